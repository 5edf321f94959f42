"""Llama 3.x on sglang 0.5.23's own CPU server (`python -m sglang.launch_server`), fed by a trainer at
PP=2 through the project's payloads over HTTP: after each of two syncs the server's log-probs of what
it sampled equal the trainer's (its RoPE scaling included). TEST DOUBLE: only sgl_kernel's CPU build
(tests/doubles/sglang/sgl_kernel). The other families: Qwen3-MoE (colocated at TP=2, PP=2 and EP=2,
its experts into SGLang's FusedMoE) in test_sglang_colocated_real.py, Qwen3 (HTTP, TP=2) in
test_sglang_server_real.py, Qwen2 (colocated in a VAPO run) in tests/e2e/test_sglang_train_resume.py."""

from __future__ import annotations

import torch

from tests.distributed.test_sglang_server_real import assert_logprobs_equal, push_and_compare
from tests.helpers.dist_utils import run_ranks
from tests.helpers.ports import free_port
from tests.helpers.sglang_world import start_server, stop_process_tree
from tests.helpers.tiny_hf import llama_config, randomize


def _save(path, cfg, seed):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    randomize(model, seed)
    model.save_pretrained(path)


def _against_server(tmp_path, cfg, *, tp=1, pp=1, ep=1):
    _save(tmp_path / "hf", cfg, seed=4)
    proc, url = start_server(tmp_path / "hf", tmp_path / "server.log", port=free_port())
    try:
        assert_logprobs_equal(run_ranks(2, push_and_compare, url, tmp_path / "hf", tp, pp, ep, timeout=600))
    finally:
        stop_process_tree(proc)


def test_llama_with_rope_scaling_from_a_trainer_at_pp2(tmp_path):
    _against_server(tmp_path, llama_config(tied=False), pp=2)
