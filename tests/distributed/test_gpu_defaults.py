"""Issue 32: what the start-up decides for a GPU, decided here on the CPU. One GPU without TE or
Apex has run the trainer since; most of these decisions need TE, Apex or a missing compiler to be
seen at all.

Each decision is a function of what imports and what is installed (mcore/models.py,
config/determinism.py), so it is checked with those inputs faked: the answer megatron's
TransformerConfig gets with on_gpu=True, on this machine (no Apex, no TE, maybe no compiler)
and with the extension or the compiler present. Model-building checks run once in one spawned
rank (megatron's process groups), the pure functions in this process.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch

from tests.helpers.dist_utils import run_ranks

ROOT = Path(__file__).resolve().parents[2]


def _config(models, **kw):
    """transformer_config for a GPU run of tiny-qwen2, TE reported absent (its RoPE fusion needs it)."""
    from model_providers.presets import preset

    return models.transformer_config(preset("tiny-qwen2"), params_dtype=torch.bfloat16, on_gpu=True, **kw)


def _decisions():
    from model_providers.presets import preset
    from vapo_megatron.mcore import models, parallel

    parallel.init_distributed(1, 1)
    real_te_available = models.te_available
    models.te_available = lambda: False
    out = {}
    # 1. masked_softmax_fusion: Apex's softmax extensions absent (this machine), then present.
    out["softmax_absent"] = _config(models).masked_softmax_fusion
    fakes = {name: types.ModuleType(name) for name in models.SOFTMAX_EXTENSIONS}
    sys.modules.update(fakes)
    try:
        out["softmax_present"] = _config(models).masked_softmax_fusion
    finally:
        for name in fakes:
            del sys.modules[name]
    # 2. deterministic_mode follows trainer.deterministic.
    out["deterministic_on"] = _config(models, deterministic=True).deterministic_mode
    out["deterministic_off"] = _config(models).deterministic_mode
    # 5. the torch.compile'd fusions: no compiler, then one.
    real = models.host_compiler
    try:
        models.host_compiler = lambda: None
        cfg = _config(models)
        out["no_compiler"] = (cfg.bias_activation_fusion, cfg.bias_dropout_fusion)
        models.host_compiler = lambda: "/usr/bin/cc"
        cfg = _config(models)
        out["compiler"] = (cfg.bias_activation_fusion, cfg.bias_dropout_fusion)
    finally:
        models.host_compiler = real
    # 6. the critic's value head on a bf16 trunk output.
    (critic,) = models.build_chunks(preset("tiny-qwen2"), params_dtype=torch.bfloat16, critic=True, on_gpu=False)
    hidden = torch.randn(5, 2, critic.config.hidden_size, generator=torch.Generator().manual_seed(1)).bfloat16()
    with torch.no_grad():
        values = critic._values(hidden_states=hidden)
        head = critic.value_head
        expected = torch.nn.functional.linear(hidden.float(), head.weight.float(), head.bias.float()).squeeze(-1).T
        bf16 = head(hidden).squeeze(-1).T.float()  # what a bf16 head gives
    out["values"] = (values, expected, bf16, head.weight.dtype)
    # The first GPU run's bf16 models (no TE): every parameter in params_dtype, and the optimizer's
    # checkpoint state built against the model's parameters (the save that failed there).
    from vapo_megatron.config import OptimConfig
    from vapo_megatron.mcore.model import wrap_ddp
    from vapo_megatron.mcore.optimizer import build_optimizer, optimizer_step

    for name in ("tiny-qwen2", "tiny-qwen3-moe"):
        for critic in (False, True):
            chunks = models.build_chunks(preset(name), params_dtype=torch.bfloat16, critic=critic, on_gpu=False)
            out[f"dtypes {name} critic={critic}"] = sorted({str(p.dtype) for p in chunks[0].parameters()})
    chunks = wrap_ddp(models.build_chunks(preset("tiny-qwen2"), params_dtype=torch.bfloat16, critic=False,
                                          on_gpu=False),
                      distributed_optimizer=False)
    optimizer = build_optimizer(chunks, OptimConfig(lr=1e-3), params_dtype=torch.bfloat16)
    ids = torch.randint(0, 250, (2, 16), generator=torch.Generator().manual_seed(0))
    chunks[0].zero_grad_buffer()
    chunks[0](ids, torch.arange(16).expand(2, 16), None).float().square().mean().backward()
    optimizer_step(optimizer, chunks, loss_finite=True)
    try:
        optimizer.sharded_state_dict(chunks[0].sharded_state_dict())
        out["bf16 optimizer state"] = "built"
    except AssertionError as e:
        out["bf16 optimizer state"] = str(e)
    # 3. te_available is megatron's HAVE_TE.
    import megatron.core.extensions.transformer_engine as mte

    have = mte.HAVE_TE
    try:
        answers = []
        for flag in (True, False):
            mte.HAVE_TE = flag
            answers.append(real_te_available())
        out["te_follows_megatron"] = answers
    finally:
        mte.HAVE_TE = have
    return out


@pytest.fixture(scope="module")
def decided():
    (res,) = run_ranks(1, _decisions)
    return res


# ---- the first GPU run: a bf16 model without TE ------------------------------------------------

def test_bf16_models_have_every_parameter_in_bf16(decided):
    """The local spec's norms (torch.nn.RMSNorm) were float32 in a bf16 model: on the GPU they were
    also left on the CPU (DDP's broadcast failed), and Float16OptimizerWithFloat16Params, which
    numbers only its float16 parameters, then paired Adam's state with the wrong parameters."""
    dtypes = {k: v for k, v in decided.items() if k.startswith("dtypes ")}
    assert len(dtypes) == 4
    assert all(v == ["torch.bfloat16"] for v in dtypes.values()), dtypes


def test_bf16_optimizer_checkpoint_state_matches_the_model(decided):
    # was: "Optimizer shape ((64,) does not match model shape ((128,))"
    assert decided["bf16 optimizer state"] == "built"


# ---- 1. masked_softmax_fusion needs Apex's softmax extensions ------------------------------------

def test_masked_softmax_fusion_off_on_a_gpu_without_apex_softmax(decided):
    assert decided["softmax_absent"] is False
    assert decided["softmax_present"] is True


def test_softmax_decision_and_the_import_probe(monkeypatch):
    from vapo_megatron.mcore import models

    for on_gpu in (False, True):
        for apex in (False, True):
            assert models.softmax_fusion(on_gpu=on_gpu, apex_softmax=apex) == (on_gpu and apex)
    for name in models.SOFTMAX_EXTENSIONS:
        monkeypatch.delitem(sys.modules, name, raising=False)
    assert models.apex_softmax_available() is False  # this machine: no Apex
    for name in models.SOFTMAX_EXTENSIONS:
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    assert models.apex_softmax_available() is True
    monkeypatch.delitem(sys.modules, models.SOFTMAX_EXTENSIONS[0])
    assert models.apex_softmax_available() is False  # one of the two is not enough


# ---- 2. trainer.deterministic: the environment before CUDA, megatron's deterministic_mode --------

def test_determinism_env_only_when_deterministic():
    from vapo_megatron.config.determinism import determinism_env

    env: dict[str, str] = {}
    assert determinism_env(False, env) == {} and env == {}
    determinism_env(True, env)
    assert env == {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0"}
    env = {"CUBLAS_WORKSPACE_CONFIG": ":16:8", "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "1"}
    determinism_env(True, env)  # a deterministic workspace setting is kept, TE's permission is not
    assert env == {"CUBLAS_WORKSPACE_CONFIG": ":16:8", "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0"}
    env = {"CUBLAS_WORKSPACE_CONFIG": ":0:0"}
    determinism_env(True, env)
    assert env["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"


def test_deterministic_mode_reaches_megatron(decided):
    assert decided["deterministic_on"] is True
    assert decided["deterministic_off"] is False


def test_vapo_train_sets_the_environment_before_it_imports_torch(monkeypatch):
    """checked_config's order: the value checks, determinism_env, then what imports torch (the
    hardware check imports it when a setting needs CUDA; the model files' check loads transformers).
    Before determinism_env, torch is imported only on the way to refusing the start."""
    import vapo_megatron.train as train

    src = Path(train.__file__).read_text()
    body = src[src.index("def checked_config"):src.index("def model_file_problems")]
    env = body.index("determinism_env(cfg.trainer.deterministic)")
    assert "import torch" not in body[:env]
    assert env < body.index("problems = hardware_problems(cfg)") < body.index("model_file_problems(cfg)")
    refusal = body.index("raise problems_error(problems + hardware_problems(cfg))")
    assert refusal < env  # the only earlier call: torch imported, then the start refused


# ---- 3. te_available is megatron's own HAVE_TE ---------------------------------------------------

def test_te_available_follows_megatron(decided):
    assert decided["te_follows_megatron"] == [True, False]


def test_te_with_a_broken_torch_extension_is_absent(tmp_path):
    """A transformer_engine whose __init__ imports but whose torch extension does not (TE's own
    __init__ swallows that failure): megatron falls back to its local spec, and so must we."""
    pkg = tmp_path / "transformer_engine"
    (pkg / "pytorch").mkdir(parents=True)
    (pkg / "__init__.py").write_text("try:\n    from transformer_engine import pytorch\nexcept ImportError:\n"
                                     "    pass\n")
    (pkg / "pytorch" / "__init__.py").write_text("raise ImportError('libtransformer_engine.so: "
                                                 "cannot open shared object')\n")
    code = textwrap.dedent("""
        import transformer_engine  # imports, as on a node whose TE torch extension is broken
        from vapo_megatron.mcore.models import broken_te_line, te_available
        print("TE", te_available())
        print(broken_te_line(te_available()))
    """)
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "TE False" in out.stdout
    assert "Transformer Engine is installed but megatron-core cannot use it" in out.stdout  # the log line agrees


# ---- 5. torch.compile'd fusions need a host C compiler ------------------------------------------

def test_compiled_fusions_off_without_a_compiler(decided):
    assert decided["no_compiler"] == (False, False)
    assert decided["compiler"] == (True, True)


def test_host_compiler_lookup(monkeypatch, tmp_path):
    from vapo_megatron.mcore import models

    for on_gpu in (False, True):
        for compiler in (None, "/usr/bin/cc"):
            assert models.compiled_fusions(on_gpu=on_gpu, compiler=compiler) == (on_gpu and compiler is not None)
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # a bare image: no cc, gcc or clang
    assert models.host_compiler() is None
    fake = tmp_path / "mycc"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    monkeypatch.setenv("CC", "mycc -O2")
    assert models.host_compiler() == str(fake)
    monkeypatch.setenv("CC", "")
    (tmp_path / "gcc").write_text("#!/bin/sh\n")
    (tmp_path / "gcc").chmod(0o755)
    assert models.host_compiler() == str(tmp_path / "gcc")


# ---- 6. the critic's value head computes in float32 ---------------------------------------------

def test_value_head_computes_in_float32_on_a_bf16_trunk(decided):
    values, expected, bf16, weight_dtype = decided["values"]
    assert weight_dtype == torch.bfloat16  # the parameter keeps the model's dtype (checkpoints unchanged)
    assert values.dtype == torch.float32
    torch.testing.assert_close(values, expected, rtol=0, atol=1e-6)
    assert not torch.equal(values, bf16)  # a bf16 matmul rounds to 3 significant digits


# ---- 7. rollout.sglang.mem_fraction against the offload, at start-up (the collective part) -------

def _engine_share(offload: bool):
    """check_engine_share on 2 ranks with CUDA faked: an 80 GiB GPU, rank 1 holding more state."""
    from vapo_megatron.config import ConfigError, load_config
    from vapo_megatron.mcore import offload as off
    from vapo_megatron.mcore import parallel
    from vapo_megatron.sizing.plan import check_engine_share

    parallel.init_distributed(1, 1)
    cfg = load_config(str(ROOT / "configs" / "qwen3_32b_vapo.yaml"),
                      [f"trainer.offload_during_rollout={str(offload).lower()}", "rollout.sglang.mem_fraction=0.6"],
                      check_paths=False)
    torch.cuda.is_available = lambda: True
    torch.cuda.current_device = lambda: 0
    torch.cuda.get_device_properties = lambda _: types.SimpleNamespace(total_memory=80 << 30)
    off.host_bytes = lambda models: (10 if parallel.is_rank0() else 30) << 30
    try:
        check_engine_share(cfg, [])
    except ConfigError as e:
        return str(e)
    return None


def test_engine_share_checked_on_every_rank_by_the_worst_one():
    refused = run_ranks(2, _engine_share, False)
    assert refused[0] is not None and refused[0] == refused[1]  # every rank stops, with the same line
    assert refused[0].startswith("rollout.sglang.mem_fraction=0.6 with trainer.offload_during_rollout=false")
    assert "30.0 GiB (the worst rank's, resident)" in refused[0]
    assert run_ranks(2, _engine_share, True) == [None, None]  # with the offload the state leaves the GPU
