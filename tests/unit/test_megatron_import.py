"""megatron-core imported without torch.compile at import on a machine without CUDA
(vapo_megatron/mcore/megatron_import.py): nothing of torch._inductor is loaded by the trainer's
modules, torch.compile is torch's own again afterwards, wandb is not imported by megatron's timers
but importable after, and megatron's kernels compute what their
formula says. In a fresh interpreter: the property is about what an import does."""

from __future__ import annotations

import subprocess
import sys

from tests.helpers.train_runs import ROOT

PROBE = """
import sys, torch
assert not torch.cuda.is_available()
real = torch.compile
from vapo_megatron.mcore.megatron_import import import_megatron
assert import_megatron() is True
import vapo_megatron.trainer.trainer, vapo_megatron.weights.convert, vapo_megatron.sizing.plan  # the commands' modules
import megatron.core.transformer.moe.moe_layer, megatron.core.dist_checkpointing  # loaded after the import
from megatron.core import jit
from megatron.core.fusions.fused_bias_swiglu import bias_swiglu, swiglu
inductor = sorted(m for m in sys.modules
                  if m.startswith("torch._inductor.compile_fx") or m == "torch._dynamo.convert_frame")
assert not inductor, inductor
assert torch.compile is real, "torch.compile was not restored"
assert jit.jit_fuser is jit.noop_decorator
y, b = torch.randn(3, 8, dtype=torch.float64), torch.randn(8, dtype=torch.float64)
a, g = (y + b).chunk(2, dim=-1)
assert torch.allclose(bias_swiglu(y, b), torch.nn.functional.silu(a) * g)
a, g = y.chunk(2, dim=-1)
assert torch.allclose(swiglu(y), a * torch.sigmoid(a) * g)
assert import_megatron() is False  # imported already: nothing changes
# wandb was hidden from megatron's timers (its fallback None) and is importable again, unloaded so far
import megatron.core.timers
assert "wandb" not in sys.modules and megatron.core.timers.wandb is None
import wandb
assert wandb.__name__ == "wandb" and sys.modules["wandb"] is wandb
print("ok")
"""


def test_megatron_imports_without_compiling_and_its_kernels_compute_their_formula():
    proc = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]
