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

import pytest
import torch

from tests.helpers.dist_utils import run_ranks

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
    if kind == "te":
        from tests.doubles.te.transformer_engine.pytorch.optimizers.fused_adam import FusedAdam
    else:
        from tests.doubles.apex.apex.optimizers.fused_adam import FusedAdam
    mo.Adam, mo.USING_PYTORCH_OPTIMIZER = FusedAdam, False
    do.Adam, do.HAVE_APEX_OR_TE = FusedAdam, True
    do.USING_TE_OPTIMIZER, do.USING_APEX_OPTIMIZER = kind == "te", kind == "apex"


def _model(hf_dir: str, distributed: bool):
    from model_providers import family_for
    from model_providers.registry import read_hf_config
    from vapo_megatron.config import OptimConfig
    from vapo_megatron.mcore.model import TrainModel, wrap_ddp
    from vapo_megatron.mcore.models import build_actor
    from vapo_megatron.mcore.optimizer import build_optimizer

    hf_cfg = read_hf_config(hf_dir)
    torch.manual_seed(0)
    chunks = wrap_ddp([build_actor(hf_cfg, params_dtype=torch.float32)], distributed_optimizer=distributed)
    optim = OptimConfig(lr=1e-2, weight_decay=0.1, distributed_optimizer=distributed)
    return TrainModel(chunks=chunks, optimizer=build_optimizer(chunks, optim, params_dtype=torch.float32),
                      scheduler=None, family=family_for(hf_cfg), hf_cfg=hf_cfg, hf_dir=hf_dir, critic=False,
                      dtype="float32")


def _step(model, seed: int) -> None:
    from vapo_megatron.mcore.optimizer import optimizer_step

    ids = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(seed))
    chunk = model.chunks[0]
    chunk.zero_grad_buffer()
    model.optimizer.zero_grad()
    chunk(ids, torch.arange(12).expand(2, 12), None).float().square().mean().backward()
    assert optimizer_step(model.optimizer, model.chunks, loss_finite=True)[0]


def _state(model) -> dict[str, torch.Tensor]:
    """Every parameter and every Adam moment, by name."""
    from vapo_megatron.checkpoint.model_state import optimizer_moments

    out = {f"param/{n}": p.detach().clone() for n, p in model.modules[0].named_parameters()}
    return out | {f"adam/{k}": v.clone() for k, v in optimizer_moments(model).items()}


def _same(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), f"{what}: {sorted(a.keys() ^ b.keys())[:5]}"
    bad = [k for k in a if not torch.equal(a[k], b[k])]
    assert not bad, f"{what}: {len(bad)} tensors differ, e.g. {[(k, a[k].flatten()[:3], b[k].flatten()[:3]) for k in bad[:3]]}"


def _round_trips(kind: str, distributed: bool, hf_dir: str, tmp: str) -> None:
    from pathlib import Path

    from vapo_megatron.checkpoint.model_state import load_model_state, save_model_state
    from vapo_megatron.mcore import parallel

    _use_adam(kind)
    parallel.init_distributed(1, 1, seed=3)
    # A save after two steps, then a resume into a fresh model: moments intact on both sides.
    run, twin = _model(hf_dir, distributed), _model(hf_dir, distributed)
    for m in (run, twin):
        _step(m, 1), _step(m, 2)
    before = _state(run)
    assert any(k.startswith("adam/") and v.abs().sum() > 0 for k, v in before.items()), "no moments to check"
    save_model_state(run, Path(tmp) / "stepped")
    _same(before, _state(run), "the saving model after its save")
    resumed = _model(hf_dir, distributed)
    load_model_state(resumed, Path(tmp) / "stepped")
    _same(before, _state(resumed), "the resumed model")
    for m in (run, resumed, twin):
        _step(m, 3)
    _same(_state(twin), _state(run), "the saving model one step later")
    _same(_state(twin), _state(resumed), "the resumed model one step later")
    # A save before the first step (a stop during value pretraining): loads as a fresh optimizer.
    fresh, twin = _model(hf_dir, distributed), _model(hf_dir, distributed)
    save_model_state(fresh, Path(tmp) / "unstepped")
    resumed = _model(hf_dir, distributed)
    load_model_state(resumed, Path(tmp) / "unstepped")
    for m in (fresh, resumed, twin):
        _step(m, 4)
    _same(_state(twin), _state(fresh), "saved before its first step, then stepped")
    _same(_state(twin), _state(resumed), "resumed from a save before the first step, then stepped")


@pytest.mark.parametrize("case", list(CASES))
def test_adam_state_survives_save_and_resume(case, tmp_path):
    from tests.helpers.tiny_hf import save_tiny

    kind, distributed = CASES[case]
    save_tiny(tmp_path / "hf", kind="qwen2")
    run_ranks(1, _round_trips, kind, distributed, str(tmp_path / "hf"), str(tmp_path))
