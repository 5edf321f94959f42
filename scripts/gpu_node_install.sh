#!/usr/bin/env bash
# On an air-gapped GPU node that has Python 3.12 and torch only (docs/gpu_node.md): install the
# wheels of a bundle made by scripts/gpu_bundle.py, unpack the source, and print the first command.
#   bash gpu_node_install.sh [BUNDLE] [TARGET]
#     BUNDLE  the bundle folder (default: this script's folder)
#     TARGET  where the wheels go (default: BUNDLE/site); nothing else on the node is changed:
#             the node's torch stays the one it has
# Then: export PYTHONPATH=TARGET, and run from BUNDLE/vapo-megatron (printed at the end).
set -euo pipefail
BUNDLE=$(cd "${1:-$(dirname "$0")}" && pwd)
TARGET=${2:-$BUNDLE/site}
PY=${PYTHON:-python3}
"$PY" - <<'PYCHECK'
import sys
if sys.version_info[:2] != (3, 12):
    sys.exit(f"gpu_node_install: Python 3.12 is needed (the bundle's wheels are cp312); {sys.executable} is {sys.version.split()[0]}")
try:
    import torch
except ImportError as e:
    sys.exit(f"gpu_node_install: torch does not import with {sys.executable} ({e}); the bundle brings everything but torch")
print(f"gpu_node_install: Python {sys.version.split()[0]}, torch {torch.__version__}, CUDA available: {torch.cuda.is_available()}")
PYCHECK
# --no-deps: the bundle holds the whole closure but torch's, and pip must not try to fetch a torch.
# --no-index: nothing is fetched. --no-compile: import compiles what it needs.
"$PY" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --target "$TARGET" "$BUNDLE"/wheels/*.whl
mkdir -p "$BUNDLE/vapo-megatron"
tar -xzf "$BUNDLE/vapo-megatron.tar.gz" -C "$BUNDLE/vapo-megatron"
export PYTHONPATH="$TARGET"
(cd "$BUNDLE/vapo-megatron" && "$PY" -c "import megatron.core, transformers, vapo_megatron.train; print('gpu_node_install: megatron-core', megatron.core.__version__, 'transformers', transformers.__version__, 'import')")
echo "gpu_node_install: next:"
echo "  export PYTHONPATH=$TARGET"
echo "  cd $BUNDLE/vapo-megatron && python3 -m vapo_megatron.check"
