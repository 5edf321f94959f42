# The README contract: `make demo` and `make test` set up whatever is missing, then run.
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.setup-stamp

.PHONY: setup test lint demo bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml scripts/setup_env.sh scripts/sglang_cpu_requirements.txt
	bash scripts/setup_env.sh
	touch $(STAMP)

# Two workers (pytest-xdist): tests/conftest.py keeps each file, and both Slurm files, on one
# worker. --durations: CI's log shows where the suite's time goes.
test: $(STAMP) lint
	@# PYTHONDONTWRITEBYTECODE (set on CI machines) unset for the suite: each module the suite's
	@# hundreds of processes import is byte-compiled once, by the first, into .venv and the clone,
	@# instead of again in every process; setup compiles only megatron-core ahead (scripts/setup_env.sh).
	env -u PYTHONDONTWRITEBYTECODE $(PY) -m pytest -q -n 2 --dist loadfile --durations=15 tests

# ruff (pinned in pyproject.toml's test extra): the tree is clean under the rules pyproject.toml sets.
lint: $(STAMP)
	$(VENV)/bin/ruff check vapo_megatron model_providers scripts benchmarks tests

demo: $(STAMP)
	env -u PYTHONDONTWRITEBYTECODE bash scripts/run_demo.sh

bench: $(STAMP)
	$(PY) -m benchmarks.algo
	$(PY) -m benchmarks.weight_sync
	$(PY) -m benchmarks.convert
	$(PY) -m benchmarks.estimators

clean:
	rm -rf $(VENV) runs .pytest_cache
