"""A quiet start-up: the libraries' warnings that say nothing a user can act on stay out of the
terminal, and what matters is said once, in one line.

    quiet_startup()           # first thing in every command's main(): warnings filters, log filters
    device_startup()          # vapo-train, vapo-convert, vapo-eval: the one line (global rank 0), and
                              # on the CPU the GPU-only advice filtered too

Without it every command opened with a screen of library output: megatron-core's "Transformer
Engine and Apex are not installed" (six times, from six modules), "GPTModel IS DEPRECATED" (once
per model), "MimoModelConfig is experimental", "full scope is deprecated", "MCore's async save is
deprecated", torch's "No CUDA runtime is found". Each is dropped by its exact text and only that
text (a filter per message, on the logger or warning category that emits it), so any other
warning of these libraries still shows. What they meant for the user, that megatron-core runs its
local PyTorch layers, is `device_startup`'s line. VAPO_VERBOSE=1 keeps everything.
quiet_startup is pure Python (it runs before anything imports torch or megatron-core).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import warnings

from vapo_megatron.config import transformers_index
from vapo_megatron.config.cli import verbose

# warnings.warn texts (the start of the message) of megatron-core, and of torch's distributed
# checkpointing as megatron-core calls it (every resume, mcore-to-hf and eval from a checkpoint).
QUIET_WARNINGS = (
    "Transformer Engine and Apex are not installed",  # optimizers, clip_grads, megatron-fsdp: said once below
    "Apex is not installed. Falling back to Torch Norm",  # the local layer spec: said once below
    "full scope is deprecated",  # megatron's own TransformerConfig default, not a setting of ours
    "MimoModelConfig is experimental",  # an import side effect; this project does not use MIMO
    # megatron's dist_checkpointing reads a checkpoint's common part on each rank alone (no_dist);
    # torch says so on every load, though that is megatron's design, not a missing process group.
    "torch.distributed is disabled, unavailable or uninitialized, assuming the intent is to load in a single process",
    "The argument order of load has been changed",  # megatron's call into torch.distributed.checkpoint.load
    "Please use DTensor instead and we are deprecating ShardedTensor",  # FutureWarning: megatron's storage format
    # FutureWarning of torch 2.11 at megatron's gathers (the MoE token dispatch at EP > 1, once per
    # rank); the text opens with a backquote, and a filter matches the message from its start.
    "`torch.distributed.all_gather_into_tensor` is deprecated",
)
# logging records, by the logger that emits them: (message start, why it is noise).
QUIET_LOGS = {
    "torch.utils.cpp_extension": ("No CUDA runtime is found",),  # no extension is ever built here
    "megatron.core.models.gpt.gpt_model": ("GPTModel IS DEPRECATED",),  # the model class we build; no action
    "megatron.core.dist_checkpointing.strategies.torch": ("MCore's async save is deprecated",),  # saves are sync
}
# Only without CUDA (device_startup), where they cannot apply; on a GPU they keep their meaning.
CPU_ONLY_WARNINGS = (
    # GPU advice (slurm/vapo_train.sbatch sets it there); on the CPU there is no CUDA queue to tune.
    "When using async grad allreduce it is recommended to set the environment variable CUDA_DEVICE_MAX_CONNECTIONS",
)
CPU_ONLY_LOGS = {
    # megatron's "CUDA" RNG is the CPU generator here (mcore/cpu_compat.py), so its check that a CUDA
    # RNG context left the CPU RNG alone always fires.
    "megatron.core.tensor_parallel.random": ("CPU RNG state changed within GPU RNG context",),
}


class _DropMessages(logging.Filter):
    def __init__(self, starts: tuple[str, ...]):
        super().__init__()
        self.starts = starts

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.starts)


def _install(texts: tuple[str, ...], logs: dict[str, tuple[str, ...]]) -> None:
    for text in texts:
        warnings.filterwarnings("ignore", message=text, category=Warning)  # by its text: User- or FutureWarning
    for name, starts in logs.items():
        logger = logging.getLogger(name)  # the same object the library gets when it imports
        if not any(isinstance(f, _DropMessages) and f.starts == starts for f in logger.filters):
            logger.addFilter(_DropMessages(starts))


def quiet_startup(*, loading_bars: bool = True) -> None:
    """Install the filters (idempotent); nothing when VAPO_VERBOSE=1. loading_bars=False also hides
    transformers' "Loading weights" bars (vapo-train: its own bar is the one that counts; a user's
    HF_HUB_DISABLE_PROGRESS_BARS wins)."""
    # Not a filter, but every command calls this first, before transformers is imported:
    # transformers' import table from a disk cache, not rebuilt in every process (transformers_index.py).
    transformers_index.install()
    if verbose():
        return
    if not loading_bars:
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # read when transformers is imported
    _install(QUIET_WARNINGS, QUIET_LOGS)
    # A library's source with an invalid escape ("\-" in megatron-core's inference code) warns when
    # Python first compiles it: once per environment (setup_env.sh installs without byte-compiling),
    # about an installed file. Such a compile-time warning names the file as its module.
    warnings.filterwarnings("ignore", category=SyntaxWarning, module=r".*[/\\]site-packages[/\\]")


def missing_accelerators() -> list[str]:
    """The optional GPU libraries megatron-core would use that are not installed."""
    return [name for name, module in (("Transformer Engine", "transformer_engine"), ("Apex", "apex"))
            if importlib.util.find_spec(module) is None]


def accelerator_line() -> str | None:
    """What the absent libraries mean, in one line; None when Transformer Engine is installed (with
    it, megatron-core's GPU layers and fused optimizers need no Apex)."""
    missing = missing_accelerators()
    if "Transformer Engine" not in missing:
        return None
    names = " and ".join(missing)
    verb = "are" if len(missing) > 1 else "is"
    return (f"[vapo] {names} {verb} not installed: megatron-core runs its local (PyTorch) layers and "
            "optimizers, slower on GPUs; fine on the CPU (GPU install: README)")


def device_startup() -> None:
    """For the commands that build a model, once torch may be imported: without CUDA, the GPU-only
    advice is filtered too (not with VAPO_VERBOSE=1); then accelerator_line, once, on global rank 0
    (every rank would say the same). It imports megatron-core, without CUDA with no torch.compile
    at import (mcore/megatron_import.py), before any other module can, and gives transformers'
    import a packages_distributions that does not stat every installed file (config/package_index.py)."""
    import torch

    from vapo_megatron.config import package_index
    from vapo_megatron.mcore.megatron_import import import_megatron

    package_index.install()
    transformers_index.install()  # idempotent; here too for callers that skip quiet_startup
    import_megatron()
    if not verbose() and not torch.cuda.is_available():
        _install(CPU_ONLY_WARNINGS, CPU_ONLY_LOGS)
    line = accelerator_line()
    if line and os.environ.get("RANK", "0") == "0":
        print(line, flush=True)


__all__ = ["CPU_ONLY_LOGS", "CPU_ONLY_WARNINGS", "QUIET_LOGS", "QUIET_WARNINGS", "accelerator_line",
           "device_startup", "missing_accelerators", "quiet_startup"]
