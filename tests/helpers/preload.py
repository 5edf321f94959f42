"""The forkserver's first import (dist_utils.PRELOAD): megatron-core as the commands import it,
through vapo_megatron.mcore.megatron_import (no torch.compile at import without CUDA), before any
other preloaded module imports it; and transformers' import with the commands' packages_distributions
(vapo_megatron/config/package_index.py)."""

from vapo_megatron.config import package_index
from vapo_megatron.mcore.megatron_import import import_megatron

package_index.install()
import_megatron()
