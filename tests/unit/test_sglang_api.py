"""Every call vapo_megatron/rollout makes into SGLang, against the installed SGLang's source (engine.py, io_struct.py,
the Qwen2/Qwen3/Qwen3-MoE/Llama model files read via ast; ServerArgs, SamplingParams used directly): a renamed argument,
field or weight mapping fails here. docs/weight_sync.md lists the calls; test_sglang_shutdown.py checks the shutdown."""

from __future__ import annotations

import dataclasses
import inspect
import re

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

from model_providers import QWEN3_MOE
from model_providers.qwen2 import MLP_ROWS
from model_providers.qwen3_moe import EXPERT_ROWS, moe_layer_pattern, num_experts
from tests.helpers.sglang_doubles import FakeColocatedSGLangEngineForTests, FakeSGLangEngineForTests, hf_state
from tests.helpers.sglang_source import (
    engine_method,
    engine_signature,
    engine_start_nccl_env,
    fused_moe_local_expert,
    legacy_load_target,
    qwen3_moe_expert_mapping,
    qwen3_moe_layer_is_sparse,
    qwen3_moe_load_target,
    qwen3_moe_params,
    sglang_param_names,
    stacked_params_mapping,
)
from tests.helpers.tiny_hf import qwen3_moe_config
from vapo_megatron.rollout.base import SamplingParams
from vapo_megatron.rollout.sglang_engine import SGLangEngineConfig, engine_kwargs
from vapo_megatron.rollout.sglang_payloads import order_by_engine_rank
from vapo_megatron.rollout.sglang_requests import expand_requests, parse_output

ENGINE_CALLS = ("generate", "begin_weight_update", "end_weight_update", "update_weights_from_tensor",
                "release_memory_occupation", "resume_memory_occupation", "flush_cache")


def test_engine_kwargs_are_sglang_server_args():
    from sglang.srt.server_args import ServerArgs

    from vapo_megatron.rollout.engine_signals import EngineDeath

    # dummy: what colocated engines start with; the handler: SGLang's SIGQUIT becomes EngineDied
    cfg = SGLangEngineConfig(model_path="/m", tp_size=2, base_gpu_id=4, mem_fraction_static=0.6, dtype="bfloat16",
                             random_seed=3, deterministic=True, load_format="dummy", sigquit_handler=EngineDeath("e"),
                             return_routes=True, max_total_tokens=4096)
    kwargs = engine_kwargs(cfg)
    assert kwargs["enable_return_routed_experts"] is True  # routing replay: the engine's capturer is on
    assert (kwargs["max_total_tokens"] == 4096
            and "max_total_tokens" not in engine_kwargs(SGLangEngineConfig("/m", 1, 0, 0.5)))
    assert kwargs["custom_sigquit_handler"] is cfg.sigquit_handler and kwargs["load_format"] == "dummy"
    args = ServerArgs(**kwargs)  # what sglang.Engine(**kwargs) builds first; unknown names raise
    for name, value in kwargs.items():
        assert getattr(args, name) == value, name
    assert args.enable_memory_saver and args.skip_tokenizer_init and args.enable_deterministic_inference
    with pytest.raises(TypeError, match="bogus"):
        ServerArgs(**kwargs, bogus=1)  # the check above would catch a misspelt name
    # SGLang's CPU engine (test_sglang_colocated_real.py starts it): CPU settings, no GPU ids, no memory saver (CUDA's)
    cpu = engine_kwargs(dataclasses.replace(cfg, device="cpu"))
    assert {k: cpu[k] for k in ("device", "attention_backend", "sleep_on_idle")} == {
        "device": "cpu", "attention_backend": "torch_native", "sleep_on_idle": True}
    assert "base_gpu_id" not in cpu and "enable_memory_saver" not in cpu
    assert all(getattr(ServerArgs(**cpu), k) == v for k, v in cpu.items())


def test_every_rank_has_the_nccl_settings_sglang_gives_its_owner():
    """sglang.Engine's start sets NCCL variables in its owner's process only (engine.py _set_envs_and_config from
    source, for our ServerArgs): init_distributed's nccl_env sets them first on each rank; the start changes none."""
    from sglang.srt.arg_groups.model_override_base import resolving_view
    from sglang.srt.environ import envs
    from sglang.srt.server_args import ServerArgs

    from vapo_megatron.mcore.nccl_env import nccl_env

    cfg = SGLangEngineConfig(model_path="/m", tp_size=2, base_gpu_id=0, mem_fraction_static=0.6)
    args = ServerArgs(**engine_kwargs(cfg))
    start = lambda env: engine_start_nccl_env(args, env, resolving_view=resolving_view, envs=envs)  # noqa: E731
    by_sglang, ours = {}, {}
    start(by_sglang)  # a process without NCCL settings: what an owner had and its peers lacked
    assert nccl_env(ours) == by_sglang and set(by_sglang) == {"NCCL_CUMEM_ENABLE", "NCCL_NVLS_ENABLE"}
    after = dict(ours)
    start(after)
    assert after == ours and nccl_env(ours) == {}  # the start leaves every rank's values; idempotent
    job = {"NCCL_NVLS_ENABLE": "1"}  # the job's own value: kept by both, so on every rank alike
    assert nccl_env(job) == {"NCCL_CUMEM_ENABLE": "0"}
    kept = dict(job)
    start(job)
    assert job == kept
    # Engine TP rank i runs on GPU base_gpu_id + i (engine.py's scheduler launch: gpu_id_step 1,
    # one pipeline stage), the GPU whose trainer rank's payload order_by_engine_rank puts at i.
    assert (resolving_view(args).gpu_id_step, args.pp_size, args.dp_size) == (1, 1, 1)


@pytest.mark.parametrize("double", [FakeSGLangEngineForTests, FakeColocatedSGLangEngineForTests])
def test_test_doubles_take_the_real_engine_signatures(double):
    methods = [n for n, f in inspect.getmembers(double, inspect.isfunction) if n in ENGINE_CALLS]
    assert sorted(methods) == sorted(ENGINE_CALLS)  # every call we make is implemented
    for name in methods:
        assert inspect.signature(getattr(double, name)) == engine_signature(name), name
    fake = FakeSGLangEngineForTests(hf_state()[0])
    with pytest.raises(TypeError):  # a field of the request struct that Engine's method does not take
        fake.update_weights_from_tensor([], load_format="flattened_bucket", weight_version="1")
    with pytest.raises(TypeError):
        fake.release_memory_occupation(["weights"], "extra")


def test_engine_signature_is_read_from_source():
    sig = engine_signature("update_weights_from_tensor")
    assert list(sig.parameters) == ["self", "named_tensors", "load_format", "flush_cache"]
    assert sig.parameters["flush_cache"].default is True and sig.parameters["load_format"].default is None
    assert engine_signature("release_memory_occupation").parameters["tags"].default is None

    class Double:
        @engine_method
        def begin_weight_update(self, selector):
            return selector

    assert Double().begin_weight_update() == "all"  # the real default arrives


def test_sampling_params_are_sglang_sampling_params():
    from sglang.srt.sampling.sampling_params import SamplingParams as SGLangSamplingParams

    p = SamplingParams(n=2, temperature=0.7, top_p=0.9, top_k=0, max_new_tokens=5, stop_token_ids=(2, 9), seed=10)
    ids, sps, owners = expand_requests([[1, 2], [3]], p)
    assert owners == [0, 0, 1, 1] and ids == [[1, 2], [1, 2], [3], [3]]
    for k, sp in enumerate(sps):
        s = SGLangSamplingParams(**sp)
        s.verify(vocab_size=100)
        assert s.max_new_tokens == 5 and s.temperature == 0.7 and s.top_p == 0.9
        assert s.stop_token_ids == {2, 9} and s.no_stop_trim and not s.skip_special_tokens and s.n == 1
        assert s.sampling_seed == 10 + k
        assert s.top_k >= 1 << 30  # -1 -> SGLang's "whole vocabulary"
    greedy = SGLangSamplingParams(**expand_requests([[1]], SamplingParams(temperature=0.0))[1][0])
    assert greedy.top_k == 1  # SGLang turns temperature 0 into top_k=1


def test_sglang_samples_a_token_from_its_seed_and_position_only():
    """What makes a continuation (prompt + response so far as input_ids) draw the tokens the one-go generation drew
    (rollout/sglang_requests.py), from SGLang's source: the seeded sampler's noise is murmur_hash32(seed, positions,
    columns), and ModelRunner.sample passes a prefill's last input position and a decode step's input token position."""
    import ast

    from tests.helpers.sglang_source import SRT

    def tree(path):
        return ast.parse(path.read_text())

    fn = next(n for n in ast.walk(tree(SRT / "layers" / "sampler.py"))
              if isinstance(n, ast.FunctionDef) and n.name == "multinomial_with_seed")
    hashes = [ast.unparse(c) for c in ast.walk(fn)
              if isinstance(c, ast.Call) and ast.unparse(c.func) == "murmur_hash32"]
    assert hashes == ["murmur_hash32(seed, positions, col_indices)"]
    runner = next(n for n in ast.walk(tree(SRT / "model_executor" / "model_runner.py"))
                  if isinstance(n, ast.ClassDef) and n.name == "ModelRunner")
    sample = next(n for n in runner.body if isinstance(n, ast.FunctionDef) and n.name == "sample")
    call = next(c for c in ast.walk(sample) if isinstance(c, ast.Call) and ast.unparse(c.func) == "self.sampler")
    forward = next(n for n in ast.walk(tree(SRT / "layers" / "sampler.py")) if isinstance(n, ast.FunctionDef)
                   and n.name == "forward" and any(a.arg == "positions" for a in n.args.args))
    at = [a.arg for a in forward.args.args[1:]].index("positions")  # Sampler.forward's parameter, by position
    assert ast.unparse(call.args[at]) == ("forward_batch.positions if forward_batch.forward_mode.is_decode() "
                                          "else forward_batch.seq_lens - 1")
    batch_info = (SRT / "sampling" / "sampling_batch_info.py").read_text()
    assert "enable_deterministic = get_exec().deterministic.enable_deterministic_inference" in batch_info


@pytest.mark.parametrize("temperature", [0.8, 0.0])
def test_a_response_continued_through_sglangs_api_is_the_one_go_response(temperature):
    """Partial rollout over SGLang (issue 47): SGLangEngine.extend sends prompt + response so far with the response's
    seed and the round's budget (SGLang's SamplingParams checks each), and a sampler drawing as SGLang's does (seed and
    position only) continues each response to exactly the one-go response: tokens, finish reasons and log-probs."""
    from tests.helpers.sglang_doubles import SeededSamplingEngineForTests
    from vapo_megatron.rollout.base import Continuation
    from vapo_megatron.rollout.sglang_engine import SGLangEngine

    model, _ = hf_state()
    eng = SGLangEngine(SeededSamplingEngineForTests(model.eval()))
    prompts = [[5, 9, 11], [12], [30, 31]]
    p = SamplingParams(n=2, temperature=temperature, max_new_tokens=9, stop_token_ids=(40, 41, 42, 43, 44), seed=77)
    whole = eng.generate(prompts, p)
    grown = [[] for _ in whole]
    logps = [[] for _ in whole]
    done = [False] * len(whole)
    for piece in range(20):
        rows = [b for b in range(len(whole)) if not done[b]]
        if not rows:
            break
        reqs = [Continuation(prompts[b // 2], grown[b], p.sample_seed(b // 2, b % 2),
                             min(1 + (b + piece) % 3, p.max_new_tokens - len(grown[b]))) for b in rows]
        for b, o in zip(rows, eng.extend(reqs, p)):
            grown[b] += o.token_ids
            logps[b] += o.logprobs
            done[b] = o.finish_reason == "stop" or len(grown[b]) == p.max_new_tokens
    assert grown == [o.token_ids for o in whole] and logps == [o.logprobs for o in whole]
    assert [grown[b][-1] in p.stop_token_ids for b in range(len(whole))] == [o.finish_reason == "stop" for o in whole]
    if temperature:
        assert len({tuple(g) for g in grown}) > 3  # the samples differ


def test_parse_output_reads_sglang_fields():
    out = {"output_ids": [4, 2], "meta_info": {"finish_reason": {"type": "stop", "matched": 2},
                                               "output_token_logprobs": [(-0.1, 4, None), (-0.2, 2, None)]}}
    r = parse_output(out, prompt_index=3, version=5)
    assert ((r.prompt_index, r.token_ids, r.finish_reason, r.logprobs, r.weight_version)
            == (3, [4, 2], "stop", [-0.1, -0.2], 5))
    out["meta_info"]["output_token_logprobs"] = [(-0.1, 4, None), (-0.2, 7, None)]
    with pytest.raises(RuntimeError, match="do not match"):
        parse_output(out, 0, 0)
    with pytest.raises(RuntimeError, match="abort"):
        parse_output({"output_ids": [], "meta_info": {"finish_reason": {"type": "abort", "message": "x"}}}, 0, 0)


def test_each_engine_rank_gets_the_handle_of_its_own_gpu():
    # Members in group-rank order on GPUs 5, 4 (a launcher that numbered them the other way):
    # engine TP rank 0 runs on base_gpu_id = 4 and must get the payload made on GPU 4.
    assert order_by_engine_rank([(5, b"on5"), (4, b"on4")], base_gpu_id=4) == [b"on4", b"on5"]
    assert order_by_engine_rank([(2, b"a"), (3, b"b")], base_gpu_id=2) == [b"a", b"b"]
    assert order_by_engine_rank([(None, b"a"), (None, b"b")], base_gpu_id=0) == [b"a", b"b"]  # CPU payloads
    with pytest.raises(RuntimeError, match="its own GPU"):
        order_by_engine_rank([(0, b"a"), (2, b"b")], base_gpu_id=0)  # GPU 1 missing
    with pytest.raises(RuntimeError, match="its own GPU"):
        order_by_engine_rank([(1, b"a"), (2, b"b")], base_gpu_id=0)


def _tiny(config_cls, tied: bool):
    cfg = config_cls(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, tie_word_embeddings=tied, head_dim=4)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg)


@pytest.mark.parametrize("config_cls", [Qwen2Config, Qwen3Config])
@pytest.mark.parametrize("tied", [False, True])
def test_hf_names_reach_sglang_qwen_parameters(config_cls, tied):
    qwen2 = stacked_params_mapping("qwen2", "_legacy_load_weights")
    assert stacked_params_mapping("qwen3", "load_weights") == qwen2  # one name flow for both families
    model = _tiny(config_cls, tied)
    params = dict(model.named_parameters())
    sglang_params = sglang_param_names(params, qwen2)
    assert ("lm_head.weight" in params) == (not tied)  # tied: SGLang fills lm_head from embed_tokens
    fused = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
             "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
    for name in params:
        target = legacy_load_target(name, sglang_params, qwen2)
        assert target is not None, name
        part = name.split(".")[-2]
        if part in fused:
            assert target == (name.replace(part, fused[part][0]), fused[part][1])
        else:
            assert target == (name, None)
    if tied:  # in the state dict, but not a parameter of SGLang's model: hf_export skips it
        assert "lm_head.weight" in model.state_dict()
        assert legacy_load_target("lm_head.weight", sglang_params, qwen2) is None
    # A fused name, as Megatron holds it, is dropped by SGLang (a log line only): we never push one.
    assert legacy_load_target("model.layers.0.self_attn.qkv_proj.weight", sglang_params, qwen2) is None
    assert legacy_load_target("model.layers.0.mlp.gate_up_proj.weight", sglang_params, qwen2) is None


@pytest.mark.parametrize("tied", [False, True])
def test_hf_names_reach_sglang_llama_parameters(tied):
    """SGLang's LlamaForCausalLM.load_weights runs _legacy_load_weights by default (as Qwen2's),
    whose mapping folds the same HF names, spelled with a leading dot (".q_proj" -> ".qkv_proj")."""
    llama = stacked_params_mapping("llama", "_legacy_load_weights")
    assert ([(p.lstrip("."), s.lstrip("."), i) for p, s, i in llama]
            == stacked_params_mapping("qwen2", "_legacy_load_weights"))
    model = _tiny(LlamaConfig, tied)
    params = dict(model.named_parameters())
    sglang_params = sglang_param_names(params, llama)
    assert ("lm_head.weight" in params) == (not tied)  # tied (Llama 3.2 1B/3B): SGLang uses embed_tokens
    fused = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
             "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
    for name in params:  # every name the sync pushes (LLAMA's table: no biases anywhere)
        target = legacy_load_target(name, sglang_params, llama)
        part = name.split(".")[-2]
        assert target == ((name.replace(part, fused[part][0]), fused[part][1]) if part in fused else (name, None)), name
    assert not any(n.endswith(".bias") for n in params)
    # Unlike Qwen2's undotted mapping (where "v_proj" matches inside "qkv_proj", the name dropped), a fused name reaches
    # Llama's qkv_proj whole, in SGLang's [q; k; v] order, not Megatron's per-group one: pushing Megatron's fused tensor
    # would silently load wrong weights. The sync sends the table's separate HF names only (the loop above).
    assert legacy_load_target("model.layers.0.self_attn.qkv_proj.weight", sglang_params, llama) == (
        "model.layers.0.self_attn.qkv_proj.weight", None)


def _qwen3_moe_sent(hf_cfg: dict) -> list[str]:
    """Every HF name the weight sync pushes for a Qwen3-MoE actor: the export table's rows, with each layer's dense-MLP
    rows or its router and expert rows (moe_layer_pattern), every expert bound by Row.for_expert."""
    pattern, experts, names = moe_layer_pattern(hf_cfg), num_experts(hf_cfg), []
    for row in QWEN3_MOE.export_table(hf_cfg, critic=False):
        if not row.has_layer():
            names += row.hf_names()
            continue
        for layer, sparse in enumerate(pattern):
            if (row in EXPERT_ROWS and not sparse) or (row in MLP_ROWS and sparse):
                continue
            bound = [row.for_expert(e) for e in range(experts)] if row.has_expert() else [row]
            names += [n for r in bound for n in r.hf_names(layer)]
    return names


def _qwen3_moe_targets(cfg) -> tuple[dict, set[str]]:
    """{sent name: SGLang's load target or None}, and SGLang's parameter names, for the config object."""
    stacked = stacked_params_mapping("qwen3_moe", "load_weights")
    experts, params = qwen3_moe_expert_mapping(cfg), qwen3_moe_params(cfg)
    return {n: qwen3_moe_load_target(n, params, stacked, experts) for n in _qwen3_moe_sent(cfg.to_dict())}, params


def test_hf_names_reach_sglang_qwen3_moe_parameters():
    """Qwen3MoeForCausalLM.load_weights: q/k/v fold as Qwen3's; each expert's gate/up/down goes to
    its layer's FusedMoE (gate -> w13 shard w1, up -> w3, down -> w2_weight) with its global
    expert id; the router `mlp.gate` loads as is. All layers sparse, untied: the Hub's Qwen3-MoE."""
    assert stacked_params_mapping("qwen3_moe", "load_weights") == stacked_params_mapping("qwen3", "load_weights")
    cfg = qwen3_moe_config(mlp_only_layers=())
    targets, params = _qwen3_moe_targets(cfg)
    fused = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v")}
    for name, target in targets.items():
        m = re.fullmatch(r"(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight", name)
        part = name.split(".")[-2]
        assert target is not None, f"{name} reaches no parameter of SGLang's model"
        if m:
            want = (m[1] + (".w2_weight" if m[3] == "down" else ".w13_weight"),
                    {"gate": "w1", "up": "w3", "down": "w2"}[m[3]], int(m[2]))
        elif part in fused:
            want = (name.replace(part, fused[part][0]), fused[part][1], None)
        else:
            want = (name, None, None)
        assert target == want, name
    assert {t[0] for t in targets.values()} == params  # and every parameter of SGLang's model is written
    assert len(targets) == len(_qwen3_moe_sent(cfg.to_dict()))  # no name sent twice
    assert sum(".mlp.experts." in n for n in targets) == 4 * 4 * 3  # layers x experts x (gate, up, down)
    stacked, experts = stacked_params_mapping("qwen3_moe", "load_weights"), qwen3_moe_expert_mapping(cfg)
    # Dropped without a log line: fused expert names (transformers 5 holds its experts so, in
    # memory), Megatron's names, a dense MLP's names on an expert layer. We never push those.
    for bad in ("model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.0.gate_up_proj.weight",
                "decoder.layers.0.mlp.router.weight", "decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight",
                "model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.down_proj.weight"):
        assert qwen3_moe_load_target(bad, params, stacked, experts) is None, bad


def test_sglang_qwen3_moe_has_no_dense_layers():
    """SGLang's Qwen3MoeDecoderLayer.stage_facts builds every layer with experts, reading neither mlp_only_layers nor
    decoder_sparse_step. A model with dense layers (the tiny one: layer 2) loses their MLP: the names are dropped, that
    layer's experts keep what they had. No published Qwen3-MoE has dense layers; the trainer refuses none yet."""
    cfg = qwen3_moe_config()
    assert moe_layer_pattern(cfg.to_dict()) == [1, 1, 0, 1]  # transformers and megatron
    assert [qwen3_moe_layer_is_sparse(cfg, layer) for layer in range(4)] == [True] * 4  # SGLang
    targets, params = _qwen3_moe_targets(cfg)
    assert {n for n, t in targets.items() if t is None} == {f"model.layers.2.mlp.{p}_proj.weight"
                                                            for p in ("gate", "up", "down")}
    p = "model.layers.2.mlp."
    assert params - {t[0] for t in targets.values() if t} == {p + "gate.weight", p + "experts.w13_weight",
                                                              p + "experts.w2_weight"}


def test_sglang_qwen3_moe_lm_head_is_not_tied():
    """SGLang's Qwen3MoeForCausalLM always builds its own lm_head (never reading tie_word_embeddings). The sync sends no
    tied lm_head, so it would keep what it had (random, with load_format="dummy"). Published Qwen3-MoEs are untied."""
    cfg = qwen3_moe_config(tied=True, mlp_only_layers=())
    targets, params = _qwen3_moe_targets(cfg)
    assert "lm_head.weight" not in targets and all(t is not None for t in targets.values())
    assert params - {t[0] for t in targets.values()} == {"lm_head.weight"}


@pytest.mark.parametrize("ep", [1, 2, 4])
def test_each_sglang_ep_rank_keeps_its_own_experts(ep):
    """Each engine TP rank is sent every expert's full tensors; SGLang's FusedMoE.weight_loader
    keeps global expert e on EP rank e // (E/ep) only, in local slot e % (E/ep)."""
    E = 4
    for e in range(E):
        slots = {r: fused_moe_local_expert(e, ep_rank=r, ep_size=ep, num_experts=E) for r in range(ep)}
        assert {r: s for r, s in slots.items() if s != -1} == {e // (E // ep): e % (E // ep)}


def test_sglang_refuses_deterministic_inference_on_the_cpu():
    """Why trainer.deterministic (vapo-eval --deterministic) is refused with SGLang's CPU engine (config/preflight.py
    hardware_problems), per SGLang's source: deterministic inference takes only DETERMINISTIC_ATTENTION_BACKEND_CHOICES,
    none a CPU one (torch_native, intel_amx: the CPU engine's), and its batch-invariant kernels register for an
    accelerator's dispatch key or raise. A SGLang that allows it fails here (then the refusal can go)."""
    import ast

    from tests.helpers.sglang_source import SRT

    def function(path, name):
        return next(n for n in ast.walk(ast.parse(path.read_text()))
                    if isinstance(n, ast.FunctionDef) and n.name == name)

    choices = next(n.value for n in ast.parse((SRT / "arg_groups" / "choices.py").read_text()).body
                   if isinstance(n, ast.Assign)
                   and ast.unparse(n.targets[0]) == "DETERMINISTIC_ATTENTION_BACKEND_CHOICES")
    allowed = ast.literal_eval(choices)
    assert "torch_native" not in allowed and "intel_amx" not in allowed, allowed
    check = ast.unparse(function(SRT / "arg_groups" / "overrides.py", "_deterministic_attention_backend"))
    assert ("elif view.attention_backend not in DETERMINISTIC_ATTENTION_BACKEND_CHOICES:\n"
            "        raise ValueError(" in check)
    dispatch = ast.unparse(function(SRT / "utils" / "common.py", "get_dispatch_device_backend"))
    assert dispatch.endswith("else:\n        raise RuntimeError('No supported accelerator (CUDA/XPU) available')\n"
                             "    return dispatch_key"), dispatch
