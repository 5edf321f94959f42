"""vapo-plan: will a run fit on its GPUs? Per-GPU memory of actor, critic (if any) and the SGLang engine.

    vapo-plan --config configs/qwen2.5_32b_vapo.yaml --nodes 8 --gpus-per-node 8 [--gpu-memory-gib 80]
              [--reserve-gib G] [--preset qwen2.5-32b] [--critic-preset qwen3-8b]
              [--gpu h100 [--mean-response-tokens N] ...
              [--search [--top N] [--json]]] [key=value overrides...]

Nothing is loaded and no GPU is used. For each DISTINCT rank position (tp_rank, pp_rank; DP
replicas are identical) the real actor and critic providers build that rank's shard on the meta
device (vapo_megatron/sizing/shards.py); bytes are then counted per rank (sizing/memory.py) for the
two phases of a colocated run, training and rollout (sizing/plan.py), each of which must fit in
--gpu-memory-gib minus a reserve, itemised per phase (CUDA contexts of trainer and engine, NCCL
buffers, the caching allocator, SGLang's buffers outside its static share); --reserve-gib replaces
it by one flat figure. Also printed: the size of one checkpoint and the disk the kept ones need.

The model config comes from model.hf_path/config.json when that file exists; otherwise --preset
NAME (model_providers/presets.py) must be given, and it is always said which one was used. The
critic's is critic.warm_start's or model.critic_hf_path's config.json, or --critic-preset NAME (a
critic of its own size), else the actor's; it is sized and timed at critic.parallel when given (its
own TP/PP/VPP/EP on the same GPUs: sizing/plan.py), else at the actor's layout.
With algo.estimator=grpo (GRPO, DAPO) there is no critic: only the actor is sized and built, and the
report compares the KV cache and state with the same config with a critic (sizing/plan.py).
Mixture-of-experts models (Qwen3-MoE) are sized at parallel.ep: each rank holds E/EP of every MoE
layer's experts, whose optimizer state the distributed optimizer shards over expert-DP = DP/EP.
With --gpu NAME (h100, h200, a100, b200, gb200) it also prints how long one iteration takes, per
phase, its tokens/s/GPU and the whole run's GPU-hours (sizing/step_time.py: datasheet rates at
stated efficiencies, with --mean-response-tokens, --mean-prompt-tokens, --storage-gb-per-s and
--eval-prompts as the assumptions it cannot read from the config).
With --search (and --gpu) it tries every layout instead of the config's: TP, PP, VPP, EP, the
engine's TP, recompute, offload and micro-batch tokens, each through the same checks and memory
check as one config, and ranks those that fit by modelled step time, the config's own among them,
then the critic's own layouts beside the fastest (sizing/search.py, critic_search.py; --top N, --json
for a list of records; exit 0 when one fits, 1 when none does, 2 when the checks refuse every layout:
the refusals counted by rule and the three closest, each with its problems).
Exit status: 0 fits, 1 does not fit (each failing phase, rank and the amount over are printed),
2 invalid configuration or layout (one message, never a traceback: config/cli.py). The figures are computed, not
measured (docs/slurm.md).
"""

from __future__ import annotations

import argparse
import os
import sys

from vapo_megatron.config import ConfigError, parse_config, problems_error
from vapo_megatron.config.critic_start import critic_start
from vapo_megatron.config.engines import colocated_engines, engine_of, known_engine


def resolve_model_config(hf_path: str, preset: str | None, *, key: str) -> tuple[dict, str]:
    """(HF config dict, where it came from): --preset wins; else hf_path/config.json, which must exist."""
    from model_providers import read_hf_config
    from model_providers.presets import PRESETS
    from model_providers.presets import preset as get_preset

    if preset is not None:
        hf_cfg = get_preset(preset)
        hf_cfg["_source"] = f"preset {preset}"
        return hf_cfg, f"preset {preset} (--preset; {key}={hf_path or '(empty)'} not read)"
    if hf_path and os.path.isfile(os.path.join(hf_path, "config.json")):
        hf_cfg = read_hf_config(hf_path)
        return hf_cfg, hf_cfg["_source"]
    raise ConfigError(f"{key}={hf_path or '(empty)'} has no config.json: give the model's config with "
                      f"--preset NAME (known: {', '.join(PRESETS)})")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="vapo-plan", description=__doc__.split("\n")[0])
    ap.add_argument("--config", required=True, help="run config (YAML)")
    ap.add_argument("--nodes", type=int, required=True)
    ap.add_argument("--gpus-per-node", type=int, required=True)
    ap.add_argument("--gpu-memory-gib", type=float, default=None,
                    help="memory of one GPU (default: the --gpu's, else 80)")
    ap.add_argument("--reserve-gib", type=float, default=None,
                    help="one flat figure kept free on every GPU instead of the itemised reserve (CUDA contexts, NCCL "
                         "buffers, allocator cache, SGLang's buffers; printed)")
    ap.add_argument("--preset", default=None,
                    help="model config by name (model_providers/presets.py), for planning without the model files; "
                         "otherwise model.hf_path/config.json is read")
    ap.add_argument("--critic-preset", default=None,
                    help="the critic's model config by name: a critic of its own size (what model.critic_hf_path or "
                         "critic.warm_start gives the trainer; at critic.parallel, else the actor's layout); otherwise "
                         "their config.json, else the actor's model")
    timing = ap.add_argument_group("step time and cost (sizing/step_time.py; computed, nothing measured)")
    timing.add_argument("--gpu", default=None, help="the GPU whose rates time the step: h100, h200, a100, b200, gb200")
    timing.add_argument("--mean-response-tokens", type=float, default=None,
                      help="mean response length (default: rollout.max_new_tokens / 4); the longest is max_new_tokens")
    timing.add_argument("--mean-prompt-tokens", type=float, default=None,
                      help="mean prompt length (default: 200, at most data.max_prompt_tokens)")
    timing.add_argument("--storage-gb-per-s", type=float, default=1.0,
                      help="GB/s the job writes to its file system, all nodes together (checkpoints; default 1)")
    timing.add_argument("--eval-prompts", type=int, default=None,
                      help="prompts in the eval set (default: eval.max_prompts; fewer when the set is smaller)")
    search = ap.add_argument_group("layout search (sizing/search.py; computed, nothing measured)")
    search.add_argument("--search", action="store_true",
                        help="every layout the trainer accepts on these GPUs (TP, PP, VPP, EP, engine TP, recompute, "
                             "offload, micro-batch tokens) that fits, ranked by modelled step time; needs --gpu")
    search.add_argument("--top", type=int, default=None, help="layouts shown (default 10; the config's own always)")
    search.add_argument("--json", action="store_true", help="print the ranking as a JSON list of records")
    ap.add_argument("overrides", nargs="*", help="dotted config overrides, e.g. parallel.pp=2")
    args = ap.parse_args(argv)
    from vapo_megatron.config.cli import answer
    from vapo_megatron.config.quiet import quiet_startup

    quiet_startup()

    return answer("vapo-plan", lambda: plan(args), bad_input=(ConfigError,))


def plan(args: argparse.Namespace) -> int:
    """Check the configuration for the cluster (exit 2 naming every problem), then size it."""
    from model_providers import HFConfigError, check_supported
    from vapo_megatron.config.checks import config_problems
    from vapo_megatron.config.preflight import critic_layout_problems, launch_problems
    from vapo_megatron.sizing.search import setting_problems

    try:
        if args.nodes < 1 or args.gpus_per_node < 1:
            raise ConfigError(f"--nodes={args.nodes} and --gpus-per-node={args.gpus_per_node} must be >= 1")
        cfg, problems = parse_config(args.config, args.overrides)
        world = args.nodes * args.gpus_per_node
        try:
            actor_hf, source = resolve_model_config(cfg.model.hf_path, args.preset, key="model.hf_path")
            critic_hf = actor_hf
            start = critic_start(cfg)  # the critic's own model, when it has one
            own = start.key != "model.hf_path"
            if args.critic_preset is not None or (own and args.preset is None):
                critic_hf, critic_source = resolve_model_config(str(start.config_dir) if own else "",
                                                                args.critic_preset,
                                                                key=start.key if own else "model.critic_hf_path")
                source += f"; critic: {critic_source}"
        except (ConfigError, ValueError) as e:  # with the file's own problems (a missing --config says so first)
            raise problems_error(problems + [str(e)]) from None
        try:
            check_supported(actor_hf)
            check_supported(critic_hf)
        except HFConfigError as e:
            problems.append(str(e))
        if args.search:  # the layout is the search's: only what no layout can fix, and the search's options
            problems += setting_problems(cfg) + time_option_problems(args, cfg) + search_option_problems(args, cfg)
            # critic.parallel as given: no actor layout changes whether it splits the critic and the batch
            problems += critic_layout_problems(cfg, world, critic_hf, "model.hf_path" if critic_hf is actor_hf
                                               else "model.critic_hf_path")
        else:
            problems += config_problems(cfg, check_paths=False)
            problems += time_option_problems(args, cfg)
            problems += [f"{option} needs --search" for option, given in (("--json", args.json), ("--top", args.top))
                         if given not in (False, None)]
            problems += launch_problems(cfg, world, actor_hf, critic_hf, gpus_per_node=args.gpus_per_node)
        if problems:
            raise problems_error(problems)
    except (ConfigError, ValueError) as e:  # ValueError: an unknown preset, an unreadable config.json
        print(f"vapo-plan: invalid configuration for {args.nodes} x {args.gpus_per_node} GPUs: {e}", file=sys.stderr)
        return 2
    from vapo_megatron.mcore.megatron_import import import_megatron

    import_megatron()  # on a machine without CUDA, no torch.compile at megatron-core's import
    if args.search:
        return search_layouts(args, cfg, actor_hf, critic_hf, source, world)
    from vapo_megatron.sizing.plan import make_plan
    from vapo_megatron.sizing.report import format_plan

    plan = make_plan(cfg, actor_hf, critic_hf, world_size=world, gpu_memory_gib=gpu_memory_gib(args),
                     reserve_gib=args.reserve_gib)
    print(f"config: {args.config}" + (f" with {' '.join(args.overrides)}" if args.overrides else ""))
    print(format_plan(plan, cfg, model_source=source, nodes=args.nodes, gpus_per_node=args.gpus_per_node))
    if args.gpu is not None:
        print()
        print(step_time_report(args, cfg, plan, actor_hf, critic_hf))
    return 1 if plan.problems else 0


def search_option_problems(args: argparse.Namespace, cfg) -> list[str]:
    """--search ranks by the step-time model: it needs --gpu, and a colocated engine (what the model times)."""
    problems = []
    if args.gpu is None:
        problems.append("--search ranks layouts by modelled step time: give the GPU with --gpu (h100, h200, a100, "
                        "b200, gb200)")
    if known_engine(cfg) is not None and not engine_of(cfg).colocated:  # an unknown one: config_problems says
        problems.append(f"--search ranks by the step-time model, which times colocated engines only; this "
                        f"config's rollout.engine={cfg.rollout.engine} "
                        f"(set rollout.engine={' or '.join(colocated_engines())})")
    if args.top is not None and args.top < 1:
        problems.append(f"--top={args.top} must be >= 1")
    return problems


def search_layouts(args: argparse.Namespace, cfg, actor_hf: dict, critic_hf: dict, source: str, world: int) -> int:
    """--search: the ranking as a table, or with --json as a list of records. Exit 0 when a layout fits, 1 when
    none does, 2 when the checks refuse every layout (the refusals by rule and the closest are printed)."""
    import json
    import shlex

    from vapo_megatron.sizing.hardware import GPUS
    from vapo_megatron.sizing.search import Assumptions, records, search
    from vapo_megatron.sizing.search_report import format_search, no_layout_lines

    a = Assumptions(gpu=GPUS[args.gpu], gpus_per_node=args.gpus_per_node, gpu_memory_gib=gpu_memory_gib(args),
                    reserve_gib=args.reserve_gib, response_tokens=args.mean_response_tokens,
                    prompt_tokens=args.mean_prompt_tokens, storage_gb_s=args.storage_gb_per_s,
                    eval_prompts=args.eval_prompts)
    result = search(cfg, actor_hf, critic_hf, world=world, a=a)
    top = args.top or 10
    # 0: a layout fits; 1: some pass the checks but none fits in memory; 2: the checks refuse every
    # layout, which is bad input like a setting no layout can fix (docs/slurm.md, "Choosing a layout").
    code = 0 if result.rows else 2 if result.nothing_accepted else 1
    if args.json:
        print(json.dumps(records(result, top), indent=1))
        if not result.rows:  # the records hold no reason for that: it goes to stderr, stdout stays JSON
            print("\n".join(f"vapo-plan: {line}" for line in no_layout_lines(result)), file=sys.stderr)
        return code
    options = [("--preset", args.preset), ("--critic-preset", args.critic_preset),
               ("--gpu-memory-gib", args.gpu_memory_gib), ("--reserve-gib", args.reserve_gib),
               ("--mean-response-tokens", args.mean_response_tokens), ("--mean-prompt-tokens", args.mean_prompt_tokens),
               ("--storage-gb-per-s", None if args.storage_gb_per_s == 1.0 else args.storage_gb_per_s),
               ("--eval-prompts", args.eval_prompts)]
    given = [x for option, v in options if v is not None
             for x in (option, f"{v:g}" if isinstance(v, float) else str(v))]
    rerun = shlex.join(["vapo-plan", "--config", args.config, "--nodes", str(args.nodes), "--gpus-per-node",
                        str(args.gpus_per_node), "--gpu", args.gpu, *given, *args.overrides])
    print(format_search(result, cfg, top=top, model_source=source, nodes=args.nodes, config_path=args.config,
                        rerun=rerun))
    return code


def gpu_memory_gib(args: argparse.Namespace) -> float:
    """--gpu-memory-gib, else the --gpu's memory, else 80 (an H100 or A100 80GB)."""
    from vapo_megatron.sizing.hardware import GPUS

    if args.gpu_memory_gib is not None:
        return args.gpu_memory_gib
    return GPUS[args.gpu].memory_gib if args.gpu is not None else 80.0


def time_option_problems(args: argparse.Namespace, cfg) -> list[str]:
    """The step-time options, each bad one named (sizing/step_config.py option_problems), and the
    memory ones: every number finite (argparse's float takes nan and inf) and in its range."""
    import math

    from vapo_megatron.sizing.step_config import option_problems

    problems = option_problems(gpu=args.gpu, response_tokens=args.mean_response_tokens,
                               prompt_tokens=args.mean_prompt_tokens, storage_gb_s=args.storage_gb_per_s,
                               eval_prompts=args.eval_prompts, max_new_tokens=cfg.rollout.max_new_tokens,
                               max_prompt_tokens=cfg.data.max_prompt_tokens)
    if args.gpu_memory_gib is not None and not (math.isfinite(args.gpu_memory_gib) and args.gpu_memory_gib > 0):
        problems.append(f"--gpu-memory-gib={args.gpu_memory_gib:g} must be a finite number > 0")
    if args.reserve_gib is not None and not (math.isfinite(args.reserve_gib) and args.reserve_gib >= 0):
        problems.append(f"--reserve-gib={args.reserve_gib:g} must be a finite number >= 0 (GiB kept free on every GPU)")
    return problems


def step_time_report(args: argparse.Namespace, cfg, plan, actor_hf: dict, critic_hf: dict) -> str:
    """The step-time table for --gpu, from the plan's own counts (KV-cache tokens per engine, bytes
    offloaded per GPU, checkpoint bytes)."""
    from vapo_megatron.sizing.hardware import GPUS
    from vapo_megatron.sizing.report import format_step_time
    from vapo_megatron.sizing.step_config import plan_setup, without_critic_delta
    from vapo_megatron.sizing.step_time import estimate

    if not engine_of(cfg).colocated:
        return (f"step time: modelled for colocated engines (rollout.engine={' or '.join(colocated_engines())}) only; "
                f"this config's rollout.engine={cfg.rollout.engine}")
    gpu = GPUS[args.gpu]
    setup = plan_setup(cfg, plan, actor_hf, critic_hf, gpus_per_node=args.gpus_per_node, gpu=gpu,
                       response_tokens=args.mean_response_tokens, prompt_tokens=args.mean_prompt_tokens,
                       storage_gb_s=args.storage_gb_per_s, eval_prompts=args.eval_prompts)
    delta = without_critic_delta(gpu, setup) if setup.critic is None else None
    return format_step_time(estimate(gpu, setup), cfg, critic_delta_s=delta)


if __name__ == "__main__":
    sys.exit(main())
