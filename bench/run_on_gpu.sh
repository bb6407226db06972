#!/usr/bin/env bash
# What we measure on the lent GPU machine, as named parts (each fits a call's 10-minute limit):
#   bash bench/run_on_gpu.sh tests tiny primitives   # every GPU test in one process (pytest -m gpu), the tiny config in
#                                                    # bf16-mixed, kernels + losses
#   bash bench/run_on_gpu.sh step                    # the ~1B-parameter MDLM step: lit_dllm vs a plain loop
#                                                    # (STEP_VARIANTS=a,b: only those rows, also for fsdp-step)
#   bash bench/run_on_gpu.sh long-context            # the ~1B MDLM step at batch 1 x 16k, 32k, 64k tokens (LONG_SEQS;
#                                                    # then LONG_SEQS="98304 131072" in a second call) with activation
#                                                    # checkpointing, eager and compiled: what one context-parallel rank
#                                                    # carries; one process per length, so an OOM ends only its row
#                                                    # (LONG_ATTN=flex_attention: FlexAttention's rows; the largest
#                                                    # that fits: bench_mdlm_step.py --seq N --steps 1 --warmup 1
#                                                    # --warmup-seq 4096 --variants lightning-ac with
#                                                    # PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True; the short
#                                                    # warm-up step makes Adam's states, which a first step lacks)
#   bash bench/run_on_gpu.sh cp-flex                 # Ulysses over FlexAttention equals one process (two ranks
#                                                    # sharing the GPU over gloo): the attention, each family's model
#   bash bench/run_on_gpu.sh cp-ring                 # ring attention on CUDA's flash kernel (bf16) equals one
#                                                    # process's (two ranks sharing the GPU over gloo)
#   bash bench/run_on_gpu.sh fsdp                    # 2 GPUs: FSDP2 step equals the single-process gradient
#   bash bench/run_on_gpu.sh fsdp-step               # 2 GPUs: the ~1B step on one GPU, then FSDP2 over two
#   bash bench/run_on_gpu.sh fsdp-accumulate         # 2 GPUs: the ~1B step, 2 micro-batches a step: one GPU, then
#                                                    # FSDP2 synced per micro-batch, deferred, deferred + kept gathered,
#                                                    # and that prefetching the next step (fsdp_prefetch_next_step)
#                                                    # (STEP_VARIANTS: one variant, default lightning-bf16-true-compile)
#   bash bench/run_on_gpu.sh bf16-reduce             # 2 GPUs: the accumulated ~1B step (deferred, kept gathered,
#                                                    # prefetching) reducing in fp32, then in bf16 (fsdp_reduce_dtype),
#                                                    # one GPU beside them; then the Gemma MoE step both ways
#   bash bench/run_on_gpu.sh packing-tests loader    # packed rows' GPU tests (flex = dense); the streaming loader
#                                                    # alone over 256 MB and 1 GB corpora (LOADER_SIZES_MB, _WORKERS,
#                                                    # _MAX_SECONDS: a partial pass of a larger one)
#   bash bench/run_on_gpu.sh packing                 # the ~1B MDLM step on GSM8K-length data: padded, length-grouped,
#                                                    # packed (dense document mask; FlexAttention block mask)
#   bash bench/run_on_gpu.sh dflash                  # DFlash draft step (Qwen3-8B-shaped target): lit_dllm vs a plain loop
#   bash bench/run_on_gpu.sh dflash-fsdp             # 2 GPUs: DFlash FSDP2 losses equal one process's; flex backward
#   bash bench/run_on_gpu.sh families                # hybrid, CausalLM, Gemma steps: Trainer eager / compile=True vs plain loops
#   bash bench/run_on_gpu.sh lora                    # LoRA vs full fine-tuning of the 1.24B MDLM step (needs peft's wheel in .whl/)
#   bash bench/run_on_gpu.sh samplers                # LLaDA vs the fast sampler on a trained demo MDLM (SAMPLERS_CKPT)
#   bash bench/run_on_gpu.sh lora-fsdp               # 2 GPUs: FSDP2 + LoRA update equals one process's; merged export
#   bash bench/run_on_gpu.sh fp8                     # fp8 tests (losses within bf16 noise), then the ~1B MDLM step
#                                                    # (fp8-tests, fp8-step: one half each):
#                                                    # lightning-compile vs its fp8 tensorwise and rowwise rows
#                                                    # (needs torchao's wheel in .whl/: pip download torchao==0.18.0
#                                                    # --no-deps -d .whl; over 2 GPUs: STEP_VARIANTS=lightning-compile,
#                                                    # lightning-compile-fp8-tensorwise bash bench/run_on_gpu.sh fsdp-step)
#   bash bench/run_on_gpu.sh fp8-families            # lightning-compile vs its fp8 tensorwise and rowwise rows:
#                                                    # the DFlash step, then hybrid, CausalLM, Gemma (torchao in .whl/)
#   bash bench/run_on_gpu.sh moe-profile             # MOE_GPUS GPUs (default 4): the MoE step on DiffusionGemma 26B-A4B's
#                                                    # layer shapes (4 layers) in the best layout measured (compiled, flex,
#                                                    # kept gathered, reduced in bf16; MOE_VARIANTS: other rows):
#                                                    # step times, then where each row's GPU time goes (2 profiled steps)
#   bash bench/run_on_gpu.sh moe-accumulate          # MOE_GPUS GPUs (default 2): the Gemma step with 1 (also timed back to
#                                                    # back) and 4 micro-batches (fsdp_defer_gradient_sync), the small
#                                                    # Qwen3-MoE at 4 and 16 x 2048
#   bash bench/run_on_gpu.sh flex-tests              # FlexAttention block masks: compiled flex vs SDPA at 26B-A4B's
#                                                    # head dims (256, 512), then the tiny Gemma step's loss + gradients
#   bash bench/run_on_gpu.sh flex-step               # 2 GPUs: the Gemma MoE step (4 layers), compiled, balanced, dense
#                                                    # masks vs FlexAttention block masks, each row then profiled
# Optional selectors: FAMILIES=hybrid,causal (families and fp8-families parts),
# DFLASH_VARIANTS=plain,lightning-compile (dflash part), MOE_GPUS=2 (moe-profile part: GPUs, also the EP size),
# MOE_VARIANTS (moe-profile part: bench_moe_step.py's --variants).
# The image lacks datasets and jsonargparse: their wheels travel in .whl/ (see the device notes).
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
if [ -d .whl ] && [ ! -f /tmp/site/.whl.installed ]; then  # once per machine (several parts may run at once)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && touch /tmp/site/.whl.installed || exit 1
fi
export PYTHONPATH="$PWD:/tmp/site" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
python3 -c "import torch, transformers, lightning, datasets; print('torch', torch.__version__, '| transformers', transformers.__version__, '| lightning', lightning.__version__, '| datasets', datasets.__version__, '|', torch.cuda.device_count(), 'x', torch.cuda.get_device_name())"

# the ~1B MDLM step with 2 micro-batches a step, one variant ($STEP_VARIANTS), as a named row: step_run NAME LAUNCHER [OPTION...]
step_run() { local name=$1 launcher=$2; shift 2; timeout 130 $launcher bench/bench_mdlm_step.py \
    --variants "${STEP_VARIANTS:-lightning-bf16-true-compile}" --accumulate 2 "$@" --out "$OUT/$name.md" > "$OUT/$name.log" 2>&1
    echo "$name rc=$?"; tail -n 1 "$OUT/$name.md" 2>/dev/null; }

parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(tests tiny primitives)
for part in "${parts[@]}"; do
    echo "=== $part"
    case "$part" in
    tests)
        timeout 540 python3 -m pytest -q -p no:cacheprovider -m gpu tests -rs 2>&1 | tail -n 30 ;;
    tiny)
        start=$(date +%s)
        timeout 300 python3 train.py fit --config configs/mdlm_tiny.yaml --trainer.accelerator=gpu \
            --trainer.devices=1 --trainer.precision=bf16-mixed --trainer.enable_progress_bar=false \
            --trainer.logger.init_args.save_dir="$OUT/runs" > "$OUT/tiny_gpu.log" 2>&1
        echo "tiny config on GPU, bf16-mixed: rc=$? wall=$(( $(date +%s) - start ))s"
        grep -A12 "Finished after" "$OUT/tiny_gpu.log" ;;
    primitives)
        timeout 240 python3 bench/bench_primitives.py --device cuda --out "$OUT/primitives.md" > "$OUT/primitives.log" 2>&1
        echo "primitives rc=$?"; cat "$OUT/primitives.md" 2>/dev/null || tail -n 30 "$OUT/primitives.log" ;;
    step)
        timeout 560 python3 bench/bench_mdlm_step.py ${STEP_VARIANTS:+--variants $STEP_VARIANTS} --out "$OUT/mdlm_step.md" > "$OUT/mdlm_step.log" 2>&1
        echo "mdlm step rc=$?"
        grep -E "attention check|parameters:|MFU peak|Error|error" "$OUT/mdlm_step.log" | head -n 20
        cat "$OUT/mdlm_step.md" 2>/dev/null || tail -n 40 "$OUT/mdlm_step.log" ;;
    long-context)  # SDPA: unpacked bidirectional rows take no mask, so its flash kernel runs (a full row's FlexAttention
                   # block mask skips no tile); the largest length with a time is the largest that fits
        for seq in ${LONG_SEQS:-16384 32768 65536}; do
            timeout 280 python3 bench/bench_mdlm_step.py --batch 1 --seq "$seq" --steps "${LONG_STEPS:-5}" \
                --warmup "${LONG_WARMUP:-2}" \
                --variants "${STEP_VARIANTS:-lightning-ac,lightning-compile-ac}" --attn "${LONG_ATTN:-sdpa}" \
                --out "$OUT/long_context_$seq.md" > "$OUT/long_context_$seq.log" 2>&1
            echo "seq $seq rc=$?"; tail -n 2 "$OUT/long_context_$seq.md" 2>/dev/null || tail -n 5 "$OUT/long_context_$seq.log"
        done ;;
    cp-flex)
        timeout 280 python3 -m pytest -q -p no:cacheprovider tests/test_context_parallel.py -k flex -rs 2>&1 | tail -n 8 ;;
    cp-ring)
        timeout 280 python3 -m pytest -q -p no:cacheprovider tests/test_context_parallel.py -k cuda_flash -rs 2>&1 \
            | tail -n 8 ;;
    packing-tests)  # packed rows on the GPU: FlexAttention document masks against the dense ones, every family
        timeout 300 python3 -m pytest -q -p no:cacheprovider tests/families/test_packing.py \
            tests/families/dflash/test_packing.py tests/families/dflash/test_masks.py -rs 2>&1 | tail -n 8 ;;
    loader)  # the streaming loader alone on the host's cores: tokens/s and memory as the corpus grows
        timeout 560 python3 bench/bench_loader.py --sizes-mb ${LOADER_SIZES_MB:-256 1024} --workers ${LOADER_WORKERS:-14} \
            --shards 16 ${LOADER_MAX_SECONDS:+--max-seconds $LOADER_MAX_SECONDS} \
            --tmp /tmp --out "$OUT/loader.md" > "$OUT/loader.log" 2>&1
        echo "loader rc=$?"; cat "$OUT/loader.md" 2>/dev/null || tail -n 20 "$OUT/loader.log" ;;
    packing)
        timeout 560 python3 bench/bench_packing.py ${PACKING_VARIANTS:+--variants $PACKING_VARIANTS} --out "$OUT/packing.md" > "$OUT/packing.log" 2>&1
        echo "packing rc=$?"; cat "$OUT/packing.md" 2>/dev/null || grep -vE "Warning|warn" "$OUT/packing.log" | tail -n 30 ;;
    fsdp)
        timeout 200 torchrun --nproc_per_node=2 tests/multigpu/check_fsdp_step.py > "$OUT/fsdp.log" 2>&1
        echo "fsdp check rc=$?"; grep -E "PASS|FAIL|difference|Error" "$OUT/fsdp.log" | head -n 20 ;;
    fsdp-step)  # the 1.24B step on one GPU, then FSDP2 over two, same machine
        lightning_variants=${STEP_VARIANTS:-lightning-compile,lightning-bf16-true-compile}
        timeout 200 python3 bench/bench_mdlm_step.py --variants $lightning_variants --out "$OUT/one_gpu_step.md" > "$OUT/one_gpu_step.log" 2>&1
        echo "one GPU rc=$?"; tail -n 4 "$OUT/one_gpu_step.md"
        timeout 300 torchrun --nproc_per_node=2 bench/bench_mdlm_step.py --variants $lightning_variants --out "$OUT/fsdp_step.md" > "$OUT/fsdp_step.log" 2>&1
        echo "FSDP2 over 2 GPUs rc=$?"; tail -n 4 "$OUT/fsdp_step.md" 2>/dev/null || grep -E "Error|error" "$OUT/fsdp_step.log" | tail -n 5 ;;
    fsdp-accumulate)  # 2 GPUs: the 1.24B step with 2 micro-batches a step on one GPU, then FSDP2 over two: each
        # micro-batch synced, one sync a step (fsdp_defer_gradient_sync), that with every block kept gathered, and
        # that prefetching the next step's first all-gathers (fsdp_prefetch_next_step)
        step_run accumulate_one_gpu python3
        step_run accumulate_fsdp "torchrun --nproc_per_node=2"
        step_run accumulate_fsdp_deferred "torchrun --nproc_per_node=2" --fsdp-defer-sync
        step_run accumulate_fsdp_deferred_gathered "torchrun --nproc_per_node=2" --fsdp-defer-sync --fsdp-keep-gathered
        step_run accumulate_fsdp_deferred_gathered_prefetch "torchrun --nproc_per_node=2" --fsdp-defer-sync \
            --fsdp-keep-gathered --fsdp-prefetch ;;
    bf16-reduce)
        fsdp_options="--fsdp-defer-sync --fsdp-keep-gathered --fsdp-prefetch"
        step_run reduce_one_gpu python3
        step_run reduce_fp32 "torchrun --nproc_per_node=2" $fsdp_options
        step_run reduce_bf16 "torchrun --nproc_per_node=2" $fsdp_options --fsdp-reduce-bf16
        timeout 300 torchrun --nproc_per_node=2 bench/bench_moe_step.py --family gemma --layers 4 --ep 2 --steps 5 \
            --variants fsdp+compile+flex+gathered,fsdp+compile+flex+gathered+bf16reduce --out "$OUT/gemma_reduce.md" \
            > "$OUT/gemma_reduce.log" 2>&1
        echo "gemma reduce rc=$?"; tail -n 2 "$OUT/gemma_reduce.md" 2>/dev/null ;;
    dflash)
        timeout 400 python3 bench/bench_dflash_step.py ${DFLASH_VARIANTS:+--variants "$DFLASH_VARIANTS"} --out "$OUT/dflash_step.md" > "$OUT/dflash_step.log" 2>&1
        echo "dflash step rc=$?"; grep -E "MFU peak|target Qwen3|Error" "$OUT/dflash_step.log" | head -n 10
        cat "$OUT/dflash_step.md" 2>/dev/null || tail -n 40 "$OUT/dflash_step.log" ;;
    dflash-fsdp)
        timeout 240 torchrun --nproc_per_node=2 tests/multigpu/check_dflash_parallel.py > "$OUT/dflash_fsdp.log" 2>&1
        echo "dflash fsdp check rc=$?"; grep -vE "Warning|warn|^ *$" "$OUT/dflash_fsdp.log" | tail -n 14
        timeout 150 python3 -m pytest -q -p no:cacheprovider tests/families/dflash/test_dflash.py -k flex 2>&1 | tail -n 4 ;;
    families)  # one table per family, written after each one: a run cut short keeps the finished tables
        timeout 480 python3 bench/bench_families.py ${FAMILIES:+--family "$FAMILIES"} --out "$OUT/families.md" > "$OUT/families.log" 2>&1
        echo "families rc=$?"; grep -E "MFU peak|FLOPs/step|Error" "$OUT/families.log" | head -n 20
        cat "$OUT/families.md" 2>/dev/null || tail -n 40 "$OUT/families.log" ;;
    lora)
        timeout 540 python3 bench/bench_lora.py --out "$OUT/lora.md" > "$OUT/lora.log" 2>&1
        echo "lora rc=$?"; cat "$OUT/lora.md" 2>/dev/null || tail -n 40 "$OUT/lora.log" ;;
    samplers)  # LLaDA against the fast sampler on the demo's MDLM (SAMPLERS_CKPT: a trained mdlm_tiny checkpoint)
        timeout 400 python3 bench/bench_samplers.py --device cuda --repeats 3 --thresholds 0.9,0.7 \
            --ckpt "${SAMPLERS_CKPT:-runs/demo_mdlm_3000.ckpt}" > "$OUT/samplers_demo.log" 2>&1
        echo "samplers rc=$?"; grep -E "^\||prompts|Error" "$OUT/samplers_demo.log" ;;
    fp8|fp8-tests|fp8-step)  # fp8-tests and fp8-step: one half each
        [ "$part" = fp8-step ] || timeout 560 python3 -m pytest -q -p no:cacheprovider -rs -s tests/test_fp8_cuda.py \
            2>&1 | grep -E "passed|failed|Error|bf16 vs fp32|SKIPPED" | tail -n 12
        [ "$part" = fp8-tests ] && continue
        timeout 380 python3 bench/bench_mdlm_step.py --variants lightning-compile,lightning-compile-fp8-tensorwise,lightning-compile-fp8-rowwise \
            --out "$OUT/fp8_step.md" > "$OUT/fp8_step.log" 2>&1
        echo "fp8 step rc=$?"; grep -E "MFU peak|Error" "$OUT/fp8_step.log" | head -n 10
        cat "$OUT/fp8_step.md" 2>/dev/null || tail -n 40 "$OUT/fp8_step.log" ;;
    fp8-families)  # DFlash first (its table is written at the end), families in the rest of 550 s (kept per family)
        fp8_variants=lightning-compile,lightning-compile-fp8-tensorwise,lightning-compile-fp8-rowwise
        start=$(date +%s)
        timeout 220 python3 bench/bench_dflash_step.py --variants $fp8_variants --out "$OUT/fp8_dflash.md" \
            > "$OUT/fp8_dflash.log" 2>&1
        echo "fp8 dflash rc=$?"; grep -E "MFU peak|Error" "$OUT/fp8_dflash.log" | head -n 10
        cat "$OUT/fp8_dflash.md" 2>/dev/null || tail -n 40 "$OUT/fp8_dflash.log"
        timeout $(( 550 - ($(date +%s) - start) )) python3 bench/bench_families.py ${FAMILIES:+--family "$FAMILIES"} \
            --variants $fp8_variants --out "$OUT/fp8_families.md" > "$OUT/fp8_families.log" 2>&1
        echo "fp8 families rc=$? wall=$(( $(date +%s) - start ))s"
        grep -E "MFU peak|FLOPs/step|Error" "$OUT/fp8_families.log" | head -n 20
        cat "$OUT/fp8_families.md" 2>/dev/null || tail -n 40 "$OUT/fp8_families.log" ;;
    moe-profile)  # the table and the profiles are written at the end; the log keeps each finished row's step time
        timeout 560 torchrun --nproc_per_node=${MOE_GPUS:-4} bench/bench_moe_step.py --family gemma --layers 4 \
            --ep ${MOE_GPUS:-4} --variants "${MOE_VARIANTS:-fsdp+compile+flex+gathered+bf16reduce}" --steps 5 --profile 2 \
            --out "$OUT/moe_profile.md" > "$OUT/moe_profile.log" 2>&1
        echo "moe profile rc=$?"
        cat "$OUT/moe_profile.md" 2>/dev/null || grep -vE "Warning|warn" "$OUT/moe_profile.log" | tail -n 40 ;;
    moe-accumulate)  # MOE_GPUS GPUs (default 2): the Gemma step with 1 and 4 micro-batches (the sync deferred), then the
        # small Qwen3-MoE at 4 x 2048 and 16 x 2048 tokens per GPU (docs/BENCHMARKS.md §14, sixteenth session)
        n=${MOE_GPUS:-2}; gemma="--family gemma --layers 4 --ep $n --steps 5"; best=fsdp+compile+flex+gathered+bf16reduce
        for run in "gemma_1:$gemma --unsynchronised --variants $best" "gemma_4:$gemma --accumulate 4 --variants $best+defer" \
                   "qwen_4x2048:--family mdlm --ep $n --variants fsdp+compile+gathered+bf16reduce" \
                   "qwen_16x2048:--family mdlm --ep $n --batch 16 --variants fsdp+compile+gathered+bf16reduce"; do
            name=${run%%:*}
            timeout 200 torchrun --nproc_per_node=$n bench/bench_moe_step.py ${run#*:} --out "$OUT/$name.md" \
                > "$OUT/$name.log" 2>&1
            echo "$name rc=$?"; grep "^| FSDP" "$OUT/$name.md" 2>/dev/null
        done ;;
    flex-tests)
        timeout 540 python3 -m pytest -q -s -p no:cacheprovider tests/families/diffusion_gemma/test_flex_attention_cuda.py \
            tests/families/diffusion_gemma/test_diffusion_gemma.py -k "flex" -rs 2>&1 | tee "$OUT/flex_tests.log" \
            | grep -E "passed|failed|Error|relative|ms|SKIPPED" | tail -n 60 ;;
    flex-step)
        timeout 560 torchrun --nproc_per_node=2 bench/bench_moe_step.py --family gemma --layers 4 --ep 2 \
            --variants fsdp+compile+balanced,fsdp+compile+balanced+flex --steps 5 --profile 1 \
            --out "$OUT/flex_step.md" > "$OUT/flex_step.log" 2>&1
        echo "flex step rc=$?"
        cat "$OUT/flex_step.md" 2>/dev/null || grep -vE "Warning|warn" "$OUT/flex_step.log" | tail -n 40 ;;
    lora-fsdp)
        timeout 240 torchrun --nproc_per_node=2 tests/multigpu/check_lora_parallel.py > "$OUT/lora_fsdp.log" 2>&1
        echo "lora fsdp check rc=$?"; grep -E "PASS|FAIL|difference|moved|Error" "$OUT/lora_fsdp.log" | head -n 20 ;;
    esac
done
