"""More families on sglang 0.5.23's own CPU server (`python -m sglang.launch_server`, one started per
test), each fed by the trainer at another layout through the project's payloads over HTTP: Llama 3.x
with its RoPE scaling from a trainer at PP=2, Qwen3-MoE (its experts into SGLang's FusedMoE) from a
trainer at EP=2. After each of two syncs the server's log-probs of what it sampled equal the
trainer's. TEST DOUBLE: only sgl_kernel's CPU build (tests/doubles/sglang/sgl_kernel); SGLang's MoE
runs its own torch path. Qwen2 (colocated, TP=2) and Qwen3 (HTTP, TP=2): test_sglang_colocated_real.py,
test_sglang_server_real.py."""

from __future__ import annotations

import torch

from tests.distributed.test_sglang_server_real import assert_logprobs_equal, push_and_compare
from tests.helpers.dist_utils import run_ranks
from tests.helpers.ports import free_port
from tests.helpers.sglang_world import start_server, stop_process_tree
from tests.helpers.tiny_hf import llama_config, qwen3_moe_config, randomize


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


def test_qwen3_moe_from_a_trainer_at_ep2(tmp_path):
    # Every layer with experts: SGLang builds no dense layer (start-up refuses mlp_only_layers with
    # SGLang, config/preflight.py), so the tiny model has none.
    _against_server(tmp_path, qwen3_moe_config(mlp_only_layers=()), ep=2)
