"""Model providers: table layouts against naive loops, the 32B preset's size, clear errors."""

from __future__ import annotations

import json

import pytest
import torch

from model_providers import QWEN2, family_for, read_hf_config
from model_providers.layouts import hf_to_mcore, mcore_to_hf, shard, unshard
from model_providers.presets import preset
from model_providers.table import Row
from tests.helpers.dist_utils import run_ranks
from vapo_megatron.mcore.models import padded_vocab_size

CFG = {"hidden_size": 16, "num_attention_heads": 6, "num_key_value_heads": 2, "vocab_size": 10}


def test_qkv_layout_matches_a_naive_loop_and_inverts():
    nh, ng, d, hidden = 6, 2, 2, 16  # 3 query heads per group
    row = Row("q{layer}", ("q{layer}", "k{layer}", "v{layer}"), "qkv")
    q, k, v = torch.randn(nh * d, hidden), torch.randn(ng * d, hidden), torch.randn(ng * d, hidden)
    want = []
    for g in range(ng):  # Megatron's grouping: per query group, its q heads then k then v
        for h in range(g * nh // ng, (g + 1) * nh // ng):
            want.append(q[h * d:(h + 1) * d])
        want += [k[g * d:(g + 1) * d], v[g * d:(g + 1) * d]]
    fused = hf_to_mcore(row, [q, k, v], CFG)
    assert torch.equal(fused, torch.cat(want))
    back = mcore_to_hf(row, fused, CFG, layer=3)
    assert [n for n, _ in back] == ["q3", "k3", "v3"]
    assert all(torch.equal(a, b) for (_, a), b in zip(back, (q, k, v)))
    bias = hf_to_mcore(row, [q[:, 0], k[:, 0], v[:, 0]], CFG)
    assert torch.equal(bias, fused[:, 0])


def test_gate_up_shards_hold_their_slice_of_gate_and_up():
    gate, up = torch.arange(8.0).reshape(8, 1), 100 + torch.arange(8.0).reshape(8, 1)
    row = Row("fc1", ("gate", "up"), "gate_up")
    full = hf_to_mcore(row, [gate, up], CFG)
    shards = [shard("gate_up", full, 0, 2, r) for r in range(2)]
    # SwiGLU chunks each rank's output in two: [its gate rows; its up rows]
    assert torch.equal(shards[1], torch.cat([gate[4:], up[4:]]))
    assert torch.equal(unshard("gate_up", shards, 0), full)
    assert [n for n, _ in mcore_to_hf(row, full, CFG)] == ["gate", "up"]


def test_vocab_rows_are_padded_with_zeros_and_stripped():
    row = Row("emb", ("embed",), "vocab")
    t = torch.randn(10, 4)
    padded = hf_to_mcore(row, [t], CFG, padded_vocab=256)
    assert padded.shape == (256, 4) and torch.equal(padded[:10], t) and not padded[10:].any()
    ((name, back),) = mcore_to_hf(row, padded, CFG)
    assert name == "embed" and torch.equal(back, t)


def test_padded_vocab_is_megatrons_rule():
    cfg = preset("qwen2.5-32b")
    assert padded_vocab_size(cfg, 1) == 152064  # already a multiple of 128
    assert padded_vocab_size(cfg, 8) == 152576  # next multiple of 1024


def test_a_checkpoint_at_another_tp_differs_only_in_vocab_padding():
    """Qwen2.5-32B written at TP=8 (152,576 rows) and loaded at TP=4 (152,064), or the reverse: the
    embedding differs only in padding rows, which megatron's allow_shape_mismatch load fills or drops
    (checkpoint/dist_io.py). Fewer rows than the real vocabulary, another hidden size, or a tensor
    megatron does not flag is another model."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from vapo_megatron.checkpoint.dist_io import vocab_padding_only

    cfg = preset("qwen2.5-32b")
    vocab, h = cfg["vocab_size"], cfg["hidden_size"]
    tp4, tp8 = padded_vocab_size(cfg, 4), padded_vocab_size(cfg, 8)
    assert (tp4, tp8) == (152064, 152576)
    emb = ShardedTensor.from_rank_offsets("embedding.word_embeddings.weight", torch.empty(tp4, h, device="meta"),
                                           allow_shape_mismatch=True)
    assert vocab_padding_only(emb, (tp8, h), vocab)
    assert not vocab_padding_only(emb, (vocab - 1, h), vocab)  # a smaller vocabulary
    assert not vocab_padding_only(emb, (tp8, h + 1), vocab)
    assert not vocab_padding_only(emb, (tp8, h), None)
    plain = ShardedTensor.from_rank_offsets("decoder.final_layernorm.weight", torch.empty(tp4, h, device="meta"))
    assert not vocab_padding_only(plain, (tp8, h), vocab)


def _count_32b_shards():
    """Build every (TP rank, PP stage) shard of Qwen2.5-32B at TP=8, PP=4 on the meta device,
    with fake process groups (no memory, no communication), and count parameters: TP-split
    parameters on every TP rank, TP-replicated ones (norms) once per stage."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from vapo_megatron.mcore import cpu_compat
    from vapo_megatron.mcore.models import build_actor, build_critic

    cpu_compat.activate()
    cfg = preset("qwen2.5-32b")
    counts = {"actor": 0, "critic": 0}
    for pp_rank in range(4):
        for tp_rank in range(8):
            dist.init_process_group("fake", store=FakeStore(), rank=pp_rank * 8 + tp_rank, world_size=32)
            parallel_state.initialize_model_parallel(
                tensor_model_parallel_size=8, pipeline_model_parallel_size=4, create_gloo_process_groups=False)
            for kind, build in (("actor", build_actor), ("critic", build_critic)):
                with torch.device("meta"):
                    model = build(cfg, params_dtype=torch.bfloat16)
                for _, p in model.named_parameters():
                    assert p.device.type == "meta"
                    if getattr(p, "tensor_model_parallel", False) or tp_rank == 0:
                        counts[kind] += p.numel()
            parallel_state.destroy_model_parallel()
            dist.destroy_process_group()
    return counts


def test_qwen2_5_32b_preset_builds_at_tp8_pp4_with_the_published_size():
    (counts,) = run_ranks(1, _count_32b_shards)
    hidden, vocab = 5120, 152064
    padding = (padded_vocab_size(preset("qwen2.5-32b"), 8) - vocab) * hidden  # rows per table
    assert counts["actor"] == 32_763_876_352 + 2 * padding  # embedding and untied output layer
    # critic: no output layer; a value head (H weights + 1 bias) instead
    assert counts["critic"] == 32_763_876_352 - vocab * hidden + padding + hidden + 1


# ---- clear errors ------------------------------------------------------------------------------

def test_tp_not_dividing_heads_is_named():
    from vapo_megatron.config import ConfigError
    from vapo_megatron.config.layout import check_layout

    cfg = preset("qwen2.5-7b") | {"_source": "preset qwen2.5-7b"}
    with pytest.raises(ConfigError, match=r"parallel.tp=8 does not divide num_attention_heads=28 of model.hf_path "
                                          r"\(preset qwen2.5-7b\)"):
        check_layout(8, 8, 1, model=cfg)
    with pytest.raises(ConfigError, match="parallel.tp=4 does not divide num_key_value_heads=2"):
        check_layout(4, 4, 1, model=preset("qwen2.5-1.5b"))


def test_missing_config_json_is_named(tmp_path):
    from model_providers import HFConfigError

    with pytest.raises(HFConfigError, match=f"{tmp_path} has no config.json"):
        read_hf_config(tmp_path)


def test_unsupported_architecture_is_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPTNeoXForCausalLM"], "model_type": "gpt_neox",
                                                      **{k: 4 for k in ("num_hidden_layers", "num_attention_heads",
                                                                        "hidden_size", "vocab_size",
                                                                        "intermediate_size")}}))
    with pytest.raises(ValueError, match=r"config.json: unsupported architecture "
                                         r"\(architectures=\['GPTNeoXForCausalLM'\]\).*Qwen2ForCausalLM") as e:
        family_for(read_hf_config(tmp_path))
    assert str(tmp_path) in str(e.value)


def test_directory_without_megatron_metadata_is_named(tmp_path, capsys):
    from vapo_megatron import convert
    from vapo_megatron.checkpoint import dist_io

    (tmp_path / "model.safetensors").write_bytes(b"")
    # The CLI turns it into one line naming the directory (vapo-convert: error: ...), exit 2.
    assert convert.main(["mcore-to-hf", "--ckpt", str(tmp_path), "--out", str(tmp_path.parent / "out")]) == 2
    assert f"vapo-convert: error: {tmp_path} is not a Megatron distributed checkpoint" in capsys.readouterr().err
    assert not (tmp_path.parent / "out").exists()
    with pytest.raises(dist_io.CheckpointError, match="does not exist"):
        dist_io.require_checkpoint(tmp_path / "nowhere")


def test_presets_hold_the_published_qwen2_5_32b_values():
    cfg = preset("qwen2.5-32b")
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"],
            cfg["intermediate_size"], cfg["vocab_size"], cfg["rope_theta"], cfg["rms_norm_eps"],
            cfg["tie_word_embeddings"]) == (5120, 64, 40, 8, 27648, 152064, 1e6, 1e-6, False)
    assert family_for(cfg) is QWEN2
    with pytest.raises(ValueError, match="unknown model preset 'qwen9'"):
        preset("qwen9")
