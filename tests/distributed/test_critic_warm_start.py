"""critic.warm_start (issue 65): the critic starts from a value model, an HF
Qwen2ForTokenClassification directory or a Megatron critic checkpoint (vapo-convert's hf-to-mcore
--critic, the form of a run's checkpoints/iter_N/critic), and its values are then transformers'
own model's (float32, 1e-4). Bad starts are refused by the start-up checks, one line each naming
the key, before any work: a policy (HF or Megatron), another family, another vocabulary, a
ForTokenClassification without its score head, a run directory, both start keys at once."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.helpers.dist_utils import run_ranks
from tests.helpers.tiny_hf import input_ids, save_tiny, save_tiny_tokenizer

TOL = 1e-4


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("warm")
    actor, critic = root / "actor", root / "critic"
    save_tiny(actor, kind="qwen2")
    save_tiny_tokenizer(actor)
    value = save_tiny(critic, kind="qwen2", critic=True, seed=7)
    ids = input_ids()
    with torch.no_grad():
        want = value(ids).logits[..., 0]  # [B, T]
    return root, actor, critic, ids, want


def _values_from_starts(actor: str, critic: str, megatron_dir: str, ids):
    from tests.helpers.megatron_ref import megatron_forward
    from vapo_megatron.config import Config
    from vapo_megatron.config.schema import CriticConfig, ModelConfig, ParallelConfig
    from vapo_megatron.mcore import parallel
    from vapo_megatron.mcore.model import build_model
    from vapo_megatron.trainer.warm_start import load_critic_start
    from vapo_megatron.weights.convert import hf_to_mcore

    parallel.init_distributed(1, 1, seed=0)
    hf_to_mcore(Path(critic), Path(megatron_dir), critic=True, tp=1, pp=1, dtype="float32")
    out = {}
    for name, start in (("hf", critic), ("megatron", megatron_dir)):
        cfg = Config(model=ModelConfig(hf_path=actor, dtype="float32"), parallel=ParallelConfig(tp=1, pp=1),
                     critic=CriticConfig(warm_start=start))
        model = build_model(cfg, critic=True)
        load_critic_start(cfg, {"actor": None, "critic": model})
        out[name] = megatron_forward(model.modules, ids, critic=True, vocab=300).float()
    # Without a warm start the critic's head is fresh (the policy's trunk): a control that differs.
    cfg = Config(model=ModelConfig(hf_path=actor, dtype="float32"), parallel=ParallelConfig(tp=1, pp=1))
    out["fresh"] = megatron_forward(build_model(cfg, critic=True).modules, ids, critic=True, vocab=300).float()
    parallel.destroy()
    return out


def test_the_critic_starts_from_an_hf_or_megatron_value_model(dirs):
    root, actor, critic, ids, want = dirs
    got = run_ranks(1, _values_from_starts, str(actor), str(critic), str(root / "critic_mcore"), ids, timeout=300)[0]
    for name in ("hf", "megatron"):
        torch.testing.assert_close(got[name], want, rtol=TOL, atol=TOL, msg=lambda m: f"{name}: {m}")
    assert (got["fresh"] - want).abs().max() > 1e-2  # the control: not the value model's values


def _problems(cfg_overrides, root: Path):
    from vapo_megatron.config import parse_config
    from vapo_megatron.config.preflight import startup_problems

    cfg = parse_config(str(Path(__file__).resolve().parents[2] / "configs" / "demo_cpu.yaml"), cfg_overrides)[0]
    return [p for p in startup_problems(cfg, 1) if "critic.warm_start" in p]


def test_bad_warm_starts_are_refused_naming_the_key(dirs, tmp_path):
    root, actor, critic, _, _ = dirs
    base = [f"model.hf_path={actor}", "parallel.tp=1"]
    assert _problems([*base, f"critic.warm_start={critic}"], root) == []

    # A policy is not a value model: an HF causal LM, and a Megatron actor checkpoint.
    (p,) = _problems([*base, f"critic.warm_start={actor}"], root)
    assert "is not a value model" in p and "Qwen2ForTokenClassification with num_labels=1" in p, p
    policy_ckpt = tmp_path / "policy"
    (policy_ckpt / "hf").mkdir(parents=True)
    (policy_ckpt / "hf" / "config.json").write_text((actor / "config.json").read_text())
    (policy_ckpt / "vapo.json").write_text(json.dumps({"family": "qwen2", "critic": False, "dtype": "float32"}))
    (p,) = _problems([*base, f"critic.warm_start={policy_ckpt}"], root)
    assert "is a policy checkpoint (vapo.json: critic false)" in p, p
    # Another family.
    llama = tmp_path / "llama"
    save_tiny(llama, kind="llama", critic=True)
    assert any("is a llama model; the policy (model.hf_path) is qwen2" in p
               for p in _problems([*base, f"critic.warm_start={llama}"], root))
    # Another vocabulary.
    other = shutil.copytree(critic, tmp_path / "vocab")
    c = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**c, "vocab_size": c["vocab_size"] + 8}))
    assert any("has vocab_size=308, the policy 300" in p
               for p in _problems([*base, f"critic.warm_start={other}"], root))
    # A ForTokenClassification config over a causal LM's weights: no score head.
    headless = shutil.copytree(actor, tmp_path / "headless")
    (headless / "config.json").write_text((critic / "config.json").read_text())
    (p,) = _problems([*base, f"critic.warm_start={headless}"], root)
    assert "has no value head: score.weight is absent, a value model has [1, " in p, p
    # A run directory, a missing path.
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (p,) = _problems([*base, f"critic.warm_start={run}"], root)
    assert "is a run or one of its checkpoints" in p and "RUN_DIR/checkpoints/iter_N/critic" in p, p
    (p,) = _problems([*base, f"critic.warm_start={tmp_path / 'nowhere'}"], root)
    assert p.endswith("does not exist"), p


def test_both_starts_at_once_are_refused():
    from vapo_megatron.config import Config
    from vapo_megatron.config.checks import config_problems
    from vapo_megatron.config.schema import CriticConfig, ModelConfig

    cfg = Config(model=ModelConfig(critic_hf_path="/a"), critic=CriticConfig(warm_start="/b"))
    assert any(p.startswith("critic.warm_start and model.critic_hf_path both say where the critic starts")
               for p in config_problems(cfg, check_paths=False))
