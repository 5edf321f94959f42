"""Prompt loading (JSONL and Parquet, both schemas, bad rows), the demo tokenizer, the sampler."""

import json
import logging

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from vapo_megatron.data.prompts import PromptDataError, PromptRecord, PromptSampler, load_prompts
from vapo_megatron.tasks.demo_task import build_tokenizer, make_splits, save_tokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    # The demo tokenizer, saved and reloaded through AutoTokenizer like a user's model dir.
    from transformers import AutoTokenizer

    d = tmp_path_factory.mktemp("tok")
    save_tokenizer(build_tokenizer(), str(d))
    return AutoTokenizer.from_pretrained(str(d))


def _template(tok, messages):
    # Independent reference: the template written out by hand (synthetic.CHAT_TEMPLATE's format).
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return text + "<|im_start|>assistant\n"


def test_demo_tokenizer_roundtrip_and_chat_template(tok):
    text = tok.apply_chat_template([{"role": "user", "content": "37+45="}], add_generation_prompt=True, tokenize=False)
    assert text == _template(tok, [{"role": "user", "content": "37+45="}])
    ids = tok(text, add_special_tokens=False)["input_ids"]
    toks = tok.convert_ids_to_tokens(ids)
    assert toks == ["<|im_start|>", "user", "\n", "3", "7", "+", "4", "5", "=", "<|im_end|>", "\n", "<|im_start|>",
                    "assistant", "\n"]
    assert tok.decode(tok("82")["input_ids"] + [tok.eos_token_id], skip_special_tokens=True) == "82"
    assert tok.eos_token == "<|im_end|>" and tok.pad_token_id is not None and tok.pad_token_id != tok.eos_token_id


def _write_jsonl(path, lines):
    with open(path, "wb") as f:
        for line in lines:
            f.write(line if isinstance(line, bytes) else (line + "\n").encode("utf-8"))


def _dapo_row(q, gt):
    return {
        "data_source": "math_dapo",
        "prompt": [{"role": "user", "content": q}],
        "ability": "MATH",
        "reward_model": {"ground_truth": gt, "style": "rule-lm"},
        "extra_info": {"index": "x"},
    }


def test_simple_jsonl_with_every_kind_of_bad_row(tmp_path, tok, caplog):
    p = str(tmp_path / "simple.jsonl")
    _write_jsonl(p, [
        json.dumps({"prompt": "1+2=", "answer": "3"}),                 # 1 ok
        "{not json",                                                   # 2 invalid_json
        json.dumps({"prompt": "1+2="}),                                # 3 missing_field
        json.dumps({"prompt": 5, "answer": "3"}),                      # 4 wrong_type
        json.dumps({"prompt": "1+2=", "answer": None}),                # 5 null_answer
        json.dumps({"prompt": "   ", "answer": "3"}),                  # 6 empty_prompt
        b'{"prompt": "\xff\xfe", "answer": "1"}\n',                    # 7 non_utf8 (bytes)
        '{"prompt": "\\ud800", "answer": "1"}',                        # 8 non_utf8 (lone surrogate)
        json.dumps({"prompt": "9" * 200, "answer": "9"}),              # 9 too_long
        "",                                                            # 10 blank: ignored
        json.dumps({"prompt": "20+22=", "answer": 42}),                # 11 ok (int answer)
        json.dumps(["prompt", "answer"]),                              # 12 wrong_type (not an object)
    ])
    with caplog.at_level(logging.WARNING, logger="vapo_megatron.data.prompts"):
        recs, stats = load_prompts([p], tok, max_prompt_tokens=64, apply_chat_template=True)
    assert [r.source for r in recs] == [f"{p}:1", f"{p}:11"]
    assert [r.answer for r in recs] == ["3", "42"]
    assert recs[0].prompt_text == _template(tok, [{"role": "user", "content": "1+2="}])
    assert recs[0].prompt_ids == tok(recs[0].prompt_text, add_special_tokens=False)["input_ids"]
    assert dict(stats.skipped) == {
        "invalid_json": 1, "missing_field": 1, "wrong_type": 2, "null_answer": 1,
        "empty_prompt": 1, "non_utf8": 2, "too_long": 1,
    }
    assert stats.loaded == 2
    for line in (2, 3, 4, 5, 6, 7, 8, 9, 12):
        assert f"{p}:{line}:" in caplog.text or f"{p}:{line} " in caplog.text, line


def test_dapo_parquet_and_jsonl_and_no_template(tmp_path, tok):
    rows = [_dapo_row("What is 2+2?", "4"), _dapo_row("Half of 1?", "\\frac{1}{2}")]
    bad = _dapo_row("x", "1")
    # Parquet unifies struct fields across rows, so a row without ground_truth reads as null.
    bad["reward_model"] = {"style": "rule"}
    pq_path = str(tmp_path / "dapo.parquet")
    pq.write_table(pa.Table.from_pylist(rows + [bad]), pq_path)
    js_path = str(tmp_path / "dapo.jsonl")
    _write_jsonl(js_path, [json.dumps(r) for r in rows])

    recs, stats = load_prompts([pq_path, js_path], tok, max_prompt_tokens=128, apply_chat_template=True)
    assert [r.answer for r in recs] == ["4", "\\frac{1}{2}"] * 2
    assert recs[0].source == f"{pq_path}:1" and recs[2].source == f"{js_path}:1"
    assert recs[0].prompt_text == _template(tok, rows[0]["prompt"])
    assert dict(stats.skipped) == {"null_answer": 1}
    assert stats.per_file == {pq_path: 2, js_path: 2}

    plain, _ = load_prompts([js_path], tok, max_prompt_tokens=128, apply_chat_template=False)
    assert plain[0].prompt_text == "What is 2+2?"


def test_simple_parquet(tmp_path, tok):
    p = str(tmp_path / "s.parquet")
    pq.write_table(pa.Table.from_pylist([{"prompt": "1+1=", "answer": "2"}, {"prompt": "", "answer": "0"}]), p)
    recs, stats = load_prompts([p], tok, max_prompt_tokens=64, apply_chat_template=True, schema="simple")
    assert [r.answer for r in recs] == ["2"] and dict(stats.skipped) == {"empty_prompt": 1}


def test_unreadable_missing_all_bad_and_unknown_schema_name_the_file(tmp_path, tok):
    corrupt = tmp_path / "corrupt.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": "1+1=", "answer": "2"}] * 50), str(corrupt))
    data = corrupt.read_bytes()
    corrupt.write_bytes(data[: len(data) // 2])  # truncated: footer gone
    with pytest.raises(PromptDataError, match="corrupt.parquet: cannot read Parquet"):
        load_prompts([str(corrupt)], tok, max_prompt_tokens=64, apply_chat_template=True)

    with pytest.raises(PromptDataError, match="not found: .*nope.jsonl"):
        load_prompts([str(tmp_path / "nope.jsonl")], tok, max_prompt_tokens=64, apply_chat_template=True)

    allbad = str(tmp_path / "allbad.jsonl")
    _write_jsonl(allbad, [json.dumps({"prompt": "1", "answer": None}), "{oops"])
    with pytest.raises(PromptDataError,
                       match=r"allbad.jsonl: no usable prompt in 2 rows \(invalid_json=1, null_answer=1\)"):
        load_prompts([allbad], tok, max_prompt_tokens=64, apply_chat_template=True)

    odd = str(tmp_path / "odd.jsonl")
    _write_jsonl(odd, [json.dumps({"question": "1", "solution": "2"})])
    with pytest.raises(PromptDataError, match="odd.jsonl: cannot detect the schema"):
        load_prompts([odd], tok, max_prompt_tokens=64, apply_chat_template=True)


def test_sampler_epochs_and_exact_resume(tmp_path, tok):
    ex = make_splits(0, n_train=23, n_eval=1, n_sft=1)["train"]
    p = str(tmp_path / "t.jsonl")
    _write_jsonl(p, [json.dumps({"prompt": e.prompt, "answer": e.answer}) for e in ex])
    recs, _ = load_prompts([p], tok, max_prompt_tokens=64, apply_chat_template=True)

    s = PromptSampler(recs, batch_size=5, seed=7)
    seq = [[r.source for r in s.next_batch()] for _ in range(10)]  # 50 draws: crosses 2 epochs
    flat = [x for b in seq for x in b]
    # Each epoch is a permutation of all records; different epochs are shuffled differently.
    assert sorted(flat[:23]) == sorted(r.source for r in recs) == sorted(flat[23:46])
    assert flat[:23] != flat[23:46]

    s2 = PromptSampler(recs, batch_size=5, seed=7)
    for _ in range(4):
        s2.next_batch()
    state = json.loads(json.dumps(s2.state_dict()))  # survives a checkpoint round-trip
    s3 = PromptSampler(recs, batch_size=5, seed=7)
    s3.load_state_dict(state)
    assert [[r.source for r in s3.next_batch()] for _ in range(6)] == seq[4:]
    with pytest.raises(ValueError, match="seed=7"):
        PromptSampler(recs, batch_size=5, seed=8).load_state_dict(state)


def test_demo_dir_is_deterministic_and_loads_with_transformers(tmp_path):
    import hashlib

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vapo_megatron.tasks.demo_task import TinyModelSpec, write_demo_dir

    spec = TinyModelSpec(hidden_size=32, num_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=64)
    kw = dict(seed=3, task="add", n_train=50, n_eval=20, n_sft=30, sft_noise=0.0, spec=spec)
    a = write_demo_dir(str(tmp_path / "a"), **kw)
    b = write_demo_dir(str(tmp_path / "b"), **kw)

    def digest(p):
        return hashlib.sha256(open(p, "rb").read()).hexdigest()

    for name in ("train", "eval", "sft"):
        assert digest(a[name]) == digest(b[name])
    assert digest(a["model"] + "/model.safetensors") == digest(b["model"] + "/model.safetensors")
    # Another seed is another run (scripts/demo_seeds.sh): other problems, another initialization.
    c = write_demo_dir(str(tmp_path / "c"), **{**kw, "seed": 4})
    for name in ("train", "eval", "sft"):
        assert digest(c[name]) != digest(a[name])
    assert digest(c["model"] + "/model.safetensors") != digest(a["model"] + "/model.safetensors")

    # Held-out: no eval problem appears in train or sft; every answer is right (noise 0).
    rows = {n: [json.loads(line) for line in open(a[n])] for n in ("train", "eval", "sft")}
    ev = {r["prompt"] for r in rows["eval"]}
    assert not ev & {r["prompt"] for r in rows["train"] + rows["sft"]}
    for r in rows["train"] + rows["eval"] + rows["sft"]:
        x, y = r["prompt"].rstrip("=").split("+")
        assert int(r["answer"]) == int(x) + int(y)

    tok = AutoTokenizer.from_pretrained(a["model"])
    model = AutoModelForCausalLM.from_pretrained(a["model"])
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert model.config.vocab_size >= len(tok) and model.config.vocab_size % 64 == 0
    assert model.config.eos_token_id == tok.eos_token_id and model.config.pad_token_id == tok.pad_token_id
    # The prompts of the demo load through load_prompts with this tokenizer, chat template on.
    recs, stats = load_prompts([a["eval"]], tok, max_prompt_tokens=32, apply_chat_template=True)
    assert stats.loaded == 20 and not stats.skipped
    ids = torch.tensor([recs[0].prompt_ids])
    assert model(input_ids=ids).logits.shape == (1, ids.shape[1], model.config.vocab_size)


def test_noisy_teacher_answers():
    s = make_splits(1, n_train=10, n_eval=10, n_sft=400, task="add", sft_noise=0.5)
    wrong = 0
    for e in s["sft"]:
        x, y = (int(v) for v in e.prompt.rstrip("=").split("+"))
        if int(e.answer) != x + y:
            wrong += 1
            # The wrong teacher adds digit by digit and drops every carry.
            assert int(e.answer) == (x % 10 + y % 10) % 10 + 10 * ((x // 10 + y // 10) % 10)
    # ~70% of problems carry somewhere (units or tens); half of those get the wrong teacher.
    assert 100 < wrong < 180


def test_a_batch_larger_than_its_data_is_said_once():
    """prompts_per_step above the prompts there are once repeated prompts within a step without a
    word (issue 33 item 8); now one line at the start, for the RL and the warm-start batches."""
    from vapo_megatron.config import parse_config
    from vapo_megatron.data.datasets import Datasets, repeat_warnings

    cfg, problems = parse_config(None, ["rollout.prompts_per_step=8", "sft.batch_size=4"])
    assert problems == []
    recs = [PromptRecord(prompt_ids=[i], answer="1", source=f"f.jsonl:{i}", prompt_text=f"p{i}") for i in range(5)]
    assert repeat_warnings(cfg, Datasets(None, recs, [], recs[:3])) == [
        "[vapo] warning: data.train_files hold 5 usable prompts, fewer than rollout.prompts_per_step=8: "
        "every batch repeats prompts",
        "[vapo] warning: sft.files hold 3 usable prompts, fewer than sft.batch_size=4: every batch repeats prompts"]
    assert repeat_warnings(cfg, Datasets(None, recs * 2, [], [])) == []
