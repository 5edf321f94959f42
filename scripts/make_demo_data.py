"""Write the demo's data, tokenizer and tiny random-init Qwen2 model (deterministic by seed).

    python scripts/make_demo_data.py --out runs/demo/data

Writes OUT/{train,eval,sft}.jsonl ({"prompt", "answer"}), OUT/tokenizer/, OUT/model/
(HF Qwen2ForCausalLM: config.json + model.safetensors + tokenizer) and OUT/meta.json.
The reward for this task is exact match ("exact" in vapo_megatron.rewards).
"""

import argparse
import json

from vapo_megatron.testing.demo_task import TASKS, TinyModelSpec, write_demo_dir


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--task", choices=TASKS, default="add")
    ap.add_argument("--n-train", type=int, default=4000, help="RL prompts")
    ap.add_argument("--n-eval", type=int, default=400, help="held-out prompts")
    ap.add_argument("--n-sft", type=int, default=800, help="warm-start SFT examples")
    ap.add_argument("--sft-noise", type=float, default=0.0, help="fraction of SFT answers from a systematically wrong teacher")
    ap.add_argument("--hidden-size", type=int, default=64)
    ap.add_argument("--num-layers", type=int, default=2)
    ap.add_argument("--num-heads", type=int, default=4)
    ap.add_argument("--num-kv-heads", type=int, default=2)
    ap.add_argument("--ffn-size", type=int, default=256)
    args = ap.parse_args()
    spec = TinyModelSpec(
        hidden_size=args.hidden_size, num_layers=args.num_layers, num_attention_heads=args.num_heads,
        num_key_value_heads=args.num_kv_heads, intermediate_size=args.ffn_size,
    )
    paths = write_demo_dir(
        args.out, seed=args.seed, task=args.task, n_train=args.n_train, n_eval=args.n_eval,
        n_sft=args.n_sft, sft_noise=args.sft_noise, spec=spec,
    )
    print(json.dumps(paths, indent=1))


if __name__ == "__main__":
    main()
