"""HF -> Megatron -> HF against transformers' own Qwen2 models, at TP=1, TP=2, PP=2, TP=2 x PP=2.

One multi-rank run per layout (each costs seconds): inside it, every tiny model (untied, tied,
critic from Qwen2ForTokenClassification) is converted with vapo-convert's hf-to-mcore at that
layout, loaded from the written dist checkpoint into freshly built (differently initialized)
chunks, run forward, and exported back with mcore-to-hf at that layout. The parent compares:
logits / values with transformers' to 1e-4 (float32), every exported tensor bitwise with the
source safetensors, and that transformers loads the export.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.dist_utils import run_ranks
from tests.helpers.megatron_ref import load_and_forward
from tests.helpers.tiny_hf import input_ids, save_tiny, save_tiny_tokenizer

KINDS = ("untied", "tied", "critic")
TOL = 1e-4


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """HF directories of the tiny models and transformers' outputs on a fixed batch."""
    root = tmp_path_factory.mktemp("hf")
    ids = input_ids()
    dirs, refs = {}, {}
    for kind, kw in {
        "untied": dict(tied=False), "tied": dict(tied=True), "critic": dict(critic=True), "qwen3": dict(kind="qwen3"),
    }.items():
        dirs[kind] = root / kind
        model = save_tiny(dirs[kind], seed=len(dirs), **kw)
        with torch.no_grad():
            refs[kind] = model(ids).logits  # critic: [B, T, 1]
    refs["critic"] = refs["critic"][..., 0]
    save_tiny_tokenizer(dirs["untied"])
    return dirs, refs, ids, root



def _layout_run(tp: int, pp: int, dirs: dict, ids, work: Path, extra: dict):
    from megatron.core import parallel_state as ps

    from vapo_megatron.mcore import parallel
    from vapo_megatron.weights import convert

    if ps.model_parallel_is_initialized():  # the previous layout of this world
        ps.destroy_model_parallel()
    parallel.init_distributed(tp, pp)
    out = {}
    tag = f"tp{tp}pp{pp}"
    for kind in KINDS + tuple(extra.get("kinds", ())):
        critic = kind == "critic"
        ckpt = work / f"{kind}-{tag}"
        convert.hf_to_mcore(dirs[kind], ckpt, critic=critic, tp=tp, pp=pp, dtype=None)
        out[kind] = load_and_forward(ckpt, ids, critic=critic)
        # Small shards so that each stage writes several files.
        convert.mcore_to_hf(ckpt, work / f"{kind}-{tag}-hf", tp=tp, pp=pp, max_shard_bytes=40_000)
    for name, (ckpt, critic) in extra.get("reshard", {}).items():
        out[name] = load_and_forward(ckpt, ids, critic=critic)
        # and exported at this layout: mcore-to-hf reads slices of other shapes (and another
        # vocabulary padding) than were written
        convert.mcore_to_hf(ckpt, work / f"{name}-{tag}-hf", tp=tp, pp=pp, max_shard_bytes=40_000)
    if "fresh_critic" in extra:  # a critic made from a causal LM: fresh value head
        convert.hf_to_mcore(dirs["untied"], work / f"fresh-{tag}", critic=True, tp=tp, pp=pp, dtype=None)
        out["fresh_critic"] = load_and_forward(work / f"fresh-{tag}", ids, critic=True)
        convert.mcore_to_hf(work / f"fresh-{tag}", work / f"fresh-{tag}-hf", tp=tp, pp=pp, max_shard_bytes=2**30)
    reporter = (ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0
                and ps.get_data_parallel_rank() == 0)
    return out if reporter else None


def _critic_ddp_grads(work: Path, ids):
    """The critic (value head included) under megatron's DDP at the current layout: each DP
    rank gets its own batch; after finish_grad_sync the value head's gradient must be the DP
    average, identical on every rank. Returns (this rank's own-batch grad, synced grad)."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from vapo_megatron.mcore.models import build_chunks

    hf_cfg = json.loads((work / "critic-tp2pp1" / "hf" / "config.json").read_text())
    (critic,) = build_chunks(hf_cfg, params_dtype=torch.float32, critic=True)
    model = DistributedDataParallel(config=critic.config, ddp_config=DistributedDataParallelConfig(), module=critic)
    batch = ids.roll(ps.get_data_parallel_rank(), dims=1)  # a different batch per DP rank
    pos = torch.arange(batch.shape[1]).expand_as(batch)
    model.zero_grad_buffer()
    values = model(batch, pos, None)  # [B, T]
    assert values.shape == batch.shape and values.dtype == torch.float32
    values.square().mean().backward()
    own = critic.value_head.weight.main_grad.clone()
    model.finish_grad_sync()
    return own, critic.value_head.weight.main_grad.clone()


def _vpp_run(dirs: dict, work: Path):
    """PP=2 with 2 virtual stages per rank: import, stream out (global layer numbers across
    interleaved chunks) and save a dist checkpoint that the TP=1 layout loads."""
    from megatron.core import parallel_state as ps

    from model_providers import QWEN2, read_hf_config
    from vapo_megatron.checkpoint import dist_io
    from vapo_megatron.mcore import parallel
    from vapo_megatron.mcore.models import build_chunks
    from vapo_megatron.weights.hf_read import load_hf_weights
    from vapo_megatron.weights.params import iter_hf_tensors

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    parallel.init_distributed(1, 2, 2)
    hf_cfg = read_hf_config(dirs["untied"])
    chunks = build_chunks(hf_cfg, params_dtype=torch.float32, critic=False)
    assert len(chunks) == 2
    load_hf_weights(chunks, QWEN2, hf_cfg, dirs["untied"])
    streamed = dict(iter_hf_tensors(chunks, QWEN2, hf_cfg))

    def write_config(tmp: Path) -> None:  # rank 0, inside the temp dir before the rename
        (tmp / "hf").mkdir()
        (tmp / "hf" / "config.json").write_text(json.dumps({k: v for k, v in hf_cfg.items() if k != "_source"}))
        (tmp / "vapo.json").write_text(json.dumps({"family": QWEN2.name, "critic": False, "dtype": "float32"}))

    # megatron's own writer (the trainer's): mcore-to-hf reads it too
    dist_io.save_model(work / "untied-vpp", chunks, write_extra=write_config)
    return streamed if ps.get_data_parallel_rank() == 0 else {}


def _all_layouts(dirs: dict, ids, work: Path):
    """Every layout in one 4-rank world (process start-up dominates the cost on a small machine):
    TP=2 x PP=2, TP=2 (DP=2), PP=2 (DP=2), then TP=1 (DP=4), which also loads checkpoints
    written at TP=2."""
    tp1_extra = {
        "kinds": ("qwen3",),
        # Written at TP=2 (vocab padded to 512), loaded at TP=1 (padded to 384).
        "reshard": {"untied_from_tp2": (work / "untied-tp2pp1", False),
                    "critic_from_tp2": (work / "critic-tp2pp1", True)},
        "fresh_critic": True,
    }
    tp1_extra["reshard"]["untied_from_vpp"] = (work / "untied-vpp", False)
    out = {"vpp": _vpp_run(dirs, work)}
    for tp, pp, extra in ((2, 2, {}), (2, 1, {}), (1, 2, {}), (1, 1, tp1_extra)):
        out[f"tp{tp}pp{pp}"] = _layout_run(tp, pp, dirs, ids, work, extra)
        if (tp, pp) == (2, 1):  # TP=2 x DP=2
            out["ddp"] = _critic_ddp_grads(work, ids)
    return out


def _last(results):
    (out,) = [r for r in results if r is not None]
    return out


def _check_export(src: Path, dst: Path, *, critic: bool, ref: torch.Tensor, ids):
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    source = load_file(src / "model.safetensors")
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    exported = {}
    for f in sorted(set(index["weight_map"].values())):
        exported.update(load_file(dst / f))
    assert set(exported) == set(source) == set(index["weight_map"])
    for k in source:  # bitwise: same dtype, shape and bytes; vocab padding never leaks
        assert exported[k].dtype == source[k].dtype and torch.equal(exported[k], source[k]), k
    for f in ("config.json", "generation_config.json"):
        assert (dst / f).is_file()
    auto = AutoModelForTokenClassification if critic else AutoModelForCausalLM
    model = auto.from_pretrained(dst).eval()
    assert type(model).__name__ == ("Qwen2ForTokenClassification" if critic else "Qwen2ForCausalLM")
    with torch.no_grad():
        got = model(ids).logits
    torch.testing.assert_close(got[..., 0] if critic else got, ref, atol=0, rtol=0)


def _check_layout(out, models, work, tag):
    dirs, refs, ids, _ = models
    for kind in KINDS:
        assert out[kind].shape == refs[kind].shape, kind
        torch.testing.assert_close(out[kind], refs[kind], atol=TOL, rtol=0, msg=lambda m: f"{kind} {tag}: {m}")
        _check_export(dirs[kind], work / f"{kind}-{tag}-hf", critic=kind == "critic", ref=refs[kind], ids=ids)
    return out


@pytest.fixture(scope="module")
def layouts(models, tmp_path_factory):
    dirs, _, ids, _ = models
    work = tmp_path_factory.mktemp("layouts")
    per_rank = run_ranks(4, _all_layouts, dirs, ids, work)
    out = {tag: _last([r[tag] for r in per_rank]) for tag in per_rank[0] if tag not in ("vpp", "ddp")}
    out["ddp"] = [r["ddp"] for r in per_rank]
    out["vpp"] = {k: v for r in per_rank for k, v in r["vpp"].items()}
    return out, work


def test_tp2_matches_transformers_and_round_trips(models, layouts):
    out, work = layouts
    _check_layout(out["tp2pp1"], models, work, "tp2pp1")


def test_pp2_matches_transformers_and_round_trips(models, layouts):
    out, work = layouts
    _check_layout(out["tp1pp2"], models, work, "tp1pp2")


def test_tp2_pp2_matches_transformers_and_round_trips(models, layouts):
    out, work = layouts
    _check_layout(out["tp2pp2"], models, work, "tp2pp2")
    # each pipeline stage wrote its own shards
    files = set(json.loads((work / "untied-tp2pp2-hf"
                            / "model.safetensors.index.json").read_text())["weight_map"].values())
    assert {f.split("-")[1] for f in files} == {"pp000", "pp001"}


def test_tp1_matches_transformers_and_loads_a_tp2_checkpoint(models, layouts):
    dirs, refs, ids, _ = models
    outs, work = layouts
    out = _check_layout(outs["tp1pp1"], models, work, "tp1pp1")
    torch.testing.assert_close(out["qwen3"], refs["qwen3"], atol=TOL, rtol=0)
    torch.testing.assert_close(out["untied_from_tp2"], refs["untied"], atol=TOL, rtol=0)
    torch.testing.assert_close(out["critic_from_tp2"], refs["critic"], atol=TOL, rtol=0)
    torch.testing.assert_close(out["untied_from_vpp"], refs["untied"], atol=TOL, rtol=0)
    # Written at TP=2 (or with virtual stages), exported in one layout-TP=1 pass: bitwise.
    for name, kind in (("untied_from_tp2", "untied"), ("critic_from_tp2", "critic"), ("untied_from_vpp", "untied")):
        _check_export(dirs[kind], work / f"{name}-tp1pp1-hf", critic=kind == "critic", ref=refs[kind], ids=ids)

    # The tokenizer travels inside the checkpoint and out with the export.
    from transformers import AutoTokenizer

    for f in ("tokenizer.json", "tokenizer_config.json"):
        assert (work / "untied-tp1pp1" / "hf" / f).read_bytes() == (dirs["untied"] / f).read_bytes()
        assert (work / "untied-tp1pp1-hf" / f).read_bytes() == (dirs["untied"] / f).read_bytes()
    vocab = AutoTokenizer.from_pretrained(work / "untied-tp1pp1-hf").get_vocab()
    assert vocab == AutoTokenizer.from_pretrained(dirs["untied"]).get_vocab() and vocab["w7"] == 7

    # Qwen3 (q/k norms, no qkv bias) exports bitwise too.
    src, dst = load_file(dirs["qwen3"] / "model.safetensors"), work / "qwen3-tp1pp1-hf"
    idx = json.loads((dst / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(idx) == set(src)
    for f in set(idx.values()):
        for k, v in load_file(dst / f).items():
            assert torch.equal(v, src[k]), k

    # A critic from a causal LM: the trunk is the policy's, the value head is new; the export is
    # a Qwen2ForTokenClassification whose outputs equal the Megatron critic's values.
    from transformers import AutoModelForTokenClassification

    fresh = AutoModelForTokenClassification.from_pretrained(work / "fresh-tp1pp1-hf").eval()
    src = load_file(dirs["untied"] / "model.safetensors")
    for k, v in fresh.state_dict().items():
        if k.startswith("model."):
            assert torch.equal(v, src[k]), k
    assert "lm_head.weight" not in fresh.state_dict()
    with torch.no_grad():
        torch.testing.assert_close(fresh(ids).logits[..., 0], out["fresh_critic"], atol=TOL, rtol=0)


def test_virtual_pipeline_streams_every_layer_under_its_global_number(models, layouts):
    dirs, _, _, _ = models
    outs, _ = layouts
    src = load_file(dirs["untied"] / "model.safetensors")
    assert set(outs["vpp"]) == set(src)
    for k, v in src.items():
        assert torch.equal(outs["vpp"][k], v), k


def test_critic_value_head_takes_part_in_ddp(layouts):
    outs, _ = layouts
    (own0, synced0), (own1, synced1), (own2, synced2), (own3, synced3) = outs["ddp"]
    # ranks 0,1 are DP rank 0 (TP ranks 0,1); ranks 2,3 are DP rank 1
    assert torch.equal(own0, own1) and torch.equal(own2, own3)  # TP replicas agree
    assert not torch.allclose(own0, own2)  # different batches per DP rank
    for synced in (synced0, synced1, synced2, synced3):
        torch.testing.assert_close(synced, (own0 + own2) / 2, atol=1e-6, rtol=1e-5)
