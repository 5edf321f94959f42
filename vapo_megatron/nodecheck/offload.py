"""vapo-check's offload checks (trainer.offload_during_rollout, vapo_megatron/mcore/offload.py).

    offload         an actor (model dtype, fp32 main params under bf16; the distributed optimizer)
                    and a critic (the plain optimizer) built by the project's builders, one real
                    Adam step each, gradients left in DDP's buffers:
                    every storage of their state released while offloaded (untyped storage size 0),
                    and bitwise the same bytes after the onload, but the DDP gradient buffers: zeros
                    (freed without a copy)
    offload_memory  torch.cuda.memory_reserved before the offload, after it (cache emptied) and after
                    the onload, and the host<->device copy bandwidth each way (GPU only: SKIP on the CPU)

Each check returns (name, status, detail) lines; vapo_megatron/check.py prints them.
"""

from __future__ import annotations

import torch

MIB = 1 << 20


def _model(hf_cfg: dict, *, critic: bool, dtype: torch.dtype, distributed_optimizer: bool):
    from model_providers import family_for
    from vapo_megatron.config import OptimConfig
    from vapo_megatron.mcore.model import TrainModel, wrap_ddp
    from vapo_megatron.mcore.models import build_actor, build_critic
    from vapo_megatron.mcore.optimizer import build_optimizer, optimizer_step

    chunks = wrap_ddp([(build_critic if critic else build_actor)(hf_cfg, params_dtype=dtype)],
                      distributed_optimizer=distributed_optimizer)
    optimizer = build_optimizer(chunks, OptimConfig(lr=1e-3, distributed_optimizer=distributed_optimizer),
                                params_dtype=dtype)
    model = TrainModel(chunks=chunks, optimizer=optimizer, scheduler=None, family=family_for(hf_cfg), hf_cfg=hf_cfg,
                       hf_dir=None, critic=critic, dtype=str(dtype).removeprefix("torch."))
    device = next(chunks[0].parameters()).device
    for step in range(2):  # a step (Adam's moments exist), then live gradients in the buffers
        ids = torch.randint(0, hf_cfg["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(step)).to(device)
        chunks[0].zero_grad_buffer()
        chunks[0](ids, torch.arange(16, device=device).expand(2, 16), None).float().square().mean().backward()
        if step == 0:
            optimizer_step(optimizer, chunks, loss_finite=True)
    return model


def check_offload(cpu: bool, dtype: torch.dtype, preset_name: str) -> list[tuple[str, str, str]]:
    from model_providers.presets import preset
    from vapo_megatron.mcore.offload import Offloader, grad_buffer_storages, state_tensors

    hf_cfg = preset(preset_name)
    # The actor with megatron's distributed optimizer (its parameters are views of DDP's flat param
    # buffer, its fp32 main shards views of that buffer too), the critic with the plain one.
    models = [_model(hf_cfg, critic=False, dtype=dtype, distributed_optimizer=True),
              _model(hf_cfg, critic=True, dtype=dtype, distributed_optimizer=False)]
    tensors = [t for m in models for t in state_tensors(m)]
    device = tensors[0].device
    before = [t.detach().clone() for t in tensors]
    state = Offloader(models)
    if not cpu:
        torch.cuda.synchronize()
    reserved = [torch.cuda.memory_reserved() if not cpu else 0]
    state.offload()
    released = [t.untyped_storage().size() == 0 for t in tensors if t.device == device]
    reserved.append(torch.cuda.memory_reserved() if not cpu else 0)
    state.onload()
    reserved.append(torch.cuda.memory_reserved() if not cpu else 0)
    grads = grad_buffer_storages(models)
    same = all(not bool(b.any()) if b.untyped_storage().data_ptr() in grads else
               torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
               for a, b in zip(before, tensors))
    moved = state.last["offload"][0]
    freed_grads = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors
                       if t.untyped_storage().data_ptr() in grads}.values())  # dropped, not in `moved`
    out = [("offload", "PASS" if all(released) and same else "FAIL",
            f"{len(released)} state tensors of actor and critic ({moved / MIB:.1f} MiB, {dtype}) on {device.type}: "
            f"{sum(released)} with storage released while offloaded, "
            f"restored {'bitwise' if same else 'WITH DIFFERENCES'}")]
    if cpu:
        out.append(("offload_memory", "SKIP", "torch.cuda.memory_reserved and pinned copies are GPU measurements "
                                              f"({state.bandwidth_line()} on the CPU)"))
        return out
    freed = reserved[0] - reserved[1]
    ok = freed >= moved + freed_grads  # the whole state left the device (allocator blocks may round up)
    out.append(("offload_memory", "PASS" if ok else "FAIL",
                f"memory_reserved {reserved[0] / MIB:.0f} -> {reserved[1] / MIB:.0f} MiB offloaded (freed "
                f"{freed / MIB:.0f} of {moved / MIB:.0f} MiB moved + {freed_grads / MIB:.0f} MiB of gradient "
                f"buffers dropped) -> {reserved[2] / MIB:.0f} MiB onloaded; "
                + state.bandwidth_line()))
    return out


__all__ = ["check_offload"]
