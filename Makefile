# The README contract: `make demo` and `make test` set up whatever is missing, then run.
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.setup-stamp

.PHONY: setup test demo bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml scripts/setup_env.sh scripts/sglang_cpu_requirements.txt
	bash scripts/setup_env.sh
	touch $(STAMP)

# Two workers (pytest-xdist): tests/conftest.py keeps each file, and both Slurm files, on one
# worker. --durations: CI's log shows where the suite's time goes.
test: $(STAMP)
	@# The project's own modules byte-compiled first (only what changed): where PYTHONDONTWRITEBYTECODE
	@# is set, as on CI, every one of the suite's hundreds of processes would compile them again.
	@$(PY) -m compileall -q vapo_megatron model_providers tests scripts benchmarks
	$(PY) -m pytest -q -n 2 --dist loadfile --durations=15 tests

demo: $(STAMP)
	bash scripts/run_demo.sh

bench: $(STAMP)
	$(PY) -m benchmarks.algo
	$(PY) -m benchmarks.weight_sync
	$(PY) -m benchmarks.convert
	$(PY) -m benchmarks.estimators

clean:
	rm -rf $(VENV) runs .pytest_cache
