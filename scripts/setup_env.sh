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
# The project with its pinned CPU/CI dependencies and the test extra.
.venv/bin/python -m pip install -q -e ".[test]"
# SGLang's weight-update payload classes (serializer, FlattenedTensorBucket) are importable
# without its CUDA stack; tests use the real classes, so install the package without deps.
.venv/bin/python -m pip install -q --no-deps "sglang==0.5.23"
# The light packages sglang's own modules import on the way to those two classes (its full
# dependency set pulls the CUDA stack, which CI does not need).
.venv/bin/python -m pip install -q orjson==3.13.0 psutil==7.2.2 pybase64==1.5.1 msgspec==0.22.0 \
  requests==2.34.2 starlette==1.10.0 pyzmq==27.3.0 ipython==9.18.1 aiohttp==3.14.5
echo "setup: done ($(.venv/bin/python --version))"
