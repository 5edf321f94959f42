"""Issue 21, defects 2 and 3, on real gloo ranks with a TEST DOUBLE for sglang.Engine (GPU only).

2. Every wait that may span another rank's generation, an engine start or an engine's weight
   update runs on a CPU (gloo) group whose timeout is rollout.wait_timeout_s, never on the
   default/NCCL groups (30 minutes, a device collective). Each of torch.distributed's
   communication calls is recorded with the project function that made it (through
   mcore/parallel.py's helpers) and the backend and timeout torch reports for its group.
3. Every rank of an engine's GPUs empties PyTorch's cache after a weight sync, and the owner takes
   its KV cache (and weights) back only after all of them have. free_cached_memory is a no-op
   without CUDA, so its calls are logged here, with the double's resume and update calls, as
   lines appended to one file: the order of the lines is the order of the events across ranks.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.helpers.dist_utils import run_ranks
from tests.helpers.sglang_doubles import FakeColocatedSGLangEngineForTests
from tests.helpers.tiny_hf import save_tiny, save_tiny_tokenizer

WAIT_S = 4321.0  # not any default: the groups must carry the configured timeout
PROMPTS = [[5, 9, 13], [7, 7], [21, 3, 8, 1]]
PARALLEL = str(Path(__file__).resolve().parents[2] / "vapo_megatron" / "mcore" / "parallel.py")
PROJECT = str(Path(__file__).resolve().parents[2] / "vapo_megatron")
# The project functions whose collectives wait for another rank's generation, engine start or
# engine weight update (mcore/parallel.py, wait_group; docs/weight_sync.md). init_engine_groups is
# parallel.py's own: its calls count as SGLangEngine.colocated's.
WAITS = {"SGLangEngine.colocated", "SGLangEngine.load_bucket", "SGLangEngine.sync_freed",
         "generating_ranks", "Generator._spread", "Generator.end_rounds", "Generator.collect", "greedy_accuracy",
         "sample_eval"}


def _append(path: str, line: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


def _record_collectives(calls: list) -> None:
    import torch.distributed as dist

    from tests.helpers.collective_audit import COMMUNICATION

    def wrap(name, fn):
        def call(*args, **kwargs):
            frame = sys._getframe(1)
            while frame is not None and frame.f_code.co_filename == PARALLEL:
                frame = frame.f_back  # the project function that called parallel.py's helper
            if frame is not None and frame.f_code.co_filename.startswith(PROJECT):
                group = kwargs.get("group") or dist.group.WORLD
                backend = dist.get_backend(group)
                timeout = group._get_backend(torch.device("cpu")).options._timeout.total_seconds()
                calls.append((frame.f_code.co_qualname, name, str(backend), timeout))
            return fn(*args, **kwargs)
        return call

    for name in COMMUNICATION:
        setattr(dist, name, wrap(name, getattr(dist, name)))


def _spy_frees(log: str, rank: int) -> None:
    """free_cached_memory, as every project module holds it, logs its call (a no-op on the CPU)."""
    from vapo_megatron.mcore import memory

    real = memory.free_cached_memory

    def free():
        _append(log, f"{rank} free")
        real()

    for mod in list(sys.modules.values()):
        if (getattr(mod, "__name__", "").startswith("vapo_megatron")
                and getattr(mod, "free_cached_memory", None) is real):
            mod.free_cached_memory = free


class LoggingEngineForTests(FakeColocatedSGLangEngineForTests):
    """TEST DOUBLE (see FakeColocatedSGLangEngineForTests) that also logs its memory calls."""

    log = ""

    def update_weights_from_tensor(self, named_tensors, load_format, flush_cache):
        _append(self.log, "0 update")
        return super().update_weights_from_tensor(named_tensors, load_format=load_format, flush_cache=flush_cache)

    def resume_memory_occupation(self, tags):
        _append(self.log, f"0 resume {','.join(tags)}")
        return super().resume_memory_occupation(tags=tags)


def _run(hf_dir: Path, tp: int, sglang_tp: int, log: str):
    import torch.distributed as dist
    from transformers import PreTrainedTokenizerFast

    from model_providers import family_for, read_hf_config
    from vapo_megatron.config import RolloutConfig, SGLangConfig
    from vapo_megatron.data.prompts import PromptRecord
    from vapo_megatron.evaluation.sampled import greedy_accuracy, sample_eval
    from vapo_megatron.mcore import parallel
    from vapo_megatron.mcore.models import build_chunks
    from vapo_megatron.rewards import build_reward_fn
    from vapo_megatron.rewards.answers import AnswerKey
    from vapo_megatron.rewards.scorer import Scorer
    from vapo_megatron.rollout.generator import Generator
    from vapo_megatron.rollout.sglang_engine import SGLangEngine
    from vapo_megatron.weights.hf_read import load_hf_weights

    parallel.init_distributed(tp, 1, wait_timeout_s=WAIT_S)
    hf_cfg = read_hf_config(hf_dir)
    chunks = build_chunks(hf_cfg, params_dtype=torch.float32, critic=False)
    load_hf_weights(chunks, family_for(hf_cfg), hf_cfg, hf_dir)
    rank = dist.get_rank()
    _spy_frees(log, rank)
    calls: list = []
    _record_collectives(calls)
    LoggingEngineForTests.log = log

    engine = SGLangEngine.colocated(model_path=str(hf_dir), tp_size=sglang_tp, mem_fraction=0.5, dtype="float32",
                                    seed=0, start=lambda c: LoggingEngineForTests(hf_dir, c))
    gen = Generator(engine, RolloutConfig(engine="sglang", sglang=SGLangConfig(tp=sglang_tp), n_samples=2,
                                          max_new_tokens=2), ())
    actor = SimpleNamespace(modules=chunks, family=family_for(hf_cfg), hf_cfg=hf_cfg)
    gen.sync_weights(actor, version=1)
    records = [PromptRecord(prompt_ids=ids, answer="w7", source=f"p{i}", prompt_text="")
               for i, ids in enumerate(PROMPTS)]
    gen.collect(records, seed=3)
    gen.release_weights()
    gen.sync_weights(actor, version=2)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(hf_dir)
    scorer = Scorer(build_reward_fn("exact", correct_score=1.0, incorrect_score=-1.0, timeout_s=10.0), tokenizer, ())
    greedy_accuracy(gen, scorer, records[:1])  # one prompt: a second replica has none and waits
    sample_eval(gen, scorer, AnswerKey("exact", timeout_s=10.0, num_workers=1), records, n=2, temperature=1.0, seed=0)
    return {"calls": calls, "rank": rank}


@pytest.mark.parametrize("tp,sglang_tp", [(2, 2), (1, 1)])  # one engine over two ranks; two replicas (DP=2)
def test_generation_spanning_waits_use_gloo_wait_groups_and_every_rank_frees_before_the_owner_resumes(
        tmp_path, tp, sglang_tp):
    save_tiny(tmp_path / "hf", tied=False, seed=5)
    save_tiny_tokenizer(tmp_path / "hf")
    log = str(tmp_path / "events.log")
    runs = run_ranks(2, _run, tmp_path / "hf", tp, sglang_tp, log)

    for run in runs:
        waits = [c for c in run["calls"] if c[0] in WAITS]
        wrong = [c for c in waits if c[2] != "gloo" or c[3] != WAIT_S]
        assert not wrong, f"rank {run['rank']}: waits not on a gloo group with the {WAIT_S} s timeout: {wrong}"
    seen = {c[0] for run in runs for c in run["calls"]}
    expected = {"SGLangEngine.colocated", "generating_ranks", "Generator.collect", "sample_eval"}
    # Generator._spread: generate's and extend's wait for the replica's generation (partial rollout's
    # end_rounds is not used here).
    expected |= ({"SGLangEngine.load_bucket", "SGLangEngine.sync_freed", "Generator._spread"} if tp == 2
                 else {"greedy_accuracy"})
    assert expected <= seen, expected - seen  # none of the waits went unobserved

    if tp == 1:
        return  # engines of one rank: nobody else's cache to wait for
    events = Path(log).read_text().splitlines()
    resumes = [i for i, e in enumerate(events) if e.startswith("0 resume")]
    assert any("kv_cache" in events[i] for i in resumes), events
    for i in resumes:
        previous = max((j for j in range(i) if events[j].startswith("0 ") and not events[j].endswith("free")),
                       default=-1)
        for rank in (0, 1):
            assert f"{rank} free" in events[previous + 1 : i], (
                f"rank {rank} did not free its cache between {events[previous] if previous >= 0 else 'the start'!r} "
                f"and the owner's {events[i]!r}: {events}")
