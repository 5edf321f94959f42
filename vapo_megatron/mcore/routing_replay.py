"""Routing replay (R3), the trainer's side: the actor's MoE routers send each token to the experts
the rollout engine chose for it (data/routes.py), through megatron-core 0.19.2's RouterReplay
(transformer/moe/router_replay.py), one per router.

    replay = RouteReplay(chunks, hf_cfg)     the actor's routers (mcore/model.py, build_model)
    with replay.forward(chunk, mb, width):   around each model call (schedule.py, forward_step)
    replay.finish()                          after each schedule call

Every forward whose log-probs PPO uses replays: step 4's old log-probs, each update's forward, and,
with model.recompute_activations, the forward each layer runs again in the backward. megatron's
router takes its top-k indices from its RouterReplay (moe_utils.topk_routing_with_score_function,
get_replay_topk) and computes their weights from its own scores:
  REPLAY_FORWARD   the indices set for this forward (set_target_indices);
  REPLAY_BACKWARD  the oldest indices queued and not yet replayed (set_target_indices queues them),
                   for the forward recomputed in the backward.
`forward` sets a micro-batch's routes on the chunk's routers with REPLAY_FORWARD for the model call
and leaves REPLAY_BACKWARD behind it: the backward runs outside forward_step, and megatron's
schedules run a chunk's backwards in the order of its forwards, so each recomputed layer takes its
own micro-batch's routes. The queue is kept only when such a backward will come (recomputation on,
gradients on) and is cleared by `finish`.

Token order: a MoE layer routes its hidden states [S, b, h] flattened sequence-major (token s * b + i);
with sequence parallelism each TP rank routes its S / TP positions. Each pipeline stage routes its
own layers (router.layer_number is the layer's global number). Expert parallelism does not change
what a rank routes: its own tokens, before the all-to-all. Positions without a route (a sequence's
last token, padding) get experts spread over all of them (data/routes.py, filler_experts), so
that no EP rank gets every rank's padding.

One copy to the device per forward: megatron's RouterReplay.get_replay_topk moves the indices it
is given to the scores' device with a blocking `.to(device)`, once per router per forward (and
again in the recomputed forward): 2 x MoE layers host syncs per micro-batch. `forward` instead
shapes the micro-batch's routes on the host (data/routes.py, replay_routes: [L, T, k] in the compact id
dtype), copies them once, from pinned memory, without blocking (to_device), and widens them to
int64 on the device; each router gets its layer's row, already there, which megatron's `.to`
leaves as it is. Those int64 ids stay on the device while queued for the backward.

The critic's routers are never touched: the engine's routes are the policy's choices.

moe/routing_mismatch: while `counting` (step 4), a forward hook on each router also takes the
router's own choice (megatron's topk_routing_with_score_function, no replay) and marks the tokens
whose top-k set differs from the engine's in any MoE layer (counted on the device, brought to the
host once, in mismatch_flags); `mismatch_share` is the share of the
response tokens the engine routed (data/routes.py, routed_positions), over every DP rank.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist

from vapo_megatron.data.batch import RolloutBatch
from vapo_megatron.mcore import parallel


class RouteReplay:
    def __init__(self, chunks: list, hf_cfg: dict):
        from megatron.core.transformer.moe.router import TopKRouter
        from megatron.core.transformer.moe.router_replay import RouterReplay

        from vapo_megatron.data.routes import moe_layers, route_shape

        column = {layer: i for i, layer in enumerate(moe_layers(hf_cfg))}  # global layer -> routes' column
        self.num_experts = route_shape(hf_cfg)[2]
        self.device = parallel.device()  # where the routers' scores are
        self.chunks = chunks
        self.routers: list[list[tuple[int, object]]] = []  # per chunk: (routes' column, router)
        for chunk in chunks:
            found = []
            for module in chunk.modules():
                if isinstance(module, TopKRouter):
                    if module.router_replay is None:  # what megatron builds with moe_enable_routing_replay
                        module.router_replay = RouterReplay()
                    module.register_forward_hook(self._count)
                    found.append((column[module.layer_number - 1], module))
            self.routers.append(found)
        config = getattr(chunks[0], "module", chunks[0]).config
        self.recompute = config.recompute_granularity is not None
        self.sequence_parallel = config.sequence_parallel
        self.enabled = True  # False: the routers choose for themselves (the routes are still counted against)
        self.counts: list[list[torch.Tensor]] | None = None  # counting: per chunk, per forward, [S, b] layers differing
        self._targets: dict[int, torch.Tensor] = {}  # id(router) -> the engine's indices [tokens, k] of this forward
        self._acc: torch.Tensor | None = None
        self._offset = 0

    def _index(self, model) -> int:
        for i, chunk in enumerate(self.chunks):
            if chunk is model or getattr(chunk, "module", None) is model:
                return i
        raise ValueError("RouteReplay.forward: the model is not one of the actor's chunks")

    def count(self) -> None:
        """Mark mismatched tokens in the forwards until mismatch_flags (the next forward-only schedule call)."""
        self.counts = [[] for _ in self.chunks]

    @contextmanager
    def forward(self, model, mb: RolloutBatch, width: int):
        """Replay `mb`'s routes in the chunk `model`'s routers for the model call inside; `width`
        is the sequence length the model gets (mb's, padded to a multiple of TP under SP)."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        index = self._index(model)
        routers = self.routers[index]
        if mb.routes is None or not routers:
            yield
            return
        from vapo_megatron.data.routes import replay_routes

        b = mb.routes.shape[0]
        part = None
        self._offset = 0
        if self.sequence_parallel:
            length = width // parallel.tp_size()
            self._offset = parallel.tp_rank() * length
            part = (self._offset, length)
        # [L, T, k] int64 on the device, from one non-blocking copy (the module's docstring)
        ids = to_device(replay_routes(mb.routes, mb.seq_lens, width, self.num_experts, part=part), self.device).long()
        if self.counts is not None:
            self._acc = torch.zeros(width, b, device=self.device)
            self.counts[index].append(self._acc)
        queued = self.recompute and torch.is_grad_enabled()  # a backward will recompute this forward
        for column, router in routers:
            target = ids[column]  # [T, k], contiguous
            self._targets[id(router)] = target
            if self.enabled:
                replay = router.router_replay
                replay.set_target_indices(target)
                if not queued:
                    replay.replay_backward_list.pop()  # nothing will replay it in a backward
                replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        try:
            yield
        finally:
            if self.enabled:
                for _, router in routers:
                    router.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)
            self._targets, self._acc = {}, None

    def finish(self) -> None:
        """After a schedule call: every router routes by itself again, nothing queued."""
        for routers in self.routers:
            for _, router in routers:
                router.router_replay.clear_indices()
                router.router_replay.clear_router_replay_action()

    def _count(self, module, args, output) -> None:
        """Forward hook: mark the tokens whose own top-k (no replay) differs from the engine's."""
        target = self._targets.get(id(module))
        if self._acc is None or target is None:
            return
        from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

        c = module.config
        with torch.no_grad():
            logits = module.gating(args[0]).view(-1, c.num_moe_experts)
            _, own = topk_routing_with_score_function(
                logits, module.topk, use_pre_softmax=c.moe_router_pre_softmax, num_groups=c.moe_router_num_groups,
                group_topk=c.moe_router_group_topk, scaling_factor=c.moe_router_topk_scaling_factor,
                score_function=module.score_function, expert_bias=module.expert_bias)
            engine = torch.zeros_like(own).scatter_(1, target, True)
            differ = (own != engine).any(-1).view(-1, self._acc.shape[1]).float()  # [S_local, b], on the device
        self._acc[self._offset : self._offset + differ.shape[0]] += differ

    def mismatch_flags(self, plan: list[list[int]], shape: torch.Size) -> torch.Tensor:
        """Collective over the model-parallel group. [B, S]: 1 where the router's own top-k differed
        from the engine's in some MoE layer (of any stage), from the forwards since count()."""
        full = torch.zeros(shape)
        for k, rows in enumerate(plan):
            parts = [c[k] for c in self.counts if len(c) > k]
            if parts and rows:  # a filler micro-batch (mcore/update.py) belongs to no row
                flags = (sum(parts) > 0).float().t().cpu()  # [b, S_padded]
                width = min(flags.shape[1], shape[1])
                full[rows, :width] = flags[:, :width]
        self.counts = None
        if parallel.tp_size() * parallel.pp_size() > 1:  # TP ranks saw their positions (SP), stages their layers
            parallel.all_reduce(full, op=dist.ReduceOp.MAX, group=parallel.model_parallel_group())
        return full


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`host` on `device` in one copy that does not block the host: from pinned (page-locked)
    memory, which a CUDA copy needs to run asynchronously (a pageable source makes torch stage it
    and wait). The caching host allocator keeps the pinned block until the copy is done. On the
    CPU: `host` itself."""
    if device.type == "cpu":
        return host
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def mismatch_share(flags: torch.Tensor, batch: RolloutBatch) -> float:
    """moe/routing_mismatch: the share of the response tokens the engine routed (every DP rank's)
    whose flag is set."""
    from vapo_megatron.data.routes import routed_positions

    routed = routed_positions(batch.prompt_lens, batch.response_lens, batch.tokens.shape[1])
    sums = torch.tensor([float((flags * routed).sum()), float(routed.sum())], dtype=torch.float64)
    if parallel.dp_size() > 1:
        parallel.all_reduce(sums, group=parallel.dp_group())
    return float(sums[0] / sums[1].clamp(min=1))


__all__ = ["RouteReplay", "mismatch_share", "to_device"]
