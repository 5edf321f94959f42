"""Credit-assignment diagnostics on the chain task (issue 31): does the critic blame the first wrong step?

    python -m benchmarks.learning.credit --run runs/bench/vapo/seed0 [--prompts 64 --samples 4]

Loads a finished run's final actor (run_dir/hf) and critic (its last checkpoint's critic, exported
once with `vapo-convert mcore-to-hf` to run_dir/critic_hf; AutoModelForTokenClassification),
samples responses to held-out chains at the training temperature, and computes V_t at each
response token's prediction position (the trainer's convention, data/batch.py) and the TD errors
of the run's reward: delta_t = V_{t+1} - V_t, delta_T = R - V_T (gamma = 1, reward at the end).

For a wrong answer the first wrong step is the first character where it leaves the worked chain
(the tokenizer has one token per character, so that is a token index). Printed and written
(--out, JSON): where the most negative TD error falls relative to the first wrong token (at,
before, after; within 2 tokens), also with the last token's R - V_T left out, the mean TD error by
offset from it, and the critic's explained variance against the Monte-Carlo return R by position
in the response (1 - Var(R - V)/Var(R)).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def critic_hf(run: Path) -> Path:
    out = run / "critic_hf"
    if not (out / "config.json").exists():
        latest = (run / "checkpoints" / "latest").read_text().strip()
        subprocess.run([sys.executable, "-m", "vapo_megatron.convert", "mcore-to-hf", "--ckpt",
                        str(run / "checkpoints" / latest / "critic"), "--out", str(out)], check=True, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    return out


def first_error(response: str, truth: str) -> int | None:
    """Index of the first character where `response` leaves `truth` (None: they agree)."""
    for i, (a, b) in enumerate(zip(response, truth)):
        if a != b:
            return i
    return None if len(response) == len(truth) else min(len(response), len(truth))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", required=True, help="a finished run directory (hf/, checkpoints/, config.yaml)")
    ap.add_argument("--data", default=None, help="held-out chains (default: the run's first eval file)")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--out", default=None, help="JSON of the figures (default RUN/credit.json)")
    a = ap.parse_args()
    import torch
    import yaml
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification, AutoTokenizer

    run = Path(a.run)
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    rows = [json.loads(line)
            for line in Path(a.data or cfg["data"]["eval_files"][0]).read_text().splitlines()][: a.prompts]
    tok = AutoTokenizer.from_pretrained(run / "hf")
    actor = AutoModelForCausalLM.from_pretrained(run / "hf").eval()
    critic = AutoModelForTokenClassification.from_pretrained(critic_hf(run), num_labels=1).eval()
    correct, wrong = cfg["reward"]["correct_score"], cfg["reward"]["incorrect_score"]
    torch.manual_seed(cfg["trainer"]["seed"])
    offsets: dict[int, list[float]] = {}
    where = {"at": 0, "before": 0, "after": 0, "within_2": 0}
    inner = {"at": 0, "before": 0, "after": 0, "within_2": 0}  # the same without the last token's delta (R - V_T)
    by_pos: dict[int, list[tuple[float, float]]] = {}
    n_wrong = n = 0
    for row in rows:
        text = tok.apply_chat_template([{"role": "user", "content": row["prompt"]}], tokenize=False,
                                       add_generation_prompt=True)
        prompt = torch.tensor([tok(text)["input_ids"]])
        with torch.no_grad():
            out = actor.generate(prompt.repeat(a.samples, 1), do_sample=True, temperature=cfg["rollout"]["temperature"],
                                 max_new_tokens=cfg["rollout"]["max_new_tokens"], eos_token_id=tok.eos_token_id,
                                 pad_token_id=tok.pad_token_id)
        P = prompt.shape[1]
        for seq in out:
            resp = seq[P:].tolist()
            T = resp.index(tok.eos_token_id) + 1 if tok.eos_token_id in resp else len(resp)
            resp = resp[:T]
            answer = tok.decode([t for t in resp if t != tok.eos_token_id]).strip()
            R = correct if answer == row["answer"] else wrong
            with torch.no_grad():
                v = critic(torch.tensor([seq[: P + T].tolist()])).logits[0, P - 1: P - 1 + T, 0].float()
            delta = torch.cat([v[1:] - v[:-1], torch.tensor([R]) - v[-1:]])
            n += 1
            for t in range(T):
                by_pos.setdefault(t // 10, []).append((R, float(v[t])))
            err = first_error(answer, row["answer"]) if R == wrong else None
            if err is None or err >= T:
                continue
            n_wrong += 1
            worst = int(delta.argmin())
            where["at" if worst == err else "before" if worst < err else "after"] += 1
            where["within_2"] += abs(worst - err) <= 2
            if T > 1:
                worst = int(delta[:-1].argmin())
                inner["at" if worst == err else "before" if worst < err else "after"] += 1
                inner["within_2"] += abs(worst - err) <= 2
            for t in range(T):
                offsets.setdefault(max(-10, min(10, t - err)), []).append(float(delta[t]))
    ev = {}
    for b, pairs in sorted(by_pos.items()):
        rs = torch.tensor([p[0] for p in pairs])
        vs = torch.tensor([p[1] for p in pairs])
        ev[f"{10 * b}-{10 * b + 9}"] = {"tokens": len(pairs), "explained_variance":  # None: every return equal
                                        round(float(1 - (rs - vs).var() / rs.var()), 3) if rs.var() > 1e-6 else None}
    result = {
        "run": str(run), "responses": n, "wrong_with_a_first_error": n_wrong,
        "most_negative_td_vs_first_error": where,
        "most_negative_td_before_the_last_token_vs_first_error": inner,
        "mean_td_by_offset_from_first_error": {k: round(sum(v) / len(v), 4) for k, v in sorted(offsets.items())},
        "explained_variance_by_position": ev,
    }
    print(json.dumps(result, indent=1))
    Path(a.out or run / "credit.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
