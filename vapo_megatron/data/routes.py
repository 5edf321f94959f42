"""Routing replay's data (R3): the experts a rollout engine routed each token to, per MoE layer.

A mixture-of-experts model sends each token through the top-k experts its router picks. The engine
and the trainer compute the router in different kernels (and dtypes), so for a token whose router
scores are nearly tied they can pick different experts: the PPO ratio then compares two networks.
With rollout.routing_replay the engine returns its choice and the trainer's routers take it
(mcore/routing_replay.py).

Routes of one response: int [prompt + response - 1, moe_layers, k], row p the experts of the token
at sequence position p: every prompt token and every response token but the last, which the engine
never runs through the model (SGLang 0.5.23 returns the same rows: scheduler_components/
batch_result_processor.py, _maybe_collect_routed_experts: `[start_len, seqlen - 1)`). The ids are
stored in the smallest integer type that holds num_experts - 1 (one byte for up to 256 experts).

    route_shape(hf_cfg)          (moe_layers, top-k, experts), None for a dense model
    replays(cfg, hf_cfg)         rollout.routing_replay resolved: null is on for a MoE model
    pack_routes(rows, width, k)  a batch's [B, width, moe_layers, k]; positions without a route
                                 (the last token, padding) hold placeholders 0..k-1
    filler_experts(tokens, k, E) the experts the trainer gives positions without a route: spread
    replay_routes(...)           a micro-batch's routes as its routers take them, host side
    sglang_routes(...)           meta_info["routed_experts"] of an SGLang answer as a tensor
    RouteRecorder                forward hooks on a transformers Qwen3-MoE's routers (embedded engine)
"""

from __future__ import annotations

import base64

import numpy as np
import torch


def moe_layers(hf_cfg: dict) -> list[int]:
    """The (0-based) layers with routed experts, in order; [] for a dense model. Routes keep one
    column per MoE layer, in this order (megatron's moe_layer_freq: a per-layer list, or every n-th)."""
    from model_providers import family_for

    arch = family_for(hf_cfg).architecture(hf_cfg)
    if not arch.num_experts:
        return []
    t = arch.transformer
    freq = t["moe_layer_freq"] if "moe_layer_freq" in t else 1
    pattern = freq if isinstance(freq, list) else [int(i % freq == 0) for i in range(t["num_layers"])]
    return [i for i, moe in enumerate(pattern) if moe]


def route_shape(hf_cfg: dict) -> tuple[int, int, int] | None:
    """(MoE layers, experts per token, experts) of a model's config.json; None for a dense model."""
    from model_providers import family_for

    layers = moe_layers(hf_cfg)
    if not layers:
        return None
    arch = family_for(hf_cfg).architecture(hf_cfg)
    return len(layers), arch.transformer["moe_router_topk"], arch.num_experts


def replays(cfg, hf_cfg: dict) -> bool:
    """Whether the run replays the engine's routes: rollout.routing_replay, where null means
    "yes for a mixture-of-experts model" (a dense model with true is refused at start-up)."""
    setting = cfg.rollout.routing_replay
    return route_shape(hf_cfg) is not None if setting is None else bool(setting)


def id_dtype(num_experts: int) -> torch.dtype:
    """The smallest integer dtype holding expert ids 0..num_experts - 1."""
    if num_experts <= 256:
        return torch.uint8
    return torch.int16 if num_experts <= 1 << 15 else torch.int32


def pack_routes(rows: list[torch.Tensor], width: int, k: int) -> torch.Tensor:
    """[B, width, L, k] from each sequence's routes [n_b, L, k] (n_b <= width), at their sequence
    positions. Positions without a route (the sequence's last token and the right padding, whose
    outputs no kept position reads: causal attention) hold the placeholders 0..k-1; the routers
    never take them (replay_routes gives those positions filler_experts)."""
    layers, dtype = rows[0].shape[1], rows[0].dtype
    out = torch.arange(k, dtype=dtype).expand(len(rows), width, layers, k).clone()
    for b, r in enumerate(rows):
        out[b, : r.shape[0]] = r[:width]
    return out


def filler_experts(tokens: int, k: int, num_experts: int) -> torch.Tensor:
    """int64 [tokens, k]: the experts of a micro-batch's positions without a route, numbered c = 0,
    1, ... in the order the router sees them: experts (c * k + j) mod E, j < k. A token's k experts
    are distinct (k <= E) and consecutive ones take consecutive blocks, so the padding spreads
    evenly over the experts, and so over the EP ranks, which hold contiguous blocks of E / EP
    experts (megatron-core 0.19.2 transformer/moe/moe_layer.py ~187-195, local_expert_indices).
    Experts 0..k-1 for every such position sent all of it to the first EP rank."""
    c = torch.arange(tokens).unsqueeze(1)
    return (c * k + torch.arange(k)) % num_experts


def replay_routes(routes: torch.Tensor, seq_lens: torch.Tensor, width: int, num_experts: int, *,
                  part: tuple[int, int] | None = None) -> torch.Tensor:
    """[L, T, k] contiguous, routes' dtype: a micro-batch's routes [b, R, L, k] (R <= width) as its
    routers take them, layer by layer, in megatron's token order (a MoE layer routes its hidden
    states [S, b, h] flattened sequence-major: token s * b + i). Positions without a route (s >=
    seq_len - 1: the last token and the padding up to `width`) get filler_experts, numbered in that
    order: a function of the micro-batch alone, so a forward and its recomputation route alike.
    `part` = (start, length): only those sequence positions (this TP rank's under sequence
    parallelism), T = length * b; else T = width * b. Host-side work, so that the device gets one
    copy."""
    b, R, L, k = routes.shape
    assert R <= width, (R, width)
    seq = torch.zeros(width, b, L, k, dtype=routes.dtype)
    seq[:R] = routes.transpose(0, 1)
    unrouted = torch.arange(width).unsqueeze(1) >= (seq_lens - 1).unsqueeze(0)  # [S, b]
    seq[unrouted] = filler_experts(int(unrouted.sum()), k, num_experts).to(routes.dtype).unsqueeze(1)
    if part is not None:
        seq = seq[part[0]: part[0] + part[1]]
    return seq.permute(2, 0, 1, 3).reshape(L, -1, k).contiguous()


def routed_positions(prompt_lens: torch.Tensor, response_lens: torch.Tensor, width: int) -> torch.Tensor:
    """[B, width] float: the response tokens the engine ran through the model (and routed): every
    response token but the last, at positions P .. P + R - 2."""
    pos = torch.arange(width).unsqueeze(0)
    start = prompt_lens.unsqueeze(1)
    return ((pos >= start) & (pos < start + response_lens.unsqueeze(1) - 1)).float()


def sglang_routes(encoded: str, *, rows: int, layers: int, k: int, num_experts: int, where: str) -> torch.Tensor:
    """SGLang's meta_info["routed_experts"]: base64 of int32 [rows, layers, k] (tokenizer_manager.py
    encodes the capturer's host buffer; state_capturer/routed_experts.py, extract_routed_experts_
    from_meta_info, decodes it the same way) as a compact tensor. A shape or an id that does not
    fit says so, naming `where`."""
    flat = np.frombuffer(base64.b64decode(encoded), dtype=np.int32)
    if flat.size != rows * layers * k:
        raise RuntimeError(f"{where}: SGLang returned {flat.size} routed-expert ids, expected {rows} tokens x "
                           f"{layers} MoE layers x top-{k} = {rows * layers * k}")
    ids = torch.from_numpy(flat.copy()).view(rows, layers, k)
    if rows and (int(ids.min()) < 0 or int(ids.max()) >= num_experts):
        raise RuntimeError(f"{where}: SGLang returned expert ids outside 0..{num_experts - 1}")
    return ids.to(id_dtype(num_experts))


class RouteRecorder:
    """The top-k expert ids transformers' Qwen3-MoE routers pick, per model call: a forward hook on
    every Qwen3MoeTopKRouter (its forward returns logits, weights, indices [tokens, k]). Off until
    `recording`; take() stacks one call's layers into [tokens, moe_layers, k]."""

    def __init__(self, model: torch.nn.Module, num_experts: int):
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

        self.routers = [m for m in model.modules() if isinstance(m, Qwen3MoeTopKRouter)]
        self.dtype = id_dtype(num_experts)
        self.recording = False
        self.calls: list[torch.Tensor] = []
        for router in self.routers:
            router.register_forward_hook(self._hook)

    def _hook(self, module, args, output) -> None:
        if self.recording:
            self.calls.append(output[2].detach().to(device="cpu", dtype=self.dtype))

    def take(self, batch: int, tokens: int) -> torch.Tensor:
        """This call's routes as [batch, tokens, moe_layers, k] (the model's input was [batch, tokens])."""
        if len(self.calls) != len(self.routers):
            raise RuntimeError(f"{len(self.calls)} router calls recorded for {len(self.routers)} MoE layers")
        out = torch.stack(self.calls, dim=1)  # [batch * tokens, layers, k]
        self.calls = []
        return out.view(batch, tokens, *out.shape[1:])


__all__ = ["RouteRecorder", "filler_experts", "id_dtype", "moe_layers", "pack_routes", "replay_routes", "replays",
           "route_shape", "routed_positions", "sglang_routes"]
