"""What the learning benchmark reads and records of one run (issues 31 and 45).

    spawn(cmd, log, env)           run a child that the kernel kills when the harness dies; (rc, wall s, CPU s)
    finished(run)                  the run's latest checkpoint says finished
    record_mismatch(where, old, new, flag=...)   the first setting a run was made with that this command changes
    curve_figures(records, ...)    the held-out curve, its area, samples generated
    eval_figures(eval_dir, data)   vapo-eval's figures on all held-out prompts and on the short/long chains
    machine()                      this machine's CPU kind: its model, and the kernels torch picks on it

A run's record is what it was made with: the base config's hash, steps, every override, the
warm start's SFT settings and the data's arguments; never paths, so a moved --out still matches.
"""

from __future__ import annotations

import csv
import ctypes
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

from vapo_megatron.runtime.machine import machine  # noqa: F401  (the harness's: each attempt records it)

PR_SET_PDEATHSIG = 1  # linux/prctl.h
BUCKETS = ("short", "long")


def die_with_me():
    """A preexec_fn: the child gets SIGKILL when the thread that started it dies, which a
    `kill -9` of the harness is. torchrun's workers already die with their agent
    (vapo_megatron/trainer/run_guard.py, die_with_launcher), so the whole tree goes. prctl is
    looked up here, in the parent, so that the child only calls it between fork and exec."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    me = os.getpid()

    def arm() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != me:  # the harness died before the request was in place
            os._exit(1)

    return arm


def spawn(cmd: list[str], log: Path, env: dict, cwd: Path) -> tuple[int, float, float]:
    """(exit code, wall s, CPU s of the command and its children), output appended to `log`."""
    start = time.time()
    with open(log, "a") as f:
        f.write(f"\n$ {shlex.join(cmd)}\n")
        f.flush()
        p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=cwd, env=env, preexec_fn=die_with_me())
        _, status, usage = os.wait4(p.pid, 0)
        p.returncode = os.waitstatus_to_exitcode(status)
    return p.returncode, time.time() - start, usage.ru_utime + usage.ru_stime


def finished(run: Path) -> bool:
    try:
        latest = (run / "checkpoints" / "latest").read_text().strip()
        return bool(json.loads((run / "checkpoints" / latest / "state.json").read_text())["state"]["finished"])
    except (OSError, ValueError, KeyError, TypeError):
        return False


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        out |= _flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v}
    return out


def record_mismatch(where: str, old: dict | None, new: dict, *, flag: str, in_base=None) -> str | None:
    """None when `old` (what a run was made with) is `new` (what this command would make);
    else one line naming the first difference. `flag`: the option that named `where` (--out for a
    run directory, --summaries for a summary copy), the one the line tells to change. `in_base(key)`:
    whether the base config sets a key; then the "unset" lists compare by what they remove from it
    (dropping a key the base never set changes nothing, so a longer list of critic-only keys,
    such as one that grew with the schema, is the same run)."""
    if old is None:
        return (f"{where} has no record of its settings (made by the harness before issue 45, which wrote none): "
                f"use another {flag} or remove it")
    if in_base is not None:
        old, new = ({**r, "unset": sorted(k for k in r.get("unset", []) if in_base(k))} for r in (old, new))
    a, b = _flat(old), _flat(new)
    for key in sorted(set(a) | set(b)):
        if a.get(key) != b.get(key):
            return (f"{where} was made with {key}={a.get(key)!r}, this command asks for {b.get(key)!r}: a run is never "
                    f"reused or tabled beside runs of other settings; use another {flag}, or remove it to redo it")
    return None


def metric_records(run: Path) -> list[dict]:
    p = run / "metrics.jsonl"
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()] if p.exists() else []


def curve_figures(records: list[dict], *, value_pretrain: int, steps: int, prompts: int, n_samples: int) -> dict:
    """The held-out greedy curve (iteration, accuracy), its area over RL steps 0..steps divided by
    steps (the mean accuracy during RL; the actor is the warm start until value pretraining ends,
    so an eval at iteration i is at RL step max(0, i - value_pretrain)), and samples generated
    (value-pretraining steps and dynamic sampling's extra rounds included) and samples trained.

    Samples generated: the trainer's rollout/samples_generated, or for a partial-rollout run made
    before it logged that, partial/groups_admitted x n + partial/samples_restarted (responses begun;
    those still carried at the end count too), or rollout/prompts_consumed x n (default: prompts x n).
    Samples trained: partial/groups_trained x n for partial rollout (dynamic sampling may leave a step
    short), else prompts x n per RL step."""
    curve = [[r["step"], r["eval/accuracy"]] for r in records if "eval/accuracy" in r]
    by_rl = {}
    for it, acc in curve:
        by_rl[max(0, it - value_pretrain)] = acc
    xs = sorted(by_rl)
    area = None
    if steps > 0 and xs and xs[0] == 0 and xs[-1] == steps:
        area = sum((x1 - x0) * (by_rl[x0] + by_rl[x1]) / 2 for x0, x1 in zip(xs, xs[1:])) / steps
    rollout = {r["step"]: r for r in records if r.get("phase") in ("value_pretrain", "vapo")}

    def begun(r: dict) -> float:
        if "rollout/samples_generated" in r:
            return r["rollout/samples_generated"]
        if "partial/groups_admitted" in r:
            return r["partial/groups_admitted"] * n_samples + r.get("partial/samples_restarted", 0)
        return r.get("rollout/prompts_consumed", prompts) * n_samples

    generated = sum(begun(r) for r in rollout.values())
    trained = sum(r.get("partial/groups_trained", prompts) * n_samples for r in rollout.values()
                  if r["phase"] == "vapo")
    return {"curve": curve, "auc": area, "samples_generated": int(generated), "samples": int(trained)}


def _prompts(path: Path) -> list[str]:
    return [json.loads(line)["prompt"] for line in path.read_text().splitlines() if line.strip()]


def eval_figures(eval_dir: Path, data: Path) -> dict:
    """vapo-eval's run on data/eval.jsonl: avg@K and greedy accuracy on all its prompts, and avg@K
    on the prompts of eval_short.jsonl and eval_long.jsonl (subsets of it) from the same samples."""
    s = json.loads((eval_dir / "summary.json").read_text())
    k = s["samples_per_prompt"]
    prompt_at = dict(enumerate(_prompts(data / "eval.jsonl"), start=1))  # sources are "path:line", 1-based
    with open(eval_dir / "per_prompt.csv", newline="") as f:
        rows = [(prompt_at[int(r["source"].rsplit(":", 1)[1])], int(r["correct"]) / int(r["samples"]))
                for r in csv.DictReader(f)]
    out = {"eval_k": k, "heldout_prompts": s["prompts"], "heldout_avg@K": s[f"avg@{k}"],
           "heldout_accuracy": s.get("greedy_accuracy"), "heldout_mean_length": s.get("response_length/mean")}
    for b in BUCKETS:
        if (data / f"eval_{b}.jsonl").exists():
            mine = set(_prompts(data / f"eval_{b}.jsonl"))
            acc = [a for p, a in rows if p in mine]
            out |= {f"{b}_prompts": len(acc), f"{b}_avg@K": sum(acc) / len(acc) if acc else None}
    return out
