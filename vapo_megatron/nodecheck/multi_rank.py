"""vapo-check --ranks' checks on running colocated SGLang engines (nodecheck/ranks_mode.py starts them
on the node's GPUs; vapo_megatron/check.py's docstring says what each proves).

    check_on_engine(hf_dir, engine, name=..., dtype=...)   the whole check of one model: build, sync, sample, compare

Its steps, each a function of its own (the suite runs check_on_engine on SGLang's CPU
engines, then the steps with a wrong weight planted between them):
    build_actor(hf_dir, dtype)                  the actor at the world's TP (sequence parallel at TP > 1)
    sync(chunks, hf_cfg, engine)                one weight sync (rollout/weight_sync.py stream_weights)
    sample(engine, hf_cfg, routes=...)          every engine's answers, on every rank (Sampled)
    compare_logprobs(chunks, hf_cfg, sampled, ...)   sglang_sync:<name>
    compare_routes(chunks, hf_cfg, sampled, ...)     routed_experts:<name>

Collectives: every rank makes the same calls in the same order whatever the data. What one rank
alone produces (an owner's answers, or its error) reaches every rank through one all_gather_object,
and each verdict is computed from what every rank then holds, so all ranks report alike and go on
to the same next call. A failure inside a collective itself (a sync, a forward) is not caught
here: ranks_mode.py ends that rank, and torchrun the others.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from types import SimpleNamespace

import torch
import torch.distributed as dist

# max |engine - trainer log-prob| over every answer token: float32 agrees to rounding (the CPU run
# of the suite: below 1e-5); bf16 kernels of two programs differ by ~1e-2 in a logit (model_logits),
# and a log-prob adds the log-sum-exp's error. Not yet measured on a GPU (docs/what_ran_where.md).
LOGP_TOL = {torch.float32: 1e-4, torch.bfloat16: 0.1}
# moe/routing_mismatch allowed: bf16 router scores a kernel apart flip near-tied top-k choices for a
# few tokens; routes read from the wrong token or layer, or a capture buffer left unwritten, differ
# in nearly every token (4 experts, top-2: a random pair is the trainer's in 1 of 6 per layer).
MISMATCH_TOL = 0.25
PROMPT_LENS = (5, 9, 12, 16, 7, 11, 3, 14)  # 8 prompts, shared out over the engines
SAMPLES, NEW_TOKENS = 2, 16
NO_CAPTURE_ON_CPU = ("SGLang's CPU engine cannot capture routes (enable_return_routed_experts registers pinned host "
                     "memory through CUDA at start-up); the suite runs the comparison's logic on hand-built routes")


@dataclass(frozen=True)
class Sampled:
    """Every engine's answers, on every rank, in the order of the generating ranks."""

    prompts: list[list[int]]  # each answer's prompt
    tokens: list[list[int]]
    logprobs: list[list[float] | None]
    routes: list[torch.Tensor] | None  # [prompt + answer - 1, MoE layers, k] per answer, when asked for
    engines: int  # engines that generated
    errors: list[str]  # "rank R: ..." of each owner whose generate raised


def build_actor(hf_dir, dtype: torch.dtype) -> tuple[list, dict]:
    """The actor at the world's TP (every rank one TP rank), loaded from hf_dir; sequence parallel at
    TP > 1, as in every shipped GPU config (megatron needs it to train a MoE at TP > 1)."""
    import model_providers
    from vapo_megatron.mcore import parallel
    from vapo_megatron.mcore.models import build_chunks
    from vapo_megatron.weights.hf_read import load_hf_weights

    hf_cfg = model_providers.read_hf_config(str(hf_dir))
    chunks = build_chunks(hf_cfg, params_dtype=dtype, critic=False, sequence_parallel=parallel.tp_size() > 1)
    load_hf_weights(chunks, model_providers.family_for(hf_cfg), hf_cfg, str(hf_dir))
    return chunks, hf_cfg


def sync(chunks: list, hf_cfg: dict, engine, *, version: int = 1, bucket_bytes: int = 1 << 20):
    """Collective. The trainer's weights into the engines: stream_weights in buckets of 1 MiB, so
    that a tiny model's sync still takes several buckets, each a collective over its engine group."""
    import model_providers
    from vapo_megatron.rollout.weight_sync import stream_weights

    return stream_weights(chunks, model_providers.family_for(hf_cfg), hf_cfg, engine, version=version,
                          bucket_bytes=bucket_bytes)


def prompts_for(hf_cfg: dict) -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(3, hf_cfg["vocab_size"], (n,), generator=gen).tolist() for n in PROMPT_LENS]


def _everyone(obj) -> list:
    from vapo_megatron.mcore import parallel

    got = [None] * dist.get_world_size()
    parallel.all_gather_object(got, obj, group=parallel.wait_group())
    return got


def _why(e: Exception) -> str:
    return f"rank {dist.get_rank()}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def sample(engine, hf_cfg: dict, *, routes: bool) -> Sampled:
    """Collective over the world. Each engine's owner samples its share of the prompts, as the
    trainer's Generator does (caches freed on every rank of the engine group first, the KV cache
    taken for the call and given back); then every rank holds every answer."""
    from vapo_megatron.rollout.base import SamplingParams

    prompts = prompts_for(hf_cfg)
    engine.sync_freed()  # every rank's cache emptied first (mcore/memory.py), as before the trainer's rollouts
    owners = [r for r, owns in enumerate(_everyone(engine.generates)) if owns]
    mine, error = [], None
    if engine.generates:
        share = prompts[owners.index(dist.get_rank())::len(owners)]
        try:
            if share:
                engine.resume_memory(("kv_cache", "cuda_graph"))
                outs = engine.generate(share, SamplingParams(n=SAMPLES, temperature=1.0, max_new_tokens=NEW_TOKENS,
                                                             seed=0, return_routes=routes))
                engine.release_memory(("kv_cache", "cuda_graph"))
                mine = [(share[o.prompt_index], o.token_ids, o.logprobs, o.routes) for o in outs]
        except Exception as e:  # noqa: BLE001 - every rank must learn of it (the module docstring)
            error = _why(e)
    got = _everyone((mine, error))
    answers = [a for part, _ in got for a in part]
    return Sampled(prompts=[list(a[0]) for a in answers], tokens=[list(a[1]) for a in answers],
                   logprobs=[a[2] for a in answers], routes=[a[3] for a in answers] if routes else None,
                   engines=len(owners), errors=[e for _, e in got if e])


def answers_batch(s: Sampled, k: int | None = None):
    """(RolloutBatch of the answers, with their routes packed when k is given; the engine's log-probs
    [B, S] at the trainer's prediction positions)."""
    from vapo_megatron.data.batch import RolloutBatch, pack_sequences, pad_ragged, to_sequence
    from vapo_megatron.data.routes import pack_routes

    tokens, pl, rl = pack_sequences(s.prompts, s.tokens)
    n = len(s.tokens)
    batch = RolloutBatch(tokens=tokens, prompt_lens=pl, response_lens=rl, rewards=torch.zeros(n),
                         correct=torch.zeros(n, dtype=torch.bool), group_ids=torch.arange(n) // SAMPLES,
                         routes=pack_routes(s.routes, tokens.shape[1], k) if k is not None else None)
    return batch, to_sequence(pad_ragged([lp or [] for lp in s.logprobs]), pl, rl, tokens.shape[1])


def unusable(s: Sampled) -> str | None:
    """Why these answers cannot be compared (the same on every rank), or None."""
    if s.errors:
        return f"generate failed: {'; '.join(s.errors)}"
    if not s.tokens or not any(s.tokens):
        return "the engines returned no answer tokens"
    if any(lp is None or len(lp) != len(t) for lp, t in zip(s.logprobs, s.tokens)):
        return "an answer came without a log-prob per token"
    return None


def logprob_verdict(trainer: torch.Tensor, engine: torch.Tensor, mask: torch.Tensor, tol: float) -> tuple[str, str]:
    """PASS when every answer token's log-prob is the trainer's within tol: (status, figures)."""
    diff = (trainer - engine).abs() * mask
    n = int(mask.sum())
    worst, mean = float(diff.max()), float(diff.sum()) / max(n, 1)
    status = "PASS" if n > 0 and worst <= tol else "FAIL"
    return status, (f"{n} answer tokens: max |engine - trainer log-prob| {worst:.3g}, mean {mean:.3g} "
                    f"(tolerance {tol:g})")


def compare_logprobs(chunks: list, hf_cfg: dict, s: Sampled, *, name: str, dtype: torch.dtype,
                     stats=None) -> tuple[str, str, str]:
    """Collective over the world (when the answers are usable). sglang_sync:<name>: the engines' log-probs
    of what they sampled against the trainer's own (step 4's forward_only with logprob_outputs, as the
    trainer takes old log-probs), temperature 1."""
    from vapo_megatron.mcore import parallel
    from vapo_megatron.mcore.actor import logprob_outputs
    from vapo_megatron.mcore.update import forward_only

    check = f"sglang_sync:{name}"
    if why := unusable(s):
        return check, "FAIL", why
    batch, engine_logp = answers_batch(s)
    fn = partial(logprob_outputs, temperature=1.0, vocab_size=hf_cfg["vocab_size"], chunk_tokens=1024)
    trainer = forward_only(SimpleNamespace(chunks=chunks, replay=None), batch, fn, ("logp",), 10**6)["logp"]
    status, figures = logprob_verdict(trainer, engine_logp, batch.mask, LOGP_TOL[dtype])
    on_gpu = parallel.device().type == "cuda"
    how = (f"trainer TP={parallel.tp_size()}, {s.engines} SGLang engine(s) at TP={parallel.tp_size() // s.engines}, "
           f"{str(dtype).removeprefix('torch.')}; weights as "
           + ("CUDA IPC handles gathered per engine group" if on_gpu else "shared memory (CPU)")
           + (f", {stats.buckets} bucket(s) on rank {dist.get_rank()}" if stats is not None else ""))
    return check, status, f"{how}; {figures}"


def route_problems(s: Sampled, k: int) -> list[str]:
    """What is wrong with the engine's routes beyond what their decoding checks (rollout/sglang_requests.py
    parse_output: their size and expert range): each answer's rows (prompt + answer - 1) and each
    token's k experts in a layer all different (an unwritten capture buffer reads as expert 0 k times)."""
    out = []
    for i, (r, p, t) in enumerate(zip(s.routes, s.prompts, s.tokens)):
        if r is None or r.ndim != 3 or r.shape[2] != k or r.shape[0] != len(p) + len(t) - 1:
            out.append(f"answer {i}: routes {None if r is None else tuple(r.shape)} for {len(p)} prompt + {len(t)} "
                       f"answer tokens, top-{k}")
            continue
        repeated = (r.long().sort(dim=-1).values.diff(dim=-1) == 0).any(dim=-1).any(dim=-1)  # [rows]
        if repeated.any():
            out.append(f"answer {i}: {int(repeated.sum())} tokens with an expert twice in one layer")
    return out


def routes_verdict(mismatch: float, with_replay: float, without: float, tol: float) -> tuple[str, str]:
    """Of well-formed routes (route_problems): PASS when the trainer's own routers mostly agree with
    them (moe/routing_mismatch <= MISMATCH_TOL), and replaying them brings the trainer's log-probs at
    least as close to the engine's as its own routing does, within tol."""
    ok = mismatch <= MISMATCH_TOL and with_replay <= without + 1e-6 and with_replay <= tol
    return ("PASS" if ok else "FAIL"), (f"moe/routing_mismatch {mismatch:.3f} (at most {MISMATCH_TOL:g}); max |engine "
                                        f"- trainer log-prob| with replay {with_replay:.3g}, without {without:.3g} "
                                        f"(tolerance {tol:g})")


def compare_routes(chunks: list, hf_cfg: dict, s: Sampled, *, name: str, dtype: torch.dtype) -> tuple[str, str, str]:
    """Collective over the world (when the answers are usable). routed_experts:<name>: SGLang's routed
    experts (return_routed_experts) replayed by the trainer (nodecheck/replay.py replayed_errors)."""
    from vapo_megatron.data.routes import route_shape
    from vapo_megatron.nodecheck.replay import replayed_errors

    check = f"routed_experts:{name}"
    if why := unusable(s):
        return check, "FAIL", why
    layers, k, experts = route_shape(hf_cfg)
    problems = route_problems(s, k)
    if problems:  # nothing to replay: every rank skips the forwards alike (the routes are every rank's)
        return check, "FAIL", "; ".join(problems[:3])
    batch, engine_logp = answers_batch(s, k)
    got = replayed_errors(chunks, hf_cfg, batch, engine_logp)
    status, figures = routes_verdict(got[True][1], got[True][0], got[False][0], LOGP_TOL[dtype])
    routed = int(sum(len(t) - 1 for t in s.tokens))
    return check, status, (f"SGLang's routes of {routed} answer tokens ({layers} MoE layers, top-{k} of {experts}) "
                           f"replayed by the trainer: {figures}")


def check_on_engine(hf_dir, engine, *, name: str, dtype: torch.dtype) -> list[tuple[str, str, str]]:
    """Collective over the world. One model's checks on running engines (started on hf_dir's config):
    the actor built from hf_dir, one sync, the engines' answers, sglang_sync and, for a MoE model,
    routed_experts (SKIP where the engines were started without SGLang's capture)."""
    from vapo_megatron.data.routes import route_shape
    from vapo_megatron.rollout.sglang_engine import cpu_engine

    chunks, hf_cfg = build_actor(hf_dir, dtype)
    stats = sync(chunks, hf_cfg, engine)
    routes = engine.routes is not None
    s = sample(engine, hf_cfg, routes=routes)
    lines = [compare_logprobs(chunks, hf_cfg, s, name=name, dtype=dtype, stats=stats)]
    if route_shape(hf_cfg) is not None:
        if routes:
            lines.append(compare_routes(chunks, hf_cfg, s, name=name, dtype=dtype))
        else:
            lines.append((f"routed_experts:{name}", "SKIP", NO_CAPTURE_ON_CPU if cpu_engine() else
                          "the engines were started without return_routed_experts"))
    return lines


__all__ = ["LOGP_TOL", "MISMATCH_TOL", "NO_CAPTURE_ON_CPU", "Sampled", "answers_batch", "build_actor",
           "check_on_engine", "compare_logprobs", "compare_routes", "logprob_verdict", "prompts_for", "route_problems",
           "routes_verdict", "sample", "sync", "unusable"]
