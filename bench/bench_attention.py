"""Attention backends for the MDLM step's bidirectional attention: forward + backward of
``F.scaled_dot_product_attention`` with no mask (the 1.24B bench's shape: B=4, 32 query heads, 8 KV heads,
L=4096, head dim 64, bf16), per SDPA backend, with grouped-query heads passed as ``enable_gqa=True`` (what
transformers' sdpa path does) or expanded beforehand. FLOPs: 4·B·H·L²·D forward, ×2.5 with backward.
Each backend's output and gradients are checked against the math backend in fp32 (relative norm).

Usage::

    python bench/bench_attention.py --out $OUT/attention.md      # GPU
"""

from __future__ import annotations

import argparse

from _common import emit, environment_line, markdown_table, time_calls

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}


def attention(q, k, v, backend: SDPBackend, gqa: bool):
    if not gqa:
        repeat = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(repeat, 1), v.repeat_interleave(repeat, 1)
    with sdpa_kernel([backend]):
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want).norm() / want.norm()).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--peak-tflops", type=float, default=989.0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device("cuda")
    gen = torch.Generator(device).manual_seed(0)
    shape = lambda heads: (args.batch, heads, args.length, args.head_dim)  # noqa: E731
    q, k, v = (torch.randn(shape(h), generator=gen, device=device, dtype=torch.bfloat16).requires_grad_()
               for h in (args.heads, args.kv_heads, args.kv_heads))
    grad = torch.randn(shape(args.heads), generator=gen, device=device, dtype=torch.bfloat16)
    with sdpa_kernel([SDPBackend.MATH]):  # the fp32 reference
        ref_inputs = [t.detach().float().requires_grad_() for t in (q, k, v)]
        ref = F.scaled_dot_product_attention(*ref_inputs, enable_gqa=True)
        ref.backward(grad.float())
    flops = 4 * args.batch * args.heads * args.length**2 * args.head_dim * 3.5  # forward + backward (2.5x)
    rows = []
    for name, backend in BACKENDS.items():
        for gqa in (True, False):
            label = f"{name}, {'enable_gqa' if gqa else 'expanded KV'}"
            try:
                out = attention(q, k, v, backend, gqa)
                out.backward(grad)
            except RuntimeError as err:
                rows.append([label, "unsupported", "-", "-", str(err).splitlines()[0][:60]])
                continue
            errors = [relative_error(out, ref)] + [relative_error(t.grad, r.grad) for t, r in zip((q, k, v), ref_inputs)]
            for t in (q, k, v):
                t.grad = None

            def step(_):
                attention(q, k, v, backend, gqa).backward(grad)

            timing = time_calls(step, device, warmup=3, reps=20, wall_loop=False)
            seconds = timing.median
            rows.append([label, f"{seconds * 1e3:.2f}", f"{flops / seconds / 1e12:.0f}",
                         f"{100 * flops / seconds / (args.peak_tflops * 1e12):.1f}", f"{max(errors):.1e}"])
            for t in (q, k, v):
                t.grad = None
    header = ["backend", "fwd+bwd ms", "TFLOP/s", "% of peak", "max rel. error vs fp32"]
    title = (f"# SDPA backends, B={args.batch} H={args.heads} KV={args.kv_heads} L={args.length} D={args.head_dim} "
             f"bf16, no mask\n\n{environment_line()}\n")
    emit(title + "\n" + markdown_table(header, rows), args.out)


if __name__ == "__main__":
    main()
