"""The HTTP client (rollout.engine=sglang_http, rollout/sglang_http.py) against a real
`python -m sglang.launch_server` of sglang 0.5.23 on the CPU, serving a tiny Qwen3: started once for
this file (tests/helpers/sglang_world.py start_server). TEST DOUBLE: only sgl_kernel's CPU build
(tests/doubles/sglang/sgl_kernel). The server runs at TP=1: SGLang's CPU engine at TP>1 builds a
NCCL communicator for its CPU group and dies in torch.cuda (docs/what_ran_where.md).

  - /server_info gives the TP size the client reads at start-up; /generate answers in the format
    parse_output reads; /flush_cache answers;
  - a trainer at TP=2 (2 gloo ranks, the replica's engine held by its first rank, as build_engine
    does for sglang_http) streams its weights through the project's payloads over HTTP, twice: the
    server's log-probs of what it sampled then equal the trainer's own.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers.dist_utils import run_ranks
from tests.helpers.ports import free_port
from tests.helpers.sglang_world import start_server, stop_process_tree
from tests.helpers.tiny_hf import save_tiny

PROMPTS = [[5, 9, 13], [7, 7, 30, 2], [21, 3, 8, 1, 44]]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("sglang_server")
    save_tiny(d / "hf", kind="qwen3", seed=3)
    proc, url = start_server(d / "hf", d / "server.log", port=free_port())
    yield url, d / "hf"
    stop_process_tree(proc)


def test_server_info_generate_and_flush(server):
    from vapo_megatron.rollout.base import SamplingParams
    from vapo_megatron.rollout.sglang_engine import SGLangEngine
    from vapo_megatron.rollout.sglang_http import HttpEngine

    url, _ = server
    http = HttpEngine(url)
    assert http.server_tp_size("rollout.sglang_http.urls[0]") == 1
    eng = SGLangEngine(http, engine_tp=1)
    outs = eng.generate(PROMPTS, SamplingParams(n=2, temperature=1.0, max_new_tokens=5, seed=1))
    assert [o.prompt_index for o in outs] == [0, 0, 1, 1, 2, 2]
    assert all(len(o.token_ids) == len(o.logprobs) == 5 and o.finish_reason == "length" for o in outs)
    assert http.flush_cache()["success"]


def push_and_compare(url: str, hf_dir: Path, tp: int = 1, pp: int = 1, ep: int = 1, syncs: int = 2):
    """A trainer at (tp, pp, ep) on this rank; its replica's first rank holds the client of the server
    at `url` (generator.build_engine's placement for sglang_http; one replica feeds it). `syncs`
    times: a random update, the weights streamed over HTTP through the project's payloads, answers
    sampled at temperature 1; returns [(server's log-probs, trainer's log-probs)] per sync."""
    import torch.distributed as dist

    from model_providers import family_for, read_hf_config
    from tests.distributed.test_sglang_colocated_real import trainer_logprobs
    from tests.helpers.megatron_ref import random_update
    from vapo_megatron.mcore import parallel
    from vapo_megatron.mcore.models import build_chunks
    from vapo_megatron.rollout.base import SamplingParams
    from vapo_megatron.rollout.sglang_engine import SGLangEngine
    from vapo_megatron.rollout.sglang_http import HttpEngine
    from vapo_megatron.rollout.weight_sync import stream_weights
    from vapo_megatron.weights.hf_read import load_hf_weights

    parallel.init_distributed(tp, pp, ep=ep)
    hf_cfg = read_hf_config(hf_dir)
    chunks = build_chunks(hf_cfg, params_dtype=torch.float32, critic=False)
    load_hf_weights(chunks, family_for(hf_cfg), hf_cfg, hf_dir)
    engine = None
    if dist.get_rank() == 0:
        http = HttpEngine(url)
        engine = SGLangEngine(http, engine_tp=http.server_tp_size("rollout.sglang_http.urls[0]"))
    res = []
    for step in range(syncs):
        random_update(chunks)
        stream_weights(chunks, family_for(hf_cfg), hf_cfg, engine, version=step + 1, bucket_bytes=8_000)
        outs = (engine.generate(PROMPTS, SamplingParams(n=1, temperature=1.0, max_new_tokens=6, seed=step)) if engine
                else None)
        box = [None if outs is None else [(PROMPTS[o.prompt_index], o.token_ids, o.logprobs) for o in outs]]
        dist.broadcast_object_list(box, src=0)
        seqs = [(p, t) for p, t, _ in box[0]]
        # Every rank runs the forward (TP gathers, pipeline sends, expert all-to-alls); the last stage has the logits.
        trainer = trainer_logprobs(chunks, hf_cfg["vocab_size"], seqs) if parallel.pp_rank() == pp - 1 else None
        if pp > 1 and parallel.pp_rank() != pp - 1:
            for prompt, answer in seqs:
                from tests.helpers.megatron_ref import megatron_forward

                megatron_forward(chunks, torch.tensor([list(prompt) + list(answer)]), critic=False,
                                 vocab=hf_cfg["vocab_size"])
        res.append(([lp for _, _, lp in box[0]], trainer))
    return res


def assert_logprobs_equal(runs):
    checked = 0
    for run in runs:
        for engine, trainer in run:
            if trainer is None:
                continue
            for eng, ref in zip(engine, trainer):
                assert len(eng) == len(ref) > 0
                assert max(abs(a - b) for a, b in zip(eng, ref)) < 1e-4, (eng, ref)
                checked += 1
    assert checked


def test_trainer_at_tp2_updates_the_server_over_http(server):
    url, hf_dir = server
    assert_logprobs_equal(run_ranks(2, push_and_compare, url, hf_dir, 2, timeout=600))
