# Two entry points for a fresh machine; each builds .venv and installs what it needs.
#   make demo   - the main job: the shipped llada-tiny answers held-out task prompts (fast + vanilla decoding)
#   make test   - the test suite (what CI runs); PYTEST_ARGS=--runslow adds the slow tests
PYTHON ?= python3
PYTEST_WORKERS ?= 2
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(VENV)/.runtime: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e .
	touch $@

$(VENV)/.test: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $@ $(VENV)/.runtime

demo: $(VENV)/.runtime
	$(BIN)/dlm-jax demo

test: $(VENV)/.test
	$(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
