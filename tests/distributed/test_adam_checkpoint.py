"""Adam's state through a checkpoint, for every Adam megatron-core may pick (issue 43 defects 1, 4).

megatron-core uses TE's FusedAdam whenever Transformer Engine imports, Apex's when only Apex does,
torch's AdamW otherwise (megatron/core/optimizer/__init__.py). The fused ones keep the step count
per param GROUP; torch's per parameter. The checkpoint code once knew only torch's layout and
cleared every state without a per-parameter step at each save and load: on every GPU node each
checkpoint wiped Adam's moments (silently), so a resume no longer matched the uninterrupted run.

Each case below is one process in the local world, with megatron's choice of Adam swapped for the
library's test double (tests/doubles/*/optimizers/fused_adam.py) the way megatron's import would
have chosen it; tests/distributed/test_te_world.py and test_apex_world.py run the same paths with
the libraries' stand-ins imported for real. References: the same model trained without a save
(the twin), compared bitwise, Adam's moments included."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.dist_utils import run_ranks

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

CASES = {  # name: (megatron's Adam, distributed optimizer)
    "torch": ("torch", False),
    "te": ("te", False),
    "apex": ("apex", False),
    "torch-distributed": ("torch", True),
    "te-distributed": ("te", True),
}


def _use_adam(kind: str) -> None:
    """megatron's module-level choice of Adam, as its imports would make it with TE or Apex present."""
    import megatron.core.optimizer as mo
    import megatron.core.optimizer.distrib_optimizer as do

    if kind == "torch":
        return
    # The double's own file, without importing its package (which imports the whole library double
    # by its real name, as the library does: that takes the library's world, tests/helpers/worlds.py).
    doubles = Path(__file__).resolve().parents[1] / "doubles"
    path = {"te": doubles / "te/transformer_engine/pytorch/optimizers/fused_adam.py",
            "apex": doubles / "apex/apex/optimizers/fused_adam.py"}[kind]
    spec = importlib.util.spec_from_file_location(f"{kind}_fused_adam_double", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    FusedAdam = module.FusedAdam
    mo.Adam, mo.USING_PYTORCH_OPTIMIZER = FusedAdam, False
    do.Adam, do.HAVE_APEX_OR_TE = FusedAdam, True
    do.USING_TE_OPTIMIZER, do.USING_APEX_OPTIMIZER = kind == "te", kind == "apex"


def _round_trips(kind: str, distributed: bool, tmp: str) -> dict[str, list[str]]:
    from pathlib import Path

    from gpu_check_checkpoint import round_trips  # scripts/: the same checks gpu_check runs on a node

    from model_providers.presets import preset
    from vapo_megatron.mcore import parallel

    _use_adam(kind)
    parallel.init_distributed(1, 1, seed=3)
    return round_trips(preset("tiny-qwen2"), Path(tmp), distributed=distributed, dtype=torch.float32)


@pytest.mark.parametrize("case", list(CASES))
def test_adam_state_survives_save_and_resume(case, tmp_path):
    kind, distributed = CASES[case]
    found = run_ranks(1, _round_trips, kind, distributed, str(tmp_path))[0]
    assert len(found) == 6, found  # six comparisons (a seventh entry says Adam had no moments to compare)
    assert not {what: bad for what, bad in found.items() if bad}


def _layout_problems(kind: str) -> list:
    from pathlib import Path

    from gpu_check_checkpoint import build

    from model_providers.presets import preset
    from vapo_megatron.checkpoint.model_state import distributed_optimizer_format, resume_layout_problem
    from vapo_megatron.mcore import parallel

    _use_adam(kind)
    parallel.init_distributed(1, 1, seed=3)
    model = build(preset("tiny-qwen2"), Path("."), distributed=True, dtype=torch.float32)
    return [distributed_optimizer_format(model), resume_layout_problem(model, {"tp": 2, "pp": 1}, {"tp": 1, "pp": 1}),
            resume_layout_problem(model, {"tp": 1, "pp": 1}, {"tp": 1, "pp": 1})]


@pytest.mark.parametrize("kind", ["torch", "te"])
def test_a_layout_change_the_optimizer_state_cannot_take_is_refused_before_loading(kind):
    """The distributed optimizer's state with torch's Adam loads at the saved TP/PP only (megatron
    0.19.2's fully reshardable load fails on its per-parameter step); with the fused Adams it goes
    anywhere. The checkpoint manager raises the line as a CheckpointMismatch: a stop, not a fallback."""
    fmt, moved, same = run_ranks(1, _layout_problems, kind)[0]
    assert same is None
    if kind == "torch":
        assert fmt == "dp_reshardable" and "parallel.tp=2 -> 1" in moved and "resume at the saved layout" in moved
    else:
        assert fmt == "fully_reshardable" and moved is None
