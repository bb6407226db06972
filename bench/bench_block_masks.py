"""The FlexAttention block masks of one DiffusionGemma training step (the encoder's full and sliding masks, the
decoder's two): built eagerly by ``create_block_mask`` against lit_dllm's compiled build (``lit_dllm.attention``,
on CUDA), wall time per step's masks (the host's launches included: the device is synced after each build), and the
same blocks from both (kv counts and indices, full and partial), also at a second canvas width (a recompile).

Usage (GPU)::

    python bench/bench_block_masks.py --out $OUT/block_masks.md
"""

from __future__ import annotations

import argparse
import time
from unittest import mock

from _common import emit, environment_line, markdown_table, sync

import torch

import lit_dllm.attention as attention
import lit_dllm.families.diffusion_gemma.masks as masks

BLOCK_FIELDS = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices")


def step_masks(batch: int, seq: int, width: int, block: int, window: int, device: torch.device) -> list:
    """The four masks of one step: prompts of 1/4 to 1/2 of ``seq``, responses filling ``width`` or less."""
    generator = torch.Generator().manual_seed(width)
    prefix = torch.randint(seq // 4, seq // 2, (batch,), generator=generator)
    lengths = torch.minimum(torch.full((batch,), width), seq - prefix)
    prefix, lengths = prefix.to(device), lengths.to(device)
    attention_mask = torch.ones(batch, seq, dtype=torch.long, device=device)
    encoder = masks.encoder_block_masks(attention_mask, window)
    return [encoder["full_attention"], encoder["sliding_attention"],
            masks.block_diffusion_block_mask(prefix, lengths, width, seq, block),
            masks.block_diffusion_block_mask(prefix, lengths, width, seq, block, sliding_window=window)]


def timed(build, repeats: int, device: torch.device) -> float:
    """Median seconds of ``build()`` with the device synced after each."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        build()
        sync(device)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def same_blocks(first: list, second: list) -> bool:
    return all(torch.equal(getattr(a, field), getattr(b, field))
               for a, b in zip(first, second) for field in BLOCK_FIELDS if getattr(a, field) is not None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--width", type=int, default=256, help="canvas width R (the 26B-A4B step's canvas)")
    parser.add_argument("--block", type=int, default=256, help="diffusion block size (canvas_length)")
    parser.add_argument("--window", type=int, default=1024, help="sliding window")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shape = (args.batch, args.seq, args.width, args.block, args.window, device)
    build = lambda width=args.width: step_masks(*shape[:2], width, *shape[3:])  # noqa: E731
    rows = []
    start = time.perf_counter()
    reference = build()  # the first call compiles
    sync(device)
    first_call = time.perf_counter() - start
    rows.append(("lit_dllm (compiled on CUDA)", f"{timed(build, args.repeats, device) * 1e3:.2f}",
                 f"{first_call:.1f}"))
    with mock.patch.object(attention, "_compiled", lambda build: build):  # eager create_block_mask
        eager, eager_other = build(), build(args.width // 2)
        rows.append(("eager create_block_mask", f"{timed(build, args.repeats, device) * 1e3:.2f}", "-"))
    other = build(args.width // 2)
    checks = [("same blocks as eager", same_blocks(reference, eager)),
              (f"same blocks as eager at width {args.width // 2} (a new shape)", same_blocks(other, eager_other))]
    lines = [f"# Gemma step's block masks: {args.batch} x {args.seq}, canvas {args.width}, block {args.block}, "
             f"window {args.window}", "", environment_line(), "",
             markdown_table(["build", "ms per step's 4 masks (median)", "first call s"], rows), ""]
    lines += [f"- {name}: {'PASS' if ok else 'FAIL'}" for name, ok in checks]
    emit("\n".join(lines), args.out)
    if not all(ok for _, ok in checks):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
