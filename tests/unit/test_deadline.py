"""The deadline decision of vapo_megatron/deadline.py and its settings. The Slurm end-time query
and the whole save-requeue-resume path run on a real cluster in tests/test_slurm.py."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from vapo_megatron.config import ConfigError, load_config, parse_config
from vapo_megatron.config.checks import parse_time
from vapo_megatron.trainer.deadline import Deadline, StepClock, fits


def test_fits_counts_the_step_the_save_and_the_margin():
    # 100 s left: a 60 s step + 30 s save + 10 s margin is exactly 100 s.
    assert fits(now=1000.0, end=1100.0, step_s=60.0, save_s=30.0, margin_s=10.0)
    assert not fits(now=1000.5, end=1100.0, step_s=60.0, save_s=30.0, margin_s=10.0)
    assert not fits(now=1000.0, end=1100.0, step_s=0.0, save_s=0.0, margin_s=101.0)
    assert not fits(now=1000.0, end=900.0, step_s=0.0, save_s=0.0, margin_s=0.0)  # already past


def test_step_clock_keeps_the_longest_times():
    clock = StepClock()
    for s in (3.0, 7.0, 5.0):
        clock.add_step(s)
    clock.add_save(2.0)
    clock.add_save(1.0)
    assert (clock.step_s, clock.save_s) == (7.0, 2.0)


def test_fixed_deadline_decides_from_the_measured_times():
    soon = datetime.now(timezone.utc) + timedelta(seconds=100)
    clock = StepClock(step_s=30.0, save_s=20.0)
    ok, why = Deadline.from_setting(soon.isoformat(), margin_s=10.0).next_step_fits(clock)
    assert ok and why == ""
    ok, why = Deadline.from_setting(soon.isoformat(), margin_s=60.0).next_step_fits(clock)
    assert not ok and "longest so far 30 s" in why and "longest so far 20 s" in why and "at least 50 s" in why


def test_the_predicted_times_stand_in_until_measured():
    # vapo-train sets the prediction (sizing/step_time.py) before its first step; a measured time replaces it.
    clock = StepClock(predicted_step_s=1800.0, predicted_save_s=900.0)
    assert (clock.next_step_s, clock.next_save_s) == (1800.0, 900.0)
    soon = (datetime.now(timezone.utc) + timedelta(seconds=2000)).isoformat()
    ok, why = Deadline.from_setting(soon, margin_s=300.0).next_step_fits(clock)  # 1800 + 900 + 300 > 2000
    assert not ok and "(predicted 1800 s, none measured yet)" in why and "(predicted 900 s, none measured yet)" in why
    clock.add_step(600.0)
    assert (clock.next_step_s, clock.next_save_s) == (600.0, 900.0)
    ok, why = Deadline.from_setting(soon, margin_s=300.0).next_step_fits(clock)  # 600 + 900 + 300 < 2000
    assert ok and why == ""
    clock.add_save(1200.0)
    ok, why = Deadline.from_setting(soon, margin_s=300.0).next_step_fits(clock)  # 600 + 1200 + 300 > 2000
    assert not ok and "(longest so far 600 s)" in why and "(longest so far 1200 s)" in why
    assert StepClock().next_step_s == 0.0  # no prediction (CPU, unknown GPU): the measured times alone


def test_deadline_sources():
    assert parse_time("2026-11-23T10:00:00+00:00") == datetime(2026, 11, 23, 10, tzinfo=timezone.utc).timestamp()
    assert parse_time("2026-11-23T10:00:00") == datetime(2026, 11, 23, 10).timestamp()  # squeue's local time
    for no_end in ("N/A", "Unknown", "NONE", ""):
        assert parse_time(no_end) is None
    assert Deadline.from_setting("slurm", 5.0, env={"SLURM_JOB_ID": "42"}).slurm_job == "42"
    outside = Deadline.from_setting("slurm", 5.0, env={})
    assert outside.end() is None and outside.next_step_fits(StepClock(1e9, 1e9)) == (True, "")
    assert Deadline.from_setting("none", 5.0, env={"SLURM_JOB_ID": "42"}).end() is None


def test_deadline_settings_are_checked():
    load_config("configs/demo_cpu.yaml", ["trainer.deadline=2026-11-23T10:00:00+00:00"], check_paths=False)
    with pytest.raises(ConfigError, match=r"trainer.deadline='tomorrow' must be 'slurm', 'none' or an ISO-8601 time"):
        load_config("configs/demo_cpu.yaml", ["trainer.deadline=tomorrow"], check_paths=False)
    with pytest.raises(ConfigError, match=r"trainer.deadline_margin_s=-1.0 must be >= 0"):
        load_config("configs/demo_cpu.yaml", ["trainer.deadline_margin_s=-1"], check_paths=False)


def test_the_launchers_run_dir_applies_only_when_none_is_set(tmp_path):
    job = {"trainer.run_dir": "/scratch/job-7"}
    bare = tmp_path / "bare.yaml"
    bare.write_text("model: {hf_path: m}\n")
    assert parse_config(str(bare), [], fallbacks=job)[0].trainer.run_dir == "/scratch/job-7"
    # the config file's and the command line's win (configs/demo_cpu.yaml sets runs/demo)
    assert parse_config("configs/demo_cpu.yaml", [], fallbacks=job)[0].trainer.run_dir == "runs/demo"
    assert (parse_config(str(bare), ["trainer.run_dir=/scratch/run1"], fallbacks=job)[0].trainer.run_dir
            == "/scratch/run1")
