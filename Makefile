# Two commands on a fresh machine:  `make train` (the main job) and `make test` (the test suite).
# Both create .venv and install everything on first use. torch is installed first and pinned so pip
# takes the CPU build on the machine instead of pulling a multi-GB CUDA build.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.fbt-installed

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	DS_BUILD_OPS=0 $(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

.PHONY: setup train test bench
setup: $(STAMP)

train: $(STAMP)
	$(PY) -m fbt_megatron.cli train recipes/tiny.yaml

# The SLURM tests start a one-node cluster themselves (tests/conftest.py: apt-installs munge/slurmctld/
# slurmd if missing, as root; stops only the daemons it started); with CI=true they fail instead of skip.
test: $(STAMP)
	$(PY) -m pytest -q tests

bench: $(STAMP)
	$(PY) benchmarks/bench_model.py
