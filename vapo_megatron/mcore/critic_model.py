"""The critic's model: the policy's trunk with a scalar value head in place of the LM head, and
that head's initial values (fresh_value_head; models.py builds the model)."""

from __future__ import annotations

import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.tensor_parallel import gather_from_sequence_parallel_region


def fresh_value_head(config) -> dict[str, torch.Tensor]:
    """The critic's initial value head {"weight": [1, H], "bias": [1]} (float32, CPU).

    Identical on every rank whatever the RNG state (TP replicas must agree); replaced when the HF
    checkpoint has a trained `score` head. vapo-convert, which builds the critic on the meta
    device, writes these values for a critic made from a causal LM."""
    gen = torch.Generator().manual_seed(0)
    return {"weight": torch.randn(1, config.hidden_size, generator=gen) * config.init_method_std,
            "bias": torch.zeros(1)}


class CriticModel(GPTModel):
    """The policy's trunk with a scalar value head in place of the LM head (last stage only).

    forward(input_ids, position_ids, attention_mask, ...) returns values [B, T] (float32) on the
    last pipeline stage and hidden states [T, B, H] elsewhere, as GPTModel does. The value head
    is a plain Linear(H, 1) replicated across TP: megatron's sharded_state_dict treats children
    that are not MegatronModules as TP-replicated tensors, so dist checkpointing and DDP include
    it like any layernorm. It maps to HF's <Family>ForTokenClassification(num_labels=1).score.
    The head's matmul runs in float32 on the trunk's output (_values).
    """

    def __init__(self, **kwargs):
        super().__init__(share_embeddings_and_output_weights=False, **kwargs)
        if self.post_process:
            del self.output_layer  # the vocab projection is not part of the critic
            self.output_layer = None
            cfg = self.config
            device = (torch.cuda.current_device() if torch.cuda.is_available() and not cfg.use_cpu_initialization
                      else None)
            self.value_head = torch.nn.Linear(cfg.hidden_size, 1, bias=True, device=device, dtype=cfg.params_dtype)
            if self.value_head.weight.device.type != "meta":
                with torch.no_grad():
                    for name, value in fresh_value_head(cfg).items():
                        getattr(self.value_head, name).copy_(value)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        # LanguageModule.sharded_state_dict flags the last stage's output_layer.weight for vocab
        # padding; the critic has none. Its children (value_head included) are unaffected.
        post_process, self.post_process = self.post_process, False
        try:
            return super().sharded_state_dict(prefix, sharded_offsets, metadata)
        finally:
            self.post_process = post_process

    def forward(self, input_ids, position_ids, attention_mask, **kwargs):
        return super().forward(input_ids, position_ids, attention_mask, output_processor=self._values, **kwargs)

    def _values(self, *, hidden_states, **_unused):
        # hidden_states [T(/TP with sequence parallel), B, H] -> values [B, T]
        if self.config.sequence_parallel:
            # The value head is replicated over TP: every rank's gradient w.r.t. the gathered
            # states is already whole, so the backward keeps this rank's slice
            # (tensor_parallel_output_grad=False) instead of summing TP copies (reduce-scatter).
            hidden_states = gather_from_sequence_parallel_region(
                hidden_states, tensor_parallel_output_grad=False, group=self.pg_collection.tp)
        # The head computes in float32 whatever the parameter dtype: a bf16 matmul would leave every
        # value 3 significant digits before GAE. Its parameters stay in the model's dtype (checkpoints,
        # conversion and DDP's buffers unchanged); the casts pass the gradient back in that dtype.
        head = self.value_head
        bias = None if head.bias is None else head.bias.float()
        values = torch.nn.functional.linear(hidden_states.float(), head.weight.float(), bias).squeeze(-1)
        return values.transpose(0, 1).contiguous()
