# make demo | test | test-fast | bench | lint | format | install
#   Creates .venv (python3.11, else python3) and installs into it, the first time, what the
#   target uses, with the pins of constraints.txt (stamp files .venv/.installed-*):
#     demo, bench      the extras triton and pictures (matplotlib, for the PNGs)
#     test, test-fast  the extra test (triton, pictures, hf, pytest, hypothesis, model weights)
#     lint, format     the extra dev (test and ruff); install: the same
#   Tests: `make test` (CI) runs every test but the `slow` and `gpu` ones, the Triton kernel
#   tests in Triton's interpreter included (minutes on two cores). `make test-fast`, i.e.
#   `pytest -m "not kernel"`, is the fast tier: it leaves out the tests marked `kernel`.
#   `pytest -m slow` / `pytest -m gpu` run the long and the CUDA tests.
#   CM_NO_INSTALL=1: no venv, no install; run the source tree with the system python3 and the
#   packages it already has (PYTHONPATH=src python3 -m compilemask ...).

SYSTEM_PYTHON ?= $(shell command -v python3.11 2>/dev/null || command -v python3)
VENV := .venv
PIP_INSTALL = $(VENV)/bin/python -m pip install -q -c constraints.txt

ifeq ($(CM_NO_INSTALL),1)
PY := PYTHONPATH=src python3
RUFF := python3 -m ruff
DEMO_DEPS :=
TEST_DEPS :=
DEV_DEPS :=
else
PY := $(VENV)/bin/python
RUFF := $(VENV)/bin/ruff
DEMO_DEPS := $(VENV)/.installed-demo
TEST_DEPS := $(VENV)/.installed-test
DEV_DEPS := $(VENV)/.installed-dev
endif

.PHONY: demo test test-fast bench lint format install clean

demo: $(DEMO_DEPS)
	$(PY) -m compilemask demo

test: $(TEST_DEPS)
	$(PY) -m pytest -q

test-fast: $(TEST_DEPS)
	$(PY) -m pytest -q -m "not kernel"

bench: $(DEMO_DEPS)
	$(PY) -m compilemask bench

lint: $(DEV_DEPS)
	$(RUFF) check src tests benchmarks examples
	$(RUFF) format --check src tests benchmarks examples

format: $(DEV_DEPS)
	$(RUFF) format src tests benchmarks examples

install: $(DEV_DEPS)

$(VENV)/bin/python:
	$(SYSTEM_PYTHON) -m venv $(VENV)

# torch first and pinned: the pin resolves to the CPU build on local disk (an unpinned resolve
# pulls a multi-GB CUDA build); then the project, editable, with the target's extras.
$(VENV)/.installed-demo: EXTRAS = triton,pictures
$(VENV)/.installed-test: EXTRAS = test
$(VENV)/.installed-dev: EXTRAS = dev
$(VENV)/.installed-%: $(VENV)/bin/python pyproject.toml constraints.txt
	$(PIP_INSTALL) torch==2.13.0
	$(PIP_INSTALL) -e '.[$(EXTRAS)]'
	touch $@

clean:
	rm -rf out build dist src/*.egg-info .pytest_cache .ruff_cache
