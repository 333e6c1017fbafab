# One entry point. Every target creates .venv when it is missing.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install demo test test-slow lint bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(PY) examples/quickstart.py

lint: install
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

test: lint
	$(PY) -m pytest -m "not slow"

test-slow: install
	$(PY) -m pytest -m slow || [ $$? -eq 5 ]  # 5: no slow tests collected

bench: install
	$(PY) -m benchmarks.run

clean:
	rm -rf $(VENV) artifacts .pytest_cache .ruff_cache
