"""The TE world's acceptance runs (tests/distributed/test_te_world.py), driven from ONE interpreter of
the world with Transformer Engine and Apex (worlds.drive_in_world("te_apex"), as NGC images have
both): every trainer run, conversion, load, eval and plan forks its ranks from that interpreter's
forkserver, so the world's start-up is paid once. Its models accumulate weight gradients into
main_grad (gradient_accumulation_fusion, TE's fuse_wgrad_accumulation), as a GPU node with TE and
Apex does; `unfused` runs turn that off (mcore/models.py WGRAD_FUSION_ON_CPU="0": what a node with
TE and no Apex runs).

Each stage's outcome is recorded on its own ({"error": traceback} when it failed), so that a stage
that fails (the resume, before the Adam-state fix of issue 43) does not hide the others."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
import traceback
from pathlib import Path

import torch

from tests.helpers.train_runs import checkpoint_tensors, hf_weights, records, small_run_overrides, train_in_forks

# Micro-batches of at most 40 tokens (one full sequence: data.max_prompt_tokens + rollout.max_new_tokens):
# a mini-batch of 4 demo sequences takes several, so the fused wgrad GEMM both writes main_grad (the
# first micro-batch) and adds to it (the others).
MICRO = "trainer.micro_batch_tokens=40"
DENSE = ["parallel.tp=2", "parallel.sequence_parallel=true", MICRO]  # TE's TP and SP communication
MOE = ["parallel.tp=1", "parallel.ep=2", "model.moe_aux_loss_coeff=0.01", MICRO]  # grouped-GEMM experts over EP
SAVE_BOTH = ["trainer.save_every=1", "trainer.export_hf=true"]  # iterations 1 and 2 saved, the final HF export


def stage(out: dict, name: str, fn, *args) -> None:
    start = time.monotonic()
    try:
        out[name] = fn(*args)
    except BaseException:  # noqa: BLE001 - recorded, reported by the test of that stage
        out[name] = {"error": traceback.format_exc()[-6000:]}
    out.setdefault("seconds", {})[name] = round(time.monotonic() - start, 1)


def transformers_logits(model_dir: Path, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(ids).logits


def model_ids(model_dir: Path) -> torch.Tensor:
    from tests.helpers.tiny_hf import input_ids

    return input_ids(vocab=json.loads((model_dir / "config.json").read_text())["vocab_size"])


def object_keys(ckpt: Path) -> list[str]:
    """The non-tensor entries (ShardedObjects: TE's `_extra_state`) of a dist checkpoint."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    import vapo_megatron.checkpoint.dist_io  # noqa: F401 - the restricted unpickling first

    meta = FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    return sorted(k for k, m in meta.items() if isinstance(m, BytesStorageMetadata))


FUSED_LINE = "[vapo] gradient_accumulation_fusion=True"  # mcore/models.py announces the fusion


@contextlib.contextmanager
def fusion(on: bool):
    """Ranks forked meanwhile (dist_utils.run_ranks passes this environment on) build their models
    with gradient_accumulation_fusion on or off."""
    from vapo_megatron.mcore.models import WGRAD_FUSION_ON_CPU

    before = os.environ.get(WGRAD_FUSION_ON_CPU)
    os.environ[WGRAD_FUSION_ON_CPU] = "1" if on else "0"
    try:
        yield
    finally:
        if before is None:
            del os.environ[WGRAD_FUSION_ON_CPU]
        else:
            os.environ[WGRAD_FUSION_ON_CPU] = before


def train(model: Path, data: Path, run_dir: Path, layout: list[str]) -> dict:
    """Two VAPO steps, wgrad fusion on; the engine's and the trainer's log-probs of every rollout
    (rollout/logprob_diff) agree only if the weights synced into the engine are the trainer's."""
    with fusion(True):
        run = train_in_forks("demo_cpu.yaml", *small_run_overrides(data, run_dir), f"model.hf_path={model}", *layout,
                             *SAVE_BOTH)
    vapo = [r for r in records(run_dir) if r["phase"] == "vapo"]
    return {"vapo": [{k: r[k]
                      for k in ("rollout/logprob_diff", "actor/pg_loss", "critic/value_loss", "actor/grad_norm")}
                     for r in vapo], "fused": FUSED_LINE in run.stdout,
            "extra_state": object_keys(run_dir / "checkpoints" / "iter_0000002" / "actor"), "tail": run.stdout[-2000:]}


def resume(model: Path, data: Path, full: Path, run_dir: Path, layout: list[str], fused: bool = True) -> dict:
    """The full run as it was after iteration 1, resumed (wgrad fusion on, or off: `fused`):
    iteration 2's checkpoints (weights and Adam moments of actor and critic) against the
    uninterrupted run's, tensor by tensor: the names of those not bitwise equal, and the largest
    difference of each relative to the largest magnitude of its tensor."""
    shutil.copytree(full, run_dir)
    shutil.rmtree(run_dir / "checkpoints" / "iter_0000002")
    (run_dir / "checkpoints" / "latest").write_text("iter_0000001\n")
    with fusion(fused):
        run = train_in_forks("demo_cpu.yaml", *small_run_overrides(data, run_dir), f"model.hf_path={model}", *layout,
                             *SAVE_BOTH)
    out = {"resumed": "resumed from" in run.stdout + run.stderr, "fused": FUSED_LINE in run.stdout, "differ": [],
           "relative": {}, "moments": 0}
    for role in ("actor", "critic"):
        want = checkpoint_tensors(full / "checkpoints" / "iter_0000002" / role)
        have = checkpoint_tensors(run_dir / "checkpoints" / "iter_0000002" / role)
        out["moments"] += sum("exp_avg" in k for k in want)
        for k in sorted(want.keys() | have.keys()):
            if k not in want or k not in have or not torch.equal(want[k], have[k]):
                out["differ"].append(f"{role} {k}")
                if k in want and k in have and want[k].shape == have[k].shape:
                    scale = want[k].double().abs().max().clamp(min=1e-30)
                    out["relative"][f"{role} {k}"] = float((want[k].double() - have[k].double()).abs().max() / scale)
    return out


def load_rank(tp: int, ep: int, model_dir: str, ckpts: dict, convert_to: str | None = None,
              export: tuple[str, str] | None = None) -> dict:
    """On each rank of a TP x EP layout: hf-to-mcore of model_dir into `convert_to` (when given),
    then every checkpoint of `ckpts` loaded into a freshly built model of this world and run
    forward; mcore-to-hf of export = (checkpoint, out) when given. Returns, on the rank that holds
    them, {name: full logits or the load's error, name + "/spec": the layer spec built}."""
    from megatron.core import parallel_state as ps

    from model_providers import read_hf_config
    from tests.helpers.megatron_ref import megatron_forward
    from vapo_megatron.checkpoint import dist_io
    from vapo_megatron.mcore import parallel
    from vapo_megatron.mcore.models import build_chunks
    from vapo_megatron.weights import convert

    parallel.init_distributed(tp, 1, ep=ep)
    hf_cfg = read_hf_config(model_dir)
    ids = model_ids(Path(model_dir))
    out = {}
    if convert_to:
        convert.hf_to_mcore(Path(model_dir), Path(convert_to), critic=False, tp=tp, pp=1, dtype=None)
    for name, ckpt in ckpts.items():
        try:
            chunks = build_chunks(hf_cfg, params_dtype=torch.float32, critic=False)
            dist_io.load_model(ckpt, chunks)
            out[name] = megatron_forward(chunks, ids, critic=False, vocab=hf_cfg["vocab_size"])
            out[name + "/spec"] = chunks[0].config.transformer_impl
        except Exception:  # noqa: BLE001 - a load that fails does so on every rank alike
            out[name] = traceback.format_exc()[-4000:]
    if export:
        convert.mcore_to_hf(Path(export[0]), Path(export[1]), tp=tp, pp=1)
    return out if ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0 else None


def conversions(kind: str, model: Path, work: Path, run: Path, tp: int, ep: int, extra: dict) -> dict:
    """hf-to-mcore in this world, then the TE model loaded from it, from the trainer's last
    checkpoint and from `extra` (checkpoints written in the local world), each forward against
    transformers' logits of the same weights; mcore-to-hf of the trainer's checkpoint against the
    trainer's own HF export, bitwise."""
    from tests.helpers.dist_utils import run_ranks

    trainer_ckpt = run / "checkpoints" / "iter_0000002" / "actor"
    exported = work / f"{kind}-trainer-hf"
    ckpts = {"converted_here": str(work / f"{kind}-te-converted"), "trainer": str(trainer_ckpt), **extra}
    (logits,) = [r for r in run_ranks(tp * ep, load_rank, tp, ep, str(model), ckpts, ckpts["converted_here"],
                                      (str(trainer_ckpt), str(exported)), timeout=900) if r is not None]
    ids = model_ids(model)
    want = {"trainer": transformers_logits(run / "hf", ids)}
    want.update({k: transformers_logits(model, ids) for k in ckpts if k != "trainer"})
    out = {k: (float((v - want[k]).abs().max()) if isinstance(v, torch.Tensor) else v) for k, v in logits.items()
           if not k.endswith("/spec")}
    out["specs"] = {k[:-5]: v for k, v in logits.items() if k.endswith("/spec")}
    mine, theirs = hf_weights(exported), hf_weights(run / "hf")
    out["export_differs"] = sorted(k for k in mine.keys() | theirs.keys()
                                   if k not in mine or k not in theirs or not torch.equal(mine[k], theirs[k]))
    return out


def evals(model: Path, data: Path, converted: Path, work: Path) -> dict:
    """vapo-eval on a checkpoint (hf-to-mcore's, written in the local world: the TE model loads
    it and syncs it into the engine) and on the HF model it came from: the same samples."""
    from tests.helpers.worlds import run_command

    samples = {}
    for name, source in (("checkpoint", converted), ("hf", model)):
        out = work / f"eval-{name}"
        code, stdout, stderr = run_command("vapo_megatron.eval", [
            "--model", str(source), "--data", str(data / "eval.jsonl"), "--out", str(out), "--n-samples", "2",
            "--reward", "exact", "--max-new-tokens", "6", "--max-prompt-tokens", "32", "--seed", "7"])
        if code != 0:
            return {"error": f"vapo-eval --model {source}: exit {code}\n{stdout[-2000:]}\n{stderr[-4000:]}"}
        samples[name] = sorted(p.name for p in out.iterdir()), [p.read_text() for p in sorted(out.glob("*.jsonl"))]
    return {"same": samples["checkpoint"] == samples["hf"], "files": samples["hf"][0]}


def plan(config: str, model: Path) -> dict:
    from tests.helpers.worlds import run_command

    code, stdout, stderr = run_command("vapo_megatron.plan", plan_args(config, model))
    return {"code": code, "stdout": stdout, "stderr": stderr[-3000:]}


def plan_args(config: str, model: Path) -> list[str]:
    return ["--config", config, "--nodes", "1", "--gpus-per-node", "2", "--gpu-memory-gib", "8", "--reserve-gib", "1",
            f"model.hf_path={model}", *MOE]


def drive(work: str, local_ckpts: dict) -> dict:
    """Everything the TE world runs, in order; `local_ckpts`: {"dense": ..., "moe": ...}
    checkpoints hf-to-mcore wrote in the local world."""
    w = Path(work)
    data, moe = w / "data", w / "moe-model"
    out: dict = {}
    stage(out, "dense_train", train, data / "model", data, w / "dense", DENSE)
    stage(out, "moe_train", train, moe, data, w / "moe", MOE)
    # The critic at its own layout (TP=1, DP=2) beside the TE actor at TP=2 with SP: TE's modules at both.
    stage(out, "dense_critic_layout", train, data / "model", data, w / "dense-critic", [*DENSE, "critic.parallel.tp=1"])
    stage(out, "dense_resume", resume, data / "model", data, w / "dense", w / "dense-resumed", DENSE)
    stage(out, "moe_resume", resume, moe, data, w / "moe", w / "moe-resumed", MOE)
    # The unfused reference: iteration 2 again from the fused run's iteration 1, without the fusion.
    stage(out, "dense_unfused", resume, data / "model", data, w / "dense", w / "dense-unfused", DENSE, False)
    stage(out, "moe_unfused", resume, moe, data, w / "moe", w / "moe-unfused", MOE, False)
    stage(out, "dense_convert", conversions, "dense", data / "model", w, w / "dense", 2, 1,
          {"local_converted": local_ckpts["dense"]})
    stage(out, "moe_convert", conversions, "moe", moe, w, w / "moe", 1, 1, {"local_converted": local_ckpts["moe"]})
    stage(out, "eval", evals, data / "model", data, Path(local_ckpts["dense"]), w)
    stage(out, "plan", plan, str(Path(__file__).resolve().parents[2] / "configs" / "demo_cpu.yaml"), moe)
    return out
