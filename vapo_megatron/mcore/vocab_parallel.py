"""Token log-probs and entropy from vocabulary-sharded logits (tensor parallelism).

Each TP rank holds logits for a contiguous slice [vocab_start, vocab_start + V/TP) of the
vocabulary. The log-softmax needs three vocabulary-wide quantities per token, combined across
the TP group with all-reduces: the max (MAX), the sum of exp (SUM) and the target's logit (SUM,
only its owner contributes); the entropy adds the sum of p * logit (SUM). No rank ever holds
full-vocabulary logits, and work is done in chunks of tokens so the only float32 temporary is
one [chunk, V/TP] buffer at a time (bf16 logits are cast per chunk, never as a whole).

Temperature is applied the way SGLang reports log-probs: log_softmax(logits / temperature).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from vapo_megatron.mcore import parallel


def _group_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _flatten_tokens(logits: Tensor) -> tuple[Tensor, tuple[int, ...], list[int]]:
    """A [N, V] view of logits [..., V] without copying when the layout allows it.

    Megatron's logits are [S, B, V]; callers often pass them transposed to [B, S, V]. Ordering
    the leading dims by stride makes them mergeable into one, so no copy is taken; the caller
    undoes the permutation on the [N] results.
    """
    lead = list(range(logits.dim() - 1))
    order = sorted(lead, key=lambda d: -logits.stride(d))
    permuted = logits.permute(*order, logits.dim() - 1)
    try:
        flat = permuted.view(-1, logits.shape[-1])
    except RuntimeError:  # overlapping/odd strides: one copy, unavoidable
        flat = permuted.reshape(-1, logits.shape[-1])
    return flat, tuple(permuted.shape[:-1]), order


def _unflatten(x: Tensor, permuted_shape: tuple[int, ...], order: list[int]) -> Tensor:
    inverse = [order.index(d) for d in range(len(order))]
    return x.view(permuted_shape).permute(*inverse)


class _VocabParallelLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, tp_group, vocab_start, temperature, chunk_tokens, with_entropy, num_valid):
        flat, pshape, order = _flatten_tokens(logits)
        N, _ = flat.shape
        Vs = num_valid  # columns past num_valid are vocabulary padding: not part of the softmax
        tgt = targets.permute(*order).reshape(-1)  # [N]
        device = flat.device
        world = _group_size(tp_group)

        # Pass 1: the vocabulary-wide max per token, from the raw logits (max commutes with a
        # positive temperature), one all-reduce for every token at once.
        gmax = torch.full((N,), float("-inf"), dtype=torch.float32, device=device)
        if Vs > 0:
            for s in range(0, N, chunk_tokens):
                gmax[s : s + chunk_tokens] = flat[s : s + chunk_tokens, :Vs].amax(dim=-1).float()
        gmax.div_(temperature)
        if world > 1:
            parallel.all_reduce(gmax, op=dist.ReduceOp.MAX, group=tp_group)

        # Pass 2: per chunk, t = logits / T - max in one float32 [chunk, V/TP] buffer (the only
        # temporary), then overwritten in place: e = exp(t), then e * log(e) = e * t.
        # sums[:, 0] = sum e, [:, 1] = t at the target (owner rank only), [:, 2] = sum e * t
        # (entropy). One SUM all-reduce for every token at once.
        local = tgt - vocab_start
        owned = (local >= 0) & (local < Vs)
        local = torch.where(owned, local, 0)
        sums = torch.zeros(N, 3, dtype=torch.float32, device=device)
        for s in range(0, N, chunk_tokens):
            e = slice(s, s + chunk_tokens)
            if Vs == 0:
                break
            t = flat[e, :Vs].to(torch.float32, copy=True)
            if temperature != 1.0:
                t.div_(temperature)
            t.sub_(gmax[e, None])
            sums[e, 1] = torch.where(owned[e], t.gather(1, local[e, None]).squeeze(1), 0.0)
            t.exp_()
            sums[e, 0] = t.sum(dim=-1)
            if with_entropy:
                sums[e, 2] = t.xlogy_(t).sum(dim=-1)  # xlogy(0, 0) = 0 where exp underflowed
            del t
        if world > 1:
            parallel.all_reduce(sums, op=dist.ReduceOp.SUM, group=tp_group)
        log_z = torch.log(sums[:, 0])  # [N]: logsumexp(logits / T) - max
        logp = sums[:, 1] - log_z
        if with_entropy:
            # H = -sum p log p = log Z - sum(exp(t) * t) / Z, with t relative to the max.
            entropy = _unflatten(log_z - sums[:, 2] / sums[:, 0], pshape, order)
        else:
            entropy = logp.new_empty(0)

        ctx.save_for_backward(logits, targets, gmax + log_z)  # per-token logsumexp of logits/T
        ctx.tp_group, ctx.vocab_start, ctx.temperature, ctx.chunk_tokens, ctx.num_valid = (
            tp_group, vocab_start, temperature, chunk_tokens, num_valid,
        )
        ctx.mark_non_differentiable(entropy)
        return _unflatten(logp, pshape, order), entropy

    @staticmethod
    def backward(ctx, grad_logp, _grad_entropy):
        # d logp / d logits_v = (onehot_v - softmax_v) / T for the local vocabulary slice v: the
        # global max and sum-exp enter through lse, whose derivative is exactly the softmax, so
        # no further communication is needed (Megatron's output layer reduces input grads).
        logits, targets, lse = ctx.saved_tensors
        flat, pshape, order = _flatten_tokens(logits)
        N, _ = flat.shape
        Vs = ctx.num_valid
        tgt = targets.permute(*order).reshape(-1)
        g = grad_logp.permute(*order).reshape(-1).to(torch.float32) / ctx.temperature  # [N]
        local = tgt - ctx.vocab_start
        owned = (local >= 0) & (local < Vs)
        local = torch.where(owned, local, 0)
        grad_flat = torch.zeros_like(flat, memory_format=torch.contiguous_format)  # padding: 0
        C = ctx.chunk_tokens
        for s in range(0, N, C if Vs > 0 else max(N, 1)):
            if Vs == 0:
                break
            e = slice(s, s + C)
            p = flat[e, :Vs].to(torch.float32, copy=True)
            if ctx.temperature != 1.0:
                p.div_(ctx.temperature)
            p.sub_(lse[e, None]).exp_().mul_(-g[e, None])  # -g * softmax
            p.scatter_add_(1, local[e, None], torch.where(owned[e], g[e], 0.0)[:, None])
            grad_flat[e, :Vs] = p
            del p
        grad = _unflatten(grad_flat, pshape + (flat.shape[1],), order + [len(order)])
        return grad, None, None, None, None, None, None, None


def vocab_parallel_logprobs_entropy(
    logits_shard: Tensor,
    targets: Tensor,
    *,
    tp_group,
    vocab_start: int,
    temperature: float = 1.0,
    chunk_tokens: int = 1024,
    with_entropy: bool = True,
    num_valid: int | None = None,
) -> tuple[Tensor, Tensor | None]:
    """log p(target) and entropy of softmax(logits / temperature) over the full vocabulary.

    logits_shard: [..., V/TP] this rank's vocabulary slice (any float dtype, e.g. bf16),
    covering token ids [vocab_start, vocab_start + V/TP); targets: [...] int64 token ids in the
    full vocabulary. tp_group: the tensor-parallel process group (None or size 1: single
    process). num_valid: how many leading columns of this shard are real vocabulary (the rest
    is Megatron's vocabulary padding, excluded from the softmax; may be 0 on the last TP ranks
    of a small vocabulary); None: all. Returns (logp [...] float32, differentiable w.r.t. logits_shard; entropy [...]
    float32 or None). The entropy is a METRIC: it is detached (no gradient flows through it).

    Memory: backward keeps a reference to the logits themselves (no copy) and the per-token
    logsumexp [N]. Forward and backward each use one float32 [chunk_tokens, V/TP] buffer at a
    time (plus, in backward, the gradient itself, in the logits' dtype): chunk_tokens x V/TP x 4
    bytes (trainer.logprob_chunk_tokens, counted by vapo-plan; 4096 x 152k is 2.5 GB).
    """
    if logits_shard.shape[:-1] != targets.shape:
        raise ValueError(
            f"targets shape {tuple(targets.shape)} must equal the logits' leading shape "
            f"{tuple(logits_shard.shape[:-1])}"
        )
    if not logits_shard.is_floating_point():
        raise ValueError(f"logits must be floating point, got {logits_shard.dtype}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got temperature={temperature}")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got chunk_tokens={chunk_tokens}")
    vocab = logits_shard.shape[-1] * _group_size(tp_group)
    if targets.numel() and bool(((targets < 0) | (targets >= vocab)).any()):
        bad = targets[(targets < 0) | (targets >= vocab)][0].item()
        raise ValueError(f"target token id {bad} is outside the vocabulary [0, {vocab})")
    width = logits_shard.shape[-1]
    num_valid = width if num_valid is None else max(0, min(int(num_valid), width))
    logp, entropy = _VocabParallelLogProbs.apply(
        logits_shard, targets.long(), tp_group, int(vocab_start), float(temperature),
        int(chunk_tokens), bool(with_entropy), num_valid,
    )
    return logp, (entropy if with_entropy else None)
