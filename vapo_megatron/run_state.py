"""Model construction, weight sync, and the run's checkpoints (save, resume, HF export).

A checkpoint is run_dir/checkpoints/iter_NNNNNNN/ holding
    actor/   Megatron dist checkpoint: actor weights + optimizer state
    critic/  Megatron dist checkpoint: critic weights + optimizer state
    state.json          iteration counters and the prompt sampler's position
    rng/rank_R.safetensors   each rank's torch RNG state (uint8 tensor)
It is written under a temporary name, flushed, and renamed into place when complete; then the
`latest` pointer file is replaced atomically. A crash at any point leaves the previous
checkpoint as the latest; a damaged one is detected on load and the previous one is used
(docs/faults.md). Dist checkpoints load at any TP/PP layout.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Callable, TypeVar

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.api import CheckpointException

import model_providers
from model_providers.build import build_chunks
from vapo_megatron import checkpoint_io  # also installs safe_checkpoint: no checkpoint pickle runs code
from vapo_megatron import faults, parallel
from vapo_megatron.checkpoint_io import model_sharded_state
from vapo_megatron.config import Config, to_dict
from vapo_megatron.convert import write_source_files
from vapo_megatron.data.prompts import PromptSampler
from vapo_megatron.gpu_memory import free_cached_memory
from vapo_megatron.hf_import import load_hf_weights
from vapo_megatron.megatron_step import build_optimizer, wrap_ddp
from vapo_megatron.updates import TrainModel

KEEP_CHECKPOINTS = 2
T = TypeVar("T")


class CheckpointCorrupt(RuntimeError):
    """A checkpoint that cannot be resumed from; the message names it."""


@dataclass
class RunState:
    iteration: int = 0
    sft_steps_done: int = 0
    sft_finished: bool = False
    pretrain_steps_done: int = 0
    pretrain_finished: bool = False
    sampler: PromptSampler | None = field(default=None, repr=False)

    def to_json(self) -> dict:
        d = {k: v for k, v in asdict(self).items() if k != "sampler"}
        d["sampler"] = self.sampler.state_dict()
        return d


def param_dtype(cfg: Config) -> torch.dtype:
    return torch.bfloat16 if cfg.model.dtype == "bfloat16" else torch.float32


def build_models(cfg: Config, hf_cfg: dict) -> tuple[TrainModel, TrainModel]:
    """Actor from model.hf_path; critic from model.critic_hf_path or the policy's trunk with a
    fresh value head (component 1 then trains that head and trunk before RL)."""
    parallel.validate_layout(
        parallel.launcher_env()[1], cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.vpp,
        num_layers=hf_cfg["num_hidden_layers"], num_attention_heads=hf_cfg["num_attention_heads"],
        num_query_groups=hf_cfg.get("num_key_value_heads", hf_cfg["num_attention_heads"]),
    )
    actor = _build(cfg, cfg.model.hf_path, hf_cfg, critic=False)
    critic_dir = cfg.model.critic_hf_path or cfg.model.hf_path
    critic = _build(cfg, critic_dir, model_providers.load_hf_config(critic_dir), critic=True)
    return actor, critic


def _build(cfg: Config, hf_dir: str, hf_cfg: dict, *, critic: bool) -> TrainModel:
    family = model_providers.family_for(hf_cfg)
    chunks = build_chunks(hf_cfg, params_dtype=param_dtype(cfg), critic=critic, recompute=cfg.model.recompute_activations,
                          sequence_parallel=cfg.parallel.sequence_parallel)
    load_hf_weights(chunks, family, hf_cfg, hf_dir, critic=critic)
    optim = cfg.critic_optim if critic else cfg.actor_optim
    chunks = wrap_ddp(chunks, distributed_optimizer=optim.distributed_optimizer)
    optimizer = build_optimizer(chunks, optim, params_dtype=param_dtype(cfg))
    return TrainModel(chunks=chunks, optimizer=optimizer, family=family, hf_cfg=hf_cfg, vocab_size=hf_cfg["vocab_size"])


@torch.no_grad()
def start_critic_from_policy(actor: TrainModel, critic: TrainModel) -> int:
    """Copy the actor's trunk (every parameter but the LM head) into the critic, keeping the
    critic's value head: VAPO.md component 1, 'the critic starts from the policy's trunk with a
    fresh scalar value head'. Used after the warm start, whose policy is the RL starting point.
    Same layout on both models, so each rank copies its own shards. Returns tensors copied."""
    copied = 0
    for a_chunk, c_chunk in zip(actor.modules, critic.modules):
        a_params = dict(a_chunk.named_parameters())
        for name, param in c_chunk.named_parameters():
            if name.startswith("value_head"):
                continue
            if name not in a_params or a_params[name].shape != param.shape:
                raise RuntimeError(f"critic parameter {name} {tuple(param.shape)} has no counterpart in the actor")
            param.copy_(a_params[name])
            copied += 1
    for model in (actor, critic):  # the optimizers' own (fp32 main) copies follow the weights
        model.optimizer.reload_model_params()
    return copied


def _megatron_optimizers(optimizer) -> list:
    """The per-param-group megatron optimizers (a ChainedOptimizer holds several)."""
    return [o for o in getattr(optimizer, "chained_optimizers", [optimizer]) if o.optimizer is not None]


def _drop_unstepped_state(model: TrainModel) -> None:
    """Zero moments without a step count (an optimizer saved or loaded before its first step)
    are dropped, so that Adam's next step initializes them as a fresh optimizer would."""
    for opt in _megatron_optimizers(model.optimizer):
        for p_state in opt.optimizer.state.values():
            if "step" not in p_state:
                p_state.clear()


def sync_weights(actor: TrainModel, engine, *, version: int, cfg: Config) -> None:
    """Step 8: stream the actor's weights (HF names, full tensors) into the rollout engines."""
    from vapo_megatron.rollout.weight_sync import sync_weights as stream

    free_cached_memory()  # the updates' activations, before the engine takes its weights back
    stream(actor.modules, actor.family, actor.hf_cfg, engine, version=version,
           bucket_bytes=cfg.rollout.weight_sync_bucket_mb << 20)
    faults.fault_point("weight_sync")  # test-only (faults.py): the engine is ahead of the checkpoint


# ---- checkpoints -------------------------------------------------------------------------------

def _ckpt_root(cfg: Config) -> Path:
    return Path(cfg.trainer.run_dir) / "checkpoints"


def _model_state(model: TrainModel, *, loading: bool) -> dict:
    if not loading:
        # An optimizer that has not stepped yet has no state; save zero moments so that the
        # checkpoint has the keys a load asks for (megatron creates them when loading).
        for opt in _megatron_optimizers(model.optimizer):
            if opt.init_state_fn is not None:
                opt.init_state_fn(opt.optimizer, opt.config)
    state = model_sharded_state(model.modules)
    state["optimizer"] = model.optimizer.sharded_state_dict(state, is_loading=loading)
    return state


def _barrier() -> None:
    if dist.is_initialized():
        parallel.barrier()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    """Flush a directory tree's files and directories to stable storage before it is renamed
    into place: the rename is the commit, and must not reach the disk before the data does."""
    for dirpath, _, files in os.walk(root):
        for f in files:
            _fsync(Path(dirpath) / f)
        _fsync(Path(dirpath))


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.parent / f".{path.name}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _remove_leftovers(root: Path) -> None:
    """A crashed save leaves `.iter_N.tmp` (or `.old`/`.del`) behind; nothing reads them."""
    for p in root.glob(".iter_*"):
        shutil.rmtree(p, ignore_errors=True)


def save_run_state(cfg: Config, state: RunState, actor: TrainModel, critic: TrainModel, ctx, *, final: bool = False) -> Path:
    """Collective. Writes iter_N under a temporary name, flushes it, renames it into place, then
    moves `latest` to it; keeps the newest few. A crash at any point leaves `latest` naming a
    complete checkpoint (docs/faults.md)."""
    root = _ckpt_root(cfg)
    name = f"iter_{state.iteration:07d}"
    target, tmp = root / name, root / f".{name}.tmp"
    if parallel.is_rank0():
        root.mkdir(parents=True, exist_ok=True)
        _remove_leftovers(root)
        (tmp / "rng").mkdir(parents=True)
    _barrier()
    for sub, model in (("actor", actor), ("critic", critic)):
        (tmp / sub).mkdir(exist_ok=True)
        _barrier()
        checkpoint_io.write_dist_checkpoint(_model_state(model, loading=False), tmp / sub)
        _drop_unstepped_state(model)
        if parallel.is_rank0():  # hf/ + vapo.json: `vapo-convert mcore-to-hf --ckpt .../actor` works on it
            src = cfg.model.critic_hf_path if sub == "critic" and cfg.model.critic_hf_path else cfg.model.hf_path
            write_source_files(tmp / sub, model.hf_cfg, Path(src), family_name=model.family.name,
                               critic=sub == "critic", dtype=cfg.model.dtype)
        if sub == "actor":
            faults.fault_point("checkpoint")  # test-only (faults.py): a crash mid-write
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state()
    rng_file = tmp / "rng" / f"rank_{dist.get_rank()}.safetensors"
    save_file(rng, str(rng_file))
    _fsync(rng_file)  # each rank flushes what it wrote (megatron fsyncs its own .distcp files)
    _barrier()
    if parallel.is_rank0():
        meta = {"state": state.to_json(), "world_size": dist.get_world_size(), "config": to_dict(cfg), "complete": True}
        (tmp / "state.json").write_text(json.dumps(meta, indent=1))
        _fsync_tree(tmp)
        if target.exists():  # the same iteration again (after a fallback): move the old one aside first
            target.rename(root / f".{name}.old")
        os.replace(tmp, target)
        _fsync(root)
        _write_atomic(root / "latest", name + "\n")
        _fsync(root)
        older = sorted(p for p in root.glob("iter_*") if p.name < name)
        for old in older[: max(len(older) - (KEEP_CHECKPOINTS - 1), 0)]:
            dead = root / f".{old.name}.del"
            old.rename(dead)  # never a half-deleted iter_N
            shutil.rmtree(dead, ignore_errors=True)
        _remove_leftovers(root)
    _barrier()
    if final and cfg.trainer.export_hf:
        export_hf(cfg, actor, ctx)
    return target


def _candidates(root: Path) -> list[Path]:
    """Checkpoints to try, newest first: the `latest` pointer, then older complete ones."""
    found = sorted((p for p in root.glob("iter_*") if p.is_dir()), reverse=True)
    latest = root / "latest"
    if latest.exists():
        named = latest.read_text(errors="replace").strip()
        if re.fullmatch(r"iter_\d{7}", named):
            found = [root / named] + [p for p in found if p.name != named]
        elif parallel.is_rank0():
            print(f"[vapo] {latest} is damaged (holds {named[:40]!r}, not iter_NNNNNNN); ignoring it", flush=True)
    return found


def _check_complete(path: Path) -> dict:
    """The cheap checks, the same on every rank: state.json parses and names this iteration,
    both dist checkpoints have their metadata. Damage inside the tensor files shows at load."""
    if not path.is_dir():
        raise CheckpointCorrupt(f"{path} does not exist")
    try:
        meta = json.loads((path / "state.json").read_text())
        s = meta["state"]
        fields = (s["iteration"], s["sft_steps_done"], s["sft_finished"], s["pretrain_steps_done"],
                  s["pretrain_finished"], s["sampler"], meta["world_size"], meta["complete"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointCorrupt(f"{path / 'state.json'} is unreadable or incomplete ({type(e).__name__}: {e})") from None
    if fields[-1] is not True:
        raise CheckpointCorrupt(f"{path / 'state.json'}: not marked complete")
    if f"iter_{s['iteration']:07d}" != path.name:
        raise CheckpointCorrupt(f"{path / 'state.json'} records iteration {s['iteration']}, not that of {path.name}")
    for sub in ("actor", "critic"):
        if not dist_checkpointing.check_is_distributed_checkpoint(str(path / sub)):
            raise CheckpointCorrupt(f"{path / sub} is not a complete Megatron dist checkpoint (metadata.json missing or unreadable)")
    return meta


def _one_line(e: BaseException) -> str:
    """A short reason; torch DCP wraps each rank's error in a CheckpointException."""
    if isinstance(e, CheckpointException) and e.failures:
        e = next(iter(e.failures.values()))[0]
    if isinstance(e, (CheckpointCorrupt, checkpoint_io.CheckpointError)):  # already one line naming the file
        return str(e)
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[-1] if lines else ''}"


def _torch_optimizer_states(state) -> list[dict]:
    """The torch optimizer state dicts ({"state", "param_groups"}) inside a loaded megatron
    optimizer state: one for a plain optimizer, one per part of a ChainedOptimizer, nested
    under "optimizer" for the mixed-precision one."""
    if not isinstance(state, dict):
        return []
    if "state" in state and "param_groups" in state:
        return [state]
    return [s for v in state.values() for s in _torch_optimizer_states(v)]


def _load_model(ckpt: Path, model: TrainModel) -> None:
    """Weights and optimizer state of one model from its dist checkpoint."""
    loaded = checkpoint_io.load(ckpt, _model_state(model, loading=True))  # any failure is a CheckpointError
    for chunk, key in zip(model.modules, [k for k in loaded if k.startswith("model")]):
        chunk.load_state_dict(loaded[key], strict=True)
    for opt_state in _torch_optimizer_states(loaded["optimizer"]):
        if opt_state["state"] and "common_step" not in opt_state["state"]:
            # Saved before this optimizer's first step: zero moments and no step count (megatron
            # stores the step only once it is non-zero), which torch's Adam refuses to load. It
            # was a fresh optimizer; it loads as one.
            opt_state["state"] = {}
    model.optimizer.load_state_dict(loaded["optimizer"])
    _drop_unstepped_state(model)


def _rng_state(path: Path, meta: dict) -> dict | None:
    """This rank's RNG state; None when the checkpoint was written by another world size (then
    the RNG is not restored)."""
    if meta["world_size"] != dist.get_world_size():
        return None
    rng_file = path / "rng" / f"rank_{dist.get_rank()}.safetensors"
    if not rng_file.is_file():
        raise CheckpointCorrupt(f"{rng_file} is missing")
    return load_file(str(rng_file))


def _on_every_rank(step: Callable[[], T]) -> T:
    """Collective: run one step of a resume on every rank and agree on its outcome before any
    rank goes on. When it failed on some rank, it raises CheckpointCorrupt on all, with the
    first failing rank's reason. Megatron reads each rank's shards without collectives, so a
    damaged file fails only on the ranks that read it; a rank that went on alone would meet the
    others' collectives of the next load (or of the fallback) out of step."""
    result, reason = None, ""
    try:
        result = step()
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - any damage means: try an older one
        reason = _one_line(e)
    reasons = [""] * dist.get_world_size()
    parallel.all_gather_object(reasons, reason)
    bad = next((r for r in reasons if r), "")
    if bad:
        raise CheckpointCorrupt(bad)
    return result


def load_run_state(cfg: Config, actor: TrainModel, critic: TrainModel, ctx) -> RunState:
    """Resume from the newest loadable checkpoint of run_dir, or start fresh when it has none.

    A damaged checkpoint (unreadable state.json, missing metadata, a truncated or missing tensor
    file, ...) is reported by name and the next older one is tried. Every rank takes the same
    decision after each step of the load: a damaged shard may be read by one rank only. When
    checkpoints exist but none loads, the run stops rather than silently starting over."""
    state = RunState(sampler=PromptSampler(ctx.train_records, cfg.rollout.prompts_per_step, cfg.data.seed))
    root = _ckpt_root(cfg)
    candidates = _candidates(root) if root.exists() else []
    failures = []
    for path in candidates:
        try:
            meta = _on_every_rank(partial(_check_complete, path))
            for sub, model in (("actor", actor), ("critic", critic)):
                _on_every_rank(partial(_load_model, path / sub, model))
            rng = _on_every_rank(partial(_rng_state, path, meta))
        except CheckpointCorrupt as e:
            if parallel.is_rank0():
                print(f"[vapo] checkpoint {path} is damaged, falling back to an older one: {e}", flush=True)
            failures.append(f"{path.name}: {e}")
            continue
        if rng is not None:
            torch.set_rng_state(rng["cpu"])
            if "cuda" in rng and torch.cuda.is_available():
                torch.cuda.set_rng_state(rng["cuda"])
        elif parallel.is_rank0():
            print(f"[vapo] {path} was written by {meta['world_size']} ranks, not {dist.get_world_size()}: "
                  "random number generators are not restored (the run continues, not bitwise as before)", flush=True)
        s = meta["state"]
        state.iteration, state.sft_steps_done, state.sft_finished = s["iteration"], s["sft_steps_done"], s["sft_finished"]
        state.pretrain_steps_done, state.pretrain_finished = s["pretrain_steps_done"], s["pretrain_finished"]
        state.sampler.load_state_dict(s["sampler"])
        if parallel.is_rank0():
            print(f"[vapo] resumed from {path} at iteration {state.iteration}", flush=True)
        return state
    if failures:
        raise CheckpointCorrupt(
            f"no checkpoint in {root} can be loaded ({'; '.join(failures)}); "
            f"move {root} away to start the run afresh"
        )
    return state


def export_hf(cfg: Config, actor: TrainModel, ctx) -> Path:
    """Final HF export of the actor (run_dir/hf) through the conversion code."""
    from vapo_megatron.convert import export_hf_dir

    out = Path(cfg.trainer.run_dir) / "hf"
    export_hf_dir(actor.modules, actor.family, actor.hf_cfg, out, files_src=Path(cfg.model.hf_path), critic=False,
                  dtype=cfg.model.dtype)
    return out
