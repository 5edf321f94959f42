"""The Llama family's reading of config.json: the llama3 RoPE scaling megatron-core can express
(checked against megatron's own RotaryEmbedding and transformers' Llama RoPE), everything else
refused in one line naming the file and the value; the Llama 3.1 presets."""

from __future__ import annotations

import inspect
import json

import pytest
import torch

from model_providers import LLAMA, QWEN2, HFConfigError, check_supported, read_hf_config
from model_providers.llama import MCORE_LLAMA3_FIXED
from model_providers.presets import preset

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}


def _dir(tmp_path, **cfg):
    hf = {k: v for k, v in preset("llama3.1-8b").items()}
    hf.update(cfg)
    hf = {k: v for k, v in hf.items() if v is not ...}  # `...`: leave the key out
    (tmp_path / "config.json").write_text(json.dumps(hf))
    return read_hf_config(tmp_path)


def test_megatron_fixes_the_llama3_values_the_family_requires():
    # The family refuses what megatron's _apply_scaling cannot be told: its keyword defaults.
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    defaults = {k: p.default for k, p in inspect.signature(RotaryEmbedding._apply_scaling).parameters.items()
                if k in MCORE_LLAMA3_FIXED}
    assert defaults == MCORE_LLAMA3_FIXED
    assert "factor" in inspect.signature(RotaryEmbedding._apply_scaling).parameters


@pytest.mark.parametrize("head_dim, theta, factor", [(128, 500000.0, 8.0), (64, 500000.0, 32.0), (16, 500000.0, 8.0)])
def test_megatron_llama3_frequencies_equal_transformers(head_dim, theta, factor):
    """megatron's RotaryEmbedding(rope_scaling=True) against transformers' LlamaRotaryEmbedding, built
    from a config: the inverse frequencies agree to float32 rounding (the 3.2 1B/3B use factor 32)."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    cfg = LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim, rope_theta=theta,
                      rope_scaling={**LLAMA3, "factor": factor}, max_position_embeddings=131072)
    hf = LlamaRotaryEmbedding(cfg).inv_freq
    mc = RotaryEmbedding(kv_channels=head_dim, rotary_percent=1.0, rotary_base=theta, rope_scaling=True,
                         rope_scaling_factor=factor, use_cpu_initialization=True, cp_group=object()).inv_freq
    plain = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    assert not torch.allclose(hf, plain)  # the scaling changes frequencies at these sizes
    torch.testing.assert_close(mc, hf, atol=0, rtol=1e-6)


@pytest.mark.parametrize("style", ["hub", "transformers5"])
def test_llama3_scaling_is_mapped_from_either_spelling(tmp_path, style):
    if style == "hub":  # meta-llama/Llama-3.1-8B's config.json: rope_scaling beside rope_theta
        cfg = _dir(tmp_path)
    else:  # what transformers 5 writes: rope_parameters holding rope_theta
        cfg = _dir(tmp_path, rope_scaling=..., rope_theta=..., rope_parameters={**LLAMA3, "rope_theta": 500000.0})
    assert check_supported(cfg) is LLAMA
    arch = LLAMA.architecture(cfg)
    assert (arch.rotary_base, arch.rope_scaling_factor, arch.tied_embeddings) == (500000.0, 8.0, False)
    assert arch.transformer["kv_channels"] == 128 and arch.transformer["num_query_groups"] == 8
    assert not arch.transformer["add_qkv_bias"] and not arch.transformer["add_bias_linear"]


def test_llama3_0_without_scaling_and_3_2_tied(tmp_path):
    cfg = _dir(tmp_path, rope_scaling=None, tie_word_embeddings=True, head_dim=64)
    arch = LLAMA.architecture(cfg)
    assert arch.rope_scaling_factor is None and arch.tied_embeddings and arch.transformer["kv_channels"] == 64


BAD = [
    (dict(rope_scaling={**LLAMA3, "low_freq_factor": 2.0}), "rope_scaling.low_freq_factor=2.0 is not supported",
     "fixes low_freq_factor=1"),
    (dict(rope_scaling={**LLAMA3, "high_freq_factor": 8}), "rope_scaling.high_freq_factor=8 is not supported",
     "fixes high_freq_factor=4"),
    (dict(rope_scaling={**LLAMA3, "original_max_position_embeddings": 4096}),
     "rope_scaling.original_max_position_embeddings=4096 is not supported",
     "fixes original_max_position_embeddings=8192"),
    (dict(rope_scaling={k: v for k, v in LLAMA3.items() if k != "high_freq_factor"}),
     "rope_scaling.high_freq_factor='(absent)' is not supported", "fixes high_freq_factor=4"),
    (dict(rope_scaling={**LLAMA3, "factor": 0}), "rope_scaling.factor=0 is not supported", "a positive number"),
    (dict(rope_scaling={**LLAMA3, "partial_rotary_factor": 0.5}),
     "rope_scaling.partial_rotary_factor=0.5 is not supported", "takes only"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}),
     "rope_scaling={'rope_type': 'yarn', 'factor': 4.0} is not supported", "only 'llama3' or the default RoPE"),
    (dict(rope_scaling={"type": "linear", "factor": 2.0}),
     "rope_scaling={'type': 'linear', 'factor': 2.0} is not supported", "only 'llama3'"),
    (dict(attention_bias=True), "attention_bias=True is not supported for Llama", "only false"),
    (dict(mlp_bias=True), "mlp_bias=True is not supported for Llama", "only false"),
    (dict(hidden_act="gelu"), "hidden_act='gelu' is not supported", "silu"),
]


@pytest.mark.parametrize("change, value, why", BAD)
def test_what_megatron_cannot_express_is_one_line_naming_the_file_and_value(tmp_path, change, value, why):
    cfg = _dir(tmp_path, **change)
    with pytest.raises(HFConfigError) as e:
        check_supported(cfg)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{tmp_path / 'config.json'}: {value}"), msg
    assert why in msg, msg


def test_qwen_still_refuses_any_rope_scaling(tmp_path):
    cfg = {**preset("tiny-qwen2"), "rope_scaling": LLAMA3}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(HFConfigError,
                       match=r"config.json: rope_scaling=.*llama3.*only the default RoPE, without scaling"):
        check_supported(read_hf_config(tmp_path))
    assert check_supported(preset("tiny-qwen2") | {"_source": "p"}) is QWEN2


def test_llama3_1_presets_hold_the_published_values():
    for name, want in {"llama3.1-8b": (4096, 32, 32, 8, 14336), "llama3.1-70b": (8192, 80, 64, 8, 28672)}.items():
        cfg = preset(name)
        assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"],
                cfg["intermediate_size"]) == want
        assert (cfg["vocab_size"], cfg["rope_theta"], cfg["rope_scaling"], cfg["max_position_embeddings"],
                cfg["rms_norm_eps"], cfg["tie_word_embeddings"]) == (128256, 500000.0, LLAMA3, 131072, 1e-5, False)
        assert check_supported(cfg) is LLAMA and LLAMA.architecture(cfg).rope_scaling_factor == 8.0
