"""Every pipeline layout's shards from a few meta-device builds per (TP, EP): vapo-plan --search's counts.

shards.py builds every stage of ONE layout on the meta device (vapo-plan for one config). A search
over hundreds of layouts cannot: each stage costs one start-up of megatron's parallel state in a
fake process group of the whole world (0.3 s at 512 ranks) and a build of its layers (6 ms per
Qwen2.5-32B layer, 0.3 s per Qwen3-30B-A3B layer with its 128 experts), so PP=64 alone takes over
a minute. Here each model is built in pieces, once per (TP, EP), with megatron's own builders
(mcore/models.py build_actor, build_critic) one model chunk at a time, in a layout that puts one
layer in each chunk (build_layout: PP=2 with VPP = layers / 2): the chunk of layer 0 (with the
embedding), the chunk of the last layer (with the final norm and the LM head or value head), and
one chunk for each other kind of layer (dense or with routed experts: the family's
moe_layer_freq, the pattern megatron picks each layer's spec from), so that every layer's counts
are a built layer's. A layout's stages are then put together with megatron's own placement
(get_transformer_layer_offset, get_num_layers_to_build, is_vp_first_stage / is_vp_last_stage) and
its own warm-up count (get_pp_rank_microbatches, asked about each pipeline rank).

What is derived, not built: a tied model's output layer. Megatron allocates it on the last stage
but not on a chunk that also holds the embedding (gpt_model.py: skip_weight_param_allocation=
pre_process and share_embeddings_and_output_weights), which happens at PP=1 only.
The suite checks every stage of several layouts (tied, MoE with a dense
layer, VPP, EP, TP) against shards.py's per-stage builds.

The shards come back one per pipeline stage, at tp_rank 0, with `*_unique` summed over the
stage's TP ranks: every TP rank of a stage holds the same parameter counts (shards.py), so
make_plan's per-rank memory and its sums (engine weights, checkpoint bytes) are the same as with
one position per (tp_rank, pp_rank).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from vapo_megatron.sizing.shards import ShardSize, global_rank, is_expert


@dataclass(frozen=True)
class Piece:
    """One part of a model's stage: parameters on each TP rank, the distinct ones counted on
    tp_rank 0 and on each other TP rank (shards.py's `unique`: routed experts x EP), the experts."""

    params: int = 0
    unique_first: int = 0
    unique_other: int = 0
    expert: int = 0

    def __add__(self, other: Piece) -> Piece:
        return Piece(self.params + other.params, self.unique_first + other.unique_first,
                     self.unique_other + other.unique_other, self.expert + other.expert)

    def __sub__(self, other: Piece) -> Piece:
        return Piece(self.params - other.params, self.unique_first - other.unique_first,
                     self.unique_other - other.unique_other, self.expert - other.expert)


@dataclass(frozen=True)
class ModelPieces:
    """One model at one (TP, EP): the pieces every layout's stages are made of."""

    embedding: Piece  # on the first chunk of pipeline rank 0
    layers: tuple  # Piece per global layer index
    last: Piece  # final norm + LM head (actor) or value head (critic), on the last chunk of the last rank
    tied_output: Piece  # of `last`: a tied LM head's weight, not allocated where the chunk holds the embedding
    config: object  # the TransformerConfig of the build: megatron's placement reads it


_PIECES: dict[tuple, ModelPieces] = {}


def layer_kinds(hf_cfg: dict) -> list[int]:
    """Per layer, which spec megatron builds it with: 1 with routed experts, 0 dense (the family's
    moe_layer_freq: a list, or every k-th layer for an int k, as megatron's block spec reads it)."""
    from model_providers import family_for

    layers = hf_cfg["num_hidden_layers"]
    freq = family_for(hf_cfg).architecture(hf_cfg).transformer.get("moe_layer_freq")
    if freq is None:
        return [0] * layers
    return list(freq) if isinstance(freq, list) else [int(i % freq == 0) for i in range(layers)]


def model_pieces(hf_cfg: dict, *, critic: bool, tp: int, ep: int, params_dtype: torch.dtype,
                 sequence_parallel: bool) -> ModelPieces:
    """The pieces of one model (the actor, or the critic: critic=True) at (TP, EP), built once per process."""
    key = (json.dumps(hf_cfg, sort_keys=True, default=str), critic, tp, ep, str(params_dtype), sequence_parallel)
    if key not in _PIECES:
        _PIECES[key] = _build(hf_cfg, critic, tp, ep, params_dtype, sequence_parallel)
    return _PIECES[key]


def _piece(params: list, tp: int, ep: int) -> Piece:
    # shards.py's counts: `unique` counts TP-sharded tensors on every TP rank, the rest on tp_rank 0.
    sharded = [(n, p) for n, p in params if getattr(p, "tensor_model_parallel", False)]
    return Piece(params=sum(p.numel() for _, p in params),
                 unique_first=sum(p.numel() * (ep if is_expert(n) else 1) for n, p in params),
                 unique_other=sum(p.numel() * (ep if is_expert(n) else 1) for n, p in sharded),
                 expert=sum(p.numel() for n, p in params if is_expert(n)))


def build_layout(layers: int) -> tuple[int, int | None]:
    """(PP, VPP) of the builds: one layer per model chunk, on as few ranks as megatron allows, since
    starting its parallel state costs time with the world's size: PP=2 with VPP = layers / 2 (layer
    i on pipeline rank i % 2, chunk i // 2, megatron's interleaved placement), or PP = layers
    (layer i alone on rank i) for an odd count or two layers."""
    if layers % 2 == 0 and layers >= 4:
        return 2, layers // 2
    return layers, None


def _build(hf_cfg: dict, critic: bool, tp: int, ep: int, params_dtype: torch.dtype, sp: bool) -> ModelPieces:
    from model_providers import family_for
    from vapo_megatron.mcore import parallel
    from vapo_megatron.mcore.models import build_actor, build_critic

    layers = hf_cfg["num_hidden_layers"]
    kinds = layer_kinds(hf_cfg)
    wanted = sorted({0, layers - 1} | {kinds.index(k) for k in set(kinds)})  # a layer of each kind, the first, the last
    pp, vpp = build_layout(layers)
    tied = family_for(hf_cfg).architecture(hf_cfg).tied_embeddings and not critic
    build = build_critic if critic else build_actor
    built, embedding, last, tied_output, config = {}, None, None, Piece(), None
    for rank in sorted({i % pp for i in wanted}):
        parallel.init_fake(tp * pp * ep, global_rank(0, rank, tp=tp, dp=ep), tp, pp, vpp, ep=ep)
        try:
            where = (parallel.tp_rank(), parallel.pp_rank(), parallel.ep_rank())
            if where != (0, rank, 0):
                raise RuntimeError(f"megatron placed pipeline rank {rank} of the build at (tp, pp, ep)={where}")
            for layer in (i for i in wanted if i % pp == rank):
                with torch.device("meta"):
                    chunk = build(hf_cfg, params_dtype=params_dtype, vp_stage=layer // pp if vpp else None,
                                  on_gpu=False, sequence_parallel=sp)
                config = chunk.config
                groups: dict[str, list] = {"embedding": [], "layer": [], "last": [], "tied": []}
                for name, p in chunk.named_parameters():
                    if name.startswith("embedding."):
                        groups["embedding"].append((name, p))
                    elif name.startswith("decoder.layers.0."):
                        groups["layer"].append((name, p))
                    elif name.startswith(("decoder.final_layernorm.", "output_layer.", "value_head.")):
                        groups["last"].append((name, p))
                        if tied and name.startswith("output_layer."):
                            groups["tied"].append((name, p))
                    else:
                        raise RuntimeError(f"a parameter this count does not place: {name} (layer {layer}'s chunk)")
                built[layer] = _piece(groups["layer"], tp, ep)
                if layer == 0:
                    embedding = _piece(groups["embedding"], tp, ep)
                if layer == layers - 1:
                    last, tied_output = _piece(groups["last"], tp, ep), _piece(groups["tied"], tp, ep)
                del chunk
        finally:
            parallel.destroy()
    by_kind = {kinds[i]: built[i] for i in wanted}
    pieces = tuple(built[i] if i in built else by_kind[kinds[i]] for i in range(layers))
    return ModelPieces(embedding, pieces, last, tied_output, config)


class _PipelineGroup:
    """The pipeline group's size and rank, as get_pp_rank_microbatches asks a p2p communicator's
    pp_group for them (megatron-core 0.19 schedules.py): the rank to ask about, no process group."""

    def __init__(self, size: int, rank: int):
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


def inflight_microbatches(pp: int, vpp: int | None, pp_rank: int, *, num_microbatches: int = 1024) -> int:
    """shards.peak_inflight_microbatches for pipeline rank `pp_rank` without initializing it:
    megatron's warm-up count (get_pp_rank_microbatches, same arguments) + the one in 1F1B."""
    if pp == 1:
        return 1
    from megatron.core.pipeline_parallel.schedules import get_pp_rank_microbatches

    p2p = SimpleNamespace(pp_group=_PipelineGroup(pp, pp_rank), virtual_pipeline_model_parallel_size=vpp)
    _, _, warmup, _ = get_pp_rank_microbatches(num_microbatches, vpp or 1, pp, forward_only=False, p2p_communicator=p2p)
    return warmup + 1


def stage_pieces(m: ModelPieces, *, pp: int, vpp: int | None) -> list[Piece]:
    """One Piece per pipeline rank: its chunks' layers by megatron's placement, the embedding on
    the first chunk of rank 0, the final norm and head on the last chunk of the last rank."""
    from megatron.core.pipeline_parallel.utils import is_vp_first_stage, is_vp_last_stage
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    config = dataclasses.replace(m.config, pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp)
    out = []
    for rank in range(pp):
        total = Piece()
        for v in range(vpp) if vpp else [None]:
            offset = get_transformer_layer_offset(config, vp_stage=v, pp_rank=rank)
            n = get_num_layers_to_build(config, vp_stage=v, pp_rank=rank)
            for layer in m.layers[offset:offset + n]:
                total += layer
            first, last = rank == 0 and is_vp_first_stage(v, vpp), rank == pp - 1 and is_vp_last_stage(v, vpp)
            if first:
                total += m.embedding
            if last:
                total += m.last - (m.tied_output if first else Piece())
        out.append(total)
    return out


def layout_shards(actor_hf: dict, critic_hf: dict | None, *, tp: int, pp: int, vpp: int | None, ep: int,
                  params_dtype: torch.dtype, sequence_parallel: bool) -> list[ShardSize]:
    """shard_sizes' counts for a layout, one position per pipeline stage (TP ranks folded: the
    module docstring). critic_hf None: no critic (its counts 0)."""
    kw = dict(tp=tp, ep=ep, params_dtype=params_dtype, sequence_parallel=sequence_parallel and tp > 1)
    actor = stage_pieces(model_pieces(actor_hf, critic=False, **kw), pp=pp, vpp=vpp)
    critic = (stage_pieces(model_pieces(critic_hf, critic=True, **kw), pp=pp, vpp=vpp) if critic_hf is not None
              else [Piece()] * pp)
    return [ShardSize(0, r, a.params, c.params, a.unique_first + (tp - 1) * a.unique_other,
                      c.unique_first + (tp - 1) * c.unique_other, inflight_microbatches(pp, vpp, r), a.expert, c.expert)
            for r, (a, c) in enumerate(zip(actor, critic))]


def critic_layout_shards(critic_hf: dict, *, tp: int, pp: int, vpp: int | None, ep: int, params_dtype: torch.dtype,
                         sequence_parallel: bool) -> list[ShardSize]:
    """shards.critic_shard_sizes' counts for a critic of its own layout, one position per stage (the
    actor's counts 0): what vapo-plan --search puts beside an actor layout's shards."""
    kw = dict(tp=tp, ep=ep, params_dtype=params_dtype, sequence_parallel=sequence_parallel and tp > 1)
    critic = stage_pieces(model_pieces(critic_hf, critic=True, **kw), pp=pp, vpp=vpp)
    return [ShardSize(0, r, 0, c.params, 0, c.unique_first + (tp - 1) * c.unique_other,
                      inflight_microbatches(pp, vpp, r), 0, c.expert) for r, c in enumerate(critic)]


__all__ = ["ModelPieces", "Piece", "critic_layout_shards", "inflight_microbatches", "layer_kinds", "layout_shards",
           "model_pieces", "stage_pieces"]
