"""Weight sync from a Megatron actor (TP=2, PP=2, TP=2 x PP=2 on gloo) into embedded engines.

One multi-rank run per case. Inside it: the tiny HF model is loaded into the actor (hf_import),
every parameter gets a random update, the updated actor is written back to HF safetensors by
mcore-to-hf (the reference for the streamed tensors; one case), and stream_weights pushes the
actor into EmbeddedEngines (on global rank 0, or on every rank as colocated SGLang engines
would be), either straight into their parameters or through small buckets, with TP shards
travelling through shared memory or gloo collectives. The parent checks: engine tensors ==
mcore-to-hf's files bitwise, every engine's logits == the Megatron actor's logits to 1e-4 on
the same sequences, and the measured peak bytes on every rank <= one bucket + the largest
tensor.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from model_providers.layouts import hf_shapes, mcore_to_hf, place_shard, shard, unshard
from model_providers.table import Row
from tests.helpers.dist_utils import run_ranks
from tests.helpers.megatron_ref import megatron_forward, random_update
from tests.helpers.tiny_hf import input_ids, save_tiny

BUCKET = 16_000  # bytes: many buckets; the 300x32 embedding (38 KB) is larger than one



def _sync_run(tp: int, pp: int, hf_dir: Path, work: Path, ids, with_export: bool, setups):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from transformers import AutoConfig

    from model_providers import family_for, read_hf_config
    from vapo_megatron.checkpoint import dist_io
    from vapo_megatron.mcore import parallel
    from vapo_megatron.mcore.models import build_chunks
    from vapo_megatron.rollout.embedded import EmbeddedEngine
    from vapo_megatron.rollout.weight_sync import stream_weights
    from vapo_megatron.weights import convert
    from vapo_megatron.weights.hf_read import load_hf_weights
    from vapo_megatron.weights.hf_write import META

    parallel.init_distributed(tp, pp)
    hf_cfg = read_hf_config(hf_dir)
    family = family_for(hf_cfg)
    chunks = build_chunks(hf_cfg, params_dtype=torch.float32, critic=False)
    load_hf_weights(chunks, family, hf_cfg, hf_dir)
    random_update(chunks)

    if with_export:  # the reference: the updated actor written to HF files by mcore-to-hf
        def meta(tmp: Path) -> None:
            (tmp / "hf").mkdir()
            (tmp / "hf" / "config.json").write_text(json.dumps({k: v for k, v in hf_cfg.items() if k != "_source"}))
            (tmp / META).write_text(json.dumps({"family": family.name, "critic": False, "dtype": "float32"}))

        dist_io.save_model(work / "ckpt", chunks, write_extra=meta)
        convert.mcore_to_hf(work / "ckpt", work / "hf1", tp=tp, pp=pp, max_shard_bytes=1 << 30)

    megatron_logits = megatron_forward(chunks, ids, critic=False, vocab=hf_cfg["vocab_size"])
    outs = []
    for engines, direct, transport in setups:
        engine = None
        if engines == "all" or dist.get_rank() == 0:
            torch.manual_seed(123 + dist.get_rank())  # a fresh, different initialization: the sync must replace it all
            engine = EmbeddedEngine.from_hf_config(AutoConfig.from_pretrained(hf_dir), direct_load=direct)
        stats = [stream_weights(chunks, family, hf_cfg, engine, version=v, bucket_bytes=BUCKET, transport=transport)
                 for v in (4, 5)]  # the second sync reuses the shared-memory staging of the first
        out = {"stats": stats[-1]}
        if engine is not None:
            with torch.no_grad():
                out["engine_logits"] = engine.model(ids).logits
            out["engine_state"] = {k: v.clone() for k, v in engine.model.state_dict().items()}
            out["version"] = engine.weight_version
        outs.append(out)
    return {"megatron_logits": megatron_logits if ps.get_tensor_model_parallel_rank() == 0 else None, "setups": outs}


def _check(ref_logits, results, work: Path, *, tied: bool, with_export: bool, direct: bool, tp: int):
    """results: every rank's output of one sync setup."""
    holders = [r for r, res in enumerate(results) if "engine_state" in res]
    for r in holders:
        res = results[r]
        assert res["version"] == 5
        assert torch.allclose(res["engine_logits"], ref_logits, atol=1e-4, rtol=0), (
            r, (res["engine_logits"] - ref_logits).abs().max())
        assert res["stats"].tensors == len(res["engine_state"]) - (1 if tied else 0)
        assert (res["stats"].buckets == 0) == direct

    state = results[0]["engine_state"]
    if with_export:
        written = {}
        for f in sorted((work / "hf1").glob("*.safetensors")):
            written.update(load_file(f))
        assert ("lm_head.weight" in written) == (not tied)
        assert set(written) <= set(state) and set(state) - set(written) <= {"lm_head.weight"}
        for name, t in written.items():
            assert torch.equal(state[name], t), name

    for r, res in enumerate(results):
        s = res["stats"]
        assert s.peak_bytes <= s.bound(), (r, s)
    # The largest tensor is the embedding, padded by Megatron to a multiple of 128 * TP rows.
    s0 = results[0]["stats"]
    assert s0.largest_tensor_bytes == -(-300 // (128 * tp)) * 128 * tp * 32 * 4 > BUCKET
    if not direct:
        assert s0.buckets > 3 and s0.peak_bytes > BUCKET  # the embedding got a bucket of its own


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    save_tiny(root / "untied", tied=False, seed=3)
    save_tiny(root / "tied", tied=True, seed=4)
    return root


# One spawned run per layout (start-up dominates); several sync setups in each:
# (engines on "rank0" or on "all" ranks as colocated SGLang would be, direct into parameters or
# through buckets, TP transport). mcore-to-hf (a dist checkpoint round trip) costs seconds: the
# reference export runs in the TP=2 x PP=2 layout only; the logits check runs everywhere.
LAYOUTS = {
    # Rank 0 reads rank 1's shards from shared memory straight into its parameters; then every
    # TP rank both writes and reads shards, into buckets.
    "tp2": (2, 1, "untied", False, [("rank0", True, "auto"), ("all", False, "shm")]),
    # An engine on each stage: each stage broadcasts its layers to the other. Tied embeddings.
    "pp2": (1, 2, "tied", False, [("all", True, "auto")]),
    # Buckets and gloo gathers, against mcore-to-hf's files; then engines on every rank, direct,
    # shared memory (stage senders write into their parameters and broadcast from them).
    "tp2pp2": (2, 2, "untied", True, [("rank0", False, "collective"), ("all", True, "shm")]),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_sync_into_embedded_engine(layout, hf_dirs, tmp_path):
    tp, pp, kind, with_export, setups = LAYOUTS[layout]
    ids = input_ids(batch=2, seq=10)
    runs = run_ranks(tp * pp, _sync_run, tp, pp, hf_dirs / kind, tmp_path, ids, with_export, setups)
    (ref_logits,) = [r["megatron_logits"] for r in runs if r["megatron_logits"] is not None]
    for i, (engines, direct, transport) in enumerate(setups):
        results = [run["setups"][i] for run in runs]
        _check(ref_logits, results, tmp_path, tied=kind == "tied", with_export=with_export, direct=direct, tp=tp)
        if pp > 1 and engines == "rank0":
            # Ranks are TP-fastest: rank tp is (tp 0, stage 1), in the engine's PP group; it sent
            # its layers. At TP=2 the last rank's PP group holds no engine, so it sent nothing.
            later = results[tp]["stats"]
            assert later.sent > 0 and later.tensors == 0
            if tp > 1:
                assert results[-1]["stats"].sent == 0
        if transport != "collective" and tp > 1:
            # Shared memory was used: a writer holds its staging area, 2 x its largest shard.
            writer = results[1]["stats"]
            assert writer.peak_bytes >= writer.largest_tensor_bytes * 2 // tp


# GQA (8 query heads, 4 groups), vocab 300 padded to 384 rows, ffn 24.
_CFG = {"num_attention_heads": 8, "num_key_value_heads": 4, "hidden_size": 16, "vocab_size": 300}


@pytest.mark.parametrize("row, full_shape, partition_dim", [
    (Row("qkv.weight", ("q", "k", "v"), "qkv"), ((8 + 2 * 4) * 2, 16), 0),
    (Row("qkv.bias", ("q", "k", "v"), "qkv"), ((8 + 2 * 4) * 2,), 0),
    (Row("fc1.weight", ("gate", "up"), "gate_up"), (48, 16), 0),
    (Row("proj.weight", ("o",), "copy"), (16, 40), 1),
    (Row("fc2.weight", ("down",), "copy"), (16, 24), 1),
    (Row("emb.weight", ("embed",), "vocab"), (384, 16), 0),
    (Row("norm.weight", ("norm",), "copy"), (16,), 0),
])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_place_shard_equals_unshard_then_mcore_to_hf(row, full_shape, partition_dim, tp):
    """Placing every rank's shard into the HF tensors, one HF tensor at a time (as the sync
    does), gives exactly mcore_to_hf of the full tensor (the converter's reference path)."""
    full = torch.randn(full_shape, generator=torch.Generator().manual_seed(tp))
    want = mcore_to_hf(row, full, _CFG)
    shards = [shard(row.layout, full, partition_dim, tp, r) for r in range(tp)]
    assert torch.equal(unshard(row.layout, shards, partition_dim), full)
    shapes = hf_shapes(row, full_shape, _CFG)
    assert shapes == [t.shape for _, t in want]
    for j, (name, ref) in enumerate(want):
        out = torch.full(shapes[j], float("nan"), dtype=torch.float64)  # copy_ casts into any dtype
        outs = [None] * len(want)
        outs[j] = out
        for r, s in enumerate(shards):
            place_shard(row, s.clone(), r, tp, partition_dim, outs, _CFG)
        assert torch.equal(out, ref.double()), (row.mcore, name)


