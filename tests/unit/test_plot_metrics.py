"""benchmarks/plot_metrics.py draws what a run logged: a run without a critic (algo.estimator=grpo)
has no value-loss or explained-variance panel and its RL steps are labelled grpo, not vapo."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import plot_metrics
from vapo_megatron.config import load_config, resume

ROOT = Path(__file__).resolve().parents[2]


def _run(tmp_path: Path, config: str, critic: bool) -> Path:
    run_dir = tmp_path / config
    resume.save(load_config(str(ROOT / "configs" / config), [f"trainer.run_dir={run_dir}"], check_paths=False))
    records = [{"step": 0, "phase": "eval", "eval/accuracy": 0.1, "eval/avg@2": 0.1}]
    for step in (1, 2, 3):
        r = {"step": step, "phase": "vapo", "reward/mean": 0.1 * step, "response_length/mean": 5.0,
             "actor/entropy": 1.0, "perf/step_s": 1.0, "perf/rollout_s": 0.6, "perf/actor_update_s": 0.4}
        if critic:
            r |= {"critic/value_loss": 0.5, "critic/explained_variance": 0.2, "perf/critic_update_s": 0.1}
        records.append(r)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return run_dir


def _drawn(run_dir: Path, monkeypatch) -> tuple[list[str], set[str]]:
    made = {}
    subplots = plot_metrics.plt.subplots

    def keep(*args, **kwargs):
        made["fig"], made["axes"] = subplots(*args, **kwargs)
        # Not rendered (seconds of CPU): what is drawn is the subject; tests/e2e/test_train.py
        # writes a real run's curves.png.
        made["fig"].tight_layout = made["fig"].savefig = lambda *a, **k: None
        return made["fig"], made["axes"]

    monkeypatch.setattr(plot_metrics.plt, "subplots", keep)
    assert plot_metrics.main([str(run_dir)]) == 0
    axes = [ax for ax in made["axes"].flat if ax.get_visible()]
    plot_metrics.plt.close(made["fig"])
    labels = {line.get_label() for ax in axes for line in ax.get_lines()}
    return [ax.get_title() for ax in axes], labels


def test_a_run_without_a_critic_has_no_critic_panels_and_is_labelled_grpo(tmp_path, monkeypatch):
    titles, labels = _drawn(_run(tmp_path, "grpo.yaml", critic=False), monkeypatch)
    assert "value loss" not in titles and "explained variance" not in titles
    assert "reward (mean)" in titles and "time per step by phase (s)" in titles
    assert "grpo" in labels and "vapo" not in labels
    titles, labels = _drawn(_run(tmp_path, "demo_cpu.yaml", critic=True), monkeypatch)
    assert "value loss" in titles and "explained variance" in titles and "vapo" in labels
