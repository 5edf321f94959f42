"""The forkserver's first import (dist_utils.PRELOAD): megatron-core as the commands import it,
through vapo_megatron.mcore.megatron_import (no torch.compile at import without CUDA), before any
other preloaded module imports it; and transformers' import with the commands' packages_distributions
(vapo_megatron/config/package_index.py)."""

from vapo_megatron.config import package_index
from vapo_megatron.mcore.megatron_import import import_megatron

package_index.install()
import_megatron()

# What a trainer rank imports after it starts (measured: 693 modules, ~1.8 s of CPU per rank on
# the 2-core machine when each forked rank imported them itself): the commands' own modules, and
# transformers' model classes and generation (the embedded engine's HF model, AutoTokenizer), which
# pull torch._dynamo, torch.onnx and torchvision in through transformers' masking and image utils.
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, PreTrainedTokenizerFast  # noqa: E402,F401
from transformers.models.llama import modeling_llama  # noqa: E402,F401
from transformers.models.qwen2 import modeling_qwen2  # noqa: E402,F401
from transformers.models.qwen3 import modeling_qwen3  # noqa: E402,F401
from transformers.models.qwen3_moe import modeling_qwen3_moe  # noqa: E402,F401

import vapo_megatron.checkpoint.manager  # noqa: E402,F401
import vapo_megatron.train  # noqa: E402,F401
import vapo_megatron.trainer.trainer  # noqa: E402,F401
