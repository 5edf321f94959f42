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

from dist_utils import run_ranks
from sglang_source import engine_method
from test_convert import _forward
from test_rollout_sglang import FakeSGLangEngineForTests
from test_weight_sync import _random_update
from tiny_hf import save_tiny

PROMPTS = [[5, 9, 13], [7, 7], [21, 3, 8, 1], [11], [30, 2]]  # 5 prompts: shares of 3 + 2
N, SEED = 2, 11


class FakeColocatedSGLangEngineForTests(FakeSGLangEngineForTests):
    """TEST DOUBLE for a colocated sglang.Engine (GPU only), built from an SGLangEngineConfig,
    with the real Engine's signatures (see FakeSGLangEngineForTests). Each update deserializes
    every engine TP rank's payload with SGLang's classes, puts each name through SGLang's Qwen2
    name mapping, checks the ranks agree, and loads the tensors into a transformers model; it
    tracks released memory and generate refuses to run on released weights."""

    def __init__(self, hf_dir: Path, cfg):
        from transformers import AutoConfig, AutoModelForCausalLM

        torch.manual_seed(1000)  # a fresh initialization: only the sync can make it right
        super().__init__(AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(hf_dir)).eval(), cfg.tp_size)
        self.released: set[str] = set()

    @engine_method
    def update_weights_from_tensor(self, named_tensors, load_format, flush_cache):
        assert "weights" not in self.released
        views = self.receive(named_tensors, load_format)
        with torch.no_grad():
            for name, t in views[0].items():
                for r in range(1, self.tp_size):
                    assert torch.equal(views[r][name], t), name  # every engine TP rank gets the full tensor
                self.params[name].copy_(t)
        self.calls.append("update")
        return True, "Success"

    @engine_method
    def release_memory_occupation(self, tags):
        super().release_memory_occupation(tags=tags)
        self.released |= set(tags)

    @engine_method
    def resume_memory_occupation(self, tags):
        super().resume_memory_occupation(tags=tags)
        self.released -= set(tags)

    @engine_method
    def generate(self, **args):
        assert not self.released, f"generate with {self.released} released"
        self.check_generate_args(args)
        self.calls.append(("generate", len(args["input_ids"])))
        outs = []
        with torch.no_grad():
            for ids, sp in zip(args["input_ids"], args["sampling_params"]):
                nxt = int(self.model(torch.tensor([ids])).logits[0, -1].argmax())
                outs.append({"output_ids": [nxt, sp["sampling_seed"]],
                             "meta_info": {"finish_reason": {"type": "length", "length": 2}, "weight_version": "default"}})
        return outs


def _colocated_run(hf_dir: Path):
    import types

    import torch.distributed as dist

    from model_providers import family_for, load_hf_config
    from model_providers.build import build_chunks
    from vapo_megatron import parallel
    from vapo_megatron.data.prompts import PromptRecord
    from vapo_megatron.hf_import import load_hf_weights
    from vapo_megatron.rollout.base import SamplingParams
    from vapo_megatron.rollout.sglang_engine import SGLangEngine
    from vapo_megatron.rollout.weight_sync import sync_weights
    from vapo_megatron.rollout_collect import _generate_and_share, generating_ranks, release_engine_weights

    parallel.init_distributed(2, 1)
    hf_cfg = load_hf_config(hf_dir)
    chunks = build_chunks(hf_cfg, params_dtype=torch.float32, critic=False)
    load_hf_weights(chunks, family_for(hf_cfg), hf_cfg, hf_dir)
    _random_update(chunks)
    greedy = []
    for ids in PROMPTS:  # Megatron's own greedy next token: the reference for the engine's
        logits = _forward(chunks, torch.tensor([ids]), critic=False, vocab=hf_cfg["vocab_size"])
        greedy.append(int(logits[0, -1].argmax()))

    prompts = [PromptRecord(prompt_ids=ids, answer="", source=f"p{i}", prompt_text="") for i, ids in enumerate(PROMPTS)]
    out = {"greedy": greedy}
    for sglang_tp in (1, 2):
        engine = SGLangEngine.colocated(model_path=str(hf_dir), tp_size=sglang_tp, mem_fraction=0.5, dtype="float32",
                                        seed=0, start=lambda c: FakeColocatedSGLangEngineForTests(hf_dir, c))
        sync_weights(chunks, family_for(hf_cfg), hf_cfg, engine, version=7, bucket_bytes=16_000)
        ctx = types.SimpleNamespace(engine=engine, generators=generating_ranks(engine))  # the two fields used
        outputs = _generate_and_share(ctx, prompts, SamplingParams(n=N, temperature=1.0, max_new_tokens=2, seed=SEED))
        release_engine_weights(ctx)
        refused = ""
        if engine.generates:
            try:
                engine.generate([PROMPTS[0]], SamplingParams(n=1))
            except RuntimeError as e:
                refused = str(e)
        out[sglang_tp] = {
            "generators": ctx.generators,
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
                ("resume", ("kv_cache", "cuda_graph")), ("generate", share * N), ("release", ("kv_cache", "cuda_graph")),
                ("release", ("weights",)),  # before training
            ], (sglang_tp, rank, calls)
            assert "released and not loaded again" in res["refused"]
