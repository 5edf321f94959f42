"""The learning benchmark's harness (benchmarks/learning; issue 45), in this process: bad flags and settings are one
line and exit 2 before any work; a run, warm start or summary made with other settings is
refused, a matching committed summary is reused; the study's order and commands; the figures a
summary is made of, against hand-computed values; and a kill -9 of the harness takes its
children with it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import benchmarks.learning.cli as bench
from benchmarks.learning.report import decisions, paired, study_report, t_interval
from benchmarks.learning.runs import curve_figures, eval_figures
from benchmarks.learning.variants import STUDIES

ROOT = Path(__file__).resolve().parents[2]


def call(argv: list[str], capsys) -> tuple[int, str, str]:
    try:
        rc = bench.main(argv)
    except SystemExit as e:
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture
def no_work(monkeypatch):
    """Any process started (data, training, evaluation) fails the test. matplotlib's font cache is
    built first: on a machine where it has never run, the report's figure would ask fc-list for the
    fonts (a process, but no work of the harness's), and the test would fail there alone."""
    import matplotlib.font_manager  # noqa: F401  (builds ~/.cache/matplotlib once)

    def boom(*a, **k):
        raise AssertionError(f"work started: {a[0] if a else k}")
    monkeypatch.setattr(subprocess, "Popen", boom)


@pytest.mark.parametrize("argv, names", [
    (["--jobs", "0"], "--jobs"), (["--seeds", "a"], "--seeds"), (["--nproc", "0"], "--nproc"),
    (["--eval-k", "0"], "--eval-k"), (["--steps", "-1"], "trainer.total_steps=-1"),
    (["--set", "algo.lambda_critic=1.5"], "algo.lambda_critic=1.5"), (["--nproc", "3"], "world size 3"),
    (["--variants", "vapo,nope"], "nope"), (["--study", "critic", "--variants", "no_nll"], "no_nll"),
])
def test_bad_flags_and_settings_are_one_line_and_exit_2(argv, names, capsys, no_work, tmp_path):
    rc, out, err = call(["--dry-run", "--out", str(tmp_path / "out"), *argv], capsys)
    assert rc == 2 and err.count("\n") == 1 and names in err and not out, (rc, out, err)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("out, names", [(None, "give --out"), (str(ROOT / "runs" / "study"), "inside the repository")])
def test_a_study_writes_its_runs_outside_the_repository(out, names, capsys, no_work):
    rc, _, err = call(["--study", "critic", *(["--out", out] if out else [])], capsys)
    assert rc == 2 and err.count("\n") == 1 and names in err, err


def test_report_on_a_missing_directory_is_refused(capsys, tmp_path):
    rc, out, err = call(["--report", "--out", str(tmp_path / "nope")], capsys)
    assert rc == 2 and err.count("\n") == 1 and f"--out {tmp_path / 'nope'}: no such directory" in err, err


def test_the_study_runs_its_primary_arms_over_every_seed_first(capsys, tmp_path, no_work):
    rc, out, err = call(["--study", "critic", "--dry-run", "--out", str(tmp_path)], capsys)
    assert rc == 0, err
    study = STUDIES["critic"]
    runs = [line[2:].split(":")[0] for line in out.splitlines() if line.startswith("# ") and ", seed " in line
            and "warm start" not in line and "data of" not in line and "vapo-eval" not in line]
    assert runs == [f"{v}, seed {s}" for block in ("primary", "mechanism") for s in study["seeds"]
                    for v in study[block]]
    lines = out.splitlines()
    evals = [w for w in lines if "-m vapo_megatron.eval" in w]
    assert len(evals) == 9 * 5 + 5 and all("--n-samples 8 " in w and "/eval.jsonl " in w for w in evals)
    assert sum("-m benchmarks.learning.credit" in w for w in lines) == 6 * 5  # vapo and the five mechanism arms
    k = next(i for i, w in enumerate(lines) if w.startswith("# vapo_critic_4x, seed 103:"))
    assert f"model.critic_hf_path={tmp_path}/warm/seed103_critic4x/hf" in lines[k + 1]
    warm = lines[lines.index("# warm start of seed 103, the 4x critic's model") + 1]
    assert (f"model.hf_path={tmp_path}/data/seed103_critic4x/model" in warm
            and f"{tmp_path}/data/seed103/sft.jsonl" in warm)
    data = lines[lines.index("# data of seed 103, the 4x critic's model") + 1]
    assert data.endswith("--seed 103 --out " + f"{tmp_path}/data/seed103_critic4x --hidden-size 128 --ffn-size 512")


def made_with(tmp_path, *argv: str) -> bench.Bench:
    a, _, _ = bench.parse(["--out", str(tmp_path / "out"), "--summaries", str(tmp_path / "sums"), *argv])
    return bench.Bench(a)


def test_runs_made_with_other_settings_are_refused_before_any_work(capsys, tmp_path, no_work):
    run = tmp_path / "out" / "vapo" / "seed0"
    (run / "checkpoints").mkdir(parents=True)
    (run / "bench_record.json").write_text(json.dumps(made_with(tmp_path, "--steps", "10").record("vapo", 0)))
    argv = ["--variants", "vapo", "--seeds", "0", "--out", str(tmp_path / "out"), "--summaries", str(tmp_path / "sums")]
    rc, _, err = call([*argv, "--steps", "50"], capsys)
    assert rc == 2 and err.count("\n") == 1 and "was made with steps=10, this command asks for 50" in err, err
    assert not (tmp_path / "out" / "data").exists()
    (run / "bench_record.json").unlink()  # an older harness's run: no record
    rc, _, err = call([*argv, "--steps", "50"], capsys)
    assert rc == 2 and "has no record of its settings" in err, err
    (run / "bench_record.json").write_text(json.dumps(made_with(tmp_path, "--steps", "50").record("vapo", 0)))
    warm = tmp_path / "out" / "warm" / "seed0"  # its warm start made with another SFT
    (warm / "checkpoints").mkdir(parents=True)
    (warm / "bench_record.json").write_text(json.dumps(made_with(tmp_path, "--set", "sft.lr=0.01").warm_record(0)))
    rc, _, err = call([*argv, "--steps", "50"], capsys)
    assert rc == 2 and str(warm) in err and "'sft.lr=0.01'" in err, err


def summary(b: bench.Bench, variant: str, seed: int, value: float) -> dict:
    return {"variant": variant, "seed": seed, "status": "finished", "record": b.record(variant, seed), "samples": 6400,
            "curve": [[0, 0.2], [50, value]], "heldout_avg@K": value, "value_pretrain_steps": 0}


def test_a_committed_summary_is_reused_only_when_its_record_matches(capsys, tmp_path, no_work):
    argv = ["--variants", "vapo", "--seeds", "0", "--out", str(tmp_path / "out"), "--summaries", str(tmp_path / "sums")]
    (tmp_path / "sums").mkdir()
    copy = tmp_path / "sums" / "vapo_seed0.json"
    copy.write_text(json.dumps(summary(made_with(tmp_path), "vapo", 0, 0.375)))
    rc, out, err = call(argv, capsys)  # nothing to train: the committed summary is this command's run
    assert rc == 0 and "| vapo | 0 | 6400 | 0.375 |" in out, out + err
    rc, _, err = call([*argv, "--set", "rollout.temperature=0.7"], capsys)
    assert rc == 2 and str(copy) in err and "rollout.temperature=0.7" in err, err
    rc, _, err = call([*argv, "--report", "--set", "rollout.temperature=0.7"], capsys)  # nor tabled
    assert rc == 2 and str(copy) in err, err
    copy.write_text(json.dumps(summary(made_with(tmp_path), "vapo", 0, 0.375) | {"record": None}))
    rc, _, err = call(argv, capsys)
    assert rc == 2 and "has no record" in err, err


def test_t_intervals_and_the_paired_table_against_hand_computed_values(tmp_path, capsys):
    m, lo, hi = t_interval([0.1, 0.2, 0.3])  # sd 0.1, t(0.975, 2) = 4.303: 0.2 ± 0.4303 / sqrt(3) = 0.24843
    assert (round(m, 5), round(lo, 5), round(hi, 5)) == (0.2, -0.04843, 0.44843)
    assert t_interval([0.5]) is None
    b = made_with(tmp_path, "--study", "critic")
    gains = [0.02, 0.05, 0.03, 0.04, 0.06]  # mean 0.04, sd 0.0158114, t(0.975, 4) = 2.776: ± 0.01963
    rows = [summary(b, "vapo", s, 0.5 + g) for s, g in zip(STUDIES["critic"]["seeds"], gains)]
    rows += [summary(b, "vapo_no_critic", s, 0.5) for s in STUDIES["critic"]["seeds"]]
    rows[3] = rows[3] | {"status": "failed"}  # vapo seed 104 failed: its pair is left out
    assert (paired(rows, "vapo", "vapo_no_critic", "heldout_avg@K")
            == pytest.approx({101: 0.02, 102: 0.05, 103: 0.03, 105: 0.06}))
    rows[3] = summary(b, "vapo", 104, 0.54)
    text = study_report(rows, STUDIES["critic"], ["vapo", "vapo_no_critic"])
    assert ("| vapo - vapo_no_critic | 5 | +0.040 | [+0.020, +0.060] | above 0 | 101: +0.020, 102: +0.050, "
            "103: +0.030, 104: +0.040, 105: +0.060 |") in text, text
    sums = tmp_path / "sums"  # --report builds it from the committed summaries alone
    sums.mkdir()
    for r in rows:
        (sums / f"{r['variant']}_seed{r['seed']}.json").write_text(json.dumps(r))
    rc, out, err = call(["--study", "critic", "--report", "--out", str(tmp_path / "out"), "--summaries", str(sums)],
                        capsys)
    assert rc == 0 and "| vapo - vapo_no_critic | 5 | +0.040 | [+0.020, +0.060] | above 0 |" in out, out + err
    assert "| dapo |  | - | not run |" in out and (sums / "report.md").read_text() == out, out
    assert (sums / "curves.png").stat().st_size > 0


def test_the_critic_studys_decision_rules_are_applied_as_written():
    """Rules 1-5 of docs/benchmarks.md on hand-built per-seed values, every branch named: the gap
    resolves (+0.040 [+0.020, +0.060]); whitening takes VAPO to the no-critic level (explains),
    lambda 1 takes part of the gap (partly), vp0 is noise, vp50 adds +0.02 but not on long chains."""
    seeds, free = STUDIES["critic"]["seeds"], 0.5
    g = [0.02, 0.05, 0.03, 0.04, 0.06]
    noise = [0.01, -0.01, 0.0, 0.01, -0.01]  # mean 0: unresolved against anything it is added to
    arms = {"vapo_no_critic": [free] * 5, "vapo": [free + x for x in g],
            "vapo_whiten": [free + n for n in noise],
            "vapo_lambda1": [free + x - d for x, d in zip(g, (0.01, 0.012, 0.011, 0.009, 0.01))],
            "vapo_vp0": [free + x + n for x, n in zip(g, noise)],
            "vapo_vp50": [free + x + 0.02 + n / 10 for x, n in zip(g, noise)]}
    rows = [{"variant": v, "seed": s, "status": "finished", "heldout_avg@K": x,
             "long_avg@K": (arms["vapo"][i] - 0.01 if v == "vapo_vp50" else x)}  # vp50: long chains move the other way
            for v, xs in arms.items() for i, (s, x) in enumerate(zip(seeds, xs))]
    text = decisions(rows, STUDIES["critic"])
    assert "1. `vapo - vapo_no_critic` = +0.040 [+0.020, +0.060]: the critic helps." in text, text
    assert ("`vapo_whiten` explains the gap (`vapo_whiten - vapo` below 0, "
            "`vapo_whiten - vapo_no_critic` unresolved)" in text)
    assert ("`vapo_lambda1` partly explains the gap (`vapo_lambda1 - vapo` below 0, "
            "`vapo_lambda1 - vapo_no_critic` above 0)" in text)
    assert "`vapo_vp0` does not explain the gap (`vapo_vp0 - vapo` unresolved" in text
    assert "`vapo_vp50` does not explain the gap (`vapo_vp50 - vapo` above 0" in text
    # not run: not read
    assert "3. Critic capacity: no paired runs." in text and "`vapo_critic_4x` does not explain" not in text
    assert "4. Value-pretraining length matters: `vapo_vp50 - vapo` above 0." in text
    assert "`vapo_whiten - vapo` below 0: long-chain avg@K -0.040 [" in text and "moves the same way: a finding" in text
    assert ("`vapo_vp50 - vapo` above 0: long-chain avg@K -0.010 [-0.010, -0.010] does not move the same way: "
            "reported, not a finding" in text)
    # Rule 1 unresolved: nothing explains; the mechanism arms are read against vapo alone.
    rows = [r | {"heldout_avg@K": free + n} if r["variant"] == "vapo" else r for r, n in zip(rows, noise * 6)]
    text = decisions(rows, STUDIES["critic"])
    # noise: sd 0.01, t(0.975, 4) = 2.776: ± 0.0124
    assert ("the critic is unresolved at this scale "
            "(the interval rules out effects outside [-0.012, +0.012])." in text), text
    assert "2. Rule 1 does not resolve: no arm explains anything" in text and "explains the gap" not in text
    assert "4. Value-pretraining length matters: `vapo_vp0 - vapo` above 0, `vapo_vp50 - vapo` above 0." in text
    assert "- vapo_no_critic` above 0:" not in text  # rule 5 reads M - vapo alone


def test_the_partial_study_reads_each_row_with_minus_without_on_the_critic_studys_warm_starts(tmp_path):
    study = STUDIES["partial"]
    assert set(study["seeds"]) <= set(STUDIES["critic"]["seeds"])  # vapo and dapo runs are shared
    b = made_with(tmp_path, "--study", "partial")
    rows = [summary(b, v, s, x) for v, xs in (("vapo", (0.5, 0.6, 0.7)), ("vapo_partial", (0.52, 0.57, 0.71)),
                                               ("dapo", (0.6, 0.6, 0.6)), ("dapo_partial", (0.5, 0.6, 0.6)))
            for s, x in zip(study["seeds"], xs)]
    for r, n in zip(rows[-3:], (6300, 6400, 6500)):  # dapo_partial: dynamic sampling left steps short or long
        r["samples"] = n
    text = study_report(rows, study, study["primary"])
    assert ("| vapo | 101,102,103 | 6400 |" in text
            and "| dapo_partial | 101,102,103 | 6400 ± 100 [6300, 6500] |" in text), text
    # vapo_partial - vapo: +0.02, -0.03, +0.01; mean 0, sd 0.0264575, t(0.975, 2) = 4.303: ± 0.06573
    assert ("| vapo_partial - vapo | 3 | +0.000 | [-0.066, +0.066] | unresolved | "
            "101: +0.020, 102: -0.030, 103: +0.010 |" in text)
    assert "| dapo_partial - dapo | 3 |" in text and "| vapo - " not in text, text


def test_eval_and_curve_figures_against_hand_computed_values(tmp_path):
    prompts = ["a1+b2=", "a3+b4=", "a1+b1+c1+d1+e1=", "a1+b1+c1+d1+e1+f1+g1="]
    write = lambda name, ps: (tmp_path / name).write_text(  # noqa: E731
        "".join(json.dumps({"prompt": p, "answer": "x"}) + "\n" for p in ps))
    write("eval.jsonl", prompts)
    write("eval_short.jsonl", prompts[:2])
    write("eval_long.jsonl", prompts[3:])
    ev = tmp_path / "ev"
    ev.mkdir()
    (ev / "summary.json").write_text(json.dumps({"samples_per_prompt": 2, "prompts": 4, "avg@2": 0.5,
                                                 "greedy_accuracy": 0.25}))
    (ev / "per_prompt.csv").write_text("prompt_index,source,samples,correct\n" + "".join(
        f"{i},/x/eval.jsonl:{i + 1},2,{c}\n" for i, c in enumerate([2, 1, 0, 1])))
    got = eval_figures(ev, tmp_path)
    assert (got["heldout_avg@K"], got["heldout_accuracy"], got["short_prompts"], got["short_avg@K"],
            got["long_prompts"], got["long_avg@K"]) == (0.5, 0.25, 2, 0.75, 1, 0.5)
    records = ([{"step": 0, "phase": "eval", "eval/accuracy": 0.2}]
               + [{"step": i, "phase": "value_pretrain"} for i in range(1, 11)]
               + [{"step": i, "phase": "vapo"} | ({"rollout/prompts_consumed": 32} if i in (12, 13) else {})
                  for i in range(11, 31)]
               + [{"step": 20, "phase": "eval", "eval/accuracy": 0.4},
                  {"step": 30, "phase": "eval", "eval/accuracy": 0.5}])
    got = curve_figures(records, value_pretrain=10, steps=20, prompts=16, n_samples=8)
    # RL steps 0/10/20 at 0.2/0.4/0.5: (10 x 0.3 + 10 x 0.45) / 20; 30 steps x 16 x 8, two of them 32 prompts
    assert got["auc"] == pytest.approx(0.375) and got["samples_generated"] == 30 * 16 * 8 + 2 * 16 * 8
    assert got["samples"] == 20 * 16 * 8
    # Partial rollout: the groups admitted (and samples restarted) are generated, the groups trained trained;
    # the trainer's own rollout/samples_generated wins where logged.
    part = [{"step": 1, "phase": "vapo", "partial/groups_admitted": 32, "partial/samples_restarted": 3,
             "partial/groups_trained": 15},
            {"step": 2, "phase": "vapo", "partial/groups_admitted": 16, "partial/groups_trained": 16},
            {"step": 3, "phase": "vapo", "partial/groups_admitted": 0, "rollout/samples_generated": 5,
             "partial/groups_trained": 14}]
    got = curve_figures(part, value_pretrain=0, steps=3, prompts=16, n_samples=8)
    assert (got["samples_generated"], got["samples"]) == (32 * 8 + 3 + 16 * 8 + 5, (15 + 16 + 14) * 8)


def test_a_kill_9_of_the_harness_kills_its_children(tmp_path):
    pidfile = tmp_path / "child.pid"
    child = f"import os, time; open({str(pidfile)!r}, 'w').write(str(os.getpid())); time.sleep(120)"
    harness = (f"import os, sys; sys.path.insert(0, {str(ROOT)!r}); from pathlib import Path; "
               f"from benchmarks.learning.runs import spawn; spawn([sys.executable, '-c', {child!r}], "
               f"Path({str(tmp_path / 'log')!r}), "
               "dict(os.environ), Path('.'))")
    p = subprocess.Popen([sys.executable, "-c", harness])
    pid = None
    try:
        deadline = time.time() + 60
        while pid is None and time.time() < deadline and p.poll() is None:
            time.sleep(0.1)
            pid = int(pidfile.read_text()) if pidfile.exists() and pidfile.read_text() else None
        assert pid, "the harness did not start its child"
        p.kill()
        p.wait()
        deadline = time.time() + 10
        while alive(pid) and time.time() < deadline:
            time.sleep(0.1)
        assert not alive(pid), "the child outlived the harness"
    finally:
        if pid and alive(pid):
            os.kill(pid, signal.SIGKILL)


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_outputs_that_would_fail_at_the_end_are_refused_at_the_start(capsys, tmp_path, no_work):
    (tmp_path / "file").write_text("")
    rc, _, err = call(["--out", str(tmp_path / "out"), "--summaries", str(tmp_path / "file" / "sums")], capsys)
    assert rc == 2 and err.count("\n") == 1 and "--summaries" in err and "not a writable directory" in err, err


def test_unset_lists_compare_by_what_they_remove_from_the_base():
    """A run made when the critic-only keys were fewer is the same run when the added key is one the
    base config never set; a key the base does set still makes it another run."""
    from benchmarks.learning.runs import record_mismatch

    old = {"unset": ["algo.gamma", "critic_optim"], "steps": 3}
    grown = {"unset": ["algo.gamma", "critic", "critic_optim"], "steps": 3}
    in_base = {"algo.gamma", "critic_optim"}.__contains__
    assert record_mismatch("x", old, grown, flag="--out", in_base=in_base) is None
    assert "was made with unset=" in record_mismatch("x", old, grown, flag="--out")
    assert "was made with unset=" in record_mismatch("x", old, grown, flag="--out", in_base=lambda k: True)
