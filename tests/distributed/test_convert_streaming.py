"""vapo-convert's streaming and its handling of bad input (one single-process run).

- Bad HF input (a shard missing, a shard truncated, a tensor of the wrong shape) and a truncated
  dist checkpoint: the CLI stops with one line naming the file, and nothing is left under the
  output name or in its temp directory.
- Streaming, checked structurally (bytes held, not RSS): hf-to-mcore never holds more than one
  parameter made from the HF files besides the one being made; mcore-to-hf's groups stay under
  the bound and each group is released before the next is read. Correctness of the converted
  values is test_convert.py's (bitwise round trips, logits against transformers).
"""

from __future__ import annotations

import json
import shutil
import weakref
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.helpers.dist_utils import run_ranks
from tests.helpers.tiny_hf import save_tiny


def _convert_error(argv: list[str]) -> str:
    """vapo-convert's answer to bad input: exit 2 and its one "vapo-convert:" line on stderr
    (beside it only the progress bar's carriage-return updates and library warnings)."""
    import contextlib
    import io

    from vapo_megatron import convert

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = convert.main(argv)
    ours = [line for line in err.getvalue().replace("\r", "\n").splitlines() if line.startswith("vapo-convert:")]
    assert code == 2 and len(ours) == 1, err.getvalue()
    return ours[0]


def _leftovers(out: Path) -> list[str]:
    return [p.name for p in out.parent.iterdir() if p.name in (out.name, f".{out.name}.tmp")]


def _bad_inputs(src: Path, work: Path) -> dict:
    index = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    files = sorted(set(index.values()))
    results = {}

    def case(name: str, damage) -> None:
        hf = work / name
        shutil.copytree(src, hf)
        results[name] = (damage(hf),
                         _convert_error(["hf-to-mcore", "--hf", str(hf), "--out", str(work / f"{name}-mc")]),
                         _leftovers(work / f"{name}-mc"))

    def missing(hf: Path) -> Path:
        (hf / files[1]).unlink()
        return hf / files[1]

    def truncated(hf: Path) -> Path:
        path = hf / files[1]
        with open(path, "r+b") as f:
            f.truncate(path.stat().st_size - 100)
        return path

    def wrong_shape(hf: Path) -> Path:
        name = "model.layers.1.mlp.up_proj.weight"
        path = hf / index[name]
        tensors = load_file(path)
        tensors[name] = tensors[name][:-1].clone()  # [63, 32] instead of [64, 32]
        save_file(tensors, path, metadata={"format": "pt"})
        return path

    for name, damage in (("missing", missing), ("truncated", truncated), ("wrong_shape", wrong_shape)):
        case(name, damage)

    # A dist checkpoint with a storage file cut short: mcore-to-hf names it, leaves no export.
    from vapo_megatron import convert

    convert.main(["hf-to-mcore", "--hf", str(src), "--out", str(work / "mc")])
    cut = sorted((work / "mc").glob("*.distcp"), key=lambda p: p.stat().st_size)[-1]
    with open(cut, "r+b") as f:
        f.truncate(cut.stat().st_size // 2)
    results["distcp"] = (cut, _convert_error(["mcore-to-hf", "--ckpt", str(work / "mc"), "--out", str(work / "back"),
                                              "--max-shard-mb", "1"]), _leftovers(work / "back"))
    return results


def _streaming(src: Path, work: Path) -> dict:
    """Counts of bytes held, from weak references to the storages of every tensor made."""
    from model_providers import QWEN2, read_hf_config
    from vapo_megatron.mcore import parallel
    from vapo_megatron.mcore.models import build_chunks
    from vapo_megatron.weights import convert
    from vapo_megatron.weights.from_checkpoint import iter_checkpoint_hf_groups
    from vapo_megatron.weights.hf_read import HFImporter

    made: list[tuple[weakref.ref, int]] = []
    held_at_make: list[int] = []
    real = HFImporter.local_tensor

    def observed(self, param, row, layer):  # the real method; records what is still alive
        held_at_make.append(sum(n for ref, n in made if ref() is not None))
        tensor = real(self, param, row, layer)
        made.append((weakref.ref(tensor.untyped_storage()), tensor.nbytes))
        return tensor

    HFImporter.local_tensor = observed
    try:
        convert.hf_to_mcore(src, work / "stream-mc", critic=False, tp=1, pp=1, dtype=None)
    finally:
        HFImporter.local_tensor = real
    sizes = [n for _, n in made]

    # mcore-to-hf's groups, 40 kB each at most, consumed as write_hf_dir does.
    hf_cfg = read_hf_config(src)
    parallel.init_distributed(1, 1)
    with torch.device("meta"):
        chunks = build_chunks(hf_cfg, params_dtype=torch.float32, critic=False, on_gpu=False)
    group_sizes, left_over, previous = [], [], []
    for group in iter_checkpoint_hf_groups(work / "stream-mc", chunks, QWEN2, hf_cfg, critic=False, max_bytes=40_000):
        left_over.append(sum(n for ref, n in previous if ref() is not None))
        group_sizes.append((len(group), sum(t.nbytes for _, t in group)))
        previous = [(weakref.ref(t.untyped_storage()), t.nbytes) for _, t in group]
        del group
    return {"held_at_make": held_at_make, "sizes": sizes, "groups": group_sizes, "left_over": left_over}


def _run(src: Path, work: Path) -> dict:
    return {"bad": _bad_inputs(src, work), "streaming": _streaming(src, work)}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("stream")
    model = save_tiny(root / "one", tied=False, seed=3)
    model.save_pretrained(root / "hf", max_shard_size="60KB")  # several shards and an index
    assert len(set(json.loads((root / "hf" / "model.safetensors.index.json").read_text())["weight_map"].values())) >= 3
    (work := root / "work").mkdir()
    (result,) = run_ranks(1, _run, root / "hf", work)
    return result


@pytest.mark.parametrize("case, says", [
    ("missing", "is missing"),
    ("truncated", "is truncated or damaged: "),  # model_providers/files.py, before the layout starts
    ("wrong_shape", "tensor model.layers.1.mlp.up_proj.weight has shape (63, 32), the model config needs (64, 32)"),
])
def test_bad_hf_shard_is_named_and_nothing_is_written(results, case, says):
    path, message, leftovers = results["bad"][case]
    assert message.startswith("vapo-convert: error: ") and "\n" not in message
    assert str(path) in message and says in message
    assert leftovers == []


def test_truncated_dist_checkpoint_is_named_and_no_export_is_left(results):
    path, message, leftovers = results["bad"]["distcp"]
    assert message.startswith("vapo-convert: error: ") and "\n" not in message
    assert f"{path} is truncated" in message
    assert leftovers == []


def test_hf_to_mcore_holds_one_parameter_at_a_time(results):
    s = results["streaming"]
    assert len(s["sizes"]) >= 30  # every parameter of the 4-layer model was made, one call each
    # When a parameter is made, at most the previous one (still referenced by the writer's loop
    # until its next item) is alive: the writer does not accumulate the model.
    assert max(s["held_at_make"]) <= max(s["sizes"])
    assert sum(s["sizes"]) > 4 * max(s["sizes"])  # so the bound above is far below the model


def test_mcore_to_hf_reads_bounded_groups_and_releases_each(results):
    s = results["streaming"]
    assert len(s["groups"]) >= 4
    assert all(nbytes <= 40_000 or count == 1 for count, nbytes in s["groups"])
    assert s["left_over"] == [0] * len(s["groups"])  # nothing of a group survives into the next
