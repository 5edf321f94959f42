# The README contract: `make demo` and `make test` set up whatever is missing, then run.
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.setup-stamp

.PHONY: setup test demo bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml scripts/setup_env.sh
	bash scripts/setup_env.sh
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q tests

demo: $(STAMP)
	bash scripts/run_demo.sh

bench: $(STAMP)
	$(PY) scripts/bench_algo.py
	$(PY) scripts/bench_weight_sync.py
	$(PY) scripts/bench_convert.py

clean:
	rm -rf $(VENV) runs .pytest_cache
