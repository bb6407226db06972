"""Shared helpers for the bench scripts: import path, timing, formatting, markdown tables, and the timed loops of the
step benchmarks (a ``lightning.Trainer`` fit and a plain loop), and the summary of a kernel profile (:func:`report`,
:func:`gap_sources`).

Only torch and the standard library are imported at import time (``lightning`` inside :func:`fit_timed`). On a machine without ``datasets`` or
``jsonargparse`` (the lent GPU image), install them first: see README.md here.
"""

from __future__ import annotations

import bisect
import collections
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

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


class StepTimes:
    """Host times of each training step (all steps, warm-up included) and each step's loss.

    ``steps``: batch start -> batch end, both synchronised; ``iters`` (Lightning only): batch start -> next batch
    start, which adds the data loader's fetch and the host-to-device copy; ``wall``: the whole run in seconds.
    Unsynchronised (``fit_timed(..., synchronise=False)``), ``steps`` and ``iters`` are both the device's time from
    one batch start to the next: what training without a wait per step runs at."""

    def __init__(self) -> None:
        self.starts: list[float] = []
        self.steps: list[float] = []
        self.losses: list[float] = []
        self.wall = 0.0
        self.synchronised = True

    @property
    def iters(self) -> list[float]:
        if not self.synchronised:
            return self.steps
        return [b - a for a, b in zip(self.starts[:-1], self.starts[1:])]


def fit_timed(module, batches, device: torch.device, precision: str, synchronise: bool = True,
              **trainer_kwargs) -> StepTimes:
    """Train ``module`` with a real ``lightning.Trainer`` (one device, no logger, checkpoints, validation or
    progress bar; ``trainer_kwargs`` override any setting) for one pass over ``batches`` (a map-style dataset whose
    items are whole batches), timing each step with a callback (before any ``callbacks`` given); the loss is the
    module's logged ``train/loss``.

    ``synchronise``: the callback synchronises the device at ``on_train_batch_start`` and ``on_train_batch_end``
    (each step alone: the device idles while the host starts the next one). False: it records a CUDA event at each
    batch start and at the end of training (on the CPU, the host's clock) and never waits, so the host queues the
    next step while the device runs this one, as in training; each step is the events' distance."""
    import lightning as L

    times = StepTimes()
    times.synchronised = synchronise
    marks, losses = [], []

    def mark() -> None:
        if device.type == "cuda":
            marks.append(torch.cuda.Event(enable_timing=True))
            marks[-1].record()
        else:
            marks.append(time.perf_counter())

    class StepTimer(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            if not synchronise:
                return mark()
            sync(device)
            times.starts.append(time.perf_counter())

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            loss = trainer.callback_metrics.get("train/loss")  # logged at optimizer steps, not after a micro-batch
            if not synchronise:
                losses.extend([] if loss is None else [loss.detach().clone()])
                return
            sync(device)
            times.steps.append(time.perf_counter() - times.starts[-1])
            if loss is not None:
                times.losses.append(float(loss))

        def on_train_end(self, trainer, pl_module) -> None:
            if not synchronise:
                mark()
                sync(device)
                pairs = zip(marks[:-1], marks[1:])
                times.steps = [
                    a.elapsed_time(b) / 1e3 if device.type == "cuda" else b - a for a, b in pairs]
                times.losses = [float(loss) for loss in losses]

    loader = torch.utils.data.DataLoader(batches, batch_size=None, pin_memory=device.type == "cuda")
    settings = dict(
        accelerator="gpu" if device.type == "cuda" else "cpu", devices=1, precision=precision,
        max_steps=len(batches), logger=False, enable_checkpointing=False, limit_val_batches=0,
        num_sanity_val_steps=0, enable_progress_bar=False, enable_model_summary=False, callbacks=[StepTimer()],
    )
    settings["callbacks"] += trainer_kwargs.pop("callbacks", [])  # the step timer first, then the caller's
    trainer = L.Trainer(**{**settings, **trainer_kwargs})
    start = time.perf_counter()
    trainer.fit(module, train_dataloaders=loader)
    times.wall = time.perf_counter() - start
    return times


def loop_timed(loss_of: Callable[[dict], torch.Tensor], batches: Sequence[dict], device: torch.device,
               optimizer: torch.optim.Optimizer) -> StepTimes:
    """A plain training loop over ``batches``: ``loss_of(batch)``, backward, ``optimizer.step()``, zeroed gradients;
    each iteration timed between two synchronisations of the device."""
    times = StepTimes()
    start = time.perf_counter()
    for batch in batches:
        sync(device)
        times.starts.append(time.perf_counter())
        loss = loss_of(batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync(device)
        times.steps.append(time.perf_counter() - times.starts[-1])
        times.losses.append(float(loss))
    times.wall = time.perf_counter() - start
    return times


def add_shape_arguments(parser) -> None:
    """The decoder shape of the step benchmarks (default: the 1.24B bench shape), the batch and the measured steps."""
    for name, default in [("hidden", 2048), ("layers", 16), ("heads", 32), ("kv-heads", 8), ("intermediate", 8192),
                          ("vocab", 128256), ("batch", 4), ("seq", 4096)]:
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--steps", type=int, default=10, help="measured steps per variant")
    parser.add_argument("--warmup", type=int, default=3, help="warm-up steps per variant (not measured)")


FP8_RECIPES = ("tensorwise", "rowwise")  # lit_dllm.fp8.RECIPES (not imported: this module needs only torch)
FP8_VARIANTS = tuple(f"lightning-compile-fp8-{recipe}" for recipe in FP8_RECIPES)
"""The step benchmarks' fp8 rows: ``lightning-compile`` with ``fp8=<recipe>`` (torchao, CUDA capability >= 8.9)."""
FP8_MFU_NOTE = "the fp8 rows too: a bf16-equivalent MFU"


def split_fp8(variant: str) -> tuple[str, str | None]:
    """``"<base>-fp8-<recipe>"`` -> ``(base, recipe)``; a variant without ``-fp8-`` -> ``(variant, None)``."""
    base, fp8, recipe = variant.partition("-fp8-")
    return (base, recipe) if fp8 else (variant, None)


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


def emit(text: str, out: str | None, echo: bool = True) -> None:
    """Print ``text`` (unless not ``echo``) and, if ``out`` is given, write it to that file (parent dirs created)."""
    if echo:
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


# ----------------------------------------------------------------------------- profiles (profile_step, bench_moe_step)
KINDS = {  # the first whose key is in the kernel's name
    "attention": ("flash", "fmha", "cudnn", "attention"),
    "gemm": ("gemm", "nvjet", "cutlass", "xmma", "sm90_"),
    "optimizer": ("adam", "multi_tensor"),
    "inductor (triton)": ("triton",),
    "copies": ("memcpy", "memset"),
    "communication": ("nccl",),
}


def kind(name: str, kinds: dict = KINDS) -> str:
    name = name.lower()
    return next((k for k, keys in kinds.items() if any(key in name for key in keys)), "other")


def size_class(gap_us: float) -> str:
    return "< 20 µs" if gap_us < 20 else "20-100 µs" if gap_us < 100 else "0.1-1 ms" if gap_us < 1000 else "> 1 ms"


def merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of ``(start, end)`` intervals as disjoint sorted ones."""
    out: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def exposed(kernels: list[tuple[float, float, str]], kinds: dict = KINDS) -> collections.Counter:
    """Per communication kernel (by name): the time it runs while no other kind of kernel does (µs)."""
    compute = merged([(s, e) for s, e, name in kernels if kind(name, kinds) != "communication"])
    starts = [s for s, _ in compute]
    alone = collections.Counter()
    for start, end, name in kernels:
        if kind(name, kinds) == "communication":
            near = compute[max(0, bisect.bisect_right(starts, start) - 1):bisect.bisect_left(starts, end)]
            covered = sum(max(0.0, min(end, e) - max(start, s)) for s, e in near)
            alone[f"`{name[:60]}`"] += end - start - covered
    return alone


def idle_gaps(spans: Sequence[tuple]) -> Iterator[tuple[float, Any, Any]]:
    """For ``(start, end, what)`` spans sorted by start: each stretch where none runs, as (its length, the ``what``
    that finished last before it, the ``what`` that ends it)."""
    finished, last = (spans[0][1], spans[0][2]) if spans else (0.0, None)
    for start, end, what in spans[1:]:
        if start > finished:
            yield start - finished, last, what
        if end >= finished:
            finished, last = end, what


def report(kernels: list[tuple[float, float, str]], steps: int, kinds: dict = KINDS) -> str:
    """Kernel time by kind (``kinds``: each kind's name keys, the first kind that matches counts; a ``communication``
    kind is the one reported as exposed) and name, idle gaps by size and by the kernels around them, per step (µs
    inputs)."""
    by_kind, by_name = collections.Counter(), collections.Counter()
    for start, end, name in kernels:
        by_kind[kind(name, kinds)] += end - start
        by_name[f"`{name[:80]}`"] += end - start
    gaps, sizes = collections.Counter(), collections.Counter()
    for gap, previous, name in idle_gaps(kernels):
        gaps[f"`{previous[:40]}` → `{name[:40]}`"] += gap
        sizes[size_class(gap)] += gap

    def ms(us: float) -> str:
        return f"{us / 1e3 / steps:.2f}"

    def table(title: str, rows) -> list[str]:
        return ["", f"| {title} | ms/step |", "|---|---|"] + [f"| {key} | {ms(us)} |" for key, us in rows]

    span = kernels[-1][1] - kernels[0][0]
    alone = exposed(kernels, kinds)
    return "\n".join(
        [f"per step: span {ms(span)} ms, kernels {ms(sum(by_kind.values()))} ms, idle {ms(sum(gaps.values()))} ms"
         + (f", communication exposed (no other kernel running) {ms(sum(alone.values()))} ms" if alone else "")]
        + table("kernel kind", by_kind.most_common()) + table("top kernels", by_name.most_common(15))
        + table("idle gaps by size", sizes.most_common()) + table("idle between", gaps.most_common(12))
        + (table("exposed communication", alone.most_common(8)) if alone else [])
    )


DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")
SOURCE_PATHS = ("lit_dllm/", "transformers/", "torch/distributed/", "torch/optim/", "lightning/")


def gap_sources(trace_events: list[dict], paths: Sequence[str] = SOURCE_PATHS) -> collections.Counter:
    """Idle device time (µs: no kernel, copy or memset on any stream) by the host code that launched the work ending
    each gap, from a Chrome trace's events (``torch.profiler`` with CPU and CUDA activities and ``with_stack=True``):
    the innermost Python frame in one of ``paths`` (``file(line): function`` from that path on), else the outermost
    operator around the launch (the backward's ``autograd::engine::evaluate_function: …``, which has no Python frame),
    else ``(launch outside any frame)``."""
    device = sorted((e["ts"], e["ts"] + e.get("dur", 0), e.get("args", {}).get("correlation"))
                    for e in trace_events if e.get("ph") == "X" and e.get("cat") in DEVICE_CATEGORIES)
    launches = {e["args"]["correlation"]: (e["ts"], e["tid"]) for e in trace_events
                if e.get("cat") in LAUNCH_CATEGORIES and "correlation" in e.get("args", {})}
    queries = collections.defaultdict(list)  # thread -> (launch time, gap)
    for gap, _, correlation in idle_gaps(device):
        if correlation in launches:
            launched, thread = launches[correlation]
            queries[thread].append((launched, gap))
    frames = collections.defaultdict(list)  # thread -> (start, end, name, is Python)
    for e in trace_events:
        if e.get("ph") == "X" and e.get("cat") in ("python_function", "cpu_op") and e.get("tid") in queries:
            frames[e["tid"]].append((e["ts"], e["ts"] + e.get("dur", 0), e["name"], e["cat"] == "python_function"))
    sources = collections.Counter()
    for thread, asked in queries.items():
        events = sorted(frames[thread], key=lambda frame: (frame[0], -frame[1]))  # an outer frame before its inner
        index, open_frames = 0, []  # frames nest: a stack of the open ones
        for launched, gap in sorted(asked):
            while index < len(events) and events[index][0] <= launched:
                while open_frames and open_frames[-1][1] < events[index][0]:
                    open_frames.pop()
                open_frames.append(events[index])
                index += 1
            while open_frames and open_frames[-1][1] < launched:
                open_frames.pop()
            sources[_source(open_frames, paths)] += gap
    return sources


def cuda_kernels(prof) -> list[tuple[float, float, str]]:
    """A finished ``torch.profiler`` run's device work as (start, end, name), sorted: kernels, copies and memsets, not
    the ranges that ``record_function`` annotations (the optimizer's, NCCL's) also draw on the device when CPU
    activity is recorded (they would cover idle time and count their kernels twice)."""
    return sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                  if e.device_type == torch.autograd.DeviceType.CUDA and not e.is_user_annotation)


def gap_sources_section(prof, steps: int) -> str:
    """:func:`gap_sources` of a finished ``torch.profiler`` run (CPU and CUDA activities, ``with_stack=True``) as a
    markdown section: the 20 largest sources, idle ms per step."""
    with tempfile.TemporaryDirectory() as folder:
        prof.export_chrome_trace(f"{folder}/trace.json")
        trace = json.loads(Path(f"{folder}/trace.json").read_text())["traceEvents"]
    rows = [(source, f"{us / 1e3 / steps:.2f}") for source, us in gap_sources(trace).most_common(20)]
    return ("\n\nIdle GPU time by the host code that launched the work ending each gap (per step):\n\n"
            + markdown_table(["launched from", "idle ms/step"], rows))


def _source(open_frames: list[tuple], paths: Sequence[str]) -> str:
    """:func:`gap_sources`' name for a launch inside ``open_frames`` (outermost first)."""
    for _, _, name, python in reversed(open_frames):
        at = min((name.find(path) for path in paths if path in name), default=-1)
        if python and at >= 0:
            return name[at:]
    operators = [name for _, _, name, python in open_frames if not python]
    return operators[0] if operators else "(launch outside any frame)"
