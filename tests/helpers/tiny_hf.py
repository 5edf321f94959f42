"""Random tiny Qwen2/Qwen3/Qwen3-MoE/Llama models built with transformers itself, saved as HF directories."""

from __future__ import annotations

import torch


def qwen2_config(*, tied: bool, vocab: int = 300, layers: int = 4):
    from transformers import Qwen2Config

    # GQA (4 query heads, 2 KV groups); vocab 300 is padded to 384 at TP=1 and 512 at TP=2,
    # so a checkpoint written at TP=2 loaded at TP=1 also changes the padding.
    return Qwen2Config(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        rms_norm_eps=1e-6, tie_word_embeddings=tied, rope_theta=10000.0,
        architectures=["Qwen2ForCausalLM"], bos_token_id=1, eos_token_id=2,
    )


def qwen3_config(*, tied: bool = False):
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
        tie_word_embeddings=tied, architectures=["Qwen3ForCausalLM"],
    )


def qwen3_moe_config(*, tied: bool = False, vocab: int = 300, layers: int = 4, norm_topk: bool = True,
                     mlp_only_layers: tuple[int, ...] = (2,)):
    from transformers import Qwen3MoeConfig

    # Odd shapes: head_dim 12 unlike hidden/heads = 8, GQA, vocab 300 padded by Megatron; 4 experts
    # (2 per rank at EP=2), top-2, expert width 24 unlike the dense layer's 64; layer 2 dense.
    return Qwen3MoeConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, moe_intermediate_size=24, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=12, max_position_embeddings=64,
        num_experts=4, num_experts_per_tok=2, norm_topk_prob=norm_topk, decoder_sparse_step=1,
        mlp_only_layers=list(mlp_only_layers), tie_word_embeddings=tied, rope_theta=10000.0,
        architectures=["Qwen3MoeForCausalLM"], bos_token_id=1, eos_token_id=2,
    )


# Llama 3.1's published RoPE scaling (meta-llama/Llama-3.1-8B config.json); megatron expresses it.
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}


def llama_config(*, tied: bool, vocab: int = 300, layers: int = 4, scaling: bool = True):
    from transformers import LlamaConfig

    # Odd shapes: head_dim 16 unlike hidden/heads = 12, GQA (4 heads, 2 groups), vocab 300 padded
    # by Megatron. theta 500000 and head_dim 16 put the rotary wavelengths (6 to 6e5 positions) in
    # all three bands of the llama3 scaling (kept < 2048, smoothed in 2048..8192, divided above).
    return LlamaConfig(
        vocab_size=vocab, hidden_size=48, intermediate_size=80, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=131072,
        rms_norm_eps=1e-5, tie_word_embeddings=tied, rope_theta=500000.0,
        rope_scaling=dict(LLAMA3_ROPE) if scaling else None,
        architectures=["LlamaForCausalLM"], bos_token_id=1, eos_token_id=2,
    )


def randomize(model, seed: int) -> None:
    """Every weight random, including q/k/v biases and norms (HF inits those to 0 and 1)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            norm = p.ndim == 1 and p.shape[0] == model.config.hidden_size
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2 + (1.0 if norm else 0.0))


def save_tiny(path, *, kind: str = "qwen2", tied: bool = False, critic: bool = False, seed: int = 0):
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    cfg = {"qwen2": qwen2_config, "qwen3": qwen3_config, "qwen3_moe": qwen3_moe_config,
           "llama": llama_config}[kind](tied=tied)
    torch.manual_seed(seed)
    if critic:
        cfg.num_labels = 1
        cfg.architectures = [cfg.architectures[0].replace("ForCausalLM", "ForTokenClassification")]
        model = AutoModelForTokenClassification.from_config(cfg, dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    randomize(model, seed)
    model.save_pretrained(path)
    return model.eval()


def input_ids(batch: int = 2, seq: int = 12, vocab: int = 300, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


def save_tiny_tokenizer(path, vocab: int = 300) -> None:
    """A word-level tokenizer (tokenizer.json + tokenizer_config.json) saved by transformers."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {f"w{i}": i for i in range(vocab - 1)}
    words["<unk>"] = vocab - 1
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>").save_pretrained(path)


def save_demo_sized(model_dir, tokenizer_dir, *, family: str, seed: int = 0) -> None:
    """A random-init untied model of `family` with the demo tokenizer (tests/helpers/train_runs.py
    make_demo_data), for runs of the trainer on the demo data. "llama": 2 layers, Llama 3.1's
    llama3 RoPE scaling; "qwen3_moe": 3 layers of 4 experts (top-2, renormalized), layer 1 dense."""
    import shutil

    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    common = dict(
        # the tokenizer's size rounded to 64 as the demo does; Megatron pads it further (to 256 at TP=2)
        vocab_size=-(-len(tok) // 64) * 64, hidden_size=48, intermediate_size=96, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, tie_word_embeddings=False,
        bos_token_id=tok.convert_tokens_to_ids("<|endoftext|>"), eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    arch, cfg = {
        "llama": lambda: ("Llama", transformers.LlamaConfig(
            **common, num_hidden_layers=2, max_position_embeddings=131072, rms_norm_eps=1e-5,
            rope_theta=500000.0, rope_scaling=dict(LLAMA3_ROPE), architectures=["LlamaForCausalLM"])),
        "qwen3_moe": lambda: ("Qwen3Moe", transformers.Qwen3MoeConfig(
            **common, moe_intermediate_size=32, num_hidden_layers=3, max_position_embeddings=512, num_experts=4,
            num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1], rope_theta=10000.0,
            architectures=["Qwen3MoeForCausalLM"])),
    }[family]()
    torch.manual_seed(seed)
    shutil.rmtree(model_dir, ignore_errors=True)
    getattr(transformers, f"{arch}ForCausalLM")(cfg).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
