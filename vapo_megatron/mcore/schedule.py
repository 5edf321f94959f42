"""One call of megatron's schedule over a mini-batch's micro-batches, shared by actor and critic.

Gradient normalization (docs/normalization.md): a trained model is in per-token loss mode
(``calculate_per_token_loss=True``, model.py's wrap_ddp). Then
  * DDP sums gradients over DP ranks (no 1/dp averaging),
  * the schedule neither divides a micro-batch's loss by its token count nor by the number
    of micro-batches, and
  * ``finalize_model_grads`` all-reduces the micro-batches' token counts over DP (after a
    broadcast from the last pipeline stage) and scales every gradient by 1 / that total.
Each loss function therefore returns (loss_sum, num_tokens, metrics) where the sum over all
micro-batches and ranks of num_tokens is the global token count N, and loss_sum is scaled so
that sum(loss_sum) / N is exactly the loss of the global mini-batch (actor.py, critic.py).
"""

from __future__ import annotations

from contextlib import nullcontext
from functools import partial
from typing import Callable, Iterable

import torch
import torch.distributed as dist

from vapo_megatron.data.batch import RolloutBatch
from vapo_megatron.mcore import parallel


def forward_step(loss_fn: Callable, data_iterator, model, *, replay=None):
    """Megatron's forward_step_func: the next micro-batch through `model`; the last stage's output
    [b, S, ...] (logits for the actor, values for the critic) goes to `loss_fn(micro_batch, output)`.
    replay: the actor's RouteReplay (routing_replay.py), which routes the call by the batch's routes."""
    mb: RolloutBatch = next(data_iterator)
    device = parallel.device()
    tokens = mb.tokens.to(device)  # [b, S]
    width = tokens.shape[1]
    if model.config.sequence_parallel and width % parallel.tp_size():
        # Sequence parallelism splits the sequence over TP: S must be a multiple of TP. Extra
        # right padding changes no earlier position (causal attention); the loss sees [b, S] again.
        tokens = torch.nn.functional.pad(tokens, (0, -width % parallel.tp_size()))
    position_ids = torch.arange(tokens.shape[1], device=device).unsqueeze(0).expand_as(tokens)
    with replay.forward(model, mb, tokens.shape[1]) if replay is not None else nullcontext():
        output = model(tokens, position_ids, None)
    return output, partial(_unpadded, loss_fn, mb, width)


def _unpadded(loss_fn, mb: RolloutBatch, width: int, output: torch.Tensor):
    return loss_fn(mb, output[:, :width])


def forward_backward(model_chunks: list, loss_fn: Callable, micro_batches: list[RolloutBatch], *,
                     forward_only: bool, replay=None) -> list:
    """Run megatron's schedule over `micro_batches`; returns the last stage's loss outputs.
    `loss_fn(micro_batch, output)` -> (loss_sum, num_tokens, metrics). replay: the actor's
    RouteReplay (routing_replay.py; None: the routers choose, as the critic's always do)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    for chunk in model_chunks:
        chunk.train(not forward_only)
    longest = max(int(mb.tokens.shape[1]) for mb in micro_batches)
    tcfg = model_chunks[0].config if not hasattr(model_chunks[0], "module") else model_chunks[0].module.config
    if tcfg.sequence_parallel:  # forward_step pads each micro-batch to a multiple of TP
        longest = -(-longest // parallel.tp_size()) * parallel.tp_size()
    widest = max(int(mb.tokens.shape[0]) for mb in micro_batches)
    data = [iter(micro_batches) for _ in model_chunks] if len(model_chunks) > 1 else iter(micro_batches)
    if not forward_only:
        for chunk in model_chunks:
            chunk.zero_grad_buffer()
    try:
        return get_forward_backward_func()(
            forward_step_func=partial(forward_step, loss_fn, replay=replay),
            data_iterator=data,
            model=model_chunks,
            num_microbatches=len(micro_batches),
            seq_length=longest,
            micro_batch_size=widest,
            forward_only=forward_only,
        )
    finally:
        if replay is not None:
            replay.finish()


def reduce_metric_sums(outputs: list[dict]) -> dict[str, float]:
    """Sum per-micro-batch metric sums, over DP too; the result is known on every rank."""
    local: dict[str, float] = {}
    for out in outputs:
        for k, v in out.items():
            local[k] = local.get(k, 0.0) + float(v)
    holder = [sorted(local.items())]
    if parallel.pp_size() > 1:  # only the last stage computed losses
        last = dist.get_global_rank(parallel.pp_group(), parallel.pp_size() - 1)
        parallel.broadcast_object_list(holder, src=last, group=parallel.pp_group())
    keys = [k for k, _ in holder[0]]
    vals = torch.tensor([v for _, v in holder[0]], dtype=torch.float64)
    if parallel.dp_size() > 1 and len(keys):
        parallel.all_reduce(vals, group=parallel.dp_group())
    return dict(zip(keys, vals.tolist()))


def broadcast_from_last_stage(tensors: Iterable[torch.Tensor]) -> None:
    """Copy last-stage results (log-probs, values) to the other pipeline stages in place."""
    if parallel.pp_size() == 1:
        return
    last = dist.get_global_rank(parallel.pp_group(), parallel.pp_size() - 1)
    for t in tensors:
        parallel.broadcast(t, src=last, group=parallel.pp_group())


__all__ = ["broadcast_from_last_stage", "forward_backward", "forward_step", "reduce_metric_sums"]
