"""vapo-train on a tiny Llama (llama3 RoPE scaling on): torchrun, 2 ranks, TP=2, the embedded
engine; and an unsupported rope setting refused by vapo-train, vapo-convert and vapo-plan in one
line (vapo-eval runs the HF model with transformers or SGLang, never megatron, so it does not
refuse what only megatron cannot express).

The demo data and tokenizer are the demo's (scripts/make_demo_data.py); its Qwen2 model is
replaced by a random-init transformers LlamaForCausalLM sized to that tokenizer. The engine
(transformers' Llama) and the trainer (megatron's GPTModel) compute the rollout's log-probs
independently, so `rollout/logprob_diff` at float32 rounding level says that megatron's llama3
RoPE, weights synced through the family table included, is transformers' at every step.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.tiny_hf import LLAMA3_ROPE
from tests.helpers.train_runs import ROOT, make_demo_data, records, small_run_overrides, train_in_forks


def write_tiny_llama(model_dir: Path, tokenizer_dir: Path, *, seed: int = 0) -> None:
    """A random-init LlamaForCausalLM (untied, llama3 RoPE scaling) with the demo tokenizer."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    cfg = LlamaConfig(
        # the tokenizer's size rounded to 64 as the demo does; Megatron pads it further (to 256 at TP=2)
        vocab_size=-(-len(tok) // 64) * 64, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=131072,
        rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling=dict(LLAMA3_ROPE), tie_word_embeddings=False,
        bos_token_id=tok.convert_tokens_to_ids("<|endoftext|>"), eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id, architectures=["LlamaForCausalLM"],
    )
    torch.manual_seed(seed)
    shutil.rmtree(model_dir, ignore_errors=True)
    LlamaForCausalLM(cfg).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)


@pytest.fixture(scope="module")
def llama_demo(tmp_path_factory) -> Path:
    data = make_demo_data(tmp_path_factory.mktemp("llama-demo") / "data", n_train=64, n_eval=8, n_sft=16)
    write_tiny_llama(data / "model", data / "tokenizer")
    return data


def _overrides(data: Path, run_dir: Path) -> list[str]:
    return [*small_run_overrides(data, run_dir)]


def test_vapo_train_runs_on_llama_at_tp2_with_the_embedded_engine(llama_demo, tmp_path):
    run_dir = tmp_path / "run"
    run = train_in_forks("demo_cpu.yaml", *_overrides(llama_demo, run_dir), "parallel.tp=2")
    vapo = [r for r in records(run_dir) if r["phase"] == "vapo"]
    assert len(vapo) == 2, run.stdout[-2000:]
    for r in vapo:
        # Mean |engine - trainer| log-prob over response tokens, float32 on both sides: rounding
        # only (a wrong RoPE scaling or a misplaced weight gives ~1e-2 and more).
        assert 0.0 <= r["rollout/logprob_diff"] < 1e-6, r["rollout/logprob_diff"]
        assert all(r[k] == r[k] for k in ("actor/pg_loss", "critic/value_loss", "actor/grad_norm"))  # finite, not NaN


# ---- an unsupported rope setting: one line, exit 2, from vapo-train and vapo-convert ----------

def _with_rope(src: Path, dst: Path, **change) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["rope_parameters"] = {**cfg["rope_parameters"], **change}
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _error_lines(err: str, prog: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith(prog)]


def test_unsupported_rope_is_one_line_from_vapo_train(llama_demo, tmp_path):
    bad = _with_rope(llama_demo / "model", tmp_path / "model", high_freq_factor=2.0)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS")}
    proc = subprocess.run(
        [sys.executable, "-m", "vapo_megatron.train", "--config", str(ROOT / "configs" / "demo_cpu.yaml"),
         *_overrides(llama_demo, tmp_path / "run"), f"model.hf_path={bad}", "parallel.tp=1"],
        cwd=ROOT, env={**env, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
        timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    want = f"{bad / 'config.json'}: rope_parameters.high_freq_factor=2.0 is not supported"
    assert want in proc.stderr and "fixes high_freq_factor=4" in proc.stderr, proc.stderr[-3000:]
    assert not (tmp_path / "run").exists()


def test_unsupported_rope_is_one_line_from_vapo_convert(llama_demo, tmp_path, capsys):
    from vapo_megatron import convert

    bad = _with_rope(llama_demo / "model", tmp_path / "model", rope_type="yarn")
    assert convert.main(["hf-to-mcore", "--hf", str(bad), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    (line,) = _error_lines(err, "vapo-convert")
    assert "Traceback" not in err and "\n" not in line
    assert f"vapo-convert: error: {bad / 'config.json'}: rope_parameters=" in line
    assert "'rope_type': 'yarn'" in line and "only 'llama3' or the default RoPE" in line
    assert not (tmp_path / "o").exists()


def test_unsupported_rope_is_one_line_from_vapo_plan(llama_demo, tmp_path):
    bad = _with_rope(llama_demo / "model", tmp_path / "model", original_max_position_embeddings=4096)
    proc = subprocess.run(
        [sys.executable, "-m", "vapo_megatron.plan", "--config", str(ROOT / "configs" / "demo_cpu.yaml"),
         "--nodes", "1", "--gpus-per-node", "2", f"model.hf_path={bad}"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    (line,) = _error_lines(proc.stderr, "vapo-plan")
    assert f"{bad / 'config.json'}: rope_parameters.original_max_position_embeddings=4096 is not supported" in line
