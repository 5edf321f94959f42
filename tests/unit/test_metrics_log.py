"""metrics.jsonl across extensions of a finished run (trainer/metrics.py): one eval/accuracy_final
per run. Twice extended, a run held finals at steps 3, 5 and 6; the earlier ones keep their
figures under eval/accuracy_before_extension, also when an extension is killed and resumed."""

from __future__ import annotations

import json

from vapo_megatron.trainer.metrics import MetricsLogger


def _attempt(run_dir, *, start: int, total: int, finished: bool, until: int | None = None) -> None:
    """One start of the trainer: RL steps start+1..total, then the final eval (unless stopped `until`)."""
    logger = MetricsLogger(str(run_dir), total_steps=total, start_step=start, sft_start=0, finished=finished,
                           enabled=True, tensorboard=False)
    for step in range(start + 1, (until or total) + 1):
        logger.log(step, "vapo", {"reward/mean": step / 10})
    if until is None and start < total:
        logger.log(total, "eval", {"eval/accuracy": total / 100, "eval/accuracy_final": total / 100})
    logger.close()


def _records(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_one_final_eval_per_run_after_extensions(tmp_path):
    _attempt(tmp_path, start=0, total=3, finished=False)
    _attempt(tmp_path, start=3, total=5, finished=True)                 # extended to 5
    _attempt(tmp_path, start=5, total=6, finished=True, until=6)        # extended to 6, killed before its final
    _attempt(tmp_path, start=5, total=6, finished=True)                 # ... resumed from step 5's checkpoint
    records = _records(tmp_path)
    assert [r["step"] for r in records if "eval/accuracy_final" in r] == [6]
    assert [(r["step"], r["eval/accuracy_before_extension"]) for r in records
            if "eval/accuracy_before_extension" in r] == [(3, 0.03), (5, 0.05)]
    assert [r["step"] for r in records if r["phase"] == "eval"] == [3, 5, 6]  # eval/accuracy at each, once
    assert [r["step"] for r in records if r["phase"] == "vapo"] == [1, 2, 3, 4, 5, 6]
    text = (tmp_path / "metrics.jsonl").read_bytes()
    _attempt(tmp_path, start=6, total=6, finished=True)                 # a rerun of the finished run
    assert (tmp_path / "metrics.jsonl").read_bytes() == text


def test_an_extension_resumed_before_its_end_keeps_the_earlier_final(tmp_path):
    """Killed after the extension's first checkpoint (not finished), a resume dropped every record
    with eval/accuracy_final, the earlier run's too, although no later attempt evaluates step 3 again."""
    _attempt(tmp_path, start=0, total=3, finished=False)
    _attempt(tmp_path, start=3, total=6, finished=True, until=5)        # extended; checkpoint at 4, killed in 5
    _attempt(tmp_path, start=4, total=6, finished=False)
    records = _records(tmp_path)
    assert [(r["step"], "eval/accuracy_final" in r) for r in records if r["phase"] == "eval"] == [(3, False), (6, True)]
    assert [r["step"] for r in records if r["phase"] == "vapo"] == [1, 2, 3, 4, 5, 6]
