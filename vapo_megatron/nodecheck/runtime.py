"""vapo-check's checks of the process groups and the kernels around them: collectives (mcore/parallel.py's
device-placing helpers), wait_groups, wgrad_fusion and vocab_parallel. Described in
vapo_megatron/check.py's docstring; run through it."""

from __future__ import annotations

import contextlib
import sys

import torch

from vapo_megatron.nodecheck.models import Env, report


def check_collectives(env: Env) -> None:
    """parallel.py's helpers on this backend: CPU tensors in and out of an NCCL group."""
    from vapo_megatron.mcore import parallel

    t = torch.arange(4, dtype=torch.float64)  # a CPU tensor, as the global counts are
    parallel.all_reduce(t, group=parallel.dp_group())
    parallel.broadcast(t, src=0, group=parallel.tp_group())
    shards = parallel.all_gather([torch.empty(4, dtype=torch.float64)], t, group=parallel.tp_group())
    ok = t.device.type == "cpu" and torch.equal(shards[0], torch.arange(4, dtype=torch.float64))
    report("collectives", "PASS" if ok else "FAIL",
           f"backend {torch.distributed.get_backend()}: CPU tensors through parallel.all_reduce/broadcast/all_gather "
           f"(communicated on {parallel.backend_device(parallel.dp_group())}), results back on the CPU")


def check_wgrad_fusion(env: Env) -> None:
    from model_providers.presets import preset
    from vapo_megatron.mcore import models

    te, apex = models.te_available(), models.apex_wgrad_available()
    with contextlib.redirect_stdout(sys.stderr):  # its start-up log line
        got = models.transformer_config(preset(env.preset), params_dtype=env.dtype, on_gpu=not env.cpu)
    got = got.gradient_accumulation_fusion
    report("wgrad_fusion", "PASS" if got == (not env.cpu and te and apex) else "FAIL",
           f"gradient_accumulation_fusion={got} (Transformer Engine {'imports' if te else 'absent'}, Apex "
           f"fused_weight_gradient_mlp_cuda {'imports' if apex else 'absent'}; on only with both, on a GPU)")


def check_wait_groups(env: Env) -> None:
    from vapo_megatron.mcore import parallel

    groups = {name: parallel.wait_group(name) for name in parallel.WAIT_GROUPS}
    seen = {n: (torch.distributed.get_backend(g), g._get_backend(torch.device("cpu")).options._timeout.total_seconds())
            for n, g in groups.items() if parallel.barrier(group=g) is None}
    bad = [f"{n}: {b}, {t:.0f} s" for n, (b, t) in seen.items() if (b, t) != ("gloo", parallel.wait_timeout_s())]
    report("wait_groups", "FAIL" if bad else "PASS", f"{', '.join(seen)}: barrier answered; want gloo, timeout "
                                                       f"{parallel.wait_timeout_s():.0f} s; wrong: {bad or 'none'}")


def check_vocab_parallel(env: Env) -> None:
    from vapo_megatron.mcore import parallel
    from vapo_megatron.mcore.vocab_parallel import vocab_parallel_logprobs_entropy

    g = torch.Generator().manual_seed(1)
    # GPU: a 32k vocabulary shard (Qwen2.5-32B at TP=8 has 19k); CPU: small, the machine is shared.
    vocab, tokens = (8192, 1024) if env.cpu else (32768, 4096)
    logits = (torch.randn(tokens, vocab, generator=g) * 3).to(env.device, env.dtype)
    targets = torch.randint(0, vocab, (tokens,), generator=g).to(env.device)
    base = env.peak_reset()
    logp, entropy = vocab_parallel_logprobs_entropy(logits, targets, tp_group=parallel.tp_group(), vocab_start=0,
                                                    temperature=0.7, chunk_tokens=1024)
    extra = env.peak_extra(base)
    ref = torch.log_softmax(logits.float() / 0.7, dim=-1)
    want_logp = ref.gather(-1, targets[:, None])[:, 0]
    want_ent = -(ref.exp() * ref).sum(-1)
    err = max((logp - want_logp).abs().max().item(), (entropy - want_ent).abs().max().item())
    mem = "peak extra memory: n/a on the CPU" if extra is None else (
        f"peak extra memory {extra / 2**20:.0f} MiB vs logits {logits.numel() * logits.element_size() / 2**20:.0f} MiB")
    report("vocab_parallel", "PASS" if err < 1e-3 else "FAIL",
           f"[{tokens}, {vocab}] {str(env.dtype).removeprefix('torch.')}: max error {err:.2g} "
           f"vs torch.log_softmax; {mem}")
