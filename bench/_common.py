"""Shared helpers for the bench scripts: import path, timing, formatting, markdown tables.

Only torch and the standard library are imported here. On a machine without ``datasets`` or
``jsonargparse`` (the lent GPU image), install them first: see README.md here.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from typing import Callable, Sequence

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:  # `python bench/x.py` from the repo root, lit_dllm not installed
    sys.path.insert(0, REPO_ROOT)

import torch  # noqa: E402


def sync(device: torch.device | str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank-with-interpolation percentile, ``q`` in [0, 100]."""
    xs = sorted(values)
    if not xs:
        return float("nan")
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = int(pos), min(int(pos) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


class Timing:
    """Per-call times in seconds plus the host wall time per call of a back-to-back loop."""

    def __init__(self, per_call: list[float], wall_per_call: float | None = None):
        self.per_call = per_call
        self.wall_per_call = wall_per_call

    @property
    def median(self) -> float:
        return statistics.median(self.per_call)

    @property
    def p10(self) -> float:
        return percentile(self.per_call, 10)

    @property
    def p90(self) -> float:
        return percentile(self.per_call, 90)


def time_calls(
    fn: Callable[[int], object],
    device: torch.device | str,
    warmup: int,
    reps: int,
    rotate: int = 1,
    wall_loop: bool = True,
) -> Timing:
    """Time ``fn(i % rotate)`` (``i`` selects one of ``rotate`` input sets).

    CUDA: one pair of CUDA events around every call (device time per call, launch gaps included
    when the host is the bottleneck), synchronised once at the end. CPU: ``perf_counter`` per call.
    Then (``wall_loop``) a second back-to-back loop timed with the host clock between two
    synchronisations gives the wall time per call. Warm-up calls run first and are not counted.
    """
    device = torch.device(device)
    for i in range(warmup):
        fn(i % rotate)
    sync(device)
    if device.type == "cuda":
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        for i in range(reps):
            starts[i].record()
            fn(i % rotate)
            ends[i].record()
        torch.cuda.synchronize()
        per_call = [s.elapsed_time(e) / 1e3 for s, e in zip(starts, ends)]
    else:
        per_call = []
        for i in range(reps):
            t0 = time.perf_counter()
            fn(i % rotate)
            per_call.append(time.perf_counter() - t0)
    wall = None
    if wall_loop:
        sync(device)
        t0 = time.perf_counter()
        for i in range(reps):
            fn(i % rotate)
        sync(device)
        wall = (time.perf_counter() - t0) / reps
    return Timing(per_call, wall)


def fmt_time(seconds: float | None) -> str:
    """µs below 1 ms, ms below 10 s, else s."""
    if seconds is None or seconds != seconds:
        return "-"
    if seconds < 1e-3:
        return f"{seconds * 1e6:.1f} µs"
    if seconds < 10:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds:.2f} s"


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(str(c).replace("|", "\\|") for c in row) + " |")
    return "\n".join(lines)


def emit(text: str, out: str | None) -> None:
    """Print ``text`` and, if ``out`` is given, write it to that file (parent dirs created)."""
    print(text, flush=True)
    if out:
        parent = os.path.dirname(os.path.abspath(out))
        os.makedirs(parent, exist_ok=True)
        with open(out, "w") as fh:
            fh.write(text + "\n")


def environment_line() -> str:
    import platform

    parts = [f"python {platform.python_version()}", f"torch {torch.__version__}"]
    for name in ("lightning", "transformers"):
        try:
            module = __import__(name)
            parts.append(f"{name} {module.__version__}")
        except Exception as err:  # pragma: no cover - informational
            parts.append(f"{name} unavailable ({type(err).__name__})")
    if torch.cuda.is_available():
        parts.append(f"GPU {torch.cuda.get_device_name(0)} (CUDA {torch.version.cuda})")
    parts.append(f"CPU threads {torch.get_num_threads()}")
    return ", ".join(parts)
