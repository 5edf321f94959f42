"""Start-up checks (issue 7, part 5) and bad data through the real CLI (part 2).

Every invalid setting is refused by vapo-train before torch.distributed starts or any model is
built, with a message naming the key and what is allowed; all problems are listed at once.
The CLI tests whose subject is the start-up run `python -m vapo_megatron.train` in a subprocess
(no torchrun): a launch of several ranks is described to it through WORLD_SIZE/RANK, as torchrun
would, and since no other rank exists, getting an answer at all proves the check ran before any
rendezvous; and a process that never imported torch proves the checks need none. The runs that
read the data (bad and fuzzed training data, a crafted checkpoint) run vapo-train's main on one
rank forked from the suite's preloaded forkserver (tests/helpers/train_runs.py launch_in_forks:
main's return value is the exit code, its output the command's).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.train_runs import Launch, launch_in_forks
from vapo_megatron.config import ConfigError, load_config, parse_config
from vapo_megatron.config.preflight import hardware_problems, startup_problems

ROOT = Path(__file__).resolve().parents[2]


def base_overrides(demo: Path, run_dir: Path) -> list[str]:
    return [
        f"trainer.run_dir={run_dir}", f"model.hf_path={demo}/model", f"data.train_files=[{demo}/train.jsonl]",
        f"data.eval_files=[{demo}/eval.jsonl]", f"sft.files=[{demo}/sft.jsonl]", "sft.steps=0",
        "parallel.tp=1", "algo.value_pretrain_steps=0", "algo.mini_batches=1", "rollout.prompts_per_step=4",
        "rollout.n_samples=2",
        "trainer.total_steps=1", "trainer.tensorboard=false", "trainer.export_hf=false", "eval.max_prompts=4",
    ]


def startup_report(demo: Path, tmp_path: Path, *overrides: str, world_size: int = 1, cuda: bool = False) -> list[str]:
    """What vapo-train's start-up reports (vapo_megatron/train.py's checked_config, both passes)."""
    cfg, problems = parse_config(str(ROOT / "configs" / "demo_cpu.yaml"),
                                 [*base_overrides(demo, tmp_path / "run"), *overrides])
    return problems + startup_problems(cfg, world_size) + hardware_problems(cfg, cuda=cuda)


def test_the_base_settings_pass(demo, tmp_path):
    assert startup_report(demo, tmp_path) == []


# (overrides, world size, text every message for it must hold: the key and what is allowed)
CASES = [
    (["parallel.tp=3"], 4, "parallel.tp * parallel.pp = 3 * 1 = 3 does not divide the world size 4 (ranks launched); "
                           "allowed parallel.tp * parallel.pp: 1, 2, 4"),
    (["parallel.tp=2", "parallel.pp=2"], 2, "= 4 does not divide the world size 2"),
    (["parallel.tp=3"], 3, "parallel.tp=3 does not divide num_attention_heads=4 of model.hf_path"),
    (["parallel.tp=4"], 4, "parallel.tp=4 does not divide num_key_value_heads=2 of model.hf_path"),
    (["parallel.tp=3"], 3, "allowed parallel.tp: 1, 2, 4"),
    (["parallel.pp=4"], 4, "parallel.pp=4 does not divide num_hidden_layers=2 of model.hf_path"),
    (["parallel.pp=2", "parallel.vpp=2"], 2, "parallel.pp * parallel.vpp = 2 * 2 does not divide num_hidden_layers=2"),
    (["parallel.vpp=2"], 1, "parallel.vpp=2 must be null, or >= 1 with parallel.pp >= 2"),
    (["rollout.prompts_per_step=6"], 4,
     "rollout.prompts_per_step=6 must be divisible by data-parallel size * algo.mini_batches = 4 * 1 = 4"),
    (["rollout.prompts_per_step=8", "algo.mini_batches=4"], 4, "= 4 * 4 = 16"),
    (["rollout.prompts_per_step=6", "algo.mini_batches=4"], 1,
     "rollout.prompts_per_step=6 is not divisible by algo.mini_batches=4"),
    (["sft.steps=2", "sft.batch_size=3"], 2, "sft.batch_size=3 must be divisible by the data-parallel size 2"),
    (["rollout.max_new_tokens=120", "trainer.micro_batch_tokens=4096"], 1,
     "= 152 exceeds max_position_embeddings=128 of model.hf_path"),
    (["trainer.micro_batch_tokens=16"], 1, "trainer.micro_batch_tokens=16 must hold one full sequence"),
    (["data.max_prompt_tokens=0"], 1, "data.max_prompt_tokens=0 must be >= 1"),
    (["trainer.logprob_chunk_tokens=0"], 1, "trainer.logprob_chunk_tokens=0 must be >= 1"),
    (["rollout.top_k=0"], 1, "rollout.top_k=0 must be -1 (off) or >= 1"),
    (["actor_optim.adam_beta2=1.0"], 1, "actor_optim.adam_beta2=1.0 must be in [0, 1)"),
    (["critic_optim.min_lr=1.0"], 1, "critic_optim.min_lr=1.0 must be in [0, critic_optim.lr="),
    (["reward.correct_score=0", "reward.incorrect_score=0"], 1,
     "reward.correct_score=0.0 must be greater than reward.incorrect_score=0.0"),
    (["reward.fn=no_such_module_xyz:score"], 1,
     "reward.fn='no_such_module_xyz:score': reward function spec 'no_such_module_xyz:score': cannot import module"),
    (["reward.fn=tests.helpers.reward_fns:missing"], 1, "has no callable 'missing'"),
    (["rollout.engine=sglang"], 1, "rollout.engine=sglang needs CUDA GPUs"),
    (["actor_optim.distributed_optimizer=true"], 1, "actor_optim.distributed_optimizer=true needs CUDA GPUs"),
    (["model.hf_path=/nonexistent/model"], 1, "model.hf_path: /nonexistent/model does not exist"),
    (["data.train_files=[/nonexistent/train.jsonl]"], 1, "data.train_files: /nonexistent/train.jsonl does not exist"),
    (["data.eval_files=[/nonexistent/eval.parquet]"], 1, "data.eval_files: /nonexistent/eval.parquet does not exist"),
    (["sft.steps=3", "sft.files=[/nonexistent/sft.jsonl]"], 1, "sft.files: /nonexistent/sft.jsonl does not exist"),
    (["sft.steps=3", "sft.files=[]"], 1, "sft.steps=3 needs sft.files"),
    (["eval.n_samples=0"], 1, "eval.n_samples=0 must be >= 1"),
    (["eval.every=-1"], 1, "eval.every=-1 must be >= 0 (0: no periodic evaluation)"),
    (["eval.temperature=0"], 1, "eval.temperature=0.0 must be > 0 (or null)"),
    (["rollout.routing_replay=true"], 1, "rollout.routing_replay=true: model.hf_path ("),  # the demo model is dense
]


def test_an_unknown_engine_is_one_line_naming_the_key(demo, tmp_path):
    assert startup_report(demo, tmp_path, "rollout.engine=vllm") == [
        "rollout.engine='vllm' is not an engine; one of: embedded, sglang, sglang_http (config/engines.py)"]


def test_moved_keys_name_their_new_place(demo, tmp_path):
    for old, new in (("trainer.eval_every", "eval.every"), ("data.eval_max_prompts", "eval.max_prompts"),
                     ("rollout.sglang_tp", "rollout.sglang.tp")):
        assert startup_report(demo, tmp_path, f"{old}=5") == [f"command-line override '{old}=5': "
                                                              f"{old} was moved to {new}"]


def test_routing_replay_is_refused_for_a_dense_model_in_one_line(demo, tmp_path):
    (line,) = startup_report(demo, tmp_path, "rollout.routing_replay=true")
    assert line.endswith("is a dense model, which routes no token through experts: set rollout.routing_replay=null "
                         "(on for mixture-of-experts models only)"), line
    assert startup_report(demo, tmp_path, "rollout.routing_replay=false") == []  # off: nothing to say


def test_the_shipped_dapo_config_runs_with_partial_rollout_from_the_command_line(demo, tmp_path):
    """issue 55 item 9: `vapo-train --config configs/dapo.yaml rollout.partial.enabled=true` was refused
    (its rollout.max_sampling_rounds=3: "remove it"), which no override could do. Both passes of
    vapo-train's start-up checks on that command line (only the files moved to the test's demo data,
    at its world size of 2 ranks for parallel.tp=2), and --print-config's (vapo-plan's) checks."""
    dapo = str(ROOT / "configs" / "dapo.yaml")
    files = [f"trainer.run_dir={tmp_path / 'run'}", f"model.hf_path={demo}/model",
             f"data.train_files=[{demo}/train.jsonl]",
             f"data.eval_files=[{demo}/eval.jsonl]", f"sft.files=[{demo}/sft.jsonl]"]
    cfg, problems = parse_config(dapo, [*files, "rollout.partial.enabled=true"])
    assert cfg.rollout.partial.enabled and cfg.rollout.dynamic_sampling and cfg.rollout.max_sampling_rounds == 3
    assert problems + startup_problems(cfg, 2) + hardware_problems(cfg) == []
    shown = subprocess.run([sys.executable, "-m", "vapo_megatron.train", "--print-config", "--config", dapo,
                            "rollout.partial.enabled=true"], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                           env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert shown.returncode == 0, shown.stderr


def test_files_the_run_will_not_read_are_not_required(demo, tmp_path):
    assert startup_report(demo, tmp_path, "sft.steps=0", "sft.files=[/nonexistent/sft.jsonl]") == []


@pytest.mark.parametrize("overrides,world,text", CASES, ids=[" ".join(c[0]) + f" @{c[1]}" for c in CASES])
def test_each_invalid_setting_is_named(demo, tmp_path, overrides, world, text):
    problems = startup_report(demo, tmp_path, *overrides, world_size=world)
    assert any(text in p for p in problems), problems


def test_files_and_model_dirs_are_checked_for_what_they_hold(demo, tmp_path):
    (tmp_path / "data_dir.jsonl").mkdir()
    (tmp_path / "t.csv").write_text("prompt,answer\n")
    empty_model = tmp_path / "empty_model"
    empty_model.mkdir()
    bad_json = tmp_path / "bad_json_model"
    bad_json.mkdir()
    (bad_json / "config.json").write_text("{not json")
    odd_arch = tmp_path / "odd_arch"
    odd_arch.mkdir()
    hf = json.loads((demo / "model" / "config.json").read_text())
    (odd_arch / "config.json").write_text(json.dumps({**hf, "architectures": ["GPTNeoXForCausalLM"],
                                                      "model_type": "gpt_neox"}))
    (tmp_path / "run_is_a_file").write_text("")
    problems = startup_report(
        demo, tmp_path, f"data.train_files=[{tmp_path}/data_dir.jsonl]", f"data.eval_files=[{tmp_path}/t.csv]",
        f"model.hf_path={empty_model}", f"model.critic_hf_path={bad_json}", f"trainer.run_dir={tmp_path}/run_is_a_file",
    )
    want = [
        f"data.train_files: {tmp_path}/data_dir.jsonl is not a file",
        f"data.eval_files: {tmp_path}/t.csv has an unknown file type (allowed: .jsonl, .json, .parquet)",
        f"model.hf_path: {empty_model} has no config.json",
        f"model.critic_hf_path: {bad_json}/config.json is not readable JSON",
        f"trainer.run_dir: {tmp_path}/run_is_a_file exists and is not a directory",
    ]
    for w in want:
        assert any(w in p for p in problems), (w, problems)
    problems = startup_report(demo, tmp_path, f"model.critic_hf_path={odd_arch}")
    assert any("model.critic_hf_path: " in p and "unsupported architecture" in p for p in problems), problems
    assert any(f"model.critic_hf_path: {odd_arch} has no model.safetensors" in p for p in problems), problems


def test_what_a_setting_needs_of_the_machine_is_listed_with_the_other_problems(demo, tmp_path, monkeypatch):
    """vapo-train's own two passes (train.checked_config): a setting that needs CUDA is said beside
    the other problems, not only once they are fixed (rollout.engine=sglang at parallel.tp=1 said
    the rollout.sglang.tp problem alone, then the missing CUDA on the next try)."""
    import torch

    from vapo_megatron.train import checked_config

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS", "VAPO_RUN_DIR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # this machine's answer, on any machine
    with pytest.raises(ConfigError) as e:
        checked_config(str(ROOT / "configs" / "demo_cpu.yaml"),
                       [*base_overrides(demo, tmp_path / "run"), "rollout.engine=sglang", "rollout.sglang.tp=2"])
    msg = str(e.value)
    assert msg.startswith("2 invalid settings:"), msg
    assert ("rollout.sglang.tp=2 must divide parallel.tp=1" in msg
            and "rollout.engine=sglang needs CUDA GPUs" in msg), msg


def test_unknown_keys_and_wrong_types_are_all_listed():
    with pytest.raises(ConfigError) as e:
        load_config(str(ROOT / "configs" / "demo_cpu.yaml"),
                    ["algo.alpah=0.1", "rollout.n_samples=many", "model.dtype=fp8"], check_paths=False)
    msg = str(e.value)
    assert msg.startswith("3 invalid settings:")
    assert "unknown config key algo.alpah (allowed: " in msg and "alpha" in msg
    assert "rollout.n_samples must be an integer, got 'many'" in msg
    assert "model.dtype='fp8' is not allowed (choose one of: float32, bfloat16)" in msg


# ---- the real CLI ----------------------------------------------------------------------------

def _cli(*args: str, env_extra: dict | None = None, timeout: int = 120) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS")}
    env.update({"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **(env_extra or {})})
    cmd = [sys.executable, "-m", "vapo_megatron.train", "--config", str(ROOT / "configs" / "demo_cpu.yaml"), *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def _forked(*args: str) -> Launch:
    """vapo-train's main on one forked rank (a launch of one process)."""
    return launch_in_forks("demo_cpu.yaml", list(args), nproc=1)


def test_cli_lists_every_bad_setting_and_exits_before_starting_ranks(demo, tmp_path):
    run_dir = tmp_path / "run"
    proc = _cli(
        *base_overrides(demo, run_dir), "parallel.tp=3", "rollout.prompts_per_step=6", "rollout.top_k=0",
        "rollout.max_new_tokens=200", "trainer.micro_batch_tokens=4096", f"data.eval_files=[{tmp_path}/missing.jsonl]",
        # Four ranks launched (as torchrun would say); only this one exists, so a rendezvous would hang.
        env_extra={"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "0"},
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    err = proc.stderr
    assert "vapo-train: configuration error: " in err
    for text in [
        "parallel.tp * parallel.pp = 3 * 1 = 3 does not divide the world size 4",
        "parallel.tp=3 does not divide num_attention_heads=4",
        "rollout.top_k=0 must be -1 (off) or >= 1",
        "exceeds max_position_embeddings=128",
        f"data.eval_files: {tmp_path}/missing.jsonl does not exist",
    ]:
        assert text in err, (text, err[-3000:])
    assert "Traceback" not in err
    assert not run_dir.exists()  # nothing was started: not even the run directory


def test_cli_reports_an_unknown_key_and_a_bad_value_at_once_without_torch(demo, tmp_path):
    """Structural problems (an unknown key, a type, an override without `=`) and value problems
    come back together, exit 2, from a process that never imported torch or megatron-core (the
    reason it answers in a few seconds)."""
    code = ("import sys; from vapo_megatron.train import main; rc = main(sys.argv[1:]); "
            "heavy = sorted(m for m in ('torch', 'megatron', 'transformers') if m in sys.modules); "
            "print('HEAVY', heavy, file=sys.stderr); sys.exit(rc)")
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS")}
    proc = subprocess.run(
        [sys.executable, "-c", code, "--config", str(ROOT / "configs" / "demo_cpu.yaml"),
         *base_overrides(demo, tmp_path / "run"),
         "algo.alpah=0.1", "algo.gamma=1.5", "rollout.n_samples=many", "algo.value_clip"],
        cwd=ROOT, env={**env, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    err = proc.stderr
    assert "vapo-train: configuration error: 4 invalid settings:" in err, err[-3000:]
    for text in ["unknown config key algo.alpah", "algo.gamma=1.5 must be in [0, 1]",
                 "rollout.n_samples must be an integer, got 'many'",
                 "command-line override 'algo.value_clip' must be key=value"]:
        assert text in err, (text, err[-3000:])
    assert "HEAVY []" in err, err[-3000:]
    assert not (tmp_path / "run").exists()


def test_cli_heads_against_tp_with_a_matching_world(demo, tmp_path):
    proc = _cli(*base_overrides(demo, tmp_path / "run"), "parallel.tp=4",
                env_extra={"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "0"})
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "parallel.tp=4 does not divide num_key_value_heads=2 of model.hf_path" in proc.stderr
    assert "allowed parallel.tp: 1, 2" in proc.stderr


def test_cli_all_bad_training_data_stops_with_the_file_named(demo, tmp_path):
    bad = tmp_path / "all_bad.jsonl"
    bad.write_bytes(b'{"prompt": "1+1=", "answer": null}\n{"prompt": 5, "answer": "2"}\n\xff\xfe\n')
    proc = _forked(*base_overrides(demo, tmp_path / "run"), f"data.train_files=[{bad}]")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert (f"vapo-train: data error: {bad}: no usable prompt in 3 rows (non_utf8=1, null_answer=1, "
            "wrong_type=1)" in proc.stderr)
    for line in (1, 2, 3):
        assert f"{bad}:{line}:" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "run").exists()  # made by the start (its lock), removed by the refusal (issue 44)


def test_cli_trains_through_fuzzed_data_and_refuses_a_crafted_checkpoint(demo, tmp_path):
    # The demo's good rows with the whole bad-row corpus of test_bad_data interleaved: the run
    # skips and logs each bad row, then trains; nothing reaches the model but validated prompts.
    import pickle
    import shutil

    from tests.helpers.hostile import SIMPLE_BAD_ROWS, Payload

    good = (demo / "train.jsonl").read_bytes().splitlines()
    lines: list[bytes] = []
    for i, (_, bad, _, _) in enumerate(SIMPLE_BAD_ROWS):
        lines += [good[i], bad]
    lines += good[len(SIMPLE_BAD_ROWS):]
    fuzzed = tmp_path / "fuzzed.jsonl"
    fuzzed.write_bytes(b"\n".join(lines) + b"\n")
    run_dir = tmp_path / "run"
    args = [*base_overrides(demo, run_dir), f"data.train_files=[{fuzzed}]", "data.eval_files=[]"]
    proc = _forked(*args)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for k in range(len(SIMPLE_BAD_ROWS)):
        assert f"skipping {fuzzed}:{2 * k + 2}:" in proc.stderr, 2 * k + 2
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert [r["phase"] for r in records] == ["data", "vapo"]
    # The skips are counted in the metrics too, not only in the log.
    assert records[0]["data/train_skipped"] == len(SIMPLE_BAD_ROWS)
    assert records[0]["data/train_prompts"] == len(good)

    # Part 6 through the trainer: a newer checkpoint whose actor index is a crafted pickle is
    # refused on resume (no code runs), and the run falls back to the good one and goes on.
    ckpts = run_dir / "checkpoints"
    shutil.copytree(ckpts / "iter_0000001", ckpts / "iter_0000002")
    meta = json.loads((ckpts / "iter_0000002" / "state.json").read_text())
    meta["state"]["iteration"] = 2  # a consistent newer checkpoint, apart from the planted pickle
    (ckpts / "iter_0000002" / "state.json").write_text(json.dumps(meta))
    marker = tmp_path / "pwned"
    (ckpts / "iter_0000002" / "actor" / ".metadata").write_bytes(pickle.dumps(Payload(str(marker))))
    (ckpts / "latest").write_text("iter_0000002\n")
    proc = _forked(*args, "trainer.total_steps=2")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert not marker.exists()
    assert "iter_0000002/actor/.metadata: refused to unpickle _io.open" in out
    assert "resumed from" in out and "iter_0000001 at iteration 1" in out
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert [r["step"] for r in records if r["phase"] == "vapo"] == [1, 2]


def test_cli_refuses_bad_baseline_settings_at_once_without_torch(demo, tmp_path):
    """The baselines' settings (issue 30): an estimator typo, grpo with value pretraining and with a
    critic-only setting, no sampling round, an overlong buffer past the longest response; one
    line each, together, exit 2, before torch."""
    code = ("import sys; from vapo_megatron.train import main; rc = main(sys.argv[1:]); "
            "heavy = sorted(m for m in ('torch', 'megatron', 'transformers') if m in sys.modules); "
            "print('HEAVY', heavy, file=sys.stderr); sys.exit(rc)")
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS")}

    def run(config: str, *overrides: str) -> str:
        proc = subprocess.run(
            [sys.executable, "-c", code, "--config", str(ROOT / "configs" / config),
             *base_overrides(demo, tmp_path / "run"),
             *overrides], cwd=ROOT, env={**env, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2, proc.stderr[-3000:]
        assert "HEAVY []" in proc.stderr, proc.stderr[-3000:]
        return proc.stderr

    err = run("demo_cpu.yaml", "algo.estimator=gpro", "rollout.max_sampling_rounds=0", "reward.overlong_buffer=9")
    assert "3 invalid settings:" in err, err[-3000:]
    for text in ["algo.estimator='gpro' is not an estimator; one of: gae, grpo, batch (config/estimators.py)",
                 "rollout.max_sampling_rounds=0 must be >= 1",
                 "reward.overlong_buffer=9 must be <= rollout.max_new_tokens=8"]:
        assert text in err, (text, err[-3000:])
    err = run("grpo.yaml", "algo.value_pretrain_steps=5", "algo.value_clip=0.3")
    assert "2 invalid settings:" in err, err[-3000:]
    for text in ["algo.value_pretrain_steps=5 needs a critic, which algo.estimator=grpo does not have",
                 "algo.value_clip (the value loss's clip) is set, but algo.estimator=grpo has no critic"]:
        assert text in err, (text, err[-3000:])
    assert not (tmp_path / "run").exists()


# critic.parallel (the critic's own layout): each bad setting is one line naming its key, before any work.
CRITIC_LAYOUT_CASES = [
    (["critic.parallel.tp=3"], 4, "critic.parallel.tp * critic.parallel.pp = 3 * 1 = 3 does not divide the world "
                                  "size 4 (ranks launched)"),
    (["critic.parallel.tp=3"], 3, "critic.parallel.tp=3 does not divide num_attention_heads=4 of model.hf_path"),
    (["critic.parallel.ep=2"], 2, "critic.parallel.ep=2 needs a mixture-of-experts model; model.hf_path"),
    (["critic.parallel.pp=4"], 4, "critic.parallel.pp=4 does not divide num_hidden_layers=2 of model.hf_path"),
    (["rollout.prompts_per_step=1", "rollout.n_samples=2", "parallel.tp=2", "critic.parallel.tp=1"], 4,
     "critic.parallel: its data-parallel size 4 (world size 4 / (critic.parallel.tp * critic.parallel.pp)) exceeds "
     "the 2 responses of a mini-batch"),
]


@pytest.mark.parametrize("overrides,world,text", CRITIC_LAYOUT_CASES)
def test_a_bad_critic_layout_is_one_line_naming_its_key(demo, tmp_path, overrides, world, text):
    report = startup_report(demo, tmp_path, *overrides, world_size=world)
    assert [line for line in report if text in line], report
    critic_lines = [line for line in report if "critic.parallel" in line]
    assert critic_lines and len(critic_lines) == len(set(critic_lines)), report


def test_a_critic_layout_is_refused_without_a_critic(demo, tmp_path):
    report = startup_report(demo, tmp_path, "algo.estimator=grpo", "critic.parallel.tp=1")
    assert any(line.startswith("critic (the critic's own settings) is set, but algo.estimator=grpo has no critic")
               for line in report), report


def test_the_critic_at_the_actors_layout_passes(demo, tmp_path):
    assert startup_report(demo, tmp_path, "critic.parallel.tp=1") == []
    assert startup_report(demo, tmp_path, "parallel.tp=2", "critic.parallel.tp=1", world_size=2) == []
