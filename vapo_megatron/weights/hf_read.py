"""Load HF safetensors into Megatron model chunks: read only the tensors this rank needs, one at
a time, convert them with the family's table, and cut out this rank's TP shard of each parameter.

`HFImporter.local_tensor` makes one parameter's TP-local tensor on demand; `load_hf_weights`
copies every parameter of live chunks from it (the trainer's warm start), and vapo-convert's
streaming hf-to-mcore hands it to the dist-checkpoint writer, which asks for one tensor at a time.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import Tensor

from model_providers.family import Family
from model_providers.layouts import hf_shapes, hf_to_mcore, shard
from model_providers.table import Row
from vapo_megatron.mcore import parallel
from vapo_megatron.weights.params import param_rows


class HFCheckpointError(ValueError):
    """An HF model directory that cannot be converted; the message names the file."""


def weight_map(hf_dir: str | Path) -> dict[str, Path]:
    """HF tensor name -> the safetensors file holding it."""
    hf_dir = Path(hf_dir)
    index = hf_dir / "model.safetensors.index.json"
    if index.is_file():
        with open(index) as f:
            return {k: hf_dir / v for k, v in json.load(f)["weight_map"].items()}
    single = hf_dir / "model.safetensors"
    if single.is_file():
        return {k: single for k in _header_shapes(single)}
    raise HFCheckpointError(f"{hf_dir}: neither model.safetensors.index.json nor model.safetensors found")


def _header_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Name -> shape from a safetensors file's header. safetensors refuses, on opening, a file
    shorter than its header says (a truncated download or copy)."""
    if not path.is_file():
        raise HFCheckpointError(f"{path} is missing (model.safetensors.index.json lists it)")
    try:
        with safe_open(path, framework="pt") as f:
            return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    except SafetensorError as e:
        raise HFCheckpointError(f"{path} is not a readable safetensors file (truncated?): {e}") from e


class HFImporter:
    """The HF checkpoint in `hf_dir` seen through the family's table, for this rank's chunks.

    Reads open the file, copy one tensor and close it again: a safetensors file is memory-mapped,
    and the mapped pages already read count toward this process's resident memory until the map
    is closed, so keeping files open would grow RSS to the size of the model."""

    def __init__(self, family: Family, hf_cfg: dict, hf_dir: str | Path, *, critic: bool = False):
        self.hf_dir, self.hf_cfg = Path(hf_dir), hf_cfg
        self.files = weight_map(hf_dir)
        self.table = family.table(hf_cfg, critic=critic)
        self.critic_only = {r.mcore for r in family.critic_rows}
        self.tp = parallel.tp_size()

    def params(self, model_chunks: list) -> list[tuple[Tensor, Row, int | None, str]]:
        """(param, row, global layer or None, local name) for every parameter of the chunks."""
        return [p for chunk in model_chunks for p in param_rows(chunk, self.table)]

    def _full_shape(self, param: Tensor) -> tuple[int, ...]:
        shape = list(param.shape)
        if getattr(param, "tensor_model_parallel", False):
            shape[param.partition_dim] *= self.tp
        return tuple(shape)

    def missing(self, row: Row, layer: int | None) -> bool:
        """True for a critic-only row (the value head) that this checkpoint lacks: it keeps its
        fresh initialization. Any other absent tensor is an error."""
        names = row.hf_names(layer)
        absent = [n for n in names if n not in self.files]
        if absent and row.mcore in self.critic_only:
            return True
        if absent:
            raise HFCheckpointError(f"{self.hf_dir}: tensor(s) {absent} needed for {row.mcore_name(layer)} "
                                    "are not in the checkpoint")
        return False

    def check(self, model_chunks: list) -> None:
        """Before anything is written: every file these chunks need opens (present, not
        truncated) and holds each needed tensor with the shape the model expects. Reads headers
        only."""
        wanted: dict[str, tuple[int, ...]] = {}
        for param, row, layer, _ in self.params(model_chunks):
            if not self.missing(row, layer):
                shapes = hf_shapes(row, self._full_shape(param), self.hf_cfg)
                wanted.update({n: tuple(s) for n, s in zip(row.hf_names(layer), shapes)})
        for path in sorted({self.files[n] for n in wanted}):
            found = _header_shapes(path)
            for name in (n for n in wanted if self.files[n] == path):
                if name not in found:
                    raise HFCheckpointError(f"{path}: tensor {name} is missing "
                                            "(model.safetensors.index.json places it here)")
                if found[name] != wanted[name]:
                    raise HFCheckpointError(f"{path}: tensor {name} has shape {found[name]}, "
                                            f"the model config needs {wanted[name]}")

    def read(self, name: str) -> Tensor:
        with safe_open(self.files[name], framework="pt") as f:
            return f.get_tensor(name)

    def local_tensor(self, param: Tensor, row: Row, layer: int | None) -> Tensor:
        """This TP rank's slice of the Megatron tensor for `param`, in `param`'s dtype and
        shape, made from the full HF tensors (read one by one)."""
        padded = param.shape[0] * self.tp if row.layout == "vocab" else None
        full = hf_to_mcore(row, [self.read(n) for n in row.hf_names(layer)], self.hf_cfg, padded_vocab=padded)
        if getattr(param, "tensor_model_parallel", False) and self.tp > 1:
            full = shard(row.layout, full, param.partition_dim, self.tp, parallel.tp_rank())
        if full.shape != param.shape:
            raise HFCheckpointError(f"{self.hf_dir}: {row.hf_names(layer)} give shape {tuple(full.shape)} for "
                                    f"{row.mcore_name(layer)}, which has shape {tuple(param.shape)}")
        return full.to(param.dtype)


def load_hf_weights(model_chunks: list, family: Family, hf_cfg: dict, hf_dir: str | Path, *,
                    critic: bool = False) -> list[str]:
    """Fill every parameter of `model_chunks` from the HF checkpoint in `hf_dir`.

    Returns the names of parameters left as initialized: only the critic's value head, when the
    checkpoint is a causal LM without a `score` head (a fresh critic from the policy)."""
    importer = HFImporter(family, hf_cfg, hf_dir, critic=critic)
    importer.check(model_chunks)
    left = []
    with torch.no_grad():
        for param, row, layer, local_name in importer.params(model_chunks):
            if importer.missing(row, layer):
                left.append(local_name)
                continue
            param.copy_(importer.local_tensor(param, row, layer))
    return left


__all__ = ["HFCheckpointError", "HFImporter", "load_hf_weights", "weight_map"]
