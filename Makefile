# Two commands do all the set-up: `make demo` (the embedded default run) and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The CPU build of torch on this kind of machine; override for a CUDA machine: make TORCH_SPEC=torch test
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: setup test demo hybrid ar gemma bench

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest -q

demo: $(STAMP)
	$(BIN)/python train.py fit --config configs/mdlm_tiny.yaml

hybrid: $(STAMP)
	$(BIN)/python train.py fit --config configs/hybrid_tiny.yaml

ar: $(STAMP)
	$(BIN)/python train.py fit --config configs/ar_tiny.yaml

gemma: $(STAMP)
	$(BIN)/python train.py fit --config configs/gemma_tiny.yaml

bench: $(STAMP)
	$(BIN)/python bench/bench_primitives.py
