"""python -m benchmarks.learning, from anywhere (configs/chain_cpu.yaml and earlier runs name this path)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.learning.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
