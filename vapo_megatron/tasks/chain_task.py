"""The chain task: long, heterogeneous answers with one terminal reward (issue 31).

The demo's answers (demo_task.py) are 2-4 tokens long, too short for what VAPO's components are
for: value pretraining, decoupled and length-adaptive GAE and the token-level loss act on long
responses of very different lengths whose reward arrives at the end. Here the user turn is a sum
of 2 to 10 one-digit terms, and the assistant works it out step by step, one running sum at a time:

    prompt  "a3+b5+c8+d9="
    answer  "a3+b5=8,8+c8=16,16+d9=25"

Each term carries a letter, its position: a step names the term it adds ("c8"), so the look-up
of the next term is "the digit after the next letter" (an induction head on a unique key), not
a count of the terms done so far, which the tiny model did not learn in a short warm start (an
unlabelled chain "3+5=8,8+8=16": 0 of 64 right after 210 SFT steps, docs/benchmarks.md).
An answer is 7 tokens long for 2 terms and up to ~80 for 10 (the tokenizer is demo_task's, one
token per character), so the lengths of one batch span more than 10x. Running sums stay below
100 (at most 10 x 9 = 90): every step is "a two-digit number plus a digit", which a tiny model can
learn; what makes long chains hard is that each step must look up the next term in the prompt
and copy the running sum it just wrote, so errors compound with the chain's length.

Reward: ``exact`` (rewards/, the whole stripped answer equals the worked chain). One wrong step
makes the answer wrong: the running sums after it differ, and even an error that a later one
cancels out leaves a step that does not match. So the reward is terminal and binary, and it
checks the final result (the last number of the chain) among everything else.
"""

from __future__ import annotations

import json
import os
import random

from vapo_megatron.tasks.demo_task import (
    Example,
    TinyModelSpec,
    write_task_files,
)

MIN_TERMS, MAX_TERMS = 2, 10
# The held-out length buckets of vapo-eval / benchmarks/learning: eval_short.jsonl and
# eval_long.jsonl are the held-out prompts with this many terms.
SHORT_TERMS = (2, 4)   # answers of 7-25 tokens
LONG_TERMS = (7, 10)   # answers of 50-80 tokens
# The chain's default model: the demo's width (hidden 64) with one more layer (3) for the look-up
# of the next term in the prompt; kept this small because a step of 128 responses of up to 70
# tokens must train in seconds on two CPU cores. Positions: prompt ~30 + answer ~70 tokens.
CHAIN_SPEC = TinyModelSpec(hidden_size=64, num_layers=3, num_attention_heads=4, num_key_value_heads=2,
                           intermediate_size=256, max_position_embeddings=256)


LABELS = "abcdefghijk"  # term i of a prompt is labelled LABELS[i]


def chain_answer(terms: list[int]) -> str:
    """The worked chain: "a3+b5=8,8+c8=16,..." (one step per term after the first)."""
    steps, total = [f"a{terms[0]}+b{terms[1]}={terms[0] + terms[1]}"], terms[0] + terms[1]
    for i, t in enumerate(terms[2:], start=2):
        steps.append(f"{total}+{LABELS[i]}{t}={total + t}")
        total += t
    return ",".join(steps)


def chain_prompt(terms: list[int]) -> str:
    return "+".join(f"{LABELS[i]}{t}" for i, t in enumerate(terms)) + "="


def num_terms(prompt: str) -> int:
    return prompt.rstrip("=").count("+") + 1


def final_result(answer: str) -> str:
    """The chain's result: the number after the last '=' (what the exact reward ends on)."""
    return answer.rsplit("=", 1)[-1]


def _problems(rng: random.Random, n: int, min_terms: int, max_terms: int) -> list[tuple[str, str]]:
    """n distinct problems, the number of terms uniform in [min_terms, max_terms] (a length of
    which every problem is taken already is redrawn: there are only 81 of 2 terms)."""
    if not 2 <= min_terms <= max_terms <= 11:
        raise ValueError(f"terms must satisfy 2 <= min <= max <= 11 (sums below 100), got {min_terms}..{max_terms}")
    capacity = sum(9 ** k for k in range(min_terms, max_terms + 1))
    if n > capacity:
        raise ValueError(f"{n} distinct chains requested, {capacity} exist")
    seen: set[str] = set()
    out = []
    while len(out) < n:
        terms = [rng.randint(1, 9) for _ in range(rng.randint(min_terms, max_terms))]
        p = chain_prompt(terms)
        if p not in seen:
            seen.add(p)
            out.append((p, chain_answer(terms)))
    return out


def make_chain_splits(seed: int, n_train: int, n_eval: int, n_sft: int, *, min_terms: int = MIN_TERMS,
                      max_terms: int = MAX_TERMS) -> dict[str, list[Example]]:
    """Disjoint train (RL prompts), eval (held-out) and sft sets, deterministic in ``seed``, plus
    eval_short / eval_long: the held-out prompts of SHORT_TERMS / LONG_TERMS terms."""
    rng = random.Random(seed)
    probs = [Example(p, a) for p, a in _problems(rng, n_train + n_eval + n_sft, min_terms, max_terms)]
    rng.shuffle(probs)  # the redraws put the few short chains first; every split gets its share
    ev, sft, train = probs[:n_eval], probs[n_eval: n_eval + n_sft], probs[n_eval + n_sft:]

    def bucket(lo: int, hi: int) -> list[Example]:
        return [e for e in ev if lo <= num_terms(e.prompt) <= hi]

    return {"train": train, "eval": ev, "sft": sft, "eval_short": bucket(*SHORT_TERMS),
            "eval_long": bucket(*LONG_TERMS)}


def write_chain_dir(out_dir: str, *, seed: int, n_train: int, n_eval: int, n_sft: int, spec: TinyModelSpec = CHAIN_SPEC,
                    min_terms: int = MIN_TERMS, max_terms: int = MAX_TERMS) -> dict[str, str]:
    """Like demo_task.write_demo_dir: {train,eval,eval_short,eval_long,sft}.jsonl, tokenizer/,
    model/ (random init, deterministic in ``seed``) and meta.json (with the answers' lengths)."""
    splits = make_chain_splits(seed, n_train, n_eval, n_sft, min_terms=min_terms, max_terms=max_terms)
    paths, tok, model = write_task_files(out_dir, splits, spec, seed)
    lengths = [len(tok(e.answer)["input_ids"]) for e in splits["train"]]
    meta = {
        "seed": seed, "task": "chain", "n_train": n_train, "n_eval": n_eval, "n_sft": n_sft,
        "terms": [min_terms, max_terms], "short_terms": list(SHORT_TERMS), "long_terms": list(LONG_TERMS),
        "n_eval_short": len(splits["eval_short"]), "n_eval_long": len(splits["eval_long"]),
        "answer_tokens": {"min": min(lengths), "max": max(lengths), "mean": round(sum(lengths) / len(lengths), 1)},
        "model": spec.__dict__, "num_parameters": sum(p.numel() for p in model.parameters()),
        "reward": "exact", "max_new_tokens": max(lengths) + 8,
    }
    paths["meta"] = os.path.join(out_dir, "meta.json")
    with open(paths["meta"], "w") as f:
        json.dump(meta, f, indent=1)
    return paths
