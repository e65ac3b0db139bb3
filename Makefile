# Every install step lives here: `make test` and `make demo` work from a clean clone.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: test lint typecheck pytest demo up bench bench-smoke schemas clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# with the bench extras: `make bench` needs them, and the benchmark's smoke test (part of
# `make test`) measures every stack, FastStream's included (small pure-Python wheels)
$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/python -m pip install --quiet -e '.[test,bench]'
	touch $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check reach tests bench
	$(BIN)/ruff format --check reach tests bench

typecheck: $(STAMP)
	$(BIN)/mypy reach
	$(BIN)/mypy bench

pytest: $(STAMP)
	$(BIN)/pytest -q

test: lint typecheck pytest

demo: $(STAMP)
	$(BIN)/reach demo

up: $(STAMP)
	$(BIN)/reach up

# Every suite, one after the other (about 15 minutes on 2 cores): call path, discovery,
# failover, growth. Each writes bench/results/<suite>.json (+ PNG) and prints its table.
bench: $(STAMP)
	$(BIN)/python -m bench
	$(BIN)/python -m bench.discovery
	$(BIN)/python -m bench.failover
	$(BIN)/python -m bench.growth

schemas: $(STAMP)
	$(BIN)/reach schema export schemas

clean:
	rm -rf $(VENV) .reach .pytest_cache .mypy_cache .ruff_cache
