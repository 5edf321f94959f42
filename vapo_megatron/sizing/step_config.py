"""The step-time model's inputs from a run config (vapo-plan's --gpu options, vapo-train's deadline).
Pure Python: sizing/step_time.py has the model, docs/slurm.md "Step time and cost" its assumptions.
"""

from __future__ import annotations

import math
from dataclasses import replace

from vapo_megatron.config.engines import engine_of, engine_tp
from vapo_megatron.config.estimators import estimator_of
from vapo_megatron.config.layout import critic_parallel, own_critic_layout
from vapo_megatron.rollout.engines import record_of
from vapo_megatron.sizing.flops import shapes_from_hf
from vapo_megatron.sizing.hardware import GPU, GPUS, gpu_from_device_name
from vapo_megatron.sizing.step_time import Setup, checkpoint_save_s, estimate

DEFAULT_PROMPT_TOKENS = 200  # a math prompt with its instruction and chat template, tokens


def default_response_tokens(max_new_tokens: int) -> int:
    """A quarter of rollout.max_new_tokens (5,120 of the 32B configs' 20,480): responses grow
    during RL; rerun with the run's measured mean (response_length/mean) once it is known."""
    return max(1, max_new_tokens // 4)


def default_prompt_tokens(max_prompt_tokens: int) -> int:
    return min(DEFAULT_PROMPT_TOKENS, max_prompt_tokens)


def setup_from_config(cfg, actor_hf: dict, critic_hf: dict | None, *, world: int, gpus_per_node: int, gpu: GPU,
                      gpu_memory_gib: float | None = None, response_tokens: float | None = None,
                      prompt_tokens: float | None = None, kv_tokens: int | None = None,
                      offload_bytes_per_gpu: int | None = None, checkpoint_bytes: int | None = None,
                      storage_bytes_s: float = 1e9, eval_prompts: int | None = None) -> Setup:
    """A Setup from a run config (vapo_megatron/config Config) and the models' HF configs. vapo-plan
    passes its own kv_tokens, offload and checkpoint bytes (megatron's exact parameter counts);
    left None they are counted here from the shapes, by the same formulas (sizing/memory.py)."""
    from vapo_megatron.sizing.memory import GIB, state_bytes
    from vapo_megatron.sizing.memory import checkpoint_bytes as ckpt_bytes

    p, r, t, a = cfg.parallel, cfg.rollout, cfg.trainer, cfg.algo
    actor = shapes_from_hf(actor_hf)
    critic = shapes_from_hf(critic_hf or actor_hf) if estimator_of(cfg).needs_critic else None
    c = critic_parallel(cfg)  # the critic's layout: critic.parallel, else the actor's
    dtype_bytes = 2 if cfg.model.dtype == "bfloat16" else 4
    if kv_tokens is None:  # the engine's record: its KV cache on a GPU of this size (rollout/engines.py)
        kv_tokens = record_of(cfg).gpu_memory(cfg, gpu_bytes=int((gpu_memory_gib or gpu.memory_gib) * GIB),
                                              actor_params=actor.params(), actor_hf=actor_hf).kv_tokens
    models = [(actor.params(), cfg.actor_optim, p)] + ([(critic.params(critic=True), cfg.critic_optim, c)]
                                                         if critic else [])
    if offload_bytes_per_gpu is None:  # parameters + optimizer state; the gradient buffers are freed, not copied
        offload_bytes_per_gpu = 0
        if t.offload_during_rollout:
            for n, optim, m in models:  # each model at its own layout
                params, _, optimizer = state_bytes(n // (m.tp * m.pp), dtype_bytes=dtype_bytes,
                                                   dp=world // (m.tp * m.pp),
                                                   distributed_optimizer=optim.distributed_optimizer)
                offload_bytes_per_gpu += params + optimizer
    if checkpoint_bytes is None:
        checkpoint_bytes = ckpt_bytes(sum(n for n, _, _ in models), dtype_bytes=dtype_bytes)
    e = cfg.eval
    evals = (2 + (max(0, t.total_steps - 1) // e.every if e.every else 0)) if cfg.data.eval_files else 0
    eval_n = min(e.max_prompts, eval_prompts) if eval_prompts is not None else e.max_prompts
    return Setup(
        actor=actor, critic=critic, world=world, gpus_per_node=gpus_per_node, tp=p.tp, pp=p.pp, vpp=p.vpp, ep=p.ep,
        engine_tp=engine_tp(cfg) or 1, kv_tokens=kv_tokens, prompts=r.prompts_per_step,
        samples=r.prompts_per_step * r.n_samples,
        prompt_tokens=prompt_tokens if prompt_tokens is not None else default_prompt_tokens(cfg.data.max_prompt_tokens),
        response_tokens=response_tokens if response_tokens is not None else default_response_tokens(r.max_new_tokens),
        max_response_tokens=r.max_new_tokens, micro_batch_tokens=t.micro_batch_tokens, mini_batches=a.mini_batches,
        ppo_epochs=a.ppo_epochs, recompute=cfg.model.recompute_activations,
        distributed_optimizer=cfg.actor_optim.distributed_optimizer, offload_bytes_per_gpu=offload_bytes_per_gpu,
        checkpoint_bytes=checkpoint_bytes, save_every=t.save_every, storage_bytes_s=storage_bytes_s,
        bucket_bytes=r.weight_sync_bucket_mb << 20, value_pretrain_steps=a.value_pretrain_steps,
        total_steps=t.total_steps, evals=evals, eval_prompts=eval_n, eval_samples=e.n_samples,
        partial=r.partial.enabled, spare_batches=r.partial.spare_batches, max_staleness=r.partial.max_staleness,
        critic_layout=(c.tp, c.pp, c.vpp, c.ep) if critic is not None and own_critic_layout(cfg) else None)


def plan_setup(cfg, plan, actor_hf: dict, critic_hf: dict, *, gpus_per_node: int, gpu: GPU,
               response_tokens: float | None = None, prompt_tokens: float | None = None, storage_gb_s: float = 1.0,
               eval_prompts: int | None = None) -> Setup:
    """The Setup of `cfg` from its plan's own counts (sizing/plan.py: KV-cache tokens per engine,
    bytes offloaded per GPU, checkpoint bytes): what vapo-plan --gpu times, for one config and for
    every layout vapo-plan --search ranks."""
    return setup_from_config(
        cfg, actor_hf, critic_hf, world=plan.world_size, gpus_per_node=gpus_per_node, gpu=gpu,
        response_tokens=response_tokens, prompt_tokens=prompt_tokens, kv_tokens=plan.kv_tokens,
        offload_bytes_per_gpu=plan.host_per_gpu if plan.offload else 0, checkpoint_bytes=plan.checkpoint,
        storage_bytes_s=storage_gb_s * 1e9, eval_prompts=eval_prompts)


def predicted_step_and_save(cfg, actor_hf: dict, critic_hf: dict | None, *, world: int, gpus_per_node: int,
                            device_name: str, gpu_memory_gib: float | None = None) -> tuple[float, float]:
    """(one RL iteration, one checkpoint save) in seconds for vapo-train's deadline before it has
    measured either (trainer/deadline.py StepClock): this config at its defaults for what a
    config does not say (mean response rollout.max_new_tokens / 4, 1 GB/s to the file system).
    (0, 0) where the model has no rates: an unknown GPU, or an engine that is not colocated."""
    gpu = gpu_from_device_name(device_name)
    if gpu is None or not engine_of(cfg).colocated:
        return 0.0, 0.0
    setup = setup_from_config(cfg, actor_hf, critic_hf, world=world, gpus_per_node=gpus_per_node, gpu=gpu,
                              gpu_memory_gib=gpu_memory_gib)
    return estimate(gpu, setup).step_s, checkpoint_save_s(gpu, setup)


def without_critic_delta(gpu: GPU, setup: Setup) -> float:
    """What a critic adds to a step of `setup` (algo.estimator=grpo): the same setup with one, the
    actor's trunk as its model, minus this one. Its extra state in offload and checkpoints is left out."""
    with_critic = replace(setup, critic=setup.actor)
    return estimate(gpu, with_critic).step_s - estimate(gpu, setup).step_s


def option_problems(*, gpu: str | None, response_tokens: float | None, prompt_tokens: float | None,
                    storage_gb_s: float, eval_prompts: int | None, max_new_tokens: int,
                    max_prompt_tokens: int) -> list[str]:
    """vapo-plan's time options against each other and the config: one message per bad value, naming it."""
    problems = []
    if gpu is not None and gpu not in GPUS:
        problems.append(f"--gpu={gpu} is not a GPU this model knows; known: {', '.join(GPUS)}")
    for option, value in (("--mean-response-tokens", response_tokens), ("--mean-prompt-tokens", prompt_tokens),
                          ("--storage-gb-per-s", storage_gb_s), ("--eval-prompts", eval_prompts)):
        if value is not None and not (math.isfinite(value) and value > 0):  # nan and inf too
            problems.append(f"{option}={value:g} must be a finite number > 0")
    if response_tokens is not None and math.isfinite(response_tokens) and response_tokens > max_new_tokens:
        problems.append(f"--mean-response-tokens={response_tokens:g} is more than "
                        f"rollout.max_new_tokens={max_new_tokens}: a mean cannot exceed the longest response")
    if prompt_tokens is not None and math.isfinite(prompt_tokens) and prompt_tokens > max_prompt_tokens:
        problems.append(f"--mean-prompt-tokens={prompt_tokens:g} is more than "
                        f"data.max_prompt_tokens={max_prompt_tokens}")
    return problems


__all__ = ["default_prompt_tokens", "default_response_tokens", "option_problems", "plan_setup",
           "predicted_step_and_save", "setup_from_config", "without_critic_delta"]


def predict_on_this_gpu(cfg, actor_hf: dict, critic_hf: dict | None, world: int) -> tuple[float, float, str] | None:
    """(step s, save s, GPU name) of predicted_step_and_save on this process's GPU, for the trainer's
    deadline (trainer.Planner's predict); None without CUDA."""
    import os

    import torch

    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    step_s, save_s = predicted_step_and_save(
        cfg, actor_hf, critic_hf, world=world, device_name=props.name,
        gpus_per_node=int(os.environ.get("LOCAL_WORLD_SIZE") or torch.cuda.device_count()),
        gpu_memory_gib=props.total_memory / 2**30)
    return step_s, save_s, props.name
