"""One row of a family's declarative HF <-> Megatron name table (pure Python, no torch).

A `Row` says: the Megatron parameter `mcore` is made from the HF tensors `hf` by `layout`.
Names may hold `{layer}` (the GLOBAL layer number, 0-based, as in HF's `model.layers.{layer}`) and,
for a routed expert's weights, `{expert}` (the GLOBAL expert number, as in HF's
`mlp.experts.{expert}`); weights/params.py binds `{expert}` per parameter (`for_expert`), because
an expert-parallel rank holds experts ep_rank * E/EP ... under the local numbers 0 ...
The layouts and the tensor transforms behind them are in layouts.py. Checkpoint conversion
(vapo_megatron/weights) and weight sync (vapo_megatron/rollout/weight_sync.py) both read the
same table, so a weight cannot be converted one way and synced another.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# copy: one HF tensor; qkv: q/k/v -> fused linear_qkv; gate_up: gate/up -> fused linear_fc1;
# vocab: embedding / LM-head rows with Megatron's vocabulary padding (layouts.py has the details).
LAYOUTS = ("copy", "qkv", "gate_up", "vocab")
_HF_NAMES = {"copy": 1, "vocab": 1, "qkv": 3, "gate_up": 2}


@dataclass(frozen=True)
class Row:
    mcore: str
    hf: tuple[str, ...]
    layout: str
    # A row bound to one global expert (for_expert): the expert, and the row it was made from.
    expert: int | None = None
    template: "Row | None" = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        if self.layout not in LAYOUTS:
            raise ValueError(f"mapping row {self.mcore!r}: unknown layout {self.layout!r}; known: {LAYOUTS}")
        want = _HF_NAMES[self.layout]
        if len(self.hf) != want:
            raise ValueError(f"mapping row {self.mcore!r}: layout {self.layout!r} takes {want} HF names, got {self.hf}")

    def has_layer(self) -> bool:
        return "{layer}" in self.mcore

    def has_expert(self) -> bool:
        return "{expert}" in self.mcore

    def for_expert(self, expert: int) -> "Row":
        """This row for one global expert (`{expert}` filled in; `{layer}` left for later). A bound
        row may be rebound to another expert."""
        base, e = self.template or self, str(expert)
        return Row(base.mcore.replace("{expert}", e), tuple(n.replace("{expert}", e) for n in base.hf), base.layout,
                   expert=expert, template=base)

    def mcore_name(self, layer: int | None = None) -> str:
        return self.mcore.format(layer=layer) if self.has_layer() else self.mcore

    def hf_names(self, layer: int | None = None) -> tuple[str, ...]:
        return tuple(n.format(layer=layer) for n in self.hf) if self.has_layer() else self.hf


# The critic's scalar value head <-> <Family>ForTokenClassification(num_labels=1).score; the same
# for every family (transformers' GenericForTokenClassification names it `score`).
CRITIC_ROWS = (
    Row("value_head.weight", ("score.weight",), "copy"),
    Row("value_head.bias", ("score.bias",), "copy"),
)

# Transformer Engine's layer spec fuses the pre-attention / pre-MLP norms into the next linear;
# the tables use megatron's local-spec names, and these aliases map TE names onto them.
TE_ALIASES = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
}


def head_dim(hf_cfg: dict) -> int:
    # Qwen3 configs state head_dim (it may differ from hidden/heads); Qwen2 configs omit it.
    if "head_dim" in hf_cfg and hf_cfg["head_dim"] is not None:
        return int(hf_cfg["head_dim"])
    return hf_cfg["hidden_size"] // hf_cfg["num_attention_heads"]


def query_groups(hf_cfg: dict) -> int:
    # num_key_value_heads (GQA); HF's default when a config omits it is one group per head.
    if "num_key_value_heads" in hf_cfg and hf_cfg["num_key_value_heads"] is not None:
        return int(hf_cfg["num_key_value_heads"])
    return hf_cfg["num_attention_heads"]


__all__ = ["CRITIC_ROWS", "LAYOUTS", "Row", "TE_ALIASES", "head_dim", "query_groups"]
