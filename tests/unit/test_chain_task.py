"""The chain task (vapo_megatron/tasks/chain_task.py): long, heterogeneous answers whose exact
reward is terminal and one wrong step dooms (issue 31)."""

from __future__ import annotations

from vapo_megatron.rewards import build_reward_fn
from vapo_megatron.tasks.chain_task import (
    LONG_TERMS,
    SHORT_TERMS,
    chain_answer,
    chain_prompt,
    final_result,
    make_chain_splits,
    num_terms,
)
from vapo_megatron.tasks.demo_task import build_tokenizer


def test_worked_chain():
    assert chain_prompt([3, 5, 8, 9]) == "a3+b5+c8+d9="
    assert chain_answer([3, 5, 8, 9]) == "a3+b5=8,8+c8=16,16+d9=25"
    assert final_result(chain_answer([3, 5, 8, 9])) == "25" and num_terms("a3+b5+c8+d9=") == 4


def test_splits_are_disjoint_and_answer_lengths_span_5x_in_one_batch():
    s = make_chain_splits(0, 1000, 200, 300)
    prompts = [set(e.prompt for e in s[k]) for k in ("train", "eval", "sft")]
    assert sum(map(len, prompts)) == len(set().union(*prompts)) == 1500
    tok = build_tokenizer()
    batch = s["train"][:16]  # the first RL step's prompts (configs/chain_cpu.yaml: 16 per step)
    lengths = [len(tok(e.answer)["input_ids"]) for e in batch]
    assert max(lengths) >= 5 * min(lengths), lengths
    everywhere = [len(tok(e.answer)["input_ids"]) for e in s["train"]]
    assert min(everywhere) == 7 and max(everywhere) >= 75
    assert {num_terms(e.prompt) for e in s["eval_short"]} <= set(range(SHORT_TERMS[0], SHORT_TERMS[1] + 1))
    assert {num_terms(e.prompt) for e in s["eval_long"]} <= set(range(LONG_TERMS[0], LONG_TERMS[1] + 1))
    assert s["eval_short"] and s["eval_long"] and set(s["eval_short"]) | set(s["eval_long"]) <= set(s["eval"])


def test_reward_is_correct_only_for_the_whole_chain():
    reward = build_reward_fn("exact", correct_score=1.0, incorrect_score=-1.0, timeout_s=5.0)
    truth = chain_answer([3, 5, 8, 9])
    wrong_step = "a3+b5=8,8+c8=17,17+d9=26"    # one slip, carried to the end
    cancelled = "a3+b5=9,9+c8=16,16+d9=25"     # a slip a later one cancels: right result, wrong chain
    final_only = "25"
    got = reward(["a3+b5+c8+d9="] * 5, [truth, f" {truth}\n", wrong_step, cancelled, final_only], [truth] * 5)
    assert [r.score for r in got] == [1.0, 1.0, -1.0, -1.0, -1.0]
    assert [r.correct for r in got] == [True, True, False, False, False]
