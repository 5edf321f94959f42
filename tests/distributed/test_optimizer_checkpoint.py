"""The distributed optimizer's checkpoint (issue 55, items 1 and 2; checkpoint/optimizer_state.py).

1. A save or a load costs a rank its own share of the optimizer state, not DP times it. megatron's
   fully_reshardable format, which the fused Adams (every GPU node) wrote, all-gathered the whole DP
   group's state on every rank at every save and allocated and read it on every rank at every load.
   Measured at DP=2 on gloo ranks with tests/helpers/tensor_bytes.py (tensor storage created and
   held by the save or load; the stored tensor data a load reads), against the rank's own share
   (its float32 main parameters and both Adam moments, counted from the optimizer's own tensors).
2. The format follows the checkpoint, not the Adam: a checkpoint of TE's or Apex's FusedAdam
   resumes where torch's Adam runs and the reverse (it used to be "damaged", every one alike).

Reference for the stored content: megatron's own fully_reshardable writer (the same tensors,
bitwise), and the checkpoint itself: loaded at another layout and with the other Adam, then saved
again, every stored tensor is bitwise what it was.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers.adams import use_adam
from tests.helpers.dist_utils import run_ranks
from tests.helpers.train_runs import checkpoint_tensors

PRESET = "tiny-qwen2"
# Its vocabulary here: megatron pads it to 128 rows at TP=1, 256 at TP=2, so a load at TP=2 takes
# the embedding's and output layer's Adam state from a tensor of fewer rows (dist_io.py,
# vocab_padding_only) and zero-fills the rest.
VOCAB = 100


def _hf(preset_name: str) -> dict:
    from model_providers.presets import preset

    return preset(preset_name) | ({"vocab_size": VOCAB} if preset_name == PRESET else {})


def _model(kind: str, tp: int = 1, pp: int = 1, ep: int = 1, preset_name: str = PRESET, distributed: bool = True):
    from vapo_megatron.mcore import parallel
    from vapo_megatron.nodecheck.checkpoint import build

    use_adam(kind)
    parallel.init_distributed(tp, pp, ep=ep, seed=3)
    return build(_hf(preset_name), Path("."), distributed=distributed, dtype=torch.float32)


def own_share(model) -> int:
    """Bytes of this rank's part of the optimizer state: for every parameter range it owns, its
    float32 main parameter and Adam's moments (megatron's own accessor)."""
    from vapo_megatron.checkpoint.model_state import megatron_optimizers

    total = 0
    for opt in megatron_optimizers(model.optimizer):
        for per_dtype in opt.gbuf_ranges:
            for per_bucket in per_dtype.values():
                for gbuf_range_map in per_bucket:
                    for p in gbuf_range_map["param_map"]:
                        total += sum(v.nbytes for k, v in opt._get_main_param_and_optimizer_states(p).items()
                                     if k != "step")
    return total


def _megatron_format(model, path: Path, fmt: str = "fully_reshardable") -> None:
    """What this project wrote before issue 55, by megatron's own format writers: fully_reshardable
    with the fused Adams, dp_reshardable with torch's (of a model that has stepped)."""
    from vapo_megatron.checkpoint import dist_io

    path.mkdir(exist_ok=True)  # every rank
    state = dist_io.model_sharded_state(model.modules)
    state["optimizer"] = model.optimizer.sharded_state_dict(state, metadata={"distrib_optim_sharding_type": fmt})
    dist_io.write_dist_checkpoint(state, path)


def _written(work: str, kind: str, tp: int, pp: int, ep: int, preset_name: str) -> dict:
    """Two steps, a save (measured) and megatron's own fully_reshardable checkpoint of the same
    state; then a fresh model, stepped once as a run's would be, loads the save (measured)."""
    from tests.helpers.tensor_bytes import CheckpointReads, CheckpointWrites, TensorBytes
    from vapo_megatron.checkpoint.model_state import load_model_state, save_model_state
    from vapo_megatron.nodecheck.checkpoint import snapshot, train_step

    model = _model(kind, tp, pp, ep, preset_name)
    train_step(model, 1), train_step(model, 2)
    with TensorBytes() as save, CheckpointWrites() as writes:
        save_model_state(model, Path(work) / "ours")
    _megatron_format(model, Path(work) / "megatron")
    resumed = _model(kind, tp, pp, ep, preset_name)
    train_step(resumed, 9)
    with TensorBytes() as load, CheckpointReads() as reads:
        load_model_state(resumed, Path(work) / "ours")
    before, after = snapshot(model), snapshot(resumed)
    return {"share": own_share(model), "save": save.peak, "staged": writes.staged, "load": load.peak,
            "read": sum(v for k, v in reads.payload.items() if k.startswith("optimizer.")), "largest": reads.largest,
            "differ": [k for k in before if not torch.equal(before[k], after.get(k, torch.empty(0)))]}


@pytest.fixture(scope="module")
def dp2(tmp_path_factory) -> tuple[Path, list[dict]]:
    """TE's FusedAdam (as on every GPU node) at TP=1 x DP=2: the checkpoints and each rank's measures."""
    work = tmp_path_factory.mktemp("dp2")
    return work, run_ranks(2, _written, str(work), "te", 1, 1, 1, PRESET)


def test_a_save_and_a_load_cost_each_dp_rank_its_own_share(dp2):
    """At DP=2: DP rank 1 writes no weights, so it stages for writing exactly its own share (torch
    DCP copies the views among its blocks, no more); every rank reads exactly its own share and
    holds at most that much more at once (TE's FusedAdam.load_state_dict copies both moments: 2/3
    of it). megatron's fully_reshardable held over 2x the share at DP rank 1's save, and read 2x
    and held over 2x at every load. The resumed state is the saved one, bitwise."""
    for rank, m in enumerate(dp2[1]):
        assert not m["differ"], (rank, m["differ"][:5])
        assert m["read"] == m["share"], (rank, m)
        assert m["load"] <= m["share"], (rank, m)
    assert dp2[1][1]["save"] <= dp2[1][1]["staged"] == dp2[1][1]["share"], dp2[1][1]


def _planned() -> dict:
    """vapo-plan's figures for the fixture's model at TP=1 x DP=2 (the larger of actor and critic: the
    actor, whose output layer the critic's value head replaces)."""
    from vapo_megatron.config import load_config
    from vapo_megatron.sizing.plan import make_plan

    cfg = load_config(str(Path(__file__).resolve().parents[2] / "configs" / "demo_cpu.yaml"),
                      ["parallel.tp=1", "actor_optim.distributed_optimizer=true",
                       "critic_optim.distributed_optimizer=true"], check_paths=False)
    plan = make_plan(cfg, _hf(PRESET), _hf(PRESET), world_size=2, gpu_memory_gib=80.0)
    return plan.ranks[0].checkpoint_io


def test_vapo_plan_reports_what_a_save_and_a_load_cost_as_measured(dp2):
    """vapo-plan's save and load figures (sizing/memory.py checkpoint_parts) against the fixture's
    measures on DP rank 0, the worst (it also writes the weights): what its save staged, what its
    load held at once (the larger of megatron's SwiGLU merges and TE's copy of the moments; the CPU
    has no separate GPU), the largest stored tensor it read. Within 2%: the plan takes a DP rank's
    share as the parameters / DP, megatron's buckets split them a little unevenly."""
    from vapo_megatron.sizing.memory import LOAD_GPU, LOAD_HOST, SAVE_GPU, SAVE_HOST

    planned, measured = run_ranks(1, _planned)[0], dp2[1][0]
    assert planned[SAVE_GPU] == 0
    for item, have in ((SAVE_HOST, measured["staged"]), (LOAD_GPU, measured["load"]), (LOAD_HOST, measured["largest"])):
        assert abs(planned[item] - have) <= 0.02 * have, (item, planned[item], have)


def _reloaded(work: str, src: str, dst: str, kind: str, tp: int, pp: int, ep: int, preset_name: str) -> list:
    """Load `src` at this layout with this Adam, save it as `dst`; the loaded step counts."""
    from vapo_megatron.checkpoint.model_state import load_model_state, optimizer_moments, save_model_state

    model = _model(kind, tp, pp, ep, preset_name)
    load_model_state(model, Path(work) / src)
    save_model_state(model, Path(work) / dst)
    return sorted({float(v) for k, v in optimizer_moments(model).items() if k.endswith("step")})


def _same_tensors(a: Path, b: Path) -> list[str]:
    """The tensors that differ between two dist checkpoints; where the vocabulary's padding differs
    (another TP), the rows both have, and zeros in the rows only one has (a load zero-fills them)."""
    x, y = checkpoint_tensors(a), checkpoint_tensors(b)
    differ = sorted(x.keys() ^ y.keys())
    for k in x.keys() & y.keys():
        u, v = x[k], y[k]
        if u.shape != v.shape and u.shape[1:] == v.shape[1:]:
            rows = min(len(u), len(v))
            if torch.cat([u[rows:], v[rows:]]).any():
                differ.append(f"{k}: rows beyond the other's {rows} not zero")
            u, v = u[:rows], v[:rows]
        if not torch.equal(u, v):
            differ.append(k)
    return differ


def test_the_state_is_megatrons_fully_reshardable_and_loads_at_any_layout_with_either_adam(dp2):
    """Written by TE's FusedAdam at TP=1 x DP=2, the checkpoint holds megatron's fully_reshardable
    tensors bitwise. Loaded by torch's Adam at TP=2 (one of issue 55's switches: it was refused as
    damaged; the vocabulary padded to 256 rows, not 128) and saved; megatron's own checkpoint loaded
    by TE's FusedAdam at PP=2 and saved: each holds every tensor of the first bitwise (at TP=2 its
    128 rows, the new ones zero), and the step count 2."""
    work = dp2[0]
    assert not _same_tensors(work / "ours", work / "megatron")
    assert run_ranks(2, _reloaded, str(work), "ours", "tp2", "torch", 2, 1, 1, PRESET)[0] == [2.0]
    assert run_ranks(2, _reloaded, str(work), "megatron", "pp2", "te", 1, 2, 1, PRESET)[0] == [2.0]
    for dst in ("tp2", "pp2"):
        assert not _same_tensors(work / "ours", work / dst), dst
    key = "optimizer.state.exp_avg.embedding.word_embeddings.weight"
    assert [len(checkpoint_tensors(work / d)[key]) for d in ("ours", "tp2")] == [128, 256]


def _moe_round_trip(work: str) -> list:
    _written(work, "torch", 1, 1, 2, "tiny-qwen3-moe")
    return _reloaded(work, "ours", "again", "te", 1, 1, 2, "tiny-qwen3-moe")  # same layout: the same process


def test_a_mixture_of_experts_chained_optimizer_round_trips(tmp_path):
    """Qwen3-MoE at EP=2: dense and expert parameters in two chained distributed optimizers (keys
    prefixed chained_0., chained_1.), the experts' state sharded over expert-DP, the layer and
    expert axes prepended: megatron's tensors bitwise, and back through a load with the other Adam."""
    assert run_ranks(2, _moe_round_trip, str(tmp_path))[0] == [2.0]
    assert not _same_tensors(tmp_path / "ours", tmp_path / "megatron")
    assert not _same_tensors(tmp_path / "ours", tmp_path / "again")


def _run_state(iteration: int):
    from vapo_megatron.checkpoint.run_state import RunState
    from vapo_megatron.data.prompts import PromptRecord, PromptSampler

    return RunState(PromptSampler([PromptRecord([1, 2], "1", "x:1", "p")], batch_size=1, seed=0), iteration=iteration)


def _adams(model) -> dict[str, torch.Tensor]:
    """Parameters and Adam's moments by name, and the step count, whichever Adam keeps it where."""
    from vapo_megatron.nodecheck.checkpoint import snapshot

    out = {k: v for k, v in snapshot(model).items() if not k.endswith("step")}
    return out | {"step": torch.tensor(sorted({float(v) for k, v in snapshot(model).items() if k.endswith("step")}))}


def _switches(work: str) -> list[str]:
    """Through the run's checkpoint manager on one rank: a checkpoint of TE's FusedAdam resumed by
    torch's Adam, its next one by TE's, and that one's by torch's (each also restoring the CPU random
    generator as saved: nothing draws from it in a run today, but dropout would); then an older checkpoint of
    torch's Adam (megatron's dp_reshardable, as written before issue 55) resumed by TE's. Each
    resumes, its parameters, moments and step count as saved. Without the distributed optimizer
    the resume stops in one line naming the setting, the checkpoints intact."""
    from vapo_megatron.checkpoint.manager import CheckpointManager, CheckpointMismatch
    from vapo_megatron.checkpoint.model_state import megatron_optimizers, per_parameter_steps
    from vapo_megatron.nodecheck.checkpoint import train_step

    found, run = [], Path(work) / "run"
    writer = _model("te")
    for kind, iteration in (("torch", 2), ("te", 3), ("torch", 4)):
        train_step(writer, iteration)
        CheckpointManager(run, {"actor": writer}, config={}).save(_run_state(iteration))
        drawn = torch.rand(4)  # what the saved CPU generator draws next
        reader = _model(kind)
        torch.manual_seed(iteration + 1000)  # another state, which the load must replace
        assert per_parameter_steps(megatron_optimizers(reader.optimizer)[0].optimizer) == (kind == "torch"), kind
        state = _run_state(0)
        if not CheckpointManager(run, {"actor": reader}, config={}).load(state) or state.iteration != iteration:
            found.append(f"{kind}: resumed nothing at iteration {iteration}")
        if not torch.equal(torch.rand(4), drawn):
            found.append(f"{kind}: the CPU random generator was not restored at iteration {iteration}")
        before, after = _adams(writer), _adams(reader)
        found += [f"{kind}: {k}" for k in before if not torch.equal(before[k], after.get(k, torch.empty(0)))]
        writer = reader
    older = Path(work) / "older" / "checkpoints" / "iter_0000005"
    train_step(writer, 5)
    CheckpointManager(older.parent.parent, {"actor": writer}, config={}).save(_run_state(5))
    _megatron_format(writer, older / "actor", "dp_reshardable")  # its optimizer state as torch's Adam wrote it
    reader, state = _model("te"), _run_state(0)
    if not CheckpointManager(older.parent.parent, {"actor": reader}, config={}).load(state) or state.iteration != 5:
        found.append("older: resumed nothing at iteration 5")
    before, after = _adams(writer), _adams(reader)
    found += [f"older: {k}" for k in before if not torch.equal(before[k], after.get(k, torch.empty(0)))]
    try:  # not a switch of Adam: of the optimizer (trainer.allow_config_change=true lets it through)
        CheckpointManager(run, {"actor": _model("te", distributed=False)}, config={}).load(_run_state(0))
        found.append("the plain optimizer loaded a distributed optimizer's checkpoint")
    except CheckpointMismatch as e:
        if "resume with actor_optim.distributed_optimizer=true; the checkpoints are intact" not in str(e):
            found.append(str(e))
    return found


def test_a_checkpoint_resumes_whichever_adam_wrote_it_and_whichever_loads_it(tmp_path):
    """Issue 55 item 2: the format followed the Adam at load time, so these resumes called every
    checkpoint damaged and stopped ("move ... away to start the run afresh")."""
    assert run_ranks(1, _switches, str(tmp_path))[0] == []
