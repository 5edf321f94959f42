"""Partial rollout's carry-over file read back against what the resumed run will do with it
(data/carry_over.py, Bounds; issue 55 item 10). Before, read_groups checked only that the table
matched the tensors: a token id outside the vocabulary failed the first step after every resume
with an IndexError, a version newer than the policy with a bincount error, so the run crash-looped
on one checkpoint. Now each is the damage of that checkpoint, named with its group and field, and
the resume falls back to the previous one (checkpoint/manager.py; end to end:
tests/e2e/test_fault_injection.py)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from vapo_megatron.data import carry_over
from vapo_megatron.data.carry_over import Bounds, Group, Sample

VOCAB, N = 96, 2
BOUNDS = Bounds(vocab_size=VOCAB, prompts=10, admitted=8, version=5, pretrain_iterations=1, n_samples=N,
                max_new_tokens=6)


def groups() -> list[Group]:
    """Two groups as a run leaves them: one finished, one half-way (a sample not yet begun)."""
    return [Group(4, 7, [Sample(11, [5, 6, 3], [-0.5, -1.0, -0.25], [3, 4, 4], "stop"),
                         Sample(12, [9, 8, 7, 6, 5, 4], [-0.1] * 6, [4, 4, 5, 5, 5, 5], "length")]),
            Group(6, 2, [Sample(13, [30, 31], [-2.0, -3.0], [5, 5]), Sample(14)])]


@pytest.fixture
def path(tmp_path):
    p = tmp_path / carry_over.FILE
    assert carry_over.write_groups(p, [carry_over.to_plain(groups())]) == 2
    return p


def rewrite(path, *, table=None, meta=None, **tensors) -> None:
    """The file with its table, metadata or some of its tensors replaced."""
    with safe_open(str(path), framework="pt") as f:
        old_meta, old = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    new_meta = old_meta | (meta or {}) | ({"groups": json.dumps(table)} if table is not None else {})
    save_file(old | tensors, str(path), metadata={k: v for k, v in new_meta.items() if v is not None})


def table(path) -> list:
    with safe_open(str(path), framework="pt") as f:
        return json.loads(f.metadata()["groups"])


def test_a_whole_file_reads_back_the_same_groups(path):
    dp, saved = carry_over.read_groups(path, BOUNDS)
    assert dp == 1 and [r for r, _ in saved] == [0, 0]
    assert carry_over.to_plain([g for _, g in saved]) == carry_over.to_plain(groups())
    # Bounds that the groups just fit: the newest version is the policy's, keys and rows below the counts.
    carry_over.read_groups(path, replace(BOUNDS, version=5, admitted=7, prompts=8, max_new_tokens=3))


def test_each_thing_a_resume_cannot_continue_is_damage_naming_its_group_and_field(path):
    tokens = torch.tensor([5, 6, 3, 9, 8, 7, 6, 5, 4, 30, 31], dtype=torch.int32)
    versions = torch.tensor([3, 4, 4, 4, 4, 5, 5, 5, 5, 5, 5], dtype=torch.int32)
    logprobs = torch.tensor([-0.5, -1.0, -0.25] + [-0.1] * 6 + [-2.0, -3.0], dtype=torch.float64)
    rows = table(path)

    def edited(change) -> list:
        t = json.loads(json.dumps(rows))
        change(t)
        return t

    cases = [
        ({"tokens": torch.where(tokens == 31, VOCAB, tokens)},
         "group 1 (key 6): token id 96 is outside the vocabulary [0, 96) of model.hf_path"),
        ({"tokens": torch.where(tokens == 8, -1, tokens)}, "group 0 (key 4): token id -1 is outside the vocabulary"),
        ({"versions": torch.where(versions == 3, 2**31 - 1, versions)},
         "group 0 (key 4): weight version 2147483647 is outside [0, 5] (the checkpoint's policy version)"),
        ({"versions": torch.where(versions == 3, -1, versions)},
         "group 0 (key 4): weight version -1 is outside [0, 5]"),
        ({"versions": torch.tensor([3, 4, 4, 4, 4, 5, 5, 5, 5, 5, 4], dtype=torch.int32)},
         "group 1 (key 6): weight versions decrease along a response (5, then 4)"),
        ({"logprobs": torch.where(logprobs == -2.0, float("nan"), logprobs)},
         "group 1 (key 6): log-prob nan is no sampled token's"),
        ({"table": edited(lambda t: t[1].__setitem__(2, 10))},
         "group 1 (key 6): prompt row 10 is outside the training set's 10 rows"),
        ({"table": edited(lambda t: t[1].__setitem__(1, 8))},
         "group 1 (key 8): its key is outside [0, 8) (carry.admitted in state.json)"),
        ({"table": edited(lambda t: t[1].__setitem__(1, 4))}, "group 1 (key 4): its key is a repeat"),
        ({"table": edited(lambda t: t[1].__setitem__(0, 1))}, "group 1 (key 6): DP rank 1 is outside [0, 1)"),
        ({"table": edited(lambda t: t[0][3][0].__setitem__(0, -3))}, "group 0 (key 4): sampling seed -3 is outside"),
        ({"table": edited(lambda t: t[0][3][1].__setitem__(2, None))},
         "group 0 (key 4): an unfinished response of 6 tokens, rollout.max_new_tokens=6"),
    ]
    for change, text in cases:
        fresh = path.with_name(f"case{len(text)}.safetensors")
        fresh.write_bytes(path.read_bytes())
        rewrite(fresh, **change)
        carry_over.read_groups(fresh)  # whole as a file: only the bounds find it
        with pytest.raises(ValueError) as e:
            carry_over.read_groups(fresh, BOUNDS)
        assert str(e.value).startswith(f"{fresh} is damaged: {text}"), (str(e.value), text)
    with pytest.raises(ValueError, match=r"2 samples, not rollout.n_samples=3"):
        carry_over.read_groups(path, replace(BOUNDS, n_samples=3))


@pytest.mark.parametrize("change", [
    {"table": [[0, 4, 7, [[11, -1, "stop"], [12, 12, "length"]]], [0, 6, 2, [[13, 2, None], [14, 0, None]]]]},
    {"table": [[0, "4", 7, [[11, 3, "stop"], [12, 6, "length"]]], [0, 6, 2, [[13, 2, None], [14, 0, None]]]]},
    {"tokens": torch.zeros(11, dtype=torch.float32)},
    {"meta": {"dp_size": "two"}},
])
def test_a_malformed_file_is_unreadable(path, change):
    rewrite(path, **change)
    with pytest.raises(ValueError, match=rf"^{path} is unreadable \("):
        carry_over.read_groups(path, BOUNDS)


def test_a_file_written_when_versions_counted_iterations_reads_as_actor_updates(path):
    """Files before issue 55 item 11 have no "versions" metadata: their versions are iterations, the
    value-pretraining ones included (they came first), which are actor updates less those."""
    rewrite(path, meta={"versions": None}, versions=torch.tensor([3, 4, 4, 4, 4, 5, 5, 5, 5, 6, 6], dtype=torch.int32))
    _, saved = carry_over.read_groups(path, BOUNDS)
    assert [s.versions for _, g in saved for s in g.samples] == [[2, 3, 3], [3, 3, 4, 4, 4, 4], [5, 5], []]
    _, saved = carry_over.read_groups(path, replace(BOUNDS, pretrain_iterations=4, version=2))
    assert [s.versions for _, g in saved for s in g.samples] == [[0, 0, 0], [0, 0, 1, 1, 1, 1], [2, 2], []]
