"""The demo's synthetic task, its character-level tokenizer and a tiny random-init Qwen2.

Task (default ``add``): two-digit addition. The user turn is ``"37+45="``; the assistant answers the plain
number ``"82"`` and ends its turn. Answers are checked exactly (``rewards.exact``), so the
reward is binary and cannot be gamed by formatting.

Why this task: a tiny model gets part of it right after a short SFT (the last digit is easy,
the carry into the tens digit is not), and sampled responses then contain enough correct
answers per group for binary-reward RL to sharpen it. SFT generalizes in a sharp, init-
dependent transition, so the warm-start should stop on an accuracy target, not a step count
(docs/data_and_rewards.md has the measured numbers).

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


TASKS = ("add", "reverse")


def _add_problem(a: int, b: int) -> tuple[str, str, str]:
    """(prompt, answer, the answer of a teacher that forgets every carry)."""
    no_carry = "".join(str((int(x) + int(y)) % 10) for x, y in zip(f"{a:02d}", f"{b:02d}")).lstrip("0") or "0"
    return f"{a}+{b}=", str(a + b), no_carry


def _reverse_problem(word: str) -> tuple[str, str, str]:
    """(prompt, answer, the answer of a teacher that copies instead of reversing)."""
    return f"reverse {word}", word[::-1], word


def _problems(task: str, rng: random.Random, n: int) -> list[tuple[str, str, str]]:
    if task == "add":
        pairs = [(a, b) for a in range(100) for b in range(100)]
        rng.shuffle(pairs)
        if n > len(pairs):
            raise ValueError(f"task 'add' has {len(pairs)} distinct problems, {n} requested")
        return [_add_problem(a, b) for a, b in pairs[:n]]
    if task == "reverse":
        seen: set[str] = set()
        out = []
        letters = "abcdefghijklmnopqrstuvwxyz"
        while len(out) < n:
            w = "".join(rng.choice(letters) for _ in range(rng.randint(3, 6)))
            if w not in seen and w != w[::-1]:  # palindromes would make both teachers right
                seen.add(w)
                out.append(_reverse_problem(w))
        return out
    raise ValueError(f"unknown task {task!r}; expected one of {TASKS}")


def make_splits(
    seed: int, n_train: int, n_eval: int, n_sft: int, *, task: str = "add", sft_noise: float = 0.0
) -> dict[str, list[Example]]:
    """Disjoint train (RL prompts), eval (held-out) and sft sets, deterministic in ``seed``.

    ``sft_noise``: the fraction of SFT answers taken from a systematically wrong teacher
    (add: carries forgotten; reverse: the word copied). The eval and train answers are
    always correct; RL has to undo the teacher's habit.
    """
    if not 0.0 <= sft_noise <= 1.0:
        raise ValueError(f"sft_noise must be in [0, 1], got {sft_noise}")
    rng = random.Random(seed)
    probs = _problems(task, rng, n_train + n_eval + n_sft)
    ev, sft, train = probs[:n_eval], probs[n_eval : n_eval + n_sft], probs[n_eval + n_sft :]
    sft_ex = [Example(p, wrong if rng.random() < sft_noise else ans) for p, ans, wrong in sft]
    return {
        "train": [Example(p, a) for p, a, _ in train],
        "eval": [Example(p, a) for p, a, _ in ev],
        "sft": sft_ex,
    }


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

    # Rounded up to a multiple of 64 so the embedding splits evenly under tensor parallelism
    # (the extra rows are never produced by the tokenizer), like Qwen's own padded vocab.
    vocab_size = -(-len(tokenizer) // 64) * 64
    cfg = Qwen2Config(
        vocab_size=vocab_size,
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


def write_task_files(out_dir: str, splits: dict, spec: "TinyModelSpec", seed: int):
    """A synthetic task's files: one {name}.jsonl per split, tokenizer/, and model/ (the tiny
    random-init Qwen2 with the tokenizer beside it). Returns (paths, tokenizer, model)."""
    os.makedirs(out_dir, exist_ok=True)
    paths = {}
    for name, examples in splits.items():
        paths[name] = os.path.join(out_dir, f"{name}.jsonl")
        write_jsonl(paths[name], examples)
    tok = build_tokenizer()
    paths["tokenizer"] = os.path.join(out_dir, "tokenizer")
    save_tokenizer(tok, paths["tokenizer"])
    model = build_tiny_qwen2(tok, spec, seed)
    paths["model"] = os.path.join(out_dir, "model")
    model.save_pretrained(paths["model"])
    save_tokenizer(tok, paths["model"])
    return paths, tok, model


def write_demo_dir(
    out_dir: str,
    *,
    seed: int,
    task: str,
    n_train: int,
    n_eval: int,
    n_sft: int,
    sft_noise: float,
    spec: TinyModelSpec,
) -> dict[str, str]:
    """Write train/eval/sft JSONL, the tokenizer and a random-init Qwen2 model dir.

    Layout: ``out_dir/{train,eval,sft}.jsonl`` (simple schema), ``out_dir/tokenizer/``,
    ``out_dir/model/`` (config.json + model.safetensors + the tokenizer files, so the model
    dir alone is loadable with AutoTokenizer/AutoModelForCausalLM), ``out_dir/meta.json``.
    Deterministic in ``seed``. Returns the paths written.
    """
    splits = make_splits(seed, n_train, n_eval, n_sft, task=task, sft_noise=sft_noise)
    paths, tok, model = write_task_files(out_dir, splits, spec, seed)
    meta = {
        "seed": seed, "task": task, "n_train": n_train, "n_eval": n_eval, "n_sft": n_sft, "sft_noise": sft_noise,
        "model": spec.__dict__, "num_parameters": sum(p.numel() for p in model.parameters()),
        "reward": "exact", "max_new_tokens": 8,
    }
    paths["meta"] = os.path.join(out_dir, "meta.json")
    with open(paths["meta"], "w") as f:
        json.dump(meta, f, indent=1)
    return paths
