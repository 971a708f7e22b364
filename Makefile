# One command installs, one runs the tests (see README.md).
#
# Python: the active virtual environment's (or conda environment's) interpreter; with none active, `make install`
# creates `.venv` (reusing what the base interpreter already has installed) and every target here runs `.venv/bin/python`
# (`python` before `.venv` exists). Override with `make PYTHON=/path/to/python ...`.
ifneq ($(VIRTUAL_ENV)$(CONDA_PREFIX),)
PYTHON ?= python
else
PYTHON ?= $(if $(wildcard .venv/bin/python),.venv/bin/python,python)
endif
# torch: the CUDA build of PyPI where `nvidia-smi -L` lists a GPU, else the CPU build (PyTorch's CPU index).
# Choose yourself with TORCH_BUILD=cpu|cuda, or a pip requirement in TORCH_SPEC. An importable torch 2.13 is kept.
TORCH_VERSION ?= 2.13.0
TORCH_BUILD ?= $(shell nvidia-smi -L >/dev/null 2>&1 && echo cuda || echo cpu)
TORCH_SPEC ?= torch==$(TORCH_VERSION)
TORCH_INDEX_cpu = --extra-index-url https://download.pytorch.org/whl/cpu
PYTEST_ARGS ?=

.PHONY: install install-packages test test-slow lint bench bench-gpu gpu-wheels demo stability compare seeds

install:
	@if [ -z "$(VIRTUAL_ENV)$(CONDA_PREFIX)" ] && [ "$(origin PYTHON)" = file ] && [ ! -x .venv/bin/python ]; then \
		echo "make install: no virtual environment active: creating .venv (python -m venv --system-site-packages)"; \
		python -m venv --system-site-packages .venv || python3 -m venv --system-site-packages .venv; fi
	@$(MAKE) --no-print-directory install-packages

install-packages:
	@if $(PYTHON) -c "import torch, sys; sys.exit(not torch.__version__.startswith('$(TORCH_VERSION)'))" 2>/dev/null; \
	then echo "make install: keeping the installed torch $$($(PYTHON) -c 'import torch; print(torch.__version__)')"; \
	else echo "make install: installing the $(TORCH_BUILD) build of $(TORCH_SPEC) (set TORCH_BUILD=cpu|cuda to choose)"; \
		$(PYTHON) -m pip install "$(TORCH_SPEC)" $(TORCH_INDEX_$(TORCH_BUILD)); fi
	$(PYTHON) -m pip install -e ".[dev,deepspeed,math,plot,logging]"
	@$(PYTHON) -c "import torch; c = torch.cuda.is_available(); print('make install: torch', torch.__version__, \
		'(CUDA build, GPU ' + ('found' if c else 'NOT visible') + ')' if torch.version.cuda else '(CPU build)', \
		'in', __import__('sys').prefix)"

test:
	$(PYTHON) -m pytest -m "not slow" -q $(PYTEST_ARGS)

# Multi-process tests; pytest's exit code 5 (none collected) is not a failure.
test-slow:
	$(PYTHON) -m pytest -m slow -q $(PYTEST_ARGS) || [ $$? -eq 5 ]

lint:
	$(PYTHON) -m ruff check trl_dllm tests bench studies

# The CPU demo (docs/demo.md): warm start + StableDRL on a synthetic task, <= 10 min on 2 cores → demo_out/
demo:
	$(PYTHON) -m trl_dllm.demo

# grpo vs stabledrl with noisy likelihood ratios, 3 seeds → demo_out/stability.png (docs/demo.md)
stability:
	$(PYTHON) -m studies.stability

# Every method on the same budget (docs/compare.md): make compare [COMPARE_ARGS="--short" | "--quick" | "--methods d1 sft ..."]
COMPARE_ARGS ?=
compare:
	$(PYTHON) -m studies.compare $(COMPARE_ARGS)

# Collapse rates over 10 seeds (docs/compare.md#many-seeds-collapse-rates): two processes (one per 5 seeds), then the
# report. SEEDS_ARGS adds compare flags to both (e.g. "--set beta=0.04" for a remedy arm, with its own SEEDS_OUT);
# SEEDS_TASK picks the task (default sort_shuffled; SEEDS_TASK=sort for the demo task).
SEEDS_ARGS ?=
SEEDS_METHODS ?= stabledrl espo grpo agrpo d1
SEEDS_OUT ?= seeds_out
SEEDS_TASK ?= sort_shuffled
seeds:
	$(PYTHON) -m studies.compare --tasks $(SEEDS_TASK) --methods $(SEEDS_METHODS) --seeds 0 1 2 3 4 --max-minutes 10 --out $(SEEDS_OUT)/a $(SEEDS_ARGS) & \
	$(PYTHON) -m studies.compare --tasks $(SEEDS_TASK) --methods $(SEEDS_METHODS) --seeds 5 6 7 8 9 --max-minutes 10 --out $(SEEDS_OUT)/b $(SEEDS_ARGS) & \
	wait
	$(PYTHON) -m studies.seeds_report $(SEEDS_OUT)/a $(SEEDS_OUT)/b --out $(SEEDS_OUT)

# Benchmarks (docs/benchmarks.md): ratios measured in one run; writes bench_out/*.json and prints them.
bench:
	$(PYTHON) -m bench.run_all --out bench_out

# The GPU benchmark (docs/gpu.md): the README's 8B run on one CUDA device, <out>/gpu.json and a table.
# BENCH_GPU_ARGS="--quick" runs every path on CPU with tiny shapes (the test suite does: tests/test_bench_gpu.py).
BENCH_GPU_ARGS ?=
bench-gpu:
	$(PYTHON) -m bench.gpu --out bench_out $(BENCH_GPU_ARGS)

# The wheel folder an offline GPU machine needs (docs/gpu.md): run where there is network and torch.
gpu-wheels:
	$(PYTHON) -m bench.gpu_wheels --out wheels
