"""vapo-check: the first thing to run on a GPU node: one line per check, PASS / FAIL / SKIP (reason).

    vapo-check [--model-preset NAME ...] [--offload-preset NAME] [--steps 2]
    vapo-check --cpu          # the same checks on the CPU (gloo), GPU-only parts SKIP
    python -m vapo_megatron.check ...   # the same, where the package is not installed (docs/gpu_node.md)
    torchrun --nproc-per-node N -m vapo_megatron.check --ranks [--engine-tp K] [--model-preset NAME ...]
                              # the multi-rank checks: every GPU of the node, one rank each (below)

Exit status: 0 no FAIL; 1 some FAIL; 2 no GPU visible (without --cpu) or bad arguments (each one line
naming its flag, found before anything is imported or run: --steps below 1, an unknown preset, and
for --ranks: not under torchrun with N >= 2 ranks on one node, --engine-tp not dividing N, flags
of the other mode).
Single process (world size 1): the NCCL process group of one GPU still takes CUDA tensors only,
so every collective of the checks below runs through mcore/parallel.py's device-placing helpers.

Checks (vapo_megatron/nodecheck/; each calls the project's own code; a check is skipped only when its
package is absent):
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
  routing_replay  per MoE preset (nodecheck/replay.py): the embedded engine on the device samples
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
  offload         nodecheck/offload.py (offload, offload_memory) on `--offload-preset` (GPU
                  default small-qwen2: hidden 1024, so the state sits in the allocator's large
                  pool and its release is measurable), the actor with the distributed optimizer;
                  vapo_steps runs with offload on
  adam_resume     nodecheck/checkpoint.py on the first preset, with the Adam megatron picks here
                  (TE's or Apex's FusedAdam, else torch's): save after two steps and resume, parameters
                  and moments bitwise equal to a twin that never saved, one step later too
  save_before_update  the distributed optimizer saved before its first step and resumed: its next
                  step equals a fresh optimizer's
  multi_gpu       always SKIP, naming what one process cannot check: SGLang at an engine TP > 1, the
                  colocated sync through CUDA IPC from every trainer rank, SGLang's routed-experts
                  capture. With several GPUs visible it gives the --ranks command that checks them;
                  with one (or --cpu), that they need a node of several GPUs.

Multi-rank checks (`--ranks`, nodecheck/ranks_mode.py and multi_rank.py; not yet run on GPUs: docs/
what_ran_where.md). One rank per GPU of one node, the actor at trainer TP = N (sequence parallel),
per `--model-preset` (default the four families' tiny presets, their heads multiplied until N
divides them, head_dim 128, experts in every layer: ranks_mode.ranks_model; random bf16 weights). The
colocated SGLang engines start through SGLangEngine.colocated at engine TP `--engine-tp` (default N,
what the shipped configs' rollout.sglang.tp = parallel.tp means), one per block of K ranks; one weight
sync (rollout/weight_sync.py in 1 MiB buckets: each rank's bucket a CUDA IPC handle, gathered per
engine group and opened by the SGLang TP rank on that rank's GPU); each engine samples its share of 8
prompts (2 answers each, 16 tokens, temperature 1). Every rank makes the same collectives whatever the
answers; rank 0 prints:
  sglang_sync:<preset>     every answer token's SGLang log-prob against the trainer's own (step 4's
                           forward_only), max |difference| <= 0.1 in bf16 (1e-4 in float32)
  routed_experts:<preset>  MoE presets, engines started with return_routed_experts: SGLang's routes
                           (one row per prompt and answer token but the last, k distinct experts per
                           layer) replayed by the trainer (nodecheck/replay.py): moe/routing_mismatch as
                           the trainer computes it <= 0.25, and the replayed log-probs at least as close
                           to SGLang's as without replay, within the same tolerance
On the CPU (SGLang's CPU engine: engine TP 1, no routed-experts capture) the suite runs these
checks on real engines (docs/what_ran_where.md); routed_experts SKIPs there.
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

FAMILY_PRESETS = ("tiny-qwen2", "tiny-qwen3", "tiny-llama3", "tiny-qwen3-moe")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse's usage line and message: one line instead, like every bad argument
        print(f"vapo-check: {message} (vapo-check --help)", file=sys.stderr)
        sys.exit(2)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = _Parser(prog="vapo-check", description=__doc__.split("\n")[0])
    ap.add_argument("--cpu", action="store_true", help="run on the CPU with gloo; GPU-only parts are SKIP")
    ap.add_argument("--model-preset", nargs="+", default=list(FAMILY_PRESETS),
                    help="model_providers.presets names for the model checks (default: one tiny model per family)")
    ap.add_argument("--offload-preset", default=None,
                    help="preset of the offload check (default: small-qwen2 on a GPU, tiny-qwen2 on the CPU)")
    ap.add_argument("--steps", type=int, default=None, help="VAPO steps in vapo_steps (>= 1; default 2)")
    ap.add_argument("--ranks", action="store_true",
                    help="the multi-rank checks, under torchrun --nproc-per-node N (N >= 2, one node): SGLang at "
                         "engine TP > 1 fed by every trainer rank, SGLang's routed experts against routing replay")
    ap.add_argument("--engine-tp", type=int, default=None,
                    help="with --ranks: SGLang's engine TP, dividing N (default N, as rollout.sglang.tp = parallel.tp)")
    args = ap.parse_args(argv)
    args.steps_given = args.steps is not None
    args.steps = 2 if args.steps is None else args.steps
    return args


def ranks_problems(args: argparse.Namespace, env) -> list[str]:
    """--ranks' own: a torchrun launch of N >= 2 ranks on one node (the ranks are the node's GPUs, the
    trainer's TP group) and an engine TP dividing N; the single-process mode's flags refused."""
    if not args.ranks:
        return [] if args.engine_tp is None else [f"--engine-tp={args.engine_tp} is a flag of the multi-rank checks: "
                                                  "add --ranks (under torchrun)"]
    problems = []
    for flag, given in (("--cpu", args.cpu), ("--steps", args.steps_given), ("--offload-preset", args.offload_preset)):
        if given:
            problems.append(f"{flag} is a flag of the single-process checks, not of --ranks"
                            + (" (SGLang's CPU engine runs TP=1 only; the suite runs --ranks' checks on it)"
                               if flag == "--cpu" else ""))
    world, local = env.get("WORLD_SIZE"), env.get("LOCAL_WORLD_SIZE")
    if world is None or int(world) < 2:
        problems.append("--ranks runs one rank per GPU of the node "
                        f"({'no launcher' if world is None else 'WORLD_SIZE=' + world}):"
                        " torchrun --nproc-per-node N -m vapo_megatron.check --ranks, N >= 2")
        return problems
    if local is not None and local != world:
        problems.append(f"--ranks checks one node: WORLD_SIZE={world} over nodes of LOCAL_WORLD_SIZE={local} "
                        "(torchrun --nnodes 1)")
    if args.engine_tp is not None and (args.engine_tp < 1 or int(world) % args.engine_tp):
        problems.append(f"--engine-tp={args.engine_tp} must be >= 1 and divide the {world} ranks (each engine serves "
                        "a block of the trainer's TP group, as rollout.sglang.tp divides parallel.tp)")
    return problems


def argument_problems(args: argparse.Namespace) -> list[str]:
    """Every bad argument, each naming its flag, found before torch is imported: the checks take tens of
    seconds to start, and a bad value must not surface as a node failure at the end (issue 63)."""
    from model_providers.presets import preset

    problems = []
    if args.steps < 1:  # 0 would train nothing and check nothing: vapo_steps and plan_memory measure these steps
        problems.append(f"--steps={args.steps} must be >= 1 (the VAPO steps vapo_steps trains and plan_memory "
                        "measures)")
    for flag, names in (("--model-preset", args.model_preset),
                        ("--offload-preset", [] if args.offload_preset is None else [args.offload_preset])):
        for name in names:
            try:
                preset(name)
            except ValueError as e:
                problems.append(f"{flag}: {e}")
    return problems + ranks_problems(args, os.environ)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    problems = argument_problems(args)
    for problem in problems if os.environ.get("RANK", "0") == "0" else ():  # under torchrun: once, not per rank
        print(f"vapo-check: {problem}", file=sys.stderr)
    if problems:
        return 2
    if args.ranks:
        from vapo_megatron.nodecheck.ranks_mode import run

        return run(args.model_preset, args.engine_tp)
    if args.cpu:  # before torch looks for GPUs: the CPU path must not use one that is present
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    import torch

    from vapo_megatron.nodecheck.checkpoint import check_checkpoint
    from vapo_megatron.nodecheck.models import (
        Env,
        check_model_logits,
        check_recompute,
        check_weight_sync,
        has,
        report,
        results,
    )
    from vapo_megatron.nodecheck.offload import check_offload
    from vapo_megatron.nodecheck.replay import check_routing_replay
    from vapo_megatron.nodecheck.runtime import (
        check_collectives,
        check_vocab_parallel,
        check_wait_groups,
        check_wgrad_fusion,
    )
    from vapo_megatron.nodecheck.steps import check_plan_memory, check_vapo_steps

    if not args.cpu and not torch.cuda.is_available():
        print("vapo-check: no CUDA GPU visible (torch.cuda.is_available() is False); "
              "`--cpu` runs the CPU subset", file=sys.stderr)
        return 2
    if not has("megatron.core"):
        print("vapo-check: megatron-core is not installed; nothing can be checked", file=sys.stderr)
        return 2
    from model_providers.presets import preset
    from vapo_megatron.mcore import parallel

    parallel.init_distributed(1, 1, seed=0)
    device = "cpu (gloo)" if args.cpu else f"{torch.cuda.get_device_name()} ({torch.distributed.get_backend()})"
    offload_preset = args.offload_preset or ("tiny-qwen2" if args.cpu else "small-qwen2")
    print(f"vapo-check: {device}; torch {torch.__version__}; presets {' '.join(args.model_preset)}; "
          f"offload preset {offload_preset}", flush=True)
    with tempfile.TemporaryDirectory(prefix="vapo_check_") as work:
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
                            ("offload", lambda: [report(*r) for r in check_offload(env.cpu, env.dtype,
                                                                                   offload_preset)]),
                            ("checkpoint", lambda: [report(*r) for r in check_checkpoint(env.dtype, env.first_preset,
                                                                                         Path(work) / "checkpoint")]),
                            ("vapo_steps", lambda: check_vapo_steps(env, args.steps)),
                            ("plan_memory", lambda: check_plan_memory(env, run))):
            if not has("transformers") and name in ("model_logits", "recompute", "weight_sync", "routing_replay",
                                                    "vapo_steps"):
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
    # What one process cannot check (issue 63): it needs several GPUs and the trainer's own ranks, which
    # --ranks runs. Said on every node, so that its record does not read as complete.
    gpus = 0 if args.cpu else torch.cuda.device_count()
    what = ("SGLang at an engine TP > 1 (the shipped configs' rollout.sglang.tp), the colocated weight sync through "
            "CUDA IPC from every trainer rank, SGLang's routed-experts capture against routing replay")
    command = f"torchrun --nproc-per-node {gpus if gpus > 1 else 'N'} -m vapo_megatron.check --ranks"
    report("multi_gpu", "SKIP", f"not checked in this process ({gpus} GPU(s) visible): {what}; " + (
        f"check them now: {command}" if gpus > 1 else f"they need a node of 2+ GPUs, where: {command} "
        "(docs/gpu_node.md)"))
    failed = [n for n, s, _ in results if s == "FAIL"]
    print(f"vapo-check: {len(results) - len(failed)} of {len(results)} without FAIL"
          + (f"; FAIL: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
