# oomdoc developer commands. `make demo` and `make test` work on a fresh machine.
PYTHON ?= python3
PIP ?= $(PYTHON) -m pip
# torch is installed only when missing, so an existing (CUDA or CPU) build is kept.
# Without an NVIDIA GPU (no working nvidia-smi) the CPU build is installed: the
# default wheel pulls gigabytes of CUDA libraries that such a machine never uses.
TORCH ?= torch==2.13.0
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu

.PHONY: install demo lint test test-gpu bench clean

install:
	@$(PYTHON) -c "import torch" 2>/dev/null || { \
		if nvidia-smi -L >/dev/null 2>&1; then \
			$(PIP) install "$(TORCH)"; \
		else \
			$(PIP) install "$(TORCH)" --index-url "$(TORCH_CPU_INDEX)"; \
		fi; }
	$(PIP) install -q -e ".[dev]"
	@# The simulated device's compiled op check, built once per torch install
	@# (without a C++ compiler the device counts the same, more slowly).
	@$(PYTHON) -m oomdoc.capture.native >/dev/null || true

# Runs oomdoc on an example that runs out of memory: on a GPU, the GPT example
# on a card capped to 16 GiB; without one, a small GPT on a 192 MiB simulated device.
demo: install
	@if $(PYTHON) -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then \
		$(PYTHON) -m oomdoc run --device-memory 16GiB examples/gpt_train.py --batch-size 32 --steps 4 || [ $$? -eq 1 ]; \
	else \
		$(PYTHON) -m oomdoc run --device cpu --device-memory 192MiB examples/gpt_train.py --preset tiny --batch-size 64 --steps 4 || [ $$? -eq 1 ]; \
	fi

# Format, lint and type-check: ruff and mypy (configured in pyproject.toml).
lint: install
	$(PYTHON) -m ruff format --check oomdoc tests benchmarks examples
	$(PYTHON) -m ruff check oomdoc tests benchmarks examples
	$(PYTHON) -m mypy

# Two test processes: most end-to-end tests wait on a child that uses one
# core (1540 s one at a time, 1140 s in two on a 2-core machine).
TEST_WORKERS ?= 2

test: lint
	$(PYTHON) -m pytest -q --durations=15 -n $(TEST_WORKERS)

test-gpu: install
	$(PYTHON) -m pytest -q -m gpu tests/gpu

bench: install
	$(PYTHON) benchmarks/instrumentation_overhead.py

clean:
	rm -rf .oomdoc build *.egg-info .pytest_cache
