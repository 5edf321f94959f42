"""Partial rollout's carry-over buffer: the groups in flight between steps, and its file.

    carry = CarryOver()                      RunState.carry; this DP rank's groups, in admission order
    write_groups(path, by_rank)              rank 0, inside the checkpoint being written
    dp_size, groups = read_groups(path)      [(DP rank that held it, Group)], in the saved order

A group is one prompt's n samples. Each sample keeps what a later step needs to continue it
exactly: its seed, its tokens so far, the behaviour log-prob of each token (the engine's, as it
sampled it) and the weight version that produced each token; `finish` is set once it stopped or
reached rollout.max_new_tokens. A group trains only when every sample has finished (partial.py).

The file is written with the checkpoint (into its temporary directory, renamed into place with
it: checkpoint/manager.py), so the buffer and the prompt sampler's position are saved together
and a resume continues both. It is a safetensors file: the tokens (int32), log-probs (float64:
the engine's values, exactly) and versions (int32) of every sample, concatenated, and a JSON
table of the groups in its metadata. Only the prompt's row in the training set is stored.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

FILE = "carry_over.safetensors"
FINISH = ("stop", "length")


@dataclass
class Sample:
    seed: int                                          # its sampling seed (the one-go generation's)
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # behaviour log-prob of each token
    versions: list[int] = field(default_factory=list)    # weight version that sampled each token
    finish: str | None = None                          # "stop" | "length" once finished

    @property
    def oldest(self) -> int | None:
        """The version of its first token (versions never decrease along a response)."""
        return self.versions[0] if self.versions else None


@dataclass
class Group:
    key: int        # admission number over the run (every DP rank numbers alike): the training order
    index: int      # the prompt's row in the training set (PromptSampler.records)
    samples: list[Sample]
    results: list | None = None  # the verifier's results once judged (dynamic sampling; not saved)

    @property
    def complete(self) -> bool:
        return all(s.finish is not None for s in self.samples)

    @property
    def oldest(self) -> int | None:
        versions = [s.oldest for s in self.samples if s.oldest is not None]
        return min(versions) if versions else None


@dataclass
class CarryOver:
    groups: list[Group] = field(default_factory=list)  # this DP rank's groups in flight
    admitted: int = 0       # groups admitted over the run: the next group's key
    drain: bool = False     # loaded with groups: a run with partial rollout off finishes them next step


def to_plain(groups: list[Group]) -> list:
    """Plain lists (for an object gather over DP)."""
    return [[g.key, g.index, [[s.seed, s.tokens, s.logprobs, s.versions, s.finish] for s in g.samples]] for g in groups]


def from_plain(plain: list) -> list[Group]:
    return [Group(key, index, [Sample(*s) for s in samples]) for key, index, samples in plain]


def write_groups(path: Path, by_rank: list[list]) -> int:
    """The groups of every DP rank (to_plain's lists, by DP rank) as one file; returns their number."""
    from safetensors.torch import save_file

    table, tokens, logprobs, versions = [], [], [], []
    for rank, plain in enumerate(by_rank):
        for key, index, samples in plain:
            table.append([rank, key, index, [[seed, len(toks), finish] for seed, toks, _, _, finish in samples]])
            for _, toks, lps, vers, _ in samples:
                tokens += toks
                logprobs += lps
                versions += vers
    tensors = {"tokens": torch.tensor(tokens, dtype=torch.int32), "logprobs": torch.tensor(logprobs, dtype=torch.float64),
               "versions": torch.tensor(versions, dtype=torch.int32)}
    save_file(tensors, str(path), metadata={"groups": json.dumps(table), "dp_size": str(len(by_rank))})
    return len(table)


def read_groups(path: Path) -> tuple[int, list[tuple[int, Group]]]:
    """(the DP size that wrote it, [(DP rank, group)]); ValueError naming the file when damaged."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata()
            tokens, logprobs, versions = (f.get_tensor(k).tolist() for k in ("tokens", "logprobs", "versions"))
        table, dp_size = json.loads(meta["groups"]), int(meta["dp_size"])
        out, at = [], 0
        for rank, key, index, samples in table:
            group = Group(int(key), int(index), [])
            for seed, n, finish in samples:
                if finish not in FINISH + (None,) or at + n > len(tokens):
                    raise ValueError("its table does not match its tensors")
                group.samples.append(Sample(int(seed), tokens[at : at + n], logprobs[at : at + n], versions[at : at + n], finish))
                at += n
            out.append((int(rank), group))
        if at != len(tokens) or not len(tokens) == len(logprobs) == len(versions):
            raise ValueError("its table does not match its tensors")
    except Exception as e:  # noqa: BLE001 -- any damage: the caller falls back to an older checkpoint
        raise ValueError(f"{path} is unreadable ({type(e).__name__}: {e})") from None
    return dp_size, out


def groups_for_rank(saved: list[tuple[int, Group]], saved_dp: int, dp_size: int, dp_rank: int) -> list[Group]:
    """This DP rank's groups: the same ones at the same DP size; otherwise every group, in saved
    order, dealt in equal contiguous shares (each sample keeps its seed, so it continues alike)."""
    if saved_dp == dp_size:
        return [g for r, g in saved if r == dp_rank]
    groups = [g for _, g in saved]
    return groups[dp_rank * len(groups) // dp_size : (dp_rank + 1) * len(groups) // dp_size]


__all__ = ["FILE", "CarryOver", "Group", "Sample", "from_plain", "groups_for_rank", "read_groups", "to_plain",
           "write_groups"]
