"""The positive control's defect review (issue 54, decision rule 3: an oracle that hurts is looked at
as a defect first).

    python -m benchmarks.learning.oracle_review --run OUT/vapo_oracle/seed101 --data OUT/data/seed101/eval.jsonl
    python -m benchmarks.learning.oracle_review --run OUT/warm/seed101 --data OUT/data/seed101/eval.jsonl --advantages

Real groups: a run's vapo-eval samples (RUN/eval/samples.jsonl, 8 per held-out prompt at the
training temperature), tokenized as the trainer does (chat-template prompt, response, stop token).

- Values (default): OracleCritic.values on those groups, against a reference written apart from
  oracle.py: a prefix that differs from the worked answer (+ stop) is worth the wrong score; one on
  it, the mean reward of the group's other samples with the same first t tokens, or the last such
  mean. Every response position is compared, and every position outside the responses must be 0.
- --advantages: per-token advantages on the same groups, of VAPO's GAE on the oracle's values
  (length-adaptive lambda, gamma 1) and of GRPO (group mean and std), split at each wrong answer's
  first wrong token. Descriptive: it shows where each estimator puts the blame.
"""

from __future__ import annotations

import argparse
import json
import statistics
import types
from collections import defaultdict
from pathlib import Path

import torch

from benchmarks.learning.oracle import OracleCritic, first_wrong


def real_groups(run: Path, data: Path) -> tuple[types.SimpleNamespace, list, list[list[int]], OracleCritic]:
    """(batch, first wrong token per sample, each sample's reference answer + stop, the oracle)."""
    from transformers import AutoTokenizer

    hf = str(run / "hf")
    tok = AutoTokenizer.from_pretrained(hf)
    critic = OracleCritic(types.SimpleNamespace(model=types.SimpleNamespace(hf_path=hf),
                                                reward=types.SimpleNamespace(incorrect_score=-1.0, correct_score=1.0)))
    groups = defaultdict(list)
    with open(run / "eval" / "samples.jsonl") as f:
        for line in f:
            s = json.loads(line)
            groups[s["prompt_index"]].append(s)
    prompts = [json.loads(line) for line in data.read_text().splitlines() if line.strip()]
    rows, P, R, correct, rewards, gids, fws, refs = [], [], [], [], [], [], [], []
    for g, samples in sorted(groups.items()):
        p_ids = tok.apply_chat_template([{"role": "user", "content": prompts[g]["prompt"]}], tokenize=True,
                                        add_generation_prompt=True)
        p_ids = p_ids if isinstance(p_ids, list) else p_ids["input_ids"]
        chain = tok.encode(samples[0]["ground_truth"], add_special_tokens=False)
        for s in samples:
            r_ids = tok.encode(s["response"], add_special_tokens=False) + ([] if s["truncated"] else [tok.eos_token_id])
            rows.append(p_ids + r_ids)
            P.append(len(p_ids))
            R.append(len(r_ids))
            correct.append(bool(s["correct"]))
            rewards.append(float(s["reward"]))
            gids.append(g)
            refs.append(chain + [tok.eos_token_id])
            fws.append(first_wrong(r_ids, chain, bool(s["correct"])))
    S = max(map(len, rows))
    batch = types.SimpleNamespace(tokens=torch.tensor([r + [0] * (S - len(r)) for r in rows]),  # [B, S]
                                  prompt_lens=torch.tensor(P), response_lens=torch.tensor(R),
                                  correct=torch.tensor(correct), rewards=torch.tensor(rewards),
                                  group_ids=torch.tensor(gids))
    return batch, fws, refs, critic


def check_values(batch, refs: list[list[int]], critic: OracleCritic) -> tuple[int, int, list]:
    """(values compared, how many differ, the first few differences) of the oracle against the reference."""
    got = critic.values(batch)  # [B, S], at prediction positions
    P, R, rewards, gids = (batch.prompt_lens.tolist(), batch.response_lens.tolist(), batch.rewards.tolist(),
                           batch.group_ids.tolist())
    rows = batch.tokens.tolist()
    members = defaultdict(list)
    for i, g in enumerate(gids):
        members[g].append(i)
    checked, wrong = 0, []
    for i in range(len(rows)):
        resp, last = rows[i][P[i]:P[i] + R[i]], 0.0
        for t in range(R[i]):
            if resp[:t] != refs[i][:t]:
                want = -1.0
            else:
                same = [rewards[j] for j in members[gids[i]]
                        if j != i and R[j] >= t and rows[j][P[j]:P[j] + t] == refs[i][:t]]
                last = sum(same) / len(same) if same else last
                want = last
            checked += 1
            if abs(float(got[i, P[i] - 1 + t]) - want) > 1e-6:
                wrong.append((i, t, float(got[i, P[i] - 1 + t]), want))
        outside = got[i].clone()
        outside[P[i] - 1:P[i] - 1 + R[i]] = 0
        if outside.abs().sum() > 0:
            wrong.append((i, "a value outside the response"))
    return checked, len(wrong), wrong[:5]


def advantage_shapes(batch, fws: list, critic: OracleCritic, alpha: float = 1.0) -> dict[str, dict[str, float]]:
    """Mean per-token advantage by estimator, in groups with both scores: |A|, and A on wrong answers
    before / at / after their first wrong token, and on right answers."""
    from vapo_megatron.algorithms.advantages import group_relative_advantages
    from vapo_megatron.algorithms.gae import compute_gae, length_adaptive_lambda
    from vapo_megatron.data.batch import to_response

    pl, rl = batch.prompt_lens, batch.response_lens
    values = to_response(critic.values(batch), pl, rl)  # [B, T]
    T = values.shape[1]
    mask = (torch.arange(T).unsqueeze(0) < rl.unsqueeze(1)).float()
    rew = torch.zeros_like(values)
    rew.scatter_(1, (rl - 1).unsqueeze(1), batch.rewards.float().unsqueeze(1))  # the reward on the last token
    oracle, _ = compute_gae(rew, values, mask, 1.0, length_adaptive_lambda(rl.float(), alpha))
    grpo = (group_relative_advantages(batch.rewards.float(), batch.group_ids, std_norm=True, eps=1e-6).unsqueeze(1)
            * mask)
    R, ok, gids = rl.tolist(), batch.correct.tolist(), batch.group_ids.tolist()
    scores = defaultdict(set)
    for i, g in enumerate(gids):
        scores[g].add(ok[i])
    mixed = [i for i, g in enumerate(gids) if len(scores[g]) == 2]
    out = {}
    for name, A in (("oracle", oracle), ("grpo", grpo)):
        wrong, right = [i for i in mixed if not ok[i]], [i for i in mixed if ok[i]]
        cut = {i: min(int(fws[i]), R[i]) for i in wrong}
        parts = {"abs": [abs(float(A[i, t])) for i in mixed for t in range(R[i])],
                 "wrong_before": [float(A[i, t]) for i in wrong for t in range(cut[i])],
                 "wrong_at": [float(A[i, cut[i]]) for i in wrong if cut[i] < R[i]],
                 "wrong_after": [float(A[i, t]) for i in wrong for t in range(cut[i] + 1, R[i])],
                 "right": [float(A[i, t]) for i in right for t in range(R[i])]}
        out[name] = {k: statistics.fmean(v) if v else float("nan") for k, v in parts.items()}
    out["groups"] = {"samples": len(gids), "groups": len(scores), "mixed_groups": len({gids[i] for i in mixed}),
                     "success": sum(ok) / len(ok)}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.learning.oracle_review", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", required=True, type=Path, help="a run directory with hf/ and eval/samples.jsonl")
    ap.add_argument("--data", required=True, type=Path, help="the held-out prompts it was evaluated on (eval.jsonl)")
    ap.add_argument("--advantages", action="store_true", help="describe the per-token advantages instead")
    a = ap.parse_args(argv)
    for need in (a.run / "hf", a.run / "eval" / "samples.jsonl", a.data):
        if not need.exists():
            ap.error(f"{need}: not found")
    batch, fws, refs, critic = real_groups(a.run, a.data)
    if a.advantages:
        print(json.dumps(advantage_shapes(batch, fws, critic), indent=1))
        return 0
    checked, n_wrong, first = check_values(batch, refs, critic)
    print(f"{a.run}: {len(fws)} samples, {checked} oracle values compared with the reference, {n_wrong} differ {first}")
    return 1 if n_wrong else 0


if __name__ == "__main__":
    raise SystemExit(main())
