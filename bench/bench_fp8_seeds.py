"""Does fp8 train as well as bf16? Issue 25's loss parity measured on training that learns, over several seeds.

The real-shaped parity test (``tests/test_fp8_cuda.py``) compares loss curves step by step against bf16's distance to
fp32, on a run whose loss does not fall: its verdict moved with the seed (docs/BENCHMARKS.md §13, eleventh session).
This bench asks the practical question instead. For each seed and precision (fp32, bf16-mixed, and bf16-mixed with
each ``--recipes`` fp8 recipe) ``MDLMModule`` trains on the data module's digit-reversal task, which it learns, then
scores the held-out set: ``val/loss`` (the seed sets the weights' init and the noise keys; the data are the same).

Printed per precision: each seed's validation loss, their mean and spread. The proposed criterion, per fp8 recipe,
paired by seed (the same init and noise, so the seeds' own spread cancels): ``|mean over seeds of (fp8 - bf16)| <= 2 x
mean over seeds of |bf16 - fp32|``: on average fp8 lands as close to bf16 as bf16 lands to fp32.

Usage::

    python bench/bench_fp8_seeds.py --out $OUT/fp8_seeds.md       # one H100 / H200 (torchao in .whl/)
    python bench/bench_fp8_seeds.py --cpu --seeds 2 --steps 30 --recipes tensorwise   # CPU smoke test, ~2 min: the CPU
                                                                   # float8 matmuls run without autocast, so there
                                                                   # the fp8 rows train in fp32 (no verdict to read)
"""

from __future__ import annotations

import argparse
import statistics

from _common import emit, environment_line, markdown_table

import lightning as L
import torch

import lit_dllm.core.token_loss as token_loss
from lit_dllm import DLLMDataModule, MDLMModule

CONFIG = {  # tests/test_compile_cuda.py's model: every projection a multiple of 16, so fp8 converts all seven
    "model_type": "llama", "hidden_size": 256, "intermediate_size": 1024, "num_hidden_layers": 4,
    "num_attention_heads": 8, "num_key_value_heads": 4, "max_position_embeddings": 64,
}


def val_loss(dm: DLLMDataModule, seed: int, precision: str, fp8: str | None, steps: int, accelerator: str) -> float:
    """``val/loss`` on ``dm``'s held-out reversals after ``steps`` steps from ``seed``."""
    L.seed_everything(seed, verbose=False)
    module = MDLMModule(vocab_size=len(dm.tokenizer), mask_token_id=dm.tokenizer.mask_token_id,
                        pad_token_id=dm.tokenizer.pad_token_id, eos_token_id=dm.tokenizer.eos_token_id,
                        model_config=CONFIG, noise_seed=seed, lr=1e-3, warmup=0.05, fp8=fp8, val_generate_batches=0,
                        compile=accelerator == "gpu")
    trainer = L.Trainer(accelerator=accelerator, devices=1, precision=precision, max_steps=steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, num_sanity_val_steps=0)
    trainer.fit(module, dm)
    trainer.limit_val_batches = 1.0
    return float(trainer.validate(module, dm, verbose=False)[0]["val/loss"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--recipes", default="tensorwise,rowwise")
    parser.add_argument("--cpu", action="store_true", help="a smoke test: float8 matmuls on the CPU, in fp32")
    parser.add_argument("--out", default=None, help="also write the markdown table to this file")
    args = parser.parse_args()
    accelerator = "cpu" if args.cpu else "gpu"
    if args.cpu:
        token_loss.check_fp8_device = lambda device: None  # the module refuses fp8 off CUDA; here that is the point
    runs = {"fp32": ("32-true", None), "bf16": ("bf16-mixed", None)}
    fp8_precision = "32-true" if args.cpu else "bf16-mixed"
    runs.update({f"fp8 {recipe}": (fp8_precision, recipe) for recipe in args.recipes.split(",") if recipe})
    seeds = range(args.seeds)
    dm = DLLMDataModule(data="task:reverse", task_kwargs={"min_len": 2, "max_len": 8}, batch_size=64, max_seq_len=32,
                        task_num_train=20000, task_num_val=256, val_batch_size=256)  # tokenised once, for every run
    scores = {name: [val_loss(dm, seed, precision, fp8, args.steps, accelerator) for seed in seeds]
              for name, (precision, fp8) in runs.items()}
    bf16, fp32 = scores["bf16"], scores["fp32"]
    bound = 2 * statistics.mean(abs(b - f) for b, f in zip(bf16, fp32))
    rows = []
    for name, values in scores.items():
        gap = abs(statistics.mean(v - b for v, b in zip(values, bf16)))
        verdict = f"{gap:.4f} {'<=' if gap <= bound else '>'} {bound:.4f}" if name.startswith("fp8") else ""
        spread = statistics.stdev(values) if len(values) > 1 else 0.0
        rows.append([name, " / ".join(f"{v:.4f}" for v in values), f"{statistics.mean(values):.4f}", f"{spread:.4f}",
                     verdict])
    table = markdown_table(["precision", "val/loss per seed", "mean", "std", "paired fp8 - bf16 vs bound"], rows)
    emit(f"{environment_line()}\n{args.steps} steps, seeds {list(seeds)}\n\n{table}", args.out)


if __name__ == "__main__":
    main()
