"""The Qwen3-MoE family's pure parts: which layers get experts, what a config may say, and how a
megatron expert parameter name finds its table row and global expert number."""

from __future__ import annotations

import pytest

from model_providers import QWEN3_MOE, HFConfigError, check_supported
from model_providers.presets import preset
from model_providers.qwen3_moe import moe_layer_pattern
from vapo_megatron.weights.params import expert_key


def _cfg(**change) -> dict:
    cfg = {**preset("qwen3-30b-a3b"), "_source": "/m/config.json"}
    cfg.update(change)
    return cfg


def test_dense_layers_follow_transformers_rule():
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeDecoderLayer, Qwen3MoeSparseMoeBlock

    cfg = dict(num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=[3])
    hf = Qwen3MoeConfig(hidden_size=16, intermediate_size=32, moe_intermediate_size=8, num_attention_heads=2,
                        num_key_value_heads=1, head_dim=8, num_experts=4, num_experts_per_tok=2, **cfg)
    want = [int(isinstance(Qwen3MoeDecoderLayer(hf, i).mlp, Qwen3MoeSparseMoeBlock)) for i in range(6)]
    assert moe_layer_pattern(cfg) == want == [0, 1, 0, 0, 0, 1]


def test_architecture_of_the_published_30b_a3b():
    arch = QWEN3_MOE.architecture(_cfg())
    t = arch.transformer
    assert arch.num_experts == 128 and t["moe_router_topk"] == 8 and t["moe_ffn_hidden_size"] == 768
    assert t["moe_router_pre_softmax"] is False  # norm_topk_prob=true: softmax over the top-k
    assert t["moe_layer_freq"] == [1] * 48 and t["qk_layernorm"] and not t["add_qkv_bias"]
    # transformers 5 writes num_local_experts in place of the Hub's num_experts
    cfg = _cfg(num_local_experts=128)
    del cfg["num_experts"]
    assert QWEN3_MOE.architecture(cfg).num_experts == 128


@pytest.mark.parametrize("change, says", [
    (dict(num_experts_per_tok=200), "num_experts_per_tok=200 is more than num_experts=128"),
    (dict(moe_intermediate_size=0), "moe_intermediate_size=0 is not supported"),
    (dict(mlp_only_layers=list(range(48))), "no layer has routed experts"),
    (dict(attention_bias=True), "attention_bias=true is not supported for Qwen3-MoE"),
    (dict(hidden_act="gelu"), "hidden_act='gelu' is not supported"),
])
def test_unsupported_settings_are_one_line_naming_the_config(change, says):
    with pytest.raises(HFConfigError) as e:
        check_supported(_cfg(**change))
    assert str(e.value).startswith("/m/config.json: ") and says in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("rest, per_rank, ep_rank, want", [
    ("mlp.experts.local_experts.1.linear_fc1.weight", 64, 1,
     ("mlp.experts.local_experts.{expert}.linear_fc1.weight", 65)),
    ("mlp.experts.local_experts.0.linear_fc2.weight", 2, 0,
     ("mlp.experts.local_experts.{expert}.linear_fc2.weight", 0)),
    # Transformer Engine's grouped GEMM keeps a rank's experts as weight0, weight1, ...
    ("mlp.experts.linear_fc2.weight3", 16, 2, ("mlp.experts.local_experts.{expert}.linear_fc2.weight", 35)),
    ("mlp.router.weight", 16, 2, ("mlp.router.weight", None)),
    ("mlp.linear_fc1.weight", 16, 2, ("mlp.linear_fc1.weight", None)),
])
def test_expert_parameter_names_find_their_row_and_global_number(rest, per_rank, ep_rank, want):
    assert expert_key(rest, per_rank=per_rank, ep_rank=ep_rank) == want
    key, expert = want
    rows = {r.mcore: r for r in QWEN3_MOE.rows}
    row = rows["decoder.layers.{layer}." + key]
    if expert is not None:
        bound = row.for_expert(expert)
        assert bound.hf_names(5)[-1].startswith(f"model.layers.5.mlp.experts.{expert}.")
        assert bound.for_expert(7).hf_names(5) == row.for_expert(7).hf_names(5)  # rebinding uses the template


@pytest.mark.parametrize("change, says", [
    (dict(mlp_only_layers=[3]), "has dense layers [3] (mlp_only_layers / decoder_sparse_step)"),
    (dict(tie_word_embeddings=True), "has tie_word_embeddings=true"),
])
def test_sglang_refuses_what_its_qwen3_moe_would_silently_drop(change, says):
    """SGLang 0.5.23's Qwen3-MoE builds every layer with experts and always its own lm_head
    (tests/unit/test_sglang_api.py pins both from its source), so such a model is refused with
    SGLang rollouts, in one line naming the setting and the config, and accepted with the
    embedded engine (transformers builds what the config says)."""
    from vapo_megatron.config.load import load_config
    from vapo_megatron.config.preflight import moe_problems

    hf = _cfg(**change)
    for engine, refused in (("sglang", True), ("sglang_http", True), ("embedded", False)):
        urls = ["rollout.sglang_http.urls=[http://127.0.0.1:30000]"] if engine == "sglang_http" else []
        cfg = load_config("configs/qwen3_30b_a3b_vapo.yaml", [f"rollout.engine={engine}", *urls], check_paths=False)
        problems = moe_problems(cfg, [("model.hf_path", hf)])
        assert bool(problems) == refused, (engine, problems)
        if refused:
            (line,) = problems
            assert line.startswith(f"rollout.engine={engine}: model.hf_path (/m/config.json) ") and says in line
    cfg = load_config("configs/qwen3_30b_a3b_vapo.yaml", [], check_paths=False)
    assert moe_problems(cfg, [("model.hf_path", _cfg())]) == []  # the published config goes through


def test_partial_rollout_with_routing_replay_is_refused_in_one_line():
    """Routing replay records a response's routes in one generate call; partial rollout grows a
    response over several (engine extend), so the two together are refused at start-up, unless
    routing replay is off (or the policy is dense: nothing to replay)."""
    from vapo_megatron.config.load import load_config
    from vapo_megatron.config.preflight import moe_problems

    def problems(*overrides, hf=None):
        cfg = load_config("configs/qwen3_30b_a3b_vapo.yaml", ["rollout.partial.enabled=true", *overrides],
                          check_paths=False)
        return moe_problems(cfg, [("model.hf_path", hf or _cfg())])

    for setting, shown in (([], "null"), (["rollout.routing_replay=true"], "true")):
        (line,) = problems(*setting)
        assert line.startswith(f"rollout.partial.enabled=true with rollout.routing_replay={shown}: model.hf_path "
                               "(/m/config.json) is a mixture-of-experts model"), line
        assert line.endswith("set rollout.routing_replay=false or rollout.partial.enabled=false"), line
    assert problems("rollout.routing_replay=false") == []
    dense = {"model_type": "qwen2", "_source": "/d/config.json"}
    assert problems(hf=dense) == []  # null on a dense model: no replay, nothing to refuse
    assert moe_problems(load_config("configs/qwen3_30b_a3b_vapo.yaml", [], check_paths=False),
                        [("model.hf_path", _cfg())]) == []  # partial rollout off: replay as before
