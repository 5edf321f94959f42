"""The vapo_oracle arm's program (benchmarks/learning/oracle.py): torchrun runs this path, which every
run of the arm records as its "entry" (benchmarks/learning/studies.yaml), so it stays here."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.learning.oracle import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
