"""Issue 21, defect 1: gradient_accumulation_fusion needs Apex, not only Transformer Engine.

megatron's ColumnParallelLinear (GPTModel's output layer, built for actor and critic) raises at
construction when the config asks for the fusion and Apex's fused_weight_gradient_mlp_cuda does
not import (megatron/core/tensor_parallel/layers.py). On the pip route (TE, no Apex) the
project's own config must therefore not ask for it. Transformer Engine cannot import here, so its
availability is the one input given to transformer_config (mcore/models.py te_available); Apex's
is this machine's real answer (absent), and the layer is megatron's real one, CPU-initialized.
megatron's TransformerConfig checks RoPE fusion against TE's real presence, so that one field
(which needs TE and nothing else) is turned off before the config is built; every other field is
the project's own.
"""

from __future__ import annotations

import dataclasses
import importlib.util

import torch

from tests.helpers.dist_utils import run_ranks


def _build_output_layer(te_imports: bool):
    import megatron.core.transformer as mtransformer
    from megatron.core import tensor_parallel

    from model_providers.presets import preset
    from vapo_megatron.mcore import models, parallel

    parallel.init_distributed(1, 1)
    models.te_available = lambda: te_imports  # what a GPU node with TE answers
    real = mtransformer.TransformerConfig
    mtransformer.TransformerConfig = lambda **kw: real(**{**kw, "apply_rope_fusion": False})
    try:
        cfg = models.transformer_config(preset("tiny-qwen2"), params_dtype=torch.float32, on_gpu=True)
    finally:
        mtransformer.TransformerConfig = real
    # GPTModel's output layer as gpt_model.py builds it; CPU-initialized since there is no GPU here.
    cpu_cfg = dataclasses.replace(cfg, use_cpu_initialization=True)
    try:
        tensor_parallel.ColumnParallelLinear(cfg.hidden_size, 256, config=cpu_cfg, init_method=cfg.init_method,
                                             bias=False, gather_output=False)
        built = ""
    except RuntimeError as e:
        built = str(e)
    apex = importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is not None
    return {"fusion": cfg.gradient_accumulation_fusion, "apex": apex, "error": built}


def test_output_layer_builds_when_te_imports_and_apex_does_not():
    (res,) = run_ranks(1, _build_output_layer, True)
    assert res["apex"] is False  # this machine, like the pip route, has no Apex
    assert res["error"] == "", res["error"]  # megatron's check passes: no fusion was asked for
    assert res["fusion"] is False


def test_decision_needs_gpu_te_and_apex():
    from vapo_megatron.mcore.models import wgrad_fusion

    for on_gpu in (False, True):
        for te in (False, True):
            for apex in (False, True):
                assert wgrad_fusion(on_gpu=on_gpu, te=te, apex=apex) == (on_gpu and te and apex)


def test_the_te_and_apex_world_fuses_on_the_cpu_and_no_other_does(monkeypatch):
    """Issue 55 item 6: the tests' world with TE and Apex (an NGC image's) builds its models with
    gradient_accumulation_fusion as a GPU node with both does (mcore/models.py WGRAD_FUSION_ON_CPU,
    set by worlds.world_env), so tests/distributed/test_te_world.py trains, resumes and syncs with
    TE's fused accumulation into main_grad; a model built on the CPU on purpose (on_gpu=False:
    vapo-convert, vapo-plan) never fuses, and the commands never set the switch."""
    from tests.helpers.worlds import WORLDS, world_env
    from vapo_megatron.mcore import models

    monkeypatch.delenv(models.WGRAD_FUSION_ON_CPU, raising=False)
    assert not models.wgrad_fusion_hardware(None) and models.wgrad_fusion_hardware(True)
    for value, on in (("1", True), ("0", False)):
        monkeypatch.setenv(models.WGRAD_FUSION_ON_CPU, value)
        assert models.wgrad_fusion_hardware(None) is on and not models.wgrad_fusion_hardware(False)
    assert [w for w in WORLDS if world_env(w).get(models.WGRAD_FUSION_ON_CPU) == "1"] == ["te_apex"]
