"""Named model configs (HF config.json dicts): tiny test models and the real Qwen2.5, Qwen3
(dense and MoE) and Llama 3.1 sizes.

The values are those of the published config.json files (Qwen/Qwen2.5-*-Instruct, Qwen/Qwen3-8B,
-32B, -30B-A3B and -235B-A22B, meta-llama/Llama-3.1-8B and -70B).
"""

from __future__ import annotations


def _qwen2(*, hidden, layers, heads, kv_heads, ffn, vocab, tied, max_pos=32768, theta=1_000_000.0) -> dict:
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "intermediate_size": ffn,
        "vocab_size": vocab,
        "tie_word_embeddings": tied,
        "max_position_embeddings": max_pos,
        "rope_theta": theta,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_sliding_window": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": 151643,
        "eos_token_id": 151645,
    }


def _qwen3(*, hidden, layers, heads, kv_heads, ffn, experts=None, top_k=None, expert_ffn=None) -> dict:
    cfg = {
        "architectures": ["Qwen3MoeForCausalLM" if experts else "Qwen3ForCausalLM"],
        "model_type": "qwen3_moe" if experts else "qwen3",
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": 128,
        "intermediate_size": ffn,
        "vocab_size": 151936,
        "tie_word_embeddings": False,
        "max_position_embeddings": 40960,
        "rope_theta": 1_000_000.0,
        "rope_scaling": None,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_sliding_window": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": 151643,
        "eos_token_id": 151645,
    }
    if experts:
        cfg.update(num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=expert_ffn,
                   norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], router_aux_loss_coef=0.001)
    return cfg


def _llama3_1(*, hidden, layers, heads, kv_heads, ffn) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "intermediate_size": ffn,
        "vocab_size": 128256,
        "tie_word_embeddings": False,
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
        "rms_norm_eps": 1e-5,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "torch_dtype": "bfloat16",
        "bos_token_id": 128000,
        "eos_token_id": 128001,
    }


PRESETS = {
    # Tiny test models: GQA, a vocabulary that Megatron must pad (250 -> 256 at TP=1, 256 at TP=2).
    "tiny-qwen2": lambda: _qwen2(hidden=32, layers=4, heads=4, kv_heads=2, ffn=64, vocab=250, tied=False,
                                 max_pos=128, theta=10000.0),
    "tiny-qwen2-tied": lambda: _qwen2(hidden=32, layers=4, heads=4, kv_heads=2, ffn=64, vocab=250, tied=True,
                                      max_pos=128, theta=10000.0),
    # 4 experts (2 per rank at EP=2), top-2, layer 2 dense, head_dim 12 unlike hidden/heads.
    "tiny-qwen3-moe": lambda: {**_qwen3(hidden=32, layers=4, heads=4, kv_heads=2, ffn=64, experts=4, top_k=2,
                                        expert_ffn=24),
                               "head_dim": 12, "vocab_size": 250, "max_position_embeddings": 128, "rope_theta": 10000.0,
                               "mlp_only_layers": [2]},
    # One per family for gpu_check's model checks: Qwen3's QK norms with head_dim 16 unlike
    # hidden/heads = 8; Llama 3.1's llama3 RoPE scaling (theta 500000 and head_dim 16 put the rotary
    # wavelengths in all three of its bands) with head_dim 16 unlike hidden/heads = 12.
    "tiny-qwen3": lambda: {**_qwen3(hidden=32, layers=4, heads=4, kv_heads=2, ffn=64),
                           "head_dim": 16, "vocab_size": 250, "max_position_embeddings": 128, "rope_theta": 10000.0},
    "tiny-llama3": lambda: {**_llama3_1(hidden=48, layers=4, heads=4, kv_heads=2, ffn=80), "head_dim": 16,
                            "vocab_size": 250},
    # gpu_check's offload preset: hidden 1024 puts every weight and buffer in the CUDA allocator's
    # large pool (their release is then visible in memory_reserved), at ~120M parameters, so an
    # actor and a critic with fp32 Adam state fit one GPU beside the other checks (~4 GiB).
    "small-qwen2": lambda: _qwen2(hidden=1024, layers=4, heads=8, kv_heads=2, ffn=2816, vocab=32000, tied=False,
                                  max_pos=4096, theta=10000.0),
    "qwen2.5-0.5b": lambda: _qwen2(hidden=896, layers=24, heads=14, kv_heads=2, ffn=4864, vocab=151936, tied=True),
    "qwen2.5-1.5b": lambda: _qwen2(hidden=1536, layers=28, heads=12, kv_heads=2, ffn=8960, vocab=151936, tied=True),
    "qwen2.5-7b": lambda: _qwen2(hidden=3584, layers=28, heads=28, kv_heads=4, ffn=18944, vocab=152064, tied=False),
    "qwen2.5-32b": lambda: _qwen2(hidden=5120, layers=64, heads=40, kv_heads=8, ffn=27648, vocab=152064, tied=False),
    "qwen3-8b": lambda: _qwen3(hidden=4096, layers=36, heads=32, kv_heads=8, ffn=12288),
    "qwen3-32b": lambda: _qwen3(hidden=5120, layers=64, heads=64, kv_heads=8, ffn=25600),
    "qwen3-30b-a3b": lambda: _qwen3(hidden=2048, layers=48, heads=32, kv_heads=4, ffn=6144, experts=128, top_k=8,
                                    expert_ffn=768),
    "qwen3-235b-a22b": lambda: _qwen3(hidden=4096, layers=94, heads=64, kv_heads=4, ffn=12288, experts=128, top_k=8,
                                      expert_ffn=1536),
    "llama3.1-8b": lambda: _llama3_1(hidden=4096, layers=32, heads=32, kv_heads=8, ffn=14336),
    "llama3.1-70b": lambda: _llama3_1(hidden=8192, layers=80, heads=64, kv_heads=8, ffn=28672),
}


def preset(name: str) -> dict:
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; known: {', '.join(PRESETS)}")
    return PRESETS[name]()
