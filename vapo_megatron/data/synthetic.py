"""The demo's synthetic task, its character-level tokenizer and a tiny random-init Qwen2.

Task: two-digit addition. The user turn is ``"37+45="``; the assistant answers the plain
number ``"82"`` and ends its turn. Answers are checked exactly (``rewards.exact``), so the
reward is binary and cannot be gamed by formatting.

Why this task: a tiny model gets part of it right after a short SFT (the last digit is easy,
the carry into the tens digit is not), and sampled responses then contain enough correct
answers per group for binary-reward RL to sharpen it (scripts/make_demo_data.py documents
the measured before/after numbers).

The tokenizer is a ``tokenizers`` WordLevel model: every character is a token, except the
chat-template words (``user``, ``assistant``, ``system``) and the special tokens, which are
single tokens so a prompt stays ~13 tokens long.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
WORDS = ["system", "user", "assistant"]
CHARS = list("0123456789+-*=%()<>,.:? \n") + list("abcdefghijklmnopqrstuvwxyz") + ["\\", "{", "}"]

# Qwen-style chat template, minimal: no default system prompt, no tools.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def build_tokenizer():
    """Character-level tokenizer with chat words as single tokens; returns PreTrainedTokenizerFast."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab_list = SPECIAL_TOKENS + WORDS + CHARS
    vocab = {tok: i for i, tok in enumerate(vocab_list)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|endoftext|>"))
    # Split into the chat words, else single characters (newline included).
    pattern = Regex("|".join(WORDS) + r"|[\s\S]")
    tok.pre_tokenizer = pre_tokenizers.Split(pattern, behavior="isolated")
    tok.decoder = decoders.Fuse()  # concatenate tokens back without separators
    tok.add_special_tokens(SPECIAL_TOKENS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|pad|>",
        unk_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", "<|endoftext|>"],
        clean_up_tokenization_spaces=False,
        model_max_length=4096,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


@dataclass(frozen=True)
class Example:
    prompt: str
    answer: str


def addition_example(rng: random.Random, max_operand: int = 99) -> Example:
    """``"a+b="`` -> ``"a+b"``; operands uniform in [0, max_operand], written without padding."""
    a = rng.randint(0, max_operand)
    b = rng.randint(0, max_operand)
    return Example(prompt=f"{a}+{b}=", answer=str(a + b))


def make_splits(seed: int, n_train: int, n_eval: int, n_sft: int, max_operand: int = 99) -> dict[str, list[Example]]:
    """Disjoint train (RL prompts), eval (held-out) and sft sets, deterministic in ``seed``.

    Eval problems never appear in train or sft (held-out by (a, b) pair).
    """
    n_total = (max_operand + 1) ** 2
    if n_train + n_eval + n_sft > n_total:
        raise ValueError(f"n_train+n_eval+n_sft={n_train + n_eval + n_sft} exceeds the {n_total} distinct problems")
    rng = random.Random(seed)
    pairs = [(a, b) for a in range(max_operand + 1) for b in range(max_operand + 1)]
    rng.shuffle(pairs)
    eval_pairs = pairs[:n_eval]
    sft_pairs = pairs[n_eval : n_eval + n_sft]
    train_pairs = pairs[n_eval + n_sft : n_eval + n_sft + n_train]

    def ex(p: tuple[int, int]) -> Example:
        return Example(prompt=f"{p[0]}+{p[1]}=", answer=str(p[0] + p[1]))

    return {"train": [ex(p) for p in train_pairs], "eval": [ex(p) for p in eval_pairs], "sft": [ex(p) for p in sft_pairs]}


def write_jsonl(path: str, examples: list[Example]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for e in examples:
            f.write(json.dumps({"prompt": e.prompt, "answer": e.answer}) + "\n")


@dataclass(frozen=True)
class TinyModelSpec:
    hidden_size: int = 64
    num_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    intermediate_size: int = 256
    max_position_embeddings: int = 128


def build_tiny_qwen2(tokenizer, spec: TinyModelSpec, seed: int):
    """Random-init Qwen2ForCausalLM sized for ``tokenizer`` (tied embeddings, float32)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=True,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg)
    return model


def save_tokenizer(tokenizer, out_dir: str) -> None:
    os.makedirs(out_dir, exist_ok=True)
    tokenizer.save_pretrained(out_dir)
