"""The learning benchmark (issue 31): the VAPO paper's ablation rows, seeds x variants, on one task.

    python scripts/bench_learning.py --variants vapo,vanilla_ppo --seeds 0,1,2 [--steps N] [--jobs K]
    python scripts/bench_learning.py --dry-run          the commands, nothing run
    python scripts/bench_learning.py --report           the table and figure of what has finished

Every variant is one row of VARIANTS: dotted overrides ("set") on the base config (--config,
configs/chain_cpu.yaml by default) and keys of the base config to drop ("unset": the key returns
to its schema default, e.g. the grpo rows drop the critic-only settings the base config tunes,
which a grpo config refuses). The harness writes each run's configuration as a YAML of its own,
OUT/<variant>/seed<k>/bench.yaml (the base with the unset keys removed), then starts
`torchrun --nproc-per-node 2 -m vapo_megatron.train --config bench.yaml <set> <seed overrides>`
with trainer.run_dir=OUT/<variant>/seed<k>. Same sample budget for every variant: total steps x
prompts_per_step x n_samples (no_group_sampling multiplies prompts_per_step by the base's group
size); the optimizer settings are the base's.

Seeds: seed k writes the task's data, tokenizer and random-init model once, OUT/data/seed<k>
(`make_demo_data.py --task TASK --seed k`), shared by every variant of that seed, and sets
trainer.seed=k and data.seed=k.

Resumes: a run whose latest checkpoint says finished (state.json's state.finished, written after
the final eval and HF export) is never trained again; a killed run is started again with the same
command and the trainer resumes it from its last checkpoint. A run that fails is reported as failed
(its log: OUT/<variant>/seed<k>/bench.log) and the others go on.

After training, the exported model (run_dir/hf) is evaluated by vapo-eval on the short- and
long-chain held-out files (eval_short.jsonl, eval_long.jsonl; chain task only): greedy accuracy
and avg@K (K = eval.n_samples, at the training temperature). Each finished run gets
OUT/<variant>/seed<k>/summary.json (also copied to --summaries, small files to commit); the table
(mean, std and min-max over seeds) is printed and written to OUT/table.md, and --figure draws the
held-out eval/accuracy against the RL step (mean and min-max band per variant).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench_learning_report import figure, table  # noqa: E402  (scripts/, beside this file)

from vapo_megatron.config.checks import CRITIC_ONLY as CRITIC_ONLY_SETTINGS  # noqa: E402

# The value-free rows drop every critic-only key of the base config (algo.estimator=grpo refuses them).
CRITIC_ONLY = list(CRITIC_ONLY_SETTINGS)
VARIANTS: dict[str, dict] = {
    "vapo": {"set": []},
    "no_value_pretrain": {"set": ["algo.value_pretrain_steps=0"]},
    "no_decoupled_gae": {"set": ["algo.decoupled_gae=false"]},
    "no_length_adaptive": {"set": ["algo.length_adaptive=false", "algo.lambda_policy=0.95"]},
    "no_clip_higher": {"set": ["algo.eps_high=EPS_LOW"]},
    "no_token_loss": {"set": ["algo.loss_agg=sample"]},
    "no_nll": {"set": ["algo.nll_coef=0"]},
    "no_group_sampling": {"set": ["rollout.n_samples=1", "rollout.prompts_per_step=PROMPTS_X_GROUP"]},
    "vanilla_ppo": {"set": ["algo.value_pretrain_steps=0", "algo.decoupled_gae=false", "algo.length_adaptive=false",
                            "algo.lambda_policy=0.95", "algo.eps_high=EPS_LOW", "algo.loss_agg=sample",
                            "algo.nll_coef=0", "rollout.n_samples=1", "rollout.prompts_per_step=PROMPTS_X_GROUP"]},
    "grpo": {"set": ["algo.estimator=grpo", "algo.value_pretrain_steps=0"], "unset": CRITIC_ONLY},
    "dapo": {"set": ["algo.estimator=grpo", "algo.value_pretrain_steps=0", "rollout.dynamic_sampling=true",
                     "reward.overlong_buffer=OVERLONG"], "unset": CRITIC_ONLY},
}
# Partial rollout's learning parity (issue 47; docs/benchmarks.md): each of these rows with
# rollout.partial on, rounds of a third of the longest answer so that responses do carry over.
for _row in ("vapo", "dapo"):
    VARIANTS[f"{_row}_partial"] = {"set": VARIANTS[_row]["set"] + ["rollout.partial.enabled=true",
                                                                   "rollout.partial.round_tokens=ROUND"],
                                   "unset": VARIANTS[_row].get("unset", [])}
BUCKETS = ("short", "long")


def base_settings(config: Path, overrides: list[str]) -> dict:
    """The base config's resolved settings, --set overrides applied (schema defaults filled in)."""
    from vapo_megatron.config.load import parse_config, to_dict

    cfg, problems = parse_config(str(config), overrides)
    if problems:
        sys.exit(f"{config}: " + "; ".join(problems))
    return to_dict(cfg)


def resolve(variant: str, base: dict) -> tuple[list[str], list[str]]:
    """(overrides, unset keys) of a variant, its placeholders filled from the base settings."""
    r, a = base["rollout"], base["algo"]
    fill = {"EPS_LOW": str(a["eps_low"]), "PROMPTS_X_GROUP": str(r["prompts_per_step"] * r["n_samples"]),
            "OVERLONG": str(max(1, r["max_new_tokens"] // 8)), "ROUND": str(max(1, r["max_new_tokens"] // 3))}
    out = []
    for item in VARIANTS[variant]["set"]:
        key, value = item.split("=", 1)
        out.append(f"{key}={fill.get(value, value)}")
    return out, list(VARIANTS[variant].get("unset", []))


def derived_yaml(config: Path, unset: list[str]) -> str:
    """The base config's YAML text without the unset keys (a dropped key takes its default)."""
    import yaml

    data = yaml.safe_load(config.read_text()) or {}
    for key in unset:
        *parents, last = key.split(".")
        node = data
        for p in parents:
            node = node.get(p) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(last, None)
    return f"# {config} with {', '.join(unset) or 'nothing'} removed (scripts/bench_learning.py)\n" + yaml.safe_dump(data, sort_keys=False)


def free_port() -> int:
    with socket.socket() as s:
        return s.bind(("127.0.0.1", 0)) or s.getsockname()[1]


class Bench:
    def __init__(self, a: argparse.Namespace):
        self.a = a
        self.out = Path(a.out)
        self.config = Path(a.config)
        self.base = base_settings(self.config, a.set)
        self.py = sys.executable
        self.warm = self.base["sft"]["steps"] > 0
        self.env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}

    def warm_dir(self, seed: int) -> Path:
        return self.out / "warm" / f"seed{self.data_seed(seed)}"

    def data_seed(self, seed: int) -> int:
        return seed if self.a.data_seed is None else self.a.data_seed

    def data_dir(self, seed: int) -> Path:
        return self.out / "data" / f"seed{self.data_seed(seed)}"

    def run_dir(self, variant: str, seed: int) -> Path:
        return self.out / variant / f"seed{seed}"

    def data_cmd(self, seed: int) -> list[str]:
        return [self.py, str(ROOT / "scripts" / "make_demo_data.py"), "--task", self.a.task, "--seed", str(self.data_seed(seed)),
                "--out", str(self.data_dir(seed)), *shlex.split(self.a.data_args)]

    def train_cmd(self, variant: str | None, seed: int) -> list[str]:
        """variant None: the seed's warm start (the base config's SFT, no RL step, the HF export)."""
        d = self.data_dir(seed)
        if variant is None:
            run, config, model = self.warm_dir(seed), self.config, f"{d}/model"
            sets = ["trainer.total_steps=0", "algo.value_pretrain_steps=0"]
            seed = self.data_seed(seed)
        else:
            run, config = self.run_dir(variant, seed), self.run_dir(variant, seed) / "bench.yaml"
            model = f"{self.warm_dir(seed)}/hf" if self.warm else f"{d}/model"
            sets = (["sft.steps=0"] if self.warm else []) + resolve(variant, self.base)[0]
            sets = [f"trainer.total_steps={self.a.steps}"] * (self.a.steps is not None) + sets
        return [self.py, "-m", "torch.distributed.run", "--nproc-per-node", str(self.a.nproc), "--master-addr",
                "127.0.0.1", "--master-port", "PORT", "-m", "vapo_megatron.train", "--config", str(config),
                f"trainer.run_dir={run}", f"model.hf_path={model}", f"data.train_files=[{d}/train.jsonl]",
                f"data.eval_files=[{d}/eval.jsonl]", f"sft.files=[{d}/sft.jsonl]", f"trainer.seed={seed}",
                f"data.seed={seed}", *self.a.set, *sets]

    def do_warm(self, seed: int) -> dict:
        """The seed's warm start, once for every variant: they all start RL from its run_dir/hf."""
        run = self.warm_dir(seed)
        run.mkdir(parents=True, exist_ok=True)
        times = self.times(run)
        if not self.finished(run):
            times = self.train(None, seed, run, times)
        if self.finished(run):
            self.bucket_evals(run, seed)  # the starting point's short/long figures (the table's first row)
        return times | {"finished": self.finished(run)}

    def bucket_evals(self, run: Path, seed: int) -> dict | str:
        """vapo-eval of run/hf on the short and long held-out chains: {bucket: summary}, or what failed."""
        out = {}
        for b in BUCKETS if self.a.task == "chain" else ():
            if not (run / f"eval_{b}" / "summary.json").exists():
                rc, _, _ = self.sh(self.eval_cmd(run, seed, b), run / "bench.log")
                if rc != 0:
                    return f"vapo-eval on eval_{b}.jsonl failed (bench.log)"
            out[b] = json.loads((run / f"eval_{b}" / "summary.json").read_text())
        return out

    def train(self, variant: str | None, seed: int, run: Path, times: dict) -> dict:
        """One attempt at the run (a resume if it was killed); its times are added to `times`."""
        cmd = [str(free_port()) if w == "PORT" else w for w in self.train_cmd(variant, seed)]
        rc, wall, cpu = self.sh(cmd, run / "bench.log")
        times = {"wall_s": times["wall_s"] + wall, "cpu_s": times["cpu_s"] + cpu, "attempts": times["attempts"] + 1}
        (run / "bench_time.json").write_text(json.dumps(times))
        return times | {"returncode": rc}

    @staticmethod  # what the run's attempts have cost so far
    def times(run: Path) -> dict:
        p = run / "bench_time.json"
        return json.loads(p.read_text()) if p.exists() else {"wall_s": 0.0, "cpu_s": 0.0, "attempts": 0}

    def settings(self, run: Path) -> dict:
        """The run's own resolved settings (run_dir/config.yaml, the trainer's), else the base's."""
        import yaml

        return yaml.safe_load((run / "config.yaml").read_text()) if (run / "config.yaml").exists() else self.base

    def eval_cmd(self, run: Path, seed: int, bucket: str) -> list[str]:
        cfg = self.settings(run)
        r, e, rw = cfg["rollout"], cfg["eval"], cfg["reward"]
        temp = r["temperature"] if e["temperature"] is None else e["temperature"]
        return [self.py, "-m", "vapo_megatron.eval", "--model", str(run / "hf"), "--data",
                str(self.data_dir(seed) / f"eval_{bucket}.jsonl"), "--out", str(run / f"eval_{bucket}"),
                "--n-samples", str(self.a.eval_k or e["n_samples"]), "--temperature", str(temp), "--greedy",
                "--max-new-tokens", str(r["max_new_tokens"]), "--reward", rw["fn"], "--correct-score",
                str(rw["correct_score"]), "--incorrect-score", str(rw["incorrect_score"]), "--seed", str(seed)]

    @staticmethod
    def finished(run: Path) -> bool:
        try:
            latest = (run / "checkpoints" / "latest").read_text().strip()
            return bool(json.loads((run / "checkpoints" / latest / "state.json").read_text())["state"]["finished"])
        except (OSError, ValueError, KeyError, TypeError):
            return False

    def sh(self, cmd: list[str], log: Path) -> tuple[int, float, float]:
        """(exit code, wall s, CPU s of the command and its children), output appended to `log`."""
        start = time.time()
        with open(log, "a") as f:
            f.write(f"\n$ {shlex.join(cmd)}\n")
            f.flush()
            p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env=self.env)
            _, status, usage = os.wait4(p.pid, 0)
            p.returncode = os.waitstatus_to_exitcode(status)
        return p.returncode, time.time() - start, usage.ru_utime + usage.ru_stime

    def do_run(self, variant: str, seed: int) -> dict:
        run = self.run_dir(variant, seed)
        if (run / "summary.json").exists() and self.finished(run):
            return json.loads((run / "summary.json").read_text())
        run.mkdir(parents=True, exist_ok=True)
        _, unset = resolve(variant, self.base)
        (run / "bench.yaml").write_text(derived_yaml(self.config, unset))
        times = self.times(run)
        if self.warm and not self.finished(self.warm_dir(seed)):
            return {"variant": variant, "seed": seed, "status": "failed", "returncode": None,
                    "log_tail": [f"the warm start failed: {self.warm_dir(seed) / 'bench.log'}"]}
        if not self.finished(run):
            times = self.train(variant, seed, run, times)
            rc = times.pop("returncode")
            if rc != 0 or not self.finished(run):
                tail = (run / "bench.log").read_text(errors="replace").strip().splitlines()[-3:]
                return {"variant": variant, "seed": seed, "status": "failed", "returncode": rc, "log_tail": tail,
                        "needs": VARIANTS[variant].get("needs")}
        buckets = self.bucket_evals(run, seed)
        if isinstance(buckets, str):
            return {"variant": variant, "seed": seed, "status": "failed", "log_tail": [buckets]}
        summary = self.summarize(variant, seed, run, times, buckets)
        (run / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
        if self.a.summaries:
            dest = Path(self.a.summaries) / f"{variant}_seed{seed}.json"
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_text(json.dumps(summary, indent=1) + "\n")
        return summary

    def warm_summary(self, seed: int) -> dict:
        run = self.warm_dir(seed)
        records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
        sft = [r for r in records if r.get("phase") == "sft"]
        final = next((r for r in reversed(records) if "eval/accuracy_final" in r), {})
        t = self.times(run)
        buckets = {b: json.loads((run / f"eval_{b}" / "summary.json").read_text()) for b in BUCKETS
                   if (run / f"eval_{b}" / "summary.json").exists()}
        return self.bucket_figures(buckets) | {"sft_steps": sft[-1]["sft_step"] if sft else 0, "train_accuracy": next(
                    (r["sft/train_accuracy"] for r in reversed(sft) if "sft/train_accuracy" in r), None),
                "eval_accuracy": final.get("eval/accuracy"),
                "eval_avg@K": final.get(f"eval/avg@{self.settings(run)['eval']['n_samples']}"),
                "wall_s": round(t["wall_s"], 1), "cpu_s": round(t["cpu_s"], 1)}

    def summarize(self, variant: str, seed: int, run: Path, times: dict, buckets: dict) -> dict:
        cfg = self.settings(run)
        records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
        curve = [[r["step"], r["eval/accuracy"]] for r in records if "eval/accuracy" in r]
        final = next((r for r in reversed(records) if "eval/accuracy_final" in r), {})
        k = cfg["eval"]["n_samples"]
        out = {
            "variant": variant, "seed": seed, "status": "finished", "overrides": resolve(variant, self.base)[0],
            "unset": resolve(variant, self.base)[1], "steps": cfg["trainer"]["total_steps"],
            "samples": cfg["trainer"]["total_steps"] * cfg["rollout"]["prompts_per_step"] * cfg["rollout"]["n_samples"],
            "wall_s": round(times["wall_s"], 1), "cpu_s": round(times["cpu_s"], 1), "attempts": times["attempts"],
            "warm_start": self.warm_summary(seed) if self.warm else None,
            "eval_k": k, "accuracy": final.get("eval/accuracy"), "avg@K": final.get(f"eval/avg@{k}"),
            "curve": curve,
        }
        return out | self.bucket_figures(buckets)

    @staticmethod
    def bucket_figures(buckets: dict) -> dict:
        out = {}
        for b, s in buckets.items():
            out |= {f"{b}_prompts": s["prompts"], f"{b}_accuracy": s.get("greedy_accuracy"),
                    f"{b}_avg@K": s[f"avg@{s['samples_per_prompt']}"], f"{b}_mean_length": s.get("response_length/mean")}
        return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(ROOT / "configs" / "chain_cpu.yaml"), help="the base config")
    ap.add_argument("--variants", default="vapo", help=f"comma-separated, of: {','.join(VARIANTS)}")
    ap.add_argument("--seeds", default="0", help="comma-separated seeds")
    ap.add_argument("--steps", type=int, default=None, help="trainer.total_steps (default: the config's)")
    ap.add_argument("--jobs", type=int, default=1, help="runs at a time (each is --nproc processes)")
    ap.add_argument("--nproc", type=int, default=2, help="torchrun processes per run")
    ap.add_argument("--out", default=str(ROOT / "runs" / "bench"), help="runs, data and table")
    ap.add_argument("--data-seed", type=int, default=None,
                    help="one data set, model init and warm start for every seed (default: each seed its own)")
    ap.add_argument("--task", default="chain", help="make_demo_data.py --task (chain: short/long evals)")
    ap.add_argument("--data-args", default="", help="more make_demo_data.py arguments, one string")
    ap.add_argument("--set", action="append", default=[], help="an override for every variant (repeatable)")
    ap.add_argument("--eval-k", type=int, default=None, help="vapo-eval's K (default: the config's eval.n_samples)")
    ap.add_argument("--summaries", default=None, help="also copy each run's summary.json here")
    ap.add_argument("--figure", default=None, help="PNG of held-out accuracy vs step (default OUT/learning.png)")
    ap.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    ap.add_argument("--report", action="store_true", help="only tabulate runs that have a summary")
    a = ap.parse_args(argv)
    variants = [v for v in a.variants.split(",") if v]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        ap.error(f"unknown variant(s) {unknown}; known: {', '.join(VARIANTS)}")
    seeds = [int(s) for s in a.seeds.split(",") if s]
    bench = Bench(a)
    if a.dry_run:
        for s in seeds:
            print(shlex.join(bench.data_cmd(s)))
            if bench.warm:
                print(f"# the warm start of seed {s}, shared by its variants (RL starts from its hf/)")
                print(shlex.join(bench.train_cmd(None, s)))
            for v in variants:
                _, unset = resolve(v, bench.base)
                print(f"# {v}, seed {s}: {bench.run_dir(v, s) / 'bench.yaml'} = {a.config}" + (f" without {', '.join(unset)}" if unset else ""))
                print(shlex.join(bench.train_cmd(v, s)))
                if a.task == "chain":
                    for b in BUCKETS:
                        print(shlex.join(bench.eval_cmd(bench.run_dir(v, s), s, b)))
        return 0
    pairs = [(v, s) for s in seeds for v in variants]
    if a.report:
        summaries = [json.loads((bench.run_dir(v, s) / "summary.json").read_text()) for v, s in pairs
                     if (bench.run_dir(v, s) / "summary.json").exists()]
    else:
        for s in dict.fromkeys(map(bench.data_seed, seeds)):
            meta = bench.out / "data" / f"seed{s}" / "meta.json"
            if not (meta.exists() and json.loads(meta.read_text()).get("seed") == s):
                subprocess.run(bench.data_cmd(s), check=True, cwd=ROOT, env=bench.env, stdout=subprocess.DEVNULL)
        with concurrent.futures.ThreadPoolExecutor(max_workers=a.jobs) as pool:
            if bench.warm:
                warm_seeds = list(dict.fromkeys(map(bench.data_seed, seeds)))
                for s, w in zip(warm_seeds, pool.map(bench.do_warm, warm_seeds)):
                    print(f"[bench] warm start, seed {s}: " + ("done" if w["finished"] else "FAILED")
                          + f", wall {w['wall_s']:.0f} s", flush=True)
            futures = {pool.submit(bench.do_run, v, s): (v, s) for v, s in pairs}
            for f in concurrent.futures.as_completed(futures):
                s = f.result()
                print(f"[bench] {s['variant']} seed {s['seed']}: {s['status']}"
                      + (f", accuracy {s['accuracy']}, wall {s['wall_s']} s" if s["status"] == "finished" else f" ({s.get('log_tail')})"),
                      flush=True)
        summaries = [_read(bench, v, s) for v, s in pairs]
    summaries = [s for s in summaries if s]
    warm = {}  # the starting point of every row: the warm start's own figures, once per data seed
    for s in summaries:
        if s.get("warm_start") and s["status"] == "finished":
            w = bench.warm_summary(s["seed"])
            warm[bench.data_seed(s["seed"])] = {"variant": "warm start (before RL)", "seed": bench.data_seed(s["seed"]),
                                                "status": "finished", "samples": 0, "accuracy": w["eval_accuracy"],
                                                "avg@K": w["eval_avg@K"],
                                                **{k: v for k, v in w.items() if k.startswith(BUCKETS)}, "wall_s": w["wall_s"]}
    text = table(list(warm.values()) + summaries)
    print(text, end="")
    bench.out.mkdir(parents=True, exist_ok=True)
    (bench.out / "table.md").write_text(text)
    if any(s["status"] == "finished" for s in summaries):
        figure(summaries, Path(a.figure) if a.figure else bench.out / "learning.png")
    return 0


def _read(bench: Bench, v: str, s: int) -> dict:
    p = bench.run_dir(v, s) / "summary.json"
    if p.exists():
        return json.loads(p.read_text())
    return {"variant": v, "seed": s, "status": "failed", "needs": VARIANTS[v].get("needs")}


if __name__ == "__main__":
    sys.exit(main())
