"""Write the demo's data, tokenizer and tiny random-init Qwen2 model (deterministic by seed).

    python scripts/make_demo_data.py --out runs/demo/data
    python scripts/make_demo_data.py --task chain --out runs/chain/data

Writes OUT/{train,eval,sft}.jsonl ({"prompt", "answer"}), OUT/tokenizer/, OUT/model/
(HF Qwen2ForCausalLM: config.json + model.safetensors + tokenizer) and OUT/meta.json.
The reward for every task is exact match ("exact" in vapo_megatron.rewards).
--task chain (vapo_megatron/tasks/chain_task.py: worked chains of 2-10 one-digit terms, answers
of 5-70 tokens) also writes OUT/eval_short.jsonl and OUT/eval_long.jsonl (the held-out chains of
2-4 and 7-10 terms), and its model defaults to chain_task.CHAIN_SPEC (the size flags override it).
"""

import argparse
import dataclasses
import json

from vapo_megatron.tasks.chain_task import CHAIN_SPEC, MAX_TERMS, MIN_TERMS, write_chain_dir
from vapo_megatron.tasks.demo_task import TASKS, TinyModelSpec, write_demo_dir


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--task", choices=(*TASKS, "chain"), default="add")
    ap.add_argument("--n-train", type=int, default=4000, help="RL prompts")
    ap.add_argument("--n-eval", type=int, default=400, help="held-out prompts")
    ap.add_argument("--n-sft", type=int, default=None, help="warm-start SFT examples (default 800; chain: 2000)")
    ap.add_argument("--sft-noise", type=float, default=0.0,
                    help="fraction of SFT answers from a systematically wrong teacher")
    ap.add_argument("--min-terms", type=int, default=MIN_TERMS, help="chain: fewest terms of a prompt")
    ap.add_argument("--max-terms", type=int, default=MAX_TERMS, help="chain: most terms of a prompt")
    ap.add_argument("--hidden-size", type=int, default=None, help="default: 64")
    ap.add_argument("--num-layers", type=int, default=None, help="default: 2 (chain: 3)")
    ap.add_argument("--num-heads", type=int, default=None, help="default: 4")
    ap.add_argument("--num-kv-heads", type=int, default=None, help="default: 2")
    ap.add_argument("--ffn-size", type=int, default=None, help="default: 256")
    args = ap.parse_args(argv)
    if args.n_sft is None:
        args.n_sft = 2000 if args.task == "chain" else 800
    base = CHAIN_SPEC if args.task == "chain" else TinyModelSpec()
    sizes = {"hidden_size": args.hidden_size, "num_layers": args.num_layers, "num_attention_heads": args.num_heads,
             "num_key_value_heads": args.num_kv_heads, "intermediate_size": args.ffn_size}
    spec = dataclasses.replace(base, **{k: v for k, v in sizes.items() if v is not None})
    if args.task == "chain":
        if args.sft_noise:
            ap.error("--sft-noise: the chain task has no wrong teacher")
        paths = write_chain_dir(args.out, seed=args.seed, n_train=args.n_train, n_eval=args.n_eval, n_sft=args.n_sft,
                                spec=spec, min_terms=args.min_terms, max_terms=args.max_terms)
    else:
        paths = write_demo_dir(
            args.out, seed=args.seed, task=args.task, n_train=args.n_train, n_eval=args.n_eval,
            n_sft=args.n_sft, sft_noise=args.sft_noise, spec=spec,
        )
    print(json.dumps(paths, indent=1))


if __name__ == "__main__":
    main()
