"""The `_extra_state` TE modules and ops keep (module/base.py get_extra_state ~1354, set_extra_state
~1419; ops/op.py ~632-770): without FP8 an EMPTY uint8 tensor, so every TE module adds
`<prefix>._extra_state` to its state_dict(); loading ignores None and empty tensors. A non-empty
one carries pickled FP8 metadata, which this world does not model: it raises NotImplementedError."""

from __future__ import annotations

import torch


def empty_extra_state() -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8)


def check_extra_state(state, context: str) -> None:
    if state is None or (isinstance(state, torch.Tensor) and state.numel() == 0):
        return
    raise NotImplementedError(f"test double: {context}'s extra state holds FP8 metadata, which is not modelled")


__all__ = ["check_extra_state", "empty_extra_state"]
