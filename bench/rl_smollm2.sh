#!/usr/bin/env bash
# RL on a real model (docs/benchmarks/rl.md) on the lent GPU machine: SmolLM2-135M-Instruct on two built-in tasks, as
# named parts (the model folder comes from bench/smollm2_recipes.sh's `gguf-a` and `model` parts):
#   sft    the starts, side by side, each stopped at its first validation reaching 30 % held-out exact match (or by
#          DEADLINE), exported to runs/rl_smollm2/*/hf: the MDLM on arith (configs/mdlm_smollm2_arith.yaml), the AR
#          model on arith (configs/ar_smollm2_arith.yaml, validated every 10 steps at lr 2e-5 so that it stops near
#          30 %), the MDLM on sorting 10-14 digits (answers of 10-14 tokens), the AR model on sorting likewise (the
#          AR GRPO start of `sort_ar`, the comparison for `sort_justgrpo`); STARTS="mdlm_sft ...": only those
#   rl     the recipes of RUNS (default: all of RECIPES) side by side, each validated first (a run cut by DEADLINE
#          resumes from its last checkpoint when called again), then bench/rl_table.py's table; the runs' TensorBoard
#          logs go to $OUT. RL_ARGS: more train.py arguments for every run. SEEDS (default 42): each recipe once per
#          seed (data order and rollout draws: seed_everything and noise_seed), named NAME_sSEED but for 42; a seed
#          moves a run by a few points (docs/benchmarks/rl.md), so compare recipes over seeds
#   widths the MDLM starts validated on narrow rows (NARROW: the longest prompt + 128) and on rows as wide as the SFT's
#          (the configs' own)
#   memory bench/bench_rl.py's exact row on sorting (micro-batches of 16 completions) with the config's micro_batch_rows
#          and with none, from a random-init policy
#          of SmolLM2's shape (runs/models/smollm2_shape: its config as model_config.json and its tokenizer, carried
#          without weights, or made from the `model` part's folder): it never ends a completion early, so every
#          canvas is scored whole, the most memory a trained start can take
#   bench  bench/bench_rl.py alone on the GPU (timings and peak memory per phase of each estimator; BENCH_BATCHES
#          batches each, default 8, the first 2 not counted)
# Logs and tables land in $OUT. The image lacks datasets and jsonargparse: their wheels travel in .whl/.
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
M=--model.init_args
SORT=(--data.init_args.source.path=task:sort '--data.init_args.task.kwargs={"min_len":10,"max_len":14}')
SORT_START=($M.backbone.model=$RL/mdlm_sort_sft/hf "${SORT[@]}")
# the config is the winning recipe (the exact estimator, left-to-right rollouts, dynamic sampling, one update a batch
# at lr 2e-5); the others are the config with these changes
COOL=($M.optimization.lr=5e-6)  # JustGRPO's learning rate, the earlier sessions' default
EXACT=("${COOL[@]}" --trainer.max_steps=120)  # the one-update recipes of the earlier sessions, 120 batches
MU2=($M.rl.inner_updates=2 --trainer.max_steps=240)  # two updates a batch of rollouts (the earlier config's)
STATIC=(--data.init_args.loader.batch_size=16 $M.rl.update_groups=null)  # 16 prompts rolled out and updated
BLOCKWISE=($M.generation.gen_block_length=32 $M.generation.gen_steps=64 $M.rl.micro_batch_size=32 "${COOL[@]}"
           "${MU2[@]}")
D1=($M.rl.estimator=one_pass "${BLOCKWISE[@]}" "${STATIC[@]}")
ESPO=($M.rl.estimator=elbo $M.rl.mc_samples=2 $M.rl.objective=sequence)
# the configs lay rollouts on rows as wide as the SFT's (160: collation.pad_seq_len_divisible; a canvas of 96, answers
# take 15 tokens at most); the runs of the 2026-12-03 table laid them as the longest prompt + 128, 162-175 wide
NARROW=($M.generation.gen_length=128 $M.generation.gen_canvas_multiple=null)
# name -> config and its arguments
declare -A RECIPES=(
    [d1]="grpo_smollm2_arith.yaml ${NARROW[*]} ${D1[*]}"
    [wd1]="grpo_smollm2_arith.yaml ${NARROW[*]} ${D1[*]} $M.rl.objective=weighted"
    [justgrpo]="grpo_smollm2_arith.yaml ${NARROW[*]} ${EXACT[*]} ${STATIC[*]}"
    [justgrpo_g16]="grpo_smollm2_arith.yaml ${NARROW[*]} ${EXACT[*]} ${STATIC[*]} $M.rl.group_size=16 --data.init_args.loader.batch_size=8"
    [justgrpo_dyn]="grpo_smollm2_arith.yaml ${NARROW[*]} ${EXACT[*]}"
    [justgrpo_dyn_w]="grpo_smollm2_arith.yaml ${EXACT[*]}"
    [justgrpo_dyn_1e5]="grpo_smollm2_arith.yaml ${NARROW[*]} ${EXACT[*]} $M.optimization.lr=1e-5"
    [justgrpo_dyn_w_1e5]="grpo_smollm2_arith.yaml ${EXACT[*]} $M.optimization.lr=1e-5"
    [justgrpo_dyn_w_mu2]="grpo_smollm2_arith.yaml ${COOL[*]} ${MU2[*]}"
    [justgrpo_dyn_w_2e5]="grpo_smollm2_arith.yaml"
    [justgrpo_dyn_w_mu2_2e5]="grpo_smollm2_arith.yaml ${MU2[*]}"
    [justgrpo_dyn_w_5e5]="grpo_smollm2_arith.yaml ${EXACT[*]} $M.optimization.lr=5e-5"
    [espo]="grpo_smollm2_arith.yaml ${NARROW[*]} ${D1[*]} ${ESPO[*]}"
    [coupled_dyn]="grpo_smollm2_arith.yaml ${NARROW[*]} ${BLOCKWISE[*]} $M.rl.estimator=elbo"
    [coupled]="grpo_smollm2_arith.yaml ${NARROW[*]} ${D1[*]} $M.rl.estimator=elbo"
    [coupled_dyn_w]="grpo_smollm2_arith.yaml ${BLOCKWISE[*]} $M.rl.estimator=elbo"
    [sort_justgrpo]="grpo_smollm2_sort.yaml ${NARROW[*]}"
    [sort_justgrpo_w]="grpo_smollm2_sort.yaml"
    [sort_espo]="grpo_smollm2_arith.yaml ${NARROW[*]} ${D1[*]} ${ESPO[*]} ${SORT_START[*]}"
    [ar]="grpo_ar_smollm2_arith.yaml"
    [sort_ar]="grpo_ar_smollm2_arith.yaml $M.backbone.model=$RL/ar_sort_sft/hf ${SORT[*]}"
)
RUNS=${RUNS:-"d1 wd1 justgrpo justgrpo_g16 justgrpo_dyn justgrpo_dyn_w justgrpo_dyn_1e5 justgrpo_dyn_w_1e5 justgrpo_dyn_w_mu2
justgrpo_dyn_w_2e5 justgrpo_dyn_w_mu2_2e5 justgrpo_dyn_w_5e5 espo coupled coupled_dyn coupled_dyn_w ar sort_justgrpo sort_justgrpo_w sort_espo sort_ar"}

left() { local s=$(( DEADLINE - $(date +%s) )); echo $(( s > 1 ? s : 1 )); }  # (timeout 0 would never stop)
summary() { grep -E "Finished after|^ +(val|train)/(accuracy|exact_match|reward)|Error|error" "$1" | grep -v Warning | tail -n 8; }
sft() {  # sft NAME CONFIG CLASS [train.py arguments]: train until the config's early stop, export the last checkpoint
    local start=$(date +%s)
    timeout --signal=TERM "$(left)" python3 train.py fit --config "configs/$2" "${QUIET[@]}" \
        --trainer.logger.init_args.name="$1" "${@:4}" > "$OUT/$1.log" 2>&1
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

for part in "$@"; do
    case $part in
        sft)  # STARTS: the starts to make (default all four)
            wanted() { [[ " ${STARTS:-mdlm_sft ar_sft mdlm_sort_sft ar_sort_sft} " == *" $1 "* ]]; }
            wanted mdlm_sft && sft mdlm_sft mdlm_smollm2_arith.yaml MDLMModule > "$OUT/sft_mdlm.txt" &
            wanted ar_sft && sft ar_sft ar_smollm2_arith.yaml CausalLMModule --trainer.val_check_interval=10 \
                $M.optimization.lr=2e-5 > "$OUT/sft_ar.txt" &
            wanted mdlm_sort_sft && sft mdlm_sort_sft mdlm_smollm2_arith.yaml MDLMModule "${SORT[@]}" \
                > "$OUT/sft_sort.txt" &
            # validated every 5 steps: on a CPU (float32) this start went from 25.0 % at 70 steps to 44.5 % at 80
            wanted ar_sort_sft && sft ar_sort_sft ar_smollm2_arith.yaml CausalLMModule --trainer.val_check_interval=5 \
                $M.optimization.lr=2e-5 "${SORT[@]}" > "$OUT/sft_ar_sort.txt" &
            wait; cat "$OUT"/sft_*.txt 2>/dev/null ;;
        rl)
            runs=()
            for name in $RUNS; do
                read -r -a recipe <<< "${RECIPES[$name]}"
                for seed in ${SEEDS:-42}; do
                    run=$name; [ "$seed" = 42 ] || run=${name}_s$seed
                    runs+=("$run")
                    rl "$run" "${recipe[0]}" --trainer.logger.init_args.name="$run" "${recipe[@]:1}" \
                        --seed_everything="$seed" $M.noise_seed="$seed" ${RL_ARGS:-} > "$OUT/rl_$run.txt" &
                done
            done
            wait; cat "$OUT"/rl_*.txt
            python3 bench/rl_table.py $RL "${runs[@]}" | tee "$OUT/rl_table.md"
            tar czf "$OUT/tb.tgz" $(find $RL -name "events.out.tfevents.*" -path "*/version_*") 2>/dev/null ;;
        widths)
            for start in mdlm_sft mdlm_sort_sft; do
                task=(); [ $start = mdlm_sort_sft ] && task=("${SORT[@]}")
                for width in narrow sft; do
                    extra=(); [ $width = narrow ] && extra=("${NARROW[@]}")
                    python3 train.py validate --config configs/mdlm_smollm2_arith.yaml "${QUIET[@]}" "${task[@]}" \
                        $M.backbone.model=$RL/$start/hf "${extra[@]}" > "$OUT/width_${start}_$width.log" 2>&1
                    echo "$start on $width rows: $(grep -o "exact_match *[│|] *[0-9.]*" \
                        "$OUT/width_${start}_$width.log" | grep -o "[0-9.]*$")"
                done
            done | tee "$OUT/widths.txt" ;;
        memory)
            shape=runs/models/smollm2_shape
            if [ ! -f $shape/model_config.json ]; then  # made from the converted model's folder (the `model` part)
                mkdir -p $shape && cp runs/models/smollm2-135m-instruct/{*.jinja,tokenizer*.json} $shape/ && python3 -c "
import json; c = json.load(open('runs/models/smollm2-135m-instruct/config.json'))
drop = ('vocab_size', 'architectures', 'dtype', 'torch_dtype', 'transformers_version', '_model_name_or_path', 'unk_token_id')
json.dump({k: v for k, v in c.items() if k not in drop}, open('$shape/model_config.json', 'w'))" || exit 1
            fi
            for rows in 256 null; do  # the config's bound first (the goal's figure), then none (16 x 96 rows)
                python3 bench/bench_rl.py --config configs/grpo_smollm2_sort.yaml --batches 2 --warmup 1 --estimators exact \
                    $M.rl.micro_batch_rows=$rows $M.backbone.model=null "$M.backbone.model_config=$(cat $shape/model_config.json)" \
                    --data.init_args.tokenizer.name=$shape "${SORT[@]}" > "$OUT/memory_$rows.log" 2>&1
                echo "--- micro_batch_rows $rows: rc=$?"; grep "^|" "$OUT/memory_$rows.log" | tail -n 1
            done | tee "$OUT/memory.md" ;;
        bench)
            python3 bench/bench_rl.py --config configs/grpo_smollm2_arith.yaml --batches "${BENCH_BATCHES:-8}" \
                > "$OUT/bench_rl.log" 2>&1
            echo "--- bench: rc=$?"; grep "^|" "$OUT/bench_rl.log" | tee "$OUT/bench_rl.md" ;;
        *) echo "unknown part $part"; exit 2 ;;
    esac
done
