# Every install step lives here: `make test` and `make demo` work from a clean clone.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install test docs docs-check test-long test-faults lint typecheck pytest pytest-pure pytest-long demo up bench bench-smoke schemas build pure clean node-deps browser

# pip with no notice a user has nothing to do about: its version check, and setuptools'
# "Editable installation" notice about folders named like the package
PIP := PYTHONWARNINGS="ignore:Editable installation" $(BIN)/python -m pip install --quiet \
	--disable-pip-version-check

$(BIN)/python:
	@echo "Creating the virtual environment $(VENV)"
	@$(PYTHON) -m venv $(VENV)
	@$(PIP) --upgrade pip

# The package and what it needs to run (pure Python): enough for `make demo` and `make up`.
# The install steps say what they do in a line each instead of echoing their commands
CORE := $(VENV)/.core
$(CORE): $(BIN)/python pyproject.toml
	@echo "Installing agent-reach and its dependencies into $(VENV) (about a minute)"
	@$(PIP) -e .
	@touch $(CORE)

# with the bench extras (`make bench` needs them, and the benchmark's smoke test measures
# every stack, FastStream's included), the gateways' and the console's (their tests run in
# `make test`) and the docs' (`make test` builds the site);
# setuptools >= 77 in the venv too: `make build` runs setup.py with it. After the package
# (order only: a venv made before it was a step of its own needs no second install)
$(STAMP): $(BIN)/python pyproject.toml | $(CORE)
	@echo "Installing the test, benchmark, gateway, console and documentation tools into $(VENV)"
	@$(PIP) --upgrade 'setuptools>=77'
	@$(PIP) -e '.[test,bench,gateways,console,docs]'
	@touch $(STAMP)

# The venv with the package, its extras and nats-server, nothing compiled (the README's
# quickstart starts here; every other target does this first)
install: $(STAMP)

# The call path compiled with mypyc (setup.py lists the modules), built next to the
# sources; rebuilt when any source changes, since mypyc compiles against the types of
# everything they import (one to two minutes on 2 cores: type-checking, then one gcc per
# module, as many at once as there are cores). Tests and benchmarks run compiled; `make
# demo` and `make up` run whatever is there (plain Python on a fresh clone, so that the
# first run starts at once; the compiled build, kept up to date, once one was made);
# `make pure` removes the compiled modules (the same code then runs as plain Python).
SOURCES := $(shell find reach -name '*.py')
NATIVE := $(VENV)/.native
JOBS := $(shell nproc 2>/dev/null || echo 2)
$(NATIVE): $(STAMP) setup.py $(SOURCES)
	@echo "Compiling the call path with mypyc: one to two minutes, once per change of reach/"
	@find reach -name '*.so' -delete  # a module no longer compiled must not linger
	@REACH_COMPILE=1 $(BIN)/python setup.py --quiet build_ext --inplace --parallel $(JOBS)
	@find reach -name '*.so' -exec touch {} +
	@touch $(NATIVE)

build: $(NATIVE)

pure:
	find reach -name '*.so' -delete
	rm -f $(NATIVE)

lint: $(STAMP)
	$(BIN)/ruff check reach tests bench setup.py docs/hooks
	$(BIN)/ruff format --check reach tests bench setup.py docs/hooks

typecheck: $(STAMP)
	$(BIN)/mypy reach
	$(BIN)/mypy bench
	$(BIN)/mypy docs/hooks

# The Node.js examples' packages (examples/node, from its package-lock.json), for their
# test in tests/conformance; only where npm is installed (the test is skipped without it)
NPM := $(shell command -v npm 2>/dev/null)
NODE_DEPS := examples/node/node_modules/.package-lock.json
$(NODE_DEPS): examples/node/package.json examples/node/package-lock.json
	cd examples/node && npm ci --no-audit --no-fund
node-deps: $(if $(NPM),$(NODE_DEPS))

# The headless browser the console's tests drive (tests/test_console_browser.py): Debian's
# chromium and chromedriver, installed with apt-get where they are missing, apt-get is
# there and this is root (CI runs as root on Debian; about a minute); a no-op when they
# are present. Elsewhere it says so, and the browser tests are skipped with the reason.
# The tests point at /usr/bin/chromedriver: nothing is downloaded at test time.
APT_GET := $(shell command -v apt-get 2>/dev/null)
browser:
	@if [ ! -x /usr/bin/chromium ] || [ ! -x /usr/bin/chromedriver ]; then \
		if [ -n "$(APT_GET)" ] && [ "$$(id -u)" = 0 ]; then \
			echo "Installing chromium and chromium-driver with apt-get (about a minute)"; \
			apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
				--no-install-recommends chromium chromium-driver >/dev/null; \
		else \
			echo "no chromium (apt-get install chromium chromium-driver as root):" \
				"the console's browser tests will be skipped"; \
		fi; \
	fi

# Tests run in parallel (pytest-xdist), twice as many at once as there are cores: most
# of a test's time is spent waiting on the nats-server and the processes it starts, each
# its own. The tests that load the machine on purpose (marker serial: floods, calls at a
# set rate while something fails) run after them, alone, so that what they measure is
# the fabric and not the other tests.
TEST_WORKERS ?= $(shell echo $$(( $(JOBS) * 2 )))
PARALLEL := -n $(TEST_WORKERS)
IN_MAKE_TEST := not faults_long and not bench_smoke and not long
pytest: $(NATIVE)
	REACH_TEST_BUILD=compiled $(BIN)/pytest -q $(PARALLEL) -m "$(IN_MAKE_TEST) and not serial"
	REACH_TEST_BUILD=compiled $(BIN)/pytest -q -m "$(IN_MAKE_TEST) and serial"

# What `pip install` gives is pure Python, whose runtime checks differ from the compiled
# build's: the call path's tests (calls, codec, contract, audit, routing, resilience, the
# protocol reader, the route cache's collection after a load) and the registrar's
# per-message ones (health plan, probes, budget) run on it too, from a copy of reach/
# without the compiled modules, imported ahead of the checkout (PYTHONPATH, pytest's
# append import mode).
PURE := build/pure
PURE_TESTS := tests/test_calls.py tests/test_call_inputs.py tests/test_retries.py \
	tests/test_fallbacks.py tests/test_batching.py tests/test_codec.py \
	tests/test_contract.py tests/test_route_choice.py tests/test_route_cache.py tests/test_aperture.py \
	tests/test_breaker.py tests/test_budget.py tests/test_backoff.py tests/test_writer.py \
	tests/test_public_nats_api.py tests/test_agent_fuzz.py tests/test_reader.py \
	tests/test_health_plan.py tests/test_registrar_probes.py tests/test_control_budget.py \
	tests/test_runtime.py \
	$(wildcard tests/test_audit_*.py)
pytest-pure: $(STAMP)
	rm -rf $(PURE)
	$(BIN)/python -c "import shutil; shutil.copytree('reach', '$(PURE)/reach', \
		ignore=shutil.ignore_patterns('*.so', '__pycache__'))"
	PYTHONPATH=$(CURDIR)/$(PURE) REACH_TEST_BUILD=pure $(BIN)/pytest -q -p no:cacheprovider \
		--import-mode=append $(PARALLEL) $(PURE_TESTS)

# The longer tests, kept out of `make test` so that it stays under 8 minutes on 2 cores;
# CI runs them after it: the end-to-end runs of whole programs (marker long: the README
# as printed, the demo, `reach up`'s process life, the raw-NATS and Node.js conformance
# kits, the MCP and A2A gateways, the console in a browser) and the pure-Python build's
# call-path tests, in parallel; then the fault scenarios (tests/faults and the registrar
# handover, marker faults_long), as many at once as there are cores: each faults the
# processes of its own fabric on a schedule at a light load (40 calls/s), so that two
# side by side leave each other's timings alone; then the benchmarks' end-to-end smoke
# runs (marker bench_smoke), as many at once as there are cores: they assert no timing.
test-long: pytest-long pytest-pure test-faults
	REACH_TEST_BUILD=compiled $(BIN)/pytest -q -n $(JOBS) -m bench_smoke

pytest-long: $(NATIVE) node-deps browser
	REACH_TEST_BUILD=compiled $(BIN)/pytest -q $(PARALLEL) -m "long and not serial"
	REACH_TEST_BUILD=compiled $(BIN)/pytest -q -m "long and serial"

test-faults: $(NATIVE)
	REACH_TEST_BUILD=compiled $(BIN)/pytest -q -n $(JOBS) -m faults_long

# The checks run while the call path compiles (mypyc spends its first minute on one
# core, type-checking), then the tests
test:
	@$(MAKE) --no-print-directory -j3 lint typecheck docs-check build
	@$(MAKE) --no-print-directory pytest

# The documentation site (mkdocs.yml: MkDocs Material, the API reference from the
# docstrings) into site/; `mkdocs serve` shows it while it is edited. `make test` builds
# it with --strict into a scratch directory, so a broken link or reference fails the
# tests without touching site/.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict
	@echo "the documentation is in site/index.html"

docs-check: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir build/site-check

# the compiled build if one was made (rebuilt when stale), else plain Python
RUNNABLE := $(CORE) $(if $(wildcard $(NATIVE)),$(NATIVE))
demo: $(RUNNABLE)
	@$(BIN)/reach demo

up: $(RUNNABLE)
	@$(BIN)/reach up

# Every suite, one after the other (about 30 minutes on 2 cores): call path, discovery,
# failover, growth, cold path, faults, gateways, command line. Each writes
# bench/results/<suite>.json (+ PNG, or faults.md) and prints its table.
bench: $(NATIVE)
	$(BIN)/python -m bench
	$(BIN)/python -m bench.discovery
	$(BIN)/python -m bench.failover
	$(BIN)/python -m bench.growth
	$(BIN)/python -m bench.coldpath
	$(BIN)/python -m bench.faults
	$(BIN)/python -m bench.gateways
	$(BIN)/python -m bench.cli

schemas: $(STAMP)
	$(BIN)/reach schema export schemas

clean: pure
	rm -rf $(VENV) .reach .pytest_cache .mypy_cache .ruff_cache build site
