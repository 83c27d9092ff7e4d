# make demo | test | bench | lint
#   Creates .venv (python3.11, else python3) and installs the project with the pins in
#   constraints.txt the first time; later runs reuse it (stamp file .venv/.installed).
#   CM_NO_INSTALL=1: no venv, no install; run the source tree with the system python3
#   (the GPU machine: PYTHONPATH=src python3 -m compilemask ...).

SYSTEM_PYTHON ?= $(shell command -v python3.11 2>/dev/null || command -v python3)
VENV := .venv
STAMP := $(VENV)/.installed
PIP_INSTALL = $(VENV)/bin/python -m pip install -q -c constraints.txt

ifeq ($(CM_NO_INSTALL),1)
PY := PYTHONPATH=src python3
RUFF := python3 -m ruff
DEPS :=
else
PY := $(VENV)/bin/python
RUFF := $(VENV)/bin/ruff
DEPS := $(STAMP)
endif

.PHONY: demo test bench lint format install clean

demo: $(DEPS)
	$(PY) -m compilemask demo

test: $(DEPS)
	$(PY) -m pytest -q

bench: $(DEPS)
	$(PY) -m compilemask bench

lint: $(DEPS)
	$(RUFF) check src tests benchmarks examples
	$(RUFF) format --check src tests benchmarks examples

format: $(DEPS)
	$(RUFF) format src tests benchmarks examples

install: $(DEPS)

$(VENV)/bin/python:
	$(SYSTEM_PYTHON) -m venv $(VENV)

# torch first and pinned: it resolves to the CPU build on local disk (an unpinned resolve pulls
# a multi-GB CUDA build); then the project with its triton and test extras, same pins.
$(STAMP): $(VENV)/bin/python pyproject.toml constraints.txt
	$(PIP_INSTALL) torch==2.13.0
	$(PIP_INSTALL) -e '.[triton,test]'
	touch $(STAMP)

clean:
	rm -rf out build dist src/*.egg-info .pytest_cache .ruff_cache
