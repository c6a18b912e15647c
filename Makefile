# Thin aliases. Each target bootstraps what it needs on a fresh machine:
# a private venv holding uv (.tools), then `uv sync --locked` into .venv.
SHELL := /bin/bash
PYTHON ?= python3
TOOLS := .tools
UV := $(TOOLS)/bin/uv
VENV := .venv
ASSAY_DATA_DIR ?= $(CURDIR)/assay-data
export ASSAY_DATA_DIR
# Strict: a broken link or anchor, or a page missing from nav, fails the build.
# Offline: the theme loads no web fonts (mkdocs.yml), so nothing is fetched.
MKDOCS_BUILD := NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet
STAGE_PKGS := assay_ingest assay_execute assay_verify assay_tournament assay_aggregate assay_decide assay_console

.PHONY: run test test-fast lint docs bench sync bytecode schemas config-docs clean up down console chromium

$(UV):
	$(PYTHON) -m venv $(TOOLS)
	$(TOOLS)/bin/pip install --quiet --disable-pip-version-check "uv>=0.9,<1"

# Bytecode is compiled here, once, and not by each process as it imports: with
# PYTHONDONTWRITEBYTECODE set, an interpreter that finds no .pyc compiles every module
# it imports from source, every time, and the suite starts hundreds of processes.
$(VENV)/.synced: $(UV) uv.lock pyproject.toml libs/assay/pyproject.toml $(wildcard services/*/pyproject.toml) Makefile
	$(UV) sync --locked --all-packages --quiet --compile-bytecode
	@touch $@

sync: $(VENV)/.synced

# The workspace's own modules are installed editable, so `uv sync` leaves them out;
# compileall writes only what changed since its last run.
bytecode: sync
	$(VENV)/bin/python -m compileall -q libs/assay/src $(wildcard services/*/src) > /dev/null

# `rebuild --check` checks the demo's data directory even where ASSAY_DATABASE_URL is set.
run: bytecode  ## the embedded demo on a freshly emptied data directory
	rm -rf "$(ASSAY_DATA_DIR)"
	$(VENV)/bin/assay demo
	ASSAY_DATABASE_URL= $(VENV)/bin/assay rebuild --check

# The suite's files (data directories, throwaway clusters, broker and S3 state) go to a
# tmpfs where there is one. Its crash tests kill processes, which the page cache
# survives: fsync guards only against a power cut, which no test makes, so syncing to a
# disk would only make the suite slower and dependent on how busy that disk is.
# `make test TEST_TMPDIR=/some/disk/dir` runs it on a disk instead.
TEST_TMPDIR ?= $(shell [ -d /dev/shm ] && [ -w /dev/shm ] && echo /dev/shm || echo $${TMPDIR:-/tmp})

console: bytecode  ## serve the console over the demo's data directory (after `make run`)
	$(VENV)/bin/assay console

# The console's browser tests drive Debian's chromium (never a downloaded browser).
CHROMIUM ?= /usr/bin/chromium
export ASSAY_CHROMIUM := $(CHROMIUM)
chromium:  ## install Debian's chromium when missing; fail when it cannot be
	@test -x "$(CHROMIUM)" || { \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq chromium; \
	  else sudo -n apt-get update -qq && sudo -n apt-get install -y -qq chromium; fi; }
	@test -x "$(CHROMIUM)" || { echo "chromium is missing and could not be installed" >&2; exit 1; }

# Two pytest workers, a test file each at a time (a file's module fixtures, such as a
# shared deployment, are set up once); `make test TEST_WORKERS=0` runs in one process.
TEST_WORKERS ?= 2
XDIST := $(if $(filter 0,$(TEST_WORKERS)),-p no:xdist,-n $(TEST_WORKERS) --dist loadfile)

test: bytecode chromium  ## the whole suite
	TMPDIR=$(TEST_TMPDIR) $(VENV)/bin/pytest $(XDIST)

test-fast: bytecode  ## the inner loop: every test not marked slow (no end-to-end, crash or fault tests)
	TMPDIR=$(TEST_TMPDIR) $(VENV)/bin/pytest -m "not slow" -q $(XDIST)

lint: sync  ## ruff, mypy --strict, import-linter layer contracts, the docs site's strict build
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy $(addprefix -p ,assay $(STAGE_PKGS))
	$(VENV)/bin/mypy conftest.py tests libs/assay/tests $(wildcard services/*/tests/*.py)
	cd bench && ../$(VENV)/bin/mypy --config-file ../pyproject.toml .
	$(VENV)/bin/lint-imports
	$(MKDOCS_BUILD)

docs: sync  ## the documentation site from docs/ (mkdocs.yml) -> site/
	$(MKDOCS_BUILD)

# The engine section's peers (DBOS Transact, LangGraph) are the `bench` dependency group:
# installed here only, never in the library's or the stages' environments.
bench: sync  ## figures beside their baselines -> bench/results/latest.json
	$(UV) sync --locked --all-packages --group bench --quiet --compile-bytecode
	$(VENV)/bin/python bench/run.py

# `make up REPLICAS="execute=3 tournament=2"`: more processes of a stage, one consumer group.
up: bytecode  ## a local distributed deployment without Docker: Postgres, broker, S3, six stages, the console
	$(VENV)/bin/assay up $(if $(REPLICAS),--replicas "$(REPLICAS)")

down:  ## stop what `make up` started; PURGE=1 also drops the database and roles it created
	@if [ -x $(VENV)/bin/assay ]; then $(VENV)/bin/assay down $(if $(PURGE),--purge); else echo "nothing to stop"; fi

schemas: sync  ## regenerate JSON Schemas of every message
	$(VENV)/bin/assay schemas schemas

config-docs: sync  ## regenerate docs/reference/configuration.md and docs/retention.md's table
	$(VENV)/bin/assay settings reference --output docs/reference/configuration.md
	$(VENV)/bin/python -c "import pathlib, assay.runtime.retention as r; p = pathlib.Path('docs/retention.md'); p.write_text(r.with_retention_table(p.read_text()))"

clean:
	rm -rf $(VENV) $(TOOLS) assay-data site .mypy_cache .ruff_cache .pytest_cache
