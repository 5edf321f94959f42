"""What a user's screen must not show (vapo_megatron/config/quiet.py): the lines megatron-core,
torch and transformers printed before the commands quieted them. Checked on the output of real
commands across the suite: the demo run and its resume (tests/e2e/test_train.py), vapo-convert from
a trainer checkpoint (test_convert_cli.py) and vapo-eval (test_eval.py); VAPO_VERBOSE=1 brings them
back (test_quiet_startup.py)."""

from __future__ import annotations

import os
import re

LIBRARY_NOISE = re.compile(r"Warning|warnings\.warn|DEPRECATED|deprecated|experimental|No CUDA runtime|"
                           r"Falling back|RNG state changed|Loading weights")
ACCELERATORS = "[vapo] Transformer Engine and Apex are not installed"
# Set by some shells and CI images, never by a user starting a run: a command's output is checked
# without them (VAPO_VERBOSE=1 would turn the libraries' lines back on).
NOT_A_USERS = ("VAPO_VERBOSE", "PYTHONWARNINGS", "HF_HUB_DISABLE_PROGRESS_BARS")


def library_noise(text: str) -> str:
    """The lines of `text` a quiet command must not print; "" when there are none. Lines as a
    terminal shows them: a carriage return (tqdm) starts the line over."""
    return "\n".join(ln for ln in (raw.split("\r")[-1] for raw in text.splitlines()) if LIBRARY_NOISE.search(ln))


def users_env(*also_drop: str) -> dict[str, str]:
    """This process's environment as a user's shell has it: without NOT_A_USERS nor `also_drop`."""
    return {k: v for k, v in os.environ.items() if k not in NOT_A_USERS + also_drop}
