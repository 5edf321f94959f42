"""Benchmarks of the VAPO math against the common baselines, side by side in one run.

1. GAE: compute_gae (chunked scan over length-sorted groups) vs the per-time-step masked
   recurrence most PPO frameworks use (loop over t from T-1 to 0, updating the whole batch),
   same inputs, same process; median of repeats; beside each time, one call's tensor
   allocations as torch's profiler records them (benchmarks/allocations.py: count and MiB, in
   units of one [B, T] float32 tensor; on a CPU each fresh page is a fault at first touch);
   prints `ratio: baseline_time / ours`.
2. Log-prob + entropy, forward + backward, on [tokens x vocab-shard] logits: peak memory beyond
   the logits, ours vs log_softmax-based code. Each is measured in a fresh subprocess by the
   kernel's resident-set high-water mark (VmHWM, reset through /proc/self/clear_refs just
   before the measured call), the same way for both. Prints `ratio: ours_extra / logits_bytes`.

Run: python -m benchmarks.algo [--threads 1] [--only gae|logprob]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks.allocations import allocations, summary  # noqa: E402
from benchmarks.peak_rss import reset_peak_rss, rss_kib  # noqa: E402
from vapo_megatron.algorithms.gae import compute_gae, length_adaptive_lambda  # noqa: E402


# ----------------------------------------------------------------------------- GAE
def baseline_gae(rewards, values, mask, gamma, lam):
    """The masked per-time-step recurrence (one batch-wide update per position)."""
    B, T = rewards.shape
    m = mask.float()
    r, v = rewards * m, values * m
    advantages = torch.zeros_like(r)
    last = torch.zeros(B)
    next_value = torch.zeros(B)
    for t in reversed(range(T)):
        delta = r[:, t] + gamma * next_value - v[:, t]
        last = (delta + gamma * lam * last) * m[:, t]
        next_value = v[:, t]
        advantages[:, t] = last
    return advantages, advantages + v


def median_time(fn, repeats):
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def bench_gae(repeats: int) -> None:
    B, T = 1024, 8192
    g = torch.Generator().manual_seed(0)
    # Long-tailed lengths: lognormal (median ~665 tokens) clipped to [1, 8192], 8 at the limit.
    lengths = torch.exp(torch.randn(B, generator=g) * 1.0 + 6.5).round().clamp(1, T).long()
    lengths[:8] = T
    lengths = lengths[torch.randperm(B, generator=g)]
    mask = torch.arange(T)[None, :] < lengths[:, None]
    rewards = torch.zeros(B, T)
    rewards[torch.arange(B), lengths - 1] = torch.randint(0, 2, (B,), generator=g).float() * 2 - 1
    values = torch.randn(B, T, generator=g) * 0.5
    lam = length_adaptive_lambda(lengths, alpha=0.05)
    gamma = 1.0
    print(f"[gae] B={B} T={T} real tokens={int(lengths.sum())} ({lengths.sum().item() / (B * T):.1%} of B*T), "
          f"length median={int(lengths.median())} mean={lengths.float().mean():.0f} max={int(lengths.max())}, "
          f"per-response length-adaptive lambda (alpha=0.05), gamma={gamma}, float32, "
          f"torch threads={torch.get_num_threads()}")
    compute_gae(rewards, values, mask, gamma, lam)  # warm-up
    t_ours, (adv, ret) = median_time(lambda: compute_gae(rewards, values, mask, gamma, lam), repeats)
    t_base, (adv_b, ret_b) = median_time(lambda: baseline_gae(rewards, values, mask, gamma, lam), repeats)
    # Exactness against a float64 run of the baseline recurrence, and against the float32 one.
    adv64, ret64 = baseline_gae(rewards.double(), values.double(), mask, gamma, lam.double())
    def rel(a, b):
        return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()
    # One call of each under the profiler (after the timings: the profiler slows what it watches).
    unit = B * T * 4
    a_base = summary(allocations(lambda: baseline_gae(rewards, values, mask, gamma, lam))[1], unit)
    a_ours = summary(allocations(lambda: compute_gae(rewards, values, mask, gamma, lam))[1], unit)
    print(f"[gae] baseline (per-time-step masked recurrence): {t_base * 1e3:.1f} ms (median of {repeats}); {a_base}")
    print(f"[gae] ours (compute_gae):                         {t_ours * 1e3:.1f} ms (median of {repeats}); {a_ours}")
    print("[gae] allocations: one call each, torch's profiler (its outputs, advantages and returns, are 2 x [B, T])")
    diff = max(rel(adv, adv_b), rel(ret, ret_b))
    print(f"[gae] max relative difference ours vs baseline (max|a-b| / max|b|): {diff:.2e}")
    print(f"[gae] max relative difference vs float64 recurrence: ours {max(rel(adv, adv64), rel(ret, ret64)):.2e}, "
          f"baseline {max(rel(adv_b, adv64), rel(ret_b, ret64)):.2e}")
    if diff > 1e-5:
        raise SystemExit(f"[gae] FAILED: relative difference {diff:.2e} > 1e-5")
    print(f"ratio: {t_base / t_ours:.2f}")


# ----------------------------------------------------------------------------- log-probs
def logprob_child(method: str, tokens: int, vocab: int, dtype_name: str, chunk: int) -> None:
    """Runs in a fresh process: one forward + backward, prints peak bytes beyond the logits."""
    torch.set_num_threads(1)
    from vapo_megatron.mcore.vocab_parallel import vocab_parallel_logprobs_entropy

    dtype = getattr(torch, dtype_name)

    def forward(logits, targets):
        if method == "ours":
            logp, entropy = vocab_parallel_logprobs_entropy(
                logits, targets, tp_group=None, vocab_start=0, chunk_tokens=chunk
            )
        else:  # the log_softmax-based computation
            logsm = torch.log_softmax(logits.float(), dim=-1)
            logp = logsm.gather(-1, targets[:, None]).squeeze(-1)
            with torch.no_grad():  # entropy is a metric in both
                entropy = -(logsm.exp() * logsm).sum(-1)
        return logp, entropy

    # Warm-up on a small input (lazy initialization is not what we measure).
    small = torch.randn(64, 256).to(dtype).requires_grad_()
    lp, _ = forward(small, torch.randint(0, 256, (64,)))
    (lp * torch.randn(64)).sum().backward()

    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(tokens, vocab, generator=g) * 2).to(dtype).requires_grad_()
    targets = torch.randint(0, vocab, (tokens,), generator=g)
    weights = torch.randn(tokens, generator=g)

    reset_peak_rss()
    start = rss_kib("VmRSS")
    logp, entropy = forward(logits, targets)
    fwd_peak = rss_kib("VmHWM") - start
    reset_peak_rss()
    kept = rss_kib("VmRSS") - start  # what forward keeps for backward (+ its outputs)
    (logp * weights).sum().backward()
    bwd_peak = kept + rss_kib("VmHWM") - (start + kept)
    grad_bytes = logits.grad.numel() * logits.grad.element_size()
    print(json.dumps({
        "forward_peak": fwd_peak * 1024, "backward_peak": bwd_peak * 1024, "kept": kept * 1024,
        "logits_bytes": logits.numel() * logits.element_size(), "grad_bytes": grad_bytes,
    }))


def measure(method, tokens, vocab, dtype_name, chunk):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.algo", "--child", method, str(tokens), str(vocab), dtype_name, str(chunk)],
        capture_output=True, text=True, env=env, check=False,
    )
    if out.returncode != 0:
        raise SystemExit(f"[logprob] child {method} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def bench_logprob(dtype_name: str, chunk: int) -> None:
    tokens, vocab = 8192, 32768
    gib = 2**30
    naive = measure("naive", tokens, vocab, dtype_name, chunk)
    ours = measure("ours", tokens, vocab, dtype_name, chunk)
    logits_bytes, grad_bytes = ours["logits_bytes"], ours["grad_bytes"]
    print(f"[logprob] logits [{tokens} x {vocab}] {dtype_name} = {logits_bytes / gib:.2f} GiB; TP group of 1; "
          f"temperature 1; forward + backward (gradient of a weighted sum of log-probs), entropy as a metric; "
          f"ours with chunk_tokens={chunk}")
    print("[logprob] peak RSS beyond the logits (kernel VmHWM, reset before each phase; fresh process each):")
    rows = {}
    for name, r in (("naive log_softmax", naive), ("ours", ours)):
        total = max(r["forward_peak"], r["backward_peak"])  # includes the returned gradient
        beyond_grad = max(r["forward_peak"], r["backward_peak"] - grad_bytes)
        rows[name] = beyond_grad
        print(f"[logprob]   {name:18s} forward {r['forward_peak'] / gib:.3f} GiB, kept for backward "
              f"{r['kept'] / gib:.3f} GiB, backward {r['backward_peak'] / gib:.3f} GiB (incl. the "
              f"{grad_bytes / gib:.2f} GiB gradient); overall {total / gib:.3f} GiB = "
              f"{total / logits_bytes:.3f} x logits, "
              f"beyond the gradient {beyond_grad / gib:.3f} GiB = {beyond_grad / logits_bytes:.3f} x logits")
    print("[logprob] 'beyond the gradient': the gradient w.r.t. the logits (same size as the logits) is the")
    print("[logprob] output of backward for any method; everything else is the method's own overhead.")
    print("[logprob] naive ratio (peak beyond logits and gradient / logits_bytes): "
          f"{rows['naive log_softmax'] / logits_bytes:.3f}")
    print(f"ratio: {rows['ours'] / logits_bytes:.3f}")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        _, _, method, tokens, vocab, dtype_name, chunk = sys.argv
        logprob_child(method, int(tokens), int(vocab), dtype_name, int(chunk))
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads for the GAE case (1: the CI machine has 2 shared cores)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--only", choices=["gae", "logprob"], default=None)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--chunk-tokens", type=int, default=1024)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.only in (None, "gae"):
        bench_gae(args.repeats)
    if args.only in (None, "logprob"):
        bench_logprob(args.dtype, args.chunk_tokens)


if __name__ == "__main__":
    main()
