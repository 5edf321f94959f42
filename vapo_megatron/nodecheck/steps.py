"""vapo-check's trainer checks: vapo_steps (VAPO steps of the demo task through the trainer's Trainer,
phase_memory at its phase switches) and plan_memory (vapo-plan's estimate against the measured
peak). Described in vapo_megatron/check.py's docstring; run through it."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import torch

from vapo_megatron.nodecheck.models import GIB, Env, report

ROOT = Path(__file__).resolve().parents[2]
TRAINING_PHASES = ("score", "critic_update", "actor_update")  # what vapo-plan's `training` peak covers


def check_vapo_steps(env: Env, steps: int) -> dict | None:
    from vapo_megatron.config import load_config
    from vapo_megatron.sizing.plan import check_engine_share
    from vapo_megatron.sizing.step_config import predict_on_this_gpu
    from vapo_megatron.tasks.demo_task import TinyModelSpec, write_demo_dir
    from vapo_megatron.trainer.signals import StopSignals
    from vapo_megatron.trainer.trainer import Planner, Trainer

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
        trainer = Trainer(cfg, StopSignals(), Planner(check_engine_share, predict_on_this_gpu))
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
    engine_bytes = (sum(t.numel() * t.element_size() for t in engine.model.parameters()) if hasattr(engine, "model")
                    else 0)
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
        report("plan_memory", "SKIP", "no CUDA memory counters on the CPU (vapo-plan predicts "
                                      f"{predicted / 2**20:.1f} MiB training peak for this layout, without reserve)")
        return
    measured = run["training_peak"]
    ratio = measured / predicted
    report("plan_memory", "PASS" if measured <= predicted else "FAIL",
           f"measured training-phase peak {measured / 2**20:.1f} MiB (above the start, less the embedded engine's "
           f"{run['engine_bytes'] / 2**20:.1f} MiB of weights) vs vapo-plan's training {predicted / 2**20:.1f} MiB "
           f"(no reserve): ratio measured/predicted {ratio:.2f}")
