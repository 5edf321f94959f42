"""Where a run stands: the loop's counters, the prompt sampler's position and partial rollout's
carry-over buffer.

Saved in every checkpoint's state.json (checkpoint/manager.py) and restored on resume; each field
is named once, here. The buffer's groups go to their own file beside it (data/carry_over.py);
state.json keeps its admission counter.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from vapo_megatron.data.carry_over import CarryOver
from vapo_megatron.data.prompts import PromptSampler


@dataclass
class RunState:
    sampler: PromptSampler = field(repr=False)  # the RL prompts' order and position
    iteration: int = 0             # RL iterations done (value pretraining's included)
    sft_steps_done: int = 0
    sft_finished: bool = False
    pretrain_steps_done: int = 0
    pretrain_finished: bool = False
    finished: bool = False         # the final eval, export and save are done: a rerun has nothing to do
    carry: CarryOver = field(default_factory=CarryOver, repr=False)  # partial rollout's groups in flight

    # Fields that checkpoints written before they existed lack; those load with the default.
    ADDED_LATER = ("finished", "carry")
    STRUCTURED = ("sampler", "carry")  # saved as dicts

    @property
    def policy_version(self) -> int:
        """The actor updates done: the version of the policy the engine serves and the next step
        trains (partial rollout's staleness counts these, rollout/partial.py). Every iteration
        either updates the actor or is a value-pretraining one (pretrain_steps_done counts those),
        so it is saved with, and resumes with, the two counters."""
        return self.iteration - self.pretrain_steps_done

    def to_json(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in self.STRUCTURED}
        d["sampler"] = self.sampler.state_dict()
        d["carry"] = {"admitted": self.carry.admitted}
        return d

    @classmethod
    def check_json(cls, d: dict) -> None:
        """KeyError/TypeError unless `d` holds every field with its type (state.json's own check)."""
        for f in dataclasses.fields(cls):
            if f.name in cls.ADDED_LATER and f.name not in d:
                continue
            value = d[f.name]
            want = dict if f.name in cls.STRUCTURED else type(getattr(cls, f.name))
            if not isinstance(value, want) or (want is int and isinstance(value, bool)):
                raise TypeError(f"{f.name}={value!r} is not a {want.__name__}")

    def load_json(self, d: dict) -> None:
        self.check_json(d)
        for f in dataclasses.fields(self):
            if f.name == "sampler":
                self.sampler.load_state_dict(d["sampler"])
            elif f.name == "carry":  # its groups: CheckpointManager.load, from their file
                self.carry = CarryOver(admitted=int(d["carry"]["admitted"]) if "carry" in d else 0)
            elif f.name in self.ADDED_LATER and f.name not in d:
                setattr(self, f.name, f.default)
            else:
                setattr(self, f.name, d[f.name])


__all__ = ["RunState"]
