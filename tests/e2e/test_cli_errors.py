"""vapo-eval and vapo-plan answer bad input with one message and exit 2, never a traceback, and
the message is whole (issue 25 item 7; vapo-convert's own cases: test_convert_cli.py).

vapo-eval once printed only the first line of a multi-problem message ("vapo-eval: 2 invalid
settings:", naming none of them); vapo-plan answered a missing --config with the model path it
could not read from it. Each command runs in this process (it stops before any model is built)."""

from __future__ import annotations

import pytest

from tests.helpers.tiny_hf import save_tiny, save_tiny_tokenizer


def answer(capsys, main, argv: list, prog: str) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    err = capsys.readouterr().err
    lines = err.splitlines()
    first = [i for i, line in enumerate(lines) if line.startswith(prog)]
    assert len(first) == 1, err
    return code, "\n".join([lines[first[0]], *(line for line in lines[first[0] + 1:] if line.startswith("  - "))]), err


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    root = tmp_path_factory.mktemp("m")
    save_tiny(root / "hf")
    save_tiny_tokenizer(root / "hf")
    (root / "eval.jsonl").write_text('{"prompt": "1+1", "answer": "2"}\n')
    return root


def eval_args(model, *extra):
    return ["--model", model / "hf", "--data", model / "eval.jsonl", "--n-samples", "2", "--out", model / "out", *extra]


def test_eval_layout_error_names_every_problem_by_its_flag(model, capsys):
    from vapo_megatron import eval as vapo_eval

    code, message, err = answer(capsys, vapo_eval.main, eval_args(model, "--tp", "4"), "vapo-eval")
    assert code == 2 and "Traceback" not in err
    assert "--tp * --pp = 4 * 1 = 4 does not divide the world size 1" in message
    assert f"--tp=4 does not divide num_key_value_heads=2 of --model {model / 'hf'}" in message
    assert "--." not in err and "tensor_parallel" not in err
    assert not (model / "out").exists()


def test_eval_missing_data_is_one_line_and_verbose_adds_the_traceback(model, capsys, monkeypatch):
    from vapo_megatron import eval as vapo_eval

    argv = eval_args(model)
    argv[argv.index("--data") + 1] = model / "nope.jsonl"
    code, message, err = answer(capsys, vapo_eval.main, argv, "vapo-eval")
    assert code == 2 and message == f"vapo-eval: error: --data {model / 'nope.jsonl'}: no such file"
    assert "Traceback" not in err
    monkeypatch.setenv("VAPO_VERBOSE", "1")
    code, message, err = answer(capsys, vapo_eval.main, argv, "vapo-eval")
    assert code == 2 and "Traceback" in err and "no such file" in message


def test_plan_names_a_missing_config_file(tmp_path, capsys):
    from vapo_megatron import plan

    code, message, err = answer(capsys, plan.main, ["--config", tmp_path / "nope.yaml", "--nodes", "1",
                                                    "--gpus-per-node", "1"], "vapo-plan")
    assert code == 2 and "Traceback" not in err
    assert f"config file not found: {tmp_path / 'nope.yaml'}" in message


def test_eval_never_writes_into_a_directory_it_did_not_write(model, capsys):
    """--out . (a project directory) or the model itself: refused before any model is built, the
    user's files untouched (the same ownership rule as vapo-convert's, runtime/atomic.py)."""
    from vapo_megatron import eval as vapo_eval

    project = model / "project"
    project.mkdir()
    (project / "summary.json").write_text("my notes\n")
    for out, why in ((project, "not written by vapo-megatron"), (model / "hf", "is the input --model")):
        argv = eval_args(model)
        argv[argv.index("--out") + 1] = out
        code, message, err = answer(capsys, vapo_eval.main, argv, "vapo-eval")
        assert code == 2 and "Traceback" not in err, err
        assert message.startswith(f"vapo-eval: error: --out {out} ") and why in message, message
    assert (project / "summary.json").read_text() == "my notes\n"
    assert sorted(p.name for p in project.iterdir()) == ["summary.json"]


@pytest.mark.parametrize("text,says", [(None, "config file not found: "),
                                       ("model: [unclosed\n", "invalid YAML at line 2, column 1: "),
                                       ("- a list\n", "expected a mapping of sections, got list")])
def test_train_names_an_unreadable_config_file_alone(tmp_path, capsys, text, says):
    """A missing or unparsable --config is the one error: the schema's defaults once stood in for
    it and added three follow-on errors (issue 33 item 8)."""
    from vapo_megatron import train

    path = tmp_path / "c.yaml"
    if text is not None:
        path.write_text(text)
    code, message, err = answer(capsys, train.main, ["--config", path, "trainer.total_steps=3"], "vapo-train")
    assert code == 2 and "Traceback" not in err
    assert (message.startswith(f"vapo-train: configuration error: {path}")
            or message == f"vapo-train: configuration error: {says}{path}")
    assert says in message and "\n" not in message, message
