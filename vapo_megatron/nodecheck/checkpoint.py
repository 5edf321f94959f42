"""vapo-check's checkpoint checks (issue 43): Adam's state through a save and a resume, with
whichever Adam megatron-core picks on this node (TE's FusedAdam when Transformer Engine imports,
Apex's when Apex does, torch's AdamW otherwise), compared bitwise with a twin that never saved.

    adam_resume          two steps, save, resume into a fresh model: parameters and Adam's moments
                         equal before and after, on both models, and one step later equal the twin's
                         (the plain optimizer and the distributed one)
    save_before_update   a save before the first step (a stop during value pretraining) and its
                         resume: the next step equals a fresh optimizer's (the distributed optimizer)

The suite runs round_trips() on the CPU with each library's Adam.
"""

from __future__ import annotations

from pathlib import Path

import torch


def build(hf_cfg: dict, hf_dir: Path, *, distributed: bool, dtype: torch.dtype):
    from model_providers import family_for
    from vapo_megatron.config import OptimConfig
    from vapo_megatron.mcore.model import TrainModel, wrap_ddp
    from vapo_megatron.mcore.models import build_actor
    from vapo_megatron.mcore.optimizer import build_optimizer

    torch.manual_seed(0)
    chunks = wrap_ddp([build_actor(hf_cfg, params_dtype=dtype)], distributed_optimizer=distributed)
    optim = OptimConfig(lr=1e-2, weight_decay=0.1, distributed_optimizer=distributed)
    return TrainModel(chunks=chunks, optimizer=build_optimizer(chunks, optim, params_dtype=dtype), scheduler=None,
                      family=family_for(hf_cfg), hf_cfg=hf_cfg, hf_dir=hf_dir, critic=False,
                      dtype=str(dtype).removeprefix("torch."))


def train_step(model, seed: int) -> None:
    from vapo_megatron.mcore.optimizer import optimizer_step

    chunk = model.chunks[0]
    device = next(chunk.parameters()).device
    ids = torch.randint(0, model.vocab_size, (2, 12), generator=torch.Generator().manual_seed(seed)).to(device)
    chunk.zero_grad_buffer()
    model.optimizer.zero_grad()
    chunk(ids, torch.arange(12, device=device).expand(2, 12), None).float().square().mean().backward()
    assert optimizer_step(model.optimizer, model.chunks, loss_finite=True)[0], "the optimizer step was skipped"


def snapshot(model) -> dict[str, torch.Tensor]:
    """Every parameter and every optimizer state tensor, by name (on the CPU)."""
    from vapo_megatron.checkpoint.model_state import optimizer_moments

    out = {f"param/{n}": p.detach().cpu().clone() for n, p in model.modules[0].named_parameters()}
    return out | {f"adam/{k}": v.cpu() for k, v in optimizer_moments(model).items()}


def differences(a: dict, b: dict) -> list[str]:
    return sorted(a.keys() ^ b.keys()) + [k for k in a.keys() & b.keys() if not torch.equal(a[k], b[k])]


def round_trips(hf_cfg: dict, work: Path, *, distributed: bool, dtype: torch.dtype) -> dict[str, list[str]]:
    """{what was compared: the tensors that differ} for both round trips ([] everywhere: PASS)."""
    from vapo_megatron.checkpoint.model_state import load_model_state, save_model_state

    out = {}
    run, twin = (build(hf_cfg, work, distributed=distributed, dtype=dtype) for _ in range(2))
    for m in (run, twin):
        train_step(m, 1), train_step(m, 2)
    before = snapshot(run)
    if not any(k.startswith("adam/") and v.abs().sum() > 0 for k, v in before.items()):
        out["Adam has moments after two steps"] = ["none found"]
    save_model_state(run, work / "stepped")
    out["the saving model after its save"] = differences(before, snapshot(run))
    resumed = build(hf_cfg, work, distributed=distributed, dtype=dtype)
    load_model_state(resumed, work / "stepped")
    out["the resumed model"] = differences(before, snapshot(resumed))
    for m in (run, resumed, twin):
        train_step(m, 3)
    out["the saving model one step later"] = differences(snapshot(twin), snapshot(run))
    out["the resumed model one step later"] = differences(snapshot(twin), snapshot(resumed))
    fresh, twin = (build(hf_cfg, work, distributed=distributed, dtype=dtype) for _ in range(2))
    save_model_state(fresh, work / "unstepped")
    resumed = build(hf_cfg, work, distributed=distributed, dtype=dtype)
    load_model_state(resumed, work / "unstepped")
    for m in (fresh, resumed, twin):
        train_step(m, 4)
    out["saved before its first step, then stepped"] = differences(snapshot(twin), snapshot(fresh))
    out["resumed from a save before the first step, then stepped"] = differences(snapshot(twin), snapshot(resumed))
    return out


def check_checkpoint(dtype: torch.dtype, preset_name: str, work: Path) -> list[tuple[str, str, str]]:
    from model_providers.presets import preset

    hf_cfg = preset(preset_name)
    lines = []
    for name, distributed in (("adam_resume", False), ("save_before_update", True)):
        sub = work / name
        sub.mkdir(parents=True, exist_ok=True)
        found = round_trips(hf_cfg, sub, distributed=distributed, dtype=dtype)
        model = build(hf_cfg, sub, distributed=distributed, dtype=dtype)
        adam = type(model.optimizer.chained_optimizers[0].optimizer if hasattr(model.optimizer, "chained_optimizers")
                    else model.optimizer.optimizer)
        bad = {k: v for k, v in found.items() if v}
        detail = (f"{adam.__module__}.{adam.__name__}, {'distributed' if distributed else 'plain'} optimizer, {dtype}: "
                  + ("bitwise equal to a twin that never saved, moments included" if not bad else
                     "; ".join(f"{k}: {len(v)} differ (e.g. {v[0]})" for k, v in bad.items())))
        lines.append((name, "PASS" if not bad else "FAIL", detail))
    return lines


__all__ = ["check_checkpoint", "round_trips"]
