"""The progress bar's time summary (trainer/timing.py): the largest phases as shares of the step,
then the offload and onload seconds whenever the trainer moved its state (trainer.offload_during_rollout)."""

from __future__ import annotations

from vapo_megatron.trainer.timing import PHASES, summary


def _logs(**seconds: float) -> dict[str, float]:
    logs = {f"perf/{p}_s": 0.0 for p in (*PHASES, "other")}
    logs.update({f"perf/{p}_s": s for p, s in seconds.items()})
    logs["perf/step_s"] = sum(seconds.values())
    return logs


def test_summary_names_the_offload_and_onload_times():
    text = summary(_logs(rollout=6.0, actor_update=2.0, critic_update=1.0, offload=0.5, onload=0.5))
    assert text == "10.00s roll 60% actor 20% crit 10% off 0.50s on 0.50s"


def test_summary_without_offload_is_unchanged():
    assert summary(_logs(rollout=6.0, actor_update=3.0, other=1.0)) == "10.00s roll 60% actor 30% other 10%"
    assert "perf/offload_s" in {f"perf/{p}_s" for p in PHASES} and "perf/onload_s" in {f"perf/{p}_s" for p in PHASES}
