"""vapo-check's model checks (model_logits, recompute, weight_sync and the real SGLang engine's
engine_memory, sync_memory, engine_signals) and what every check shares: the Env, report().
Described in vapo_megatron/check.py's docstring; run through it."""

from __future__ import annotations

import importlib.util
import os
import signal
from pathlib import Path

import torch

GIB = 1 << 30
results: list[tuple[str, str, str]] = []


def report(name: str, status: str, detail: str) -> None:
    results.append((name, status, detail))
    print(f"{status:<4}  {name:<15} {detail}", flush=True)


def has(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


class Env:
    """What the checks share: device, dtype, and the HF dir and built actor of the preset in hand."""

    def __init__(self, cpu: bool, preset: str, work: Path):
        self.cpu = cpu
        self.device = torch.device("cpu") if cpu else torch.device("cuda", torch.cuda.current_device())
        # bf16 on the GPU (production); float32 on the CPU, where bf16 matmuls are slow and loose.
        self.dtype = torch.float32 if cpu else torch.bfloat16
        self.preset = preset
        self.work = work
        self.hf_dir: Path | None = None
        self.actor: list | None = None

    def peak_reset(self) -> int:
        if self.cpu:
            return 0
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()

    def peak_extra(self, base: int) -> int | None:
        return None if self.cpu else torch.cuda.max_memory_allocated() - base


def _tol(env: Env) -> dict:
    # bf16 keeps 8 bits of mantissa: logits of a few-layer model differ by ~1e-2 between kernels.
    return dict(atol=1e-4, rtol=1e-4) if env.dtype == torch.float32 else dict(atol=5e-2, rtol=5e-2)


def _logits(chunks, ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """Full logits [b, t, vocab] of a TP-sharded megatron actor (padding stripped)."""
    from vapo_megatron.mcore import parallel

    model = chunks[0].eval()
    pos = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    with torch.no_grad():
        out = model(ids, pos, None)
    shards = parallel.all_gather([torch.empty_like(out) for _ in range(parallel.tp_size())], out.contiguous(),
                                 group=parallel.tp_group())
    return torch.cat(shards, dim=-1)[..., :vocab].float()

def approx_params(hf: dict) -> int:
    """A decoder's parameter count from its config.json (embeddings, attention, MLP or experts)."""
    h, layers, vocab = hf["hidden_size"], hf["num_hidden_layers"], hf["vocab_size"]
    hd = hf.get("head_dim") or h // hf["num_attention_heads"]
    attn = h * hd * (2 * hf["num_attention_heads"] + 2 * hf["num_key_value_heads"])
    mlp = 3 * h * (hf["num_experts"] * hf["moe_intermediate_size"] if hf.get("num_experts")
                   else hf["intermediate_size"])
    return vocab * h * (1 if hf.get("tie_word_embeddings") else 2) + layers * (attn + mlp)


def too_big(env: Env) -> str | None:
    """Why the preset's model checks cannot run here, or None: they hold about four copies of the
    model at once (megatron's, transformers' reference, the engine's, recompute's gradients)."""
    from model_providers.presets import preset

    need = 4 * approx_params(preset(env.preset)) * env.dtype.itemsize
    if env.cpu:
        with open("/proc/meminfo") as f:
            free = next(int(line.split()[1]) << 10 for line in f if line.startswith("MemAvailable:"))
    else:
        free = torch.cuda.mem_get_info()[0]
    if need <= free:
        return None
    return f"{env.preset} needs about {need / GIB:.0f} GiB for these checks, {free / GIB:.0f} GiB available here"


def check_model_logits(env: Env) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    import model_providers
    from model_providers.presets import preset
    from vapo_megatron.mcore.models import build_chunks
    from vapo_megatron.weights.hf_read import load_hf_weights

    if why := too_big(env):
        report(f"model_logits:{env.preset}", "SKIP", why)
        return
    hf = preset(env.preset)
    torch.manual_seed(0)
    # The family's own transformers class (Qwen2, Qwen3, Llama, Qwen3-MoE), from the preset's config.json.
    cfg = AutoConfig.for_model(hf["model_type"],
                               **{k: v for k, v in hf.items() if k not in ("model_type", "torch_dtype")})
    ref = AutoModelForCausalLM.from_config(cfg, dtype=env.dtype)
    ref_class = type(ref).__name__
    env.hf_dir = env.work / env.preset
    ref.save_pretrained(env.hf_dir)
    hf_cfg = model_providers.read_hf_config(str(env.hf_dir))
    chunks = build_chunks(hf_cfg, params_dtype=env.dtype, critic=False)
    load_hf_weights(chunks, model_providers.family_for(hf_cfg), hf_cfg, str(env.hf_dir))
    env.actor = chunks
    qkv = type(chunks[0].decoder.layers[0].self_attention.linear_qkv)
    spec = "TE" if qkv.__module__.endswith("transformer_engine") else "local"
    ids = torch.randint(0, hf["vocab_size"], (2, 64), generator=torch.Generator().manual_seed(0)).to(env.device)
    got = _logits(chunks, ids, hf["vocab_size"])
    with torch.no_grad():
        want = ref.to(env.device)(ids).logits.float()
    del ref
    err = (got - want).abs().max().item()
    report(f"model_logits:{env.preset}", "PASS" if torch.allclose(got, want, **_tol(env)) else "FAIL",
           f"{ref_class} {str(env.dtype).removeprefix('torch.')} on {env.device.type}, {spec} layer spec "
           f"({qkv.__name__}), backend {torch.distributed.get_backend()}: max |megatron - transformers| = "
           f"{err:.3g} ({_tol(env)})")


def check_recompute(env: Env) -> None:
    """Full activation recomputation (model.recompute_activations) against none: the same weights
    and batch give the same gradients (megatron re-runs each layer's forward in the backward)."""
    import model_providers
    from vapo_megatron.mcore.models import build_chunks
    from vapo_megatron.weights.hf_read import load_hf_weights

    if env.actor is None:
        report("recompute", "SKIP", "model_logits did not build the actor")
        return
    hf_cfg = model_providers.read_hf_config(str(env.hf_dir))
    ids = torch.randint(0, hf_cfg["vocab_size"], (2, 64), generator=torch.Generator().manual_seed(3)).to(env.device)
    pos = torch.arange(ids.shape[1], device=env.device).expand_as(ids)
    grads = []
    for recompute in (False, True):
        (model,) = build_chunks(hf_cfg, params_dtype=env.dtype, critic=False, recompute=recompute)
        load_hf_weights([model], model_providers.family_for(hf_cfg), hf_cfg, str(env.hf_dir))
        model.train()(ids, pos, None).float().square().mean().backward()
        grads.append({n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None})
        del model
    worst = max((grads[0][n] - grads[1][n]).abs().max().item() / max(grads[0][n].abs().max().item(), 1e-12)
                for n in grads[0])
    same = grads[0].keys() == grads[1].keys() and len(grads[0]) > 0
    tol = 1e-5 if env.dtype == torch.float32 else 2e-2
    report("recompute", "PASS" if same and worst <= tol else "FAIL",
           f"{env.preset}: {len(grads[0])} parameter gradients with and without full recompute, max relative "
           f"difference {worst:.3g} (tolerance {tol:g})")


def check_weight_sync(env: Env) -> None:
    from transformers import AutoConfig

    import model_providers
    from vapo_megatron.rollout.embedded import EmbeddedEngine
    from vapo_megatron.rollout.weight_sync import stream_weights

    if env.actor is None:
        report(f"weight_sync:{env.preset}", "SKIP", "model_logits did not build the actor")
        return
    hf_cfg = model_providers.read_hf_config(str(env.hf_dir))
    with torch.no_grad():  # a trained actor differs from its checkpoint: the engine must get these
        for p in env.actor[0].parameters():
            p.add_(torch.randn_like(p) * 0.02)
    engine = EmbeddedEngine.from_hf_config(AutoConfig.from_pretrained(env.hf_dir), dtype=env.dtype,
                                           device=str(env.device))
    stats = stream_weights(env.actor, model_providers.family_for(hf_cfg), hf_cfg, engine, version=1)
    ids = torch.randint(0, hf_cfg["vocab_size"], (2, 48), generator=torch.Generator().manual_seed(2)).to(env.device)
    trainer = _logits(env.actor, ids, hf_cfg["vocab_size"])
    with torch.no_grad():
        served = engine.model(ids).logits.float()
    logit_err = (trainer - served).abs().max().item()
    lp = lambda x: torch.log_softmax(x, -1)[:, :-1].gather(-1, ids[:, 1:, None])  # noqa: E731
    logp_err = (lp(trainer) - lp(served)).abs().max().item()
    ok = torch.allclose(trainer, served, **_tol(env)) and logp_err < 10 * _tol(env)["atol"]
    report(f"weight_sync:{env.preset}", "PASS" if ok else "FAIL",
           f"embedded engine on {env.device.type}, {stats.tensors} tensors streamed: max |logits| "
           f"diff {logit_err:.3g}, max |log-prob| diff {logp_err:.3g} (engine version {engine.weight_version})")
    if env.preset != env.first_preset:
        return  # the real engine once, with the first preset
    if env.cpu or not has("sglang"):
        why = "on the GPU only" if env.cpu else "with sglang only (not importable)"
        for name in ("engine_memory", "sync_memory", "engine_signals"):
            report(name, "SKIP", f"a real sglang.Engine runs {why}")
    else:
        check_sglang_engine(env, hf_cfg)


def check_sglang_engine(env: Env, hf_cfg: dict) -> None:
    """A real colocated sglang.Engine (project wrapper), synced from the actor; memory measured
    around release and resume; then sync_memory and engine_signals. Not yet run on a GPU."""
    import model_providers
    from vapo_megatron.rollout.base import SamplingParams
    from vapo_megatron.rollout.engine_signals import EngineDeath
    from vapo_megatron.rollout.sglang_engine import SGLangEngine
    from vapo_megatron.rollout.weight_sync import stream_weights

    terms: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, frame: terms.append(signum))  # as StopSignals does
    mine = signal.getsignal(signal.SIGTERM)
    engine = SGLangEngine.colocated(model_path=str(env.hf_dir), tp_size=1, mem_fraction=0.3, dtype="bfloat16", seed=0)
    try:
        free = lambda: torch.cuda.mem_get_info()[0]  # noqa: E731  (the engine's memory is not torch's)
        released = free()
        engine.resume_memory()
        resumed = free()
        stream_weights(env.actor, model_providers.family_for(hf_cfg), hf_cfg, engine, version=2)
        unused = torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
        report("sync_memory", "PASS" if unused < 64 << 20 else "FAIL",
               f"after the weight sync: {unused / 2**20:.0f} MiB reserved but unused by PyTorch "
               "(the sync frees its cache)")
        prompt = [[1, 2, 3, 4]]
        out = engine.generate(prompt, SamplingParams(n=1, max_new_tokens=8, temperature=1.0, seed=0))[0]
        ids = torch.tensor([prompt[0] + list(out.token_ids)], device=env.device)
        trainer = torch.log_softmax(_logits(env.actor, ids, hf_cfg["vocab_size"]), -1)
        want = trainer[0, len(prompt[0]) - 1:-1].gather(-1, ids[0, len(prompt[0]):, None])[:, 0]
        err = (want.cpu() - torch.tensor(out.logprobs)).abs().max().item()
        engine.release_memory()
        os.kill(os.getpid(), signal.SIGTERM)  # after the Engine's first calls (SGLang's takeover point)
        kept, on_quit = (signal.getsignal(signal.SIGTERM) is mine and terms == [signal.SIGTERM],
                         signal.getsignal(signal.SIGQUIT))
        report("engine_signals", "PASS" if kept and isinstance(on_quit, EngineDeath) else "FAIL",
               f"SIGTERM handler kept and reached: {kept}; SIGQUIT handler: {on_quit!r}")
        again = free()
        ok = err < 0.1 and resumed < released and again > resumed
        report("engine_memory", "PASS" if ok else "FAIL",
               f"sglang: free GPU memory released {released / GIB:.2f} GiB -> resumed {resumed / GIB:.2f} GiB -> "
               f"released {again / GIB:.2f} GiB; engine vs trainer log-prob max diff {err:.3g}")
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        engine.shutdown()  # the engine's own processes only (sglang_engine.stop_engine), not vapo-check's others


__all__ = ["Env", "GIB", "approx_params", "check_model_logits", "check_recompute", "check_weight_sync", "has", "report",
           "results"]
