#!/usr/bin/env bash
# Creates .venv with Python 3.12 (megatron-core >= 0.17 needs it) and installs the pinned
# CPU/CI environment. Idempotent: `make setup` only reruns it when pyproject.toml changes.
set -euo pipefail
cd "$(dirname "$0")/.."

find_python() {
  if command -v python3.12 >/dev/null 2>&1 && python3.12 -c 'import sys' >/dev/null 2>&1; then
    command -v python3.12; return
  fi
  if command -v pyenv >/dev/null 2>&1; then
    for p in "$(pyenv root)"/versions/3.12*/bin/python3.12; do
      [ -x "$p" ] && { echo "$p"; return; }
    done
  fi
  for p in "$HOME"/.pyenv/versions/3.12*/bin/python3.12 /usr/local/bin/python3.12 /usr/bin/python3.12; do
    [ -x "$p" ] && { echo "$p"; return; }
  done
  echo "setup: Python 3.12 not found (tried python3.12 on PATH, pyenv, ~/.pyenv, /usr/local/bin)." >&2
  echo "setup: install Python 3.12 (megatron-core 0.19 requires it) and rerun 'make setup'." >&2
  exit 1
}

PY=$(find_python)
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv with $PY"
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
# --no-compile: pip byte-compiles every module of every wheel (tens of thousands: torch, sglang,
# transformers), most of the install's time on a 2-core machine, and a command imports a few
# thousand of them. `make test` and `make demo` let Python compile what is imported, once, on
# first import (they unset PYTHONDONTWRITEBYTECODE, which CI machines set).
# The project with its pinned CPU/CI dependencies, the test extra and the wandb extra (the suite
# runs W&B offline: tests/unit/test_wandb.py, tests/e2e/test_wandb_resume.py).
.venv/bin/python -m pip install -q --no-compile -e ".[test,wandb]"
# SGLang runs in the suite on its CPU engine (tests/helpers/sglang_world.py). Its full dependency
# set is its CUDA stack (flashinfer, sglang-kernel, cutlass, ~10 GB), which cannot run here, so
# sglang goes in with --no-deps and what its CPU path imports goes in pinned below. Everything installed beside it is at versions sglang itself accepts: torch,
# transformers and tokenizers are pinned in pyproject.toml to sglang's exact pins, and
# tests/unit/test_pins.py fails when any installed package disagrees with sglang's metadata.
.venv/bin/python -m pip install -q --no-compile --no-deps "sglang==0.5.23"
# The light packages sglang's modules import on the way to those classes, at the versions the
# GPU resolution of '.[gpu]' picks (python-dateutil: sglang requires <3; matplotlib alone would
# bring 4.x).
# pip's check then lists every CUDA-stack package sglang requires "which is not installed":
# expected with --no-deps, so only a version disagreement ("but you have") is shown.
if ! out=$(.venv/bin/python -m pip install -q --no-compile orjson==3.13.0 psutil==7.2.2 pybase64==1.5.1 msgspec==0.22.0 \
  requests==2.34.2 starlette==1.10.0 pyzmq==27.3.0 ipython==9.18.1 aiohttp==3.14.5 \
  python-dateutil==2.9.0.post0 2>&1); then
  echo "$out" >&2; exit 1
fi
grep "but you have" <<<"$out" >&2 || true
# What SGLang's CPU engine imports besides (the suite runs sglang.Engine and its server on the CPU,
# tests/helpers/sglang_world.py): each pinned, with --no-deps, so nothing unpinned comes along.
.venv/bin/python -m pip install -q --no-compile --no-deps -r scripts/sglang_cpu_requirements.txt
# The one module a command imports whose source Python warns about when it compiles it
# (megatron-core 0.19.2's inference/contexts/kv_block_allocator.py: an invalid escape sequence) is
# compiled here, quietly, with the rest of megatron-core (542 files): compiled on first import, its
# SyntaxWarning would reach the first command's output. Measured over all of site-packages
# (2026-11-29): only it and one module of sglang that SGLang's CPU engine does not import warn.
MEGATRON=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/megatron
.venv/bin/python -W ignore -m compileall -q -j 0 "$MEGATRON" >/dev/null
echo "setup: done ($(.venv/bin/python --version))"
