"""Is a Hugging Face model directory whole? Checks of its files in pure Python (no torch).

    model_dir_problems(hf_dir)   every problem of the directory's files, one line each, naming the file

Every command (vapo-train's start-up, vapo-eval, vapo-convert) runs these before any work, so a
truncated download or a damaged tokenizer is one line and exit 2, not a library's traceback
minutes later. Reads only headers: a safetensors file's first bytes say how long it must be.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

# safetensors refuses headers larger than this (its MAX_HEADER_SIZE): anything bigger is not one.
MAX_HEADER_BYTES = 100_000_000
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def safetensors_problem(path: Path) -> str | None:
    """Why `path` is not a whole safetensors file, or None. The format: an 8-byte little-endian
    header length N, N bytes of JSON ({name: {dtype, shape, data_offsets: [begin, end]}}), then the
    data, whose size is the largest `end`. A truncated copy is shorter than that."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                return f"{path} is truncated: {size} bytes, shorter than a safetensors header"
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES or 8 + n > size:
                return (f"{path} is not a safetensors file or is truncated: its header claims {n} bytes, "
                        f"the file has {size}")
            header = json.loads(f.read(n))
    except OSError as e:
        return f"{path} cannot be read ({e.strerror or e})"
    except (ValueError, UnicodeDecodeError) as e:
        return f"{path} has a damaged safetensors header ({e})"
    if not isinstance(header, dict):
        return f"{path} has a damaged safetensors header (not a JSON object)"
    try:
        end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
    except (TypeError, KeyError, IndexError, ValueError):
        return f"{path} has a damaged safetensors header (a tensor without data_offsets)"
    if size != 8 + n + end:
        return f"{path} is truncated or damaged: {size} bytes, its header describes {8 + n + end}"
    return None


def _tensor_names(path: Path) -> set[str]:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return set(json.loads(f.read(n))) - {"__metadata__"}


def tensor_shape(hf_dir: str | Path, name: str) -> list[int] | None:
    """The shape of tensor `name` in an HF directory's safetensors (read from the headers only), or
    None when no file holds it. The files must be whole (weights_problems says when they are not)."""
    hf_dir = Path(hf_dir)
    index = hf_dir / "model.safetensors.index.json"
    if index.is_file():
        file = json.loads(index.read_text()).get("weight_map", {}).get(name)
        files = [hf_dir / file] if file else []
    else:
        files = [hf_dir / "model.safetensors"]
    for path in files:
        if path.is_file():
            with open(path, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                entry = json.loads(f.read(n)).get(name)
            if entry is not None:
                return [int(d) for d in entry["shape"]]
    return None


# A Megatron model checkpoint of this project (vapo-convert's hf-to-mcore, a trainer checkpoint's
# actor/ or critic/) holds this file (its family, whether it is a critic, its dtype) and hf/config.json.
MEGATRON_META = "vapo.json"


def megatron_model_dir(path: str | Path) -> bool:
    """Whether `path` is such a Megatron model checkpoint (else: an HF directory or neither)."""
    return (Path(path) / MEGATRON_META).is_file() and (Path(path) / "hf" / "config.json").is_file()


def weights_problems(hf_dir: Path) -> list[str]:
    """model.safetensors, or model.safetensors.index.json and every file it lists: present, whole,
    and holding the tensors the index places in them."""
    index, single = hf_dir / "model.safetensors.index.json", hf_dir / "model.safetensors"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            files = {name: hf_dir / f for name, f in weight_map.items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            return [f"{index} is not a readable safetensors index ({type(e).__name__}: {e})"]
        out = []
        for path in sorted(set(files.values())):
            if not path.is_file():
                out.append(f"{path} is missing ({index.name} lists it)")
            elif (problem := safetensors_problem(path)) is not None:
                out.append(problem)
            else:
                absent = sorted(n for n, p in files.items() if p == path and n not in _tensor_names(path))
                if absent:
                    out.append(f"{path} lacks {len(absent)} tensor(s) {index.name} places in it, e.g. {absent[0]}")
        return out
    if single.is_file():
        problem = safetensors_problem(single)
        return [problem] if problem else []
    return [f"{hf_dir} has no model.safetensors or model.safetensors.index.json "
            "(weights are read from safetensors only)"]


def json_problems(hf_dir: Path) -> list[str]:
    """Every JSON file at the top of the directory parses (config, tokenizer, generation config):
    a damaged tokenizer.json would otherwise surface as a tokenizers traceback at the first prompt."""
    out = []
    for path in sorted(hf_dir.glob("*.json")):
        try:
            json.loads(path.read_bytes())
        except (OSError, ValueError) as e:
            out.append(f"{path} is not readable JSON ({e})")
    return out


def model_dir_problems(hf_dir: str | Path, *, weights: bool = True, tokenizer: bool = True) -> list[str]:
    """Every problem of an HF model directory's files. `weights=False` for a checkpoint's hf/
    (config and tokenizer only); `tokenizer=False` where no text is read (weight conversion)."""
    hf_dir = Path(hf_dir)
    out = json_problems(hf_dir)
    if weights:
        out += weights_problems(hf_dir)
    if tokenizer and not any((hf_dir / f).is_file() for f in TOKENIZER_FILES):
        out.append(f"{hf_dir} has no tokenizer ({' or '.join(TOKENIZER_FILES)})")
    return out


__all__ = ["MEGATRON_META", "json_problems", "megatron_model_dir", "model_dir_problems", "safetensors_problem",
           "tensor_shape", "weights_problems"]
