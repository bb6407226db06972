#!/usr/bin/env bash
# Everything we measure on the lent GPU machine, in two calls that each fit its 10-minute limit:
#   bash bench/run_on_gpu.sh checks   # GPU tests, the tiny config in bf16-mixed, the primitives bench
#   bash bench/run_on_gpu.sh step     # the ~1B-parameter MDLM step: lit_dllm vs a plain PyTorch loop
# The image lacks datasets and jsonargparse: their wheels travel in .whl/ (see the device notes).
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
python3 -c "import torch, transformers, lightning, datasets, pyarrow; print('torch', torch.__version__, '| transformers', transformers.__version__, '| lightning', lightning.__version__, '| datasets', datasets.__version__, '| pyarrow', pyarrow.__version__, '|', torch.cuda.get_device_name())"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader

case "${1:-checks}" in
checks)
    timeout 200 python3 -m pytest -q -p no:cacheprovider tests --ignore=tests/test_notebook.py -x \
        -k "gpu or cuda or bidirectional or fused or training_step or corruption" 2>&1 | tail -n 4
    start=$(date +%s)
    timeout 240 python3 train.py fit --config configs/mdlm_tiny.yaml --trainer.accelerator=gpu \
        --trainer.precision=bf16-mixed --trainer.enable_progress_bar=false \
        --trainer.logger.init_args.save_dir="$OUT/runs" > "$OUT/tiny_gpu.log" 2>&1
    echo "tiny config on GPU, bf16-mixed: rc=$? wall=$(( $(date +%s) - start ))s"
    grep -A12 "Finished after" "$OUT/tiny_gpu.log"
    timeout 240 python3 bench/bench_primitives.py --device cuda --out "$OUT/primitives.md" > "$OUT/primitives.log" 2>&1
    echo "primitives rc=$?"; cat "$OUT/primitives.md" 2>/dev/null || tail -n 30 "$OUT/primitives.log"
    ;;
step)
    timeout 560 python3 bench/bench_mdlm_step.py --out "$OUT/mdlm_step.md" > "$OUT/mdlm_step.log" 2>&1
    echo "mdlm step rc=$?"
    grep -E "attention check|parameters:|MFU peak|Error|error" "$OUT/mdlm_step.log" | head -n 20
    cat "$OUT/mdlm_step.md" 2>/dev/null || tail -n 40 "$OUT/mdlm_step.log"
    ;;
esac
