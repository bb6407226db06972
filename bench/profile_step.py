"""Where one compiled MDLM training step spends the GPU's time: kernel time by kind, the top kernels, and the idle
gaps between kernels (a CUDA-only torch profile, so no annotation ranges hide them), for the 1.24B model of
``bench_mdlm_step.py`` under ``lightning.Trainer``. The profile covers ``--profile`` steps after ``--warmup``. The
step before them lists where the host waits for the device (``torch.cuda.set_sync_debug_mode``: each sync's source
line), from the start of the batch to the end of the optimizer step. Under ``torchrun`` the step is FSDP2 over every
rank (as ``bench_mdlm_step.py`` runs it); rank 0 reports, with the communication kernels' time and the part of it
that no other kernel overlaps (exposed). ``--accumulate N`` makes a step N micro-batches (``--fsdp-defer-sync``,
``--fsdp-keep-gathered`` as in ``bench_mdlm_step.py``); ``--stacks`` also records Python stacks and attributes the idle
gaps to the host code that launched the work ending each (``_common.gap_sources``).

Usage (GPU)::

    python bench/profile_step.py --precision bf16-true --out $OUT/profile.md
    torchrun --nproc_per_node=2 bench/profile_step.py --precision bf16-true --out $OUT/profile_fsdp.md
    torchrun --nproc_per_node=2 bench/profile_step.py --accumulate 2 --fsdp-defer-sync --fsdp-keep-gathered --stacks
"""

from __future__ import annotations

import argparse
import collections
import time
import warnings

from _common import cuda_kernels, emit, environment_line, gap_sources_section, report
from bench_mdlm_step import (
    SyntheticBatches, keep_every_block_gathered, lightning_module, strategy_for_world, world_size,
)

import lightning as L
import torch
from torch.profiler import ProfilerActivity, profile


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--precision", default="bf16-true")
    parser.add_argument("--warmup", type=int, default=6)
    parser.add_argument("--profile", type=int, default=3)
    parser.add_argument("--out", default=None)
    parser.add_argument("--fp8", choices=["tensorwise", "rowwise"], default=None)
    parser.add_argument("--accumulate", type=int, default=1, help="micro-batches per optimizer step")
    parser.add_argument("--fsdp-defer-sync", action="store_true", help="parallelism.fsdp_defer_gradient_sync=True")
    parser.add_argument("--fsdp-keep-gathered", action="store_true", help="every FSDP2 block stays gathered")
    parser.add_argument("--stacks", action="store_true", help="attribute idle gaps to the host code (slower steps)")
    args = parser.parse_args()
    if args.fsdp_keep_gathered:
        keep_every_block_gathered()
    shape = argparse.Namespace(vocab=128256, hidden=2048, intermediate=8192, layers=16, heads=32, kv_heads=8,
                               seq=4096, untied=False, fsdp_defer_sync=args.fsdp_defer_sync, fsdp_prefetch=False,
                               fsdp_reduce_bf16=False)
    module = lightning_module(shape)
    # micro-batch indices: the profile covers whole optimizer steps
    first, last, state = args.warmup * args.accumulate, (args.warmup + args.profile) * args.accumulate - 1, {}

    class Profiled(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            if batch_idx == first - 1:
                state["caught"] = warnings.catch_warnings(record=True)
                state["syncs"] = state["caught"].__enter__()
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
            if batch_idx == first:
                activities = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if args.stacks else [])
                state["profile"] = profile(activities=activities, with_stack=args.stacks)
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

    steps, world = args.warmup + args.profile, world_size()
    strategy = strategy_for_world(shape, compile=True, fp8=args.fp8)
    trainer = L.Trainer(accelerator="gpu", devices=world, strategy=strategy, use_distributed_sampler=False,
                        precision=args.precision, max_steps=steps, logger=False,
                        accumulate_grad_batches=args.accumulate,
                        enable_checkpointing=False, limit_val_batches=0, num_sanity_val_steps=0,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[Profiled()])
    batches = SyntheticBatches(steps * args.accumulate, 4, shape.seq, shape.vocab)
    loader = torch.utils.data.DataLoader(batches, batch_size=None, pin_memory=True)
    trainer.fit(module, loader)
    if not trainer.is_global_zero:
        return
    kernels = cuda_kernels(state["profile"])
    where = f", FSDP2 over {world} GPUs (rank 0)" if world > 1 else ""
    options = {f"{args.accumulate} micro-batches a step": args.accumulate > 1, f"fp8 {args.fp8}": args.fp8,
               "fsdp_defer_sync": args.fsdp_defer_sync, "fsdp_keep_gathered": args.fsdp_keep_gathered}
    where += "".join(f", {option}" for option, chosen in options.items() if chosen)
    title = (f"# Compiled MDLM step profile, 1.24B, 4 x 4096{where}, {args.precision}\n\n{environment_line()}\n"
             f"{args.profile} profiled steps after {args.warmup}: {state['seconds'] / args.profile * 1e3:.1f} ms "
             f"a step under the profiler\n")
    syncs = collections.Counter(
        f"`{w.filename.split('site-packages/')[-1]}:{w.lineno}` {str(w.message).splitlines()[0][:60]}"
        for w in state["syncs"] if "synchronizing" in str(w.message))
    sync_table = ["", "| device sync (one step) | count |", "|---|---|"]
    sync_table += [f"| {k} | {n} |" for k, n in syncs.most_common()]
    stacks = gap_sources_section(state["profile"], args.profile) if args.stacks else ""
    emit(title + "\n" + report(kernels, args.profile) + "\n".join(sync_table) + stacks, args.out)


if __name__ == "__main__":
    main()
