"""No code runs from a checkpoint file or from model output (issue 7, part 6).

Crafted pickles (each would create a marker file when unpickled the ordinary way) are planted
where a Megatron dist checkpoint keeps pickles: the `.metadata` index, the non-tensor items
inside `*.distcp`, a legacy `common.pt`; and in place of an RNG safetensors file. Each load
through our load path is refused and no marker appears; the same payloads, unpickled the
ordinary way, do create their markers (so the test would catch a regression). A source scan
keeps eval/exec/unrestricted unpickling out of the code base.
"""

from __future__ import annotations

import ast
import pickle
from pathlib import Path

import pytest

from tests.helpers.dist_utils import run_ranks
from tests.helpers.hostile import Payload

ROOT = Path(__file__).resolve().parents[2]


def _state(seed: float, *, extra: dict | None = None) -> dict:
    import torch
    from megatron.core.dist_checkpointing import ShardedTensor

    w = torch.arange(6, dtype=torch.float32).reshape(2, 3) + seed
    state = {
        "model": {"w": ShardedTensor.from_rank_offsets("w", w, replica_id=0)},
        # Non-tensor state like the optimizer's: megatron stores it as pickled "common_state".
        "optimizer": {"param_groups": [{"lr": 1e-4, "betas": (0.9, 0.999), "foreach": None}],
                      "step": torch.tensor(3.0)},
    }
    state.update(extra or {})
    return state


def _template() -> dict:
    import torch
    from megatron.core.dist_checkpointing import ShardedTensor

    return {"model": {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(2, 3), replica_id=0)}}


def _try(fn) -> str:
    try:
        fn()
    except BaseException as e:  # noqa: BLE001 - the outcome is what the test checks (DCP raises BaseException)
        return f"{type(e).__name__}: {e}"
    return "loaded"


def _rank(work: str) -> dict:
    """One gloo rank: write checkpoints, plant payloads, try our loads. Returns the outcomes."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file
    from torch.distributed.checkpoint import FileSystemReader

    from vapo_megatron.checkpoint import dist_io
    from vapo_megatron.mcore import parallel
    from vapo_megatron.runtime.atomic import CONVERT_HF_TO_MCORE

    parallel.init_distributed(1, 1)
    work_p = Path(work)
    out: dict[str, object] = {}

    # A clean checkpoint loads, tensors and common state intact (the restrictions break nothing).
    clean = work_p / "clean"
    dist_io.save(clean, _state(1.0), writer=CONVERT_HF_TO_MCORE)
    loaded = dist_io.load(clean, _template())
    out["clean_w"] = loaded["model"]["w"].clone()
    out["clean_groups"] = loaded["optimizer"]["param_groups"]

    # 1. A crafted object inside the common state (a *.distcp byte item), written by the save itself.
    evil_common = work_p / "evil_common"
    dist_io.save(evil_common, _state(2.0, extra={"note": Payload(str(work_p / "marker_common"))}),
                 writer=CONVERT_HF_TO_MCORE)
    out["common"] = _try(lambda: dist_io.load(evil_common, _template()))
    out["common_marker"] = (work_p / "marker_common").exists()
    # Control: DCP's own reading of that item (weights_only=False) runs the payload.
    md = FileSystemReader(str(evil_common)).read_metadata()
    (index, info), = [(i, s) for i, s in md.storage_data.items() if i.fqn.startswith("common_state")]
    with open(evil_common / info.relative_path, "rb") as f:
        f.seek(info.offset)
        item = f.read(info.length)
    import io

    torch.load(io.BytesIO(item), weights_only=False)
    out["common_control_marker"] = (work_p / "marker_common").exists()

    # 2. The .metadata index replaced by a crafted pickle.
    evil_meta = work_p / "evil_meta"
    shutil.copytree(clean, evil_meta)
    (evil_meta / ".metadata").write_bytes(pickle.dumps(Payload(str(work_p / "marker_meta"))))
    out["metadata"] = _try(lambda: dist_io.load(evil_meta, _template()))
    out["metadata_marker"] = (work_p / "marker_meta").exists()

    # 3. A legacy common.pt planted beside a clean checkpoint, with weights_only forced off by
    #    the environment (TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1 is set for this process).
    legacy = work_p / "legacy"
    shutil.copytree(clean, legacy)
    torch.save({"note": Payload(str(work_p / "marker_legacy"))}, legacy / "common.pt")
    out["legacy"] = _try(lambda: dist_io.load(legacy, _template()))
    out["legacy_marker"] = (work_p / "marker_legacy").exists()

    # 4. A storage entry pointing outside the checkpoint directory (a crafted but class-clean index).
    import dataclasses

    outside = work_p / "outside"
    shutil.copytree(clean, outside)
    md = FileSystemReader(str(clean)).read_metadata()
    md.storage_data = {k: dataclasses.replace(v, relative_path="../clean/" + v.relative_path)
                       for k, v in md.storage_data.items()}
    with open(outside / ".metadata", "wb") as f:
        pickle.dump(md, f)
    out["outside"] = _try(lambda: dist_io.load(outside, _template()))

    # 5. The trainer's RNG file (safetensors) replaced by a crafted pickle.
    rng = work_p / "rank_0.safetensors"
    save_file({"cpu": torch.get_rng_state()}, str(rng))
    rng.write_bytes(pickle.dumps(Payload(str(work_p / "marker_rng"))))
    out["rng"] = _try(lambda: load_file(str(rng)))
    out["rng_marker"] = (work_p / "marker_rng").exists()
    return out


def test_crafted_pickles_in_a_checkpoint_are_refused_and_never_run(tmp_path, monkeypatch):
    import torch

    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")  # inherited by the spawned rank
    (out,) = run_ranks(1, _rank, str(tmp_path))

    assert torch.equal(out["clean_w"], torch.arange(6, dtype=torch.float32).reshape(2, 3) + 1.0)
    assert out["clean_groups"] == [{"lr": 1e-4, "betas": (0.9, 0.999), "foreach": None}]

    assert out["common"].startswith("CheckpointError:") and "refused to load" in out["common"], out["common"]
    assert "_io.open, which is not on torch's weights-only allow-list" in out["common"]
    assert not out["common_marker"]
    assert out["common_control_marker"]  # the planted item is live: unrestricted loading runs it

    assert out["metadata"].startswith("CheckpointError:"), out["metadata"]
    assert "refused to load (possibly crafted to run code): " in out["metadata"]
    assert "evil_meta/.metadata: refused to unpickle _io.open" in out["metadata"]
    assert not out["metadata_marker"]

    assert out["legacy"].startswith("CheckpointError:") and "_io.open, which is not on" in out["legacy"], out["legacy"]
    assert not out["legacy_marker"]

    assert "points outside the checkpoint directory" in out["outside"], out["outside"]

    assert out["rng"].startswith("SafetensorError"), out["rng"]
    assert not out["rng_marker"]


def test_payloads_are_live_when_unpickled_the_ordinary_way(tmp_path):
    # The control for the .metadata and RNG cases: plain pickle runs the payload.
    marker = tmp_path / "marker"
    pickle.loads(pickle.dumps(Payload(str(marker))))
    assert marker.exists()


# ---- the code base: nothing that evaluates text or unpickles without restriction --------------

def _calls(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.id if isinstance(f, ast.Name) else (ast.unparse(f) if isinstance(f, ast.Attribute) else "")
            yield node, name


def test_source_has_no_eval_exec_or_unrestricted_unpickling():
    offenders = []
    files = [p for d in ("vapo_megatron", "model_providers", "scripts", "benchmarks") for p in (ROOT / d).rglob("*.py")]
    assert len(files) > 20
    for path in files:
        tree = ast.parse(path.read_text(), filename=str(path))
        for node, name in _calls(tree):
            where = f"{path.relative_to(ROOT)}:{node.lineno}: {name}"
            kwargs = {k.arg: k.value for k in node.keywords}
            if name in ("eval", "exec", "compile", "builtins.eval", "builtins.exec"):
                offenders.append(where)
            elif name in ("pickle.load", "pickle.loads", "marshal.loads", "marshal.load", "shelve.open", "dill.load",
                          "dill.loads"):
                offenders.append(where)
            elif name == "torch.load":
                wo = kwargs.get("weights_only")
                if not (isinstance(wo, ast.Constant) and wo.value is True):
                    offenders.append(where + " without weights_only=True")
            elif name == "yaml.load":
                offenders.append(where + " (use yaml.safe_load)")
            if isinstance(kwargs.get("trust_remote_code"), ast.Constant) and kwargs["trust_remote_code"].value is True:
                offenders.append(where + " trust_remote_code=True")
    assert offenders == [], offenders


def test_the_scan_catches_what_it_looks_for():
    bad = "import torch, pickle\ntorch.load(f)\ntorch.load(f, weights_only=False)\npickle.loads(b)\neval(s)\n"
    names = [name for _, name in _calls(ast.parse(bad))]
    assert names.count("torch.load") == 2 and "pickle.loads" in names and "eval" in names


def test_metadata_unpickler_accepts_a_real_index_and_refuses_other_globals():
    import io

    import torch
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    from vapo_megatron.checkpoint.safe_unpickle import MetadataUnpickler

    md = Metadata(state_dict_metadata={"w": TensorStorageMetadata(
        properties=TensorProperties(dtype=torch.bfloat16), size=torch.Size([2, 3]),
        chunks=[ChunkStorageMetadata(offsets=torch.Size([0, 0]), sizes=torch.Size([2, 3]))])},
        storage_data={MetadataIndex("w", (0, 0)): "x"})
    back = MetadataUnpickler(io.BytesIO(pickle.dumps(md))).load()
    assert back.state_dict_metadata["w"].properties.dtype == torch.bfloat16
    # A classic payload in protocol 0: os.system("true").
    with pytest.raises(pickle.UnpicklingError, match="refused to unpickle os.system"):
        MetadataUnpickler(io.BytesIO(b"cos\nsystem\n(S'true'\ntR.")).load()
    # getattr is the usual gadget for reaching anything else from an allowed module.
    with pytest.raises(pickle.UnpicklingError, match="refused to unpickle builtins.getattr"):
        MetadataUnpickler(io.BytesIO(pickle.dumps(getattr))).load()
