"""Llama 3.x and Qwen3-MoE against transformers' own *ForCausalLM / *ForTokenClassification, at
EP=2, TP=2 and PP=2 (gloo, CPU, float32), both families in ONE 2-rank run (process start-up and
each layout's initialization are paid once).

The tiny models (tests/helpers/tiny_hf.py) are odd on purpose. Llama (llama_config): head_dim 16
unlike hidden/heads = 12, GQA, a vocabulary Megatron pads (300 -> 512 at TP=2, 384 at TP=1), and
Llama 3.1's llama3 RoPE scaling on, with rotary wavelengths in all three of its bands, so a
scaling megatron applied differently from transformers would change the logits. Qwen3-MoE
(qwen3_moe_config): 4 experts (2 per rank at EP=2), top-2 routing with renormalized weights, an
expert width (24) unlike the dense width (64), one dense layer among four (mlp_only_layers=[2]),
head_dim 12 unlike hidden/heads = 8, GQA and the padded vocabulary.

In each layout a family runs at (FAMILIES), every model (untied, tied, critic) is converted by
vapo-convert's hf-to-mcore (at EP=2 the import reads each rank's own experts by their global
numbers), loaded into freshly built chunks and run forward; at EP=1 it is exported again with
mcore-to-hf. In the layouts of a family's `syncs` the untied actor also gets a random update, is
saved as a dist checkpoint, exported by the trainer's export (every expert gathered over EP;
each stage its own) and synced into an embedded engine on rank 0 (buckets; TP shards gathered;
at PP=2 the second stage's tensors are broadcast to it); the sync checkpoints written at EP=2
and TP=2 are then converted with mcore-to-hf at EP=1, TP=2 (the checkpoint reshards the experts).
The parent compares logits and values with transformers' to 1e-4, the exports bitwise with the
source safetensors, and the engine with the trainer's export, the converted checkpoint and
Megatron's logits.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.dist_utils import run_ranks
from tests.helpers.megatron_ref import load_and_forward, megatron_forward, random_update
from tests.helpers.tiny_hf import input_ids, save_tiny
from tests.helpers.train_runs import hf_weights

KINDS = {"untied": dict(tied=False), "tied": dict(tied=True), "critic": dict(critic=True)}
LAYOUTS = {"ep2": (1, 1, 2), "tp2": (2, 1, 1), "pp2": (1, 2, 1)}  # name: (tp, pp, ep), in the run's order
CONVERTED_SYNCS = ("ep2", "tp2")  # sync checkpoints converted with mcore-to-hf in the TP=2 layout
TOL = 1e-4
VERSION = 3
BUCKET = 16_000  # bytes: several buckets; Llama's padded 512x48 embedding (98 KB) gets one of its own


class Family(NamedTuple):
    arch: str  # transformers' class names: {arch}ForCausalLM, {arch}ForTokenClassification
    seed: int  # the untied model's; tied and critic take the next two
    layouts: tuple[str, ...]  # LAYOUTS it runs at (a dense model has no EP=2 layout)
    syncs: tuple[str, ...]  # LAYOUTS where its actor is updated, exported and synced into an engine


FAMILIES = {"llama": Family("Llama", 10, ("tp2", "pp2"), ("tp2",)),
            "qwen3_moe": Family("Qwen3Moe", 20, ("ep2", "tp2", "pp2"), ("ep2", "pp2"))}
CASES = [(family, tag) for family, spec in FAMILIES.items() for tag in spec.layouts]
SYNCS = [(family, tag) for family, spec in FAMILIES.items() for tag in spec.syncs]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """HF directories of every family's tiny models and transformers' outputs on a fixed batch."""
    root = tmp_path_factory.mktemp("families")
    ids = input_ids(seq=14)
    dirs, refs = {}, {}
    for family, spec in FAMILIES.items():
        for i, (kind, kw) in enumerate(KINDS.items()):
            dirs[family, kind] = root / family / kind
            model = save_tiny(dirs[family, kind], kind=family, seed=spec.seed + i, **kw)
            with torch.no_grad():
                refs[family, kind] = model(ids).logits
        refs[family, "critic"] = refs[family, "critic"][..., 0]
    return dirs, refs, ids


def _sync(hf_dir: Path, out: Path, ids):
    """The untied actor, randomly updated: saved (out-ckpt), exported (out-export, every expert) and
    synced into an engine on rank 0 (at PP=2 the second stage's tensors reach it by broadcast)."""
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
    random_update(chunks)  # different noise per TP shard and EP rank's experts: only a real gather matches

    def meta(tmp: Path) -> None:
        (tmp / "hf").mkdir()
        (tmp / "hf" / "config.json").write_text(json.dumps({k: v for k, v in hf_cfg.items() if k != "_source"}))
        (tmp / META).write_text(json.dumps({"family": family.name, "critic": False, "dtype": "float32"}))

    dist_io.save_model(out.with_name(out.name + "-ckpt"), chunks, write_extra=meta)
    convert.export_hf_dir(chunks, family, hf_cfg, out.with_name(out.name + "-export"), files_src=hf_dir,
                          critic=False, dtype="float32", max_shard_bytes=40_000)
    logits = megatron_forward(chunks, ids, critic=False, vocab=hf_cfg["vocab_size"])
    engine = None
    if dist.get_rank() == 0:
        torch.manual_seed(123)  # a fresh initialization: the sync must replace all of it
        engine = EmbeddedEngine.from_hf_config(AutoConfig.from_pretrained(hf_dir), direct_load=False)
    stats = stream_weights(chunks, family, hf_cfg, engine, version=VERSION, bucket_bytes=BUCKET, transport="auto")
    result = {"megatron_logits": logits, "stats": stats}
    if engine is not None:
        with torch.no_grad():
            result["engine_logits"] = engine.model(ids).logits
        result["engine_state"] = {k: v.clone() for k, v in engine.model.state_dict().items()}
        result["version"] = engine.weight_version
    return result


def _run(dirs: dict, ids, work: Path):
    from megatron.core import parallel_state as ps

    from vapo_megatron.mcore import parallel
    from vapo_megatron.weights import convert

    out = {}
    for tag, (tp, pp, ep) in LAYOUTS.items():
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        parallel.init_distributed(tp, pp, ep=ep)
        for family, spec in FAMILIES.items():
            if tag not in spec.layouts:
                continue
            for kind in KINDS:
                critic, name = kind == "critic", f"{family}-{kind}-{tag}"
                convert.hf_to_mcore(dirs[family, kind], work / name, critic=critic, tp=tp, pp=pp, dtype=None)
                got = load_and_forward(work / name, ids, critic=critic)
                if got is not None and ps.get_tensor_model_parallel_rank() == 0:
                    out[name] = got
                if ep == 1:  # vapo-convert runs at EP=1 (a checkpoint written at EP=2 reshards)
                    convert.mcore_to_hf(work / name, work / f"{name}-hf", tp=tp, pp=pp, max_shard_bytes=40_000)
            if tag in spec.syncs:
                out[f"{family}-sync-{tag}"] = _sync(dirs[family, "untied"], work / f"{family}-sync-{tag}", ids)
        if tag == "tp2":
            for family, sync in SYNCS:
                if sync in CONVERTED_SYNCS:
                    ckpt = work / f"{family}-sync-{sync}-ckpt"
                    convert.mcore_to_hf(ckpt, ckpt.with_name(ckpt.name + "-hf"), tp=tp, pp=pp, max_shard_bytes=40_000)
    return out


@pytest.fixture(scope="module")
def runs(models, tmp_path_factory):
    dirs, _, ids = models
    work = tmp_path_factory.mktemp("families-work")
    return run_ranks(2, _run, dirs, ids, work), work


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize(("family", "tag"), CASES)
def test_matches_transformers(models, runs, family, tag, kind):
    _, refs, _ = models
    per_rank, _ = runs
    name = f"{family}-{kind}-{tag}"
    got = [r[name] for r in per_rank if name in r]
    assert len(got) == (2 if LAYOUTS[tag][2] == 2 else 1)  # at EP=2 both ranks computed the whole batch
    for g in got:
        assert g.shape == refs[family, kind].shape
        torch.testing.assert_close(g, refs[family, kind], atol=TOL, rtol=0)


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize(("family", "tag"), [(f, t) for f, t in CASES if LAYOUTS[t][2] == 1])
def test_round_trips_bitwise(models, runs, family, tag, kind):
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    dirs, refs, ids = models
    _, work = runs
    source = load_file(dirs[family, kind] / "model.safetensors")
    exported = hf_weights(work / f"{family}-{kind}-{tag}-hf")
    assert set(exported) == set(source)
    assert ("lm_head.weight" in source) == (kind == "untied")  # tied: none written; critic: a score head
    for k in source:  # bitwise: same dtype, shape and bytes; Megatron's vocabulary padding never leaks
        assert exported[k].dtype == source[k].dtype and torch.equal(exported[k], source[k]), k
    critic, arch = kind == "critic", FAMILIES[family].arch
    cfg = json.loads((work / f"{family}-{kind}-{tag}-hf" / "config.json").read_text())
    assert cfg["architectures"] == [f"{arch}ForTokenClassification" if critic else f"{arch}ForCausalLM"]
    model = (AutoModelForTokenClassification if critic else AutoModelForCausalLM).from_pretrained(
        work / f"{family}-{kind}-{tag}-hf").eval()
    with torch.no_grad():
        back = model(ids).logits
    torch.testing.assert_close(back[..., 0] if critic else back, refs[family, kind], atol=0, rtol=0)


@pytest.mark.parametrize("tag", FAMILIES["llama"].layouts)
@pytest.mark.parametrize("kind", list(KINDS))
def test_llama3_rope_scaling_survives_the_round_trip(models, runs, kind, tag):
    dirs, _, _ = models
    _, work = runs
    for hf_dir in (dirs["llama", kind], work / f"llama-{kind}-{tag}-hf"):
        assert json.loads((hf_dir / "config.json").read_text())["rope_parameters"]["rope_type"] == "llama3", hf_dir


@pytest.mark.parametrize("tag", [t for t in FAMILIES["qwen3_moe"].layouts if LAYOUTS[t][2] == 1])
@pytest.mark.parametrize("kind", list(KINDS))
def test_qwen3_moe_exports_each_expert_under_its_hub_name(runs, kind, tag):
    _, work = runs
    names = set(json.loads((work / f"qwen3_moe-{kind}-{tag}-hf"
                            / "model.safetensors.index.json").read_text())["weight_map"])
    assert "model.layers.0.mlp.experts.3.down_proj.weight" in names  # per-expert names, as on the Hub


def _engine_tensor(state: dict, name: str) -> torch.Tensor:
    """The engine's tensor of HF name `name`: transformers 5 fuses each MoE layer's experts into
    gate_up_proj [E, 2I, H] = [gate; up] per expert and down_proj [E, H, I]."""
    if ".mlp.experts." not in name:
        return state[name]
    layer, rest = name.split(".mlp.experts.")
    e, proj = int(rest.split(".")[0]), rest.split(".")[1]
    gate_up, down = state[f"{layer}.mlp.experts.gate_up_proj"], state[f"{layer}.mlp.experts.down_proj"]
    half = gate_up.shape[1] // 2
    return {"gate_proj": gate_up[e, :half], "up_proj": gate_up[e, half:], "down_proj": down[e]}[proj]


@pytest.mark.parametrize(("family", "tag"), SYNCS)
def test_weight_sync_into_the_embedded_engine(models, runs, family, tag):
    dirs, _, _ = models
    per_rank, work = runs
    rank0, rank1 = (r[f"{family}-sync-{tag}"] for r in per_rank)
    assert rank0["version"] == VERSION and "engine_state" not in rank1
    export = hf_weights(work / f"{family}-sync-{tag}-export")
    # Every tensor (every expert of every MoE layer) is in the trainer's export, under its HF name ...
    assert set(export) == set(load_file(dirs[family, "untied"] / "model.safetensors"))
    if tag in CONVERTED_SYNCS:  # ... the checkpoint converted at EP=1 (TP=2) gives the same tensors, bitwise ...
        converted = hf_weights(work / f"{family}-sync-{tag}-ckpt-hf")
        assert set(converted) == set(export)
        for name, t in export.items():
            assert torch.equal(converted[name], t), name
    # ... and the engine holds exactly them, and nothing else.
    state = rank0["engine_state"]
    for name, t in export.items():
        assert torch.equal(_engine_tensor(state, name), t), name
    fused = {f"{n.split('.mlp.experts.')[0]}.mlp.experts.{p}" for n in export if ".mlp.experts." in n
             for p in ("gate_up_proj", "down_proj")}
    assert set(state) == {n for n in export if ".mlp.experts." not in n} | fused  # untied: lm_head of its own
    assert rank0["stats"].tensors == len(export) and rank0["stats"].buckets > 1
    for s in (rank0["stats"], rank1["stats"]):
        assert s.peak_bytes <= s.bound(), s
    # ... and computes what Megatron computes (transformers' llama3 RoPE and experts vs megatron's).
    # Megatron's logits are on the last stage: both ranks at EP=2 and TP=2, rank 1 at PP=2.
    last = [r["megatron_logits"] for r in (rank0, rank1) if r["megatron_logits"] is not None]
    assert len(last) == (1 if LAYOUTS[tag][1] == 2 else 2)
    for logits in last:
        torch.testing.assert_close(rank0["engine_logits"], logits, atol=TOL, rtol=0)
        torch.testing.assert_close(logits, last[0], atol=0, rtol=0)


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
        keys = set(FileSystemReader(str(work / f"qwen3_moe-{ckpt}")).read_metadata().state_dict_metadata)
        for layer in range(4):
            p = f"decoder.layers.{layer}."
            assert p + "self_attention.linear_qkv.layer_norm_weight" in keys, (ckpt, layer)
            dense = layer == 2
            assert (p + "mlp.linear_fc1.layer_norm_weight" in keys) == dense, (ckpt, layer)
            assert (p + "pre_mlp_layernorm.weight" in keys) == (not dense), (ckpt, layer)
