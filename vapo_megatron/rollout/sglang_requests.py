"""What the SGLang engines send and read back: one request per sample, and each answer as a
RolloutOutput (rollout/sglang_engine.py drives the calls; docs/weight_sync.md lists every field and
the SGLang source line it was checked against).

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
The suite reads these lines from SGLang's source; the HTTP client sends the
same requests (sglang_http.py).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

from vapo_megatron.data.routes import sglang_routes
from vapo_megatron.rollout.base import Continuation, RolloutOutput, SamplingParams


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


def expand_requests(prompt_ids: Sequence[Sequence[int]],
                    p: SamplingParams) -> tuple[list[list[int]], list[dict], list[int]]:
    """One request per sample, grouped by prompt: (input_ids, sampling params, prompt index)."""
    ids, sps, owners = [], [], []
    for i, prompt in enumerate(prompt_ids):
        for j in range(p.n):
            ids.append(list(prompt))
            sps.append(sampling_params_dict(p, i, j))
            owners.append(i)
    return ids, sps, owners


def parse_output(out: dict, prompt_index: int, version: int, *, prompt_len: int = 0,
                 routes: tuple[int, int, int] | None = None) -> RolloutOutput:
    """One generate result: {"output_ids": [...], "meta_info": {"finish_reason": {"type": ...},
    "output_token_logprobs": [(logprob, token_id, text or None), ...], ...}}
    (tokenizer_manager.py: the output dict and detokenize_logprob_tokens). `version` is the
    weight version the wrapper loaded: sglang.Engine has no call that sets meta_info's
    "weight_version" (update_weights_from_tensor does not forward the request's field).
    routes: (MoE layers, k, experts) when the request asked for return_routed_experts: meta_info's
    "routed_experts" covers the prompt's `prompt_len` tokens and all response tokens but the last."""
    meta = out["meta_info"]
    reason = meta["finish_reason"]["type"] if isinstance(meta["finish_reason"], dict) else meta["finish_reason"]
    if reason not in ("stop", "length"):
        raise RuntimeError(f"SGLang request for prompt {prompt_index} ended with "
                           f"finish_reason={meta['finish_reason']!r}")
    token_ids = list(out["output_ids"])
    logprobs = None
    if "output_token_logprobs" in meta and meta["output_token_logprobs"] is not None:
        pairs = meta["output_token_logprobs"]
        if [int(x[1]) for x in pairs] != token_ids:
            raise RuntimeError(f"SGLang output for prompt {prompt_index}: output_token_logprobs token ids "
                               f"do not match output_ids ({len(pairs)} vs {len(token_ids)} tokens)")
        logprobs = [float(x[0]) for x in pairs]
    routed = None
    if routes is not None:
        where = f"SGLang output for prompt {prompt_index}"
        if "routed_experts" not in meta or not meta["routed_experts"]:
            raise RuntimeError(f"{where} has no routed_experts: the engine must run with "
                               "--enable-return-routed-experts")
        layers, k, experts = routes
        routed = sglang_routes(meta["routed_experts"], rows=max(prompt_len + len(token_ids) - 1, 0), layers=layers, k=k,
                               num_experts=experts, where=where)
    return RolloutOutput(prompt_index=prompt_index, token_ids=token_ids, finish_reason=reason, logprobs=logprobs,
                         weight_version=version, routes=routed)


def continuation_requests(requests: Sequence[Continuation],
                          params: SamplingParams) -> tuple[list[list[int]], list[dict]]:
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


__all__ = ["continuation_requests", "expand_requests", "parse_output", "sampling_params_dict"]
