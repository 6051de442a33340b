# The two commands of the README: `make repro` (set up, then run the pipeline) and `make test`.
SHELL := /bin/bash
VENV := .venv
export DVC_NO_ANALYTICS := 1
export TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD := 1
export PIP_DISABLE_PIP_VERSION_CHECK := 1
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)

.PHONY: setup repro repro-all test lab

setup: $(VENV)/.installed

$(VENV)/.installed: requirements.txt requirements-2.txt constraints.txt pyproject.toml scripts/setup.sh
	bash scripts/setup.sh
	touch $@

# dvc repro, with each stage's wall time written to figures/stage_times.{csv,md} (lowmem/pipeline/stage_times.py).
repro: setup
	python -m lowmem.pipeline.stage_times

# The same, plus the stages left out of the default for time (frozen in dvc.yaml; README, "Left out of the default").
repro-all: setup
	python -m lowmem.pipeline.stage_times --all

test: setup
	python -m pytest

lab: setup
	jupyter lab notebooks/
