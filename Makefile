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

.PHONY: setup train test test-fast test-corner corner-env bench vllm-env mutation gpu-wheels gpu-check gpu-check-multi
setup: $(STAMP)

# vLLM's CPU build in a venv of its own for the serving tests (tests/support/vllm_env.py; cached under
# ~/.cache/fbt_megatron/vllm-envs): built here, before pytest, with its own time (printed; limit
# FBT_VLLM_SETUP_TIMEOUT, default 2400 s), so the tests never skip for time. Where the package cannot
# install (no index, a pip error) it says so and the serving tests skip naming the reason. If the build
# runs out of time (exit 1), `make test` still runs pytest (the serving tests then fail in CI, skip
# elsewhere, without building again) and exits non-zero; any other failure of the step also fails the target.
vllm-env: $(STAMP)
	$(PY) tests/support/vllm_env.py

train: $(STAMP)
	$(PY) -m fbt_megatron.cli train recipes/tiny.yaml

# The SLURM tests start a one-node cluster themselves (tests/conftest.py: apt-installs munge/slurmctld/
# slurmd if missing, as root; stops only the daemons it started); with CI=true they fail instead of skip.
test: $(STAMP)
	@setup=0; $(PY) tests/support/vllm_env.py || setup=$$?; \
	if [ $$setup -eq 1 ]; then export FBT_VLLM_SETUP_TIMED_OUT="see its output above"; \
	else unset FBT_VLLM_SETUP_TIMED_OUT; fi; \
	$(PY) -m fbt_megatron.cli data embedded --out data/embedded >/dev/null || exit $$?; \
	echo "$(PY) -m pytest -q -n 2 --dist loadgroup tests"; $(PY) -m pytest -q -n 2 --dist loadgroup tests; tests=$$?; \
	if [ $$tests -ne 0 ]; then exit $$tests; fi; exit $$setup

# CI's second corner, the image's (docs/install.md, "Tested versions"): Python 3.12, torch 2.11, megatron-core
# 0.19.2, the newest DeepSpeed, in a venv of its own built once and cached under ~/.cache/fbt_megatron/corner-envs
# (tests/support/corner_env.py; it prints the build's seconds). It runs the unit tier and the multi-process
# checkpoint, TP, PP, SP, resume and elastic-restart tests on this checkout; either failing (or collecting
# nothing) fails it. Of the elastic restarts only TP=2 (DP=2 ZeRO-1 resumes are test_checkpoint_torchrun's;
# the restart itself is torchrun's either way): CI stays under 40 minutes.
CORNER_TESTS := tests/integration/test_model_tp.py tests/integration/test_pipeline.py \
	tests/integration/test_model_sequence_parallel.py tests/integration/test_checkpoint_torchrun.py \
	tests/integration/test_train_resume.py \
	tests/integration/test_elastic.py::test_worker_killed_group_restarts_then_one_worker_continues\[tp2\]
corner-env: $(STAMP)
	$(PY) -m tests.support.corner_env

test-corner: $(STAMP)
	@$(PY) -m tests.support.corner_env || exit $$?; \
	echo "$(PY) -m tests.support.corner_env --pytest -q -m 'not slow' tests/unit"; \
	unit=0; $(PY) -m tests.support.corner_env --pytest -q -m "not slow" tests/unit || unit=$$?; \
	echo "$(PY) -m tests.support.corner_env --pytest -q $(CORNER_TESTS)"; \
	multi=0; $(PY) -m tests.support.corner_env --pytest -q $(CORNER_TESTS) || multi=$$?; \
	echo "corner (Python 3.12 image): unit tier exit $$unit, multi-process tests exit $$multi"; \
	if [ $$unit -ne 0 ]; then exit $$unit; fi; exit $$multi

# The edit-test loop: the unit tier without the tests marked slow (tests/unit; multi-process, SLURM, vLLM,
# other transformers versions and end-to-end CLI runs are the integration tier, tests/integration). `make test`
# above is CI's command: every tier, after the vLLM setup step.
test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow" tests/unit

bench: $(STAMP)
	$(PY) benchmarks/bench_model.py

# Mutation testing of one core file against the tests mapped to it (tools/mutation.py; not in CI):
#   make mutation FILE=fbt_megatron/passes.py    prints killed / survived / equivalent and the survivors
mutation: $(STAMP)
	@test -n "$(FILE)" || { echo "usage: make mutation FILE=fbt_megatron/passes.py"; exit 2; }
	@$(PY) -c "import cosmic_ray" 2>/dev/null || $(PY) -m pip install -q 'cosmic-ray>=8.7,<9'
	nice -n 10 $(PY) tools/mutation.py $(FILE)

# The GPU check's wheelhouse (docs/guides/first-gpu-run.md): here, with the registry; build/gpu-wheels then installs offline on
# a CUDA image with Python 3.12 and its own torch (cp312 manylinux wheels, DeepSpeed built pure-Python, this
# project's wheel; <= 64 MiB, printed). tools/gpu_wheels.py; the pins: benchmarks/gpu_wheels.txt.
gpu-wheels:
	python3 tools/gpu_wheels.py --out build/gpu-wheels

# On a GPU node, in the image's or cluster's own Python (GPU_PY; its torch is kept): the GPU check
# (benchmarks/gpu_check.py; installs build/gpu-wheels with pip --no-index when present, then one GPU within
# GPU_BUDGET seconds, default 480) and the 2-8 GPU one (TP=2+SP, PP=2 with 3 passes, DP=2 against one GPU).
# Each writes runs/gpu_check*/gpu_check.json.
GPU_PY ?= python3
GPU_BUDGET ?= 480
gpu-check:
	$(GPU_PY) benchmarks/gpu_check.py --wheels build/gpu-wheels --budget $(GPU_BUDGET)

gpu-check-multi:
	$(GPU_PY) benchmarks/gpu_check.py --multi --wheels build/gpu-wheels --budget $(GPU_BUDGET)
