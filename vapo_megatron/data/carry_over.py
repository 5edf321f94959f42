"""Partial rollout's carry-over buffer: the groups in flight between steps, and its file.

    carry = CarryOver()                      RunState.carry; this DP rank's groups, in admission order
    write_groups(path, by_rank)              rank 0, inside the checkpoint being written
    dp_size, groups = read_groups(path)      [(DP rank that held it, Group)], in the saved order

A group is one prompt's n samples. Each sample keeps what a later step needs to continue it
exactly: its seed, its tokens so far, the behaviour log-prob of each token (the engine's, as it
sampled it) and the weight version that produced each token; `finish` is set once it stopped or
reached rollout.max_new_tokens. A group trains only when every sample has finished (rollout/partial.py).

The file is written with the checkpoint (into its temporary directory, renamed into place with
it: checkpoint/manager.py), so the buffer and the prompt sampler's position are saved together
and a resume continues both. It is a safetensors file: the tokens (int32), log-probs (float64:
the engine's values, exactly) and versions (int32) of every sample, concatenated, and a JSON
table of the groups in its metadata. Only the prompt's row in the training set is stored.

Read back, it is checked against what the resumed run will do with it (Bounds): every token id in
the policy's vocabulary, every prompt row in the training set, every version between 0 and the
checkpoint's policy version and never decreasing along a response, no NaN log-prob, keys below the
admission counter and unique, whole groups of the checkpoint's n_samples, and no unfinished
response at max_new_tokens. A file that fails is damaged like any other checkpoint file: the
resume falls back to the previous checkpoint (checkpoint/manager.py, docs/faults.md) rather than
crash at the first step after it, at every restart.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

FILE = "carry_over.safetensors"
FINISH = ("stop", "length")
VERSIONS = "actor_updates"  # what a token's version counts (metadata "versions"; older files: iterations)


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
    tensors = {"tokens": torch.tensor(tokens, dtype=torch.int32),
               "logprobs": torch.tensor(logprobs, dtype=torch.float64),
               "versions": torch.tensor(versions, dtype=torch.int32)}
    save_file(tensors, str(path),
              metadata={"groups": json.dumps(table), "dp_size": str(len(by_rank)), "versions": VERSIONS})
    return len(table)


@dataclass(frozen=True)
class Bounds:
    """What the groups of a checkpoint must fit to be continued (read_groups)."""

    vocab_size: int          # the policy's vocabulary: every token id below it
    prompts: int             # rows of the training set: every group's prompt among them
    admitted: int            # the checkpoint's admission counter (state.json): every key below it
    version: int             # the checkpoint's policy version (RunState.policy_version): no token newer
    pretrain_iterations: int  # its value-pretraining iterations: a file whose versions count iterations
    #                           (written before they counted actor updates) is read as actor updates
    n_samples: int | None = None       # the checkpoint's rollout.n_samples: every group's size
    max_new_tokens: int | None = None  # the checkpoint's rollout.max_new_tokens: no unfinished response as long


def _well_formed(table) -> bool:
    """[[rank, key, row, [[seed, length >= 0, finish], ...]], ...] with ints where ints belong."""
    def whole(*xs) -> bool:
        return all(type(x) is int for x in xs)

    return isinstance(table, list) and all(
        isinstance(g, list) and len(g) == 4 and whole(*g[:3]) and isinstance(g[3], list) and all(
            isinstance(x, list) and len(x) == 3 and whole(x[0], x[1]) and x[1] >= 0 and x[2] in FINISH + (None,)
            for x in g[3]) for g in table)


def _first(bad: torch.Tensor) -> int | None:
    hits = bad.nonzero()
    return int(hits[0, 0]) if len(hits) else None


def _content_problem(table: list, dp_size: int, tokens: torch.Tensor, logprobs: torch.Tensor, versions: torch.Tensor,
                     b: Bounds) -> str | None:
    """The first thing in the file the resumed run could not continue, naming its group and field;
    None when it fits `b`. Tensor checks over all tokens at once (the buffer of a large run holds
    hundreds of millions)."""
    lengths = torch.tensor([n for _, _, _, samples in table for _, n, _ in samples], dtype=torch.int64)
    owner = torch.tensor([k for k, (_, _, _, samples) in enumerate(table) for _ in samples], dtype=torch.int64)
    ends = lengths.cumsum(0)

    def group_of(token: int) -> str:
        k = int(owner[int(torch.searchsorted(ends, token, right=True))])
        return f"group {k} (key {table[k][1]})"

    if dp_size < 1:
        return f"dp_size={dp_size} must be >= 1"
    keys = set()
    for k, (rank, key, index, samples) in enumerate(table):
        where = f"group {k} (key {key})"
        if not 0 <= rank < dp_size:
            return f"{where}: DP rank {rank} is outside [0, {dp_size})"
        if not 0 <= key < b.admitted or key in keys:
            return (f"{where}: its key is "
                    f"{'a repeat' if key in keys else f'outside [0, {b.admitted}) (carry.admitted in state.json)'}")
        keys.add(key)
        if not 0 <= index < b.prompts:
            return f"{where}: prompt row {index} is outside the training set's {b.prompts} rows"
        if not samples or (b.n_samples is not None and len(samples) != b.n_samples):
            return f"{where}: {len(samples)} samples, not rollout.n_samples={b.n_samples}"
        for seed, n, finish in samples:
            if not 0 <= seed < 2**32:  # rollout/partial.py's seeds: below 2**31 - 1 plus a sample's place in its batch
                return f"{where}: sampling seed {seed} is outside [0, 2**32)"
            if finish is None and b.max_new_tokens is not None and n >= b.max_new_tokens:
                return f"{where}: an unfinished response of {n} tokens, rollout.max_new_tokens={b.max_new_tokens}"
    if (i := _first((tokens < 0) | (tokens >= b.vocab_size))) is not None:
        return (f"{group_of(i)}: token id {int(tokens[i])} is outside the vocabulary [0, {b.vocab_size}) "
                "of model.hf_path")
    if (i := _first(logprobs.isnan() | (logprobs == float("inf")))) is not None:
        return f"{group_of(i)}: log-prob {float(logprobs[i])} is no sampled token's (finite, or -inf by underflow)"
    if (i := _first((versions < 0) | (versions > b.version))) is not None:
        return (f"{group_of(i)}: weight version {int(versions[i])} is outside [0, {b.version}] "
                "(the checkpoint's policy version)")
    starts = torch.zeros(len(versions), dtype=torch.bool)
    starts[(ends - lengths)[lengths > 0]] = True
    if (i := _first((versions[1:] < versions[:-1]) & ~starts[1:])) is not None:
        return (f"{group_of(i + 1)}: weight versions decrease along a response "
                f"({int(versions[i])}, then {int(versions[i + 1])})")
    return None


def read_groups(path: Path, bounds: Bounds | None = None) -> tuple[int, list[tuple[int, Group]]]:
    """(the DP size that wrote it, [(DP rank, group)]); ValueError naming the file when damaged,
    or, given `bounds`, when its content does not fit them (_content_problem)."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata()
            tokens, logprobs, versions = (f.get_tensor(k) for k in ("tokens", "logprobs", "versions"))
        table, dp_size = json.loads(meta["groups"]), int(meta["dp_size"])
        if ((tokens.dtype, logprobs.dtype, versions.dtype) != (torch.int32, torch.float64, torch.int32)
                or tokens.dim() != 1):
            raise ValueError("its tensors are not int32 tokens, float64 log-probs and int32 versions")
        if bounds is not None and ("versions" not in meta or meta["versions"] != VERSIONS):
            versions = (versions - bounds.pretrain_iterations).clamp(min=0)  # iteration -> actor updates done then
        if not _well_formed(table) or sum(n for _, _, _, samples in table for _, n, _ in samples) != len(tokens) \
                or not len(tokens) == len(logprobs) == len(versions):
            raise ValueError("its table does not match its tensors")
    except Exception as e:  # noqa: BLE001 -- any damage: the caller falls back to an older checkpoint
        raise ValueError(f"{path} is unreadable ({type(e).__name__}: {e})") from None
    if bounds is not None and (problem := _content_problem(table, dp_size, tokens, logprobs, versions, bounds)):
        raise ValueError(f"{path} is damaged: {problem}")
    tokens, logprobs, versions = tokens.tolist(), logprobs.tolist(), versions.tolist()
    out, at = [], 0
    for rank, key, index, samples in table:
        group = Group(int(key), int(index), [])
        for seed, n, finish in samples:
            group.samples.append(Sample(int(seed), tokens[at : at + n], logprobs[at : at + n], versions[at : at + n],
                                        finish))
            at += n
        out.append((int(rank), group))
    return dp_size, out


def groups_for_rank(saved: list[tuple[int, Group]], saved_dp: int, dp_size: int, dp_rank: int) -> list[Group]:
    """This DP rank's groups: the same ones at the same DP size; otherwise every group, in saved
    order, dealt in equal contiguous shares (each sample keeps its seed, so it continues alike)."""
    if saved_dp == dp_size:
        return [g for r, g in saved if r == dp_rank]
    groups = [g for _, g in saved]
    return groups[dp_rank * len(groups) // dp_size : (dp_rank + 1) * len(groups) // dp_size]


__all__ = ["FILE", "Bounds", "CarryOver", "Group", "Sample", "from_plain", "groups_for_rank", "read_groups", "to_plain",
           "write_groups"]
