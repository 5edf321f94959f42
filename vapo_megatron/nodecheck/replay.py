"""vapo-check's routing_replay check (MoE presets): the embedded engine on the device, synced from
the actor, samples with its routes; step 4's forward (mcore/update.py forward_only) with and without
routing replay (mcore/routing_replay.py) against the engine's log-probs (replayed_errors, which
vapo-check --ranks' routed_experts check runs on SGLang's routes). On a GPU it also counts the
synchronizing CUDA calls of each forward (torch.cuda.set_sync_debug_mode): replay adds none, its
routes reaching the GPU in one non-blocking copy (issue 55 item 3). Run through vapo_megatron/check.py."""

from __future__ import annotations

import contextlib
import warnings
from functools import partial
from types import SimpleNamespace

import torch

from vapo_megatron.nodecheck.models import Env, report


def check_routing_replay(env: Env) -> None:
    from transformers import AutoConfig

    import model_providers
    from vapo_megatron.data.batch import RolloutBatch, pack_sequences, pad_ragged, to_sequence
    from vapo_megatron.data.routes import pack_routes
    from vapo_megatron.rollout.base import SamplingParams
    from vapo_megatron.rollout.embedded import EmbeddedEngine
    from vapo_megatron.rollout.weight_sync import stream_weights

    name = f"routing_replay:{env.preset}"
    if env.actor is None:
        report(name, "SKIP", "model_logits did not build the actor")
        return
    hf_cfg = model_providers.read_hf_config(str(env.hf_dir))
    engine = EmbeddedEngine.from_hf_config(AutoConfig.from_pretrained(env.hf_dir), dtype=env.dtype,
                                           device=str(env.device))
    stream_weights(env.actor, model_providers.family_for(hf_cfg), hf_cfg, engine, version=1)
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, hf_cfg["vocab_size"], (int(n),), generator=gen).tolist() for n in (5, 9, 12, 16)]
    outs = engine.generate(prompts, SamplingParams(n=2, temperature=1.0, max_new_tokens=16, seed=0, return_routes=True))
    tokens, pl, rl = pack_sequences([prompts[o.prompt_index] for o in outs], [o.token_ids for o in outs])
    batch = RolloutBatch(tokens=tokens, prompt_lens=pl, response_lens=rl, rewards=torch.zeros(len(outs)),
                         correct=torch.zeros(len(outs), dtype=torch.bool), group_ids=torch.arange(len(outs)) // 2,
                         routes=pack_routes([o.routes for o in outs], tokens.shape[1], outs[0].routes.shape[2]))
    engine_logp = to_sequence(pad_ragged([o.logprobs for o in outs]), pl, rl, tokens.shape[1])
    del engine
    got = replayed_errors(env.actor, hf_cfg, batch, engine_logp)
    (with_replay, mismatch, with_syncs), (without, _, without_syncs) = got[True], got[False]
    atol = 1e-4 if env.dtype == torch.float32 else 5e-2  # model_logits' tolerance: bf16 kernels differ by ~1e-2
    ok = with_replay <= without + 1e-6 and with_replay < 10 * atol and with_syncs <= without_syncs
    counted = (f"; synchronizing CUDA calls in the forward: {with_syncs} with replay, {without_syncs} without"
               if env.device.type == "cuda" else "")
    report(name, "PASS" if ok else "FAIL",
           f"embedded engine {str(env.dtype).removeprefix('torch.')} on {env.device.type}, {int(batch.mask.sum())} "
           f"response tokens: moe/routing_mismatch {mismatch:.3f}; max |engine - trainer log-prob| with replay "
           f"{with_replay:.3g}, without {without:.3g}{counted}")


def replayed_errors(chunks: list, hf_cfg: dict, batch,
                    engine_logp: torch.Tensor) -> dict[bool, tuple[float, float, int]]:
    """Collective over the model-parallel group. Step 4's forward (mcore/update.py forward_only) of `batch`
    with routing replay of batch.routes (True) and without (False): {on: (max |engine_logp - trainer
    log-prob| over the response tokens, moe/routing_mismatch as the trainer computes it, the forward's
    synchronizing CUDA calls)}. Also vapo-check --ranks' routed_experts check (multi_rank.py)."""
    from vapo_megatron.mcore import parallel
    from vapo_megatron.mcore.actor import logprob_outputs
    from vapo_megatron.mcore.routing_replay import RouteReplay, mismatch_share
    from vapo_megatron.mcore.update import forward_only

    replay = RouteReplay(chunks, hf_cfg)
    model = SimpleNamespace(chunks=chunks, replay=replay)
    fn = partial(logprob_outputs, temperature=1.0, vocab_size=hf_cfg["vocab_size"], chunk_tokens=1024)
    got = {}
    for on in (True, False):
        replay.enabled = on
        replay.count()
        with synchronizing_calls(parallel.device()) as calls:
            out = forward_only(model, batch, fn, ("logp",), 10**6)
        got[on] = (((out["logp"] - engine_logp).abs() * batch.mask).max().item(),
                   mismatch_share(out["routing_mismatch"], batch), len(calls))
    return got


@contextlib.contextmanager
def synchronizing_calls(device: torch.device):
    """The warnings torch.cuda.set_sync_debug_mode("warn") gives for each synchronizing CUDA call
    made inside (an empty list off the GPU)."""
    calls: list = []
    if device.type != "cuda":
        yield calls
        return
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield calls
        finally:
            torch.cuda.set_sync_debug_mode("default")
    calls.extend(w for w in caught if "synchronizing" in str(w.message))


__all__ = ["check_routing_replay", "replayed_errors", "synchronizing_calls"]
