"""Rewards: math-verify answers, the hard time bound, user functions that fail, batch API."""

import logging
import time

import pytest
import torch

from vapo_megatron.rewards import build_reward_fn, score, score_batch

TIMEOUT_S = 3.0  # a normal check takes milliseconds; 3 s leaves room on a loaded 2-core machine
SLACK_S = 3.0  # kill + reap of one worker process


@pytest.fixture(scope="module")
def math_fn():
    fn = build_reward_fn("math", correct_score=1.0, incorrect_score=-1.0, timeout_s=TIMEOUT_S, num_workers=2)
    fn.wait_ready()  # workers import sympy and warm up before any timed check
    yield fn
    fn.close()


CASES = [
    ("So the answer is \\boxed{42}.", "42", True),
    ("\\boxed{43}", "42", False),
    ("We get $\\frac{2}{4}$, i.e. \\boxed{\\frac{1}{2}}", "\\frac{1}{2}", True),
    ("The answer is $0.5$", "\\frac{1}{2}", True),
    ("\\boxed{\\sqrt{8}}", "2\\sqrt{2}", True),
    ("Final answer: 17", "17", True),
    ("Final answer: 18", "17", False),
    ("no number here", "17", False),
    ("\\boxed{x^2 + 2x + 1}", "(x+1)^2", True),
]


def test_math_answers(math_fn):
    prompts = [""] * len(CASES)
    res = math_fn(prompts, [c[0] for c in CASES], [c[1] for c in CASES])
    assert [r.correct for r in res] == [c[2] for c in CASES]
    assert [r.score for r in res] == [1.0 if c[2] else -1.0 for c in CASES]
    assert not any(r.timed_out or r.error for r in res)


def test_zero_one_scores_and_score_batch():
    fn = build_reward_fn("exact", correct_score=1.0, incorrect_score=0.0, timeout_s=1.0)
    scores, correct, counters = score_batch(fn, ["p"] * 3, [" 82", "81", "82\n"], ["82", "82", "82"])
    assert scores.dtype == torch.float32 and correct.dtype == torch.bool
    assert scores.tolist() == [1.0, 0.0, 1.0] and correct.tolist() == [True, False, True]
    assert counters["reward/accuracy"] == pytest.approx(2 / 3) and counters["reward/timeouts"] == 0
    with pytest.raises(ValueError, match="correct_score"):
        build_reward_fn("exact", correct_score=0.0, incorrect_score=1.0, timeout_s=1.0)


@pytest.mark.parametrize(
    "response",
    [
        "\\boxed{9^{9^{9^{9}}}}",  # sympy evaluates the power tower: a C-level bigint loop
        "\\boxed{" + "\\frac{1}{" * 3000 + "2" + "}" * 6000,  # deeply nested LaTeX
    ],
    ids=["power_tower", "nested_latex"],
)
def test_time_bound_holds_on_pathological_input(math_fn, response):
    math_fn.wait_ready()  # a worker killed by an earlier test restarts in the background
    t0 = time.monotonic()
    scores, correct, counters = score_batch(math_fn, ["", ""], [response, "\\boxed{3}"], ["1", "3"])
    elapsed = time.monotonic() - t0
    assert elapsed < TIMEOUT_S + SLACK_S, elapsed
    assert scores[0].item() == -1.0 and not correct[0]
    assert correct[1]  # the other sample of the batch is scored normally
    # The pool recovers: a normal check right after works.
    assert math_fn([""], ["\\boxed{7}"], ["7"])[0].correct


# Answers that make a verifier explode (issue 7, part 3); 9^{9^{9^{9}}} is above. These can only
# be evaluated by building astronomically large integers: the hard bound must stop them.
EXPLOSIVE = [
    "\\boxed{2^{2^{2^{2^{2^{2}}}}}}",
    "\\boxed{(10^{10})!}",
    "Final answer: 9**9**9**9",  # plain text: math-verify's expression parser, not the LaTeX one
]
ODD = [
    "\\boxed{" + "\\sqrt{" * 2000 + "2" + "}" * 2001,               # deeply nested LaTeX
    "\\boxed{" + "{" * 1_000_000,                                     # a megabyte of open braces
    "\\boxed{" + "9" * 1_000_000 + "}",                               # a megabyte-long number
    "\\boxed{\\begin{pmatrix}" + "1&" * 5000 + "1\\end{pmatrix}}",   # a 5001-column matrix
    "\\boxed{\u202e24}",                                              # right-to-left override
    "\\boxed{4\u200d2}",                                              # zero-width joiner inside the number
    "\\boxed{4" + "\u0301" * 5000 + "2}",                             # 5000 combining accents
    "\\boxed{" + "\U0001f600" * 1000 + "}",                           # emoji
    "\\boxed{\ud800}",                                                # a lone surrogate
    "\\boxed{4\x002}",                                                # NUL
    "\\boxed{1e999999999}",
]


def test_pathological_answers_are_bounded_scored_wrong_and_counted(math_fn, caplog):
    math_fn.wait_ready()
    seen = []

    def recording(prompts, responses, answers):  # the verifier itself, its results kept for the asserts
        seen.extend(math_fn(prompts, responses, answers))
        return seen

    responses = EXPLOSIVE + ODD + ["\\boxed{42}"]
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="vapo_megatron.rewards"):
        scores, correct, counters = score_batch(recording, [""] * len(responses), responses, ["42"] * len(responses))
    elapsed = time.monotonic() - t0
    # Two workers; each timeout costs the bound plus a worker restart (imports, warm-up).
    assert elapsed < len(EXPLOSIVE) * (TIMEOUT_S + 15), elapsed
    assert scores.tolist() == [-1.0] * (len(responses) - 1) + [1.0]
    assert correct.tolist() == [False] * (len(responses) - 1) + [True]
    assert [r.timed_out for r in seen[: len(EXPLOSIVE)]] == [True] * len(EXPLOSIVE)
    assert counters["reward/timeouts"] == sum(r.timed_out for r in seen) >= len(EXPLOSIVE)
    assert counters["reward/errors"] == 0
    assert sum("ran past its bound" in r.getMessage() for r in caplog.records) <= 1  # once, not per sample
    math_fn.wait_ready()
    assert math_fn([""], ["\\boxed{7}"], ["7"])[0].correct  # and the pool works on


def test_model_output_is_never_executed(math_fn, tmp_path):
    # Responses written as code: math-verify's expression path hands sympy's parse_expr (which
    # evaluates Python) only runs of digits and + - * / ^ ( ) . characters, and the LaTeX path
    # parses with a grammar. Nothing here may run.
    m = tmp_path / "ran"
    responses = [
        f"\\boxed{{__import__('os').system('touch {m}')}}",
        f"Final answer: __import__('pathlib').Path('{m}').touch()",
        f"The answer is $open('{m}', 'w')$",
        f"answer: 1+1; open('{m}','w')",
        f"\\boxed{{\\text{{exec(\"open('{m}','w')\")}}}}",
        f"Final answer: (lambda: open('{m}','w'))()",
    ]
    math_fn.wait_ready()
    res = math_fn([""] * len(responses), responses, ["2"] * len(responses))
    assert not m.exists()
    assert not any(r.correct for r in res)


def test_megabyte_response_is_bounded_and_reads_the_tail(math_fn):
    math_fn.wait_ready()
    junk = "we try 1234 and then 56, which fails. " * 26_000  # ~1 MB of plain text
    t0 = time.monotonic()
    (r,) = math_fn([""], [junk + " so \\boxed{5}"], ["5"])
    assert time.monotonic() - t0 < TIMEOUT_S + SLACK_S
    assert r.correct


def test_single_call_score_api():
    r = score("\\boxed{12}", "12", correct_score=1.0, incorrect_score=0.0, timeout_s=TIMEOUT_S)
    assert r.correct and r.score == 1.0
    assert score("\\boxed{13}", "12", correct_score=1.0, incorrect_score=0.0, timeout_s=TIMEOUT_S).score == 0.0


def test_user_function_failures_are_counted_logged_once_and_survived(caplog):
    fn = build_reward_fn("tests.helpers.reward_fns:flaky", correct_score=1.0, incorrect_score=-1.0, timeout_s=TIMEOUT_S,
                         num_workers=2)
    try:
        responses = ["42", "boom", "41", "boom", "key", "none", "partial 0.25", "partial 1.0", "slow", "42"]
        fn.wait_ready()
        with caplog.at_level(logging.ERROR, logger="vapo_megatron.rewards"):
            t0 = time.monotonic()
            scores, correct, counters = score_batch(fn, ["p"] * len(responses), responses, ["42"] * len(responses))
            assert time.monotonic() - t0 < 2 * (TIMEOUT_S + SLACK_S)
        assert scores.tolist() == [1.0, -1.0, -1.0, -1.0, -1.0, -1.0, 0.25, 1.0, -1.0, 1.0]
        assert correct.tolist() == [True, False, False, False, False, False, False, True, False, True]
        assert counters["reward/errors"] == 4  # 2x ValueError, KeyError, BadReturn
        assert counters["reward/timeouts"] == 1
        msgs = [r.getMessage() for r in caplog.records]
        assert sum("raised ValueError" in m for m in msgs) == 1  # once per kind, not per sample
        assert sum("raised KeyError" in m for m in msgs) == 1
        assert sum("returned None" in m for m in msgs) == 1
        assert "user function exploded" in caplog.text
    finally:
        fn.close()


def test_every_kind_of_user_function_failure_is_survived(caplog):
    fn = build_reward_fn("tests.helpers.reward_fns:hostile", correct_score=1.0, incorrect_score=-1.0,
                         timeout_s=TIMEOUT_S, num_workers=2)
    try:
        fn.wait_ready()
        kinds = {  # response -> the kind counted and logged
            "exit": "SystemExit", "interrupt": "KeyboardInterrupt", "unprintable": "_Unprintable",
            "die": "WorkerDied", "recurse": "RecursionError", "memory": "MemoryError",
            "huge_message": "ValueError", "inf": "BadReturn",
        }
        responses = ["42", *kinds, "unpicklable", "np32", "42"]
        with caplog.at_level(logging.ERROR, logger="vapo_megatron.rewards"):
            for _ in range(2):  # a second batch: same failures, no new log lines, the run goes on
                fn.wait_ready()
                scores, correct, counters = score_batch(fn, ["p"] * len(responses), responses, ["42"] * len(responses))
                assert scores.tolist() == [1.0] + [-1.0] * (len(kinds) + 1) + [0.5, 1.0]
                assert correct.tolist() == [True] + [False] * (len(kinds) + 2) + [True]
                assert counters["reward/errors"] == len(kinds) + 1 and counters["reward/timeouts"] == 0
        msgs = [r.getMessage() for r in caplog.records]
        for kind in kinds.values():
            assert (sum(f"raised {kind} " in m or "returned inf" in m and kind == "BadReturn" for m in msgs)
                    == 1), (kind, msgs)
        assert "cannot be formatted" in caplog.text  # the exception whose __str__ raises
        assert max(len(m) for m in msgs) < 20_000  # a 5 MB message is cut, not logged whole
    finally:
        fn.close()


def test_bad_user_specs_are_named():
    with pytest.raises(ValueError, match="'no_such_module_xyz:f'.*cannot import"):
        build_reward_fn("no_such_module_xyz:f", correct_score=1.0, incorrect_score=0.0, timeout_s=1.0)
    with pytest.raises(ValueError, match="has no callable 'nope'"):
        build_reward_fn("tests.helpers.reward_fns:nope", correct_score=1.0, incorrect_score=0.0, timeout_s=1.0)
    with pytest.raises(ValueError, match="must look like"):
        build_reward_fn("just_a_name", correct_score=1.0, incorrect_score=0.0, timeout_s=1.0)


def test_a_reward_module_in_the_working_directory_imports_from_a_console_script(tmp_path):
    """A console script (vapo-train, vapo-eval) has no working directory on sys.path, unlike
    `python -m`; a user's my_reward.py beside the config once failed to import there without
    PYTHONPATH (issue 33 item 8). `python -P` starts as a console script does."""
    import subprocess
    import sys

    (tmp_path / "my_reward.py").write_text("def score(prompt, response, ground_truth):\n"
                                           "    return response == ground_truth\n")
    script = ("from vapo_megatron.rewards import build_reward_fn, score_batch\n"
              "fn = build_reward_fn('my_reward:score', correct_score=1.0, incorrect_score=0.0, timeout_s=30.0)\n"
              "print(score_batch(fn, ['p', 'p'], ['7', '8'], ['7', '7'])[0].tolist())\n")
    proc = subprocess.run([sys.executable, "-P", "-c", script], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "[1.0, 0.0]", proc.stderr[-2000:]
