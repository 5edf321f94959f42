"""Qwen3-MoE against transformers' own Qwen3MoeForCausalLM / Qwen3MoeForTokenClassification at
EP=2, TP=2 and PP=2 (gloo, CPU, float32).

The tiny models (tests/helpers/tiny_hf.py qwen3_moe_config) have 4 experts (2 per rank at EP=2),
top-2 routing with renormalized weights, an expert width (24) unlike the dense width (64), one
dense layer among four (mlp_only_layers=[2]), head_dim 12 unlike hidden/heads = 8, GQA and a
vocabulary Megatron pads. One 2-rank run does the three layouts. In each, every model (untied,
tied, critic) is converted by vapo-convert's hf-to-mcore (at EP=2 the import reads each rank's
own experts by their global numbers), loaded into freshly built chunks and run forward; at
TP=2 and PP=2 it is exported again with mcore-to-hf. At EP=2 and PP=2 the untied actor also gets
a random update, is saved as a dist checkpoint, exported by the trainer's export (every expert
gathered over EP; each stage its own) and synced into an embedded engine on rank 0 (at PP=2 the
second stage's experts are broadcast to it); the EP=2 checkpoint is then converted with
mcore-to-hf at EP=1, TP=2 (the checkpoint reshards the experts). The parent compares logits and
values with transformers' to 1e-4, the exports bitwise with the source safetensors, and the
engine with the trainer's export and Megatron's logits.
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
from tests.helpers.train_runs import hf_weights

KINDS = {"untied": dict(tied=False), "tied": dict(tied=True), "critic": dict(critic=True)}
LAYOUTS = {"ep2": (1, 1, 2), "tp2": (2, 1, 1), "pp2": (1, 2, 1)}  # name: (tp, pp, ep)
TOL = 1e-4


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """HF directories of the tiny Qwen3-MoE models and transformers' outputs on a fixed batch."""
    root = tmp_path_factory.mktemp("qwen3moe")
    ids = input_ids(seq=14)
    dirs, refs = {}, {}
    for i, (kind, kw) in enumerate(KINDS.items()):
        dirs[kind] = root / kind
        model = save_tiny(dirs[kind], kind="qwen3_moe", seed=20 + i, **kw)
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


def _sync(hf_dir: Path, work: Path, ids, tag: str):
    """The untied actor, randomly updated: saved, exported (every expert) and synced into an
    engine on rank 0 (at PP=2 the second stage's experts reach it by broadcast)."""
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
    random_update(chunks)  # different noise per EP rank's experts: only a real gather matches

    def meta(tmp: Path) -> None:
        (tmp / "hf").mkdir()
        (tmp / "hf" / "config.json").write_text(json.dumps({k: v for k, v in hf_cfg.items() if k != "_source"}))
        (tmp / META).write_text(json.dumps({"family": family.name, "critic": False, "dtype": "float32"}))

    dist_io.save_model(work / f"{tag}-ckpt", chunks, write_extra=meta)
    convert.export_hf_dir(chunks, family, hf_cfg, work / f"{tag}-export", files_src=hf_dir, critic=False,
                          dtype="float32", max_shard_bytes=40_000)
    logits = megatron_forward(chunks, ids, critic=False, vocab=hf_cfg["vocab_size"])
    engine = None
    if dist.get_rank() == 0:
        torch.manual_seed(123)  # a fresh initialization: the sync must replace all of it
        engine = EmbeddedEngine.from_hf_config(AutoConfig.from_pretrained(hf_dir), direct_load=False)
    stats = stream_weights(chunks, family, hf_cfg, engine, version=5, bucket_bytes=16_000)
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
    for tag, (tp, pp, ep) in LAYOUTS.items():
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        parallel.init_distributed(tp, pp, ep=ep)
        for kind in KINDS:
            critic = kind == "critic"
            ckpt = work / f"{kind}-{tag}"
            convert.hf_to_mcore(dirs[kind], ckpt, critic=critic, tp=tp, pp=pp, dtype=None)
            got = _load_and_forward(ckpt, ids, critic=critic)
            if got is not None and ps.get_tensor_model_parallel_rank() == 0:
                out[f"{kind}-{tag}"] = got
            if ep == 1:  # vapo-convert runs at EP=1 (a checkpoint written at EP=2 reshards)
                convert.mcore_to_hf(ckpt, work / f"{kind}-{tag}-hf", tp=tp, pp=pp, max_shard_bytes=40_000)
        if tag in ("ep2", "pp2"):
            out[f"sync-{tag}"] = _sync(dirs["untied"], work, ids, tag)
        if tag == "tp2":
            convert.mcore_to_hf(work / "ep2-ckpt", work / "ep2-ckpt-hf", tp=tp, pp=pp, max_shard_bytes=40_000)
    return out


@pytest.fixture(scope="module")
def runs(models, tmp_path_factory):
    dirs, _, ids = models
    work = tmp_path_factory.mktemp("qwen3moe-work")
    return run_ranks(2, _run, dirs, ids, work), work


@pytest.mark.parametrize("tag", list(LAYOUTS))
@pytest.mark.parametrize("kind", list(KINDS))
def test_qwen3_moe_matches_transformers(models, runs, kind, tag):
    _, refs, _ = models
    per_rank, _ = runs
    got = [r[f"{kind}-{tag}"] for r in per_rank if f"{kind}-{tag}" in r]
    assert len(got) == (2 if tag == "ep2" else 1)  # at EP=2 both ranks computed the whole batch
    for g in got:
        assert g.shape == refs[kind].shape
        torch.testing.assert_close(g, refs[kind], atol=TOL, rtol=0)


@pytest.mark.parametrize("tag", ["tp2", "pp2"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_qwen3_moe_round_trips_bitwise(models, runs, kind, tag):
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    dirs, refs, ids = models
    _, work = runs
    source = load_file(dirs[kind] / "model.safetensors")
    exported = hf_weights(work / f"{kind}-{tag}-hf")
    assert set(exported) == set(source)
    assert "model.layers.0.mlp.experts.3.down_proj.weight" in source  # per-expert names, as on the Hub
    for k in source:
        assert exported[k].dtype == source[k].dtype and torch.equal(exported[k], source[k]), k
    critic = kind == "critic"
    cfg = json.loads((work / f"{kind}-{tag}-hf" / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3MoeForTokenClassification" if critic else "Qwen3MoeForCausalLM"]
    model = (AutoModelForTokenClassification if critic else AutoModelForCausalLM).from_pretrained(
        work / f"{kind}-{tag}-hf").eval()
    with torch.no_grad():
        back = model(ids).logits
    torch.testing.assert_close(back[..., 0] if critic else back, refs[kind], atol=0, rtol=0)


@pytest.mark.parametrize("tag", ["ep2", "pp2"])
def test_qwen3_moe_weight_sync_and_export(models, runs, tag):
    dirs, _, _ = models
    per_rank, work = runs
    rank0, rank1 = per_rank[0][f"sync-{tag}"], per_rank[1][f"sync-{tag}"]
    assert rank0["version"] == 5 and "engine_state" not in rank1
    export = hf_weights(work / f"{tag}-export")
    # Every expert of every MoE layer is in the trainer's export, under its HF name ...
    assert set(export) == set(load_file(dirs["untied"] / "model.safetensors"))
    if tag == "ep2":  # ... the EP=2 checkpoint converted at EP=1 (TP=2) gives the same tensors, bitwise ...
        converted = hf_weights(work / "ep2-ckpt-hf")
        assert set(converted) == set(export)
        for name, t in export.items():
            assert torch.equal(converted[name], t), name
    # ... and the engine holds exactly them: transformers 5 fuses each layer's experts into
    # gate_up_proj [E, 2I, H] = [gate; up] per expert and down_proj [E, H, I].
    state = rank0["engine_state"]
    for name, t in export.items():
        if ".mlp.experts." in name:
            layer, rest = name.split(".mlp.experts.")
            e, proj = int(rest.split(".")[0]), rest.split(".")[1]
            gate_up, down = state[f"{layer}.mlp.experts.gate_up_proj"], state[f"{layer}.mlp.experts.down_proj"]
            half = gate_up.shape[1] // 2
            got = {"gate_proj": gate_up[e, :half], "up_proj": gate_up[e, half:], "down_proj": down[e]}[proj]
        else:
            got = state[name]
        assert torch.equal(got, t), name
    # Megatron's logits are on the last stage: rank 0 at EP=2 (both ranks compute them), rank 1 at PP=2.
    megatron_logits = rank0["megatron_logits"] if tag == "ep2" else rank1["megatron_logits"]
    torch.testing.assert_close(rank0["engine_logits"], megatron_logits, atol=TOL, rtol=0)
    if tag == "ep2":
        torch.testing.assert_close(rank1["megatron_logits"], rank0["megatron_logits"], atol=0, rtol=0)


def test_moe_checkpoints_hold_transformer_engines_keys(runs):
    """Issue 32 defect 3: a checkpoint written here (megatron's local spec, no TE) names each layer's
    norms as Transformer Engine's spec does, so a GPU run's checkpoint and a CPU tool agree (the
    loads above then read TE's keys through the CPU path). The reference is TE's spec in
    megatron-core 0.19.2 (gpt_layer_specs.py): it fuses the input norm into linear_qkv in every
    layer and the pre-MLP norm into linear_fc1 in a dense layer; an expert layer keeps its
    pre_mlp_layernorm (TENorm). The tiny model's layer 2 is its dense one (mlp_only_layers=[2])."""
    from torch.distributed.checkpoint import FileSystemReader

    _, work = runs
    for ckpt in ("untied-tp2", "untied-ep2", "critic-pp2"):
        keys = set(FileSystemReader(str(work / ckpt)).read_metadata().state_dict_metadata)
        for layer in range(4):
            p = f"decoder.layers.{layer}."
            assert p + "self_attention.linear_qkv.layer_norm_weight" in keys, (ckpt, layer)
            dense = layer == 2
            assert (p + "mlp.linear_fc1.layer_norm_weight" in keys) == dense, (ckpt, layer)
            assert (p + "pre_mlp_layernorm.weight" in keys) == (not dense), (ckpt, layer)
