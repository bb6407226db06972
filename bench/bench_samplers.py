"""The LLaDA sampler against the Fast-dLLM one (threshold decoding, prefix / dual KV cache) on a trained MDLM.

Trains the MDLM of ``--config`` (default: the tiny digit-reversal demo, ``configs/mdlm_tiny.yaml``) for ``--steps``
steps, or loads ``--ckpt`` when that file exists (a fresh training is saved there), then answers the first held-out
batch (the demo: all 256 prompts; ``configs/mdlm_smollm2_gsm8k.yaml``: all 219) on ``--device`` with each sampler at
the config's ``gen_length`` and prints a markdown table: wall-clock and process CPU time (each the best
of ``--repeats``; CPU time is the steadier on a shared machine), model passes (full or windowed), exact match, and
agreement with the LLaDA answers of the same block length. ``--trace`` adds each sampler again recording a
:class:`~lit_dllm.core.trace.DenoisingTrace` (the "trace" column); the rows without it are the samplers as they run
when no trace is asked for.

    python bench/bench_samplers.py --ckpt runs/bench_samplers.ckpt
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import time

import _common  # noqa: F401  (puts the checkout on sys.path)
import torch
import yaml

from lit_dllm import DenoisingTrace, DLLMDataModule, MDLMModule
from lit_dllm.cli import main
from lit_dllm.families.mdlm import fast_sampler

CACHES = ("none", "prefix", "dual", "dual-eager")
"""The fast sampler's rows for each threshold (after the LLaDA row, for each block length); ``dual-eager``: the dual
cache without its CUDA graph (the same as ``dual`` off CUDA)."""


def trained(config: str, steps: int, ckpt: str | None) -> tuple[MDLMModule, DLLMDataModule]:
    if ckpt and os.path.exists(ckpt):
        data = DLLMDataModule(**yaml.safe_load(open(config))["data"]["init_args"])
        data.prepare_data()
        model = MDLMModule.load_from_checkpoint(ckpt, map_location="cpu")
        model.tokenizer = data.tokenizer
        return model, data
    cli = main(["fit", "--config", config, f"--trainer.max_steps={steps}", "--trainer.limit_val_batches=0",
                "--trainer.logger.init_args.name=bench_samplers"])
    if ckpt:
        cli.trainer.save_checkpoint(ckpt)
    return cli.model, cli.datamodule


def answer(model: MDLMModule, batch: dict, repeats: int, graphs: bool,
           traced: bool = False) -> tuple[float, float, int, list[dict]]:
    """Best wall-clock and CPU seconds of ``repeats`` runs, model passes of one run (a CUDA graph's replay is one; its
    warm-up and capture are not counted), and the answered rows. ``graphs``: whether the dual cache's window pass
    may run as a CUDA graph; ``traced``: each run records a denoising trace."""
    forwards, capturing = [], []
    hook = model.model.hf.register_forward_pre_hook(lambda *_: None if capturing else forwards.append(1))
    init, replay = fast_sampler.GraphedWindow.__init__, fast_sampler.GraphedWindow.__call__
    fast_sampler.GraphedWindow.__init__ = lambda *a: capturing.append(1) or init(*a) or capturing.clear()
    fast_sampler.GraphedWindow.__call__ = lambda *a: forwards.append(1) or replay(*a)
    apply, fast_sampler.graphs_apply = fast_sampler.graphs_apply, (fast_sampler.graphs_apply if graphs
                                                                     else lambda *_: False)
    walls, cpus = [], []
    try:
        for _ in range(repeats):
            forwards.clear()
            wall, cpu = time.perf_counter(), time.process_time()
            rows = model.answer_batch(batch, DenoisingTrace() if traced else None)
            walls.append(time.perf_counter() - wall)
            cpus.append(time.process_time() - cpu)
    finally:
        hook.remove()
        fast_sampler.GraphedWindow.__init__, fast_sampler.GraphedWindow.__call__ = init, replay
        fast_sampler.graphs_apply = apply
    return min(walls), min(cpus), len(forwards), rows


def main_bench() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/mdlm_tiny.yaml")
    parser.add_argument("--steps", type=int, default=1500, help="training steps when --ckpt is not there")
    parser.add_argument("--ckpt", help="checkpoint to load, or where to save the one trained here")
    parser.add_argument("--block-lengths", default="10,5", help="gen_block_length values (divide gen_length)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu", help="where the samplers run (cpu, cuda)")
    parser.add_argument("--thresholds", default="0.9", help="the fast sampler's gen_threshold values")
    parser.add_argument("--caches", default=",".join(CACHES), help="the fast sampler's gen_cache values")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="the weights' dtype")
    parser.add_argument("--trace", action="store_true", help="also time each sampler recording a denoising trace")
    args = parser.parse_args()
    torch.manual_seed(0)
    model, data = trained(args.config, args.steps, args.ckpt)
    data.setup("validate")
    batch = next(iter(data.val_dataloader()))
    model.to(args.device, dtype=getattr(torch, args.dtype)).eval()
    where = torch.cuda.get_device_name() if model.device.type == "cuda" else f"{torch.get_num_threads()} CPU threads"
    print(f"{len(batch['input_ids'])} prompts, gen_length {model.generation.gen_length}, {args.dtype}, {where}\n")
    print("| sampler | block | threshold | cache | trace | wall s | CPU s | forwards | exact match | = llada |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    settings = [("llada", None, None)] + [("fast", float(threshold), cache)
                                          for threshold in args.thresholds.split(",") for cache in args.caches.split(",")]
    for block in [int(b) for b in args.block_lengths.split(",")]:
        reference = None
        for (sampler, threshold, cache), traced in itertools.product(settings, [False, True] if args.trace else [False]):
            model.generation = dataclasses.replace(model.generation, sampler=sampler, gen_block_length=block,
                                                   gen_steps=None, gen_threshold=threshold or 0.9,
                                                   gen_cache=(cache or "prefix").removesuffix("-eager"))
            wall, cpu, forwards, rows = answer(model, batch, args.repeats, cache != "dual-eager", traced)
            generated = [row["generated"] for row in rows]
            reference = reference or generated
            exact = sum(model.score_answer(row["generated"], row["reference"]) for row in rows) / len(rows)
            agree = sum(a == b for a, b in zip(generated, reference)) / len(rows)
            print(f"| {sampler} | {block} | {threshold or '-'} | {cache or '-'} | {'on' if traced else 'off'} | "
                  f"{wall:.3f} | {cpu:.3f} | {forwards} | {exact:.3f} | {agree:.3f} |")


if __name__ == "__main__":
    main_bench()
