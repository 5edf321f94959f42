"""vapo-check --ranks: one rank per GPU of the node, the actor at trainer TP = every rank, SGLang
colocated with it (vapo_megatron/check.py parses the flags and says what each check proves).

    torchrun --nproc-per-node N -m vapo_megatron.check --ranks [--engine-tp K] [--model-preset NAME ...]

Per preset: ranks_model gives the preset's shapes that N trainer ranks and SGLang's GPU kernels take;
rank 0 writes it with random weights (write_model); every rank starts the colocated engines through
SGLangEngine.colocated (engine TP K, default N: what the shipped configs' rollout.sglang.tp =
parallel.tp means; a MoE preset with SGLang's return_routed_experts) and runs multi_rank.py's
check_on_engine; the engines are shut down before the next preset. Rank 0 prints the lines.
An exception ends the run where it is raised: that rank prints FAIL and its traceback and exits
1; torchrun then ends the other ranks, which may be waiting in a collective for it.
"""

from __future__ import annotations

import gc
import math
import os
import shutil
import sys
import tempfile
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

HEAD_DIM = 128  # every shipped model's; SGLang's GPU attention backends take a few head sizes, 128 among them
MEM_FRACTION = 0.3  # SGLang's static share of each GPU (the single-process check's engine takes the same)
MAX_PARAMS = 2e9  # rank 0 builds the model in host memory with transformers, in float32


def ranks_model(name: str, tp: int) -> dict:
    """model_providers.presets' `name` as TP ranks and SGLang's GPU kernels can split it: query and KV
    heads multiplied until TP divides both (Megatron splits whole KV groups), head_dim 128 (a preset
    with its own head_dim keeps its hidden size; one without gets heads x 128), MLP and expert
    widths rounded up to a multiple of 16 per TP rank; a MoE preset gets experts in every layer
    (SGLang 0.5.23's Qwen3-MoE builds no dense layer: config/preflight.py). The rest is the preset's."""
    from model_providers.presets import preset

    hf = preset(name)
    grow = tp // math.gcd(hf["num_key_value_heads"], tp)
    out = {**hf, "num_attention_heads": hf["num_attention_heads"] * grow,
           "num_key_value_heads": hf["num_key_value_heads"] * grow}
    if "head_dim" in hf:
        out["head_dim"] = HEAD_DIM
    else:
        out["hidden_size"] = out["num_attention_heads"] * HEAD_DIM
    step = 16 * tp
    for key in ("intermediate_size", "moe_intermediate_size"):
        if key in hf:
            out[key] = -(-hf[key] // step) * step
    if "num_experts" in hf:
        out["mlp_only_layers"] = []
    return out


def scramble(model: torch.nn.Module, seed: int) -> None:
    """Random weights with unit-scale activations: each matrix N(0, 1 / fan-in), norms 1 + 0.1 N(0, 1),
    biases 0.1 N(0, 1). transformers' own init (std 0.02) gives nearly uniform next-token
    distributions, under which a wrong weight hardly moves a log-prob."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            noise = torch.randn(p.shape, generator=gen)
            if p.ndim >= 2:
                p.copy_(noise / p.shape[-1] ** 0.5)
            else:
                p.copy_(float("norm" in name) + 0.1 * noise)


def write_model(hf: dict, path: Path, seed: int = 0) -> None:
    """hf as an HF model directory of the family's own transformers class, bf16 weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(hf["model_type"],
                               **{k: v for k, v in hf.items() if k not in ("model_type", "torch_dtype")})
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    scramble(model, seed)
    model.to(torch.bfloat16).save_pretrained(path)


def too_big(hf: dict) -> str | None:
    from vapo_megatron.nodecheck.models import approx_params

    n = approx_params(hf)
    return None if n <= MAX_PARAMS else (f"{n / 1e9:.0f}B parameters: --ranks builds its model in one process's "
                                         f"memory with random weights, up to {MAX_PARAMS / 1e9:.0f}B "
                                         "(the tiny presets)")


def _shared(value):
    """Rank 0's small `value` on every rank (the world's wait group)."""
    from vapo_megatron.mcore import parallel

    box = [value]
    parallel.broadcast_object_list(box, src=0, group=parallel.wait_group())
    return box[0]


def check_preset(name: str, engine_tp: int, work: Path) -> list[tuple[str, str, str]]:
    """Collective over the world. One preset's lines (the same on every rank)."""
    import model_providers
    from vapo_megatron.data.routes import route_shape
    from vapo_megatron.nodecheck.multi_rank import check_on_engine
    from vapo_megatron.rollout.sglang_engine import SGLangEngine

    hf = ranks_model(name, dist.get_world_size())
    moe = "num_experts" in hf
    if why := too_big(hf):
        return [(f"{c}:{name}", "SKIP", why) for c in ("sglang_sync", *(("routed_experts",) if moe else ()))]
    hf_dir = work / name
    error = None
    if dist.get_rank() == 0:
        try:
            write_model(hf, hf_dir)
        except Exception as e:  # noqa: BLE001 - the other ranks must learn of it before they read the files
            error = f"{type(e).__name__}: {e}"
    if error := _shared(error):
        return [(f"sglang_sync:{name}", "FAIL", f"writing the model on rank 0: {error}")]
    hf_cfg = model_providers.read_hf_config(str(hf_dir))
    engine = SGLangEngine.colocated(model_path=str(hf_dir), tp_size=engine_tp, mem_fraction=MEM_FRACTION,
                                    dtype="bfloat16", seed=0, routes=route_shape(hf_cfg))
    try:
        return check_on_engine(hf_dir, engine, name=name, dtype=torch.bfloat16)
    finally:
        engine.shutdown()  # its own processes only; the next preset starts its own engines


def run(presets: list[str], engine_tp: int | None) -> int:
    """The mode's main, on every rank under torchrun (check.py has checked the flags and the launch)."""
    from vapo_megatron.mcore import parallel
    from vapo_megatron.nodecheck.models import report

    local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
    if not torch.cuda.is_available() or torch.cuda.device_count() < local:
        if os.environ.get("RANK", "0") == "0":
            print(f"vapo-check: --ranks needs a GPU per rank: {local} ranks, "
                  f"{torch.cuda.device_count() if torch.cuda.is_available() else 0} CUDA GPU(s) visible",
                  file=sys.stderr)
        return 2
    # Short timeouts: a rank waiting on one that failed gives up (the wait groups' covers an engine's first start,
    # which may compile SGLang's kernels); the failed rank has printed FAIL, and torchrun ends the others.
    parallel.init_distributed(int(os.environ["WORLD_SIZE"]), 1, seed=0, timeout_minutes=10, wait_timeout_s=1800)
    world, rank0 = dist.get_world_size(), dist.get_rank() == 0
    engine_tp = engine_tp or world
    if rank0:
        print(f"vapo-check --ranks: {world} ranks on {torch.cuda.get_device_name()} ({dist.get_backend()}), trainer "
              f"TP={world}, SGLang engine TP={engine_tp} ({world // engine_tp} engine(s)); torch {torch.__version__}; "
              f"presets {' '.join(presets)}", flush=True)
    work = Path(_shared(tempfile.mkdtemp(prefix="vapo_check_ranks_") if rank0 else None))
    lines = []
    for name in presets:
        try:
            got = check_preset(name, engine_tp, work)
        except Exception as e:  # noqa: BLE001 - inside a collective: the other ranks cannot go on (module docstring)
            report(f"ranks:{name}", "FAIL", f"rank {dist.get_rank()}: {type(e).__name__}: "
                   f"{str(e).splitlines()[0] if str(e) else ''}")
            traceback.print_exc(file=sys.stderr)
            return 1
        for line in got:
            lines.append(line)
            if rank0:
                report(*line)
        gc.collect()  # Megatron's modules hold reference cycles: the last preset's actor leaves the GPU
        torch.cuda.empty_cache()
    parallel.barrier(group=parallel.wait_group())
    if rank0:
        shutil.rmtree(work, ignore_errors=True)
        failed = [n for n, s, _ in lines if s == "FAIL"]
        print(f"vapo-check --ranks: {len(lines) - len(failed)} of {len(lines)} without FAIL"
              + (f"; FAIL: {', '.join(failed)}" if failed else ""), flush=True)
    parallel.destroy()
    return 1 if any(s == "FAIL" for _, s, _ in lines) else 0


__all__ = ["HEAD_DIM", "MAX_PARAMS", "MEM_FRACTION", "check_preset", "ranks_model", "run", "scramble", "too_big",
           "write_model"]
