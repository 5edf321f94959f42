"""vapo-check (vapo_megatron/check.py) stays runnable without a GPU: its --cpu mode runs every check that can run
on the CPU (gloo) with no FAIL (assert_cpu_mode_passes, run by tests/e2e/test_gpu_bundle.py in the
bundle's environment), and without --cpu on a machine with no GPU it says so in one line and exits
2, without a traceback. What it checks on a GPU is described in vapo_megatron/check.py."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.helpers.train_runs import ROOT

FAMILIES = ("tiny-qwen2", "tiny-qwen3", "tiny-llama3", "tiny-qwen3-moe")  # vapo-check's default presets
CHECKS = ("collectives", "wait_groups", "wgrad_fusion", "recompute", "vocab_parallel",
          *(f"{check}:{p}" for p in FAMILIES for check in ("model_logits", "weight_sync")),
          "routing_replay:tiny-qwen3-moe", "offload", "offload_memory", "adam_resume", "save_before_update",
          "engine_memory", "sync_memory", "engine_signals", "vapo_steps", "phase_memory", "plan_memory", "multi_gpu")


def _run(*args: str) -> subprocess.CompletedProcess:
    # CUDA hidden: the same answer on a GPU machine as on this one.
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run([sys.executable, "-m", "vapo_megatron.check", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=900)


# The four families' tiny presets (the default), and a preset too large for this machine: its
# model checks say why they SKIP instead of running it out of memory.
CPU_ARGS = ("--cpu", "--model-preset", *FAMILIES, "qwen3-235b-a22b")


def assert_cpu_mode_passes(run: subprocess.CompletedProcess) -> None:
    """`vapo-check *CPU_ARGS`: every check that can run on the CPU passed; only the GPU
    measurements and the oversized preset's model checks are skipped, each with its reason.
    Run by tests/e2e/test_gpu_bundle.py, in the environment the air-gapped bundle installs (the
    same pinned libraries as this one): one vapo-check --cpu run serves both."""
    lines = run.stdout.splitlines()
    status = {line.split()[1]: line.split()[0] for line in lines if line[:4] in ("PASS", "FAIL", "SKIP")}
    assert run.returncode == 0 and "FAIL" not in status.values(), run.stdout + run.stderr[-4000:]
    big = {"model_logits:qwen3-235b-a22b", "weight_sync:qwen3-235b-a22b", "routing_replay:qwen3-235b-a22b"}
    assert set(status) == set(CHECKS) | big, status
    assert {c for c, s in status.items() if s == "SKIP"} == {"engine_memory", "sync_memory", "engine_signals",
                                                              "phase_memory", "plan_memory", "offload_memory",
                                                              "multi_gpu"} | big
    assert "SGLang at an engine TP > 1" in run.stdout  # what it did not check, said (issue 63)
    assert "qwen3-235b-a22b needs about" in run.stdout
    assert all(len(line.split(None, 2)) == 3 for line in lines if line[:4] == "SKIP")


def test_without_a_gpu_it_says_so_in_one_line_and_exits_2():
    run = _run()
    assert run.returncode == 2
    out = (run.stdout + run.stderr).strip().splitlines()
    assert len(out) == 1 and out[0].startswith("vapo-check: no CUDA GPU visible") and "--cpu" in out[0], out


def test_bad_arguments_are_one_line_each_naming_the_flag_before_any_check():
    """issue 63: `--steps -1` ran every check for 40 s and then reported `FAIL vapo_steps ConfigError`;
    `--steps 0` passed having trained nothing. Now exit 2 at once, one line per bad argument, its flag
    named, and nothing on stdout (no check ran: not even the header line, printed after torch's import)."""
    for args, says in ((("--steps", "-1"), ["vapo-check: --steps=-1 must be >= 1"]),
                       (("--steps", "0"), ["vapo-check: --steps=0 must be >= 1"]),
                       (("--steps", "two"), ["vapo-check: argument --steps: invalid int value: 'two'"]),
                       (("--model-preset", "tiny-qwen2", "nope", "--offload-preset", "zz", "--steps", "0"),
                        ["vapo-check: --steps=0 must be >= 1",
                         "vapo-check: --model-preset: unknown model preset 'nope'",
                         "vapo-check: --offload-preset: unknown model preset 'zz'"])):
        run = _run("--cpu", *args)
        lines = run.stderr.strip().splitlines()
        assert run.returncode == 2 and run.stdout == "", (args, run.stdout, run.stderr[-2000:])
        assert len(lines) == len(says) and all(line.startswith(s) for line, s in zip(lines, says)), (args, lines)
