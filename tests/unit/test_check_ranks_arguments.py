"""vapo-check's --ranks flags (vapo_megatron/check.py ranks_problems): each bad one is refused with exit 2
and one line naming its flag, before anything is run; under torchrun only rank 0 says so. The
single-process flags' own test: tests/distributed/test_gpu_check.py."""

from __future__ import annotations

import pytest

from vapo_megatron import check


def _main(capsys, monkeypatch, argv: list[str], **env: str) -> tuple[int, list[str], str]:
    for key in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    try:
        rc = check.main(argv)
    except SystemExit as e:  # argparse's own refusals (a value that is not an int)
        rc = e.code
    out, err = capsys.readouterr()
    return rc, err.strip().splitlines(), out


TORCHRUN = dict(RANK="0", WORLD_SIZE="4", LOCAL_WORLD_SIZE="4")


@pytest.mark.parametrize("argv,env,says", [
    (["--ranks"], {},
     ["vapo-check: --ranks runs one rank per GPU of the node (no launcher): torchrun --nproc-per-node N"]),
    (["--ranks"], dict(RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1"), ["vapo-check: --ranks runs one rank per GPU of "
                                                                        "the node (WORLD_SIZE=1)"]),
    (["--ranks"], dict(RANK="0", WORLD_SIZE="8", LOCAL_WORLD_SIZE="4"),
     ["vapo-check: --ranks checks one node: WORLD_SIZE=8 over nodes of LOCAL_WORLD_SIZE=4"]),
    (["--ranks", "--engine-tp", "3"], TORCHRUN, ["vapo-check: --engine-tp=3 must be >= 1 and divide the 4 ranks"]),
    (["--ranks", "--engine-tp", "0"], TORCHRUN, ["vapo-check: --engine-tp=0 must be >= 1 and divide the 4 ranks"]),
    (["--engine-tp", "2"], {}, ["vapo-check: --engine-tp=2 is a flag of the multi-rank checks: add --ranks"]),
    (["--engine-tp", "two"], {}, ["vapo-check: argument --engine-tp: invalid int value: 'two'"]),
    (["--ranks", "--cpu", "--steps", "3", "--offload-preset", "tiny-qwen2"], TORCHRUN,
     ["vapo-check: --cpu is a flag of the single-process checks, not of --ranks",
      "vapo-check: --steps is a flag of the single-process checks, not of --ranks",
      "vapo-check: --offload-preset is a flag of the single-process checks, not of --ranks"]),
    (["--ranks", "--model-preset", "nope", "--engine-tp", "8"], TORCHRUN,
     ["vapo-check: --model-preset: unknown model preset 'nope'", "vapo-check: --engine-tp=8 must be >= 1 and divide"]),
])
def test_bad_ranks_flags_are_one_line_each_naming_the_flag(capsys, monkeypatch, argv, env, says):
    rc, lines, out = _main(capsys, monkeypatch, argv, **env)
    assert rc == 2 and out == "", (rc, out)
    assert len(lines) == len(says) and all(line.startswith(s) for line, s in zip(lines, says)), lines


def test_under_torchrun_only_rank_0_says_it(capsys, monkeypatch):
    rc, lines, out = _main(capsys, monkeypatch, ["--ranks", "--engine-tp", "3"], RANK="2", WORLD_SIZE="4",
                           LOCAL_WORLD_SIZE="4")
    assert (rc, lines, out) == (2, [], "")


def test_without_a_gpu_per_rank_it_says_so_in_one_line_and_exits_2(capsys, monkeypatch):
    """The launch is right but the node has no GPU for each rank: nothing starts (no process group)."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the same answer on a GPU machine
    rc, lines, out = _main(capsys, monkeypatch, ["--ranks"], RANK="0", WORLD_SIZE="2", LOCAL_WORLD_SIZE="2")
    assert (rc, out) == (2, "") and lines == ["vapo-check: --ranks needs a GPU per rank: 2 ranks, "
                                              "0 CUDA GPU(s) visible"]
