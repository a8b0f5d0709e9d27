# Two entry points for a fresh machine; each builds .venv and installs what it needs.
#   make demo   - the main job: the shipped llada-tiny answers held-out task prompts (fast + vanilla decoding)
#   make test   - the test suite (what CI runs); PYTEST_ARGS=--runslow adds the slow tests
# Both install the exact versions of constraints.txt (pyproject.toml only gives ranges);
#   make lock   - re-resolves constraints.txt: the newest releases within pyproject.toml's ranges
PYTHON ?= python3
PYTEST_WORKERS ?= 2
VENV := .venv
BIN := $(VENV)/bin
LOCK := constraints.txt
# Held below the newest release in range by `make lock`: torch at the release whose CPU build the
# machines carry on disk (pip prefers that local build; PyPI's Linux wheels are CUDA builds of several GB).
LOCK_HOLD ?= torch==2.13.0

.PHONY: demo test lock clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(VENV)/.runtime: pyproject.toml $(LOCK) | $(BIN)/python
	$(BIN)/python -m pip install --quiet -c $(LOCK) -e .
	touch $@

$(VENV)/.test: pyproject.toml $(LOCK) | $(BIN)/python
	$(BIN)/python -m pip install --quiet -c $(LOCK) -e '.[test]'
	touch $@ $(VENV)/.runtime

demo: $(VENV)/.runtime
	$(BIN)/dlm-jax demo

test: $(VENV)/.test
	$(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

# pip's resolver, run dry (nothing installed): what a fresh `pip install '.[test]'` would take on
# this Python and platform, written as name==version lines (local labels such as +cpu dropped, so
# the file also serves machines without that build).
define LOCK_WRITER
import json, platform, sys
report = json.load(open(sys.argv[1]))
pins = sorted(((i["metadata"]["name"], i["metadata"]["version"].split("+")[0]) for i in report["install"]
               if i["metadata"]["name"] != "dlm-jax"), key=lambda p: p[0].lower())
print("# The exact versions `make demo` and `make test` install (pip install -c constraints.txt ...):")
print(f"# pip's resolution of pyproject.toml's ranges with the test extra, CPython {sys.version_info[0]}.{sys.version_info[1]}"
      f" on {platform.system()} {platform.machine()}.")
print("# Regenerate with `make lock` (the newest releases within the ranges), then run `make test`.")
print("\n".join(f"{name}=={version}" for name, version in pins))
endef
export LOCK_WRITER

lock: | $(BIN)/python
	$(BIN)/python -m pip install --quiet --dry-run --ignore-installed --report $(VENV)/lock-report.json '.[test]' $(LOCK_HOLD)
	$(BIN)/python -c "$$LOCK_WRITER" $(VENV)/lock-report.json > $(LOCK).new
	mv $(LOCK).new $(LOCK)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
