"""The first thing to run on a GPU node: one line per check, PASS / FAIL / SKIP (reason).

    python scripts/gpu_check.py [--model-preset NAME ...] [--offload-preset NAME] [--steps 2]
    python scripts/gpu_check.py --cpu          # the same checks on the CPU (gloo), GPU-only parts SKIP

Exit status: 0 no FAIL; 1 some FAIL; 2 no GPU visible (without --cpu) or bad arguments.
Single process (world size 1): the NCCL process group of one GPU still takes CUDA tensors only,
so every collective of the checks below runs through mcore/parallel.py's device-placing helpers.

Checks (each calls the project's own code; a check is skipped only when its package is absent):
  model_logits    per `--model-preset` (default one tiny model of each family: Qwen2, Qwen3, Llama 3.1
                  with its RoPE scaling, Qwen3-MoE at EP=1): megatron-core (TE layer spec when TE
                  imports, else the local spec), bf16 on the GPU, against transformers' own class
                  for that family (model_logits:<preset>)
  recompute       full activation recomputation gives the gradients of the run without it
  vocab_parallel  vocab-parallel log-prob and entropy against torch.log_softmax, with the peak
                  extra memory (torch.cuda.max_memory_allocated)
  weight_sync     per preset, the actor streamed into an embedded engine on the device (and into a real
                  colocated sglang.Engine when sglang imports, GPU only): engine logits and
                  log-probs equal the trainer's; release/resume memory measured
  routing_replay  per MoE preset (scripts/gpu_check_replay.py): the embedded engine on the device samples
                  with its routes; the trainer's log-probs with routing replay are at least as close to
                  the engine's as without, moe/routing_mismatch printed (SGLang's routes: not here)
  vapo_steps      `--steps` VAPO steps of the demo task through the trainer's Trainer, with
                  torch.cuda.memory_reserved before and after every phase switch's cache release
                  (mcore/memory.py's free_cached_memory, where rollout/generator.py calls it)
  plan_memory     vapo-plan's per-GPU training peak for that run's layout against the measured
                  peak of the training phases (score, critic_update, actor_update:
                  torch.cuda.max_memory_allocated less the embedded engine's weights), ratio printed
  wgrad_fusion    gradient_accumulation_fusion on exactly when TE and Apex's fused_weight_gradient_
                  mlp_cuda both import (else megatron's ColumnParallelLinear raises in model_logits)
  wait_groups     every wait group (mcore/parallel.py wait_group): gloo, the wait timeout, a barrier
  sync_memory     after a weight sync into the real engine, no unused PyTorch cache (GPU + sglang)
  engine_signals  after the real Engine's first calls, the SIGTERM handler set before it is in force
                  and reached, and SIGQUIT is EngineDeath (GPU + sglang)
  offload         scripts/gpu_check_offload.py (offload, offload_memory) on `--offload-preset` (GPU
                  default small-qwen2: hidden 1024, so the state sits in the allocator's large
                  pool and its release is measurable), the actor with the distributed optimizer;
                  vapo_steps runs with offload on
  adam_resume     scripts/gpu_check_checkpoint.py on the first preset, with the Adam megatron picks here
                  (TE's or Apex's FusedAdam, else torch's): save after two steps and resume, parameters
                  and moments bitwise equal to a twin that never saved, one step later too
  save_before_update  the distributed optimizer saved before its first step and resumed: its next
                  step equals a fresh optimizer's
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import sys
import tempfile
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FAMILY_PRESETS = ("tiny-qwen2", "tiny-qwen3", "tiny-llama3", "tiny-qwen3-moe")
sys.path.insert(0, str(ROOT))
if "--cpu" in sys.argv[1:]:  # before torch looks for GPUs: the CPU path must not use one that is present
    os.environ["CUDA_VISIBLE_DEVICES"] = ""

import torch  # noqa: E402
from gpu_check_models import (GIB, Env, check_model_logits, check_recompute, check_weight_sync, has,  # noqa: E402
                              report, results)
from gpu_check_checkpoint import check_checkpoint  # noqa: E402  (scripts/: the directory of this script)
from gpu_check_offload import check_offload  # noqa: E402
from gpu_check_replay import check_routing_replay  # noqa: E402

TRAINING_PHASES = ("score", "critic_update", "actor_update")  # what vapo-plan's `training` peak covers


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
           f"[{tokens}, {vocab}] {str(env.dtype).removeprefix('torch.')}: max error {err:.2g} vs torch.log_softmax; {mem}")


def check_vapo_steps(env: Env, steps: int) -> dict | None:
    from vapo_megatron.config import load_config
    from vapo_megatron.testing.demo_task import TinyModelSpec, write_demo_dir
    from vapo_megatron.trainer.signals import StopSignals
    from vapo_megatron.trainer.trainer import Trainer

    data = env.work / "demo"
    write_demo_dir(str(data), seed=0, task="add", n_train=256, n_eval=16, n_sft=16, sft_noise=0.0,
                   spec=TinyModelSpec(hidden_size=64, num_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      intermediate_size=256))
    overrides = [
        f"trainer.run_dir={env.work / 'run'}", f"model.hf_path={data}/model", f"data.train_files=[{data}/train.jsonl]",
        "data.eval_files=[]", "sft.steps=0", "sft.files=[]", "parallel.tp=1", "algo.value_pretrain_steps=1",
        f"trainer.total_steps={steps}", "rollout.prompts_per_step=16", "rollout.n_samples=4",
        "trainer.tensorboard=false", f"trainer.save_every={steps + 1}", "trainer.offload_during_rollout=true",
        f"model.dtype={str(env.dtype).removeprefix('torch.')}",
    ]
    cfg = load_config(str(ROOT / "configs" / "demo_cpu.yaml"), overrides)
    switches: list[tuple[str, int, int]] = []
    base = env.peak_reset()
    with contextlib.redirect_stdout(sys.stderr):  # the trainer's own lines: stdout is one line per check
        trainer = Trainer(cfg, StopSignals())
    training_peak = [0]
    try:
        if not env.cpu:  # the peak inside the phases vapo-plan's `training` figure is for
            timer = trainer.timer

            @contextlib.contextmanager
            def peak_timer(phase: str):
                if phase not in TRAINING_PHASES:
                    with timer(phase):
                        yield
                    return
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                with timer(phase):
                    yield
                torch.cuda.synchronize()
                training_peak[0] = max(training_peak[0], torch.cuda.max_memory_allocated())
            trainer.timer = type("PeakTimer", (), {"__call__": lambda self, phase: peak_timer(phase),
                                                   "__getattr__": lambda self, name: getattr(timer, name)})()
        if not env.cpu:  # torch.cuda.memory_reserved before and after each phase switch's cache release
            from vapo_megatron.rollout import generator

            def measured(_free=generator.free_cached_memory):
                before = torch.cuda.memory_reserved()
                _free()
                switches.append((sys._getframe(1).f_code.co_name, before, torch.cuda.memory_reserved()))
            generator.free_cached_memory = measured
        with contextlib.redirect_stdout(sys.stderr):
            code = trainer.run()
    finally:
        trainer.close()
    peak = env.peak_extra(base)
    engine = getattr(trainer.generator, "engine", None)
    engine_bytes = sum(t.numel() * t.element_size() for t in engine.model.parameters()) if hasattr(engine, "model") else 0
    rewards = [line for line in (env.work / "run" / "metrics.jsonl").read_text().splitlines() if '"vapo"' in line]
    ok = code == 0 and len(rewards) == steps
    report("vapo_steps", "PASS" if ok else "FAIL",
           f"{steps} VAPO steps (+1 value pretraining) of the demo task on {env.device.type}, exit {code}, "
           f"{len(rewards)} vapo records" + ("" if env.cpu else f"; peak {peak / 2**20:.0f} MiB"))
    if env.cpu:
        report("phase_memory", "SKIP", "torch.cuda.memory_reserved is a GPU measurement")
    else:
        shown = "; ".join(f"{where}: {a / 2**20:.0f} -> {b / 2**20:.0f} MiB" for where, a, b in switches[:4])
        ok = bool(switches) and all(b <= a for _, a, b in switches)
        report("phase_memory", "PASS" if ok else "FAIL",
               f"memory_reserved before -> after the cache release at {len(switches)} phase switches "
               f"(first 4): {shown or 'none seen'}")
    return {"cfg": cfg, "peak": peak, "hf_dir": f"{data}/model",
            # The peak above what was allocated before the trainer was built (earlier checks' leftovers).
            "training_peak": None if env.cpu else training_peak[0] - base - engine_bytes, "engine_bytes": engine_bytes}


def check_plan_memory(env: Env, run: dict | None) -> None:
    import model_providers
    from vapo_megatron.mcore import parallel
    from vapo_megatron.sizing.plan import make_plan

    if run is None:
        report("plan_memory", "SKIP", "vapo_steps did not run")
        return
    parallel.destroy()  # vapo-plan builds each rank's shard in a fake process group of its own
    hf = model_providers.read_hf_config(run["hf_dir"])
    gpu = 80.0 if env.cpu else torch.cuda.get_device_properties(env.device).total_memory / GIB
    plan = make_plan(run["cfg"], hf, hf, world_size=1, gpu_memory_gib=gpu, reserve_gib=0.0)
    predicted = max(r.training for r in plan.ranks)
    if env.cpu:
        report("plan_memory", "SKIP", f"no CUDA memory counters on the CPU (vapo-plan predicts {predicted / 2**20:.1f} MiB "
                                      "training peak for this layout, without reserve)")
        return
    measured = run["training_peak"]
    ratio = measured / predicted
    report("plan_memory", "PASS" if measured <= predicted else "FAIL",
           f"measured training-phase peak {measured / 2**20:.1f} MiB (above the start, less the embedded engine's "
           f"{run['engine_bytes'] / 2**20:.1f} MiB of weights) vs vapo-plan's training {predicted / 2**20:.1f} MiB "
           f"(no reserve): ratio measured/predicted {ratio:.2f}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="gpu_check", description=__doc__.split("\n")[0])
    ap.add_argument("--cpu", action="store_true", help="run on the CPU with gloo; GPU-only parts are SKIP")
    ap.add_argument("--model-preset", nargs="+", default=list(FAMILY_PRESETS),
                    help="model_providers.presets names for the model checks (default: one tiny model per family)")
    ap.add_argument("--offload-preset", default=None,
                    help="preset of the offload check (default: small-qwen2 on a GPU, tiny-qwen2 on the CPU)")
    ap.add_argument("--steps", type=int, default=2, help="VAPO steps in vapo_steps")
    args = ap.parse_args(argv)
    if not args.cpu and not torch.cuda.is_available():
        print("gpu_check: no CUDA GPU visible (torch.cuda.is_available() is False); "
              "`--cpu` runs the CPU subset", file=sys.stderr)
        return 2
    if not has("megatron.core"):
        print("gpu_check: megatron-core is not installed; nothing can be checked", file=sys.stderr)
        return 2
    from model_providers.presets import preset
    from vapo_megatron.mcore import parallel

    parallel.init_distributed(1, 1, seed=0)
    device = "cpu (gloo)" if args.cpu else f"{torch.cuda.get_device_name()} ({torch.distributed.get_backend()})"
    offload_preset = args.offload_preset or ("tiny-qwen2" if args.cpu else "small-qwen2")
    for name in [*args.model_preset, offload_preset]:
        try:
            preset(name)
        except ValueError as e:
            print(f"gpu_check: {e}", file=sys.stderr)
            return 2
    print(f"gpu_check: {device}; torch {torch.__version__}; presets {' '.join(args.model_preset)}; "
          f"offload preset {offload_preset}", flush=True)
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as work:
        env = Env(args.cpu, args.model_preset[0], Path(work))
        env.first_preset = args.model_preset[0]
        run = None

        def use(name: str) -> None:
            env.preset, env.actor = name, None

        per_preset = [step for name in args.model_preset for step in (
            ("use", lambda name=name: use(name)),
            ("model_logits", lambda: check_model_logits(env)),
            *([("recompute", lambda: check_recompute(env))] if name == env.first_preset else []),
            ("weight_sync", lambda: check_weight_sync(env)),
            *([("routing_replay", lambda: check_routing_replay(env))] if "num_experts" in preset(name) else []))]
        for name, check in (("collectives", lambda: check_collectives(env)),
                            ("wait_groups", lambda: check_wait_groups(env)),
                            ("wgrad_fusion", lambda: check_wgrad_fusion(env)),
                            *per_preset,
                            ("vocab_parallel", lambda: check_vocab_parallel(env)),
                            ("offload", lambda: [report(*r) for r in check_offload(env.cpu, env.dtype, offload_preset)]),
                            ("checkpoint", lambda: [report(*r) for r in check_checkpoint(env.dtype, env.first_preset,
                                                                                         Path(work) / "checkpoint")]),
                            ("vapo_steps", lambda: check_vapo_steps(env, args.steps)),
                            ("plan_memory", lambda: check_plan_memory(env, run))):
            if not has("transformers") and name in ("model_logits", "recompute", "weight_sync", "routing_replay", "vapo_steps"):
                report(name, "SKIP", "transformers is not installed")
                continue
            try:
                out = check()
                run = out if name == "vapo_steps" else run
            except Exception as e:  # noqa: BLE001 - one failing check must not hide the others
                shown = f"{name}:{env.preset}" if name in ("model_logits", "weight_sync", "routing_replay") else name
                report(shown, "FAIL", f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
                traceback.print_exc(file=sys.stderr)
            # Megatron's modules hold reference cycles (DDP's hooks): a failed check's models would
            # otherwise stay on the GPU through the checks after it (the first GPU run's offload
            # OOM left 29 GiB allocated under vapo_steps).
            gc.collect()
            if not args.cpu:
                torch.cuda.empty_cache()
    parallel.destroy()
    failed = [n for n, s, _ in results if s == "FAIL"]
    print(f"gpu_check: {len(results) - len(failed)} of {len(results)} without FAIL" + (f"; FAIL: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
