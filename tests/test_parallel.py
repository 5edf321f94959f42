"""Distributed start-up: layout validation and megatron-core running TP/PP on the CPU."""

import pytest
import torch

from dist_utils import run_ranks
from vapo_megatron.parallel import LayoutError, validate_layout


def test_layout_derives_dp():
    layout = validate_layout(8, tp=2, pp=2, num_layers=4, num_attention_heads=4, num_query_groups=2)
    assert (layout.tp, layout.pp, layout.dp) == (2, 2, 2)


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        (dict(world_size=6, tp=4, pp=1), "world size 6 is not divisible"),
        (dict(world_size=4, tp=4, pp=1, num_attention_heads=6), "num_attention_heads=6"),
        (dict(world_size=4, tp=4, pp=1, num_attention_heads=8, num_query_groups=2), "num_key_value_heads=2"),
        (dict(world_size=4, tp=1, pp=4, num_layers=6), "num_hidden_layers=6"),
        (dict(world_size=2, tp=1, pp=2, vpp=2, num_layers=6), "virtual_pipeline"),
    ],
)
def test_bad_layouts_are_named(kwargs, needle):
    with pytest.raises(LayoutError, match=needle):
        validate_layout(**kwargs)


def _tp_forward_backward(tp: int, pp: int):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    from vapo_megatron import parallel

    layout = parallel.init_distributed(tp, pp)
    cfg = TransformerConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=64,
        use_cpu_initialization=True, params_dtype=torch.float32, normalization="RMSNorm",
        gated_linear_unit=True, activation_func=torch.nn.functional.silu, add_bias_linear=False,
        add_qkv_bias=True, bias_activation_fusion=False, masked_softmax_fusion=False,
        bias_dropout_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
        apply_rope_fusion=False, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        pipeline_dtype=torch.float32,
    )
    model = GPTModel(
        config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=64,
        max_sequence_length=32, position_embedding_type="rope",
        pre_process=parallel.is_first_stage(), post_process=parallel.is_last_stage(),
    )
    ids = torch.randint(0, 64, (2, 8))
    logits = model(ids, torch.arange(8).expand(2, 8), None)
    logits.sum().backward()
    return layout.dp, tuple(logits.shape)


def test_megatron_tp2_runs_on_cpu():
    # Vocab-parallel logits: each TP rank holds half of the 64-entry vocabulary.
    assert run_ranks(2, _tp_forward_backward, 2, 1) == [(1, (2, 8, 32))] * 2
