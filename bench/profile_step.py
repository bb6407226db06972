"""Where one compiled MDLM training step spends the GPU's time: kernel time by kind, the top kernels, and the idle
gaps between kernels (a CUDA-only torch profile, so no annotation ranges hide them), for the 1.24B model of
``bench_mdlm_step.py`` under ``lightning.Trainer``. The profile covers ``--profile`` steps after ``--warmup``. The
step before them lists where the host waits for the device (``torch.cuda.set_sync_debug_mode``: each sync's source
line), from the start of the batch to the end of the optimizer step.

Usage (GPU)::

    python bench/profile_step.py --precision bf16-true --out $OUT/profile.md
"""

from __future__ import annotations

import argparse
import collections
import time
import warnings

from _common import emit, environment_line
from bench_mdlm_step import SyntheticBatches, llama_kwargs

import lightning as L
import torch
from torch.profiler import ProfilerActivity, profile

from lit_dllm.modules.mdlm import MDLMModule

KINDS = {  # the first whose key is in the kernel's name
    "attention": ("flash", "fmha", "cudnn", "attention"),
    "gemm": ("gemm", "nvjet", "cutlass", "xmma", "sm90_"),
    "optimizer": ("adam", "multi_tensor"),
    "inductor (triton)": ("triton",),
    "copies": ("memcpy", "memset"),
}


def kind(name: str) -> str:
    name = name.lower()
    return next((k for k, keys in KINDS.items() if any(key in name for key in keys)), "other")


def size_class(gap_us: float) -> str:
    return "< 20 µs" if gap_us < 20 else "20-100 µs" if gap_us < 100 else "0.1-1 ms" if gap_us < 1000 else "> 1 ms"


def report(kernels: list[tuple[float, float, str]], steps: int) -> str:
    """Kernel time by kind and name, idle gaps by size and by the kernels around them, per step (µs inputs)."""
    by_kind, by_name = collections.Counter(), collections.Counter()
    for start, end, name in kernels:
        by_kind[kind(name)] += end - start
        by_name[f"`{name[:80]}`"] += end - start
    gaps, sizes, finished, previous = collections.Counter(), collections.Counter(), kernels[0][1], kernels[0][2]
    for start, end, name in kernels[1:]:
        if start > finished:
            gaps[f"`{previous[:40]}` → `{name[:40]}`"] += start - finished
            sizes[size_class(start - finished)] += start - finished
        if end >= finished:
            finished, previous = end, name

    def ms(us: float) -> str:
        return f"{us / 1e3 / steps:.2f}"

    def table(title: str, rows) -> list[str]:
        return ["", f"| {title} | ms/step |", "|---|---|"] + [f"| {key} | {ms(us)} |" for key, us in rows]

    span = kernels[-1][1] - kernels[0][0]
    return "\n".join(
        [f"per step: span {ms(span)} ms, kernels {ms(sum(by_kind.values()))} ms, idle {ms(sum(gaps.values()))} ms"]
        + table("kernel kind", by_kind.most_common()) + table("top kernels", by_name.most_common(15))
        + table("idle gaps by size", sizes.most_common()) + table("idle between", gaps.most_common(12))
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--precision", default="bf16-true")
    parser.add_argument("--warmup", type=int, default=6)
    parser.add_argument("--profile", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    shape = argparse.Namespace(vocab=128256, hidden=2048, intermediate=8192, layers=16, heads=32, kv_heads=8,
                               seq=4096, untied=False)
    module = MDLMModule(vocab_size=shape.vocab, mask_token_id=shape.vocab - 1, pad_token_id=0,
                        model_config={"model_type": "llama", **llama_kwargs(shape)}, attn_implementation="sdpa",
                        corruption="uniform", fused_loss=True, compile=True, val_generate_batches=0, noise_seed=42)
    first, last, state = args.warmup, args.warmup + args.profile - 1, {}

    class Profiled(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            if batch_idx == first - 1:
                state["caught"] = warnings.catch_warnings(record=True)
                state["syncs"] = state["caught"].__enter__()
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
            if batch_idx == first:
                state["profile"] = profile(activities=[ProfilerActivity.CUDA])
                state["profile"].__enter__()
                state["start"] = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if batch_idx == first - 1:
                torch.cuda.set_sync_debug_mode(0)
                state["caught"].__exit__(None, None, None)
            if batch_idx == last:
                torch.cuda.synchronize()
                state["seconds"] = time.perf_counter() - state["start"]
                state["profile"].__exit__(None, None, None)

    steps = last + 1
    trainer = L.Trainer(accelerator="gpu", devices=1, precision=args.precision, max_steps=steps, logger=False,
                        enable_checkpointing=False, limit_val_batches=0, num_sanity_val_steps=0,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[Profiled()])
    loader = torch.utils.data.DataLoader(SyntheticBatches(steps, 4, shape.seq, shape.vocab), batch_size=None,
                                         pin_memory=True)
    trainer.fit(module, loader)
    kernels = sorted((e.time_range.start, e.time_range.end, e.name) for e in state["profile"].events()
                     if e.device_type == torch.autograd.DeviceType.CUDA)
    title = (f"# Compiled MDLM step profile, 1.24B, 4 x 4096, {args.precision}\n\n{environment_line()}\n"
             f"{args.profile} profiled steps after {args.warmup}: {state['seconds'] / args.profile * 1e3:.1f} ms "
             f"a step under the profiler\n")
    syncs = collections.Counter(f"`{w.filename.split('site-packages/')[-1]}:{w.lineno}` {str(w.message).splitlines()[0][:60]}"
                                for w in state["syncs"] if "synchronizing" in str(w.message))
    sync_table = ["", "| device sync (one step) | count |", "|---|---|"] + [f"| {k} | {n} |" for k, n in syncs.most_common()]
    emit(title + "\n" + report(kernels, args.profile) + "\n".join(sync_table), args.out)


if __name__ == "__main__":
    main()
