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

from dist_utils import run_ranks
from tiny_hf import input_ids, save_tiny

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
    return dirs, refs, ids, root


def _forward(chunks, ids, *, critic: bool, vocab: int):
    """Manual pipeline forward (hidden states sent stage to stage); full logits or values on the
    last stage, None elsewhere."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    model = chunks[0].eval()
    b, t = ids.shape
    pos = torch.arange(t).expand(b, t)
    if not ps.is_pipeline_first_stage():
        x = torch.empty(t, b, model.config.hidden_size)
        dist.recv(x, src=ps.get_pipeline_model_parallel_prev_rank())
        model.set_input_tensor(x)
    with torch.no_grad():
        out = model(ids, pos, None)
    if not ps.is_pipeline_last_stage():
        dist.send(out.contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
        return None
    if critic:
        return out
    # vocab-parallel logits [B, T, V_pad / TP] -> full, padding stripped
    shards = [torch.empty_like(out) for _ in range(ps.get_tensor_model_parallel_world_size())]
    dist.all_gather(shards, out.contiguous(), group=ps.get_tensor_model_parallel_group())
    return torch.cat(shards, dim=-1)[..., :vocab]


def _load_and_forward(ckpt: Path, ids, *, critic: bool):
    from model_providers.build import build_chunks
    from vapo_megatron import checkpoint_io

    hf_cfg = json.loads((ckpt / "hf" / "config.json").read_text())
    chunks = build_chunks(hf_cfg, params_dtype=torch.float32, critic=critic)
    checkpoint_io.load_model(ckpt, chunks)
    return _forward(chunks, ids, critic=critic, vocab=hf_cfg["vocab_size"])


def _layout_run(tp: int, pp: int, dirs: dict, ids, work: Path, extra: dict):
    from megatron.core import parallel_state as ps

    from vapo_megatron import convert, parallel

    parallel.init_distributed(tp, pp)
    out = {}
    tag = f"tp{tp}pp{pp}"
    for kind in KINDS + tuple(extra.get("kinds", ())):
        critic = kind == "critic"
        ckpt = work / f"{kind}-{tag}"
        convert.hf_to_mcore(dirs[kind], ckpt, critic=critic, tp=tp, pp=pp, dtype=None)
        out[kind] = _load_and_forward(ckpt, ids, critic=critic)
        # Small shards so that each stage writes several files.
        convert.mcore_to_hf(ckpt, work / f"{kind}-{tag}-hf", tp=tp, pp=pp, max_shard_bytes=40_000)
    for name, (ckpt, critic) in extra.get("reshard", {}).items():
        out[name] = _load_and_forward(ckpt, ids, critic=critic)
    if "fresh_critic" in extra:  # a critic made from a causal LM: fresh value head
        convert.hf_to_mcore(dirs["untied"], work / f"fresh-{tag}", critic=True, tp=tp, pp=pp, dtype=None)
        out["fresh_critic"] = _load_and_forward(work / f"fresh-{tag}", ids, critic=True)
        convert.mcore_to_hf(work / f"fresh-{tag}", work / f"fresh-{tag}-hf", tp=tp, pp=pp, max_shard_bytes=2**30)
    last = ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0
    return out if last else None


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


def _check_layout(results, models, work, tag):
    dirs, refs, ids, _ = models
    out = _last(results)
    for kind in KINDS:
        assert out[kind].shape == refs[kind].shape, kind
        torch.testing.assert_close(out[kind], refs[kind], atol=TOL, rtol=0, msg=lambda m: f"{kind} {tag}: {m}")
        _check_export(dirs[kind], work / f"{kind}-{tag}-hf", critic=kind == "critic", ref=refs[kind], ids=ids)
    return out


@pytest.fixture(scope="module")
def tp2(models, tmp_path_factory):
    dirs, _, ids, _ = models
    work = tmp_path_factory.mktemp("tp2")
    return run_ranks(2, _layout_run, 2, 1, dirs, ids, work, {}), work


def test_tp2_matches_transformers_and_round_trips(models, tp2):
    results, work = tp2
    _check_layout(results, models, work, "tp2pp1")


def test_tp1_matches_transformers_and_loads_a_tp2_checkpoint(models, tp2, tmp_path):
    dirs, refs, ids, _ = models
    _, tp2_work = tp2
    extra = {
        "kinds": ("qwen3",),
        # Written at TP=2 (vocab padded to 512), loaded at TP=1 (padded to 384).
        "reshard": {"untied_from_tp2": (tp2_work / "untied-tp2pp1", False),
                    "critic_from_tp2": (tp2_work / "critic-tp2pp1", True)},
        "fresh_critic": True,
    }
    out = _check_layout(run_ranks(1, _layout_run, 1, 1, dirs, ids, tmp_path, extra), models, tmp_path, "tp1pp1")
    torch.testing.assert_close(out["qwen3"], refs["qwen3"], atol=TOL, rtol=0)
    torch.testing.assert_close(out["untied_from_tp2"], refs["untied"], atol=TOL, rtol=0)
    torch.testing.assert_close(out["critic_from_tp2"], refs["critic"], atol=TOL, rtol=0)

    # Qwen3 (q/k norms, no qkv bias) exports bitwise too and loads in transformers.
    src, dst = load_file(dirs["qwen3"] / "model.safetensors"), tmp_path / "qwen3-tp1pp1-hf"
    idx = json.loads((dst / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(idx) == set(src)
    for f in set(idx.values()):
        for k, v in load_file(dst / f).items():
            assert torch.equal(v, src[k]), k

    # A critic from a causal LM: the trunk is the policy's, the value head is new; the export is
    # a Qwen2ForTokenClassification whose outputs equal the Megatron critic's values.
    from transformers import AutoModelForTokenClassification

    fresh = AutoModelForTokenClassification.from_pretrained(tmp_path / "fresh-tp1pp1-hf").eval()
    src = load_file(dirs["untied"] / "model.safetensors")
    for k, v in fresh.state_dict().items():
        if k.startswith("model."):
            assert torch.equal(v, src[k]), k
    assert "lm_head.weight" not in fresh.state_dict()
    with torch.no_grad():
        torch.testing.assert_close(fresh(ids).logits[..., 0], out["fresh_critic"], atol=TOL, rtol=0)


def test_pp2_matches_transformers_and_round_trips(models, tmp_path):
    dirs, _, ids, _ = models
    _check_layout(run_ranks(2, _layout_run, 1, 2, dirs, ids, tmp_path, {}), models, tmp_path, "tp1pp2")


def test_tp2_pp2_matches_transformers_and_round_trips(models, tmp_path):
    dirs, _, ids, _ = models
    results = run_ranks(4, _layout_run, 2, 2, dirs, ids, tmp_path, {})
    _check_layout(results, models, tmp_path, "tp2pp2")
    # each pipeline stage wrote its own shards
    files = set(json.loads((tmp_path / "untied-tp2pp2-hf" / "model.safetensors.index.json").read_text())["weight_map"].values())
    assert {f.split("-")[1] for f in files} == {"pp000", "pp001"}
