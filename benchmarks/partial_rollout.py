"""Partial rollout's rollout time per trained sample against the synchronous rollout's, on the chain
task, side by side in one process (issue 47; docs/benchmarks.md, "Partial rollout").

    python -m benchmarks.partial_rollout [--steps 10] [--sft-steps 300] [--seed 0] [--model DIR]
                                         [--round-tokens 32] [--spare-batches 1] [--max-staleness 1]

1. The chain task's files (vapo_megatron/tasks/chain_task.py: answers of 7-80 tokens) in --out,
   and, unless --model names a warm-started HF model directory, a short supervised warm start of
   its random-init model here (teacher-forced loss on the answers of sft.jsonl, AdamW, as the
   trainer's warm start but without Megatron) so that the answers have the task's lengths; it is
   saved to OUT/warm_model for --model.
2. One embedded engine (rollout/embedded.py, the CPU engine) with those weights, the training
   prompts in the sampler's order (data.seed) and configs/chain_cpu.yaml's rollout settings
   (16 prompts x 8 samples, max_new_tokens 96, temperature 1) runs --steps steps both ways,
   alternating step by step (and which goes first) so that both see the same machine load:
   synchronously (one generate call of the step's prompts, as Generator.collect) and with
   partial rollout (rollout/partial.py, the settings given here). The weights do not change (no
   update): only the rollout phase is timed; staleness counts as if each step synced new weights.
3. Printed: each way's rollout seconds, trained samples (finished groups x n), seconds per trained
   sample, and their ratio (synchronous / partial: above 1, partial rollout is faster).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


class LocalGenerator:
    """What partial.py calls on rollout/generator.py's Generator, on one engine in this process."""

    def __init__(self, engine, cfg, stop_token_ids):
        from vapo_megatron.rollout.generator import Generator

        self.engine, self.cfg, self.stop_token_ids = engine, cfg, stop_token_ids
        self.sampling = Generator.sampling.__get__(self)

    def extend(self, requests, params):
        return self.engine.extend(requests, params)

    def end_rounds(self):
        pass


def warm_start(model, tokenizer, sft_file: Path, *, steps: int, seed: int, batch: int = 32, lr: float = 3e-3) -> float:
    """Teacher-forced next-token loss on the answers (prompt tokens masked), AdamW; the last loss."""
    import torch

    from vapo_megatron.data.prompts import load_prompts

    records, _ = load_prompts([str(sft_file)], tokenizer, max_prompt_tokens=64, apply_chat_template=True,
                              schema="simple")
    eos = tokenizer.convert_tokens_to_ids(tokenizer.eos_token)
    rows = [(r.prompt_ids, tokenizer(r.answer, add_special_tokens=False)["input_ids"] + [eos]) for r in records]
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(seed)
    model.train()
    loss = torch.tensor(float("nan"))
    for _ in range(steps):
        pick = [rows[int(i)] for i in torch.randint(len(rows), (batch,), generator=g)]
        width = max(len(p) + len(a) for p, a in pick)
        ids = torch.full((batch, width), tokenizer.pad_token_id, dtype=torch.long)
        labels = torch.full((batch, width), -100, dtype=torch.long)
        for b, (p, a) in enumerate(pick):
            ids[b, : len(p) + len(a)] = torch.tensor(p + a)
            labels[b, len(p) : len(p) + len(a)] = torch.tensor(a)
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    return float(loss.detach())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="runs/bench_partial", help="where the chain task's files go")
    ap.add_argument("--model", help="a warm-started HF model directory of the chain task (skips the warm start)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=10, help="rollout steps of each way")
    ap.add_argument("--sft-steps", type=int, default=300)
    ap.add_argument("--round-tokens", type=int, default=32)
    ap.add_argument("--spare-batches", type=int, default=1)
    ap.add_argument("--max-staleness", type=int, default=1)
    ap.add_argument("--max-decode-steps", type=int, default=None)
    args = ap.parse_args(argv)
    if args.spare_batches > args.max_staleness:  # config/checks.py partial_problems' rule
        ap.error(f"--spare-batches={args.spare_batches} must be <= --max-staleness={args.max_staleness}")

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vapo_megatron.config import PartialRolloutConfig, parse_config
    from vapo_megatron.data.carry_over import CarryOver
    from vapo_megatron.data.datasets import stop_token_ids
    from vapo_megatron.data.prompts import PromptSampler, load_prompts
    from vapo_megatron.rollout.embedded import EmbeddedEngine
    from vapo_megatron.rollout.partial import DataParallel, PartialRollouts
    from vapo_megatron.tasks.chain_task import write_chain_dir

    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    out = Path(args.out)
    write_chain_dir(str(out), seed=args.seed, n_train=2000, n_eval=16, n_sft=2000)
    tokenizer = AutoTokenizer.from_pretrained(out / "tokenizer" if (out / "tokenizer").is_dir() else out / "model")
    model = AutoModelForCausalLM.from_pretrained(args.model or out / "model")
    if not args.model:
        t0 = time.perf_counter()
        loss = warm_start(model, tokenizer, out / "sft.jsonl", steps=args.sft_steps, seed=args.seed)
        model.save_pretrained(out / "warm_model")
        print(f"warm start: {args.sft_steps} steps, last loss {loss:.3f}, {time.perf_counter() - t0:.0f} s "
              f"(saved: --model {out / 'warm_model'} reuses it)")
    base, problems = parse_config(str(ROOT / "configs" / "chain_cpu.yaml"), [])
    assert not problems, problems
    partial = PartialRolloutConfig(enabled=True, round_tokens=args.round_tokens, spare_batches=args.spare_batches,
                                   max_staleness=args.max_staleness, max_decode_steps=args.max_decode_steps)
    cfg = base.rollout.__class__(**{**base.rollout.__dict__, "partial": partial})
    records, _ = load_prompts([str(out / "train.jsonl")], tokenizer, max_prompt_tokens=base.data.max_prompt_tokens,
                              apply_chat_template=True)
    stops = stop_token_ids(tokenizer)
    engine = EmbeddedEngine(model, eos_token_ids=[tokenizer.convert_tokens_to_ids(tokenizer.eos_token)],
                            pad_token_id=tokenizer.pad_token_id)
    gen = LocalGenerator(engine, cfg, stops)
    collector = PartialRollouts(gen, None, cfg, mini_batches=base.algo.mini_batches, dp=DataParallel(1, 0))
    sync_sampler = PromptSampler(records, cfg.prompts_per_step, base.data.seed)
    partial_sampler = PromptSampler(records, cfg.prompts_per_step, base.data.seed)
    carry = CarryOver()
    seconds = {"synchronous": 0.0, "partial": 0.0}
    trained = {"synchronous": 0, "partial": 0}
    lengths: list[int] = []
    for step in range(args.steps):
        seed = base.trainer.seed * 1_000_003 + step * 7919
        # alternate who goes first
        for way in ("synchronous", "partial") if step % 2 == 0 else ("partial", "synchronous"):
            t0 = time.perf_counter()
            if way == "synchronous":
                outs = engine.generate([p.prompt_ids for p in sync_sampler.next_batch()], gen.sampling(seed=seed))
                trained[way] += len(outs)
            else:
                rollout, logs = collector.collect(partial_sampler, carry, seed=seed, version=step)
                trained[way] += len(rollout.outputs)
            seconds[way] += time.perf_counter() - t0
        lengths += [len(o.token_ids) for o in outs]
        print(f"step {step}: synchronous {len(outs)} samples, longest {max(len(o.token_ids) for o in outs)} tokens; "
              f"partial {len(rollout.outputs)} samples in {logs['partial/rounds']:.0f} rounds, "
              f"{logs['partial/groups_carried']:.0f} groups carried", flush=True)
    lengths.sort()
    print(f"answers (synchronous): {lengths[0]}-{lengths[-1]} tokens, median {lengths[len(lengths) // 2]}")
    per = {k: seconds[k] / max(trained[k], 1) for k in seconds}
    print(f"{'rollout':<12}{'seconds':>9}{'trained samples':>17}{'ms per trained sample':>23}")
    for k in seconds:
        print(f"{k:<12}{seconds[k]:9.2f}{trained[k]:17d}{per[k] * 1e3:23.2f}")
    print(f"ratio (synchronous / partial, per trained sample): {per['synchronous'] / per['partial']:.2f} "
          f"(round_tokens={args.round_tokens}, spare_batches={args.spare_batches}, max_staleness={args.max_staleness}, "
          f"max_decode_steps={args.max_decode_steps})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
