"""Llama 3.x against transformers' own LlamaForCausalLM / LlamaForTokenClassification, at TP=2 and
PP=2 (gloo, CPU, float32).

The tiny models (tests/helpers/tiny_hf.py llama_config) have head_dim 16 unlike hidden/heads = 12,
GQA, a vocabulary Megatron pads (300 -> 512 at TP=2, 384 at TP=1), and Llama 3.1's llama3 RoPE
scaling on, with rotary wavelengths in all three of its bands, so a scaling megatron applied
differently from transformers would change the logits. One 2-rank run does both layouts (process
start-up dominates): in each, every model (untied, tied, critic) is converted with vapo-convert's
hf-to-mcore, loaded into freshly built chunks, run forward, and exported with mcore-to-hf. At
TP=2 the untied actor also gets a random update and is synced into an embedded engine (buckets,
TP shards gathered), the updated actor being exported by mcore-to-hf as the reference.
The parent compares: logits / values with transformers' to 1e-4, the exports bitwise with the
source safetensors, the engine's tensors bitwise with the export and its logits with Megatron's.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.dist_utils import run_ranks
from tests.helpers.megatron_ref import megatron_forward, random_update
from tests.helpers.tiny_hf import input_ids, save_tiny

KINDS = {"untied": dict(tied=False), "tied": dict(tied=True), "critic": dict(critic=True)}
TOL = 1e-4
BUCKET = 16_000  # bytes: several buckets; the padded 512x48 embedding (98 KB) gets one of its own


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """HF directories of the tiny Llama models and transformers' outputs on a fixed batch."""
    root = tmp_path_factory.mktemp("llama")
    ids = input_ids(seq=14)
    dirs, refs = {}, {}
    for i, (kind, kw) in enumerate(KINDS.items()):
        dirs[kind] = root / kind
        model = save_tiny(dirs[kind], kind="llama", seed=10 + i, **kw)
        assert model.config.rope_parameters["rope_type"] == "llama3"
        with torch.no_grad():
            refs[kind] = model(ids).logits
    refs["critic"] = refs["critic"][..., 0]
    return dirs, refs, ids


def _load_and_forward(ckpt: Path, ids, *, critic: bool):
    from vapo_megatron.checkpoint import dist_io
    from vapo_megatron.mcore.models import build_chunks

    hf_cfg = json.loads((ckpt / "hf" / "config.json").read_text())
    chunks = build_chunks(hf_cfg, params_dtype=torch.float32, critic=critic)
    dist_io.load_model(ckpt, chunks)
    return megatron_forward(chunks, ids, critic=critic, vocab=hf_cfg["vocab_size"])


def _sync(hf_dir: Path, work: Path, ids):
    """The untied actor, randomly updated, exported (reference) and synced into an engine on rank 0."""
    import torch.distributed as dist
    from transformers import AutoConfig

    from model_providers import family_for, read_hf_config
    from vapo_megatron.checkpoint import dist_io
    from vapo_megatron.mcore.models import build_chunks
    from vapo_megatron.rollout.embedded import EmbeddedEngine
    from vapo_megatron.rollout.weight_sync import stream_weights
    from vapo_megatron.weights import convert
    from vapo_megatron.weights.hf_read import load_hf_weights
    from vapo_megatron.weights.hf_write import META

    hf_cfg = read_hf_config(hf_dir)
    family = family_for(hf_cfg)
    chunks = build_chunks(hf_cfg, params_dtype=torch.float32, critic=False)
    load_hf_weights(chunks, family, hf_cfg, hf_dir)
    random_update(chunks)

    def meta(tmp: Path) -> None:
        (tmp / "hf").mkdir()
        (tmp / "hf" / "config.json").write_text(json.dumps({k: v for k, v in hf_cfg.items() if k != "_source"}))
        (tmp / META).write_text(json.dumps({"family": family.name, "critic": False, "dtype": "float32"}))

    dist_io.save_model(work / "synced-ckpt", chunks, write_extra=meta)
    convert.mcore_to_hf(work / "synced-ckpt", work / "synced-hf", tp=2, pp=1, max_shard_bytes=1 << 30)
    logits = megatron_forward(chunks, ids, critic=False, vocab=hf_cfg["vocab_size"])
    engine = None
    if dist.get_rank() == 0:
        torch.manual_seed(123)  # a fresh initialization: the sync must replace all of it
        engine = EmbeddedEngine.from_hf_config(AutoConfig.from_pretrained(hf_dir), direct_load=False)
    stats = stream_weights(chunks, family, hf_cfg, engine, version=3, bucket_bytes=BUCKET, transport="auto")
    out = {"megatron_logits": logits, "stats": stats}
    if engine is not None:
        with torch.no_grad():
            out["engine_logits"] = engine.model(ids).logits
        out["engine_state"] = {k: v.clone() for k, v in engine.model.state_dict().items()}
        out["version"] = engine.weight_version
    return out


def _run(dirs: dict, ids, work: Path):
    from megatron.core import parallel_state as ps

    from vapo_megatron.mcore import parallel
    from vapo_megatron.weights import convert

    out = {}
    for tp, pp in ((2, 1), (1, 2)):
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        parallel.init_distributed(tp, pp)
        tag = f"tp{tp}pp{pp}"
        for kind in KINDS:
            critic = kind == "critic"
            ckpt = work / f"{kind}-{tag}"
            convert.hf_to_mcore(dirs[kind], ckpt, critic=critic, tp=tp, pp=pp, dtype=None)
            got = _load_and_forward(ckpt, ids, critic=critic)
            if got is not None and ps.get_tensor_model_parallel_rank() == 0:
                out[f"{kind}-{tag}"] = got
            convert.mcore_to_hf(ckpt, work / f"{kind}-{tag}-hf", tp=tp, pp=pp, max_shard_bytes=40_000)
        if tp == 2:
            out["sync"] = _sync(dirs["untied"], work, ids)
    return out


@pytest.fixture(scope="module")
def runs(models, tmp_path_factory):
    dirs, _, ids = models
    work = tmp_path_factory.mktemp("llama-work")
    return run_ranks(2, _run, dirs, ids, work), work


def _exported(dst: Path) -> dict[str, torch.Tensor]:
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    out = {}
    for f in sorted(set(index["weight_map"].values())):
        out.update(load_file(dst / f))
    assert set(out) == set(index["weight_map"])
    return out


@pytest.mark.parametrize("tag", ["tp2pp1", "tp1pp2"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_llama_matches_transformers_and_round_trips_bitwise(models, runs, kind, tag):
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    dirs, refs, ids = models
    per_rank, work = runs
    (got,) = [r[f"{kind}-{tag}"] for r in per_rank if f"{kind}-{tag}" in r]
    assert got.shape == refs[kind].shape
    torch.testing.assert_close(got, refs[kind], atol=TOL, rtol=0)

    source = load_file(dirs[kind] / "model.safetensors")
    exported = _exported(work / f"{kind}-{tag}-hf")
    assert set(exported) == set(source)
    assert ("lm_head.weight" in source) == (kind == "untied")  # tied: none written; critic: a score head
    for k in source:  # bitwise: same dtype, shape and bytes; Megatron's vocabulary padding never leaks
        assert exported[k].dtype == source[k].dtype and torch.equal(exported[k], source[k]), k

    critic = kind == "critic"
    cfg = json.loads((work / f"{kind}-{tag}-hf" / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForTokenClassification" if critic else "LlamaForCausalLM"]
    assert cfg["rope_parameters"]["rope_type"] == "llama3"  # the scaling survives the round trip
    model = (AutoModelForTokenClassification if critic else AutoModelForCausalLM).from_pretrained(
        work / f"{kind}-{tag}-hf").eval()
    with torch.no_grad():
        back = model(ids).logits
    torch.testing.assert_close(back[..., 0] if critic else back, refs[kind], atol=0, rtol=0)


def test_llama_weight_sync_into_the_embedded_engine_at_tp2(runs):
    per_rank, work = runs
    rank0, rank1 = per_rank[0]["sync"], per_rank[1]["sync"]
    assert rank0["version"] == 3 and "engine_state" not in rank1
    # The engine equals mcore-to-hf's export of the same updated actor, tensor for tensor.
    written = _exported(work / "synced-hf")
    state = rank0["engine_state"]
    assert set(written) == set(state)  # untied: lm_head is a tensor of its own
    for name, t in written.items():
        assert torch.equal(state[name], t), name
    assert rank0["stats"].tensors == len(state) and rank0["stats"].buckets > 1
    # ... and computes what Megatron computes (transformers' llama3 RoPE vs megatron's).
    torch.testing.assert_close(rank0["engine_logits"], rank0["megatron_logits"], atol=TOL, rtol=0)
    for s in (rank0["stats"], rank1["stats"]):
        assert s.peak_bytes <= s.bound(), s
