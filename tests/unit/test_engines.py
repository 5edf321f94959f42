"""The rollout engines' records (config/engines.py, rollout/engines.py): one per name of
rollout.engine, each answering for its engine; the engine settings in their own sections, the old
flat keys refused in one line naming the new key, and a run's record written before the move read
in the new form."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from vapo_megatron.config import (
    Config,
    ConfigError,
    RolloutConfig,
    SGLangConfig,
    SGLangHttpConfig,
    load_config,
    parse_config,
    resume,
)
from vapo_megatron.config.checks import config_problems
from vapo_megatron.config.engines import (
    ENGINES,
    colocated_engines,
    engine_key,
    engine_named,
    engine_of,
    engine_problems,
    engine_settings,
    engine_tp,
    with_engine_tp,
)
from vapo_megatron.config.load import MOVED_KEYS, parse_recorded, translate_record
from vapo_megatron.rollout.engines import NO_MEMORY, RECORDS, record_of, sglang_kv_bytes_per_token

ROOT = Path(__file__).resolve().parents[2]
DEMO = str(ROOT / "configs" / "demo_cpu.yaml")
QWEN = str(ROOT / "configs" / "qwen2.5_32b_vapo.yaml")
GIB = 1 << 30
# Qwen2.5-32B's shapes as the KV cache reads them: 64 layers, 8 KV heads of 128
HF = {"num_hidden_layers": 64, "num_attention_heads": 40, "num_key_value_heads": 8, "hidden_size": 5120}


def _cfg(engine: str, **rollout) -> Config:
    return Config(rollout=RolloutConfig(engine=engine, **rollout))


def test_every_engine_has_a_record_a_builder_and_a_section():
    assert list(ENGINES) == list(RECORDS) == ["embedded", "sglang", "sglang_http"]
    assert RolloutConfig().engine in ENGINES
    sections = {f.name for f in dataclasses.fields(RolloutConfig)
                if dataclasses.is_dataclass(getattr(RolloutConfig(), f.name))} - {"partial"}
    assert {e.section for e in ENGINES.values() if e.section} == sections == {"sglang", "sglang_http"}
    for name, e in ENGINES.items():
        assert RECORDS[name].engine is e and callable(RECORDS[name].build)
        section = engine_settings(_cfg(name))
        assert (section is None) == (e.section is None)
        if e.colocated:  # what vapo-plan, its search and the start-up checks read of a colocated engine
            assert {"tp", "mem_fraction"} <= {f.name for f in dataclasses.fields(section)}, name
        if e.remote:
            assert "urls" in {f.name for f in dataclasses.fields(section)}, name
    assert colocated_engines() == ["sglang"]


@pytest.mark.parametrize("name", sorted(ENGINES))
def test_each_engine_is_answered_by_its_record(name):
    cfg = _cfg(name)
    e = engine_of(cfg)
    assert e.name == name and record_of(cfg) is RECORDS[name]
    assert engine_tp(cfg) == (cfg.rollout.sglang.tp if e.colocated else None)
    memory = record_of(cfg).gpu_memory(cfg, gpu_bytes=80 * GIB, actor_params=32_000_000_000, actor_hf=HF)
    if not e.colocated:  # none of the trainer's GPU memory
        assert memory == NO_MEMORY and record_of(cfg).share(cfg, 80 * GIB) == 0
        return
    assert engine_key(cfg, "tp") == f"rollout.{e.section}.tp"
    assert with_engine_tp(cfg, 2).rollout.sglang.tp == 2 and with_engine_tp(cfg, 2).rollout.sglang.mem_fraction == 0.7


def test_sglang_memory_per_gpu_is_its_share_less_its_weights():
    """What vapo-plan, its step-time inputs and the start-up share check ask (formerly three formulas)."""
    cfg = _cfg("sglang", sglang=SGLangConfig(tp=8, mem_fraction=0.85))
    m = record_of(cfg).gpu_memory(cfg, gpu_bytes=80 * GIB, actor_params=32_000_000_000, actor_hf=HF)
    per_token = 2 * 64 * 1 * 128 * 2  # K and V, 64 layers, 8 KV heads / TP 8, head_dim 128, bf16
    assert m.per_token == per_token == sglang_kv_bytes_per_token(HF, tp=8)
    assert m.share == int(0.85 * 80 * GIB) == record_of(cfg).share(cfg, 80 * GIB)
    assert m.weights == 32_000_000_000 * 2 // 8 and m.kv_cache == m.share - m.weights
    assert m.kv_tokens == m.kv_cache // per_token
    capped = _cfg("sglang", sglang=SGLangConfig(tp=8, mem_fraction=0.85, max_total_tokens=4096))
    assert record_of(capped).gpu_memory(capped, gpu_bytes=80 * GIB, actor_params=32_000_000_000,
                                        actor_hf=HF).kv_tokens == 4096
    assert sglang_kv_bytes_per_token(HF, tp=16) == sglang_kv_bytes_per_token(HF, tp=8)  # KV heads replicated past 8


UNKNOWN = "rollout.engine='vllm' is not an engine; one of: embedded, sglang, sglang_http (config/engines.py)"


def test_an_unknown_engine_is_refused_naming_the_key():
    """One line, from the config checks (before torch); the checks after them do not trip over it."""
    from vapo_megatron.config.preflight import hardware_problems, launch_problems, moe_problems
    from vapo_megatron.sizing.search import setting_problems

    cfg, problems = parse_config(QWEN, ["rollout.engine=vllm"])
    assert problems == [] and cfg.rollout.engine == "vllm"
    assert [p for p in config_problems(cfg, check_paths=False) if "engine" in p] == [UNKNOWN]
    with pytest.raises(ConfigError) as e:
        load_config(QWEN, ["rollout.engine=vllm"], check_paths=False)
    assert str(e.value) == UNKNOWN
    assert UNKNOWN in setting_problems(cfg)  # vapo-plan --search's
    hf = HF | {"_source": "test", "vocab_size": 1000, "intermediate_size": 64}
    assert not [p for p in hardware_problems(cfg, cuda=False) if "engine" in p]  # (its optimizer's need GPUs)
    assert moe_problems(cfg, [("model.hf_path", hf)]) == []
    assert not [p for p in launch_problems(cfg, 64, hf, hf, gpus_per_node=8) if "engine" in p]
    with pytest.raises(ConfigError, match=r"^rollout.engine='vllm' is not an engine; one of: embedded, sglang, "
                                          r"sglang_http \(config/engines.py\)$"):
        engine_of(cfg)
    with pytest.raises(ConfigError, match=r"^--engine='x' is not an engine"):
        engine_named("x", key="--engine")


def test_engine_sections_are_checked_each_problem_naming_its_key():
    bad = _cfg("sglang", sglang=SGLangConfig(tp=3, mem_fraction=1.0, max_total_tokens=0))
    assert engine_problems(bad) == [
        "rollout.sglang.mem_fraction=1.0 must be in (0, 1)", "rollout.sglang.max_total_tokens=0 must be >= 1 (or null)",
        "rollout.sglang.tp=3 must divide parallel.tp=1 with rollout.engine=sglang (each colocated engine lives on "
        "consecutive GPUs of one trainer TP group)"]
    assert engine_problems(_cfg("sglang", sglang=SGLangConfig(tp=0))) == ["rollout.sglang.tp=0 must be >= 1"]
    assert engine_problems(_cfg("embedded", sglang=SGLangConfig(tp=3))) == []  # divides only for the engine in use
    assert engine_problems(_cfg("sglang_http")) == ["rollout.engine=sglang_http needs rollout.sglang_http.urls"]
    assert engine_problems(_cfg("sglang_http", sglang_http=SGLangHttpConfig(urls=("http://h:1",)))) == []


# ---- the old flat keys ---------------------------------------------------------------------------

OLD = {"sglang_tp": 4, "sglang_mem_fraction": 0.6, "sglang_max_total_tokens": 4096, "sglang_urls": ["http://h:1"]}


def test_an_old_flat_key_in_a_file_is_refused_naming_the_file_and_its_new_key(tmp_path):
    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump({"rollout": {"engine": "sglang", **OLD}}))
    cfg, problems = parse_config(str(path))
    assert problems == [f"{path}: rollout.{old} was moved to {MOVED_KEYS[f'rollout.{old}']}" for old in OLD]
    assert problems[0] == f"{path}: rollout.sglang_tp was moved to rollout.sglang.tp"
    assert problems[3] == f"{path}: rollout.sglang_urls was moved to rollout.sglang_http.urls"
    assert cfg.rollout.sglang == SGLangConfig()  # nothing read from an old key
    with pytest.raises(ConfigError) as e:  # before any work: the load itself
        load_config(str(path), check_paths=False)
    assert f"  - {path}: rollout.sglang_mem_fraction was moved to rollout.sglang.mem_fraction" in str(e.value)


def test_an_old_flat_key_on_the_command_line_is_refused_naming_its_new_key():
    cfg, problems = parse_config(QWEN, ["rollout.sglang_tp=4", "rollout.sglang.mem_fraction=0.5"])
    assert problems == ["command-line override 'rollout.sglang_tp=4': rollout.sglang_tp was moved to rollout.sglang.tp"]
    assert cfg.rollout.sglang.tp == 8 and cfg.rollout.sglang.mem_fraction == 0.5  # the file's, and the new key's
    with pytest.raises(ConfigError, match=r"^command-line override 'rollout.sglang_urls=\[http://h:1\]': "
                                          r"rollout.sglang_urls was moved to rollout.sglang_http.urls$"):
        load_config(DEMO, ["rollout.sglang_urls=[http://h:1]"], check_paths=False)


def _old_form(tree: dict) -> dict:
    """A record as a run before the move wrote it: the engine sections as flat rollout keys."""
    r = tree["rollout"]
    s, http = r.pop("sglang"), r.pop("sglang_http")
    r.update(sglang_tp=s["tp"], sglang_mem_fraction=s["mem_fraction"], sglang_max_total_tokens=s["max_total_tokens"],
             sglang_urls=http["urls"])
    return tree


def test_a_run_recorded_before_the_move_reads_in_the_new_form_and_resumes(tmp_path):
    run_dir = tmp_path / "run"
    cfg = parse_config(QWEN, [f"trainer.run_dir={run_dir}", "rollout.sglang.tp=4",
                              "rollout.sglang.max_total_tokens=9000", "rollout.sglang_http.urls=[http://h:1]"])[0]
    saved = resume.save(cfg)
    new = yaml.safe_load(saved.read_text())
    saved.write_text(yaml.safe_dump(_old_form(yaml.safe_load(saved.read_text())), sort_keys=False))
    assert "sglang_tp: 4" in saved.read_text() and "sglang:" not in saved.read_text()
    assert parse_recorded(str(saved)) == (cfg, [])  # the run's own record: the old keys' values, new keys
    assert translate_record(_old_form(yaml.safe_load(yaml.safe_dump(new)))) == new
    assert parse_config(str(saved))[1][0] == f"{saved}: rollout.sglang_tp was moved to rollout.sglang.tp"  # as input
    (run_dir / "checkpoints" / "iter_0000001").mkdir(parents=True)
    resume.check_resume(cfg, announce=False)  # the same run: resumes
    moved = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, sglang=SGLangConfig(tp=8)))
    with pytest.raises(ConfigError, match=r"  - rollout.sglang.tp: 4 in the run, 8 now"):  # read, not defaulted
        resume.check_resume(moved, announce=False)


def test_a_colocated_engine_never_straddles_two_nodes():
    """Engine TP=2 on 8 nodes of 7 GPUs: the engine of ranks 6 and 7 would span two nodes, though 2
    divides the 56 GPUs; on nodes of 8 it is fine."""
    from vapo_megatron.config.preflight import launch_problems

    hf = HF | {"_source": "test", "vocab_size": 1000, "intermediate_size": 64}
    cfg, _ = parse_config(QWEN, ["rollout.engine=sglang", "rollout.sglang.tp=2", "parallel.tp=2"])
    straddle = [p for p in launch_problems(cfg, 56, hf, hf, gpus_per_node=7) if p.startswith("rollout.sglang.tp=2")]
    assert straddle == ["rollout.sglang.tp=2 must divide the 56 GPUs and the 7 GPUs of each node (a colocated engine "
                        "uses GPUs of its own node)"], straddle
    assert not [p for p in launch_problems(cfg, 64, hf, hf, gpus_per_node=8) if p.startswith("rollout.sglang.tp")]
