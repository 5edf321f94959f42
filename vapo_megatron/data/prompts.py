"""Prompt data: JSONL/Parquet readers for two schemas, tokenization, and a resumable sampler.

Schemas (per file, the first row that has ``answer`` or ``reward_model`` decides; or forced
with ``schema``):
- ``simple``: ``{"prompt": str, "answer": str}``.
- ``dapo`` (DAPO-Math-17k): ``{"prompt": [{"role": str, "content": str}, ...],
  "reward_model": {"ground_truth": str, ...}, "data_source"?, "ability"?, "extra_info"?}``.

Bad rows are skipped, counted by reason and logged with ``file:line`` and the field (1-based
line for JSONL, 1-based row for Parquet); a run never dies on row 12,345. What stops loading,
with a PromptDataError naming the file (and the rows, for a damaged Parquet row group): a
missing or unreadable file, an unknown file type, a file in which no row shows either schema,
and a file from which no row survives (the suite holds a fuzz corpus of each).
"""

from __future__ import annotations

import json
import logging
import os
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterator

import numpy as np

logger = logging.getLogger(__name__)

SCHEMAS = ("auto", "simple", "dapo")
# Per file and reason, log this many rows one by one, then only a summary line.
_LOG_ROWS_PER_REASON = 10
# A ground truth longer than this is not an answer (every sample would send it to the verifier).
MAX_ANSWER_CHARS = 65536


class PromptDataError(ValueError):
    """A prompt file is missing, unreadable, of unknown schema, or has no usable row."""


@dataclass(frozen=True)
class PromptRecord:
    prompt_ids: list[int]  # token ids fed to the policy (chat template applied when asked)
    answer: str  # ground truth for the verifier
    source: str  # "path:line" (JSONL) or "path:row" (Parquet), 1-based
    prompt_text: str  # the rendered prompt string (what user reward functions receive)


@dataclass
class LoadStats:
    loaded: int = 0
    skipped: Counter = field(default_factory=Counter)  # reason -> count, over all files
    per_file: dict[str, int] = field(default_factory=dict)  # path -> records loaded


class _BadRow(Exception):
    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


def _iter_jsonl(path: str) -> Iterator[tuple[int, Any]]:
    """Yields (line_no, parsed object or _BadRow) for each non-blank line."""
    try:
        f = open(path, "rb")
    except OSError as e:
        raise PromptDataError(f"{path}: cannot open: {e.strerror or e}") from e
    with f:
        for line_no, raw in enumerate(f, start=1):
            if line_no == 1 and raw.startswith(b"\xef\xbb\xbf"):
                raw = raw[3:]  # a UTF-8 byte-order mark (some editors write one): not part of the row
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield line_no, _BadRow("non_utf8", f"line is not valid UTF-8 ({e.reason} at byte {e.start})")
                continue
            if not text.strip():
                continue
            try:
                yield line_no, json.loads(text)
            except json.JSONDecodeError as e:
                yield line_no, _BadRow("invalid_json", f"invalid JSON: {e.msg} (column {e.colno})")
            except RecursionError:  # json's C parser recurses once per nesting level
                yield line_no, _BadRow("invalid_json", "invalid JSON: nested too deeply")
            except ValueError as e:  # e.g. an integer literal over Python's 4300-digit limit
                yield line_no, _BadRow("invalid_json", f"invalid JSON: {str(e)[:120]}")


def _iter_parquet(path: str) -> Iterator[tuple[int, Any]]:
    """Yields (row index from 0, row dict or _BadRow), one row group at a time (bounded memory).
    A row group that cannot be decoded stops loading with the rows it covers named: silently
    dropping thousands of rows of a damaged file would change the data set unnoticed."""
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises several types for corrupt files
        raise PromptDataError(f"{path}: cannot read Parquet file: {type(e).__name__}: {e}") from e
    start = 0
    for g in range(pf.metadata.num_row_groups):
        n = pf.metadata.row_group(g).num_rows
        try:
            table = pf.read_row_group(g)
        except Exception as e:
            raise PromptDataError(
                f"{path}: cannot read Parquet rows {start + 1}-{start + n} (row group {g}): {type(e).__name__}: {e}"
            ) from e
        # Column-wise to Python, row by row, so one undecodable value only costs its row.
        cols = {name: table.column(name) for name in table.schema.names}
        for k in range(table.num_rows):
            row: dict[str, Any] = {}
            try:
                for name, col in cols.items():
                    row[name] = col[k].as_py()
            except (UnicodeDecodeError, ValueError) as e:
                yield start + k, _BadRow("non_utf8", f"column {name!r} cannot be decoded: {e}")
                continue
            yield start + k, row
        start += n


def _detect_schema(row: Any) -> str | None:
    """The schema a row is written in, or None when it shows neither schema's key."""
    if isinstance(row, dict):
        if "reward_model" in row:
            return "dapo"
        if "answer" in row:
            return "simple"
    return None


def _check_text(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise _BadRow("wrong_type", f"{what} must be a string, got {type(value).__name__}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:  # lone surrogates from JSON escapes like "\ud800"
        raise _BadRow("non_utf8", f"{what} contains text that is not valid UTF-8 (lone surrogate)") from None
    return value


def _answer(value: Any, what: str) -> str:
    if value is None:
        raise _BadRow("null_answer", f"{what} is null")
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)  # {"answer": 42} is unambiguous; floats are not accepted
    text = _check_text(value, what)
    if not text.strip():
        raise _BadRow("null_answer", f"{what} is empty")
    if len(text) > MAX_ANSWER_CHARS:
        raise _BadRow("too_long", f"{what} has {len(text)} characters (at most {MAX_ANSWER_CHARS})")
    return text


def _parse_row(row: Any, schema: str) -> tuple[list[dict[str, str]] | str, str]:
    """Returns (messages list or plain prompt string, answer) or raises _BadRow."""
    if not isinstance(row, dict):
        raise _BadRow("wrong_type", f"row must be a JSON object, got {type(row).__name__}")
    if "prompt" not in row:
        raise _BadRow("missing_field", "missing field 'prompt'")
    if schema == "simple":
        if "answer" not in row:
            raise _BadRow("missing_field", "missing field 'answer'")
        if isinstance(row["prompt"], list):
            raise _BadRow("wrong_type", "'prompt' must be a string, got list (chat-message lists need the dapo "
                          "schema, with the answer in 'reward_model.ground_truth')")
        prompt = _check_text(row["prompt"], "'prompt'")
        if not prompt.strip():
            raise _BadRow("empty_prompt", "'prompt' is empty")
        return prompt, _answer(row["answer"], "'answer'")
    # dapo
    if "reward_model" not in row:
        raise _BadRow("missing_field", "missing field 'reward_model'")
    rm = row["reward_model"]
    if not isinstance(rm, dict):
        raise _BadRow("wrong_type", f"'reward_model' must be an object, got {type(rm).__name__}")
    if "ground_truth" not in rm:
        raise _BadRow("missing_field", "missing field 'reward_model.ground_truth'")
    answer = _answer(rm["ground_truth"], "'reward_model.ground_truth'")
    msgs = row["prompt"]
    if not isinstance(msgs, list):
        raise _BadRow("wrong_type", f"'prompt' must be a list of chat messages, got {type(msgs).__name__}")
    if not msgs:
        raise _BadRow("empty_prompt", "'prompt' has no messages")
    out = []
    for j, m in enumerate(msgs):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise _BadRow("wrong_type", f"'prompt[{j}]' must be an object with 'role' and 'content'")
        out.append({"role": _check_text(m["role"], f"'prompt[{j}].role'"),
                    "content": _check_text(m["content"], f"'prompt[{j}].content'")})
    if not any(m["content"].strip() for m in out):
        raise _BadRow("empty_prompt", "every message in 'prompt' is empty")
    return out, answer


def render_prompt(prompt: list[dict[str, str]] | str, tokenizer, apply_chat_template: bool) -> str:
    """The text the policy sees. The chat template (with the generation prompt) is used when
    asked for and the tokenizer has one; otherwise message contents are joined by newlines."""
    if apply_chat_template and getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    if isinstance(prompt, str):
        return prompt
    return "\n".join(m["content"] for m in prompt)


def _max_chars_per_token(tokenizer) -> int:
    """The longest vocabulary entry, in characters. A token never covers more characters of
    text than its own string has (byte-level BPE: one char per byte; SentencePiece: '▁' per
    space), so a text longer than ``max_prompt_tokens * this`` cannot fit and need not be
    tokenized: a multi-megabyte row costs a length check, not a tokenizer pass."""
    try:
        vocab = tokenizer.get_vocab()
    except (AttributeError, NotImplementedError):
        return 1 << 30  # unknown: never pre-reject
    return max((len(t) for t in vocab), default=1 << 30) or 1


def load_prompts(
    paths: list[str],
    tokenizer,
    *,
    max_prompt_tokens: int,
    apply_chat_template: bool,
    schema: str = "auto",
    schema_key: str = "data.schema",
) -> tuple[list[PromptRecord], LoadStats]:
    """Read, validate and tokenize prompt files (``.jsonl``/``.json`` lines or ``.parquet``).

    Rows with more than ``max_prompt_tokens`` prompt tokens are skipped (reason ``too_long``).
    Skip reasons: invalid_json, non_utf8, wrong_type, missing_field, null_answer, empty_prompt,
    too_long. Raises PromptDataError for a missing/unreadable file, a file in which no row
    shows a known schema (naming `schema_key`, the setting or flag that gives it), or a file
    from which no record survives.
    """
    if schema not in SCHEMAS:
        raise PromptDataError(f"schema must be one of {SCHEMAS}, got {schema!r}")
    if max_prompt_tokens < 1:
        raise PromptDataError(f"max_prompt_tokens must be >= 1, got {max_prompt_tokens}")
    if apply_chat_template and not getattr(tokenizer, "chat_template", None):
        logger.warning("apply_chat_template=True but the tokenizer has no chat template: "
                       "prompts are used as plain text")
    max_chars = max_prompt_tokens * _max_chars_per_token(tokenizer)
    stats = LoadStats()
    records: list[PromptRecord] = []
    for path in paths:
        if not os.path.exists(path):
            raise PromptDataError(f"prompt file not found: {path}")
        if not os.path.isfile(path):
            raise PromptDataError(f"{path}: not a file (give prompt files, not directories)")
        if path.endswith(".parquet"):
            rows, base = _iter_parquet(path), 1
        elif path.endswith((".jsonl", ".json")):
            rows, base = _iter_jsonl(path), 0
        else:
            raise PromptDataError(f"{path}: unknown prompt file type (expected .jsonl, .json or .parquet)")
        file_schema = None if schema == "auto" else schema
        file_skips: Counter = Counter()
        n_rows = 0
        n_loaded = 0
        first_keys: Any = None  # what the first row held, for the "no schema" error

        def skip(where: str, bad: _BadRow) -> None:
            file_skips[bad.reason] += 1
            if file_skips[bad.reason] <= _LOG_ROWS_PER_REASON:
                logger.warning("skipping %s: %s", where, bad.detail)

        pending: list[tuple[str, str, str]] = []  # (where, rendered text, answer)

        def flush() -> None:
            # Tokenize in chunks: fast tokenizers batch in Rust, ~10x quicker than row by row.
            nonlocal n_loaded
            if not pending:
                return
            encoded = tokenizer([t for _, t, _ in pending], add_special_tokens=False)["input_ids"]
            for (where, text, answer), ids in zip(pending, encoded):
                if len(ids) > max_prompt_tokens:
                    skip(where, _BadRow("too_long",
                                        f"prompt has {len(ids)} tokens > max_prompt_tokens={max_prompt_tokens}"))
                    continue
                if not ids:  # e.g. plain text the tokenizer drops entirely: nothing to condition on
                    skip(where, _BadRow("empty_prompt", "prompt encodes to 0 tokens"))
                    continue
                records.append(PromptRecord(prompt_ids=list(ids), answer=answer, source=where, prompt_text=text))
                n_loaded += 1
            pending.clear()

        for idx, row in rows:
            n_rows += 1
            where = f"{path}:{idx + base}"
            try:
                if isinstance(row, _BadRow):
                    raise row
                if first_keys is None and isinstance(row, dict):
                    first_keys = sorted(row)
                if file_schema is None:
                    # Auto: the first row that shows a schema's key decides it for the file;
                    # rows before it that show neither are skipped like any other bad row.
                    file_schema = _detect_schema(row)
                    if file_schema is None:
                        if not isinstance(row, dict):
                            raise _BadRow("wrong_type", f"row must be a JSON object, got {type(row).__name__}")
                        raise _BadRow("missing_field",
                                      "missing field 'answer' (simple schema) or 'reward_model' (dapo schema)")
                prompt, answer = _parse_row(row, file_schema)
                text = render_prompt(prompt, tokenizer, apply_chat_template)
                if len(text) > max_chars:
                    raise _BadRow("too_long", f"prompt has {len(text)} characters: "
                                              f"more than max_prompt_tokens={max_prompt_tokens} tokens")
            except _BadRow as bad:
                skip(where, bad)
                continue
            pending.append((where, text, answer))
            if len(pending) == 1024:
                flush()
        flush()
        for reason, n in file_skips.items():
            if n > _LOG_ROWS_PER_REASON:
                logger.warning("%s: %d rows skipped as %s (first %d logged)", path, n, reason, _LOG_ROWS_PER_REASON)
        if file_schema is None and first_keys is not None:
            raise PromptDataError(
                f"{path}: cannot detect the schema: no row has 'answer' (simple) or 'reward_model' (dapo) "
                f"(keys of the first object: {first_keys}); fix the field names or set {schema_key}"
            )
        if n_loaded == 0:
            if n_rows == 0:
                raise PromptDataError(f"{path}: the file has no rows")
            detail = ", ".join(f"{r}={n}" for r, n in sorted(file_skips.items()))
            raise PromptDataError(f"{path}: no usable prompt in {n_rows} rows ({detail}); "
                                  "the first of each kind are logged above")
        stats.skipped.update(file_skips)
        stats.per_file[path] = n_loaded
        stats.loaded += n_loaded
        logger.info("%s: loaded %d prompts (schema %s), skipped %d", path, n_loaded, file_schema,
                    sum(file_skips.values()))
    return records, stats


class PromptSampler:
    """Epoch-shuffled prompt batches, deterministic in ``seed``, resumable exactly.

    Epoch ``e`` visits records in the order ``default_rng([seed, e]).permutation(n)``; batches
    run on across epoch boundaries, so every batch is full. State: (epoch, position).
    """

    def __init__(self, records: list[PromptRecord], batch_size: int, seed: int):
        if not records:
            raise ValueError("PromptSampler needs at least one record")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.records = records
        self.batch_size = batch_size
        self.seed = seed
        self.epoch = 0
        self.position = 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.records))

    def next_batch(self) -> list[PromptRecord]:
        return [self.records[i] for i in self.next_indices()]

    def next_indices(self) -> list[int]:
        """The next batch as rows of `records` (partial rollout stores these)."""
        out: list[int] = []
        while len(out) < self.batch_size:
            if self.position == len(self.records):
                self.epoch += 1
                self.position = 0
                self._order = self._permutation(self.epoch)
            take = min(self.batch_size - len(out), len(self.records) - self.position)
            out.extend(int(i) for i in self._order[self.position : self.position + take])
            self.position += take
        return out

    def __iter__(self) -> Iterator[list[PromptRecord]]:
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "num_records": len(self.records)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state["seed"] != self.seed or state["num_records"] != len(self.records):
            raise ValueError(
                f"sampler state is for seed={state['seed']}, {state['num_records']} records; "
                f"this sampler has seed={self.seed}, {len(self.records)} records"
            )
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self._order = self._permutation(self.epoch)
