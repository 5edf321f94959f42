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


def test_a_phase_the_run_does_not_have_is_not_logged():
    """A run without a critic (algo.estimator=grpo: mcore/critic.py NoCritic) logged
    perf/critic_update_s = 0 every step; the phase is absent from its records, and the time of a
    block timed under it goes to perf/other_s, so the phases still add up to the step."""
    import time

    from vapo_megatron.mcore.critic import Critic, NoCritic
    from vapo_megatron.trainer.timing import PhaseTimer

    assert NoCritic.absent_phases == ("critic_update",) and Critic.absent_phases == ()
    timer = PhaseTimer(absent=NoCritic.absent_phases)
    timer.start()
    with timer("rollout"):
        time.sleep(0.01)
    with timer("critic_update"):
        time.sleep(0.01)
    logs = timer.lap()
    assert "perf/critic_update_s" not in logs and "perf/actor_update_s" in logs
    assert logs["perf/other_s"] >= 0.01
    assert abs(sum(v for k, v in logs.items() if k != "perf/step_s") - logs["perf/step_s"]) < 1e-9
    full = PhaseTimer()
    full.start()
    assert set(full.lap()) - set(logs) == {"perf/critic_update_s"}
