"""Start-up checks of a run against its launch and its files, before anything is built.

    startup_problems(cfg, world_size)   every problem found, one message each (pure Python)
    launch_problems(cfg, world_size, actor_hf, critic_hf, gpus_per_node=G)   vapo-plan's: the layout
                                        and batch against a launch, with the models' HF configs
    hardware_problems(cfg)              what the settings need of the machine (CUDA, NCCL, sgl-kernel)
    export_problems(cfg)                may the final HF export replace run_dir/hf? (in startup_problems)

vapo-train runs startup_problems first thing, on every rank, before it imports torch or
megatron-core and before torch.distributed starts or any model, tokenizer, reward worker or
rollout engine is built: a 32B run fails in seconds on a typo, not after minutes of loading.
Besides checks.py (values alone) and layout.py (the layout against the world size and the
model's heads and layers), it checks batch sizes against data parallelism, lengths against the
model's context, that each model directory has a supported config.json, weights and a tokenizer,
the data files, the run directory and the reward function. Each message names the key.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
from pathlib import Path

from vapo_megatron.config.checks import config_problems
from vapo_megatron.config.engines import ENGINES, engine_key, engine_tp, known_engine
from vapo_megatron.config.engines import KEY as ENGINE_KEY
from vapo_megatron.config.estimators import estimator_of, unknown_estimator
from vapo_megatron.config.layout import critic_layout_problems, layout_problems, own_critic_layout
from vapo_megatron.config.schema import Config

PROMPT_SUFFIXES = (".jsonl", ".json", ".parquet")


def _model(key: str, hf_dir: str, out: list[str], *, tokenizer: bool, weights: bool = True) -> dict | None:
    """config.json of an HF model dir when its family is supported, else None; every problem of
    the directory appended (an unsupported architecture, missing or truncated weights, a damaged
    tokenizer or other JSON file are all said, each naming its file)."""
    from model_providers import HFConfigError, check_supported, read_hf_config
    from model_providers.files import model_dir_problems

    try:
        hf_cfg = read_hf_config(hf_dir)
    except HFConfigError as e:
        out.append(f"{key}: {e}")
        return None
    try:
        check_supported(hf_cfg)
    except HFConfigError as e:
        out.append(f"{key}: {e}")
        hf_cfg = None
    out += [f"{key}: {p}" for p in model_dir_problems(hf_dir, tokenizer=tokenizer, weights=weights)]
    return hf_cfg


def _critic_warm_start(path: str, actor_cfg: dict | None, out: list[str]) -> dict | None:
    """critic.warm_start's problems, each one line naming the key; its model's config.json when it
    is a value model (an HF <Family>ForTokenClassification with its score head, or a Megatron critic
    checkpoint), else None. The family and vocabulary must be the policy's: the critic reads the
    policy's token ids, and its trunk's layers are the family's."""
    import json

    from model_providers import family_for
    from model_providers.files import MEGATRON_META, megatron_model_dir, tensor_shape

    key, p = "critic.warm_start", Path(path)
    if not p.exists():
        out.append(f"{key}={path} does not exist")
        return None
    if (p / "checkpoints").is_dir() or (p / "state.json").is_file() or any(p.glob("iter_*")):
        out.append(f"{key}={path} is a run or one of its checkpoints, not a model: give its critic, e.g. "
                   f"{key}=RUN_DIR/checkpoints/iter_N/critic")
        return None
    if megatron_model_dir(p):
        try:
            critic = json.loads((p / MEGATRON_META).read_text())["critic"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            out.append(f"{key}: {p / MEGATRON_META} is unreadable ({type(e).__name__}: {e})")
            return None
        if not critic:
            out.append(f"{key}={path} is a policy checkpoint ({MEGATRON_META}: critic false), not a value model: "
                       "give a run's critic (RUN_DIR/checkpoints/iter_N/critic) or an HF "
                       "<Family>ForTokenClassification directory")
            return None
        if not (p / "metadata.json").is_file():
            out.append(f"{key}={path} has no metadata.json: not a whole Megatron dist checkpoint")
        hf_cfg = _model(key, str(p / "hf"), out, tokenizer=False, weights=False)
    else:
        hf_cfg = _model(key, path, out, tokenizer=False)
        if hf_cfg is None:
            return None
        head = family_for(hf_cfg).token_classification_architecture
        labels = hf_cfg.get("num_labels", len(hf_cfg.get("id2label") or {}) or None)
        if head not in (hf_cfg.get("architectures") or []) or labels != 1:
            out.append(f"{key}={path} is not a value model: its config.json has architectures="
                       f"{hf_cfg.get('architectures')} and num_labels={labels}, a warm start needs {head} with "
                       "num_labels=1 (vapo-convert mcore-to-hf writes a run's critic so)")
            return None
        shape = tensor_shape(path, "score.weight")
        if shape != [1, hf_cfg["hidden_size"]]:
            out.append(f"{key}={path} has no value head: score.weight is "
                       f"{'absent' if shape is None else shape}, a value model has [1, {hf_cfg['hidden_size']}]")
            return None
    if hf_cfg is not None and actor_cfg is not None:
        mine, theirs = family_for(hf_cfg).name, family_for(actor_cfg).name
        if mine != theirs:
            out.append(f"{key}={path} is a {mine} model; the policy (model.hf_path) is {theirs}: a warm start takes a "
                       "value model of the policy's family")
        elif hf_cfg["vocab_size"] != actor_cfg["vocab_size"]:
            out.append(f"{key}={path} has vocab_size={hf_cfg['vocab_size']}, the policy {actor_cfg['vocab_size']}: the "
                       "critic reads the policy's token ids")
    return hf_cfg


def _context(key: str, hf_cfg: dict, cfg: Config, out: list[str]) -> None:
    ctx = hf_cfg["max_position_embeddings"] if "max_position_embeddings" in hf_cfg else None
    need = cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens
    if isinstance(ctx, int) and need > ctx:
        out.append(f"data.max_prompt_tokens + rollout.max_new_tokens = {cfg.data.max_prompt_tokens} + "
                   f"{cfg.rollout.max_new_tokens} = {need} exceeds max_position_embeddings={ctx} of {key} "
                   f"({hf_cfg['_source']})")


def batch_problems(cfg: Config, dp: int) -> list[str]:
    """Batch sizes against the data-parallel size: whole prompt groups per DP rank."""
    r, a = cfg.rollout, cfg.algo
    out = []
    if a.mini_batches >= 1 and r.prompts_per_step % (dp * a.mini_batches):
        out.append(f"rollout.prompts_per_step={r.prompts_per_step} must be divisible by data-parallel size * "
                   f"algo.mini_batches = {dp} * {a.mini_batches} = {dp * a.mini_batches}: each DP rank takes whole "
                   "prompt groups and splits them into equal mini-batches")
    if cfg.sft.steps > 0 and cfg.sft.batch_size % dp:
        out.append(f"sft.batch_size={cfg.sft.batch_size} must be divisible by the data-parallel size {dp}")
    return out


def _files(cfg: Config, out: list[str]) -> None:
    for key, paths in (("data.train_files", cfg.data.train_files), ("data.eval_files", cfg.data.eval_files),
                       ("sft.files", cfg.sft.files if cfg.sft.steps > 0 else ())):
        for p in paths:
            if not os.path.exists(p):
                continue  # reported by config_problems
            if not os.path.isfile(p):
                out.append(f"{key}: {p} is not a file")
            elif not p.endswith(PROMPT_SUFFIXES):
                out.append(f"{key}: {p} has an unknown file type (allowed: {', '.join(PROMPT_SUFFIXES)})")
            elif not os.access(p, os.R_OK):
                out.append(f"{key}: {p} is not readable")
    from vapo_megatron.runtime.atomic import can_create_in

    run_dir = Path(cfg.trainer.run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        out.append(f"trainer.run_dir: {run_dir} exists and is not a directory")
        return
    existing = next((p for p in [run_dir, *run_dir.absolute().parents] if p.exists()), None)
    # os.access: yes for root on a read-only mount
    if existing is not None and not (existing.is_dir() and can_create_in(existing)):
        why = "is not writable" if existing.is_dir() else "is a file, not a directory"
        out.append(f"trainer.run_dir: {run_dir} cannot be created or written ({existing} {why})")
        return  # the export below could not be written either: one problem, not a second about run_dir/hf
    out += export_problems(cfg)


def export_problems(cfg: Config) -> list[str]:
    """The run ends by replacing run_dir/hf with its export (atomic.commit_dir refuses to replace
    what the trainer did not write): said now, not after hours of training."""
    from vapo_megatron.runtime.atomic import TRAINER_EXPORT, TargetRefused, check_replaceable

    try:
        check_replaceable(Path(cfg.trainer.run_dir) / "hf", TRAINER_EXPORT, overwrite=True, flag=None, key="")
    except TargetRefused as e:
        return [f"trainer.run_dir: {e}: the run ends by writing its HF export there "
                "(or choose another trainer.run_dir)"]
    return []


def _reward(cfg: Config, out: list[str]) -> None:
    spec = cfg.reward.fn
    if spec in ("math", "exact") or spec.count(":") != 1:
        return  # builtin, or already reported
    from vapo_megatron.rewards.pool import resolve_function

    try:
        resolve_function(spec)
    except Exception as e:  # noqa: BLE001 - a user module may raise anything while importing
        out.append(f"reward.fn={spec!r}: {e}")


def hardware_problems(cfg: Config, *, cuda: bool | None = None, engine_flag: str | None = None,
                      deterministic_flag: str | None = None) -> list[str]:
    """What the settings need of the machine; `cuda`: whether CUDA GPUs are visible (None: torch
    says, imported only when a setting needs CUDA). `engine_flag`, `deterministic_flag`: the
    command's flags for rollout.engine and trainer.deterministic (vapo-eval's --engine and
    --deterministic), named in their place."""
    out = []
    e = known_engine(cfg)  # None: an unknown engine, which config_problems reports
    # An engine with a CPU switch (SGLang's CPU engine: SGLANG_USE_CPU_ENGINE=1, with sgl-kernel's CPU
    # build) runs without GPUs (rollout/sglang_engine.py cpu_engine).
    on_cpu = e is not None and e.cpu_env is not None and os.environ.get(e.cpu_env) == "1"
    on_gpu = e is not None and e.needs_gpu and not on_cpu
    setting = f"{engine_flag} {cfg.rollout.engine}" if engine_flag else f"{ENGINE_KEY}={cfg.rollout.engine}"
    local = [n for n, x in ENGINES.items() if not x.needs_gpu and not x.remote]  # embedded
    fallback = f"{engine_flag} {local[0]}" if engine_flag else f"{ENGINE_KEY}={local[0]}"
    if on_gpu:
        # vapo-eval's --engine offers the engines of its own processes; the trainer's also servers
        allowed = ([f"{engine_flag} {n}" for n in local] if engine_flag else
                   local + [f"{n} with rollout.{x.section}.urls" for n, x in ENGINES.items() if x.remote])
        if e.cpu_env:
            allowed.append(f"{e.label}'s CPU engine: {e.cpu_env}=1"
                           + (", with sgl-kernel's CPU build" if e.runtime == "sglang" else ""))
        out.append(f"{setting} needs CUDA GPUs and none is visible; allowed here: {allowed[0]}"
                   + (f" (or {', or '.join(allowed[1:])})" if allowed[1:] else ""))
    if on_cpu and cfg.trainer.deterministic and e.runtime == "sglang":
        # engine_kwargs passes it on as enable_deterministic_inference, which sglang 0.5.23 refuses with
        # its CPU attention backends (arg_groups/overrides.py _deterministic_attention_backend: only
        # the GPU/NPU/XPU ones of arg_groups/choices.py), and whose batch-invariant kernels need an
        # accelerator (utils/common.py get_dispatch_device_backend).
        flag = deterministic_flag or "trainer.deterministic=true"
        out.append(f"{flag} with SGLang's CPU engine (SGLANG_USE_CPU_ENGINE=1): SGLang refuses deterministic "
                   "inference with its CPU attention backend (torch_native); allowed here: "
                   f"{'without ' + deterministic_flag if deterministic_flag else 'trainer.deterministic=false'} "
                   f"(SGLang then ignores the per-sample seeds) or {fallback}")
    for key, o in (("actor_optim", cfg.actor_optim), ("critic_optim", cfg.critic_optim)):
        if o.distributed_optimizer:
            out.append(f"{key}.distributed_optimizer=true needs CUDA GPUs (NCCL) and none is visible; "
                       "allowed here: false")
    if out and cuda is None:
        import torch

        cuda = torch.cuda.is_available()
    # Without CUDA, SGLang's GPU engine is refused above already; its kernels are the next thing it
    # needs, where it runs in this process (not a server's).
    in_process_sglang = e is not None and e.runtime == "sglang" and not e.remote
    kernel = sgl_kernel_problem(setting, fallback) if in_process_sglang and (on_cpu or (on_gpu and cuda)) else None
    return ([] if cuda else out) + ([kernel] if kernel else [])


def sgl_kernel_problem(setting: str, embedded: str) -> str | None:
    """SGLang's engine in this process needs sgl-kernel (the module sgl_kernel), imported by its
    scheduler process: without it vapo-train passed its checks, built its models, and died some 30 s
    later in the scheduler (`ModuleNotFoundError: No module named 'sgl_kernel'`). Looked up, not
    imported (find_spec runs none of its code). On the GPU it is PyPI's sglang-kernel, which sglang
    requires (named with sglang's own pin); SGLang's CPU engine needs its CPU build, which no registry
    publishes (docs/training.md, "SGLang on a CPU"). `setting`: rollout.engine=sglang or vapo-eval's
    --engine sglang; `embedded`: the setting that needs neither."""
    if importlib.util.find_spec("sgl_kernel") is not None:
        return None
    if os.environ.get("SGLANG_USE_CPU_ENGINE") == "1":
        return (f"{setting} with SGLang's CPU engine (SGLANG_USE_CPU_ENGINE=1) needs sgl-kernel's CPU build "
                "(the module sgl_kernel), which is not installed and no package registry publishes (PyPI's "
                "sglang-kernel is a CUDA build): build it from SGLang's source (sgl-kernel, its CPU extension), or "
                f"use {embedded} on a CPU (docs/training.md, 'SGLang on a CPU')")
    try:
        pins = [r.split(";")[0].strip() for r in importlib.metadata.requires("sglang") or []
                if r.lower().replace("_", "-").startswith("sglang-kernel")]
    except importlib.metadata.PackageNotFoundError:
        pins = []
    wanted = f"{pins[0]}, which sglang requires" if pins else "sglang-kernel"
    return (f"{setting} needs sgl-kernel (the module sgl_kernel: PyPI's {wanted}), which is not installed: "
            "pip install -e '.[gpu]' installs it with sglang")


def _sglang_moe_problems(key: str, hf_cfg: dict, engine: str) -> list[str]:
    """What SGLang 0.5.23's Qwen3-MoE would silently get wrong (docs/weight_sync.md): it builds
    every layer with experts (ignores mlp_only_layers / decoder_sparse_step), so a dense layer's
    weights are dropped, and it always has its own lm_head (ignores tie_word_embeddings), which
    the sync never sends for a tied model. Both would leave engine weights unset, unnoticed."""
    from model_providers.family import tied_embeddings
    from model_providers.qwen3_moe import moe_layer_pattern

    out, src = [], hf_cfg["_source"]
    dense = [i for i, moe in enumerate(moe_layer_pattern(hf_cfg)) if not moe]
    if dense:
        out.append(f"rollout.engine={engine}: {key} ({src}) has dense layers {dense} (mlp_only_layers / "
                   "decoder_sparse_step), which SGLang 0.5.23's Qwen3-MoE does not build; use rollout.engine=embedded")
    if tied_embeddings(hf_cfg):
        out.append(f"rollout.engine={engine}: {key} ({src}) has tie_word_embeddings=true, which SGLang 0.5.23's "
                   "Qwen3-MoE ignores (its lm_head would never be synced); use rollout.engine=embedded")
    return out


def moe_problems(cfg: Config, models: list[tuple[str, dict | None]]) -> list[str]:
    """Mixture-of-experts settings that megatron-core would refuse only mid-run, routing replay
    asked for a dense policy (rollout.routing_replay=true: a dense model has no routes to replay),
    and routing replay with partial rollout (a response continued over rounds has no whole routes)."""
    out = []
    for key, hf_cfg in models:
        moe = hf_cfg is not None and any(k in hf_cfg and hf_cfg[k] for k in ("num_experts", "num_local_experts"))
        if key == "model.hf_path" and hf_cfg is not None and not moe and cfg.rollout.routing_replay:
            out.append(f"rollout.routing_replay=true: {key} ({hf_cfg['_source']}) is a dense model, which routes no "
                       "token through experts: set rollout.routing_replay=null (on for mixture-of-experts models only)")
        replay = cfg.rollout.routing_replay
        if key == "model.hf_path" and moe and cfg.rollout.partial.enabled and replay is not False:
            out.append(f"rollout.partial.enabled=true with rollout.routing_replay={'true' if replay else 'null'}: "
                       f"{key} ({hf_cfg['_source']}) is a mixture-of-experts model, whose routes the engine records "
                       "per generate call, not for a response continued over rounds: set rollout.routing_replay=false "
                       "or rollout.partial.enabled=false")
        engine = known_engine(cfg)
        if moe and engine is not None and engine.runtime == "sglang":  # SGLang's model code, here or a server's
            out += _sglang_moe_problems(key, hf_cfg, cfg.rollout.engine)
        # megatron's MoELayer.forward raises in training when TP > 1 without sequence parallelism.
        # (A critic at its own layout: critic_layout_problems, at the critic's TP.)
        if moe and cfg.parallel.tp > 1 and not cfg.parallel.sequence_parallel \
                and (key == "model.hf_path" or not own_critic_layout(cfg)):
            out.append(f"parallel.sequence_parallel=false with parallel.tp={cfg.parallel.tp}: {key} "
                       f"({hf_cfg['_source']}) is a mixture-of-experts model, which megatron-core trains at TP > 1 "
                       "only with sequence parallelism (set parallel.sequence_parallel=true)")
    return out


def launch_problems(cfg: Config, world_size: int, actor_hf: dict, critic_hf: dict, *, gpus_per_node: int) -> list[str]:
    """vapo-plan's checks of a config against a launch of `world_size` GPUs, `gpus_per_node` to a
    node, for the models' HF configs (critic_hf is actor_hf unless the critic has its own): the
    layout (layout_problems, for the critic's heads and experts too when it has its own model),
    the MoE settings, the batch sizes against DP, and the colocated engine's TP against the node
    and the heads. One message per problem (vapo-plan for one config, and every layout
    vapo-plan --search considers)."""
    p = cfg.parallel
    out = []
    layout = layout_problems(world_size, p.tp, p.pp, p.vpp, model=actor_hf, ep=p.ep)
    if critic_hf is not actor_hf and not own_critic_layout(cfg):  # its own model at the actor's layout: split too
        critic = layout_problems(world_size, p.tp, p.pp, p.vpp, model=critic_hf, model_key="model.critic_hf_path",
                                 ep=p.ep)
        layout += [msg for msg in critic if msg not in layout]  # the world-size ones are said once
    out += layout
    out += moe_problems(cfg, [("model.hf_path", actor_hf)] + ([("model.critic_hf_path", critic_hf)]
                                                              if critic_hf is not actor_hf else []))
    if critic_hf is not None:
        out += critic_layout_problems(cfg, world_size, critic_hf,
                                      "model.critic_hf_path" if critic_hf is not actor_hf else "model.hf_path")
    if not layout:
        out += batch_problems(cfg, world_size // (p.tp * p.pp))
    tp = engine_tp(cfg) if known_engine(cfg) else None
    if tp is None or tp < 1:  # not colocated; an unknown engine or tp < 1: config_problems says so
        return out
    key = engine_key(cfg, "tp")
    # An engine takes a block of tp consecutive ranks: it stays within a node only when tp divides
    # the node's GPUs (7 GPUs a node: a TP=2 engine of ranks 6 and 7 would span two nodes).
    if world_size % tp or tp > gpus_per_node or (world_size > gpus_per_node and gpus_per_node % tp):
        out.append(f"{key}={tp} must divide the {world_size} GPUs and the {gpus_per_node} GPUs of each node "
                   "(a colocated engine uses GPUs of its own node)")
    if actor_hf["num_attention_heads"] % tp:
        out.append(f"{key}={tp} does not divide num_attention_heads="
                   f"{actor_hf['num_attention_heads']} ({actor_hf['_source']})")
    return out


def startup_problems(cfg: Config, world_size: int) -> list[str]:
    """Every problem of `cfg` for a launch of `world_size` ranks (see the module docstring)."""
    out = config_problems(cfg)
    m = cfg.model
    actor_cfg = (_model("model.hf_path", m.hf_path, out, tokenizer=True) if m.hf_path and os.path.exists(m.hf_path)
                 else None)
    critic_cfg, critic_key = None, "model.critic_hf_path"
    if m.critic_hf_path and os.path.exists(m.critic_hf_path):
        critic_cfg = _model("model.critic_hf_path", m.critic_hf_path, out, tokenizer=False)
    if cfg.critic.warm_start:
        critic_cfg, critic_key = _critic_warm_start(cfg.critic.warm_start, actor_cfg, out), "critic.warm_start"
    p = cfg.parallel
    out += layout_problems(world_size, p.tp, p.pp, p.vpp, model=actor_cfg, ep=p.ep)
    if critic_cfg is not None and not own_critic_layout(cfg):
        critic = layout_problems(world_size, p.tp, p.pp, p.vpp, model=critic_cfg, model_key=critic_key, ep=p.ep)
        out += [msg for msg in critic if msg not in out]  # the world-size ones are said once
    out += moe_problems(cfg, [("model.hf_path", actor_cfg), (critic_key, critic_cfg)])
    if not unknown_estimator(cfg.algo.estimator) and estimator_of(cfg).needs_critic:
        own = critic_cfg is not None or cfg.critic.warm_start or m.critic_hf_path
        out += critic_layout_problems(cfg, world_size, critic_cfg if own else actor_cfg,
                                      critic_key if own else "model.hf_path")
    if world_size >= 1 and p.tp >= 1 and p.pp >= 1 and world_size % (p.tp * p.pp) == 0:
        out += batch_problems(cfg, world_size // (p.tp * p.pp))
    if actor_cfg is not None:
        _context("model.hf_path", actor_cfg, cfg, out)
    if actor_cfg is not None and critic_cfg is not None and critic_key == "model.critic_hf_path" \
            and critic_cfg["vocab_size"] < actor_cfg["vocab_size"]:
        out.append(f"model.critic_hf_path has vocab_size={critic_cfg['vocab_size']} < "
                   f"vocab_size={actor_cfg['vocab_size']} of model.hf_path: the critic reads the policy's token ids")
    _files(cfg, out)
    _reward(cfg, out)
    return out


__all__ = ["PROMPT_SUFFIXES", "batch_problems", "export_problems", "hardware_problems", "launch_problems",
           "moe_problems", "sgl_kernel_problem", "startup_problems"]
