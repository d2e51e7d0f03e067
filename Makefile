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

# The package maps compiler/ to shardc, passes/ to shardc.passes and backends/ to shardc.backends
# (setuptools package-dir), which mypy cannot follow: checked as plain folders, every `from shardc`
# import is unresolved. So mypy checks a tree of symlinks laid out as the package, rebuilt on every
# run so added and removed files are seen; its cache stays beside it.
TYPECHECK := .typecheck
typecheck: $(STAMP)
	rm -rf $(TYPECHECK)/shardc && mkdir -p $(TYPECHECK)
	cp -rs "$(CURDIR)/compiler" $(TYPECHECK)/shardc
	ln -s ../../passes $(TYPECHECK)/shardc/passes
	ln -s ../../backends $(TYPECHECK)/shardc/backends
	cd $(TYPECHECK) && "$(CURDIR)/$(BIN)/mypy" --config-file "$(CURDIR)/pyproject.toml" -p shardc

unit: $(STAMP)
	$(BIN)/pytest

test: lint typecheck unit

clean:
	rm -rf $(VENV) .typecheck .pytest_cache .mypy_cache .ruff_cache *.egg-info
