"""Steps 2 and 8 of the loop: this model replica's rollout engines, and the calls the loop makes.

    gen = Generator.build(cfg, stop_token_ids)      collective: engines start, generating ranks known
    rollout = gen.collect(prompts, seed=...)        step 2: n samples per prompt of this DP rank
    gen.release_weights()                           the engine's GPU memory goes to training
    gen.sync_weights(actor_model, version=...)      step 8: the new actor weights into the engines
    gen.extend(requests, params); gen.end_rounds()  partial rollout's rounds (rollout/partial.py)

Engine placement (rollout/engines.py builds each engine). The embedded engine and an SGLang HTTP
server: one engine per model replica (DP rank), held by the replica's first rank (TP rank 0, PP
stage 0). A colocated engine (SGLang): one per block of its section's tp ranks (rollout.sglang.tp)
of every TP group, so a replica (TP x PP ranks) has TP*PP/tp engines (mcore/parallel.py,
init_engine_groups). Either way the replica's
prompts are split evenly over its generating ranks, and the token ids are then shared with every
rank of the replica (the model-parallel group), which all need the batch. Sampling seeds are a
pure function of (trainer seed, iteration, DP rank, prompt and sample index), whatever the
split, so a resumed run draws the same rollouts.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch.distributed as dist

from vapo_megatron.config import Config, RolloutConfig
from vapo_megatron.data.prompts import PromptRecord
from vapo_megatron.mcore import parallel
from vapo_megatron.mcore.memory import free_cached_memory
from vapo_megatron.rollout.base import Continuation, RolloutEngine, RolloutOutput, SamplingParams
from vapo_megatron.runtime import fault_points


@dataclass
class Rollout:
    """This DP rank's prompts and their sampled responses (n per prompt, grouped)."""

    prompts: list[PromptRecord]
    outputs: list[RolloutOutput]
    n: int
    results: list | None = None  # the verifier's RewardResult per output, when already judged (dynamic sampling)


def build_engine(cfg: Config, *, with_weights: bool = True, routes: bool = False,
                 synced: bool = True) -> RolloutEngine | None:
    """Collective (colocated SGLang starts its engines together). None on ranks with no engine.
    with_weights=False: model.hf_path holds only config and tokenizer (a trainer checkpoint's
    hf/); the engine starts with placeholder weights, which the first weight sync replaces.
    Colocated SGLang starts so whenever a sync comes first (`synced`: the trainer; load_format=
    "dummy"): reading a 32B checkpoint only to release it costs minutes. synced=False (vapo-eval of
    an HF model): no sync ever comes, so it reads model.hf_path's weights and keeps them.
    routes (routing replay): SGLang engines are started (or their servers checked) to return the
    routed experts; the embedded engine always can, for a MoE model."""
    from model_providers import read_hf_config
    from vapo_megatron.data.routes import route_shape
    from vapo_megatron.rollout.engines import record_of

    record = record_of(cfg)  # rollout/engines.py: how this engine is built
    shape = route_shape(read_hf_config(cfg.model.hf_path)) if routes else None
    if not record.engine.colocated and not (parallel.tp_rank() == 0 and parallel.pp_rank() == 0):
        return None  # one engine per replica, on its first rank
    return record.build(cfg, with_weights=with_weights, routes=shape, synced=synced)


def generating_ranks(engine: RolloutEngine | None) -> list[int]:
    """Collective over the model-parallel group: the global ranks of this replica that
    generate, in group order (the order their prompt shares are assigned in)."""
    mp_group = parallel.wait_group("model_parallel")  # right after the engines started: a CPU wait
    flags = [False] * dist.get_world_size(mp_group)
    parallel.all_gather_object(flags, engine is not None and engine.generates, group=mp_group)
    ranks = [r for r, f in zip(dist.get_process_group_ranks(mp_group), flags) if f]
    if not ranks:
        raise RuntimeError("no rank of this model replica holds a rollout engine")
    return ranks


class Generator:
    """The rollout engines of this model replica, seen from one of its ranks."""

    def __init__(self, engine: RolloutEngine | None, rollout: RolloutConfig, stop_token_ids: tuple[int, ...], *,
                 routes: bool = False):
        """routes: the step's rollouts (collect) carry the experts each token was routed to (routing
        replay, data/routes.py); evaluations never do."""
        self.engine, self.cfg, self.stop_token_ids, self.routes = engine, rollout, stop_token_ids, routes
        self.generators = generating_ranks(engine)  # global ranks of this replica that generate, in share order

    @classmethod
    def build(cls, cfg: Config, stop_token_ids: tuple[int, ...], *, with_weights: bool = True,
              routes: bool = False, synced: bool = True) -> "Generator":
        """Collective: every rank's engines (build_engine), then the replica's generating ranks.
        routes: the trainer's rollouts carry the routed experts (data/routes.py, replays);
        synced: a weight sync comes before the first generation (build_engine)."""
        return cls(build_engine(cfg, with_weights=with_weights, routes=routes, synced=synced), cfg.rollout,
                   stop_token_ids, routes=routes)

    def sampling(self, *, seed: int, greedy: bool = False, n: int | None = None,
                 temperature: float | None = None, routes: bool = False) -> SamplingParams:
        """The run's sampling settings (rollout.*); greedy: one sample at temperature 0; routes:
        return the routed experts (SamplingParams.return_routes)."""
        r = self.cfg
        if greedy:
            return SamplingParams(n=1, temperature=0.0, max_new_tokens=r.max_new_tokens,
                                  stop_token_ids=self.stop_token_ids, seed=seed)
        return SamplingParams(n=r.n_samples if n is None else n,
                              temperature=r.temperature if temperature is None else temperature,
                              top_p=r.top_p, top_k=r.top_k, max_new_tokens=r.max_new_tokens,
                              stop_token_ids=self.stop_token_ids, seed=seed, return_routes=routes)

    def generate(self, prompts: list[PromptRecord], params: SamplingParams) -> list[RolloutOutput]:
        """Collective over the replica. Each generating rank samples its contiguous share of
        `prompts`; every rank of the replica gets all outputs, grouped by prompt. Seeds are offset
        by the share's start, so the samples do not depend on how many engines there are."""
        def run(share: list[PromptRecord], start: int) -> list[RolloutOutput]:
            outs = self.engine.generate([p.prompt_ids for p in share],
                                        replace(params, seed=params.seed + start * params.n))
            self.engine.release_memory(("kv_cache", "cuda_graph"))
            return outs

        return self._spread(prompts, run)

    def extend(self, requests: list[Continuation], params: SamplingParams) -> list[RolloutOutput]:
        """Collective over the replica, as generate: each generating rank continues its share of the
        responses (partial rollout: each request holds its own seed). The engine keeps its KV cache
        until end_rounds."""
        return self._spread(requests, lambda share, start: self.engine.extend(share, params))

    def end_rounds(self) -> None:
        """After partial rollout's last round: the KV cache goes, and every rank waits here (as collect)."""
        if self.engine is not None and self.engine.generates:
            self.engine.release_memory(("kv_cache", "cuda_graph"))
        parallel.barrier(group=parallel.wait_group())

    def _spread(self, items: list, run) -> list[RolloutOutput]:
        per = -(-len(items) // len(self.generators))
        mine: list[RolloutOutput] = []
        # Weight-sync buckets, gathered shards and training leftovers go back to the driver on every
        # rank, and the owner takes its KV cache back only after every rank on its engine's GPUs
        # has freed (sync_freed): SGLang sized its static memory when the trainer held almost nothing.
        free_cached_memory()
        if self.engine is not None:
            self.engine.sync_freed()
        if self.engine is not None and self.engine.generates:
            start = self.generators.index(dist.get_rank()) * per
            share = items[start : start + per]
            if share:
                self.engine.resume_memory(("kv_cache", "cuda_graph"))
                mine = [replace(o, prompt_index=o.prompt_index + start) for o in run(share, start)]
        # The replica's other ranks wait here for the whole generation: on the CPU (wait_group).
        mp_group = parallel.wait_group("model_parallel")
        if dist.get_world_size(mp_group) == 1:
            return mine
        gathered: list = [None] * dist.get_world_size(mp_group)
        parallel.all_gather_object(gathered, mine, group=mp_group)
        by_rank = dict(zip(dist.get_process_group_ranks(mp_group), gathered))
        return [o for r in self.generators for o in by_rank[r]]

    def collect(self, global_prompts: list[PromptRecord], *, seed: int) -> Rollout:
        """Step 2: rollout.n_samples samples for each of this DP rank's prompts."""
        _, prompts = parallel.dp_share(global_prompts)
        outputs = self.generate(prompts, self.sampling(seed=seed, routes=self.routes))
        # Replicas finish generating at different times; the first NCCL collective of the updates
        # (DP gradient and count reductions) would otherwise wait for the slowest one on the device.
        parallel.barrier(group=parallel.wait_group())
        return Rollout(prompts=prompts, outputs=outputs, n=self.cfg.n_samples)

    def release_weights(self) -> None:
        """Before the updates: the engine's weights make room for training; the weight sync that
        ends the step loads them again (SGLang; the embedded engine keeps its weights)."""
        if self.engine is not None:
            self.engine.release_memory(("weights",))
        free_cached_memory()  # the rollout phase's blocks: training starts from an empty cache
        fault_points.point("rollout")  # the rollout phase's end (runtime/fault_points.py)

    def sync_weights(self, model, *, version: int) -> None:
        """Step 8: stream the actor's weights (HF names, full tensors) into the rollout engines
        (weight_sync.py). `model`: the actor's TrainModel; `version`: the step they come from."""
        from vapo_megatron.rollout.weight_sync import stream_weights

        free_cached_memory()  # the updates' activations, before the engine takes its weights back
        stream_weights(model.modules, model.family, model.hf_cfg, self.engine, version=version,
                     bucket_bytes=self.cfg.weight_sync_bucket_mb << 20)
        fault_points.point("weight_sync")  # the engine is ahead of the checkpoint (runtime/fault_points.py)

    def close(self) -> None:
        from vapo_megatron.rollout.tp_gather import free_staging

        free_staging()  # weight sync's shared-memory areas, kept between syncs
        if self.engine is not None and hasattr(self.engine, "shutdown"):
            self.engine.shutdown()


__all__ = ["Generator", "Rollout", "build_engine", "generating_ranks"]
