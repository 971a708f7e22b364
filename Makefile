# One command installs, one runs the tests (see README.md).
PYTHON ?= python
# The CPU build of torch; set TORCH_SPEC="torch" (or a CUDA index) on a GPU machine.
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=

.PHONY: install test test-slow lint bench bench-gpu demo stability compare

install:
	$(PYTHON) -m pip install "$(TORCH_SPEC)"
	$(PYTHON) -m pip install -e ".[dev,deepspeed,math,plot]"

test:
	$(PYTHON) -m pytest -m "not slow" -q $(PYTEST_ARGS)

# Multi-process tests; pytest's exit code 5 (none collected) is not a failure.
test-slow:
	$(PYTHON) -m pytest -m slow -q $(PYTEST_ARGS) || [ $$? -eq 5 ]

lint:
	$(PYTHON) -m ruff check trl_dllm tests

# The CPU demo (docs/demo.md): warm start + StableDRL on a synthetic task, <= 10 min on 2 cores → demo_out/
demo:
	$(PYTHON) -m trl_dllm.demo

# grpo vs stabledrl with noisy likelihood ratios, 3 seeds → demo_out/stability.png (docs/demo.md)
stability:
	$(PYTHON) -m trl_dllm.demo --stability

# Every method on the same budget (docs/compare.md): make compare [COMPARE_ARGS="--short" | "--quick" | "--methods d1 sft ..."]
COMPARE_ARGS ?=
compare:
	$(PYTHON) -m trl_dllm.demo.compare $(COMPARE_ARGS)

# Benchmarks (docs/benchmarks.md): ratios measured in one run; writes bench_out/*.json and prints them.
bench:
	$(PYTHON) -m bench.run_all --out bench_out

# The GPU benchmark (docs/gpu.md): the README's 8B run on one CUDA device, <out>/gpu.json and a table.
# BENCH_GPU_ARGS="--quick" runs every path on CPU with tiny shapes (the test suite does: tests/test_bench_gpu.py).
BENCH_GPU_ARGS ?=
bench-gpu:
	$(PYTHON) -m bench.gpu --out bench_out $(BENCH_GPU_ARGS)
