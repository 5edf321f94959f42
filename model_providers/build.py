"""Build the actor (GPTModel) and the critic (GPTModel trunk + scalar value head) for one
pipeline stage (one virtual stage with VPP). Call after vapo_megatron.parallel.init_distributed:
TP/PP/VPP sizes and pre/post-processing come from megatron's parallel_state.
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

from model_providers import family_for
from model_providers.family import tied_embeddings
from model_providers.qwen2 import layer_spec, rope_theta

# Megatron pads the vocabulary to a multiple of this times TP (make_vocab_size_divisible_by).
VOCAB_DIVISOR = 128


def padded_vocab_size(hf_cfg: dict, tp: int) -> int:
    multiple = VOCAB_DIVISOR * tp
    return -(-hf_cfg["vocab_size"] // multiple) * multiple


def model_config(hf_cfg: dict, *, params_dtype: torch.dtype, recompute: bool = False, on_gpu: bool | None = None,
                 sequence_parallel: bool = False):
    """The family's TransformerConfig for the parallel layout megatron was initialized with.

    recompute: full activation recomputation. sequence_parallel: megatron's (only when TP > 1).
    on_gpu: None = whether CUDA is available; False builds a CPU-initialized model (under
    `torch.device("meta")`: shapes only, as vapo-plan does)."""
    return family_for(hf_cfg).transformer_config(
        hf_cfg,
        tp=parallel_state.get_tensor_model_parallel_world_size(),
        pp=parallel_state.get_pipeline_model_parallel_world_size(),
        vpp=parallel_state.get_virtual_pipeline_model_parallel_world_size(),
        params_dtype=params_dtype,
        on_gpu=torch.cuda.is_available() if on_gpu is None else on_gpu,
        recompute=recompute,
        sequence_parallel=sequence_parallel,
    )


def _gpt_kwargs(hf_cfg: dict, config, vp_stage: int | None) -> dict:
    return dict(
        config=config,
        transformer_layer_spec=layer_spec(config, vp_stage),
        vocab_size=padded_vocab_size(hf_cfg, config.tensor_model_parallel_size),
        max_sequence_length=hf_cfg["max_position_embeddings"],
        pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
        post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
        parallel_output=True,  # logits stay vocab-parallel [B, T, V_padded / TP]
        position_embedding_type="rope",
        rotary_base=rope_theta(hf_cfg),
        vp_stage=vp_stage,
    )


def build_actor(hf_cfg: dict, *, params_dtype: torch.dtype, vp_stage: int | None = None, recompute: bool = False,
                on_gpu: bool | None = None, sequence_parallel: bool = False) -> GPTModel:
    config = model_config(hf_cfg, params_dtype=params_dtype, recompute=recompute, on_gpu=on_gpu,
                          sequence_parallel=sequence_parallel)
    return GPTModel(share_embeddings_and_output_weights=tied_embeddings(hf_cfg), **_gpt_kwargs(hf_cfg, config, vp_stage))


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
    it like any layernorm. It maps to HF's Qwen2ForTokenClassification(num_labels=1).score.
    """

    def __init__(self, **kwargs):
        super().__init__(share_embeddings_and_output_weights=False, **kwargs)
        if self.post_process:
            del self.output_layer  # the vocab projection is not part of the critic
            self.output_layer = None
            cfg = self.config
            device = torch.cuda.current_device() if torch.cuda.is_available() and not cfg.use_cpu_initialization else None
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
        values = self.value_head(hidden_states).squeeze(-1)
        return values.transpose(0, 1).float().contiguous()


def build_critic(hf_cfg: dict, *, params_dtype: torch.dtype, vp_stage: int | None = None, recompute: bool = False,
                 on_gpu: bool | None = None, sequence_parallel: bool = False) -> CriticModel:
    config = model_config(hf_cfg, params_dtype=params_dtype, recompute=recompute, on_gpu=on_gpu,
                          sequence_parallel=sequence_parallel)
    return CriticModel(**_gpt_kwargs(hf_cfg, config, vp_stage))


def build_chunks(hf_cfg: dict, *, params_dtype: torch.dtype, critic: bool, recompute: bool = False,
                 on_gpu: bool | None = None, sequence_parallel: bool = False) -> list:
    """One model chunk per virtual stage (a single chunk without VPP)."""
    vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    build = build_critic if critic else build_actor
    kwargs = dict(params_dtype=params_dtype, recompute=recompute, on_gpu=on_gpu, sequence_parallel=sequence_parallel)
    if vpp is None:
        return [build(hf_cfg, **kwargs)]
    return [build(hf_cfg, vp_stage=v, **kwargs) for v in range(vpp)]
