"""Plain-torch check that the demo task has headroom for RL (not part of the trainer).

SFT a tiny Qwen2 on a few hundred addition examples, then run a bare group-baseline
REINFORCE loop (binary exact-match reward, token-level loss) and print held-out greedy
accuracy before and after, with timings. Usage:

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python scripts/prototype_demo_task.py --sft-steps 150 --rl-steps 30
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from vapo_megatron.testing.demo_task import TinyModelSpec, build_tiny_qwen2, build_tokenizer, make_splits


def prompt_ids(tok, prompt: str) -> list[int]:
    out = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if not isinstance(out, list) else out)


def left_pad(seqs: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    n = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), n), pad, dtype=torch.long)
    mask = torch.zeros((len(seqs), n), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, n - len(s) :] = torch.tensor(s)
        mask[i, n - len(s) :] = 1
    return ids, mask


@torch.no_grad()
def generate(model, prompts: list[list[int]], pad: int, eos: int, max_new: int, temperature: float, gen: torch.Generator):
    """Full-recompute sampling (sequences are ~20 tokens). Returns response id lists (eos included)."""
    ids, mask = left_pad(prompts, pad)
    done = torch.zeros(len(prompts), dtype=torch.bool)
    out: list[list[int]] = [[] for _ in prompts]
    for _ in range(max_new):
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, -1].float()
        if temperature == 0:
            nxt = logits.argmax(-1)
        else:
            nxt = torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=gen).squeeze(-1)
        for i in range(len(prompts)):
            if not done[i]:
                out[i].append(int(nxt[i]))
        done |= nxt == eos
        ids = torch.cat([ids, nxt[:, None]], 1)
        mask = torch.cat([mask, (~done | (nxt == eos)).long()[:, None]], 1)
        if done.all():
            break
    return out


def seq_logprobs(model, prompts: list[list[int]], responses: list[list[int]], pad: int):
    """Per-token log-probs of responses, right-padded; returns (logp [B, R], resp_mask [B, R])."""
    full = [p + r for p, r in zip(prompts, responses)]
    n = max(len(s) for s in full)
    r_max = max(len(r) for r in responses)
    ids = torch.full((len(full), n), pad, dtype=torch.long)
    mask = torch.zeros((len(full), n), dtype=torch.long)
    for i, s in enumerate(full):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
    logits = model(input_ids=ids, attention_mask=mask).logits.float()
    logp_all = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    logp = torch.zeros(len(full), r_max)
    rmask = torch.zeros(len(full), r_max)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        logp[i, : len(r)] = logp_all[i, len(p) - 1 : len(p) - 1 + len(r)]
        rmask[i, : len(r)] = 1
    return logp, rmask


def accuracy(model, tok, examples, max_new: int) -> float:
    eos, pad = tok.eos_token_id, tok.pad_token_id
    correct = 0
    for i in range(0, len(examples), 256):
        chunk = examples[i : i + 256]
        resp = generate(model, [prompt_ids(tok, e.prompt) for e in chunk], pad, eos, max_new, 0.0, None)
        correct += sum(tok.decode(r, skip_special_tokens=True).strip() == e.answer and r[-1:] == [eos] for r, e in zip(resp, chunk))
    return correct / len(examples)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--n-sft", type=int, default=400)
    ap.add_argument("--sft-steps", type=int, default=150)
    ap.add_argument("--sft-lr", type=float, default=3e-3)
    ap.add_argument("--rl-steps", type=int, default=30)
    ap.add_argument("--rl-lr", type=float, default=1e-3)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--task", default="add")
    ap.add_argument("--pos-nll", type=float, default=0.0, help="VAPO-style LM loss weight on correct samples")
    ap.add_argument("--sft-eval-every", type=int, default=0)
    ap.add_argument("--sft-stop-acc", type=float, default=1.1, help="stop SFT once held-out greedy acc >= this")
    ap.add_argument("--sft-noise", type=float, default=0.0)
    args = ap.parse_args()

    torch.manual_seed(args.seed)
    tok = build_tokenizer()
    eos, pad = tok.eos_token_id, tok.pad_token_id
    splits = make_splits(args.seed, n_train=4000, n_eval=400, n_sft=args.n_sft, task=args.task, sft_noise=args.sft_noise)
    spec = TinyModelSpec(hidden_size=args.hidden, num_layers=args.layers, intermediate_size=4 * args.hidden)
    model = build_tiny_qwen2(tok, spec, args.seed)
    n_params = sum(p.numel() for p in model.parameters())
    max_new = 8
    print(f"params={n_params}")
    acc0 = accuracy(model, tok, splits["eval"], max_new)

    t0 = time.time()
    opt = torch.optim.AdamW(model.parameters(), lr=args.sft_lr, weight_decay=0.0)
    g = torch.Generator().manual_seed(args.seed)
    sft = splits["sft"]
    for step in range(args.sft_steps):
        idx = torch.randint(len(sft), (64,), generator=g).tolist()
        ps = [prompt_ids(tok, sft[i].prompt) for i in idx]
        rs = [tok(sft[i].answer)["input_ids"] + [eos] for i in idx]
        logp, rmask = seq_logprobs(model, ps, rs, pad)
        loss = -(logp * rmask).sum() / rmask.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if args.sft_eval_every and (step + 1) % args.sft_eval_every == 0:
            # Stop on RL-train prompts (never SFT'd on), so the held-out eval set stays unused.
            acc = accuracy(model, tok, splits["train"][:200], max_new)
            print(f"  sft step {step + 1}: loss={loss.item():.3f} train[:200] acc={acc:.3f}", flush=True)
            if acc >= args.sft_stop_acc:
                break
    t_sft = time.time() - t0
    acc_sft = accuracy(model, tok, splits["eval"], max_new)
    print(f"init acc={acc0:.3f}  after SFT({args.sft_steps} steps, {t_sft:.1f}s) acc={acc_sft:.3f} loss={loss.item():.3f}")

    t0 = time.time()
    opt = torch.optim.AdamW(model.parameters(), lr=args.rl_lr, weight_decay=0.0)
    train = splits["train"]
    for step in range(args.rl_steps):
        idx = torch.randint(len(train), (args.prompts,), generator=g).tolist()
        ps = [prompt_ids(tok, train[i].prompt) for i in idx for _ in range(args.samples)]
        answers = [train[i].answer for i in idx for _ in range(args.samples)]
        model.eval()
        rs = generate(model, ps, pad, eos, max_new, 1.0, g)
        reward = torch.tensor(
            [float(tok.decode(r, skip_special_tokens=True).strip() == a and r[-1:] == [eos]) for r, a in zip(rs, answers)]
        )
        adv = (reward.view(args.prompts, args.samples) - reward.view(args.prompts, args.samples).mean(-1, keepdim=True)).view(-1)
        model.train()
        logp, rmask = seq_logprobs(model, ps, rs, pad)
        loss = -(logp * adv[:, None] * rmask).sum() / rmask.sum()
        pos = rmask * (reward > 0).float()[:, None]
        if args.pos_nll > 0 and pos.sum() > 0:
            loss = loss - args.pos_nll * (logp * pos).sum() / pos.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 10 == 9 or step == args.rl_steps - 1:
            print(f"rl step {step + 1}: mean reward={reward.mean():.3f}  greedy eval acc={accuracy(model, tok, splits['eval'], max_new):.3f}  t={time.time() - t0:.1f}s")
    print(f"RESULT sft_acc={acc_sft:.3f} rl_acc={accuracy(model, tok, splits['eval'], max_new):.3f} t_rl={time.time() - t0:.1f}s")


if __name__ == "__main__":
    main()
