"""A damaged model or tokenizer file is one line naming it, from every command, before work starts;
and every command refuses the same model families (issue 33, items 3 and 5).

Before: vapo-train accepted a truncated model.safetensors at start-up and died 7-15 s later with a
29-line traceback; vapo-eval said "internal error: SafetensorError" without naming the file, and
evaluated yarn-RoPE and Mistral models that vapo-train and vapo-convert refuse. The reference for
"damaged" is the safetensors library itself: whatever it refuses to open, the pure-Python header
check (model_providers/files.py, which vapo-train runs before importing torch) refuses too.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from model_providers.files import model_dir_problems, safetensors_problem
from tests.e2e.test_cli_errors import answer, eval_args
from tests.e2e.test_startup_checks import startup_report


def _opens(path: Path) -> bool:
    try:
        with safe_open(path, framework="pt") as f:
            for k in f.keys():
                f.get_tensor(k)
        return True
    except SafetensorError:
        return False


def test_header_check_refuses_exactly_what_safetensors_refuses(tmp_path):
    whole = tmp_path / "whole.safetensors"
    save_file({"a": torch.arange(6.0).reshape(2, 3), "b": torch.ones(4, dtype=torch.int64)}, whole)
    data = whole.read_bytes()
    assert safetensors_problem(whole) is None and _opens(whole)
    cut = tmp_path / "cut.safetensors"
    for n in [0, 4, 8, 9, 20, len(data) // 2, len(data) - 1, len(data) + 1]:
        cut.write_bytes(data[:n] if n <= len(data) else data + b"\0")
        assert _opens(cut) is (safetensors_problem(cut) is None), n
        assert safetensors_problem(cut) is not None and str(cut) in safetensors_problem(cut), n
    cut.write_bytes(data[:8] + b"{not json" + data[17:])
    assert not _opens(cut) and "damaged safetensors header" in safetensors_problem(cut)


@pytest.fixture(scope="module")
def hf(demo) -> Path:
    return demo / "model"  # a whole HF directory: config, safetensors weights, tokenizer


def _copy(hf: Path, tmp_path: Path) -> Path:
    d = tmp_path / "model"
    shutil.copytree(hf, d)
    return d


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-100])


def test_model_dir_problems_name_the_file(hf, tmp_path):
    assert model_dir_problems(hf) == []
    d = _copy(hf, tmp_path)
    _truncate(d / "model.safetensors")
    (d / "tokenizer.json").write_text('{"version": "1.0", "model": {"vocab": "\x01"')  # cut mid-file
    problems = model_dir_problems(d)
    assert len(problems) == 2, problems
    assert any(p.startswith(f"{d / 'model.safetensors'} is truncated") for p in problems), problems
    assert any(p.startswith(f"{d / 'tokenizer.json'} is not readable JSON") for p in problems), problems
    # A sharded model: a listed shard missing, and a shard without the tensors the index places in it.
    s = _copy(hf, tmp_path / "sharded")
    (s / "model.safetensors").rename(s / "model-00001-of-00002.safetensors")
    with safe_open(s / "model-00001-of-00002.safetensors", framework="pt") as f:
        names = list(f.keys())
    wm = {n: "model-00001-of-00002.safetensors" for n in names}
    wm["extra.weight"] = "model-00002-of-00002.safetensors"
    (s / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    assert model_dir_problems(s) == [f"{s / 'model-00002-of-00002.safetensors'} is missing "
                                     "(model.safetensors.index.json lists it)"]
    wm["extra.weight"] = "model-00001-of-00002.safetensors"
    (s / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    assert model_dir_problems(s) == [f"{s / 'model-00001-of-00002.safetensors'} lacks 1 tensor(s) "
                                     "model.safetensors.index.json places in it, e.g. extra.weight"]


def test_vapo_train_refuses_a_truncated_model_and_tokenizer_at_start_up(demo, tmp_path):
    d = _copy(demo / "model", tmp_path)
    _truncate(d / "model.safetensors")
    (d / "tokenizer.json").write_text((d / "tokenizer.json").read_text()[:-50])
    problems = startup_report(demo, tmp_path, f"model.hf_path={d}")
    assert any(p.startswith(f"model.hf_path: {d / 'model.safetensors'} is truncated") for p in problems), problems
    assert any(p.startswith(f"model.hf_path: {d / 'tokenizer.json'} is not readable JSON") for p in problems), problems


def _eval(capsys, model: Path, data: Path) -> tuple[int, str, str]:
    from vapo_megatron import eval as vapo_eval

    argv = eval_args(data, "--max-new-tokens", "4")
    argv[argv.index("--model") + 1] = model
    return answer(capsys, vapo_eval.main, argv, "vapo-eval")


@pytest.fixture()
def data(tmp_path) -> Path:
    (tmp_path / "eval.jsonl").write_text('{"prompt": "1+1", "answer": "2"}\n')
    return tmp_path


def test_vapo_eval_names_a_damaged_file_in_one_line(hf, tmp_path, data, capsys):
    d = _copy(hf, tmp_path)
    _truncate(d / "model.safetensors")
    code, message, err = _eval(capsys, d, data)
    assert code == 2 and "Traceback" not in err, err
    assert message.startswith(f"vapo-eval: error: --model {d}: {d / 'model.safetensors'} is truncated"), message
    d = _copy(hf, tmp_path / "tok")
    (d / "tokenizer.json").write_text("{\x01}")
    code, message, err = _eval(capsys, d, data)
    assert code == 2 and message.startswith(f"vapo-eval: error: --model {d}: "
                                            f"{d / 'tokenizer.json'} is not readable JSON"), err
    assert not (data / "out").exists()


@pytest.mark.parametrize("change,text", [
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}}, "yarn"),
    ({"architectures": ["MistralForCausalLM"], "model_type": "mistral"}, "MistralForCausalLM"),
])
def test_vapo_eval_refuses_the_families_vapo_train_refuses(hf, demo, tmp_path, data, capsys, change, text):
    d = _copy(hf, tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, **change}))
    code, message, err = _eval(capsys, d, data)
    assert code == 2 and "Traceback" not in err and text in message, err
    train = [p for p in startup_report(demo, tmp_path, f"model.hf_path={d}") if p.startswith("model.hf_path:")]
    assert train and text in train[0], train
    # the same sentence, from the same check (model_providers.check_supported)
    assert train[0].removeprefix("model.hf_path: ") in message, (train, message)
