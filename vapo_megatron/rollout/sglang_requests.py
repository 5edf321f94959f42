"""What the SGLang engines send and read back: one request per sample, and each answer as a
RolloutOutput (rollout/sglang_engine.py drives the calls; docs/weight_sync.md lists every field and
the SGLang source line it was checked against)."""

from __future__ import annotations

from typing import Sequence

from vapo_megatron.rollout.base import RolloutOutput, SamplingParams
from vapo_megatron.rollout.routes import sglang_routes


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
        raise RuntimeError(f"SGLang request for prompt {prompt_index} ended with finish_reason={meta['finish_reason']!r}")
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
            raise RuntimeError(f"{where} has no routed_experts: the engine must run with --enable-return-routed-experts")
        layers, k, experts = routes
        routed = sglang_routes(meta["routed_experts"], rows=max(prompt_len + len(token_ids) - 1, 0), layers=layers, k=k,
                               num_experts=experts, where=where)
    return RolloutOutput(prompt_index=prompt_index, token_ids=token_ids, finish_reason=reason, logprobs=logprobs,
                         weight_version=version, routes=routed)


__all__ = ["expand_requests", "parse_output", "sampling_params_dict"]
