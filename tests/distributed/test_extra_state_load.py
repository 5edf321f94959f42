"""A checkpoint without Transformer Engine's `_extra_state` objects loads into a model that has them
(issue 43 defect 3): what every local-spec checkpoint (vapo-convert's, a CPU run's) is to a GPU
node's TE model. Megatron's strict load refused it ("Missing key in checkpoint state_dict"). The
request below is what megatron's TE modules add to a sharded state dict
(megatron/core/transformer/utils.py make_sharded_object_for_checkpoint); the TE world
(test_te_world.py) loads real local-spec checkpoints into the stand-in's TE modules."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.helpers.dist_utils import run_ranks


def _round_trip(tmp: str) -> dict:
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    from vapo_megatron.checkpoint import dist_io
    from vapo_megatron.mcore import parallel

    parallel.init_distributed(1, 1, seed=0)
    weight = torch.arange(6.0).reshape(2, 3)
    saved = {"model": {"layer.linear.weight": ShardedTensor.from_rank_offsets("layer.linear.weight", weight.clone())}}
    Path(tmp).mkdir()
    dist_io.write_dist_checkpoint(saved, tmp)

    def request(*, also: str | None = None) -> dict:
        state = {"layer.linear.weight": ShardedTensor.from_rank_offsets("layer.linear.weight", torch.zeros(2, 3)),
                 # TE's extra state: an FP8-less module's, and a GroupedLinear's second GEMM's
                 "layer.linear._extra_state": ShardedObject("layer.linear._extra_state", b"mine", (1,), (0,),
                                                            replica_id=0),
                 "experts.linear_fc1._extra_state1": ShardedObject("experts.linear_fc1._extra_state1", None, (1,), (0,),
                                                                   replica_id=0)}
        if also:
            state[also] = ShardedTensor.from_rank_offsets(also, torch.zeros(2, 3))
        return {"model": state}

    loaded = dist_io.load(tmp, request())["model"]
    out = {"weight": loaded["layer.linear.weight"], "extra": loaded["layer.linear._extra_state"],
           "extra1": loaded["experts.linear_fc1._extra_state1"]}
    try:
        dist_io.load(tmp, request(also="layer.other.weight"))
        out["missing"] = "loaded"
    except dist_io.CheckpointError as e:
        out["missing"] = str(e)
    return out


def test_a_checkpoint_without_extra_state_loads_into_modules_that_have_it(tmp_path):
    out = run_ranks(1, _round_trip, str(tmp_path / "ckpt"))[0]
    assert torch.equal(out["weight"], torch.arange(6.0).reshape(2, 3))
    assert out["extra"] == b"mine" and out["extra1"] is None  # the modules' own, untouched
    # Only `_extra_state` is optional: any other key the checkpoint lacks still fails the load.
    assert "layer.other.weight" in out["missing"], out["missing"]


class _WithExtraState(torch.nn.Module):
    """A module with an `_extra_state` in state_dict() (as TE's modules have), like TE's attention
    whose extra state megatron leaves out of the sharded state dict."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(2, 2)
        self.seen = "fresh"

    def get_extra_state(self):
        return self.seen

    def set_extra_state(self, state):
        self.seen = state


def test_a_loaded_state_without_extra_state_keeps_the_modules_own():
    import pytest

    from vapo_megatron.checkpoint.dist_io import load_module_state

    src, dst = _WithExtraState(), _WithExtraState()
    weights = {k: v for k, v in src.state_dict().items() if not k.endswith("_extra_state")}
    load_module_state(dst, weights)
    assert torch.equal(dst.linear.weight, src.linear.weight) and dst.seen == "fresh"
    with pytest.raises(RuntimeError, match="linear.bias"):  # any other key is still required
        load_module_state(dst, {k: v for k, v in weights.items() if k != "linear.bias"})
