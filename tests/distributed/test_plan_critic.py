"""vapo-plan --critic-preset: a critic of its own size (model.critic_hf_path's, at the actor's
layout) is sized and timed as that model: its parameters are a hand count of it, its update
shrinks, the actor's phases stay as they were; a critic the actor's TP cannot split is refused."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

from tests.distributed.test_plan import megatron_padded_vocab
from tests.helpers.dist_utils import run_ranks

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
CONFIG, SMALL = str(CONFIGS / "qwen3_32b_vapo.yaml"), str(CONFIGS / "qwen3_32b_vapo_8b_critic.yaml")


def _plan(*extra: str, config: str = CONFIG) -> tuple[int, str]:
    from vapo_megatron.plan import main

    o = io.StringIO()
    with contextlib.redirect_stdout(o), contextlib.redirect_stderr(o):
        rc = main(["--config", config, "--nodes", "8", "--gpus-per-node", "8", "--preset", "qwen3-32b",
                   "--gpu", "h100", *extra])
    return rc, o.getvalue()


def _all():
    # The shipped 8B-critic config, planned without its files; a critic TP=8 cannot split.
    return _plan(), _plan("--critic-preset", "qwen3-8b", config=SMALL), _plan("--critic-preset", "qwen2.5-7b")


def qwen3_critic_count(c: dict, vocab: int) -> int:
    """Qwen3 by hand: embedding + layers * (q, k, v, o without biases + q/k norms + SwiGLU + 2 norms)
    + final norm + a 1-output value head with bias."""
    h, f, L, d = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["head_dim"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    layer = 2 * h * q + 2 * h * kv + 2 * d + 3 * h * f + 2 * h
    return vocab * h + L * layer + h + (h + 1)


def _seconds(out: str, phase: str) -> float:
    return float(re.search(rf"^\s+{phase}\s+([0-9.]+)\s", out, re.M).group(1))


def test_a_smaller_critic_is_sized_and_timed_as_its_own_model():
    from model_providers.presets import preset

    (rc_own, own), (rc_small, small), (rc_bad, bad) = run_ranks(1, _all)[0]
    assert rc_own == rc_small == 0, own + small
    assert "critic: preset qwen3-8b" in small
    c = preset("qwen3-8b")
    want = qwen3_critic_count(c, megatron_padded_vocab(c["vocab_size"], 8))
    assert f"critic {want:,} (megatron's padded vocabulary)" in small, small[:2000]
    assert _seconds(small, "critic_update") < _seconds(own, "critic_update") / 3  # 7B against 32B, same tokens
    assert _seconds(small, "actor_update") == _seconds(own, "actor_update")
    assert _seconds(small, "step") < _seconds(own, "step") and "\nfits: training peak" in small
    # Qwen2.5-7B's 28 heads and 4 KV heads do not split over the actor's TP=8: refused, naming it.
    assert rc_bad == 2 and "parallel.tp=8 does not divide num_attention_heads=28 of model.critic_hf_path (preset " \
        "qwen2.5-7b)" in bad, bad[-2000:]
