"""A run directory remembers its configuration (vapo_megatron/config/resume.py): run_dir/config.yaml
holds the resolved settings; a resume with a different seed, learning rate, ... exits 2 listing
every differing key with both values, unless trainer.allow_config_change=true, which logs them.
Through vapo-train's main from the command line on, on one rank (TP=1, a one-step run) forked from
the suite's preloaded forkserver (tests/helpers/train_runs.py launch_in_forks: main's return value
is the exit code, its output the command's)."""

from __future__ import annotations

from pathlib import Path

from tests.helpers.train_runs import Launch, launch_in_forks
from vapo_megatron.config import Config, parse_config, resume, to_dict

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "demo_cpu.yaml"


def _base(demo: Path, run_dir: Path) -> list[str]:
    return [
        f"trainer.run_dir={run_dir}", f"model.hf_path={demo}/model", f"data.train_files=[{demo}/train.jsonl]",
        "data.eval_files=[]", "sft.files=[]", "sft.steps=0", "parallel.tp=1", "algo.value_pretrain_steps=0",
        "algo.mini_batches=1", "rollout.prompts_per_step=4", "rollout.n_samples=2", "rollout.max_new_tokens=4",
        "trainer.total_steps=1", "trainer.tensorboard=false", "trainer.export_hf=false", "trainer.seed=1234",
    ]


def _cli(*args: str) -> Launch:
    return launch_in_forks(CONFIG, list(args), nproc=1)


def _keys(tree: dict, prefix: str = "") -> set[str]:
    """Every dotted setting name of a config (its nested dict)."""
    return set().union(*(_keys(v, f"{prefix}{k}.") if isinstance(v, dict) else {prefix + k} for k, v in tree.items()))


def test_every_key_allowed_to_change_is_a_setting():
    from dataclasses import replace

    from vapo_megatron.config.schema import ParallelConfig

    allowed = {k for keys, _ in resume.MAY_CHANGE_ON_RESUME.values() for k in keys}
    given = replace(Config(), critic=replace(Config().critic, parallel=ParallelConfig()))  # a section that may be null
    keys = _keys(to_dict(Config())) | _keys(to_dict(given))
    assert allowed <= keys, allowed - keys


def test_differences_list_exactly_the_changed_keys(demo, tmp_path):
    a = parse_config(str(CONFIG), _base(demo, tmp_path))[0]
    b = parse_config(str(CONFIG), [*_base(demo, tmp_path), "trainer.seed=0", "actor_optim.lr=0.001",
                                  "data.train_files=[x.jsonl]", "trainer.total_steps=7"])[0]
    assert resume.differences(a, b) == {
        "actor_optim.lr": (a.actor_optim.lr, 0.001), "data.train_files": ([f"{demo}/train.jsonl"], ["x.jsonl"]),
        "trainer.seed": (a.trainer.seed, 0), "trainer.total_steps": (1, 7),
    }
    assert resume.differences(a, a) == {}


def test_a_changed_configuration_on_resume_is_refused_or_logged(demo, tmp_path):
    run_dir = tmp_path / "run"
    base = _base(demo, run_dir)
    first = _cli(*base)
    assert first.returncode == 0, first.stderr[-4000:]
    saved = run_dir / "config.yaml"
    assert parse_config(str(saved))[0] == parse_config(str(CONFIG), base)[0]
    latest, metrics = (run_dir / "checkpoints" / "latest").read_text(), (run_dir / "metrics.jsonl").read_bytes()

    # A new seed and actor learning rate are refused, both listed with both values; the longer
    # run (total_steps) alone would pass and is not listed as refused. Nothing is touched.
    proc = _cli(*base, "trainer.seed=0", "actor_optim.lr=0.001", "trainer.total_steps=2")
    assert proc.returncode == 2, proc.stderr[-4000:]
    assert f"vapo-train: configuration error: trainer.run_dir={run_dir} holds a run started with another " \
           f"configuration ({saved}); 2 setting(s) cannot change on a resume:\n" \
           f"  - actor_optim.lr: 0.0003 in the run, 0.001 now\n" \
           f"  - trainer.seed: 1234 in the run, 0 now\n" \
           f"choose a new trainer.run_dir, or set trainer.allow_config_change=true" in proc.stderr, proc.stderr[-3000:]
    assert "resumed from" not in proc.stdout
    assert (run_dir / "checkpoints" / "latest").read_text() == latest
    assert (run_dir / "metrics.jsonl").read_bytes() == metrics
    assert parse_config(str(saved))[0].trainer.seed == 1234

    # Allowed: the differences are logged, the run resumes, and the run directory now remembers the new seed.
    proc = _cli(*base, "trainer.seed=0", "trainer.total_steps=2", "trainer.allow_config_change=true")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert (f"[vapo] resuming {run_dir} with a changed configuration (trainer.allow_config_change=true): "
            "trainer.allow_config_change: False in the run, True now; trainer.seed: 1234 in the run, 0 now; "
            "trainer.total_steps: 1 in the run, 2 now\n") in proc.stdout, proc.stdout[-3000:]
    assert "resumed from" in proc.stdout
    assert parse_config(str(saved))[0].trainer.seed == 0

    # Keys that may change on a resume pass on their own, listed.
    proc = _cli(*base, "trainer.seed=0", "trainer.total_steps=3", "trainer.save_every=5")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert (f"[vapo] resuming {run_dir} with a changed configuration: trainer.allow_config_change: True in the run, "
            "False now; trainer.save_every: 20 in the run, 5 now; "
            "trainer.total_steps: 2 in the run, 3 now\n") in proc.stdout
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "iter_0000003"


def test_a_run_directory_written_before_the_engine_sections_resumes(demo, tmp_path):
    """Issue 64: the engine settings moved into their own sections (rollout.sglang.tp, ...). A run
    directory whose config.yaml still has the flat keys (rollout.sglang_tp, ...) resumes: its record
    is read in the new form, the resume sees the same configuration and rewrites the record anew."""
    import yaml

    run_dir = tmp_path / "run"
    base = _base(demo, run_dir)
    first = _cli(*base, "rollout.sglang.tp=2", "rollout.sglang.max_total_tokens=4096")
    assert first.returncode == 0, first.stderr[-4000:]
    saved = run_dir / "config.yaml"
    tree = yaml.safe_load(saved.read_text())
    r = tree["rollout"]
    s, http = r.pop("sglang"), r.pop("sglang_http")
    r.update(sglang_tp=s["tp"], sglang_mem_fraction=s["mem_fraction"], sglang_max_total_tokens=s["max_total_tokens"],
             sglang_urls=http["urls"])
    saved.write_text(yaml.safe_dump(tree, sort_keys=False))  # as the trainer wrote it before the move

    proc = _cli(*base, "rollout.sglang.tp=2", "rollout.sglang.max_total_tokens=4096", "trainer.total_steps=2")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "resumed from" in proc.stdout
    assert (f"[vapo] resuming {run_dir} with a changed configuration: trainer.total_steps: 1 in the run, "
            "2 now\n") in proc.stdout, proc.stdout[-3000:]  # nothing else differs: the old keys were read
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "iter_0000002"
    assert yaml.safe_load(saved.read_text())["rollout"]["sglang"] == {"tp": 2, "mem_fraction": 0.7,
                                                                      "max_total_tokens": 4096}
