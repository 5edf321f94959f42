"""The one check of a parallel layout, for every command (vapo-train, vapo-eval, vapo-convert,
vapo-plan) and for the process-group start-up itself.

    layout_problems(world_size, tp, pp, vpp, model=hf_cfg)   -> list of messages ([] when it works)
    check_layout(world_size, tp, pp, vpp, model=hf_cfg)      -> Layout, or ConfigError listing them

Messages name the settings as the user wrote them: the config's keys (parallel.tp, ...) by
default, a command's flags (--tp, ...) with `keys=CLI_KEYS`. Pure Python.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from vapo_megatron.config.schema import ConfigError, problems_error


@dataclass(frozen=True)
class LayoutKeys:
    """How the user spells each setting, for the messages."""

    tp: str = "parallel.tp"
    pp: str = "parallel.pp"
    vpp: str = "parallel.vpp"
    ep: str = "parallel.ep"


CONFIG_KEYS = LayoutKeys()
CLI_KEYS = LayoutKeys(tp="--tp", pp="--pp", vpp="--vpp", ep="--ep")
CRITIC_KEYS = LayoutKeys(tp="critic.parallel.tp", pp="critic.parallel.pp", vpp="critic.parallel.vpp",
                         ep="critic.parallel.ep")


def critic_parallel(cfg):
    """The critic's layout (a ParallelConfig): critic.parallel when given, else the actor's."""
    return cfg.critic.parallel if cfg.critic.parallel is not None else cfg.parallel


def own_critic_layout(cfg) -> bool:
    """Whether the critic runs at a layout other than the actor's (critic.parallel given and different)."""
    return cfg.critic.parallel is not None and cfg.critic.parallel != cfg.parallel


@dataclass(frozen=True)
class Layout:
    world_size: int
    tp: int
    pp: int
    dp: int
    vpp: int | None = None
    # Expert parallelism (MoE): the routed experts are split over `ep` ranks of the data-parallel
    # dimension (megatron's expert_model_parallel_size; expert TP = TP), so ep divides dp.
    ep: int = 1


def launcher_env() -> tuple[int, int, int]:
    """(rank, world_size, local_rank) from torchrun, else Slurm, else a single process.

    Inside torchrun every worker sees the same SLURM_PROCID, so torchrun's variables win.
    """
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0))
    if "SLURM_PROCID" in os.environ and "SLURM_NTASKS" in os.environ:
        return (
            int(os.environ["SLURM_PROCID"]),
            int(os.environ["SLURM_NTASKS"]),
            int(os.environ.get("SLURM_LOCALID", 0)),
        )
    return 0, 1, 0


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def allowed(values: list[int]) -> str:
    return ", ".join(map(str, values[:12])) + (", ..." if len(values) > 12 else "")


def layout_problems(world_size: int | None, tp: int, pp: int, vpp: int | None = None, *, model: dict | None = None,
                    model_key: str = "model.hf_path", keys: LayoutKeys = CONFIG_KEYS, ep: int = 1) -> list[str]:
    """Every reason the layout cannot work. world_size None: the values alone (no launch known).
    `model`: an HF config dict (model_providers.read_hf_config; its path under `_source`) whose
    heads, FFN widths, layers and experts must split over TP, the pipeline stages and EP."""
    from model_providers.table import query_groups

    out: list[str] = []
    if ep < 1:
        out.append(f"{keys.ep}={ep} must be >= 1")
    if tp < 1:
        out.append(f"{keys.tp}={tp} must be >= 1")
    if pp < 1:
        out.append(f"{keys.pp}={pp} must be >= 1")
    if vpp is not None and (vpp < 1 or pp < 2):
        out.append(f"{keys.vpp}={vpp} must be null, or >= 1 with {keys.pp} >= 2 ({keys.pp}={pp})")
    if out:
        return out
    if world_size is not None:
        if world_size < 1:
            out.append(f"world size {world_size} (ranks launched) must be >= 1")
        elif world_size % (tp * pp):
            out.append(f"{keys.tp} * {keys.pp} = {tp} * {pp} = {tp * pp} does not divide the world size {world_size} "
                       f"(ranks launched); allowed {keys.tp} * {keys.pp}: {allowed(_divisors(world_size))}")
        elif (world_size // (tp * pp)) % ep:
            dp = world_size // (tp * pp)
            out.append(f"{keys.ep}={ep} does not divide the data-parallel size {dp} (world size {world_size} / "
                       f"({keys.tp} * {keys.pp})); the experts are split over data-parallel ranks; "
                       f"allowed {keys.ep}: {allowed(_divisors(dp))}")
    if model is not None:
        src = model["_source"] if "_source" in model else "config.json"
        experts = _experts(model)
        sizes = [("num_attention_heads", model["num_attention_heads"]), ("num_key_value_heads", query_groups(model)),
                 ("intermediate_size", model["intermediate_size"])]
        if experts is not None:
            sizes.append(("moe_intermediate_size", model["moe_intermediate_size"]))
            if experts % ep:
                out.append(f"{keys.ep}={ep} does not divide the {experts} experts of {model_key} ({src}); "
                           f"allowed {keys.ep}: {allowed(_divisors(experts))}")
        elif ep > 1:
            out.append(f"{keys.ep}={ep} needs a mixture-of-experts model; {model_key} ({src}) is dense "
                       f"(set {keys.ep}=1)")
        for name, n in sizes:
            if n % tp:
                out.append(f"{keys.tp}={tp} does not divide {name}={n} of {model_key} ({src}); "
                           f"allowed {keys.tp}: {allowed(_divisors(n))}")
        stages, layers = pp * (vpp or 1), model["num_hidden_layers"]
        if layers % stages:
            what = f"{keys.pp} * {keys.vpp} = {pp} * {vpp}" if vpp else f"{keys.pp}={pp}"
            out.append(f"{what} does not divide num_hidden_layers={layers} of {model_key} ({src}); "
                       f"allowed {f'{keys.pp} * {keys.vpp}' if vpp else keys.pp}: {allowed(_divisors(layers))}")
    return out


def _experts(model: dict) -> int | None:
    # Routed experts of an HF config (Hub configs: num_experts; transformers 5: num_local_experts).
    for key in ("num_experts", "num_local_experts"):
        if key in model and isinstance(model[key], int) and model[key] > 0:
            return model[key]
    return None


def check_layout(world_size: int, tp: int, pp: int, vpp: int | None = None, *, model: dict | None = None,
                 model_key: str = "model.hf_path", keys: LayoutKeys = CONFIG_KEYS, ep: int = 1) -> Layout:
    """The layout with DP derived (world_size / (tp * pp)); ConfigError listing every problem."""
    problems = layout_problems(world_size, tp, pp, vpp, model=model, model_key=model_key, keys=keys, ep=ep)
    if problems:
        raise problems_error(problems)
    return Layout(world_size=world_size, tp=tp, pp=pp, dp=world_size // (tp * pp), vpp=vpp, ep=ep)




def _is_moe(hf_cfg: dict) -> bool:
    return any(k in hf_cfg and hf_cfg[k] for k in ("num_experts", "num_local_experts"))


def critic_layout_problems(cfg, world_size: int | None, critic_hf: dict | None, critic_key: str) -> list[str]:
    """critic.parallel's problems, each naming its key, when the critic has a layout of its own
    (nothing otherwise: the actor's layout checks cover it). `critic_hf`: the critic's model's HF
    config (its own, or the policy's when it starts from the policy's trunk; None: not readable,
    reported elsewhere), `critic_key` the setting it came from. The layout must split the world
    and the critic's heads, layers and experts (layout_problems at CRITIC_KEYS); a MoE critic at
    TP > 1 needs sequence parallelism; and every mini-batch must give each of the critic's DP
    ranks a row (its rows are dealt over the critic's DP ranks, mcore/critic_share.py)."""
    if not own_critic_layout(cfg):
        return []
    c = cfg.critic.parallel
    out = layout_problems(world_size, c.tp, c.pp, c.vpp, model=critic_hf, model_key=critic_key, keys=CRITIC_KEYS,
                          ep=c.ep)
    if critic_hf is not None and _is_moe(critic_hf) and c.tp > 1 and not c.sequence_parallel:
        out.append(f"critic.parallel.sequence_parallel=false with critic.parallel.tp={c.tp}: {critic_key} "
                   f"({critic_hf['_source']}) is a mixture-of-experts model, which megatron-core trains at TP > 1 "
                   "only with sequence parallelism (set critic.parallel.sequence_parallel=true)")
    if out or world_size is None:
        return out
    dp = world_size // (c.tp * c.pp)
    r, a = cfg.rollout, cfg.algo
    rows = r.prompts_per_step * r.n_samples // max(a.mini_batches, 1)
    if rows < dp:
        out.append(f"critic.parallel: its data-parallel size {dp} (world size {world_size} / (critic.parallel.tp * "
                   f"critic.parallel.pp)) exceeds the {rows} responses of a mini-batch (rollout.prompts_per_step * "
                   "rollout.n_samples / algo.mini_batches): each of the critic's DP ranks needs one; raise "
                   "critic.parallel.tp or critic.parallel.pp")
    return out


__all__ = ["CLI_KEYS", "CONFIG_KEYS", "CRITIC_KEYS", "ConfigError", "Layout", "LayoutKeys", "check_layout",
           "critic_layout_problems", "critic_parallel", "launcher_env", "layout_problems",
           "own_critic_layout"]
