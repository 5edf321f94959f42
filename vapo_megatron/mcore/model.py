"""A trained model: megatron chunks wrapped in DDP, its optimizer and LR schedule, its HF identity.

    build_model(cfg, critic=False)     actor from model.hf_path; critic from model.critic_hf_path
                                       or the policy's trunk with a fresh value head (component 1)
    copy_trunk(actor, critic)          the critic starts from the (warm-started) policy's trunk

This file says how parallelism is applied to a model: megatron builds each rank's shard for the
layout mcore/parallel.py initialized (models.py), the HF weights are cut to that shard
(weights/hf_read.py), DDP wraps each chunk and the schedule hooks go into its TransformerConfig.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from model_providers import Family, family_for, read_hf_config
from vapo_megatron.config import Config
from vapo_megatron.config.critic_start import critic_start
from vapo_megatron.config.layout import check_layout, critic_parallel
from vapo_megatron.data.routes import replays
from vapo_megatron.mcore import parallel
from vapo_megatron.mcore.dtypes import torch_dtype
from vapo_megatron.mcore.models import build_chunks
from vapo_megatron.mcore.optimizer import build_lr_scheduler, build_optimizer
from vapo_megatron.mcore.routing_replay import RouteReplay


@dataclass
class TrainModel:
    """One Megatron model (DDP-wrapped chunks) with its optimizer, LR schedule and HF identity."""

    chunks: list               # DDP-wrapped, one per virtual pipeline stage
    optimizer: object          # megatron's (a ChainedOptimizer holds several)
    scheduler: object | None   # megatron's OptimizerParamScheduler (None: a constant lr)
    family: Family
    hf_cfg: dict
    hf_dir: Path               # where it came from: config, tokenizer and generation files for exports
    critic: bool
    dtype: str                 # model.dtype
    consecutive_skips: int = 0  # optimizer steps skipped in a row (non-finite loss or gradient)
    replay: object | None = None  # the actor's RouteReplay with rollout.routing_replay (routing_replay.py)

    @property
    def modules(self) -> list:
        """The chunks without their DDP wrappers."""
        return [c.module for c in self.chunks]

    @property
    def config(self):
        """megatron's TransformerConfig (shared by the chunks)."""
        return self.modules[0].config

    @property
    def layout(self):
        """`with model.layout:` runs its block at this model's layout (mcore/parallel.py roles)."""
        return parallel.role("critic" if self.critic else "actor")

    @property
    def vocab_size(self) -> int:
        """The real (unpadded) vocabulary."""
        return self.hf_cfg["vocab_size"]


def wrap_ddp(model_chunks: list, *, distributed_optimizer: bool) -> list:
    """Megatron DDP around each chunk, and the schedule hooks that go with it."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

    tcfg = model_chunks[0].config
    # Per-token loss mode: DDP and the schedule leave the loss scaling to us, which is what makes
    # the normalization exactly global (schedule.py, docs/normalization.md). DDP reads it when it
    # is built, so it is set first; with the training schedule's other fields (below), it is set
    # where that schedule is assembled, as Megatron-LM does.
    tcfg.calculate_per_token_loss = True
    from megatron.core.transformer.moe.router import Router

    for chunk in model_chunks:  # MoE routers copied the flag at construction (aux-loss weighting)
        for module in chunk.modules():
            if isinstance(module, Router):
                module.calculate_per_token_loss = True
    ddp_cfg = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=distributed_optimizer,
    )
    wrapped = [
        DistributedDataParallel(config=tcfg, ddp_config=ddp_cfg, module=chunk) for chunk in model_chunks
    ]
    for chunk in wrapped:
        chunk.broadcast_params()  # identical replicas across DP before the first step
    # Gradient scaling by the global token count over DP, no DDP sync before the last micro-batch,
    # and shapes sent with each micro-batch (they are packed by token budget and differ; set here,
    # not at construction, where megatron refuses it beside its default MoE dispatcher).
    tcfg.finalize_model_grads_func = finalize_model_grads
    tcfg.no_sync_func = [c.no_sync for c in wrapped] if len(wrapped) > 1 else wrapped[0].no_sync
    tcfg.variable_seq_lengths = True
    return wrapped


def planned_updates(cfg: Config, *, critic: bool) -> int:
    """Optimizer updates of a model over the whole run: the critic also trains while value
    pretraining (component 1), the actor only in the RL steps."""
    per_step = cfg.algo.ppo_epochs * cfg.algo.mini_batches
    steps = cfg.trainer.total_steps + (cfg.algo.value_pretrain_steps if critic else 0)
    return max(steps * per_step, 1)


def build_model(cfg: Config, *, critic: bool) -> TrainModel:
    """Collective. The actor from model.hf_path; the critic from model.critic_hf_path, or from
    model.hf_path's trunk with a fresh value head (VAPO component 1 then trains head and trunk)."""
    from vapo_megatron.weights.hf_read import load_hf_weights

    start = critic_start(cfg) if critic else None
    from_megatron = start is not None and start.megatron  # critic.warm_start: a Megatron critic checkpoint
    hf_dir = start.config_dir if critic else Path(cfg.model.hf_path)
    hf_cfg = read_hf_config(hf_dir)
    p = critic_parallel(cfg) if critic else cfg.parallel  # built inside `with parallel.role(...)` of that layout
    check_layout(parallel.launcher_env()[1], p.tp, p.pp, p.vpp, model=hf_cfg, ep=p.ep)  # start-up checked it; cheap
    family = family_for(hf_cfg)
    dtype = torch_dtype(cfg.model.dtype)
    chunks = build_chunks(hf_cfg, params_dtype=dtype, critic=critic, recompute=cfg.model.recompute_activations,
                          sequence_parallel=p.sequence_parallel, moe_aux_loss_coeff=cfg.model.moe_aux_loss_coeff,
                          deterministic=cfg.trainer.deterministic)
    if not from_megatron:  # else the trainer loads the checkpoint into the built model (trainer/warm_start.py)
        fresh = load_hf_weights(chunks, family, hf_cfg, hf_dir, critic=critic)
        if critic and cfg.critic.warm_start and fresh:  # the start-up checks refuse it first; a guard
            raise RuntimeError(f"critic.warm_start={cfg.critic.warm_start} lacks {fresh}: not a value model")
    optim = cfg.critic_optim if critic else cfg.actor_optim
    chunks = wrap_ddp(chunks, distributed_optimizer=optim.distributed_optimizer)
    optimizer = build_optimizer(chunks, optim, params_dtype=dtype)
    scheduler = build_lr_scheduler(optimizer, optim, planned_updates=planned_updates(cfg, critic=critic))
    # Routing replay: the actor's routers take the engine's routes; the critic routes by itself.
    replay = RouteReplay(chunks, hf_cfg) if not critic and replays(cfg, hf_cfg) else None
    return TrainModel(chunks=chunks, optimizer=optimizer, scheduler=scheduler, family=family, hf_cfg=hf_cfg,
                      hf_dir=hf_dir, critic=critic, dtype=cfg.model.dtype, replay=replay)


@torch.no_grad()
def copy_trunk(actor: TrainModel, critic: TrainModel) -> int:
    """Copy the actor's trunk (every parameter but the LM head) into the critic, keeping the
    critic's value head: component 1, "the critic starts from the policy's trunk with a fresh
    scalar value head" (docs/algorithm.md). Used after the warm start, whose policy is the RL
    starting point. Same layout on both models, so each rank copies its own shards. Returns the
    number of tensors copied."""
    copied = 0
    for a_chunk, c_chunk in zip(actor.modules, critic.modules):
        a_params = dict(a_chunk.named_parameters())
        for name, param in c_chunk.named_parameters():
            if name.startswith("value_head"):
                continue
            if name not in a_params or a_params[name].shape != param.shape:
                raise RuntimeError(f"critic parameter {name} {tuple(param.shape)} has no counterpart in the actor")
            param.copy_(a_params[name])
            copied += 1
    for model in (actor, critic):  # the optimizers' own (fp32 main) copies follow the weights
        model.optimizer.reload_model_params()
    return copied


__all__ = ["TrainModel", "build_model", "copy_trunk", "planned_updates", "wrap_ddp"]
