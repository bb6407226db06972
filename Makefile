# Two commands do all the set-up: `make demo` (the embedded default run) and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The CPU build of torch on this kind of machine; override for a CUDA machine: make TORCH_SPEC=torch test
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: setup test demo hybrid ar gemma dflash bench

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

# DFlash: the draft needs a trained target; train and export the tiny AR one (configs/ar_tiny.yaml) unless present.
DFLASH_TARGET := runs/ar_tiny/hf
dflash: $(STAMP)
	test -f $(DFLASH_TARGET)/config.json || { $(BIN)/python train.py fit --config configs/ar_tiny.yaml && \
	  $(BIN)/python -c "from lit_dllm.checkpointing import find_last_checkpoint; \
	from lit_dllm.modules.causal_lm import CausalLMModule; \
	CausalLMModule.load_from_checkpoint(find_last_checkpoint(['runs/ar_tiny/checkpoints'])).save_pretrained('$(DFLASH_TARGET)')"; }
	$(BIN)/python train.py fit --config configs/dflash_tiny.yaml

bench: $(STAMP)
	$(BIN)/python bench/bench_primitives.py
