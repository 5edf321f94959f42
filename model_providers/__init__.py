"""Model providers: what each supported model family is, declaratively.

    registry.py   the families, and read_hf_config: the one reader of a model's config.json
    family.py     Family: HF architectures, name table, Architecture for megatron
    table.py      Row: one line of a family's HF <-> Megatron name/layout table
    layouts.py    the tensor transforms behind the layouts (the only module here that needs torch)
    qwen2.py      Qwen2 / Qwen2.5 and Qwen3 dense
    llama.py      Llama 3.x (with Llama 3.1's llama3 RoPE scaling)
    qwen3_moe.py  Qwen3-MoE (routed experts; expert parallelism)
    presets.py    named model configs (tiny test models, the published Qwen2.5, Qwen3 and Llama 3.1 sizes)

A family is one small module: its rows and its Architecture. Building the megatron model from
it is vapo_megatron/mcore/models.py's job; conversion and weight sync read the same table.
"""

from model_providers.family import Family, HFConfigError
from model_providers.llama import LLAMA
from model_providers.qwen2 import QWEN2, QWEN3
from model_providers.qwen3_moe import QWEN3_MOE
from model_providers.registry import FAMILIES, check_supported, family_for, read_hf_config

__all__ = ["FAMILIES", "Family", "HFConfigError", "LLAMA", "QWEN2", "QWEN3", "QWEN3_MOE", "check_supported",
           "family_for", "read_hf_config"]
