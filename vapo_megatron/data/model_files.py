"""A model directory's text side loaded as the commands use it: tokenizer, chat template, generation config.

    loading_problems(hf_dir) -> list[str]   one line per file that does not load, naming it

model_providers/files.py checks, in pure Python, that these files are there and parse as JSON. A
file can parse and still not load: tokenizer.json `{}` (transformers: KeyError 'added_tokens'), a
chat template with a Jinja syntax error, generation_config.json with "max_new_tokens": "lots". They
are small, so every command loads them here once, with transformers' own loaders, before it builds
a model or writes anything: vapo-train after its configuration checks (train.py checked_config),
vapo-eval with its --model (evaluation/offline.py), vapo-convert before it converts, since it copies
them into its output (weights/convert.py).
"""

from __future__ import annotations

from pathlib import Path

from model_providers.files import TOKENIZER_FILES

# Where transformers finds a chat template, in the order it reads them.
TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json", "tokenizer_config.json")


def _reason(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
    return f"{type(e).__name__}: {lines[-1]}" if lines else type(e).__name__


def _tokenizer_file(hf_dir: Path) -> Path:
    """The file to name when the tokenizer does not load: tokenizer.json when the tokenizers library
    itself refuses it, else the tokenizer's configuration."""
    fast = hf_dir / "tokenizer.json"
    if fast.is_file():
        from tokenizers import Tokenizer

        try:
            Tokenizer.from_file(str(fast))
        except Exception:  # noqa: BLE001 - the Rust library raises a bare Exception
            return fast
    config = hf_dir / "tokenizer_config.json"
    return config if config.is_file() else hf_dir


def tokenizer_problems(hf_dir: Path) -> list[str]:
    """The tokenizer as data/datasets.py loads it, and its chat template compiled (a template that
    is not Jinja fails every prompt alike). Its size against the embedding is load_tokenizer's."""
    from jinja2 import TemplateSyntaxError
    from transformers import AutoTokenizer

    from vapo_megatron.data.prompts import render_prompt

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(hf_dir))
    except Exception as e:  # noqa: BLE001 - whatever the file makes the library raise
        return [f"{_tokenizer_file(hf_dir)} does not load as a tokenizer ({_reason(e)})"]
    out = []
    if getattr(tokenizer, "chat_template", None):
        try:
            render_prompt("1 + 1", tokenizer, apply_chat_template=True)
        except TemplateSyntaxError as e:
            where = next((hf_dir / f for f in TEMPLATE_FILES if (hf_dir / f).is_file()), hf_dir)
            out.append(f"{where} holds a chat template that is not valid Jinja (line {e.lineno}: {e.message})")
    return out


def loading_problems(hf_dir: str | Path) -> list[str]:
    """Every tokenizer, chat template and generation config file of `hf_dir` that is there but
    does not load, one line each naming the file; [] when all load."""
    from vapo_megatron.config import package_index

    package_index.install()  # as device_startup does: transformers' import without a stat per installed file
    hf_dir = Path(hf_dir)
    out = []
    if any((hf_dir / f).is_file() for f in TOKENIZER_FILES):
        out += tokenizer_problems(hf_dir)
    generation = hf_dir / "generation_config.json"
    if generation.is_file():
        from transformers import GenerationConfig

        try:
            GenerationConfig.from_pretrained(str(hf_dir))
        except Exception as e:  # noqa: BLE001 - a value of the wrong type fails in its validation
            out.append(f"{generation} is not a valid generation config ({_reason(e)})")
    return out


__all__ = ["TEMPLATE_FILES", "loading_problems", "tokenizer_problems"]
