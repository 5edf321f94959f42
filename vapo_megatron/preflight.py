"""Start-up checks of a run against its launch and its files, before anything is built.

    validate_startup(cfg, world_size)   # raises ConfigError listing every problem found

vapo-train calls this first thing, on every rank, before torch.distributed starts or any model,
tokenizer, reward worker or rollout engine is built: a 32B run should fail in seconds on a typo,
not after minutes of loading. It adds to config.config_problems (values alone) what needs the
launch or the disk: the parallel layout against the world size, the model's heads and layers
(from model.hf_path/config.json) against TP/PP, batch sizes against data parallelism, lengths
against the model's context, the files each setting names, the reward function, and the
hardware the settings need. Each message names the key and what is allowed.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from vapo_megatron.config import Config, ConfigError, config_problems, problems_error

PROMPT_SUFFIXES = (".jsonl", ".json", ".parquet")


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def _allowed(values: list[int]) -> str:
    return ", ".join(map(str, values[:12])) + (", ..." if len(values) > 12 else "")


def _read_hf_config(key: str, hf_dir: str, out: list[str]) -> dict | None:
    """config.json of an HF model dir, or None (with the problem appended)."""
    path = Path(hf_dir)
    if not path.is_dir():
        out.append(f"{key}: {hf_dir} is not a directory (expected a Hugging Face model directory)")
        return None
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        out.append(f"{key}: {hf_dir} has no config.json")
        return None
    try:
        hf_cfg = json.loads(cfg_path.read_text())
    except (OSError, ValueError) as e:
        out.append(f"{key}: {cfg_path} is not readable JSON ({e})")
        return None
    if not isinstance(hf_cfg, dict):
        out.append(f"{key}: {cfg_path} must hold a JSON object")
        return None
    missing = [k for k in ("num_hidden_layers", "num_attention_heads", "hidden_size", "vocab_size", "intermediate_size")
               if not isinstance(hf_cfg.get(k), int) or isinstance(hf_cfg.get(k), bool) or hf_cfg.get(k) < 1]
    if missing:
        out.append(f"{key}: {cfg_path} lacks positive integer {', '.join(missing)}")
        return None
    import model_providers

    try:
        model_providers.family_for(hf_cfg, source=str(cfg_path))
    except ValueError as e:
        out.append(f"{key}: {e}")
    if not ((path / "model.safetensors").is_file() or (path / "model.safetensors.index.json").is_file()):
        out.append(f"{key}: {hf_dir} has no model.safetensors or model.safetensors.index.json "
                   "(weights are read from safetensors only)")
    hf_cfg["_source"] = str(cfg_path)
    return hf_cfg


def _model_vs_layout(key: str, hf_cfg: dict, cfg: Config, out: list[str]) -> None:
    tp, pp, vpp = cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.vpp
    src = hf_cfg["_source"]
    heads = hf_cfg["num_attention_heads"]
    kv = hf_cfg.get("num_key_value_heads") or heads
    for name, n in (("num_attention_heads", heads), ("num_key_value_heads", kv), ("intermediate_size", hf_cfg["intermediate_size"])):
        if tp >= 1 and n % tp:
            out.append(f"parallel.tp={tp} does not divide {name}={n} of {key} ({src}); "
                       f"allowed parallel.tp: {_allowed(_divisors(n))}")
    stages = pp * (vpp or 1)
    layers = hf_cfg["num_hidden_layers"]
    if stages >= 1 and layers % stages:
        what = f"parallel.pp * parallel.vpp = {pp} * {vpp}" if vpp else f"parallel.pp={pp}"
        out.append(f"{what} does not divide num_hidden_layers={layers} of {key} ({src}); "
                   f"allowed {'pp * vpp' if vpp else 'parallel.pp'}: {_allowed(_divisors(layers))}")
    ctx = hf_cfg.get("max_position_embeddings")
    need = cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens
    if isinstance(ctx, int) and need > ctx:
        out.append(f"data.max_prompt_tokens + rollout.max_new_tokens = {cfg.data.max_prompt_tokens} + "
                   f"{cfg.rollout.max_new_tokens} = {need} exceeds max_position_embeddings={ctx} of {key} ({src})")


def _layout_vs_world(cfg: Config, world_size: int, out: list[str]) -> int | None:
    """Checks TP*PP against the world size; returns DP (None when the layout cannot work)."""
    tp, pp = cfg.parallel.tp, cfg.parallel.pp
    if tp < 1 or pp < 1:
        return None  # already reported by config_problems
    if world_size % (tp * pp):
        out.append(f"parallel.tp * parallel.pp = {tp} * {pp} = {tp * pp} does not divide the world size {world_size} "
                   f"(ranks launched); allowed tp * pp: {_allowed(_divisors(world_size))}")
        return None
    return world_size // (tp * pp)


def _batches_vs_dp(cfg: Config, dp: int, out: list[str]) -> None:
    r, a = cfg.rollout, cfg.algo
    if a.mini_batches >= 1 and r.prompts_per_step % (dp * a.mini_batches):
        out.append(f"rollout.prompts_per_step={r.prompts_per_step} must be divisible by data-parallel size * algo.mini_batches "
                   f"= {dp} * {a.mini_batches} = {dp * a.mini_batches}: each DP rank takes whole prompt groups and "
                   "splits them into equal mini-batches")
    if cfg.sft.steps > 0 and cfg.sft.batch_size % dp:
        out.append(f"sft.batch_size={cfg.sft.batch_size} must be divisible by the data-parallel size {dp}")


def _files(cfg: Config, out: list[str]) -> None:
    for key, paths in (("data.train_files", cfg.data.train_files), ("data.eval_files", cfg.data.eval_files),
                       ("sft.files", cfg.sft.files)):
        for p in paths:
            if not os.path.exists(p):
                continue  # reported by config_problems
            if not os.path.isfile(p):
                out.append(f"{key}: {p} is not a file")
            elif not p.endswith(PROMPT_SUFFIXES):
                out.append(f"{key}: {p} has an unknown file type (allowed: {', '.join(PROMPT_SUFFIXES)})")
            elif not os.access(p, os.R_OK):
                out.append(f"{key}: {p} is not readable")
    run_dir = Path(cfg.trainer.run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        out.append(f"trainer.run_dir: {run_dir} exists and is not a directory")
    else:
        existing = next((p for p in [run_dir, *run_dir.absolute().parents] if p.exists()), None)
        if existing is not None and not os.access(existing, os.W_OK):
            out.append(f"trainer.run_dir: {run_dir} cannot be created or written ({existing} is not writable)")


def _reward(cfg: Config, out: list[str]) -> None:
    spec = cfg.reward.fn
    if spec in ("math", "exact") or spec.count(":") != 1:
        return  # builtin, or already reported
    from vapo_megatron.rewards.pool import resolve_function

    try:
        resolve_function(spec)
    except Exception as e:  # noqa: BLE001 - a user module may raise anything while importing
        out.append(f"reward.fn={spec!r}: {e}")


def _hardware(cfg: Config, cuda: bool, out: list[str]) -> None:
    if cuda:
        return
    if cfg.rollout.engine == "sglang":
        out.append("rollout.engine=sglang needs CUDA GPUs and none is visible; "
                   "allowed here: embedded (or sglang_http with rollout.sglang_urls)")
    for key, o in (("actor_optim", cfg.actor_optim), ("critic_optim", cfg.critic_optim)):
        if o.distributed_optimizer:
            out.append(f"{key}.distributed_optimizer=true needs CUDA GPUs (NCCL) and none is visible; allowed here: false")


def layout_problems(cfg: Config, world_size: int, hf_cfg: dict | None, *, key: str = "model.hf_path") -> list[str]:
    """The checks of the parallel layout alone: TP*PP against the world size, batch sizes against
    DP, and (given an HF config dict with `_source`) heads and layers against TP/PP. vapo-plan
    uses this for a launch it sizes but does not run."""
    out: list[str] = []
    dp = _layout_vs_world(cfg, world_size, out) if world_size >= 1 else None
    if world_size < 1:
        out.append(f"world size {world_size} must be >= 1")
    if dp is not None:
        _batches_vs_dp(cfg, dp, out)
    if hf_cfg is not None:
        _model_vs_layout(key, hf_cfg, cfg, out)
    return out


def startup_problems(cfg: Config, world_size: int, *, cuda: bool) -> list[str]:
    """Every problem of `cfg` for a launch of `world_size` ranks (see the module docstring)."""
    out = config_problems(cfg)
    if world_size < 1:
        out.append(f"world size {world_size} (from the launcher's environment) must be >= 1")
        return out
    dp = _layout_vs_world(cfg, world_size, out)
    if dp is not None:
        _batches_vs_dp(cfg, dp, out)
    actor_cfg = critic_cfg = None
    if cfg.model.hf_path and os.path.exists(cfg.model.hf_path):
        actor_cfg = _read_hf_config("model.hf_path", cfg.model.hf_path, out)
        if actor_cfg is not None:
            _model_vs_layout("model.hf_path", actor_cfg, cfg, out)
            if not any((Path(cfg.model.hf_path) / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
                out.append(f"model.hf_path: {cfg.model.hf_path} has no tokenizer (tokenizer.json or tokenizer_config.json)")
    if cfg.model.critic_hf_path and os.path.exists(cfg.model.critic_hf_path):
        critic_cfg = _read_hf_config("model.critic_hf_path", cfg.model.critic_hf_path, out)
        if critic_cfg is not None:
            _model_vs_layout("model.critic_hf_path", critic_cfg, cfg, out)
    if actor_cfg is not None and critic_cfg is not None and critic_cfg["vocab_size"] < actor_cfg["vocab_size"]:
        out.append(f"model.critic_hf_path has vocab_size={critic_cfg['vocab_size']} < vocab_size={actor_cfg['vocab_size']} "
                   "of model.hf_path: the critic reads the policy's token ids")
    _files(cfg, out)
    _reward(cfg, out)
    _hardware(cfg, cuda, out)
    return out


def validate_startup(cfg: Config, world_size: int, *, cuda: bool | None = None) -> None:
    """Raise one ConfigError listing every problem; cheap (reads a few small files, imports
    the user's reward module). `cuda` defaults to torch.cuda.is_available()."""
    if cuda is None:
        import torch

        cuda = torch.cuda.is_available()
    problems = startup_problems(cfg, world_size, cuda=cuda)
    if problems:
        raise problems_error(problems)


__all__ = ["ConfigError", "layout_problems", "startup_problems", "validate_startup"]
