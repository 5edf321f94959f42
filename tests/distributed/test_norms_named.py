"""Every norm of a model is the family's, whatever megatron-core's import-time defaults are (issue 43
defect 2). megatron builds a transformer block's final norm from `transformer_block.LayerNormImpl`
and the MoE block spec's local layers from `gpt_layer_specs.LNImpl`: Apex's FusedLayerNorm when
Apex imports (it asserts LayerNorm; these families use RMSNorm), TENorm when TE does. Here megatron's
globals are set as its own imports set them with Apex present, in the local world; the Apex and TE
worlds (test_apex_world.py, test_te_world.py) build the same models with the stand-ins imported."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.dist_utils import run_ranks


def _build(kind: str, sequence_parallel: bool) -> list[str]:
    from megatron.core.fusions.fused_layer_norm import FusedLayerNorm
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.transformer import transformer_block

    from tests.helpers.tiny_hf import qwen2_config, qwen3_moe_config
    from vapo_megatron.mcore import parallel
    from vapo_megatron.mcore.models import build_actor

    # What `import apex` succeeding makes of megatron's module globals.
    transformer_block.LayerNormImpl = FusedLayerNorm
    gpt_layer_specs.LNImpl = FusedLayerNorm
    tp = 2 if sequence_parallel else 1
    parallel.init_distributed(tp, 1, seed=1)
    cfg = (qwen2_config(tied=False) if kind == "qwen2" else qwen3_moe_config()).to_dict()
    model = build_actor(cfg, params_dtype=torch.float32, on_gpu=False, sequence_parallel=sequence_parallel)
    return [f"{name}: {type(m).__name__}" for name, m in model.named_modules() if "norm" in type(m).__name__.lower()]


@pytest.mark.parametrize("kind,sp", [("qwen2", False), ("qwen3_moe", False), ("qwen2", True)])
def test_every_norm_is_rmsnorm_whatever_megatrons_default(kind, sp):
    norms = run_ranks(2 if sp else 1, _build, kind, sp)[0]
    assert any(n.startswith("decoder.final_layernorm:") for n in norms), norms
    wrong = [n for n in norms if not n.endswith("RMSNorm")]
    assert not wrong, wrong
