"""The learning benchmark's runs: where they live, what they are made with, and the work
(data, warm starts, training, vapo-eval, credit diagnostics, summaries). See cli.py."""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import os
import shlex
import socket
import subprocess
import sys
import threading
from pathlib import Path

import yaml

from benchmarks.learning.runs import (
    curve_figures,
    eval_figures,
    finished,
    machine,
    metric_records,
    read_json,
    record_mismatch,
    spawn,
)
from benchmarks.learning.variants import (
    CRITIC_MODELS,
    ROOT,
    VARIANTS,
    BadInput,
    base_settings,
    derived_yaml,
    has_critic,
    resolve,
    run_problems,
)
from vapo_megatron.config.estimators import ESTIMATORS


def free_port() -> int:
    with socket.socket() as s:
        return s.bind(("127.0.0.1", 0)) or s.getsockname()[1]


class Bench:
    def __init__(self, a: argparse.Namespace):
        self.a = a
        self.out = Path(a.out)
        self.config = Path(a.config)
        self.base = base_settings(self.config, a.set)
        self.config_sha = hashlib.sha256(self.config.read_bytes()).hexdigest()
        self.steps = self.base["trainer"]["total_steps"] if a.steps is None else a.steps
        self.py = sys.executable
        self.warm = self.base["sft"]["steps"] > 0
        self.env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        self.locks: dict = collections.defaultdict(threading.Lock)
        self.once_done: dict = {}

    def in_base(self, key: str) -> bool:
        """Whether the base config's YAML sets `key` (dotted): what an "unset" can remove."""
        node = yaml.safe_load(self.config.read_text()) or {}
        for part in key.split("."):
            if not isinstance(node, dict) or part not in node:
                return False
            node = node[part]
        return True

    # ---- where things are ----------------------------------------------------------------------
    def data_seed(self, seed: int) -> int:
        return seed if self.a.data_seed is None else self.a.data_seed

    def data_dir(self, seed: int, critic: str | None = None) -> Path:
        return self.out / "data" / (f"seed{self.data_seed(seed)}" + (f"_critic{critic}" if critic else ""))

    def warm_dir(self, seed: int, critic: str | None = None) -> Path:
        return self.out / "warm" / (f"seed{self.data_seed(seed)}" + (f"_critic{critic}" if critic else ""))

    def run_dir(self, variant: str, seed: int) -> Path:
        return self.out / variant / f"seed{seed}"

    def copy_path(self, variant: str, seed: int) -> Path | None:
        return Path(self.a.summaries) / f"{variant}_seed{seed}.json" if self.a.summaries else None

    # ---- what a run is made with ---------------------------------------------------------------
    def data_args(self, critic: str | None = None) -> list[str]:
        return shlex.split(self.a.data_args) + (CRITIC_MODELS[critic] if critic else [])

    def warm_record(self, seed: int, critic: str | None = None) -> dict:
        return {"task": self.a.task, "data_seed": self.data_seed(seed), "data_args": self.data_args(critic),
                "config_sha256": self.config_sha, "set": self.a.set, "nproc": self.a.nproc,
                "sft": self.base["sft"] if self.warm else None}

    def record(self, variant: str, seed: int) -> dict:
        sets, unset = resolve(variant, self.base)
        critic = VARIANTS[variant].get("critic")
        entry = {"entry": VARIANTS[variant]["entry"]} if "entry" in VARIANTS[variant] else {}  # older records have none
        return {"variant": variant, "seed": seed, "config_sha256": self.config_sha, "steps": self.steps,
                "set": self.a.set, "overrides": sets, "unset": unset, "nproc": self.a.nproc,
                "warm_start": self.warm_record(seed),
                "critic": self.warm_record(seed, critic) if critic else None} | entry

    # ---- commands ------------------------------------------------------------------------------
    def data_cmd(self, seed: int, critic: str | None = None) -> list[str]:
        return [self.py, str(ROOT / "scripts" / "make_demo_data.py"), "--task", self.a.task, "--seed",
                str(self.data_seed(seed)), "--out", str(self.data_dir(seed, critic)), *self.data_args(critic)]

    def overrides(self, variant: str | None, seed: int, critic: str | None = None) -> list[str]:
        """vapo-train's overrides; variant None: the seed's warm start (of the critic's model with `critic`)."""
        d = self.data_dir(seed)
        files = [f"data.train_files=[{d}/train.jsonl]", f"data.eval_files=[{d}/eval.jsonl]",
                 f"sft.files=[{d}/sft.jsonl]"]
        if variant is None:
            s = self.data_seed(seed)
            return [f"trainer.run_dir={self.warm_dir(seed, critic)}",
                    f"model.hf_path={self.data_dir(seed, critic)}/model", *files, f"trainer.seed={s}", f"data.seed={s}",
                    *self.a.set, "trainer.total_steps=0", "algo.value_pretrain_steps=0"]
        model = f"{self.warm_dir(seed)}/hf" if self.warm else f"{d}/model"
        out = [f"trainer.run_dir={self.run_dir(variant, seed)}", f"model.hf_path={model}", *files,
               f"trainer.seed={seed}", f"data.seed={seed}", *self.a.set, f"trainer.total_steps={self.steps}",
               *(["sft.steps=0"] * self.warm), *resolve(variant, self.base)[0]]
        if critic := VARIANTS[variant].get("critic"):
            trunk = f"{self.warm_dir(seed, critic)}/hf" if self.warm else f"{self.data_dir(seed, critic)}/model"
            out.append(f"model.critic_hf_path={trunk}")
        return out

    def train_cmd(self, variant: str | None, seed: int, critic: str | None = None) -> list[str]:
        config = self.config if variant is None else self.run_dir(variant, seed) / "bench.yaml"
        entry = VARIANTS[variant].get("entry") if variant else None  # vapo-train, or a control's wrapper of it
        return [self.py, "-m", "torch.distributed.run", "--nproc-per-node", str(self.a.nproc), "--master-addr",
                "127.0.0.1", "--master-port", "PORT",
                *([str(ROOT / entry)] if entry else ["-m", "vapo_megatron.train"]),
                "--config", str(config), *self.overrides(variant, seed, critic)]

    def eval_args(self, seed: int) -> dict:
        r, e, rw = self.base["rollout"], self.base["eval"], self.base["reward"]
        return {"samples_per_prompt": self.a.eval_k or e["n_samples"], "max_new_tokens": r["max_new_tokens"],
                "temperature": r["temperature"] if e["temperature"] is None else e["temperature"], "seed": seed,
                "reward": rw["fn"]}

    def eval_cmd(self, run: Path, seed: int) -> list[str]:
        e, rw = self.eval_args(seed), self.base["reward"]
        return [self.py, "-m", "vapo_megatron.eval", "--model", str(run / "hf"),
                "--data", str(self.data_dir(seed) / "eval.jsonl"), "--out", str(run / "eval"),
                "--n-samples", str(e["samples_per_prompt"]), "--temperature", str(e["temperature"]),
                "--greedy", "--max-new-tokens", str(e["max_new_tokens"]), "--reward", rw["fn"], "--correct-score",
                str(rw["correct_score"]), "--incorrect-score", str(rw["incorrect_score"]), "--seed", str(seed)]

    def credit_cmd(self, run: Path) -> list[str]:
        return [self.py, "-m", "benchmarks.learning.credit", "--run", str(run), "--out", str(run / "credit.json")]

    # ---- checks, before any work ---------------------------------------------------------------
    def settings_problems(self, variants: list[str]) -> list[str]:
        """What the trainer would refuse, for every row and the warm starts (its own config checks)."""
        out = [f"the warm start: {p}" for p in run_problems(self.config, [], self.overrides(None, 0), self.a.nproc)]
        for v in variants:
            out += [f"{v}: {p}"
                    for p in run_problems(self.config, resolve(v, self.base)[1], self.overrides(v, 0), self.a.nproc)]
        return out

    def stale(self, plan: list[tuple[str, int]]) -> list[str]:
        """Every run, warm start or summary made with settings other than this command's."""
        out, seen = [], set()

        def check(path: Path, made: Path, want: dict) -> None:
            if path not in seen and made.exists():
                seen.add(path)
                if msg := record_mismatch(str(path), read_json(path / "bench_record.json"), want, flag="--out",
                                           in_base=self.in_base):
                    out.append(msg)
        for v, s in plan:
            copy = self.copy_path(v, s)
            if copy and copy.exists() and (msg := record_mismatch(str(copy), (read_json(copy) or {}).get("record"),
                                                                  self.record(v, s), flag="--summaries",
                                                                  in_base=self.in_base)):
                out.append(msg)
            check(self.run_dir(v, s), self.run_dir(v, s) / "checkpoints", self.record(v, s))
            for c in (None, VARIANTS[v].get("critic")) if self.warm else ():
                check(self.warm_dir(s, c), self.warm_dir(s, c) / "checkpoints", self.warm_record(s, c))
        return out

    # ---- work ----------------------------------------------------------------------------------
    def once(self, key, fn):
        """fn() once per key for this process, whichever thread asks first; the others wait for it."""
        with self.locks[key]:
            if key not in self.once_done:
                self.once_done[key] = fn()
            return self.once_done[key]

    def ensure_data(self, seed: int, critic: str | None = None) -> bool:
        d = self.data_dir(seed, critic)
        args = self.data_cmd(seed, critic)[2:]
        if (read_json(d / "bench_data.json") or {}).get("args") != args or not (d / "meta.json").exists():
            d.mkdir(parents=True, exist_ok=True)
            if spawn(self.data_cmd(seed, critic), d / "bench.log", self.env, ROOT)[0] != 0:
                return False
            (d / "bench_data.json").write_text(json.dumps({"args": args}) + "\n")
        return True

    def ensure_warm(self, seed: int, critic: str | None = None) -> bool:
        """The seed's warm start (of the critic's model with `critic`), once for every row that needs it."""
        run = self.warm_dir(seed, critic)
        if not (self.once(("data", self.data_seed(seed), None), lambda: self.ensure_data(seed))
                and self.once(("data", self.data_seed(seed), critic), lambda: self.ensure_data(seed, critic))):
            return False
        if not self.warm:
            return True
        self.write_record(run, self.warm_record(seed, critic))
        if not finished(run):
            self.train(None, seed, run, critic)
        if finished(run) and critic is None:
            return not isinstance(self.evaluate(run, seed), str)  # the starting point's figures
        return finished(run)

    @staticmethod
    def write_record(run: Path, record: dict) -> None:
        """What the run is made with, before its first checkpoint (after one, stale() has compared them)."""
        run.mkdir(parents=True, exist_ok=True)
        if not (run / "checkpoints").exists():
            (run / "bench_record.json").write_text(json.dumps(record, indent=1) + "\n")

    def train(self, variant: str | None, seed: int, run: Path, critic: str | None = None) -> int:
        """One attempt at the run (a resume if it was killed); its cost is added to bench_time.json."""
        cmd = [str(free_port()) if w == "PORT" else w for w in self.train_cmd(variant, seed, critic)]
        self.add_code(run)
        rc, wall, cpu = spawn(cmd, run / "bench.log", self.env, ROOT)
        self.add_time(run, "", wall, cpu, attempt=1)
        return rc

    def add_code(self, run: Path) -> None:
        """The commit (and whether the tree had changes) and machine kind of each attempt at training the run, in
        bench_code.json: a summary says which code trained it, and on what, not only which wrote the summary."""
        old = read_json(run / "bench_code.json") or {}
        (run / "bench_code.json").write_text(json.dumps({
            "train_code": [*old.get("train_code", []), self.code(dirty=True)],
            "train_machine": [*old.get("train_machine", []), self.machine]}) + "\n")

    @property
    def machine(self) -> dict:
        if "machine" not in self.once_done:
            self.once_done["machine"] = machine()
        return self.once_done["machine"]

    def machine_problems(self, plan: list[tuple[str, int]]) -> list[str]:
        """One machine kind per study: a run, warm start or committed summary of this plan trained on another CPU
        kind is refused before any work (its seed's other arms would run other kernels; a pairing would mix them)."""
        here, seen = self.machine, set()
        paths = [self.run_dir(v, s) / "bench_code.json" for v, s in plan]
        paths += [self.warm_dir(s) / "bench_code.json" for _, s in plan] if self.warm else []
        kinds = [(str(p), k, "--out") for p in paths for k in (read_json(p) or {}).get("train_machine", [])]
        for v, s in plan:
            copy = self.copy_path(v, s)
            for k in ((read_json(copy) or {}).get("train_machine") or []) if copy and copy.exists() else []:
                kinds.append((str(copy), k, "--summaries"))
        out = []
        for where, kind, flag in kinds:
            if kind != here and where not in seen:
                seen.add(where)
                out.append(f"{where} was trained on {kind['cpu']} ({kind['cpu_id']}, "
                           f"torch {kind['torch_cpu_capability']}); "
                           f"this machine is {here['cpu']} ({here['cpu_id']}, torch {here['torch_cpu_capability']}): a "
                           f"study runs on one machine kind; run it on that kind, or use another {flag}")
        return out

    @staticmethod
    def times(run: Path) -> dict:
        return {"wall_s": 0.0, "cpu_s": 0.0, "attempts": 0, "eval_wall_s": 0.0, "eval_cpu_s": 0.0} | (
            read_json(run / "bench_time.json") or {})

    def add_time(self, run: Path, prefix: str, wall: float, cpu: float, attempt: int = 0) -> None:
        t = self.times(run)
        t[f"{prefix}wall_s"] += wall
        t[f"{prefix}cpu_s"] += cpu
        t["attempts"] += attempt
        (run / "bench_time.json").write_text(json.dumps(t))

    def evaluate(self, run: Path, seed: int) -> dict | str:
        """vapo-eval of run/hf on all held-out prompts (again only if its outputs were made otherwise)."""
        want, got = self.eval_args(seed), read_json(run / "eval" / "summary.json") or {}
        if {k: got.get(k) for k in want} != want or "greedy_accuracy" not in got or got.get("data") != [
                str(self.data_dir(seed) / "eval.jsonl")]:
            rc, wall, cpu = spawn(self.eval_cmd(run, seed), run / "bench.log", self.env, ROOT)
            self.add_time(run, "eval_", wall, cpu)
            if rc != 0:
                return f"vapo-eval failed ({run / 'bench.log'})"
        return eval_figures(run / "eval", self.data_dir(seed))

    def credit(self, run: Path) -> dict | str:
        if not (run / "credit.json").exists():
            rc, wall, cpu = spawn(self.credit_cmd(run), run / "bench.log", self.env, ROOT)
            self.add_time(run, "eval_", wall, cpu)
            if rc != 0:
                return f"the credit diagnostics failed ({run / 'bench.log'})"
        credit = json.loads((run / "credit.json").read_text())
        # The run's place relative to --out: a committed summary names no path of this machine.
        return credit | {"run": str(run.relative_to(self.out)) if run.is_relative_to(self.out) else run.name}

    def do_run(self, variant: str, seed: int) -> dict:
        failed = {"variant": variant, "seed": seed, "status": "failed"}
        copy = self.copy_path(variant, seed)
        if copy and copy.exists():  # committed, and its record matched (stale() refused it otherwise)
            return json.loads(copy.read_text())
        run = self.run_dir(variant, seed)
        if (run / "summary.json").exists() and finished(run):
            return self.publish(variant, seed, json.loads((run / "summary.json").read_text()))
        critic = VARIANTS[variant].get("critic")
        for c in dict.fromkeys([None, critic]):
            if not self.once(("warm", self.data_seed(seed), c), lambda c=c: self.ensure_warm(seed, c)):
                return failed | {"log_tail": [f"the warm start failed: {self.warm_dir(seed, c) / 'bench.log'}"]}
        run.mkdir(parents=True, exist_ok=True)
        (run / "bench.yaml").write_text(derived_yaml(self.config, resolve(variant, self.base)[1]))
        self.write_record(run, self.record(variant, seed))
        if not finished(run):
            rc = self.train(variant, seed, run)
            if rc != 0 or not finished(run):
                tail = (run / "bench.log").read_text(errors="replace").strip().splitlines()[-3:]
                return failed | {"returncode": rc, "log_tail": tail, "needs": VARIANTS[variant].get("needs")}
        figures = self.evaluate(run, seed)
        credit = self.credit(run) if self.a.credit and has_critic(variant) else None
        if isinstance(figures, str) or isinstance(credit, str):
            return failed | {"log_tail": [figures if isinstance(figures, str) else credit]}
        summary = self.summarize(variant, seed, run, figures) | ({"credit": credit} if credit else {})
        (run / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
        return self.publish(variant, seed, summary)

    def publish(self, variant: str, seed: int, summary: dict) -> dict:
        if copy := self.copy_path(variant, seed):
            copy.parent.mkdir(parents=True, exist_ok=True)
            copy.write_text(json.dumps(summary, indent=1) + "\n")
        return summary

    def warm_summary(self, seed: int, critic: str | None = None) -> dict:
        run = self.warm_dir(seed, critic)
        records = metric_records(run)
        sft = [r for r in records if r.get("phase") == "sft"]
        final = next((r for r in reversed(records) if "eval/accuracy_final" in r), {})
        t = self.times(run)
        figures = eval_figures(run / "eval", self.data_dir(seed)) if (run / "eval" / "summary.json").exists() else {}
        meta = read_json(self.data_dir(seed, critic) / "meta.json") or {}
        return figures | {"sft_steps": sft[-1]["sft_step"] if sft else 0, "train_accuracy": next(
            (r["sft/train_accuracy"] for r in reversed(sft) if "sft/train_accuracy" in r), None),
            "eval_accuracy": final.get("eval/accuracy"),
            "eval_avg@K": final.get(f"eval/avg@{self.base['eval']['n_samples']}"),
            "train_code": (read_json(run / "bench_code.json") or {}).get("train_code"),
            "train_machine": (read_json(run / "bench_code.json") or {}).get("train_machine"),
            "parameters": meta.get("num_parameters"), "wall_s": round(t["wall_s"], 1), "cpu_s": round(t["cpu_s"], 1),
            "eval_cpu_s": round(t["eval_cpu_s"], 1)}

    def summarize(self, variant: str, seed: int, run: Path, figures: dict) -> dict:
        cfg, t = self.settings(run), self.times(run)
        r, k = cfg["rollout"], cfg["eval"]["n_samples"]
        vp = cfg["algo"]["value_pretrain_steps"] if ESTIMATORS[cfg["algo"]["estimator"]].needs_critic else 0
        records = metric_records(run)
        final = next((x for x in reversed(records) if "eval/accuracy_final" in x), {})
        critic = VARIANTS[variant].get("critic")
        return {
            "variant": variant, "seed": seed, "status": "finished", "record": self.record(variant, seed),
            "overrides": resolve(variant, self.base)[0], "unset": resolve(variant, self.base)[1],
            "steps": cfg["trainer"]["total_steps"], "value_pretrain_steps": vp,
            "wall_s": round(t["wall_s"], 1), "cpu_s": round(t["cpu_s"], 1), "attempts": t["attempts"],
            "eval_wall_s": round(t["eval_wall_s"], 1), "eval_cpu_s": round(t["eval_cpu_s"], 1),
            "warm_start": self.warm_summary(seed) if self.warm else None,
            "critic_warm_start": self.warm_summary(seed, critic) if critic and self.warm else None,
            "accuracy": final.get("eval/accuracy"), "avg@K": final.get(f"eval/avg@{k}"), "trainer_eval_k": k,
            "code": self.code(), "train_code": (read_json(run / "bench_code.json") or {}).get("train_code"),
            "train_machine": (read_json(run / "bench_code.json") or {}).get("train_machine"),
        } | curve_figures(records, value_pretrain=vp, steps=cfg["trainer"]["total_steps"],
                          prompts=r["prompts_per_step"], n_samples=r["n_samples"]) | figures

    def settings(self, run: Path) -> dict:
        """The run's own resolved settings (run_dir/config.yaml, the trainer's)."""
        import yaml
        return yaml.safe_load((run / "config.yaml").read_text())

    def code(self, dirty: bool = False) -> str | None:
        """The harness's commit (informative, not in the record); `dirty`: "+changes" if tracked files differ."""
        p = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        commit = p.stdout.strip() or None
        if commit and dirty and subprocess.run(["git", "diff", "--quiet", "HEAD"], cwd=ROOT).returncode == 1:
            commit += "+changes"
        return commit

    def read_summary(self, variant: str, seed: int) -> dict | None:
        """A run's summary, the --summaries copy first; one made with other settings is refused, and
        one with no record (issue 31's harness wrote none) unless --unrecorded lets --report table it."""
        for path, flag in ((self.copy_path(variant, seed), "--summaries"),
                           (self.run_dir(variant, seed) / "summary.json", "--out")):
            if path and path.exists():
                s = json.loads(path.read_text())
                if s.get("record") is None and self.a.unrecorded:
                    return s
                if msg := record_mismatch(str(path), s.get("record"), self.record(variant, seed), flag=flag,
                                          in_base=self.in_base):
                    raise BadInput(msg + ("; or add --unrecorded to table it in that harness's columns, its settings "
                                          "unchecked" if s.get("record") is None and self.a.report else ""))
                return s
        return None
