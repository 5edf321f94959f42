"""Every command checks at its start what would make it fail at its end (issue 44, part A).

An empty --out that is a mount point, an empty read-only --out, damaged tokenizer, chat template
and generation config files, a truncated dist-checkpoint shard, --engine sglang without CUDA: each
was found only after the work (a whole conversion or evaluation), or as a traceback. Here each is
one line naming it, exit 2, before any model is built. The commands run in this process where they
stop before building a model; the one conversion that must succeed runs as a real command.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.quiet_check import users_env
from tests.helpers.tiny_hf import save_tiny, save_tiny_tokenizer

ROOT = Path(__file__).resolve().parents[2]

# Both directions of vapo-convert, into empty directories that answer a rename as a mount point
# does (EBUSY): the conversion once ran in full, then failed to rename --out away.
MOUNTED_CONVERT = """
import errno, os, sys
hf, mc, back = sys.argv[1:4]
mounts = {mc, back}

def guarded(real):
    def move(src, dst, *a, **kw):
        if os.path.abspath(src) in mounts or os.path.abspath(dst) in mounts:
            raise OSError(errno.EBUSY, "Device or resource busy", str(src))
        return real(src, dst, *a, **kw)
    return move

os.rename, os.replace = guarded(os.rename), guarded(os.replace)
from vapo_megatron.convert import main
sys.exit(main(["hf-to-mcore", "--hf", hf, "--out", mc]) or main(["mcore-to-hf", "--ckpt", mc, "--out", back]))
"""


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """A tiny HF model, converted to Megatron and back into empty directories kept in place."""
    root = tmp_path_factory.mktemp("made")
    save_tiny(root / "hf", seed=3)
    save_tiny_tokenizer(root / "hf")
    (root / "mc").mkdir()
    (root / "back").mkdir()
    inodes = {d: (root / d).stat().st_ino for d in ("mc", "back")}
    proc = subprocess.run([sys.executable, "-c", MOUNTED_CONVERT, root / "hf", root / "mc", root / "back"], text=True,
                          capture_output=True, env={**users_env(), "PYTHONPATH": str(ROOT)}, timeout=300)
    return root, inodes, proc


def test_convert_fills_an_empty_out_in_place_both_ways(made):
    from safetensors.torch import load_file

    from vapo_megatron.checkpoint.atomic import CONVERT_HF_TO_MCORE, CONVERT_MCORE_TO_HF, writer_of

    root, inodes, proc = made
    assert proc.returncode == 0, proc.stderr[-3000:]
    for d, writer in (("mc", CONVERT_HF_TO_MCORE), ("back", CONVERT_MCORE_TO_HF)):
        assert (root / d).stat().st_ino == inodes[d]  # never renamed
        assert writer_of(root / d) == writer and not (root / d / ".vapo-staging").exists()
    assert sorted(p.name for p in root.iterdir()) == ["back", "hf", "mc"]  # nothing staged beside
    want = load_file(root / "hf" / "model.safetensors")
    got = {k: v for f in sorted((root / "back").glob("*.safetensors")) for k, v in load_file(f).items()}
    assert sorted(got) == sorted(want) and all(got[k].equal(want[k]) for k in want)
