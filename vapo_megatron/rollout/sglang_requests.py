"""SGLang generate requests (sglang_engine.py sends them): one request per sample, with its own seed.

    ids, sampling_params, owners = expand_requests(prompt_ids, params)   n per prompt, grouped
    ids, sampling_params = continuation_requests(requests, params)       partial rollout: one per response

Partial rollout (rollout.partial) continues a carried-over response by the same generate call,
with prompt + response so far as its input_ids (checked against sglang 0.5.23). Why the
continuation is the one-go response of its seed (sglang/srt):
- the request's sampling_seed is the sample's own (sampling_params_dict, as in generate), and
  SGLang samples with it only under enable_deterministic_inference (trainer.deterministic:
  sglang_engine.engine_kwargs; sampling/sampling_batch_info.py builds the seed tensor only then);
- layers/sampler.py multinomial_with_seed draws the Gumbel noise of a token from murmur_hash32(seed,
  position, column): it depends on the request's seed and the position only, not on the batch;
- model_executor/model_runner.py `sample` passes, for a prefill, `forward_batch.seq_lens - 1` (the
  last input position) and for a decode step `forward_batch.positions` (the input token's
  position): the next token after prompt + k response tokens is drawn at position P + k - 1
  either way, so a continuation prefilling prompt + k tokens draws what the one-go decode drew;
- max_new_tokens is the request's budget for this round; finish_reason "length" then means the
  round ended it, and partial.py tells that from rollout.max_new_tokens by the response's length.
Its log-probs are output_token_logprobs of the new tokens only (return_logprob, parse_output).
tests/unit/test_sglang_api.py reads these lines from SGLang's source; the HTTP client sends the
same requests (sglang_http.py).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

from vapo_megatron.rollout.base import Continuation, SamplingParams


def sampling_params_dict(p: SamplingParams, prompt_index: int, sample_index: int) -> dict:
    """SGLang's per-request sampling params for one sample (n=1 per request, own seed)."""
    d = {
        "max_new_tokens": p.max_new_tokens,
        "temperature": p.temperature,
        "top_p": p.top_p,
        "top_k": p.top_k if p.top_k > 0 else -1,
        "n": 1,
        "sampling_seed": p.sample_seed(prompt_index, sample_index),
        "skip_special_tokens": False,
        "no_stop_trim": True,  # keep the stop token in the response: the policy learns to stop
    }
    if p.stop_token_ids:
        d["stop_token_ids"] = list(p.stop_token_ids)
    return d


def expand_requests(prompt_ids: Sequence[Sequence[int]], p: SamplingParams) -> tuple[list[list[int]], list[dict], list[int]]:
    """One request per sample, grouped by prompt: (input_ids, sampling params, prompt index)."""
    ids, sps, owners = [], [], []
    for i, prompt in enumerate(prompt_ids):
        for j in range(p.n):
            ids.append(list(prompt))
            sps.append(sampling_params_dict(p, i, j))
            owners.append(i)
    return ids, sps, owners


def continuation_requests(requests: Sequence[Continuation], params: SamplingParams) -> tuple[list[list[int]], list[dict]]:
    """(input_ids, sampling params) of one SGLang request per response: prompt + its tokens so far,
    its own seed, at most its max_new_tokens new tokens; the rest of `params` as generate sends it."""
    ids, sps = [], []
    for r in requests:
        if r.max_new_tokens < 1:
            raise ValueError("extend: every request needs max_new_tokens >= 1")
        ids.append(list(r.prompt_ids) + list(r.response_ids))
        # sample_seed(0, 0) of a one-sample params is its seed: the response's own
        sps.append(sampling_params_dict(replace(params, n=1, seed=r.seed, max_new_tokens=r.max_new_tokens), 0, 0))
    return ids, sps


__all__ = ["continuation_requests", "expand_requests", "sampling_params_dict"]
