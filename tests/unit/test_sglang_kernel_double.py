"""The test double of sgl_kernel (tests/doubles/sglang/sgl_kernel, standing in for the CPU build of
SGLang's kernel package): each op against a plain-torch reference, and its names against what
SGLang's CPU path imports, read from the installed sglang's source."""

from __future__ import annotations

import ast
import importlib.util

import pytest
import torch

from tests.helpers.sglang_source import SRT
from tests.helpers.sglang_world import SGL_KERNEL_DOUBLE


def _double():
    spec = importlib.util.spec_from_file_location("sgl_kernel_double", SGL_KERNEL_DOUBLE / "__init__.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _cpu_imports() -> set[str]:
    """Every name SGLang imports from sgl_kernel under an `if _is_cpu:` (or `elif _is_cpu:`) at module
    level, in the installed sglang package (srt/ and kernels/)."""
    names = set()
    for root in (SRT, SRT.parent / "kernels"):
        for path in root.rglob("*.py"):
            text = path.read_text()
            if "from sgl_kernel import" not in text:
                continue  # most of sglang's ~2,000 files: parsing them all takes minutes here
            tree = ast.parse(text, filename=str(path))
            for node in ast.walk(tree):
                if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "_is_cpu":
                    for stmt in node.body:
                        if isinstance(stmt, ast.ImportFrom) and stmt.module == "sgl_kernel":
                            names |= {a.name for a in stmt.names}
    return names


def test_double_provides_exactly_what_sglangs_cpu_path_imports():
    d = _double()
    provided = {n for n in dir(d) if n.endswith("_cpu") and callable(getattr(d, n))}
    assert _cpu_imports() == provided


def test_double_registers_no_torch_op_so_sglang_takes_its_native_path():
    """SGLang's cpu_has_amx_support (utils/common.py) needs torch.ops.sgl_kernel.convert_weight_packed;
    without it every layer runs forward_native, on any CPU."""
    _double()
    assert not hasattr(torch.ops.sgl_kernel, "convert_weight_packed")


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_assign_req_to_token_pool_matches_a_loop(index_dtype):
    d = _double()
    gen = torch.Generator().manual_seed(0)
    pool_len, rows = 16, 6
    rpi = torch.tensor([4, 0, 2], dtype=index_dtype)
    start = torch.tensor([0, 5, 3], dtype=index_dtype)
    end = torch.tensor([7, 5, 16], dtype=index_dtype)
    locs = torch.randint(0, 10_000, (int((end - start).sum()),), generator=gen, dtype=torch.int64)
    got = torch.full((rows, pool_len), -1, dtype=torch.int32)
    want = got.clone()
    d.assign_req_to_token_pool_cpu(rpi, got, start, end, locs, pool_len)
    k = 0
    for i in range(3):
        for j in range(int(start[i]), int(end[i])):
            want[int(rpi[i]), j] = int(locs[k])
            k += 1
    assert torch.equal(got, want)


def test_assign_req_to_token_pool_checks_like_the_kernel():
    d = _double()
    idx = torch.tensor([0])
    with pytest.raises(RuntimeError, match="int32"):
        d.assign_req_to_token_pool_cpu(idx, torch.zeros(2, 4, dtype=torch.int64), idx, idx + 1, idx, 4)
    with pytest.raises(RuntimeError, match="one dtype"):
        d.assign_req_to_token_pool_cpu(idx, torch.zeros(2, 4, dtype=torch.int32), idx.int(), idx + 1, idx, 4)


def test_copy_all_layer_kv_cache_gathers_before_it_scatters():
    """Every buffer (its own row width) gets buf[tgt] = buf[src] as of before the copy, overlapping
    locations included (src 0,1,2 -> tgt 1,2,3 shifts the rows, it does not smear row 0)."""
    d = _double()
    gen = torch.Generator().manual_seed(1)
    bufs = [torch.randn(8, 2, 4, generator=gen), torch.randn(8, 3, generator=gen), torch.randn(8, 2, 4, generator=gen)]
    want = [b.clone() for b in bufs]
    src, tgt = torch.tensor([0, 1, 2, 6]), torch.tensor([1, 2, 3, 0])
    for w in want:
        w[tgt] = w[src].clone()
    ptrs = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.uint64)
    strides = torch.tensor([b[0].numel() * b.element_size() for b in bufs], dtype=torch.int64)
    d.copy_all_layer_kv_cache_cpu(ptrs, strides, tgt, src)
    for b, w in zip(bufs, want):
        assert torch.equal(b, w)


def test_speculative_decoding_ops_are_not_modelled():
    d = _double()
    with pytest.raises(NotImplementedError, match="speculative decoding"):
        d.verify_tree_greedy_cpu()
