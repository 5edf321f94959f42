"""Distributed start-up: the one layout check (config/layout.py) and megatron-core running TP/PP
on the CPU."""

import pytest
import torch

from tests.helpers.dist_utils import run_ranks
from vapo_megatron.config import ConfigError
from vapo_megatron.config.layout import CLI_KEYS, check_layout


def _model(layers=4, heads=4, kv=2, ffn=64) -> dict:
    return {"num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv,
            "intermediate_size": ffn, "_source": "m/config.json"}


def test_layout_derives_dp():
    layout = check_layout(8, 2, 2, model=_model())
    assert (layout.tp, layout.pp, layout.dp) == (2, 2, 2)


@pytest.mark.parametrize(
    "args, kwargs, needle",
    [
        ((6, 4, 1), {}, r"parallel.tp \* parallel.pp = 4 \* 1 = 4 does not divide the world size 6"),
        ((4, 4, 1), dict(model=_model(heads=6, kv=6)),
         r"parallel.tp=4 does not divide num_attention_heads=6 of model.hf_path \(m/config.json\)"),
        ((4, 4, 1), dict(model=_model(heads=8, kv=2)), "parallel.tp=4 does not divide num_key_value_heads=2"),
        ((4, 1, 4), dict(model=_model(layers=6)), "parallel.pp=4 does not divide num_hidden_layers=6"),
        ((2, 1, 2, 2), dict(model=_model(layers=6)),
         r"parallel.pp \* parallel.vpp = 2 \* 2 does not divide num_hidden_layers=6"),
        ((2, 1, 1, 2), {}, "parallel.vpp=2 must be null, or >= 1 with parallel.pp >= 2"),
        ((4, 3, 1), dict(model=_model(), keys=CLI_KEYS), "--tp=3 does not divide num_attention_heads=4"),
    ],
)
def test_bad_layouts_are_named_with_the_users_keys(args, kwargs, needle):
    with pytest.raises(ConfigError, match=needle):
        check_layout(*args, **kwargs)


def test_every_problem_of_a_layout_at_once():
    with pytest.raises(ConfigError) as e:
        check_layout(6, 4, 4, model=_model(heads=6, kv=6, layers=6, ffn=66))
    assert "invalid settings" in str(e.value) and str(e.value).count("  - ") == 5


def _tp_forward_backward(tp: int, pp: int):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    from vapo_megatron.mcore import parallel

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


def test_a_lone_process_leaves_no_rendezvous_port_behind():
    """A single process without a launcher (vapo-convert, vapo-eval, a test calling a command's
    main) rendezvouses in memory: no MASTER_PORT is written into os.environ, where every later
    subprocess inherited it and bound a port still in use (EADDRINUSE in the suite)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    code = (
        "import os, torch.distributed as dist\n"
        "from vapo_megatron.mcore import parallel\n"
        "parallel.init_distributed(1, 1)\n"
        "t = __import__('torch').ones(2); parallel.all_reduce(t); parallel.barrier()\n"
        "assert 'MASTER_PORT' not in os.environ and 'MASTER_ADDR' not in os.environ, dict(os.environ)\n"
        "parallel.destroy(); print('ok')\n"
    )
    env = {k: v for k, v in __import__("os").environ.items()
           if k not in ("MASTER_PORT", "MASTER_ADDR", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    run = subprocess.run([sys.executable, "-c", code], cwd=root, env={**env, "PYTHONPATH": str(root)},
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-3000:]
