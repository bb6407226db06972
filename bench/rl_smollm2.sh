#!/usr/bin/env bash
# RL on a real model (docs/rl.md) on the lent GPU machine: SmolLM2-135M-Instruct on the built-in arithmetic task, as
# named parts (the model folder comes from bench/smollm2_recipes.sh's `gguf-a` and `model` parts):
#   sft    the MDLM (configs/mdlm_smollm2_arith.yaml) and AR (configs/ar_smollm2_arith.yaml) starts, side by side,
#          each stopped at its first validation reaching 30 % held-out exact match (or by DEADLINE), exported to
#          runs/rl_smollm2/*/hf
#   rl     diffu-GRPO, wd1 and AR GRPO side by side, at each learning rate of DLLM_LRS (the dLLM's) and AR_LRS,
#          each validated first (a run cut by DEADLINE resumes from its last checkpoint when called again), then
#          bench/rl_table.py's table; the runs' TensorBoard logs go to $OUT. RL_ARGS: more train.py arguments for
#          every run (e.g. --trainer.max_steps=240 to train a finished run on).
#   bench  bench/bench_rl.py alone on the GPU (timings)
# Logs and tables land in $OUT. The image lacks datasets and jsonargparse: their wheels travel in .whl/.
# The 2026-12-02 run (docs/rl.md), one H200, chained calls: `sft` (DEADLINE=330) then `rl` with DLLM_LRS="2e-5 5e-6"
# AR_LRS="5e-6 1e-6" (the 2e-5 ones and AR ran out of memory beside the others), then `rl` again with
# RL_ARGS="--trainer.max_steps=240 --data.init_args.loader.val_batch_size=64" (two dLLM runs trained on, AR anew), then
# `bench` and `rl` with DLLM_LRS=2e-5 AR_LRS=" ", then `rl` with DLLM_LRS=1e-5 AR_LRS=" " (the configs' lr was 2e-5).
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
if [ -d .whl ] && [ ! -f /tmp/site/.whl.installed ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && touch /tmp/site/.whl.installed || exit 1
fi
export PYTHONPATH="$PWD:/tmp/site" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True  # several runs share the GPU
RL=runs/rl_smollm2
QUIET=(--trainer.enable_progress_bar=false)
DEADLINE=$(( $(date +%s) + ${DEADLINE:-560} ))
# the learning rates each RL run is made at, side by side (`config`: the config's own)
DLLM_LRS=${DLLM_LRS:-config} AR_LRS=${AR_LRS:-config}

left() { local s=$(( DEADLINE - $(date +%s) )); echo $(( s > 1 ? s : 1 )); }  # (timeout 0 would never stop)
summary() { grep -E "Finished after|^ +(val|train)/(accuracy|exact_match|reward)|Error|error" "$1" | grep -v Warning | tail -n 8; }
sft() {  # sft NAME CONFIG CLASS: train until the config's early stop, export the last checkpoint to $RL/NAME/hf
    local start=$(date +%s)
    timeout --signal=TERM "$(left)" python3 train.py fit --config "configs/$2" "${QUIET[@]}" > "$OUT/$1.log" 2>&1
    echo "fit rc=$?" >> "$OUT/$1.log"  # cut by DEADLINE (SIGTERM) it saved last.ckpt first: export that
    python3 -c "from lit_dllm.checkpointing import find_last_checkpoint; import lit_dllm
lit_dllm.$3.load_from_checkpoint(find_last_checkpoint(['$RL/$1/checkpoints'])).save_pretrained('$RL/$1/hf')" \
        >> "$OUT/$1.log" 2>&1
    echo "--- $1: rc=$? wall=$(( $(date +%s) - start ))s"; summary "$OUT/$1.log"
}
rl() {  # rl NAME CONFIG [train.py arguments]: validate the start, then fit (or resume a cut fit)
    local start=$(date +%s) resume=()
    if [ -f "$RL/$1/checkpoints/last.ckpt" ]; then
        resume=(--ckpt_path last)
    else
        python3 train.py validate --config "configs/$2" "${@:3}" "${QUIET[@]}" > "$OUT/$1.validate.log" 2>&1
    fi
    timeout --signal=TERM "$(left)" python3 train.py fit --config "configs/$2" "${@:3}" "${resume[@]}" "${QUIET[@]}" \
        >> "$OUT/$1.log" 2>&1
    echo "--- $1: rc=$? wall=$(( $(date +%s) - start ))s"; summary "$OUT/$1.log"
}
at_lr() {  # at_lr NAME CONFIG LR [train.py arguments]: start `rl` in the background at LR, named NAME_lrLR
    local name=$1
    [ "$3" = config ] || name=${1}_lr$3
    runs+=("$name")
    rl "$name" "$2" --trainer.logger.init_args.name="$name" "${@:4}" ${RL_ARGS:-} \
        $([ "$3" = config ] || echo "--model.init_args.optimization.lr=$3") > "$OUT/rl_$name.txt" &
}

for part in "$@"; do
    case $part in
        sft)
            sft mdlm_sft mdlm_smollm2_arith.yaml MDLMModule > "$OUT/sft_mdlm.txt" &
            sft ar_sft ar_smollm2_arith.yaml CausalLMModule > "$OUT/sft_ar.txt" &
            wait; cat "$OUT"/sft_*.txt ;;
        rl)
            runs=()
            for lr in $DLLM_LRS; do
                at_lr grpo_smollm2_arith grpo_smollm2_arith.yaml "$lr"
                at_lr wd1_smollm2_arith grpo_smollm2_arith.yaml "$lr" --model.init_args.rl.objective=weighted
            done
            for lr in $AR_LRS; do at_lr grpo_ar_smollm2_arith grpo_ar_smollm2_arith.yaml "$lr"; done
            wait; cat "$OUT"/rl_*.txt
            python3 bench/rl_table.py $RL "${runs[@]}" | tee "$OUT/rl_table.md"
            find $RL -name "events.out.tfevents.*" -exec cp --parents {} "$OUT/" \; ;;
        bench)
            python3 bench/bench_rl.py --config configs/grpo_smollm2_arith.yaml --batches 12 > "$OUT/bench_rl.log" 2>&1
            echo "--- bench: rc=$?"; grep "^|" "$OUT/bench_rl.log" | tee "$OUT/bench_rl.md" ;;
        *) echo "unknown part $part"; exit 2 ;;
    esac
done
