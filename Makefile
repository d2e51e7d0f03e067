# Two commands set everything up on a fresh machine: `make demo` and `make test`.
# Each creates .venv when missing and installs what it needs: the CPU build of torch first
# (a bare `pip install torch` would pull a multi-GB CUDA build), then the project with its
# dev extra.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.shardc-installed
TORCH := torch==2.13.0

.PHONY: demo test lint typecheck unit clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/shardc run examples/gpt.py:tiny --nproc 2 --steps 5 --cluster local

lint: $(STAMP)
	$(BIN)/ruff check compiler passes backends tests examples benchmarks

typecheck: $(STAMP)
	$(BIN)/mypy compiler passes backends

unit: $(STAMP)
	$(BIN)/pytest

test: lint typecheck unit

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache *.egg-info
