"""Each rollout engine's record: its facts (config/engines.py ENGINES), how it is built, and what
GPU memory it takes on the trainer's GPUs.

    record_of(cfg).build(cfg, with_weights=..., routes=..., synced=...)   rollout/generator.py build_engine
    record_of(cfg).share(cfg, gpu_bytes)                                  its static share of one GPU
    record_of(cfg).gpu_memory(cfg, gpu_bytes=, actor_params=, actor_hf=)  share, weights, KV cache per GPU

vapo-plan (sizing/plan.py), its step-time inputs (sizing/step_config.py) and vapo-train's start-up
check of the share (sizing/plan.py resident_rollout_problem) ask gpu_memory and share; an engine
that is not colocated takes none of the trainer's GPU memory (NO_MEMORY). The builders import the
engines' modules when called: this module is pure Python, vapo-plan imports it without torch's
distributed machinery.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from model_providers.table import head_dim, query_groups
from vapo_megatron.config.engines import ENGINES, Engine, engine_of
from vapo_megatron.config.schema import Config

if TYPE_CHECKING:
    from vapo_megatron.rollout.base import RolloutEngine


@dataclass(frozen=True)
class EngineMemory:
    """What a colocated engine holds on each of the trainer's GPUs while it generates (bytes)."""

    share: int      # its static share: weights + KV cache (it releases all of it while the trainer trains)
    weights: int    # its copy of the actor's weights, inside the share
    kv_tokens: int  # tokens of KV cache per engine (every engine rank holds its part of each token)
    per_token: int  # KV-cache bytes per token on one GPU (0: no engine)

    @property
    def kv_cache(self) -> int:
        """The share less the weights (negative: the weights do not fit in the share)."""
        return self.share - self.weights


NO_MEMORY = EngineMemory(share=0, weights=0, kv_tokens=0, per_token=0)


def _no_share(cfg: Config, gpu_bytes: int) -> int:
    return 0


def _no_memory(cfg: Config, *, gpu_bytes: int, actor_params: int, actor_hf: dict) -> EngineMemory:
    return NO_MEMORY


def sglang_kv_bytes_per_token(hf_cfg: dict, *, tp: int, dtype_bytes: int = 2) -> int:
    """SGLang's KV cache per token on one GPU: K and V of every layer, the rank's share of the KV
    heads (replicated when the engine's TP exceeds their number), bf16."""
    return 2 * hf_cfg["num_hidden_layers"] * max(1, query_groups(hf_cfg) // tp) * head_dim(hf_cfg) * dtype_bytes


def _sglang_share(cfg: Config, gpu_bytes: int) -> int:
    return int(cfg.rollout.sglang.mem_fraction * gpu_bytes)  # SGLang's mem_fraction_static


def _sglang_memory(cfg: Config, *, gpu_bytes: int, actor_params: int, actor_hf: dict) -> EngineMemory:
    """SGLang sizes its KV cache as its share minus its weights: the actor's parameters in bf16 over
    the engine's TP, per GPU; rollout.sglang.max_total_tokens caps the tokens whatever the share."""
    s = cfg.rollout.sglang
    share = _sglang_share(cfg, gpu_bytes)
    weights = actor_params * 2 // s.tp
    per_token = sglang_kv_bytes_per_token(actor_hf, tp=s.tp)
    tokens = max(0, share - weights) // per_token
    if s.max_total_tokens is not None:
        tokens = min(tokens, s.max_total_tokens)
    return EngineMemory(share=share, weights=weights, kv_tokens=tokens, per_token=per_token)


def _build_embedded(cfg: Config, *, with_weights: bool, routes, synced: bool) -> RolloutEngine:
    """transformers in this process (it always records a MoE model's routes: `routes` unused)."""
    from transformers import AutoConfig

    from vapo_megatron.mcore import parallel
    from vapo_megatron.mcore.dtypes import torch_dtype
    from vapo_megatron.rollout.embedded import EmbeddedEngine

    dtype, device = torch_dtype(cfg.model.dtype), str(parallel.device())
    if not with_weights:
        return EmbeddedEngine.from_hf_config(AutoConfig.from_pretrained(cfg.model.hf_path), dtype=dtype, device=device)
    return EmbeddedEngine.from_pretrained(cfg.model.hf_path, dtype=dtype, device=device)


def _build_sglang(cfg: Config, *, with_weights: bool, routes, synced: bool) -> RolloutEngine:
    """Collective: one colocated engine per block of rollout.sglang.tp ranks (SGLangEngine.colocated)."""
    from vapo_megatron.rollout.sglang_engine import SGLangEngine

    s = cfg.rollout.sglang
    return SGLangEngine.colocated(model_path=cfg.model.hf_path, tp_size=s.tp, mem_fraction=s.mem_fraction,
                                  dtype=cfg.model.dtype, seed=cfg.trainer.seed,
                                  deterministic=cfg.trainer.deterministic, routes=routes,
                                  max_total_tokens=s.max_total_tokens,
                                  load_format="dummy" if synced else "auto")


def _build_sglang_http(cfg: Config, *, with_weights: bool, routes, synced: bool) -> RolloutEngine:
    """A server of rollout.sglang_http.urls per DP rank (round robin); its TP asked of it."""
    from vapo_megatron.mcore import parallel
    from vapo_megatron.rollout.sglang_engine import SGLangEngine
    from vapo_megatron.rollout.sglang_http import HttpEngine

    urls = cfg.rollout.sglang_http.urls
    i = parallel.dp_rank() % len(urls)
    http = HttpEngine(urls[i])
    tp = http.server_tp_size(f"rollout.sglang_http.urls[{i}]", routes=routes is not None)  # refuses a bad server
    return SGLangEngine(http, engine_tp=tp, routes=routes)


@dataclass(frozen=True)
class EngineRecord:
    engine: Engine  # the facts (config/engines.py): section, colocated, needs a GPU, ...
    # (cfg, *, with_weights, routes, synced) -> the engine; on the ranks that hold one: every rank of a
    # colocated engine (collective), else each replica's first rank (rollout/generator.py build_engine).
    # routes: the routed experts' shape to record (routing replay), or None.
    build: Callable[..., RolloutEngine]
    share: Callable[[Config, int], int] = _no_share  # (cfg, gpu_bytes): its static share of one GPU
    # (cfg, *, gpu_bytes, actor_params, actor_hf) -> EngineMemory per GPU; actor_params: the actor's
    # parameter count (the whole model), actor_hf its HF config.
    gpu_memory: Callable[..., EngineMemory] = _no_memory


RECORDS: dict[str, EngineRecord] = {r.engine.name: r for r in (
    EngineRecord(ENGINES["embedded"], build=_build_embedded),
    EngineRecord(ENGINES["sglang"], build=_build_sglang, share=_sglang_share, gpu_memory=_sglang_memory),
    EngineRecord(ENGINES["sglang_http"], build=_build_sglang_http),
)}


def record_of(cfg: Config) -> EngineRecord:
    """The record of cfg.rollout.engine (an unknown name: config/engines.py's ConfigError)."""
    return RECORDS[engine_of(cfg).name]


__all__ = ["NO_MEMORY", "RECORDS", "EngineMemory", "EngineRecord", "record_of", "sglang_kv_bytes_per_token"]
