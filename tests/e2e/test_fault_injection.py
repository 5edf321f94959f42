"""Crash consistency and numerics of real runs, by test-only fault injection (VAPO_FAULT under
tests/helpers/faults.py's entry point; docs/faults.md).

The shortened demo (2 ranks, TP=2, embedded engine, deterministic) runs once uninterrupted. A
second run on its own directory is SIGKILLed at each of the five kill points in turn, with a
damaged newest checkpoint before two of the restarts, and must end with the same actor and critic
(weights and Adam state), RNG states, run state, carried-over groups and metrics, bitwise, as the
uninterrupted run. NaN losses injected into a copy of the finished run are skipped and counted,
and then stop the run with exit code 4. Another copy, its carry-over file damaged, falls back to
the checkpoint before, and is stopped by a SIGTERM to torchrun with a checkpoint.

torchrun launches the runs whose subject is torchrun itself: the first kill (its failure report:
both workers -9; no process of the job left running), the NaN stop (both workers' own exit code 4
in its report, though its agent SIGTERMs the slower one: trainer/signals.py leave_together) and
the SIGTERM to it. The other runs' ranks are forked from the suite's preloaded forkserver
(tests/helpers/train_runs.py launch_in_forks), without three interpreters' start-up each: the same
main from the command line on, each rank killed by its own SIGKILL at the fault point, its exit
code, its output and any process it left running read back as torchrun's report would give them.

Both runs use partial rollout (rollout.partial; issue 47) with one-token rounds and a one-token
budget, so the checkpoints the kills resume from hold unfinished responses in the carry-over
buffer: a resume neither skips nor repeats a prompt and continues those responses exactly.
(The synchronous rollout's kill and resume: tests/e2e/test_offload_run.py, test_train.py.)
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from tests.helpers import faults
from tests.helpers.train_runs import (
    Launch,
    checkpoint_tensors,
    launch,
    launch_in_forks,
    make_demo_data,
    records,
    train_in_forks,
)
from vapo_megatron.data import carry_over

CONFIG = "demo_cpu.yaml"
VAPO_STEPS = 4
FINAL = f"iter_{1 + VAPO_STEPS:07d}"  # one value-pretraining iteration (0), then VAPO iterations 1..4
# torchrun checks its workers every 0.1 s by default and then sends SIGTERM to the rest. A trainer
# only records SIGTERM (stop_signals.py), so a peer still reaches its fault point; the longer
# interval just keeps the two ranks' ends alike (both die by their own SIGKILL, not mid-SIGTERM).
TORCHRUN_ARGS = ("--monitor-interval", "2")


def _settings(data: Path, run_dir: Path, *extra: str) -> list[str]:
    """The demo config cut to a few seconds, every phase of a VAPO step still run: no SFT, one
    value-pretraining iteration, 4 VAPO iterations of 8 prompts x 2 samples in 4 mini-batches,
    a checkpoint after every iteration."""
    return [
        f"trainer.run_dir={run_dir}", f"model.hf_path={data}/model", f"data.train_files=[{data}/train.jsonl]",
        "data.eval_files=[]", "sft.files=[]", "sft.steps=0", "algo.value_pretrain_steps=1",
        "rollout.prompts_per_step=8", "rollout.n_samples=2", "rollout.max_new_tokens=4",
        f"trainer.total_steps={VAPO_STEPS}", "trainer.save_every=1", "trainer.deterministic=true",
        "trainer.export_hf=false", "trainer.tensorboard=false", "rollout.partial.enabled=true",
        "rollout.partial.round_tokens=1", "rollout.partial.max_decode_steps=1", *extra,
    ]


@pytest.fixture(scope="module")
def demo_data(tmp_path_factory) -> Path:
    return make_demo_data(tmp_path_factory.mktemp("faults") / "data", n_train=64, n_eval=8, n_sft=8)


@pytest.fixture(scope="module")
def reference(demo_data, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    train_in_forks(CONFIG, *_settings(demo_data, run_dir))
    return run_dir


def _faulty(data: Path, run_dir: Path, fault: str, *extra: str, torchrun: bool = False) -> Launch:
    """The run under VAPO_FAULT=fault: its ranks forked, or (torchrun) under torchrun."""
    if torchrun:
        return launch(CONFIG, _settings(data, run_dir, *extra), env={"VAPO_FAULT": fault}, torchrun_args=TORCHRUN_ARGS,
                      module=faults.ENTRY)
    return launch_in_forks(CONFIG, _settings(data, run_dir, *extra), env={"VAPO_FAULT": fault}, module=faults.ENTRY,
                           reap=True)


def _worker_exit_codes(run: Launch) -> list[int]:
    """Each worker's exit code: a forked run's own (launch_in_forks), or from torchrun's failure
    report (torchrun itself exits with 1)."""
    if run.codes:
        return sorted(run.codes)
    by_pid = {pid: int(code) for code, pid in re.findall(r"exitcode\s*:\s*(-?\d+) \(pid: (\d+)\)", run.output)}
    return sorted(by_pid.values())


def _assert_killed(run: Launch, point: str, iteration: int) -> None:
    where = f"{point}@{iteration}"
    for rank in (0, 1):
        assert f"[vapo] VAPO_FAULT: killing rank {rank} at {where}\n" in run.stdout, run.output[-4000:]
    assert run.returncode != 0
    assert _worker_exit_codes(run) == [-9, -9], run.output[-3000:]  # SIGKILL, no cleanup ran
    assert not run.leftovers, f"processes of the killed run still alive: {run.leftovers}"


def _train_steps(run_dir: Path) -> list[int]:
    """Steps of the training iterations in metrics.jsonl (a fresh run also logs its data at step 0)."""
    return [r["step"] for r in records(run_dir) if r["phase"] in ("value_pretrain", "vapo")]


def _latest(root: Path) -> str:
    return (root / "latest").read_text().strip()


def _assert_consistent(root: Path) -> None:
    """`latest` names a complete checkpoint, and every iter_N directory is complete: a crash
    leaves at most a dot-named temporary directory."""
    assert (root / _latest(root)).is_dir(), f"latest names {_latest(root)}, which does not exist"
    for ckpt in root.glob("iter_*"):
        state = json.loads((ckpt / "state.json").read_text())
        assert state["complete"] is True and f"iter_{state['state']['iteration']:07d}" == ckpt.name
        assert (ckpt / "actor" / "metadata.json").is_file() and (ckpt / "critic" / "metadata.json").is_file()
        assert {p.name for p in (ckpt / "rng").iterdir()} == {"rank_0.safetensors", "rank_1.safetensors"}


def _resumed_from(run: Launch, root: Path, name: str) -> bool:
    return f"[vapo] resumed from {root / name} at iteration {int(name[5:])}\n" in run.stdout


def _unfinished(ckpt: Path) -> int:
    """Carried-over responses of a checkpoint that have tokens and have not finished."""
    _, groups = carry_over.read_groups(ckpt / carry_over.FILE)
    return sum(bool(s.tokens) and s.finish is None for _, g in groups for s in g.samples)


def _assert_same_run(want: Path, have: Path) -> None:
    """Same final checkpoint (all tensors of both dist checkpoints: weights, Adam moments and step;
    RNG states; run state) and the same metrics, each step once."""
    for model in ("actor", "critic"):
        a, b = (checkpoint_tensors(want / "checkpoints" / FINAL / model),
                checkpoint_tensors(have / "checkpoints" / FINAL / model))
        assert a.keys() == b.keys() and any(k.startswith("optimizer.") for k in a)
        differ = {k: float((a[k].double() - b[k].double()).abs().max()) for k in a if not torch.equal(a[k], b[k])}
        assert not differ, f"{model}: tensors differ from the uninterrupted run (max abs difference): {differ}"
    for rank in (0, 1):
        a = load_file(str(want / "checkpoints" / FINAL / "rng" / f"rank_{rank}.safetensors"))
        b = load_file(str(have / "checkpoints" / FINAL / "rng" / f"rank_{rank}.safetensors"))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), f"rank {rank}'s RNG state differs"
    state = [json.loads((d / "checkpoints" / FINAL / "state.json").read_text())["state"] for d in (want, have)]
    assert state[0] == state[1]
    carried = [carry_over.read_groups(d / "checkpoints" / FINAL / carry_over.FILE) for d in (want, have)]
    assert carried[0][1] and [(r, carry_over.to_plain([g])) for r, g in carried[0][1]] == \
        [(r, carry_over.to_plain([g])) for r, g in carried[1][1]], "the carried-over groups differ"

    def _comparable(r: dict) -> dict:  # timings differ; NaN != NaN, so compare the JSON text
        return json.dumps({k: v for k, v in r.items() if not k.startswith("perf/")}, sort_keys=True)

    assert _train_steps(have) == list(range(1, 2 + VAPO_STEPS)), "a step is missing or logged twice"
    a, b = records(want), records(have)
    assert [_comparable(r) for r in a] == [_comparable(r) for r in b]


def test_a_value_pretraining_step_makes_no_token_stale(reference):
    """Staleness counts actor updates (RunState.policy_version; issue 55 item 11). Iteration 0 is value
    pretraining, which leaves the actor as it was, so the tokens it sampled are of the very policy
    iteration 1 trains: none is stale and no group is waited for. (Counted by iterations, 79% of
    a step's tokens looked stale with importance ratios of 1 +- 2e-7, and groups had to finish.)"""
    steps = {r["step"]: r for r in records(reference) if r["phase"] in ("value_pretrain", "vapo")}
    assert steps[1]["phase"] == "value_pretrain" and steps[2]["phase"] == "vapo"
    assert steps[2]["partial/stale_fraction"] == 0.0 and "partial/is_ratio_mean" not in steps[2]
    assert steps[2]["partial/groups_waited"] == 0.0
    assert all(steps[s]["partial/stale_fraction"] > 0 for s in range(3, 2 + VAPO_STEPS))  # updates did make them stale


def test_killed_at_every_point_and_damaged_checkpoints_resume_to_the_same_run(reference, demo_data, tmp_path):
    run_dir = tmp_path / "run"
    root = run_dir / "checkpoints"

    # 1. Killed in the rollout of iteration 1 (iter_1 was written after the value-pretraining one),
    #    under torchrun: its report says both workers died of SIGKILL, and nothing of the job is left.
    run = _faulty(demo_data, run_dir, "rollout@1", torchrun=True)
    _assert_killed(run, "rollout", 1)
    _assert_consistent(root)
    assert _latest(root) == "iter_0000001" and _train_steps(run_dir) == [1]

    # 2. Killed after the first critic step of iteration 2 (resumes at 1: the actor has never stepped).
    run = _faulty(demo_data, run_dir, "critic_update@2")
    assert _resumed_from(run, root, "iter_0000001"), run.output[-3000:]
    _assert_killed(run, "critic_update", 2)
    _assert_consistent(root)
    assert _latest(root) == "iter_0000002"

    assert _unfinished(root / "iter_0000002") > 0  # what the next three restarts continue
    # 3. Killed after the first actor step of the same iteration (the critic had finished updating).
    run = _faulty(demo_data, run_dir, "actor_update@2")
    assert _resumed_from(run, root, "iter_0000002"), run.output[-3000:]
    _assert_killed(run, "actor_update", 2)
    _assert_consistent(root)
    assert _latest(root) == "iter_0000002"

    # 4. Killed after the weight sync of iteration 3: the engine had weights newer than any checkpoint.
    run = _faulty(demo_data, run_dir, "weight_sync@3")
    assert _resumed_from(run, root, "iter_0000002"), run.output[-3000:]
    _assert_killed(run, "weight_sync", 3)
    _assert_consistent(root)
    assert _latest(root) == "iter_0000003"

    # 5. The newest checkpoint damaged: rank 1's shard file of the actor cut in half (its TP shards;
    #    the replicated tensors are in rank 0's file). Only rank 1 fails to load it; all ranks fall
    #    back to iter_2, redo iteration 2 (writing iter_3 anew) and iteration 3, and are killed
    #    while writing iter_4: after the actor, before the critic.
    shard = root / "iter_0000003" / "actor" / "__1_0.distcp"  # torch DCP's name: __{rank}_{file}.distcp
    full = shard.stat().st_size
    shard.write_bytes(shard.read_bytes()[: full // 2])
    run = _faulty(demo_data, run_dir, "checkpoint@3")
    damaged = (f"[vapo] checkpoint {root / 'iter_0000003'} is damaged, falling back to an older one: "
               f"{root / 'iter_0000003' / 'actor'}: cannot load: ")
    assert damaged in run.stdout, run.output[-3000:]
    assert f"; {shard} is truncated ({full // 2} bytes, the metadata needs {full})" in run.stdout, run.output[-3000:]
    assert _resumed_from(run, root, "iter_0000002"), run.output[-3000:]
    _assert_killed(run, "checkpoint", 3)
    _assert_consistent(root)
    assert _latest(root) == "iter_0000003" and not (root / "iter_0000004").exists()
    half = root / ".iter_0000004.tmp"  # the half-written checkpoint, under a name nothing loads
    assert (half / "actor" / "metadata.json").is_file() and not (half / "critic" / "metadata.json").exists()

    # 6. The newest checkpoint damaged again: the critic's metadata deleted. A clean restart falls
    #    back to iter_2 and runs to the end.
    (root / "iter_0000003" / "critic" / "metadata.json").unlink()
    run = train_in_forks(CONFIG, *_settings(demo_data, run_dir))
    damaged = (f"[vapo] checkpoint {root / 'iter_0000003'} is damaged, falling back to an older one: "
               f"{root / 'iter_0000003' / 'critic'} is not a complete Megatron dist checkpoint")
    assert damaged in run.stdout, run.output[-3000:]
    assert _resumed_from(run, root, "iter_0000002"), run.output[-3000:]
    assert "VAPO_FAULT" not in run.output
    assert _latest(root) == FINAL and not list(root.glob(".iter_*"))
    _assert_consistent(root)
    _assert_same_run(reference, run_dir)


def test_a_damaged_carry_over_file_falls_back_and_sigterm_to_torchrun_checkpoints(reference, demo_data, tmp_path):
    """A copy of the finished reference run, its newest checkpoint's carry-over file holding a token id
    outside the vocabulary (which a resume took, and then failed the first step with an IndexError at
    every restart; issue 55 item 10), trained on; `kill <torchrun's pid>` during the
    one iteration after the redone one (item 12). The resume names the file, the group and the token, falls back to the
    previous checkpoint and redoes its iteration exactly. On SIGTERM torchrun's agent signals the
    workers and waits for them (--shutdown-timeout): they finish the step, checkpoint and exit 3; then
    the agent raises its SignalException and torchrun exits 1, whatever its workers' codes (docs/faults.md)."""
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    root = run_dir / "checkpoints"
    damaged = root / FINAL / carry_over.FILE
    vocab = json.loads((demo_data / "model" / "config.json").read_text())["vocab_size"]
    with safe_open(str(damaged), framework="pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    tensors["tokens"][-1] = vocab  # the last group's last token
    save_file(tensors, str(damaged), metadata=meta)
    run = launch(CONFIG, _settings(demo_data, run_dir, f"trainer.total_steps={VAPO_STEPS + 1}"),
                 env={"VAPO_FAULT": f"term_launcher@{1 + VAPO_STEPS}"},
                 torchrun_args=(*TORCHRUN_ARGS, "--shutdown-timeout", "300"), module=faults.ENTRY)
    last = len(carry_over.read_groups(reference / "checkpoints" / FINAL / carry_over.FILE)[1]) - 1
    assert (f"[vapo] checkpoint {root / FINAL} is damaged, falling back to an older one: {damaged} is damaged: "
            f"group {last} (key ") in run.stdout, run.output[-3000:]
    assert (f"token id {vocab} is outside the vocabulary [0, {vocab}) of model.hf_path\n"
            in run.stdout), run.output[-3000:]
    previous = f"iter_{VAPO_STEPS:07d}"
    assert _resumed_from(run, root, previous), run.output[-3000:]
    # The redone iteration wrote the newest checkpoint again, as the uninterrupted run had it.
    for model in ("actor", "critic"):
        a, b = checkpoint_tensors(reference / "checkpoints" / FINAL / model), checkpoint_tensors(root / FINAL / model)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), model
    assert [carry_over.to_plain([g])
            for _, g in carry_over.read_groups(reference / "checkpoints" / FINAL / carry_over.FILE)[1]] \
        == [carry_over.to_plain([g]) for _, g in carry_over.read_groups(damaged)[1]]
    # SIGTERM to torchrun: the workers' checkpoint and exit 3; torchrun's own exit 1.
    stopped = f"iter_{2 + VAPO_STEPS:07d}"
    assert f"[vapo] stop (SIGTERM): checkpoint at iteration {2 + VAPO_STEPS} written, exiting with 3" in run.stdout, \
        run.output[-3000:]
    assert run.returncode == 1 and "SignalException" in run.stderr, (run.returncode, run.output[-3000:])
    assert _latest(root) == stopped and not run.leftovers
    _assert_consistent(root)


def test_nan_losses_are_skipped_and_counted_then_stop_the_run(reference, demo_data, tmp_path):
    """Two more iterations on a copy of the finished reference run, both with NaN advantages and
    returns: 4 mini-batch steps per model per iteration. The first iteration's 4 skips (critic, then
    actor) stay under trainer.max_consecutive_skips=6 and the run goes on; the next iteration's
    second critic skip is the 6th in a row and stops the run with exit code 4."""
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    root = run_dir / "checkpoints"
    run = _faulty(demo_data, run_dir, "nan_loss@5,nan_loss@6", f"trainer.total_steps={VAPO_STEPS + 2}",
                  "trainer.max_consecutive_skips=6", torchrun=True)
    assert _resumed_from(run, root, FINAL), run.output[-3000:]
    assert "vapo-train: numerical error: critic: 6 optimizer steps in a row were skipped because a loss or the " \
           "gradient norm was NaN/Inf (trainer.max_consecutive_skips=6)" in run.stderr, run.output[-3000:]
    assert run.returncode != 0 and _worker_exit_codes(run) == [4, 4], run.output[-3000:]
    assert not run.leftovers
    for role in ("critic", "actor"):
        for n in (1, 2, 3, 4):
            assert (f"[vapo] {role}: optimizer step skipped (non-finite loss or gradient norm), "
                    f"{n} in a row\n" in run.stdout)
    # Iteration 5 (step 6) is logged with its skips; iteration 6 stopped before its log and checkpoint.
    assert _train_steps(run_dir) == list(range(1, 2 + VAPO_STEPS + 1))
    recs = {r["step"]: r for r in records(run_dir) if r["phase"] in ("value_pretrain", "vapo")}
    assert (recs[6]["critic/skipped_steps"], recs[6]["actor/skipped_steps"]) == (4.0, 4.0)
    assert recs[6]["critic/grad_norm"] is None and recs[6]["actor/grad_norm"] is None  # NaN, written as null
    assert all(recs[s]["critic/skipped_steps"] == 0.0 for s in range(1, 6))
    assert all(recs[s]["actor/skipped_steps"] == 0.0 for s in range(2, 6))
    assert _latest(root) == "iter_0000006" and not (root / "iter_0000007").exists()
    _assert_consistent(root)
    # The skipped iteration changed nothing: weights and Adam state after it are those before it.
    for model in ("actor", "critic"):
        before, after = checkpoint_tensors(root / FINAL / model), checkpoint_tensors(root / "iter_0000006" / model)
        assert before.keys() == after.keys() and any(k.startswith("optimizer.") for k in before)
        assert [k for k in before if not torch.equal(before[k], after[k])] == [], model
