"""Bad prompt data (issue 7, part 2): a fuzz corpus of bad rows and bad files, generated here.

Every bad row is either skipped, counted under its reason and logged with ``file:line`` and the
field, or (for a damaged file) loading stops with PromptDataError naming the file and rows. A
file with no usable row stops loading with an error that names it. Nothing else escapes
``load_prompts``: no RecursionError, UnicodeDecodeError, KeyError, ...
"""

from __future__ import annotations

import json
import logging
import os
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.helpers.hostile import DAPO_BAD_ROWS, MAX_TOKENS, SIMPLE_BAD_ROWS
from tests.helpers.hostile import j as _j
from vapo_megatron.data.prompts import PromptDataError, load_prompts
from vapo_megatron.tasks.demo_task import build_tokenizer, save_tokenizer

GOOD = json.dumps({"prompt": "1+2=", "answer": "3"})
GOOD_DAPO = json.dumps({"prompt": [{"role": "user", "content": "2+2?"}], "reward_model": {"ground_truth": "4"}})


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from transformers import AutoTokenizer

    d = tmp_path_factory.mktemp("tok")
    save_tokenizer(build_tokenizer(), str(d))
    return AutoTokenizer.from_pretrained(str(d))



ALL_BAD_ROWS = [(k, line, r, w, GOOD) for k, line, r, w in SIMPLE_BAD_ROWS] + [
    (k, line, r, w, GOOD_DAPO) for k, line, r, w in DAPO_BAD_ROWS
]


def _write(path, lines: list[bytes | str]) -> str:
    with open(path, "wb") as f:
        for line in lines:
            f.write((line.encode() if isinstance(line, str) else line) + b"\n")
    return str(path)


def _load(paths, tok, **kw):
    return load_prompts(list(paths), tok, max_prompt_tokens=MAX_TOKENS, apply_chat_template=True, **kw)


def test_corpus_has_at_least_20_kinds():
    kinds = [k for k, *_ in ALL_BAD_ROWS] + [k for k, *_ in BAD_FILES]
    assert len(kinds) == len(set(kinds)) and len(kinds) >= 20, len(kinds)


@pytest.mark.parametrize("kind,line,reason,word,good", ALL_BAD_ROWS, ids=[k for k, *_ in ALL_BAD_ROWS])
def test_each_bad_row_is_skipped_counted_and_logged_with_file_line_and_field(kind, line, reason, word,
                                                                             good, tmp_path, tok, caplog):
    # The good row first fixes the file's schema; the bad row sits on line 2, another good row on 3.
    p = _write(tmp_path / f"{kind}.jsonl", [good, line, good])
    with caplog.at_level(logging.WARNING, logger="vapo_megatron.data.prompts"):
        recs, stats = _load([p], tok)
    assert [r.source for r in recs] == [f"{p}:1", f"{p}:3"]
    assert dict(stats.skipped) == {reason: 1}
    logged = [r.getMessage() for r in caplog.records if f"{p}:2:" in r.getMessage()]
    assert len(logged) == 1 and word in logged[0], logged


@pytest.mark.parametrize("kind,line,reason,word,good", ALL_BAD_ROWS, ids=[k for k, *_ in ALL_BAD_ROWS])
def test_a_file_of_only_that_bad_row_stops_loading_naming_the_file(kind, line, reason, word, good, tmp_path, tok):
    p = _write(tmp_path / f"only_{kind}.jsonl", [line, line])
    with pytest.raises(PromptDataError) as e:
        _load([p], tok)
    msg = str(e.value)
    assert msg.startswith(p + ":"), msg
    # The counted reason (alone, the row may read under the other schema, so another reason), or,
    # when no row shows either schema's key, the schema error.
    assert re.search(r"no usable prompt in 2 rows \(\w+=2\)", msg) or "cannot detect the schema" in msg, msg


def test_mixed_corpus_counts_every_reason_and_summarizes_long_runs(tmp_path, tok, caplog):
    lines = [GOOD] + [line for _, line, *_ in SIMPLE_BAD_ROWS] * 2 + [GOOD]
    p = _write(tmp_path / "mixed.jsonl", lines)
    with caplog.at_level(logging.WARNING, logger="vapo_megatron.data.prompts"):
        recs, stats = _load([p], tok)
    assert [r.source for r in recs] == [f"{p}:1", f"{p}:{len(lines)}"]
    want: dict[str, int] = {}
    for _, _, reason, _ in SIMPLE_BAD_ROWS:
        want[reason] = want.get(reason, 0) + 2
    assert dict(stats.skipped) == want
    # More than 10 rows of one reason: the first 10 one by one, then one summary line.
    assert want["wrong_type"] > 10
    one_by_one = [r for r in caplog.records
                  if r.getMessage().startswith(f"skipping {p}:") and "must be" in r.getMessage()]
    assert len(one_by_one) == 10
    assert f"{p}: {want['wrong_type']} rows skipped as wrong_type (first 10 logged)" in caplog.text


def test_rows_that_look_odd_but_are_valid_are_kept(tmp_path, tok):
    p = tmp_path / "odd_ok.jsonl"
    p.write_bytes(
        b"\xef\xbb\xbf" + GOOD.encode() + b"\r\n"                                        # BOM + CRLF
        + _j({"prompt": "1+2=", "answer": "3", "extra": {"x": [1, 2]}}) + b"\n"           # unknown fields
        + _j({"prompt": "1+2=", "answer": 3}) + b"\n"                                     # integer answer
        + b"\n   \n"                                                                       # blank lines
        # RTL mark, NUL, emoji, Arabic digit
        + _j({"prompt": "\u202e\u0000\u00e9\U0001f600 1+2=", "answer": "\u0663"}) + b"\n"
    )
    recs, stats = _load([str(p)], tok)
    assert [r.answer for r in recs] == ["3", "3", "3", "\u0663"] and not stats.skipped
    assert [r.source for r in recs] == [f"{p}:1", f"{p}:2", f"{p}:3", f"{p}:6"]


def test_schema_is_detected_from_the_first_row_that_shows_it(tmp_path, tok):
    # A first row that shows neither schema is skipped like any other, not fatal for the file.
    p = _write(tmp_path / "late.jsonl", [_j({"prompt": "1+1="}), "{oops", GOOD_DAPO])
    recs, stats = _load([p], tok)
    assert [r.source for r in recs] == [f"{p}:3"] and dict(stats.skipped) == {"missing_field": 1, "invalid_json": 1}


# ---- whole files -----------------------------------------------------------------------------

def _parquet_rows(n: int) -> list[dict]:
    return [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(n)]


def _truncated(path):
    pq.write_table(pa.Table.from_pylist(_parquet_rows(50)), path)
    data = open(path, "rb").read()
    open(path, "wb").write(data[: len(data) // 2])


def _not_parquet(path):
    open(path, "wb").write(b"PAR1 this is not a parquet file at all\n" * 10)


def _zero_bytes(path):
    open(path, "wb").close()


def _bad_row_group(path):
    # Three row groups of 100 rows; the middle one's column data overwritten with junk.
    pq.write_table(pa.Table.from_pylist(_parquet_rows(300)), path, row_group_size=100, compression="NONE")
    md = pq.ParquetFile(path).metadata.row_group(1)
    data = bytearray(open(path, "rb").read())
    for c in range(md.num_columns):
        col = md.column(c)
        start = col.dictionary_page_offset or col.data_page_offset
        data[start : start + col.total_compressed_size] = b"\xa5" * col.total_compressed_size
    open(path, "wb").write(bytes(data))


def _directory(path):
    os.mkdir(path)


def _empty_jsonl(path):
    open(path, "wb").write(b"\n\n  \n")


def _binary_as_jsonl(path):
    pq.write_table(pa.Table.from_pylist(_parquet_rows(20)), path)  # a Parquet file named .jsonl


# (kind, file name, writer, regex the error must match; {p} is the path)
BAD_FILES = [
    ("truncated_parquet", "t.parquet", _truncated, r"{p}: cannot read Parquet file"),
    ("not_parquet", "n.parquet", _not_parquet, r"{p}: cannot read Parquet file"),
    ("zero_byte_parquet", "z.parquet", _zero_bytes, r"{p}: cannot read Parquet file"),
    ("corrupt_row_group", "g.parquet", _bad_row_group, r"{p}: cannot read Parquet rows 101-200 \(row group 1\)"),
    ("directory", "d.jsonl", _directory, r"{p}: not a file"),
    ("missing_file", "gone.jsonl", None, r"prompt file not found: {p}"),
    ("unknown_extension", "x.csv", _empty_jsonl, r"{p}: unknown prompt file type"),
    ("blank_jsonl", "b.jsonl", _empty_jsonl, r"{p}: the file has no rows$"),  # nothing "logged above"
    ("parquet_named_jsonl", "pq.jsonl", _binary_as_jsonl, r"{p}: no usable prompt in \d+ rows \(.*non_utf8="),
]


@pytest.mark.parametrize("kind,name,writer,pattern", BAD_FILES, ids=[k for k, *_ in BAD_FILES])
def test_bad_files_stop_loading_with_the_file_named(kind, name, writer, pattern, tmp_path, tok):
    good = _write(tmp_path / "good.jsonl", [GOOD])
    p = str(tmp_path / name)
    if writer is not None:
        writer(p)
    with pytest.raises(PromptDataError, match=pattern.format(p=re.escape(p))):
        _load([good, p], tok)


def test_unreadable_file_is_named(tmp_path, tok):
    if os.geteuid() == 0:
        pytest.skip("root reads files whatever their mode")
    p = _write(tmp_path / "secret.jsonl", [GOOD])
    os.chmod(p, 0)
    with pytest.raises(PromptDataError, match=f"{p}: cannot open"):
        _load([p], tok)


def test_parquet_bad_rows_are_skipped_with_global_row_numbers(tmp_path, tok, caplog):
    rows = _parquet_rows(250)
    rows[7]["answer"] = None                       # null answer, row group 0
    rows[120]["prompt"] = ""                       # empty prompt, row group 1
    p = str(tmp_path / "rows.parquet")
    pq.write_table(pa.Table.from_pylist(rows), p, row_group_size=100)
    # A third file whose 'prompt' column is not valid UTF-8 in one row (pyarrow writes it as is).
    bad_utf8 = str(tmp_path / "utf8.parquet")
    prompts = pa.array([b"1+1=", b"\xff\xfe", b"2+2="], type=pa.binary()).view(pa.string())
    pq.write_table(pa.table({"prompt": prompts, "answer": ["2", "x", "4"]}), bad_utf8)
    wrong_type = str(tmp_path / "ints.parquet")
    pq.write_table(pa.table({"prompt": [1, 2], "answer": ["1", "2"]}), wrong_type)
    with caplog.at_level(logging.WARNING, logger="vapo_megatron.data.prompts"):
        recs, stats = _load([p, bad_utf8], tok)
    assert len(recs) == 248 + 2 and dict(stats.skipped) == {"null_answer": 1, "empty_prompt": 1, "non_utf8": 1}
    assert f"{p}:8: 'answer' is null" in caplog.text
    assert f"{p}:121: 'prompt' is empty" in caplog.text
    assert f"{bad_utf8}:2: column 'prompt' cannot be decoded" in caplog.text
    with pytest.raises(PromptDataError, match=f"{wrong_type}: no usable prompt in 2 rows \\(wrong_type=2\\)"):
        _load([wrong_type], tok)
