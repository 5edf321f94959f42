"""The actor on Megatron: old log-probs (step 4, forward only) and the PPO + NLL update (step 7).

Loss of one optimizer step over the global mini-batch (VAPO components 4, 5, 6):
    L = L_PPO + mu * L_NLL,   L_PPO = -(1/N) sum_i sum_t min(r A, clip(r, 1-eps_low, 1+eps_high) A)
                              L_NLL = -(1/N_pos) sum_{i correct} sum_t logp(a_t)
schedule.py explains why each micro-batch returns
    loss_sum = pg_sum + mu * (N / N_pos) * nll_sum,     num_tokens = its response tokens,
so that after finalize_model_grads divides by N the gradient is exactly grad L.
With the sample-level ablation, pg_sum is the sum over responses of per-response means and is
scaled by N / M (M = responses with at least one token in the global mini-batch) the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch

from vapo_megatron.algorithms.losses import nll_loss_sum, policy_loss_sum
from vapo_megatron.algorithms.normalization import GlobalCounts
from vapo_megatron.data.batch import RolloutBatch, shifted_targets
from vapo_megatron.mcore import parallel
from vapo_megatron.mcore.model import TrainModel
from vapo_megatron.mcore.routing_replay import mismatch_share
from vapo_megatron.mcore.update import UpdateSettings, forward_only, optimize
from vapo_megatron.mcore.vocab_parallel import vocab_parallel_logprobs_entropy


@dataclass(frozen=True)
class PolicyLossSettings:
    eps_low: float
    eps_high: float
    dual_clip_c: float | None
    loss_agg: str          # "token" | "sample"
    nll_coef: float        # mu
    temperature: float     # the rollout's: log-probs are log_softmax(logits / T), as SGLang's
    chunk_tokens: int      # trainer.logprob_chunk_tokens (vocab_parallel's float32 buffer)


def token_logprobs(logits_shard: torch.Tensor, targets: torch.Tensor, *, temperature: float,
                   vocab_size: int, with_entropy: bool, chunk_tokens: int):
    """[b, S, V_pad/TP] vocab-parallel logits -> log-probs [b, S] (and entropy [b, S]).

    Megatron pads the vocabulary to a multiple of 128*TP; the padded columns are not part of
    the model's distribution (neither HF's nor SGLang's), so each rank excludes its share of
    them (a small vocabulary can leave the last TP ranks with none at all).
    """
    width = logits_shard.shape[-1]
    vocab_start = parallel.tp_rank() * width
    return vocab_parallel_logprobs_entropy(
        logits_shard, targets, tp_group=parallel.tp_group(), vocab_start=vocab_start,
        temperature=temperature, with_entropy=with_entropy, num_valid=vocab_size - vocab_start,
        chunk_tokens=chunk_tokens,
    )


def logprob_outputs(mb: RolloutBatch, logits: torch.Tensor, *, temperature: float, vocab_size: int, chunk_tokens: int):
    logp, entropy = token_logprobs(
        logits, shifted_targets(mb.tokens).to(logits.device), temperature=temperature,
        vocab_size=vocab_size, with_entropy=True, chunk_tokens=chunk_tokens,
    )
    zero = logits.new_zeros(())
    return (zero, torch.tensor(1, dtype=torch.int),
            {"logp": logp.detach().float().cpu(), "entropy": entropy.float().cpu()})


def policy_loss(mb: RolloutBatch, logits: torch.Tensor, *, settings: PolicyLossSettings,
                 counts: GlobalCounts, vocab_size: int):
    device = logits.device
    logp, entropy = token_logprobs(
        logits, shifted_targets(mb.tokens).to(device), temperature=settings.temperature,
        vocab_size=vocab_size, with_entropy=True, chunk_tokens=settings.chunk_tokens,
    )
    mask = mb.mask.to(device)
    old_logp, adv = mb.old_logp.to(device), mb.advantages.to(device)
    # Partial rollout: decoupled PPO's importance weight of each token (algorithms/off_policy.py).
    weights = mb.extras["is_weights"].to(device) if "is_weights" in mb.extras else None
    pg_sum, metrics = policy_loss_sum(logp, old_logp, adv, mask, eps_low=settings.eps_low, eps_high=settings.eps_high,
                                      dual_clip_c=settings.dual_clip_c, loss_agg=settings.loss_agg, weights=weights)
    if settings.loss_agg == "sample":
        pg_sum = pg_sum * (counts.tokens / counts.responses) if counts.responses else pg_sum * 0.0  # M = 0: N = 0
    loss = pg_sum
    nll_sum = nll_loss_sum(logp, mask, mb.correct.to(device))
    if settings.nll_coef > 0 and counts.pos_tokens > 0:
        loss = loss + settings.nll_coef * (counts.tokens / counts.pos_tokens) * nll_sum
    # Metric sums; update.py divides by the global N (N_pos for the NLL).
    logs = {
        "actor/clipfrac_sum": metrics["clipped_tokens"],
        "actor/clipfrac_high_sum": metrics["clipped_high_tokens"],
        "actor/clipfrac_low_sum": metrics["clipped_low_tokens"],
        "actor/approx_kl_sum": metrics["approx_kl_sum"],
        "actor/ratio_mean_sum": metrics["ratio_sum"],
    }
    logs["actor/pg_loss_sum"] = pg_sum.detach()          # / N  -> L_PPO
    logs["actor/nll_loss_sum"] = nll_sum.detach()        # / N_pos -> L_NLL
    logs["actor/entropy_sum"] = (entropy * mask).sum()   # / N
    return loss, mask.sum().int().cpu(), logs


class Actor:
    """The policy: a TrainModel with the loss settings of its updates."""

    def __init__(self, model: TrainModel, loss: PolicyLossSettings, update: UpdateSettings):
        self.model, self.loss, self.settings = model, loss, update

    def log_probs(self, batch: RolloutBatch) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
        """Step 4: the trainer's own log-probs of the sampled tokens and their entropy, both
        [B, S] at prediction positions. PPO's old log-probs are recomputed here rather than taken
        from the rollout engine (VAPO sec. 3). With routing replay the forward takes the engine's
        routes, and the logs hold moe/routing_mismatch (routing_replay.py)."""
        fn = partial(logprob_outputs, temperature=self.loss.temperature, vocab_size=self.model.vocab_size,
                     chunk_tokens=self.loss.chunk_tokens)
        replay = self.model.replay
        if replay is not None and batch.routes is not None:
            replay.count()
        out = forward_only(self.model, batch, fn, ("logp", "entropy"), self.settings.max_tokens)
        logs = ({"moe/routing_mismatch": mismatch_share(out["routing_mismatch"], batch)} if "routing_mismatch" in out
                else {})
        return out["logp"], out["entropy"], logs

    def update(self, batch: RolloutBatch) -> dict[str, float]:
        """Step 7: PPO (clip-higher, token-level) + mu * positive-example NLL on `batch`
        (old_logp and advantages filled in); one optimizer step per mini-batch and epoch."""
        def loss_for(counts: GlobalCounts):
            return partial(policy_loss, settings=self.loss, counts=counts, vocab_size=self.model.vocab_size)

        return optimize(self.model, "actor", batch, loss_for, self.settings)


__all__ = ["Actor", "PolicyLossSettings", "logprob_outputs", "policy_loss", "token_logprobs"]
