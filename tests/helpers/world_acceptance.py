"""What a library world must do as the local world does (issue 43), as functions of no world: the
caller picks the world by where it calls them (worlds.drive_in_world runs `world_side` in a fresh
interpreter of that world; the pytest process is the local world). They reuse the local world's
machinery: train_in_forks (the trainer's main on forked ranks), vapo-convert's, vapo-eval's and
vapo-plan's main functions on forked ranks (dist_utils.run_ranks, worlds.run_command), and
megatron_forward.

    world_side(work, local_ckpts)   in the world: two VAPO steps and a resume, dense and MoE (weight
                                    sync into the embedded engine at every step), vapo-convert both
                                    ways, the local world's checkpoints loaded, vapo-eval on the
                                    trainer's checkpoint, vapo-plan, a GPU node's settings (the
                                    world's fused kernels). Each item's result or traceback.
    convert_side(sources, work, foreign)   hf-to-mcore + forward + mcore-to-hf of each HF model, and
                                    a forward of checkpoints written elsewhere (one forked rank)
    eval_side(ckpt, data, out)      vapo-eval's samples on a checkpoint (one forked rank)
    plan_side(plans)                vapo-plan's exit code, output and parameter counts per preset
    gpu_node_rank()                 a GPU node's settings with Apex and without TE, built and stepped
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import time
import traceback
from pathlib import Path

import torch

from tests.helpers.dist_utils import run_ranks
from tests.helpers.train_runs import checkpoint_tensors, make_demo_data, records, small_run_overrides, train_in_forks

# The trainer runs: one rank each, so the MoE at EP=1 (the worlds differ in their libraries, not in
# collectives; expert parallelism runs in the local world and in the TE world at EP=2).
DENSE_LAYOUT = ("parallel.tp=1",)
MOE_LAYOUT = ("parallel.tp=1", "model.moe_aux_loss_coeff=0.01")
REPO = Path(__file__).resolve().parents[2]
# vapo-plan on the demo config for two GPUs: a dense Qwen3 at TP=2 without sequence parallelism (the
# path that builds the final norm from megatron's default), a Qwen3-MoE at EP=2.
PLANS = {"tiny-qwen3": ["parallel.tp=2"], "tiny-qwen3-moe": ["parallel.tp=1", "parallel.ep=2"]}


SECONDS: dict[str, float] = {}  # each attempt's wall time in this process (world_side reports them)


def attempt(results: dict, name: str, fn, *args) -> None:
    """results[name] = ("ok", fn(*args)) or ("error", its traceback): one item's failure does not
    hide the others'."""
    start = time.monotonic()
    try:
        results[name] = ("ok", fn(*args))
    except BaseException:  # noqa: BLE001 - reported to the parent test, item by item
        results[name] = ("error", traceback.format_exc())
    SECONDS[name] = time.monotonic() - start


def moments_report(want: dict, have: dict) -> dict:
    """The uninterrupted run's checkpoint (want) against the resumed one's (have): keys, tensors
    that differ, and Adam moments that are all zero (a wiped state, which a bitwise comparison of
    two runs that both wipe it would not see)."""
    moments = [k for k in want if "exp_avg" in k]
    return {"same_keys": want.keys() == have.keys(), "moments": len(moments),
            "differ": [k for k in want if k in have and not torch.equal(want[k], have[k])],
            "zero_moments": [k for k in moments if not want[k].any()]}


def train_and_resume(data: Path, root: Path, layout: tuple[str, ...]) -> dict:
    """Two VAPO steps uninterrupted; one step, then a resume for the second; the checkpoints of
    iteration 2 compared (weights and optimizer state of actor and critic)."""
    full, part = root / "full", root / "part"
    run = train_in_forks("demo_cpu.yaml", *small_run_overrides(data, full), *layout, nproc=1)
    train_in_forks("demo_cpu.yaml", *small_run_overrides(data, part), *layout, "trainer.total_steps=1", nproc=1)
    resumed = train_in_forks("demo_cpu.yaml", *small_run_overrides(data, part), *layout, nproc=1)
    last = (full / "checkpoints" / "latest").read_text().strip()
    out = {"records": records(full), "resumed": "resumed from" in resumed.stdout + resumed.stderr,
           "last": last, "part_last": (part / "checkpoints" / "latest").read_text().strip(),
           "output": run.stdout[-2000:], "checkpoint": str(full / "checkpoints" / last)}
    for role in ("actor", "critic"):
        out[role] = moments_report(checkpoint_tensors(full / "checkpoints" / last / role),
                                   checkpoint_tensors(part / "checkpoints" / last / role))
    return out


def moe_train_and_resume(data: Path, root: Path) -> dict:
    """train_and_resume on the demo data with tiny_hf.save_demo_sized's random Qwen3-MoE (4
    experts, top-2, layer 1 dense, the demo tokenizer)."""
    from tests.helpers.tiny_hf import save_demo_sized

    moe = root / "data"
    shutil.copytree(data, moe)
    save_demo_sized(moe / "model", data / "tokenizer", family="qwen3_moe")
    return train_and_resume(moe, root, MOE_LAYOUT)


def forward(ckpt: Path, ids: torch.Tensor) -> torch.Tensor:
    """A checkpoint's model (actor) built and loaded at TP=1, its logits on ids."""
    from tests.helpers.megatron_ref import megatron_forward
    from vapo_megatron.checkpoint import dist_io
    from vapo_megatron.mcore import parallel
    from vapo_megatron.mcore.models import build_chunks

    parallel.init_distributed(1, 1)
    try:
        hf_cfg = json.loads((ckpt / "hf" / "config.json").read_text())
        chunks = build_chunks(hf_cfg, params_dtype=torch.float32, critic=False)
        dist_io.load_model(ckpt, chunks)
        return megatron_forward(chunks, ids, critic=False, vocab=hf_cfg["vocab_size"])
    finally:
        parallel.destroy()


def convert_rank(sources: dict, work: Path, foreign: dict, ids: torch.Tensor) -> dict:
    """One rank: for each HF model, vapo-convert hf-to-mcore, a forward of the result, mcore-to-hf;
    a forward of each checkpoint in `foreign`. Every result: ("ok", logits) or ("error", traceback)."""
    from vapo_megatron import convert

    def run(*argv: str) -> None:
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            code = convert.main(list(argv))
        assert code == 0, f"vapo-convert {argv[0]} exited {code}:\n{err.getvalue()[-3000:]}"

    def both_ways(hf: Path, ckpt: Path, out: Path) -> torch.Tensor:
        run("hf-to-mcore", "--hf", str(hf), "--out", str(ckpt))
        logits = forward(ckpt, ids)
        run("mcore-to-hf", "--ckpt", str(ckpt), "--out", str(out))
        return logits

    results: dict = {}
    for name, hf in sources.items():
        attempt(results, name, both_ways, hf, work / f"{name}-mcore", work / f"{name}-hf")
    for name, ckpt in foreign.items():
        attempt(results, f"foreign-{name}", forward, ckpt, ids)
    return results


def convert_side(sources: dict, work: Path, foreign: dict, ids: torch.Tensor) -> dict:
    (out,) = run_ranks(1, convert_rank, sources, work, foreign, ids)
    return out


def eval_side(ckpt: Path, data: Path, out: Path) -> list[dict]:
    """vapo-eval of a checkpoint on the demo's eval prompts (4 samples each), its samples.jsonl."""
    from tests.helpers.worlds import run_command

    code, stdout, stderr = run_command("vapo_megatron.eval", [
        "--model", str(ckpt), "--data", str(data / "eval.jsonl"), "--n-samples", "4", "--out", str(out),
        "--reward", "exact", "--max-new-tokens", "8", "--max-prompt-tokens", "32", "--seed", "7"])
    assert code == 0, f"vapo-eval exited {code}:\n{stdout[-2000:]}\n{stderr[-4000:]}"
    return [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]


def plan_rank(plans: dict) -> dict:
    """vapo-plan's exit code and output for each preset, and the parameter counts it sizes from
    (sizing/shards.py, the models built on the meta device)."""
    import dataclasses

    from model_providers.presets import preset
    from vapo_megatron.plan import main
    from vapo_megatron.sizing.shards import shard_sizes

    out = {}
    for name, overrides in plans.items():
        text = io.StringIO()
        with contextlib.redirect_stdout(text):
            code = main(["--config", str(REPO / "configs" / "demo_cpu.yaml"), "--preset", name, "--nodes", "1",
                         "--gpus-per-node", "2", *overrides])
        layout = {k.split(".")[1]: int(v) for k, v in (o.split("=") for o in overrides)}
        sizes = shard_sizes(preset(name), preset(name), world_size=2, pp=1, vpp=None, params_dtype=torch.float32,
                            **layout)
        out[name] = (code, text.getvalue(), [dataclasses.astuple(s) for s in sizes])
    return out


def plan_side(plans: dict) -> dict:
    (out,) = run_ranks(1, plan_rank, plans)
    return out


def gpu_node_rank() -> dict:
    """A GPU node's settings where Apex imports and TE does not, built and stepped here: the
    project's TransformerConfig for the GPU (mcore/models.py transformer_config, on_gpu=True) and a
    bf16 tiny Qwen3 built on the GPU's path (cpu_compat places it on the CPU); its forward through
    megatron's fused softmax (Apex's causal kernel), against the same model with the fusion off;
    one update with megatron's bf16 optimizer over Apex's FusedAdam, its gradient norm and clipping
    through amp_C (clip_grad below the norm, so the gradients are scaled)."""
    import scaled_upper_triang_masked_softmax_cuda as causal
    from megatron.core.optimizer import clip_grads

    from model_providers.presets import preset
    from vapo_megatron.config import OptimConfig
    from vapo_megatron.mcore import models, parallel
    from vapo_megatron.mcore.model import wrap_ddp
    from vapo_megatron.mcore.optimizer import build_optimizer, optimizer_step

    parallel.init_distributed(1, 1)
    calls = {"softmax": 0, "l2norm": 0, "scale": 0}

    def counted(name, fn):
        def call(*args):
            calls[name] += 1
            return fn(*args)
        return call

    causal.forward = counted("softmax", causal.forward)
    clip_grads.l2_norm_impl = counted("l2norm", clip_grads.l2_norm_impl)
    clip_grads.multi_tensor_scale_impl = counted("scale", clip_grads.multi_tensor_scale_impl)
    (model,) = models.build_chunks(preset("tiny-qwen3"), params_dtype=torch.bfloat16, critic=False, on_gpu=True)
    fields = ("masked_softmax_fusion", "gradient_accumulation_fusion", "apply_rope_fusion", "use_cpu_initialization")
    out = {f: getattr(model.config, f) for f in fields}
    ids = torch.randint(0, 250, (2, 32), generator=torch.Generator().manual_seed(0))  # 2 x 4 heads, 32 tokens: fused
    pos = torch.arange(32).expand(2, 32)
    softmaxes = [m for m in model.modules() if hasattr(m, "scaled_masked_softmax_fusion")]
    with torch.no_grad():
        fused = model(ids, pos, None).float()
        out["fused_calls"] = calls["softmax"]
        for m in softmaxes:
            m.scaled_masked_softmax_fusion = False
        out["logits_diff"] = (fused - model(ids, pos, None).float()).abs().max().item()
        for m in softmaxes:
            m.scaled_masked_softmax_fusion = True
    chunks = wrap_ddp([model], distributed_optimizer=False)
    optimizer = build_optimizer(chunks, OptimConfig(lr=1e-3, clip_grad=1e-4), params_dtype=torch.bfloat16)
    out["adam"] = {type(o.optimizer).__module__ for o in getattr(optimizer, "chained_optimizers", [optimizer])}
    chunks[0].zero_grad_buffer()
    chunks[0](ids, pos, None).float().square().mean().backward()
    out["step"] = optimizer_step(optimizer, chunks, loss_finite=True)
    out["calls"] = dict(calls)
    return out


def world_side(work: Path, hf_models: dict, local_ckpts: dict, ids: torch.Tensor) -> dict:
    """Everything the world must do, in the world (see the module's docstring)."""
    results: dict = {}
    data = make_demo_data(work / "data", n_train=64, n_eval=8, n_sft=16)
    attempt(results, "dense", train_and_resume, data, work / "dense", DENSE_LAYOUT)
    attempt(results, "moe", moe_train_and_resume, data, work / "moe")
    attempt(results, "convert", convert_side, hf_models, work / "convert", local_ckpts, ids)
    if results["dense"][0] == "ok":
        attempt(results, "eval", eval_side, Path(results["dense"][1]["checkpoint"]), data, work / "eval")
    else:
        results["eval"] = ("error", "not run: the dense trainer run, whose checkpoint it reads, failed")
    attempt(results, "plan", plan_side, PLANS)
    attempt(results, "gpu_node", lambda: run_ranks(1, gpu_node_rank)[0])
    results["seconds"] = ("ok", dict(SECONDS))
    return results
