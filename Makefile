# The two commands of the README: `make repro` (set up, then run the pipeline) and `make test`.
SHELL := /bin/bash
VENV := .venv
export DVC_NO_ANALYTICS := 1
export PIP_DISABLE_PIP_VERSION_CHECK := 1
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)

.PHONY: setup repro repro-all test test-unit test-notebooks test-pipeline lab

setup: $(VENV)/.installed

$(VENV)/.installed: requirements.txt requirements-2.txt constraints.txt pyproject.toml scripts/setup.sh
	bash scripts/setup.sh
	touch $@

# dvc repro, with each stage's wall time written to figures/stage_times.{csv,md} (lowmem/pipeline/stage_times.py).
repro: setup
	python -m lowmem.pipeline times

# The same, plus the stages left out of the default for time (frozen in dvc.yaml; README, "Left out of the default").
repro-all: setup
	python -m lowmem.pipeline times --all

# Every tier in one pytest session, on two pytest-xdist workers (tests/conftest.py: the pipeline test, the notebooks
# that reuse its runs and the assertions on their metrics share one worker, in order; the notebooks that only account,
# with their assertions, another). The tiers alone, serially:
test: setup
	python -m pytest -n 2 --dist loadgroup

test-unit: setup
	python -m pytest tests -m "not slow and not notebook"

test-notebooks: setup
	python -m pytest notebooks tests/test_notebook_metrics.py

test-pipeline: setup
	python -m pytest tests -m slow

# JupyterLab on the project's kernel at 127.0.0.1:$(PORT), as root or not (scripts/lab.py says what it opens).
PORT ?= 8888
lab:
	@test -x $(VENV)/bin/python || { echo "error: no usable environment in $(VENV) (missing, or its Python is not executable by this user); run \`make setup\` first (about 5 minutes)" >&2; exit 2; }
	@python scripts/lab.py --port $(PORT)
