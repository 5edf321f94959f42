"""vapo-eval end to end on a model the demo trained (one short run of the real trainer): the HF
export and the trainer checkpoint give the same samples, the figures are those of the samples
file and of the trainer's own final eval, the same seed gives the same samples (also with the
prompts split over two ranks), and bad input stops with a one-line error. The trainer's run and
the evaluations whose subject is what they sample run vapo-eval's main on ranks forked from the
suite's preloaded forkserver (tests/helpers/train_runs.py command_in_forks); the checkpoint's
evaluation, whose whole output must hold no library line, is the real command."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.quiet_check import library_noise, users_env
from tests.helpers.train_runs import ROOT, command_in_forks, make_demo_data, records, train_in_forks
from vapo_megatron import eval as vapo_eval

SEED = 1234  # the trainer's seed: its eval samples with it, so vapo-eval can redraw the same samples
K = 4


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """SFT, then one VAPO step; writes checkpoints/iter_0000001/actor and the hf/ export."""
    data = make_demo_data(tmp_path_factory.mktemp("evaldemo") / "data", n_train=64, n_eval=8, n_sft=64)
    run_dir = data.parent / "run"
    train_in_forks("demo_cpu.yaml", *[
        f"trainer.run_dir={run_dir}", f"model.hf_path={data}/model", f"data.train_files=[{data}/train.jsonl]",
        f"data.eval_files=[{data}/eval.jsonl]", f"sft.files=[{data}/sft.jsonl]", "sft.steps=3", "sft.batch_size=16",
        "sft.target_accuracy=null", "algo.value_pretrain_steps=0", "rollout.prompts_per_step=4", "rollout.n_samples=2",
        "eval.max_prompts=8", f"eval.n_samples={K}", "parallel.tp=1", "trainer.total_steps=1",
        "trainer.tensorboard=false", f"trainer.seed={SEED}",
    ], nproc=1)
    return run_dir


def eval_args(model: Path, data: Path, out: Path, *extra: str) -> list[str]:
    return ["--model", str(model), "--data", str(data / "eval.jsonl"), "--n-samples", str(K), "--out", str(out),
            "--reward", "exact", "--max-new-tokens", "8", "--max-prompt-tokens", "32", "--seed", str(SEED), *extra]


def run_eval(args: list[str]) -> str:
    """vapo-eval's printed summary, from `python -m vapo_megatron.eval`, whose whole output holds no
    library line (loading a trainer checkpoint once printed torch's distributed-checkpoint warnings,
    issue 33; an HF model's loading bar is vapo-eval's by design)."""
    proc = subprocess.run([sys.executable, "-m", "vapo_megatron.eval", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, env={**users_env(), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert not library_noise(proc.stdout + proc.stderr), library_noise(proc.stdout + proc.stderr)
    return proc.stdout


def eval_in_forks(args: list[str], *, nproc: int = 1) -> str:
    """vapo-eval's printed summary, from its main on `nproc` forked ranks (as torchrun would start them)."""
    run = command_in_forks("vapo_megatron.eval", args, nproc=nproc)
    assert (run.returncode == 0
            and not run.failures), f"{run.codes} {run.failures}\n{run.stdout[-3000:]}{run.stderr[-3000:]}"
    return run.stdout


def samples(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]


def figures_from_samples(rows: list[dict]) -> dict[str, float]:
    """avg@K, pass@k (by enumerating k-subsets) and maj@K recomputed from samples.jsonl alone."""
    prompts = sorted({r["prompt_index"] for r in rows})
    groups = [[r for r in rows if r["prompt_index"] == p] for p in prompts]
    out = {f"avg@{K}": sum(r["correct"] for r in rows) / len(rows)}
    for k in (1, 2, 4):
        frac = []
        for g in groups:
            subsets = list(itertools.combinations(g, k))
            frac.append(sum(any(r["correct"] for r in s) for s in subsets) / len(subsets))
        out[f"pass@{k}"] = sum(frac) / len(frac)
    maj = 0
    for g in groups:  # exact reward: answers vote by string; ties go to the answer seen first
        counts: dict[str, int] = {}
        for r in g:
            if r["answer"]:
                counts[r["answer"]] = counts.get(r["answer"], 0) + 1
        if counts:
            best = max(counts.values())
            winner = next(r for r in g if r["answer"] and counts[r["answer"]] == best)
            maj += winner["correct"]
    out[f"maj@{K}"] = maj / len(groups)
    return out


@pytest.fixture(scope="module")
def hf_eval(trained, tmp_path_factory) -> tuple[Path, str]:
    """vapo-eval of the HF export on one process: its output directory and what it printed."""
    out = tmp_path_factory.mktemp("hf_eval") / "hf"
    return out, eval_in_forks(eval_args(trained / "hf", trained.parent / "data", out, "--greedy"))


def test_hf_export_and_checkpoint_agree_with_samples_and_training(trained, hf_eval, tmp_path):
    data = trained.parent / "data"
    hf, printed = hf_eval
    summary = json.loads((hf / "summary.json").read_text())
    rows = samples(hf)
    assert (len(rows) == 8 * K
            and {"prompt_index", "sample_index", "correct", "reward", "response", "answer", "length"} <= rows[0].keys())
    # The figures are those of the per-sample file, and printed as such.
    for key, value in figures_from_samples(rows).items():
        assert summary[key] == pytest.approx(value), key
        assert f"{key:<16} {summary[key]:.4f}" in printed
    assert summary["response_length/mean"] == pytest.approx(sum(r["length"] for r in rows) / len(rows))
    # The trainer's final eval drew the same samples (same seed, K, prompts and engine).
    final = [r for r in records(trained) if "eval/accuracy_final" in r][-1]
    for key in (f"avg@{K}", "pass@2", f"pass@{K}", f"maj@{K}"):
        assert summary[key] == pytest.approx(final[f"eval/{key}"]), key
    assert summary["greedy_accuracy"] == pytest.approx(final["eval/accuracy"])
    # The trainer checkpoint (loaded into Megatron, synced into the engine) gives the same samples.
    run_eval(eval_args(trained / "checkpoints" / "iter_0000001", data, tmp_path / "ckpt"))
    assert samples(tmp_path / "ckpt") == rows
    assert json.loads((tmp_path / "ckpt" / "summary.json").read_text())[f"avg@{K}"] == summary[f"avg@{K}"]
    table = (hf / "per_prompt.csv").read_text().splitlines()
    assert table[0].startswith("prompt_index,source,ground_truth") and len(table) == 1 + 8


def test_same_seed_same_samples_also_split_over_two_ranks(trained, hf_eval, tmp_path):
    """A prompt's samples depend on the seed and the prompt, not on how many prompts run or where:
    the first 5 prompts over two ranks are the one-process run's first 5."""
    data = trained.parent / "data"
    eval_in_forks(eval_args(trained / "hf", data, tmp_path / "two", "--max-prompts", "5"), nproc=2)
    one = [r for r in samples(hf_eval[0]) if r["prompt_index"] < 5]
    two = samples(tmp_path / "two")
    assert len(one) == 5 * K and one == two
    other = eval_args(trained / "hf", data, tmp_path / "other", "--max-prompts", "5")
    other[other.index("--seed") + 1] = str(SEED + 1)
    eval_in_forks(other)
    assert [r["response"] for r in samples(tmp_path / "other")] != [r["response"] for r in one]


def _bad(capsys, args: list[str]) -> str:
    code = vapo_eval.main(args)
    err = capsys.readouterr().err
    ours = [line for line in err.splitlines() if line.startswith("vapo-eval")]  # not the libraries' import warnings
    assert code == 2 and len(ours) == 1 and "Traceback" not in err, err
    return ours[0]


def test_bad_input_is_one_line_naming_it(trained, tmp_path, capsys):
    data = trained.parent / "data"
    out = tmp_path / "out"
    assert "--model /no/such/model: does not exist" in _bad(capsys, eval_args(Path("/no/such/model"), data, out))
    assert ("--pass-k 8: pass@k needs 1 <= k <= --n-samples (4)"
            in _bad(capsys, eval_args(trained / "hf", data, out, "--pass-k", "8")))
    zero = eval_args(trained / "hf", data, out)
    zero[zero.index("--n-samples") + 1] = "0"
    assert "--n-samples 0: must be >= 1" in _bad(capsys, zero)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "eval.jsonl").write_text("")
    assert f"{empty / 'eval.jsonl'}: the file has no rows" in _bad(capsys, eval_args(trained / "hf", empty, out))
    damaged = tmp_path / "damaged"
    (damaged / "hf").mkdir(parents=True)
    for name in ("vapo.json", "hf/config.json"):
        (damaged / name).write_text((trained / "checkpoints" / "iter_0000001" / "actor" / name).read_text())
    (damaged / "metadata.json").write_text("{not json")
    assert f"--model {damaged}: unreadable checkpoint" in _bad(capsys, eval_args(damaged, data, out))
    assert not out.exists()  # nothing written on bad input


def test_math_answers_vote_by_math_verify_equivalence():
    """With the math reward, maj@K groups answers math-verify finds equal (1/2 = 0.5 = \\frac{1}{2})."""
    from vapo_megatron.evaluation.metrics import majority_vote
    from vapo_megatron.rewards.answers import AnswerKey

    key = AnswerKey("math", timeout_s=30.0, num_workers=1)
    try:
        responses = ["so \\boxed{3}", "the answer is \\boxed{0.5}", "\\boxed{3}", "\\boxed{\\frac{1}{2}}", "x = 1/2",
                     "no idea"]
        answers = key.extract(responses)
        assert answers[0] == "3" and answers[5] is None
        same = key.equivalence([answers])
        vote = majority_vote(answers, [False, True, False, True, True, False], same)
        assert (vote.votes, vote.index, vote.correct) == (3, 1, True)
    finally:
        key.close()
