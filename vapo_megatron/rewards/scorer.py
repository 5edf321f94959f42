"""Step 3 of the loop: the verifier's rewards for a rollout, and the rollout as batch tensors.

    scorer = Scorer(reward_fn, tokenizer, stop_token_ids, shaping)
    results = scorer.results(rollout)       the verifier's RewardResult of each response
    batch, logs = scorer.score(rollout)     RolloutBatch of this rank; reward/*, response_length/*
                                            (reward/errors, /timeouts: of the calls it made itself)

The batch's rewards are the verifier's scores plus the overlong penalty (shaping.py), when on; its
routes are the engine's (routing replay), when the outputs carry them.

The evaluation (evaluation/sampled.py) judges its samples with the same decode and reward.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from vapo_megatron.data.batch import RolloutBatch, pack_sequences
from vapo_megatron.data.routes import pack_routes
from vapo_megatron.mcore import parallel
from vapo_megatron.rewards import RewardFn, score_batch, summarize
from vapo_megatron.rewards.shaping import OverlongShaping


class Scorer:
    def __init__(self, reward_fn: RewardFn, tokenizer, stop_token_ids: tuple[int, ...],
                 shaping: OverlongShaping | None = None):
        self.reward_fn, self.tokenizer, self.stop_token_ids = reward_fn, tokenizer, stop_token_ids
        self.shaping = shaping

    def decode(self, outputs) -> list[str]:
        return [self.tokenizer.decode(o.token_ids, skip_special_tokens=True) for o in outputs]

    def judge(self, prompt_texts: list[str], texts: list[str], answers: list[str]):
        """(scores float32 [n], correct bool [n], counters) from the run's reward function."""
        return score_batch(self.reward_fn, prompt_texts, texts, answers)

    def results(self, rollout) -> list:
        """The verifier's RewardResult of each response of a rollout (rollout/generator.py), in
        order; those dynamic sampling already judged (rollout.results) are not judged again."""
        if rollout.results is not None:
            return rollout.results
        owners = [rollout.prompts[o.prompt_index] for o in rollout.outputs]
        return self.reward_fn([p.prompt_text for p in owners], self.decode(rollout.outputs), [p.answer for p in owners])

    def score(self, rollout) -> tuple[RolloutBatch, dict[str, float]]:
        """Rewards of this DP rank's rollout (rollout/generator.py: Rollout), its batch tensors,
        and the reward and length figures over every DP rank."""
        texts_count = len(rollout.outputs)
        owners = [rollout.prompts[o.prompt_index] for o in rollout.outputs]
        scores, correct, counters = summarize(self.results(rollout))
        # An empty response still occupies one position: the engine's stop token.
        responses = [o.token_ids if o.token_ids else [self.stop_token_ids[0]] for o in rollout.outputs]
        tokens, pl, rl = pack_sequences([p.prompt_ids for p in owners], responses)
        # Overlong shaping on the engine's length (an empty response counts 0 tokens).
        penalty = self.shaping(torch.tensor([len(o.token_ids) for o in rollout.outputs])) if self.shaping else None
        batch = RolloutBatch(
            tokens=tokens, prompt_lens=pl, response_lens=rl,
            rewards=(scores + penalty if penalty is not None else scores).float(), correct=correct.bool(),
            group_ids=torch.tensor([o.prompt_index for o in rollout.outputs], dtype=torch.long),
        )
        if rollout.outputs and all(o.routes is not None for o in rollout.outputs):  # routing replay
            batch.routes = pack_routes([o.routes for o in rollout.outputs], tokens.shape[1],
                                       rollout.outputs[0].routes.shape[2])
        engine_logp = [o.logprobs for o in rollout.outputs]
        if all(lp is not None for lp in engine_logp):
            batch.extras["engine_logp"] = engine_logp
        if rollout.outputs and all(o.token_versions is not None for o in rollout.outputs):  # partial rollout
            batch.extras["token_versions"] = [o.token_versions for o in rollout.outputs]
        stats = torch.tensor([
            float(scores.sum()), float(correct.sum()), float(texts_count), float(rl.sum()),
            float(sum(o.finish_reason == "length" for o in rollout.outputs)),
            float(counters["reward/timeouts"]), float(counters["reward/errors"]),
            float(penalty.sum()) if penalty is not None else 0.0,
            float((penalty < 0).sum()) if penalty is not None else 0.0,
        ], dtype=torch.float64)
        max_len = torch.tensor([float(rl.max())])
        if parallel.dp_size() > 1:
            parallel.all_reduce(stats, group=parallel.dp_group())
            parallel.all_reduce(max_len, op=dist.ReduceOp.MAX, group=parallel.dp_group())
        total, n_correct, count, length_sum, truncated, timeouts, errors, penalty_sum, penalized = stats.tolist()
        logs = {
            "reward/mean": total / count,
            "reward/accuracy": n_correct / count,
            "response_length/mean": length_sum / count,
            "response_length/max": float(max_len),
            "response_length/clip_ratio": truncated / count,
        }
        if rollout.results is None:  # judged here; else whoever judged counts the failures (dynamic sampling:
            logs |= {"reward/timeouts": timeouts, "reward/errors": errors}  # every round, not only the kept groups)
        if self.shaping is not None and self.shaping.buffer > 0:  # reward/mean is the verifier's; the batch adds these
            logs["reward/overlong_penalty_mean"] = penalty_sum / count
            logs["reward/overlong_fraction"] = penalized / count
        return batch, logs

    def close(self) -> None:
        self.reward_fn.close()


__all__ = ["Scorer"]
