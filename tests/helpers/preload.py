"""The forkserver's first import (dist_utils.PRELOAD): megatron-core as the commands import it,
through vapo_megatron.mcore.megatron_import (no torch.compile at import without CUDA), before any
other preloaded module imports it."""

from vapo_megatron.mcore.megatron_import import import_megatron

import_megatron()
