"""Launch settings of ``corrupt_blockwise``'s Triton kernels (docs/BENCHMARKS.md §2b): for each block length, the GPU
time of the sort (short blocks) and of the radix select at several chunk sizes, digit widths and warp counts, each
output checked against the eager torch path. ``--baseline FILE`` also times the ``blockwise`` launcher of another
copy of ``fused_corruption.py`` (e.g. an earlier commit's) on the same inputs.

Usage (GPU)::

    python bench/sweep_blockwise.py --out $OUT/sweep.md
    git show HEAD~1:lit_dllm/noise/fused_corruption.py > /tmp/old.py
    python bench/sweep_blockwise.py --baseline /tmp/old.py
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import math

from _common import emit, environment_line, markdown_table

import torch
import triton
from torch.profiler import ProfilerActivity, profile

import lit_dllm.noise.fused_corruption as fc
from lit_dllm.noise import corruption
from lit_dllm.noise.corruption import corrupt_blockwise
from lit_dllm.noise.keys import example_keys

ROWS, MASK, EPS, HALF_LIFE = 8, 5, 1e-3, 0.25


def gpu_time_us(launch, repeats: int = 20) -> float:
    """Mean GPU time per call (kernels only, from the profiler), after a warm-up."""
    for _ in range(5):
        launch()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            launch()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return sum(e.device_time for e in kernels) / repeats


def settings(padded: int) -> list[tuple[str, dict]]:
    """The sort (blocks up to 2048) and the radix select's settings tried for a block padded to ``padded``."""
    rows = [("sort", dict(warps=w)) for w in (8, 32)] if padded <= 2048 else []
    rows += [("select", dict(chunk=c, radix=r, warps=w))
             for c, r, w in itertools.product((2048, 4096), (1, 2, 4), (8, 16)) if c <= max(padded, 2048)]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--spans", default="4096,2048,8192,16384", help="block lengths, each a whole row (bs=None)")
    parser.add_argument("--baseline", default=None, help="another fused_corruption.py whose blockwise() to time")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    baseline = None
    if args.baseline:
        spec = importlib.util.spec_from_file_location("baseline_fused_corruption", args.baseline)
        baseline = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(baseline)

    table = []
    for span in map(int, args.spans.split(",")):
        ids = torch.randint(6, 1000, (ROWS, span), generator=torch.Generator().manual_seed(0)).cuda()
        loss_mask = torch.ones(ROWS, span, device="cuda")
        keys = example_keys(3, torch.arange(ROWS), 1).cuda()
        corruption.FUSED_KEYED_KERNELS = False
        try:
            eager = corrupt_blockwise(ids, loss_mask, MASK, None, EPS, HALF_LIFE, keys=keys)
        finally:
            corruption.FUSED_KEYED_KERNELS = True
        common, padded = (ids, loss_mask, keys), triton.next_power_of_2(span)
        scalars = (span, span, 1, EPS, 1 - EPS, math.log(2.0) / (HALF_LIFE * span), 1, MASK)

        def launch(how: str, options: dict):
            if how == "baseline":
                return baseline.blockwise(*common, MASK, 1, span, EPS, HALF_LIFE, 1)
            out = fc._outputs(ids)
            if how == "sort":
                fc._blockwise_sort_kernel[(ROWS,)](*common, *out, *scalars, SPAN=padded,
                                                   num_warps=options["warps"], **fc._NO_FMA)
            else:
                fc._blockwise_select_kernel[(ROWS,)](*common, *out, *scalars, CHUNK=options["chunk"],
                                                     RADIX=options["radix"], num_warps=options["warps"], **fc._NO_FMA)
            return out

        for how, options in ([("baseline", {})] if baseline else []) + settings(padded):
            equal = all(map(torch.equal, launch(how, options), eager))
            table.append([span, how, ", ".join(f"{k} {v}" for k, v in options.items()) or "-", equal,
                          f"{gpu_time_us(lambda: launch(how, options)):.1f}"])
            print(table[-1], flush=True)
    header = ["block (= L)", "kernel", "settings", "equals eager", "GPU µs per call (B=8)"]
    emit(f"# corrupt_blockwise kernel settings\n\n{environment_line()}\n\n" + markdown_table(header, table), args.out)


if __name__ == "__main__":
    main()
