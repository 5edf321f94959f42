"""Colocated SGLang engines at trainer TP=2 on gloo, with a TEST DOUBLE for sglang.Engine (which
needs a GPU): SGLangEngine.colocated groups the ranks (one engine per rank at sglang_tp=1, one
engine over both ranks at sglang_tp=2), the real weight sync streams the Megatron actor's
payloads through SGLang's own serializer and FlattenedTensorBucket into the double, the
rollout split hands each generating rank its share of the prompts with offset seeds, and the
memory protocol (release / resume / weights lost until the next sync) is followed.

The double's generate answers, for each request, [greedy next token of its transformers model,
the request's sampling seed]; the reference is computed independently in the test: Megatron's
own greedy next token per prompt and the seed formula of SamplingParams.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tests.helpers.dist_utils import run_ranks
from tests.helpers.megatron_ref import megatron_forward, random_update
from tests.helpers.sglang_doubles import FakeColocatedSGLangEngineForTests
from tests.helpers.tiny_hf import save_tiny

PROMPTS = [[5, 9, 13], [7, 7], [21, 3, 8, 1], [11], [30, 2]]  # 5 prompts: shares of 3 + 2
N, SEED = 2, 11


def _colocated_run(hf_dir: Path):
    import torch.distributed as dist

    from model_providers import family_for, read_hf_config
    from vapo_megatron.config import RolloutConfig, SGLangConfig
    from vapo_megatron.data.prompts import PromptRecord
    from vapo_megatron.mcore import parallel
    from vapo_megatron.mcore.models import build_chunks
    from vapo_megatron.rollout.base import SamplingParams
    from vapo_megatron.rollout.generator import Generator
    from vapo_megatron.rollout.sglang_engine import SGLangEngine
    from vapo_megatron.rollout.weight_sync import stream_weights
    from vapo_megatron.weights.hf_read import load_hf_weights

    parallel.init_distributed(2, 1)
    hf_cfg = read_hf_config(hf_dir)
    chunks = build_chunks(hf_cfg, params_dtype=torch.float32, critic=False)
    load_hf_weights(chunks, family_for(hf_cfg), hf_cfg, hf_dir)
    random_update(chunks)
    greedy = []
    for ids in PROMPTS:  # Megatron's own greedy next token: the reference for the engine's
        logits = megatron_forward(chunks, torch.tensor([ids]), critic=False, vocab=hf_cfg["vocab_size"])
        greedy.append(int(logits[0, -1].argmax()))

    prompts = [PromptRecord(prompt_ids=ids, answer="", source=f"p{i}", prompt_text="") for i, ids in enumerate(PROMPTS)]
    out = {"greedy": greedy}
    for sglang_tp in (1, 2):
        engine = SGLangEngine.colocated(model_path=str(hf_dir), tp_size=sglang_tp, mem_fraction=0.5, dtype="float32",
                                        seed=0, start=lambda c: FakeColocatedSGLangEngineForTests(hf_dir, c))
        stream_weights(chunks, family_for(hf_cfg), hf_cfg, engine, version=7, bucket_bytes=16_000)
        gen = Generator(engine, RolloutConfig(engine="sglang", sglang=SGLangConfig(tp=sglang_tp)), stop_token_ids=())
        outputs = gen.generate(prompts, SamplingParams(n=N, temperature=1.0, max_new_tokens=2, seed=SEED))
        gen.release_weights()
        refused = ""
        if engine.generates:
            try:
                engine.generate([PROMPTS[0]], SamplingParams(n=1))
            except RuntimeError as e:
                refused = str(e)
        out[sglang_tp] = {
            "generators": gen.generators,
            "outputs": [(o.prompt_index, o.token_ids, o.weight_version) for o in outputs],
            "calls": engine.engine.calls if engine.owner else None,
            "refused": refused,
            "version": engine.weight_version,
        }
        dist.barrier()
    return out


def test_colocated_engines_sync_split_and_release(tmp_path):
    save_tiny(tmp_path / "hf", tied=False, seed=5)
    runs = run_ranks(2, _colocated_run, tmp_path / "hf")
    greedy = runs[0]["greedy"]
    want = [(i, [greedy[i], SEED + i * N + j], 7) for i in range(len(PROMPTS)) for j in range(N)]
    for sglang_tp, generators in ((1, [0, 1]), (2, [0])):
        for rank, run in enumerate(runs):
            res = run[sglang_tp]
            assert res["generators"] == generators
            # Every rank of the replica gets all samples, grouped by prompt, from the synced
            # weights, with the seeds a single engine would have used.
            assert res["outputs"] == want, (sglang_tp, rank)
            assert res["version"] == 7
            owner = rank in generators
            assert (res["calls"] is not None) == owner
            if not owner:
                continue
            calls = res["calls"]
            n_updates = calls.count("update")
            assert n_updates > 1  # small buckets
            share = 3 if rank == 0 and sglang_tp == 1 else (2 if sglang_tp == 1 else 5)
            assert calls == [
                ("release", ("weights", "kv_cache", "cuda_graph")),  # at start-up: room for the models
                ("resume", ("weights",)), "begin", *["update"] * n_updates, "end", "flush",
                ("resume", ("kv_cache", "cuda_graph")), ("generate", share * N),
                ("release", ("kv_cache", "cuda_graph")),
                ("release", ("weights",)),  # before training
            ], (sglang_tp, rank, calls)
            assert "released and not loaded again" in res["refused"]
