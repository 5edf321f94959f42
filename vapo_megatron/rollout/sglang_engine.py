"""SGLang rollout engines colocated with the trainer (GPU path).

One `sglang.Engine` per trainer TP group ("engine group"): engine TP rank i runs on GPU
`base_gpu_id + i`, the GPU of the i-th trainer rank of the group, which owns the Engine object
when it is rank 0 of the group. A weight update is a collective over the engine group:

  every member   copies the bucket's full HF tensors into its flat GPU buffer (buckets.FlatBucket),
                 wraps it as SGLang's FlattenedTensorBucket and serializes it with
                 MultiprocessingSerializer (a CUDA IPC handle, not the bytes; needs
                 monkey_patch_torch_reductions(), applied for CUDA tensors only);
  the owner      gathers (GPU, payload) from every member, orders the payloads so that entry i
                 was made on GPU base_gpu_id + i (the GPU of engine TP rank i: a CUDA IPC
                 handle must be opened by the rank on the GPU that made it), and calls
                 Engine.update_weights_from_tensor(payloads, load_format="flattened_bucket");
                 SGLang TP rank i deserializes entry i and its model's weight loaders slice out
                 what that rank needs (plain HF names; separate q/k/v and gate/up, because a
                 fused qkv_proj name is dropped by SGLang's Qwen2 loader). A server over HTTP
                 (a group of one) gets one serialization of the owner's bucket per server TP rank.

Every SGLang call and the source line it was checked against: docs/weight_sync.md.

Memory: around training, `release_memory()` frees weights, KV cache and CUDA graphs
(needs enable_memory_saver=True); `resume_memory()` takes them back once every member has
emptied its PyTorch cache (sync_freed: a barrier on the group, a gloo group). Every Engine call
goes through `_call`, which keeps the process's signal handlers (rollout/engine_signals.py); the
engine's processes start with the trainer's stop signals blocked (engine_signals.spared_from_stop_signals)
and are ended by `stop_engine`, which ends them and nothing else of the trainer's.

SGLang's CPU engine (no GPU, SGLANG_USE_CPU_ENGINE=1, sgl-kernel's CPU build): the same groups and
payloads (CPU tensors). It holds no GPU memory and SGLang's release/resume synchronize CUDA, so they
are never called there. The suite runs this path with sglang itself (docs/what_ran_where.md).
"""

from __future__ import annotations

import atexit
import os
import socket
import weakref
from dataclasses import dataclass
from typing import Any, Protocol, Sequence

import torch
import torch.distributed as dist

from vapo_megatron.mcore import parallel
from vapo_megatron.mcore.memory import free_cached_memory
from vapo_megatron.rollout.base import MEMORY_TAGS, Continuation, RolloutEngine, RolloutOutput, SamplingParams
from vapo_megatron.rollout.buckets import FlatBucket
from vapo_megatron.rollout.engine_signals import EngineDeath, kept_handlers, spared_from_stop_signals, take_over_now
from vapo_megatron.rollout.sglang_payloads import order_by_engine_rank, serialize_flattened_bucket, to_flattened_bucket
from vapo_megatron.rollout.sglang_requests import continuation_requests, expand_requests, parse_output


def check(result: Any, what: str) -> None:
    """SGLang's control calls answer (success, message), a dict with "success", or None."""
    if result is None:
        return
    if isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], bool):
        ok, msg = result
    elif isinstance(result, dict) and "success" in result:
        ok, msg = result["success"], result["message"] if "message" in result else ""
    elif hasattr(result, "success"):  # e.g. FlushCacheReqOutput from Engine.flush_cache()
        ok, msg = result.success, getattr(result, "message", "")
    else:
        return
    if not ok:
        raise RuntimeError(f"SGLang {what} failed: {msg}")


# ---- the engine --------------------------------------------------------------------------------

class EngineLike(Protocol):
    """The part of sglang.Engine's API this module calls, always by keyword except
    named_tensors (sglang_http.HttpEngine has it too). The suite checks every call against
    sglang/srt/entrypoints/engine.py."""

    def generate(self, *, input_ids, sampling_params, return_logprob, return_routed_experts): ...
    def begin_weight_update(self): ...
    def end_weight_update(self): ...
    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True): ...
    def release_memory_occupation(self, tags=None): ...
    def resume_memory_occupation(self, tags=None): ...
    def flush_cache(self): ...


@dataclass(frozen=True)
class SGLangEngineConfig:
    model_path: str  # HF dir (config + tokenizer; the first sync replaces the weights)
    tp_size: int
    base_gpu_id: int
    mem_fraction_static: float
    dtype: str = "bfloat16"
    random_seed: int = 0
    deterministic: bool = False
    # "dummy": random weights, nothing read from model_path; the first weight sync replaces them
    # anyway (SGLang's LoadFormat.DUMMY, sglang/srt/configs/load_config.py). "auto" reads the checkpoint.
    load_format: str = "dummy"
    sigquit_handler: Any = None  # ServerArgs.custom_sigquit_handler (engine_signals.EngineDeath)
    return_routes: bool = False  # routing replay: the engine records the experts of every token
    device: str = "cuda"  # "cpu": SGLang's CPU engine (cpu_engine())
    max_total_tokens: int | None = None  # SGLang's cap on the KV cache's tokens (rollout.sglang.max_total_tokens)


def cpu_engine() -> bool:
    """Whether SGLang runs on the CPU here: no CUDA GPU visible, and SGLang's own switch for its CPU
    engine set (SGLANG_USE_CPU_ENGINE=1, read by sglang/srt/utils/common.py is_cpu(); without it
    SGLang's scheduler takes its CUDA imports and dies)."""
    return os.environ.get("SGLANG_USE_CPU_ENGINE") == "1" and not torch.cuda.is_available()


def engine_kwargs(cfg: SGLangEngineConfig) -> dict:
    """sglang.Engine(**kwargs) = ServerArgs fields (checked against sglang.srt.server_args).
    enable_memory_saver lets the trainer release the engine's weights, KV cache and CUDA graphs
    while it trains (needs the torch_memory_saver package on the GPU machine);
    skip_tokenizer_init because the trainer sends and reads token ids.
    enable_deterministic_inference (trainer.deterministic): SGLang uses the per-request
    sampling_seed only then (sampling_batch_info.py builds the seed tensor only under it);
    without it samples depend on batching, as on any SGLang server.
    custom_sigquit_handler: SGLang installs it instead of its kill-the-process-tree handler
    (engine.py, _set_envs_and_config); ServerArgs drops it before pickling for its schedulers.
    enable_return_routed_experts (routing replay): its capturer keeps each token's top-k experts,
    which a request with return_routed_experts=True gets back.
    On the CPU (device="cpu"): SGLang's torch_native attention (its other CPU backend, intel_amx,
    needs sgl-kernel's AMX ops), no memory saver (torch_memory_saver is CUDA's), no GPU ids;
    mem_fraction_static is then a share of the host's memory (model_executor's CPU memory probe)."""
    extra = {} if cfg.sigquit_handler is None else {"custom_sigquit_handler": cfg.sigquit_handler}
    if cfg.return_routes:
        extra["enable_return_routed_experts"] = True
    if cfg.max_total_tokens is not None:
        extra["max_total_tokens"] = cfg.max_total_tokens
    if cfg.device == "cpu":
        # sleep_on_idle: an idle scheduler otherwise polls its sockets in a busy loop, a whole core
        # taken from the trainer while it trains (seen on the CPU: 40% of a 2-core machine per engine).
        extra.update(device="cpu", attention_backend="torch_native", sleep_on_idle=True)
    else:
        extra.update(base_gpu_id=cfg.base_gpu_id, enable_memory_saver=True)
    return dict(**extra, model_path=cfg.model_path, tp_size=cfg.tp_size, mem_fraction_static=cfg.mem_fraction_static,
                dtype=cfg.dtype, random_seed=cfg.random_seed, skip_tokenizer_init=True,
                enable_deterministic_inference=cfg.deterministic, load_format=cfg.load_format)


def start_engine(cfg: SGLangEngineConfig):
    """A colocated sglang.Engine (on the GPU, or SGLang's CPU engine: cpu_engine()), to be ended by
    stop_engine: at exit too, in place of the Engine's own atexit shutdown."""
    import sglang

    engine = sglang.Engine(**engine_kwargs(cfg))
    atexit.unregister(engine.shutdown)
    atexit.register(stop_engine, engine)
    return engine


_stopped: "weakref.WeakSet" = weakref.WeakSet()  # the Engines stop_engine ended (it may be called again at exit)


def stop_engine(engine) -> None:
    """sglang.Engine.shutdown(), except that it ends the engine's own processes only.

    Engine.shutdown ends them with kill_process_tree(os.getpid(), include_parent=False): SIGKILL to
    every descendant of the trainer's process, not only the engine's. That took the reward workers,
    W&B's service and multiprocessing's resource tracker with it; the tracker gone, the trainer's
    own semaphores, unregistered at exit, reached a new tracker that had never seen them, which
    printed a `KeyError` traceback at the end of every SGLang run (exit 0 too). Here the engine's
    shutdown runs with that call aimed at the engine's processes (Engine.get_all_child_pids: its
    schedulers and detokenizer), each with its own descendants, killed and reaped as SGLang does:
    `kill_process_tree` is swapped, for the call, in the globals that Engine.shutdown resolves it in
    (sglang/srt/entrypoints/engine.py's; the suite runs SGLang's shutdown source through it). Objects
    without get_all_child_pids (test doubles) get their own shutdown."""
    if not hasattr(engine, "get_all_child_pids"):
        engine.shutdown()
        return
    if engine in _stopped:
        return
    _stopped.add(engine)
    pids = list(engine.get_all_child_pids())
    names = type(engine).shutdown.__globals__
    kill_tree = names["kill_process_tree"]

    def engines_own(parent_pid, include_parent=True, skip_pid=None, wait_timeout=60):
        if parent_pid != os.getpid() or include_parent:  # not Engine.shutdown's sweep of this process: as SGLang has it
            return kill_tree(parent_pid, include_parent=include_parent, skip_pid=skip_pid, wait_timeout=wait_timeout)
        for pid in pids:
            kill_tree(pid, include_parent=True, skip_pid=skip_pid, wait_timeout=wait_timeout)

    names["kill_process_tree"] = engines_own
    try:
        engine.shutdown()
    finally:
        names["kill_process_tree"] = kill_tree


class SGLangEngine(RolloutEngine):
    """One member of an engine group. `engine` is the Engine (or HTTP client) on the group's
    rank 0 and None elsewhere; `group` is the engine group (None: a group of one).

    Memory: the wrapper tracks what the engine holds, so release/resume are idempotent, and
    remembers when the weights were released: their contents are gone (the memory saver frees
    them), so generate refuses to run until a weight update has loaded them again."""

    def __init__(self, engine: EngineLike | None, *, group=None, base_gpu_id: int | None = None,
                 death: EngineDeath | None = None, engine_tp: int | None = None,
                 routes: tuple[int, int, int] | None = None, frees_memory: bool = True) -> None:
        """routes: (MoE layers, k, experts) of the served model, when generations may ask for them.
        frees_memory=False: SGLang's CPU engine, whose memory is never released (module docstring)."""
        self.group = group
        self.frees_memory = frees_memory
        self.routes = routes
        self.base_gpu_id = base_gpu_id  # the owner's engine's base GPU (colocated engines)
        self.group_rank = dist.get_rank(group) if group is not None else 0
        self.group_size = dist.get_world_size(group) if group is not None else 1
        # SGLang TP rank i reads payload i: one per member (colocated), or all from a group of one
        # (an HTTP server of engine_tp ranks, whose TP size the client read from the server).
        self.engine_tp = self.group_size if engine_tp is None else engine_tp
        if self.group_size not in (1, self.engine_tp):
            raise ValueError(f"an engine group of {self.group_size} ranks cannot feed an engine of TP {self.engine_tp}")
        self.owner = self.group_rank == 0
        if self.owner and engine is None:
            raise ValueError("rank 0 of an engine group must hold the SGLang engine")
        self.engine = engine if self.owner else None
        ranks = (dist.get_process_group_ranks(group) if group is not None
                 else [dist.get_rank() if dist.is_initialized() else 0])
        self.death = death or EngineDeath(f"SGLang engine of trainer ranks {ranks}")
        self._version = -1
        self._resident = set(MEMORY_TAGS)  # a started engine holds everything
        self._weights_lost = False

    @classmethod
    def colocated(cls, *, model_path: str, tp_size: int, mem_fraction: float, dtype: str, seed: int,
                  deterministic: bool = False, load_format: str = "dummy", start=start_engine,
                  routes: tuple[int, int, int] | None = None, max_total_tokens: int | None = None) -> "SGLangEngine":
        """Collective over the world. One engine per block of `tp_size` consecutive ranks of a
        TP group (parallel.init_engine_groups); the block's first rank starts it on its own GPU
        and the next tp_size - 1 ones. What the engine holds is released at once, so the trainer's
        models can be built; the first weight sync loads the weights (load_format="dummy"). With
        weights read from model_path (another load_format: vapo-eval of an HF model) they are kept.
        `start` builds the engine from an SGLangEngineConfig (start_engine; tests pass a double)."""
        group = parallel.init_engine_groups(tp_size)
        engine = None
        base_gpu_id = torch.cuda.current_device() if torch.cuda.is_available() else None
        base = base_gpu_id if base_gpu_id is not None else 0
        device = "cpu" if cpu_engine() else "cuda"
        death = EngineDeath(f"SGLang engine of trainer ranks {dist.get_process_group_ranks(group)} "
                            f"(GPUs {base}..{base + tp_size - 1} of host {socket.gethostname()})")
        if dist.get_rank(group) == 0:
            death.install()  # before the Engine starts: its schedulers may fail while they load
            # The engine's processes never act on the trainer's stop signals (engine_signals.py).
            with kept_handlers(None), death.calling(), spared_from_stop_signals():
                engine = start(SGLangEngineConfig(
                    model_path=model_path, tp_size=tp_size, base_gpu_id=base, mem_fraction_static=mem_fraction,
                    dtype=dtype, random_seed=seed, deterministic=deterministic, load_format=load_format,
                    sigquit_handler=death, return_routes=routes is not None, device=device,
                    max_total_tokens=max_total_tokens,
                ))
            take_over_now(engine)  # SGLang's signal takeover, undone before any stop signal can meet it
        parallel.barrier(group=parallel.wait_group())  # every engine is up before any rank builds its models
        wrapper = cls(engine, group=group, base_gpu_id=base_gpu_id, death=death, routes=routes,
                      frees_memory=device != "cpu")
        wrapper.release_memory(MEMORY_TAGS if load_format == "dummy" else [t for t in MEMORY_TAGS if t != "weights"])
        return wrapper

    @property
    def generates(self) -> bool:
        return self.owner

    def _call(self, method: str, *args, **kwargs):
        """One call on the Engine (the owner's): a dead engine, before or during the call, is
        EngineDied naming it (EngineDeath.calling), and the process's signal handlers are the same
        afterwards (engine_signals.kept_handlers)."""
        with kept_handlers(self.engine), self.death.calling():
            return getattr(self.engine, method)(*args, **kwargs)

    def sync_freed(self) -> None:
        """Every member empties its cache; none returns before all have (gloo barrier)."""
        free_cached_memory()
        if self.group_size > 1:
            parallel.barrier(group=self.group)

    @property
    def weight_version(self) -> int:
        return self._version

    def generate(self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams) -> list[RolloutOutput]:
        if params.return_routes and self.routes is None:
            raise ValueError("routes asked for, but this SGLang engine was not built for routing replay")
        return self._generate(*expand_requests(prompt_ids, params), self.routes if params.return_routes else None)

    def extend(self, requests: Sequence[Continuation], params: SamplingParams) -> list[RolloutOutput]:
        """Partial rollout: each response continued from prompt + its tokens (sglang_requests.py)."""
        if params.return_routes:  # preflight refuses partial rollout with routing replay
            raise ValueError("extend: a continued response's routes are not recorded (partial rollout with "
                             "routing replay is refused at start-up)")
        return self._generate(*continuation_requests(requests, params), list(range(len(requests))), None)

    def _generate(self, ids: list, sps: list, owners: list[int], routes) -> list[RolloutOutput]:
        if not self.owner:
            raise RuntimeError("generate runs on the engine group's rank 0 (the Engine owner)")
        if self._weights_lost:
            raise RuntimeError("the engine's weights were released and not loaded again: run a weight update first")
        outs = self._call("generate", input_ids=ids, sampling_params=sps, return_logprob=True,  # a list for a list
                          return_routed_experts=routes is not None)
        if isinstance(outs, dict):
            outs = [outs]
        if len(outs) != len(ids):
            raise RuntimeError(f"SGLang returned {len(outs)} outputs for {len(ids)} requests")
        return [parse_output(o, i, self._version, prompt_len=len(x), routes=routes)
                for o, i, x in zip(outs, owners, ids)]

    def begin_weight_update(self) -> None:
        self.sync_freed()  # the weights come back on GPUs every member has emptied its cache on
        self.resume_memory(("weights",))  # the update writes into them
        if self.owner:
            check(self._call("begin_weight_update"), "begin_weight_update")

    def load_bucket(self, named_tensors: FlatBucket | Sequence[tuple[str, torch.Tensor]]) -> None:
        fb = to_flattened_bucket(named_tensors)
        flat = fb.get_flattened_tensor()
        gpu = flat.device.index if flat.is_cuda else None
        if self.group_size == 1:  # a serialization per engine rank: each rank's CUDA IPC refcount is its own
            entries = [(gpu, serialize_flattened_bucket(fb)) for _ in range(self.engine_tp)]
        else:
            entry = (gpu, serialize_flattened_bucket(fb))
            # Entries in group-rank order = engine TP rank order (rank i sits on GPU base + i).
            entries = [None] * self.group_size if self.owner else None
            parallel.gather_object(entry, entries, dst=dist.get_global_rank(self.group, 0), group=self.group)
        error = None
        if self.owner:
            try:
                payloads = order_by_engine_rank(entries, self.base_gpu_id)
                check(self._call("update_weights_from_tensor", payloads, load_format="flattened_bucket",
                                 flush_cache=False), "update_weights_from_tensor")
            except RuntimeError as e:
                error = str(e)
        if self.group_size > 1:
            # Members must keep their buffers untouched until every engine rank has loaded.
            box = [error]
            parallel.broadcast_object_list(box, src=dist.get_global_rank(self.group, 0), group=self.group)
            error = box[0]
        if flat.is_cuda and isinstance(named_tensors, FlatBucket):
            # SGLang answers once its TP ranks have queued their copies out of this buffer, not
            # once the copies ran (no device sync in its update path), so writing the next
            # bucket here could race them. Drop the buffer instead: torch keeps CUDA memory
            # shared over IPC alive until every receiver has freed its view, and a receiver
            # synchronizes its stream before that; the next bucket gets fresh memory.
            named_tensors.release()
        if error:
            raise RuntimeError(error)

    def end_weight_update(self, version: int) -> None:
        if self.owner:
            check(self._call("end_weight_update"), "end_weight_update")
            check(self._call("flush_cache"), "flush_cache")
        self._version = version
        self._weights_lost = False

    def shutdown(self) -> None:
        """Stop the Engine this rank started (Generator.close), its processes only (stop_engine);
        an HTTP server keeps running."""
        if self.owner and hasattr(self.engine, "shutdown"):
            stop_engine(self.engine)

    def release_memory(self, tags: Sequence[str] = MEMORY_TAGS) -> None:
        """Before training: free weights, KV cache and CUDA graphs (the engine must be idle)."""
        tags = [t for t in tags if t in self._resident]
        if not tags:
            return
        if self.owner and self.frees_memory:
            check(self._call("release_memory_occupation", tags=tags), "release_memory_occupation")
        self._resident -= set(tags)
        self._weights_lost |= "weights" in tags and self.frees_memory

    def resume_memory(self, tags: Sequence[str] = MEMORY_TAGS) -> None:
        """After training. A weight update resumes ("weights",) by itself; generation needs
        ("kv_cache", "cuda_graph") as well, taken after the update to keep its peak low."""
        tags = [t for t in tags if t not in self._resident]
        if not tags:
            return
        if self.owner and self.frees_memory:
            check(self._call("resume_memory_occupation", tags=tags), "resume_memory_occupation")
        self._resident |= set(tags)
