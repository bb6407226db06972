"""One sampling step's choice of tokens and scores (``lit_dllm.families.mdlm.sampler._confidence``) over a batch of
rollouts' block logits, with its rows drawn :data:`~lit_dllm.families.mdlm.sampler.CONFIDENCE_ROWS` at a time and all
at once: the memory it takes beyond the logits and its time. The default shape is the SmolLM2 RL configs' block-wise
rollouts (384 completions, blocks of 32, a 49,152-token vocabulary, bf16 logits, keyed draws at temperature 1).
Each setting runs in its own process: on a CPU the peak is the process's peak resident memory (VmHWM), on CUDA the
allocator's peak.

    python bench/bench_confidence_rows.py [--device cuda] [--rows 384 --block 32 --vocab 49152]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

import _common  # noqa: F401  (puts the checkout on sys.path)
import torch

from lit_dllm.families.mdlm import sampler
from lit_dllm.noise.keys import example_keys


def peak_gib(device: str) -> float:
    if device == "cuda":
        return torch.cuda.max_memory_allocated() / 2**30
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM")) / 2**20


def one(args: argparse.Namespace) -> None:
    """The step once (after a warm-up on CUDA), printing a table row."""
    sampler.CONFIDENCE_ROWS = args.at_a_time
    torch.manual_seed(0)
    logits = torch.randn(args.rows, args.block, args.vocab, dtype=torch.bfloat16, device=args.device)
    draws = sampler.StepDraws(example_keys(0, torch.arange(args.rows, device=args.device)), 0)
    if args.device == "cuda":
        sampler._confidence(logits, 1.0, "low_confidence", None, draws)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    before, start = peak_gib(args.device), time.perf_counter()
    tokens, score = sampler._confidence(logits, 1.0, "low_confidence", None, draws)
    if args.device == "cuda":
        torch.cuda.synchronize()
    seconds, logits_gib = time.perf_counter() - start, logits.numel() * 2 / 2**30
    above = peak_gib(args.device) - (logits_gib if args.device == "cuda" else before)
    print(f"| {args.at_a_time if args.at_a_time < args.rows else 'all'} | {above:.2f} | {1000 * seconds:.1f} "
          f"| {int(tokens.sum())} / {float(score.double().sum()):.4f} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rows", type=int, default=384)
    parser.add_argument("--block", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--at-a-time", type=int, help=argparse.SUPPRESS)  # one process's setting
    args = parser.parse_args()
    if args.at_a_time:
        return one(args)
    print(f"{args.rows} rows x {args.block} x {args.vocab}, bf16 logits on {args.device}")
    print("| rows at a time | GiB beyond the logits | ms | tokens sum / scores sum (equal on a CPU) |")
    print("|---|---|---|---|")
    for at_a_time in (args.rows, sampler.CONFIDENCE_ROWS):
        subprocess.run([sys.executable, __file__, *sys.argv[1:], "--at-a-time", str(at_a_time)], check=True)


if __name__ == "__main__":
    main()
