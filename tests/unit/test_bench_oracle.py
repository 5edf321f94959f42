"""The positive control's oracle value function (benchmarks/learning/oracle.py; issue 54) and the statistics
of its study (benchmarks/learning/stats.py, the report's Holm table and decision rules), on hand-built values."""

from __future__ import annotations

import math

import pytest
import torch

from benchmarks.learning.oracle import OracleCritic, first_wrong, oracle_values
from benchmarks.learning.report import T975, oracle_decisions, study_report
from benchmarks.learning.stats import fieller, holm, t_quantile, t_test
from benchmarks.learning.variants import STUDIES
from vapo_megatron.data.batch import RolloutBatch, to_response
from vapo_megatron.tasks.chain_task import chain_answer, chain_prompt
from vapo_megatron.tasks.demo_task import build_tokenizer

W, R = -1.0, 1.0  # the chain config's scores


def test_first_wrong_is_where_a_response_leaves_the_chain():
    chain = [1, 2, 3]
    assert first_wrong([1, 2, 3, 9], chain, correct=True) == math.inf
    assert first_wrong([1, 5, 3, 9], chain, correct=False) == 1
    assert first_wrong([1, 2, 9], chain, correct=False) == 2          # stopped before the chain's end
    assert first_wrong([1, 2, 3, 7, 7], chain, correct=False) == 3    # did not stop at the chain's end


def test_oracle_values_on_a_hand_built_group():
    """One group of four on the chain [1, 2, 3] (+ stop 9): a right answer, one wrong at token 1, one
    wrong at token 2, one that never stopped. Each value by the rule of the module docstring."""
    chain = [1, 2, 3]
    responses = [[1, 2, 3, 9], [1, 5, 3, 9], [1, 2, 4, 9], [1, 2, 3, 7]]
    rewards = [R, W, W, W]
    v, carried = oracle_values(responses, [chain] * 4, [True, False, False, False], rewards, [0] * 4, W, R)
    # fw = inf, 1, 2, 3. At t every sibling whose first wrong token is at t or later still shares o_<t.
    third = (R + W + W) / 3
    assert v[0] == [W, W, W, W]                        # its siblings all fail
    assert v[1] == [third, third, W, W]                # o_<2 holds its wrong token (index 1)
    assert v[2] == [third, third, (R + W) / 2, W]      # at t=2 only responses 0 and 3 share o_<2
    assert v[3] == [third, third, (R + W) / 2, R]      # at t=3 only the right answer does
    assert carried == 0
    # A response alone on the chain carries its last estimate forward.
    v, carried = oracle_values([[1, 2, 3, 9], [1, 5]], [chain] * 2, [True, False], [R, W], [0, 0], W, R)
    assert v[0] == [W, W, W, W] and carried == 2       # t=2, 3: response 1 left at t=1
    # Groups do not mix, and a group of one gets the midpoint.
    v, _ = oracle_values([[1, 2], [1, 2]], [chain, chain], [False, False], [W, W], [0, 1], W, R)
    assert v[0] == [0.0, 0.0]


def test_the_oracle_critic_reads_chains_from_prompts_and_puts_values_at_prediction_positions(tmp_path):
    tok = build_tokenizer()
    terms = [[3, 5, 8], [4, 4]]
    prompts = [tok.apply_chat_template([{"role": "user", "content": chain_prompt(t)}], tokenize=True,
                                       add_generation_prompt=True) for t in terms]
    prompts = [p if isinstance(p, list) else p["input_ids"] for p in prompts]
    right = tok.encode(chain_answer(terms[0]), add_special_tokens=False) + [tok.eos_token_id]
    wrong = right[:4] + tok.encode("9", add_special_tokens=False) + right[5:]
    other = tok.encode(chain_answer(terms[1]), add_special_tokens=False) + [tok.eos_token_id]
    rows = [(prompts[0], right), (prompts[0], wrong), (prompts[1], other), (prompts[1], other[:2] + [tok.eos_token_id])]
    S = max(len(p) + len(r) for p, r in rows)
    tokens = torch.zeros(len(rows), S, dtype=torch.long)
    for i, (p, r) in enumerate(rows):
        tokens[i, : len(p) + len(r)] = torch.tensor(p + r)
    batch = RolloutBatch(tokens=tokens, prompt_lens=torch.tensor([len(p) for p, _ in rows]),
                         response_lens=torch.tensor([len(r) for _, r in rows]), rewards=torch.tensor([R, W, R, W]),
                         correct=torch.tensor([True, False, True, False]), group_ids=torch.tensor([0, 0, 1, 1]))
    critic = OracleCritic.__new__(OracleCritic)
    critic.tokenizer, critic.chain_answer, critic.wrong, critic.right = tok, chain_answer, W, R
    values = critic.values(batch)                                         # [B, S]
    assert values.shape == (4, S) and (values * (1 - batch.mask.float())).abs().sum() == 0
    v = to_response(values, batch.prompt_lens, batch.response_lens)        # [B, T]
    assert v[0, :5].tolist() == [W] * 5 and v[0, 5:len(right)].tolist() == [W] * (len(right) - 5)  # sibling wrong at 4
    assert v[1, :5].tolist() == [R] * 5 and v[1, 5:len(wrong)].tolist() == [W] * (len(wrong) - 5)
    assert v[2, :3].tolist() == [W] * 3 and v[2, 3:len(other)].tolist() == [W] * (len(other) - 3)
    with pytest.raises(ValueError, match="no chain-task prompt"):
        critic.chain_tokens(tok.encode("hello", add_special_tokens=False))


def test_t_quantiles_match_the_table_the_earlier_studies_used():
    for df, t in enumerate(T975, start=1):
        assert abs(t_quantile(df) - t) < 6e-4, (df, t_quantile(df), t)


def test_the_paired_t_test_and_holm():
    m, low, high, p = t_test([0.1, 0.2, 0.3, 0.4, 0.5])
    assert abs(m - 0.3) < 1e-12 and abs(high - m - 2.7764 * 0.158114 / 5 ** 0.5) < 1e-4
    assert abs(p - 0.01324) < 1e-4  # t = 4.243 on 4 df (tables: 0.02 at 3.747, 0.01 at 4.604)
    assert t_test([0.0, 0.0, 0.0]) == (0.0, 0.0, 0.0, 1.0)
    # Holm's textbook case: 0.01, 0.04, 0.03, 0.005 over 4 -> 0.03, 0.06, 0.06, 0.02.
    adjusted = holm({"a": 0.01, "b": 0.04, "c": 0.03, "d": 0.005})
    assert {k: round(v, 6) for k, v in adjusted.items()} == {"d": 0.02, "a": 0.03, "c": 0.06, "b": 0.06}


def test_fiellers_interval_is_every_ratio_the_t_test_does_not_reject():
    num = [0.02, 0.05, -0.01, 0.03, 0.04, 0.0, 0.02, 0.06, 0.01, 0.03]
    den = [0.10, 0.12, 0.07, 0.09, 0.15, 0.08, 0.11, 0.13, 0.06, 0.10]
    ratio, low, high = fieller(num, den)
    assert abs(ratio - sum(num) / sum(den)) < 1e-12 and low < ratio < high
    t = t_quantile(9)
    for k in range(-100, 101):
        theta = k / 100
        d = [a - theta * b for a, b in zip(num, den)]
        r = t_test(d)
        inside = abs(r[0]) / ((r[2] - r[0]) / t) <= t
        assert inside == (low <= theta <= high), theta
    assert fieller([0.1, -0.1, 0.2], [0.05, -0.06, 0.02])[1:] == (None, None)  # a denominator around 0


def rows_of(values: dict[str, list[float]], seeds: list[int]) -> list[dict]:
    return [{"variant": v, "seed": s, "status": "finished", "heldout_avg@K": x, "long_avg@K": x, "heldout_accuracy": x,
             "auc": x, "samples": 6400, "samples_generated": 6400, "cpu_s": 1.0}
            for v, xs in values.items() for s, x in zip(seeds, xs)]


def test_the_oracle_studys_rules_are_applied_as_written():
    study = STUDIES["oracle"]
    seeds = study["seeds"]
    free = [0.40 + 0.01 * (i % 3) for i in range(10)]
    gain = [0.08, 0.10, 0.09, 0.11, 0.07, 0.10, 0.12, 0.09, 0.08, 0.10]   # the oracle: clearly above
    half = [g / 2 + (0.01 if i % 2 else -0.01) for i, g in enumerate(gain)]
    arms = {"vapo_no_critic": free, "vapo_oracle": [f + g for f, g in zip(free, gain)],
            "vapo": [f + h for f, h in zip(free, half)], "dr_grpo": free, "dapo_paper": free,
            "vapo_dapo_volume": free}
    text = oracle_decisions([r for r in rows_of(arms, seeds)], study)
    assert ("1. `vapo_oracle - vapo_no_critic` = +0.094 [" in text
            and "resolved above 0. A value function can help" in text), text
    ratio, low, high = fieller(half, gain)
    assert (f"2. The learned critic captures {ratio:+.2f} of the oracle's gain, 95% Fieller interval [{low:+.2f}, "
            f"{high:+.2f}]" in text)
    assert "`dr_grpo - vapo_no_critic` unresolved" in text  # identical arms: every difference 0, p = 1
    # The oracle's gain unresolved: no share, the task is called unable to show it.
    arms["vapo_oracle"] = [f + (0.01 if i % 2 else -0.01) for i, f in enumerate(free)]
    text = oracle_decisions(rows_of(arms, seeds), study)
    assert "unresolved. This task cannot show a critic's value" in text and "captures" not in text, text
    arms["vapo_oracle"] = [f - g for f, g in zip(free, gain)]
    assert "resolved BELOW 0" in oracle_decisions(rows_of(arms, seeds), study)
    report = study_report(rows_of(arms, seeds), study, study["primary"])
    assert "Holm p" in report and "| vapo_oracle - vapo_no_critic | 10 | -0.094 |" in report, report
    assert "Secondary comparisons" in report and "| vapo_dapo_volume - vapo | heldout_avg@K | 10 |" in report


def test_the_oracle_study_is_designed_as_the_issue_asks():
    study = STUDIES["oracle"]
    assert study["seeds"] == list(range(101, 111)) and len(study["pairs"]) == 5
    assert set(STUDIES["critic"]["seeds"]) < set(study["seeds"])
    assert study["summaries"] == "docs/benchmarks/oracle" and study["eval_k"] == STUDIES["critic"]["eval_k"]


def test_the_single_answer_studys_rules_are_applied_as_written():
    """report.single_decisions on hand-built values: each outcome of the first comparison reads as
    the design says (docs/benchmarks.md, "Where should a critic pay?")."""
    from benchmarks.learning.report import single_decisions

    study = STUDIES["single"]
    seeds = study["seeds"]
    free = [0.30 + 0.01 * (i % 3) for i in range(10)]
    gain = [0.08, 0.10, 0.09, 0.11, 0.07, 0.10, 0.12, 0.09, 0.08, 0.10]
    noise = [0.01 if i % 2 else -0.01 for i in range(10)]
    arms = {"batch_n1": free, "vapo_n1": [f + g for f, g in zip(free, gain)],
            "grpo": [f + g for f, g in zip(free, gain)], "vapo": [f + g + 2 * g for f, g in zip(free, gain)]}
    text = single_decisions(rows_of(arms, seeds), study)
    assert ("1. `vapo_n1 - batch_n1` = +0.094 [" in text
            and "above 0. The learned critic pays at one answer" in text), text
    assert "2. `vapo_n1 - grpo` (equal answers per step) = +0.000" in text and "Neither is shown to beat" in text, text
    assert "3. `vapo_n1 - vapo` = -0.188" in text and "group sampling (component 7) pays" in text, text
    arms["vapo_n1"] = [f + n for f, n in zip(free, noise)]
    text = single_decisions(rows_of(arms, seeds), study)
    assert "unresolved. The critic is not shown to pay at one answer per prompt" in text, text
    arms["vapo_n1"] = [f - g for f, g in zip(free, gain)]
    text = single_decisions(rows_of(arms, seeds), study)
    assert ("below 0. A learned critic that loses to the batch-mean baseline" in text
            and "2. The other comparisons are not read" in text)
    assert "3." not in text
    report = study_report(rows_of(arms, seeds), study, study["primary"])
    assert "| vapo_n1 - batch_n1 | 10 | -0.094 |" in report and "| vapo - grpo | heldout_avg@K | 10 |" in report, report


def test_the_defect_reviews_reference_on_a_hand_built_group():
    """benchmarks/learning/oracle_review.py's check_values on one group of three answers to a chain
    [5, 6, 7] + stop 9 (prompt of two tokens), against values worked by hand from the oracle's
    definition; a planted wrong value and a value outside a response are both reported."""
    import types

    from benchmarks.learning.oracle_review import check_values

    rows = [[1, 2, 5, 6, 7, 9], [1, 2, 5, 8, 7, 9], [1, 2, 5, 6, 7, 9]]  # right, wrong at t=1, right
    batch = types.SimpleNamespace(tokens=torch.tensor(rows), prompt_lens=torch.tensor([2, 2, 2]),
                                  response_lens=torch.tensor([4, 4, 4]), correct=torch.tensor([True, False, True]),
                                  rewards=torch.tensor([1.0, -1.0, 1.0]), group_ids=torch.tensor([0, 0, 0]))
    refs = [[5, 6, 7, 9]] * 3
    # By hand: V(t) is the mean reward of the other samples still on the chain after t tokens, -1 once off it.
    by_hand = [[0.0, 0.0, 1.0, 1.0], [1.0, 1.0, -1.0, -1.0], [0.0, 0.0, 1.0, 1.0]]

    def critic_of(values):
        full = torch.zeros(3, 6)
        for i, v in enumerate(values):
            full[i, 1:5] = torch.tensor(v)  # prediction positions P - 1 + t
        return types.SimpleNamespace(values=lambda b: full)

    assert check_values(batch, refs, critic_of(by_hand))[:2] == (12, 0)
    planted = [row[:] for row in by_hand]
    planted[1][2] = 1.0  # as if the answer were still on the chain one token late
    checked, wrong, first = check_values(batch, refs, critic_of(planted))
    assert (checked, wrong) == (12, 1) and first[0][:2] == (1, 2)
    leak = critic_of(by_hand)
    leak.values(batch)[0, 5] = 0.5  # after the response
    assert check_values(batch, refs, leak)[1] == 1
