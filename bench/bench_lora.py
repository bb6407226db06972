"""LoRA against full fine-tuning: ``MDLMModule`` on the 1.24B bench shape, both in one process, one table.

The shape is ``bench_mdlm_step``'s Llama-3.2-1B (hidden 2048, 16 layers, 32/8 heads, intermediate 8192, vocab 128256,
tied), batch 4 x 4096, random init, synthetic batches (``bench_mdlm_step.synthetic_batch``). Each row trains the module
under a real ``lightning.Trainer`` (``_common.fit_timed``; bf16-mixed on a GPU; ``lit_dllm.SingleDeviceStrategy``,
``compile`` on CUDA):

* ``full``: every parameter trains (AdamW over 1.24B parameters).
* ``lora``: ``lora={r, lora_alpha, target_modules}`` (default r 16, every linear layer of the blocks through PEFT,
  the embedding / tied LM head frozen): only the adapters train and sit in AdamW.

Columns: the step (batch start -> batch end: preparation, forward, loss, backward, optimizer, Lightning hooks) and
its forward + backward part (batch start -> ``on_before_optimizer_step``, both synchronised), median over the measured
steps; tokens/s of the step and of its forward + backward (the ``B·L`` tokens of the rows); trainable parameters; peak
allocated and reserved GPU memory. The issue's goal: LoRA's forward + backward tokens/s at least 90 % of full
fine-tuning's (the ``lora / full`` row). LoRA's adapters add ``2·r·(d_in + d_out)`` FLOPs per token and linear layer in
the forward (~1 % at r 16 on this shape) plus their backward, and save the base's weight gradients (a third of the
backward's matmuls), so its forward + backward should be faster, not slower, unless the adapters' small matmuls and
extra kernel launches dominate.

Usage::

    python bench/bench_lora.py --out $OUT/lora.md       # GPU (one H100 / H200): full, then LoRA, ~3 min
    python bench/bench_lora.py --rank 64 --variants lora
    python bench/bench_lora.py --tiny                    # CPU smoke test (~30 s on 2 cores)
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import traceback
import warnings

from _common import add_shape_arguments, emit, environment_line, fit_timed, markdown_table, sync
from bench_mdlm_step import SEED, free_memory, human, llama_kwargs, memory_stats, synthetic_batch

import lightning as L
import torch

import lit_dllm.parallel

VARIANTS = ("full", "lora")
GIB = 2**30


class Batches(torch.utils.data.Dataset):
    def __init__(self, args):
        self.args = args

    def __len__(self) -> int:
        return self.args.warmup + self.args.steps

    def __getitem__(self, i: int) -> dict:
        return synthetic_batch(i, self.args.batch, self.args.seq, self.args.vocab)


class ForwardBackwardTimer(L.Callback):
    """Synchronised time from each batch start to ``on_before_optimizer_step`` (the forward and the backward)."""

    def __init__(self, device: torch.device):
        self.device, self.start, self.times = device, 0.0, []

    def on_train_batch_start(self, *args) -> None:
        sync(self.device)
        self.start = time.perf_counter()

    def on_before_optimizer_step(self, *args) -> None:
        sync(self.device)
        self.times.append(time.perf_counter() - self.start)


def module_for(args, variant: str):
    from lit_dllm.settings import CausalBackbone
    from lit_dllm.families.mdlm.module import LLaDAGeneration, MDLMModule

    lora = None
    if variant == "lora":
        lora = {"r": args.rank, "lora_alpha": 2 * args.rank, "target_modules": args.targets}
    return MDLMModule(
        vocab_size=args.vocab, mask_token_id=args.vocab - 1, pad_token_id=0,
        backbone=CausalBackbone(model_config={"model_type": "llama", **llama_kwargs(args)}, attn_implementation="sdpa"),
        corruption="uniform", generation=LLaDAGeneration(val_generate_batches=0), noise_seed=SEED, lora=lora,
    )


def run(args, variant: str) -> dict:
    from lit_dllm import Parallelism, SingleDeviceStrategy

    torch.manual_seed(SEED)
    module = module_for(args, variant)
    free_memory(args.device)
    timer = ForwardBackwardTimer(args.device)
    strategy = SingleDeviceStrategy(parallelism=Parallelism(compile=args.compile))
    times = fit_timed(module, Batches(args), args.device, args.precision, callbacks=[timer], strategy=strategy)
    measured, tokens = times.steps[args.warmup:], args.batch * args.seq
    step, forward_backward = statistics.median(measured), statistics.median(timer.times[args.warmup:])
    trainable = sum(p.numel() for p in module.parameters() if p.requires_grad)
    result = {"step": step, "fwd_bwd": forward_backward, "tokens_per_s": tokens / step,
              "fwd_bwd_tokens_per_s": tokens / forward_backward, "trainable": trainable,
              "loss": f"{times.losses[0]:.3f} -> {times.losses[-1]:.3f}", **memory_stats(args.device)}
    del module
    return result


def table(args, results: dict[str, dict]) -> str:
    header = ["variant", "trainable", "step ms", "tokens/s", "fwd+bwd ms", "fwd+bwd tokens/s", "peak alloc GiB",
              "peak reserved GiB", "loss"]
    rows = []
    for variant, r in results.items():
        if "error" in r:
            rows.append([variant, r["error"], *["-"] * (len(header) - 2)])
            continue
        memory = [f"{r[k] / GIB:.1f}" if k in r else "-" for k in ("peak_alloc", "peak_reserved")]
        rows.append([variant, human(r["trainable"]), f"{r['step'] * 1e3:.1f}", f"{r['tokens_per_s']:,.0f}",
                     f"{r['fwd_bwd'] * 1e3:.1f}", f"{r['fwd_bwd_tokens_per_s']:,.0f}", *memory, r["loss"]])
    if all(v in results and "error" not in results[v] for v in VARIANTS):
        full, lora = results["full"], results["lora"]
        rows.append(["lora / full", "", "", f"{lora['tokens_per_s'] / full['tokens_per_s']:.3f}", "",
                     f"{lora['fwd_bwd_tokens_per_s'] / full['fwd_bwd_tokens_per_s']:.3f}", "", "", ""])
    shape = (f"hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, batch {args.batch} x {args.seq}, "
             f"{args.precision}, compile {args.compile}, LoRA r {args.rank} on {args.targets}")
    return f"## LoRA vs full fine-tuning (MDLMModule)\n\n{shape}\n\n" + markdown_table(header, rows)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_shape_arguments(parser)
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank (lora_alpha = 2 x rank)")
    parser.add_argument("--targets", default="all-linear", help="LoRA target_modules (PEFT's 'all-linear' or a name)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of {VARIANTS}")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke test: a 2-layer model, 3 steps")
    parser.add_argument("--out", default=None, help="also write the markdown table to this file")
    args = parser.parse_args()
    args.untied = False
    args.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    args.precision = "bf16-mixed" if args.device.type == "cuda" else "32-true"
    args.compile = args.device.type == "cuda"
    args.variants = args.variants.split(",")
    if args.tiny:
        args.hidden, args.layers, args.heads, args.kv_heads, args.intermediate = 64, 2, 4, 2, 256
        args.vocab, args.batch, args.seq, args.steps, args.warmup = 512, 2, 64, 3, 1
        torch.set_num_threads(1)  # tiny matmuls on a shared CPU: more threads wait for each other (timings are noise)
    return args


def main() -> None:
    args = parse_args()
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    lit_dllm.parallel.COMPILE_BACKEND = "inductor" if args.device.type == "cuda" else "aot_eager"
    print(environment_line(), flush=True)
    results = {}
    for variant in args.variants:
        try:
            results[variant] = run(args, variant)
        except torch.cuda.OutOfMemoryError as err:
            results[variant] = {"error": f"OOM: {' '.join(str(err).split())[:120]}"}
        except Exception as err:
            traceback.print_exc()
            results[variant] = {"error": f"{type(err).__name__}: {' '.join(str(err).split())[:160]}"}
    card = torch.cuda.get_device_name(0) if args.device.type == "cuda" else "cpu"
    emit(f"# LoRA vs full fine-tuning\n\n{environment_line()} (card {card})\n\n{table(args, results)}", args.out)


if __name__ == "__main__":
    main()
