"""Micro-benchmarks of lit_dllm's corruption kernels and losses (CPU and CUDA).

Corruption kernels (``lit_dllm.noise.corruption``) at B=8, L=4096, block 32, each with a
``torch.Generator`` and with ``keys=`` (keyed, counter-based hashing); on CUDA the keyed ones both
eager ("keys, eager": torch ops) and fused ("keys, fused": one Triton launch, the default there),
and a CUDA-graph replay of the eager keyed kernels. Where capture fails, the row gives the exception and the first
synchronising op of an eager call (found with ``torch.cuda.set_sync_debug_mode("error")``). Graph outputs are checked against eager on keys copied in after capture; keyed
CUDA results are checked against the CPU's (keyed noise is device-independent by design). The
reference (NeMo AutoModel) kernels take 85-380 µs per call on an H200, almost all launch overhead.

Losses (``lit_dllm.losses``), forward + backward, with peak memory on CUDA:

* ``MDLMCrossEntropyLoss`` on ``[B, L, V]`` logits (bf16 and fp32 logits);
* ``fused_linear_cross_entropy`` (eager chunks, and on CUDA ``torch.compile``d chunks) vs the dense
  ``linear`` + fp32 ``cross_entropy`` it replaces, each against a float64 reference;
* ``DFlashDecayLoss.forward`` (LM head applied first, full logits) vs ``forward_fused``.

Timing (see METHOD.md): warm-up calls first, then per-call CUDA events (or ``perf_counter`` on CPU),
median over many calls, several input sets rotated for the small kernels. ``wall/call`` in the
notes is the host wall time per call of a separate back-to-back loop (one sync at each end).
Peak memory: ``torch.cuda.max_memory_allocated`` during one extra call, after a reset; "Δ" is
that peak minus what was allocated just before the call (inputs and parameters excluded).

Usage::

    python bench/bench_primitives.py --device all --out results/primitives.md
    python bench/bench_primitives.py --device cpu --quick --threads 1

``--threads 1`` gives stable CPU numbers on small shared machines (2 OpenMP threads on 2 busy cores
made elementwise ops ~20x slower here).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import math
import os
import time
import traceback

from _common import emit, environment_line, fmt_time, markdown_table, sync, time_calls  # noqa: F401

import torch
import torch.nn.functional as F

# Submodules only: never lit_dllm.data.datamodule / lit_dllm.cli (they need datasets / jsonargparse).
import lit_dllm.losses
from lit_dllm.noise import corruption
from lit_dllm.noise.corruption import (
    corrupt_all_masked,
    corrupt_blockwise,
    corrupt_mix,
    corrupt_uniform,
    corrupt_uniform_random,
)
from lit_dllm.noise.keys import example_keys
from lit_dllm.families.dflash.loss import DFlashDecayLoss
from lit_dllm.losses import fused_linear_cross_entropy, weighted_linear_cross_entropy
from lit_dllm.reference.losses import MDLMCrossEntropyLoss

HEADER = ["name", "device", "shape", "median", "p10–p90", "peak MiB (Δ)", "notes"]


class Table:
    def __init__(self) -> None:
        self.rows: list[list[object]] = []

    def add(self, name, device, shape, timing=None, peak=None, notes="", median_override=None) -> None:
        if timing is None:
            median, spread = (median_override or "-"), "-"
        else:
            median = fmt_time(timing.median)
            spread = f"{fmt_time(timing.p10)} – {fmt_time(timing.p90)}"
            if timing.wall_per_call is not None:
                notes = (f"wall {fmt_time(timing.wall_per_call)}/call; " + notes).rstrip("; ")
        self.rows.append([name, device, shape, median, spread, peak or "-", notes])
        print("  " + " | ".join(str(c) for c in self.rows[-1]), flush=True)


def peak_memory(fn, device: torch.device) -> str | None:
    """``max_memory_allocated`` (MiB) during one call of ``fn``, and its excess over the start."""
    if device.type != "cuda":
        return None
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    return f"{peak / 2**20:.0f} ({(peak - before) / 2**20:+.0f})"


# ------------------------------------------------------------------------------------------------
# Corruption kernels


def make_batches(n: int, batch: int, length: int, vocab: int, device: torch.device, seed: int):
    """``n`` input sets: random ids in [1, vocab-1) (never the mask id), float32 loss mask with a
    random unsupervised prompt prefix of 5-20% per row, and ``[B]`` keys."""
    g = torch.Generator().manual_seed(seed)
    sets = []
    for i in range(n):
        ids = torch.randint(1, vocab - 1, (batch, length), generator=g)
        prefix = torch.randint(length // 20, length // 5, (batch, 1), generator=g)
        loss_mask = (torch.arange(length)[None] >= prefix).float()
        keys = example_keys(1234, torch.arange(i * batch, (i + 1) * batch))
        sets.append((ids.to(device), loss_mask.to(device), keys.to(device)))
    return sets


def kernel_specs(mask_id: int, vocab: int, block: int):
    """(name, fn(ids, loss_mask, generator, keys), keyed_supported)."""
    return [
        ("corrupt_uniform", lambda i, m, g, k: corrupt_uniform(i, m, mask_id, 1e-3, g, keys=k), True),
        (f"corrupt_blockwise(bs={block})",
         lambda i, m, g, k: corrupt_blockwise(i, m, mask_id, block, 1e-3, 0.25, g, keys=k), True),
        ("corrupt_blockwise(bs=None)",
         lambda i, m, g, k: corrupt_blockwise(i, m, mask_id, None, 1e-3, 0.25, g, keys=k), True),
        (f"corrupt_uniform_random(bs={block})",
         lambda i, m, g, k: corrupt_uniform_random(i, m, vocab, block, 1e-3, g, keys=k), True),
        ("corrupt_all_masked", lambda i, m, g, k: corrupt_all_masked(i, m, mask_id), False),
        ("corrupt_mix(0.3,0.2)", lambda i, m, g, k: corrupt_mix(i, m, mask_id, vocab, 0.3, 0.2, g, keys=k), True),
    ]


@contextlib.contextmanager
def switched(module, flag: str, value: bool):
    """Set ``module.flag`` to ``value`` for the block."""
    before = getattr(module, flag)
    setattr(module, flag, value)
    try:
        yield
    finally:
        setattr(module, flag, before)


def same_outputs(a, b) -> bool:
    return all(torch.equal(x.cpu(), y.cpu()) for x, y in zip(a, b))


def bench_kernels(table: Table, device: torch.device, quick: bool, cpu_reference: dict) -> None:
    batch, length, block, vocab = 8, 4096, 32, 128256
    mask_id = vocab - 1
    rotate = 4
    sets = make_batches(rotate, batch, length, vocab, device, seed=0)
    shape = f"B={batch} L={length}"
    if device.type == "cuda":
        warmup, reps = (5, 50) if quick else (20, 300)
    else:
        warmup, reps = (2, 10) if quick else (3, 30)
    for name, fn, keyed in kernel_specs(mask_id, vocab, block):
        keyed_modes = ["keys, eager", "keys, fused"] if device.type == "cuda" else ["keys"]
        for mode in ["generator", *keyed_modes] if keyed else ["-"]:
            gen = torch.Generator(device=device).manual_seed(0) if mode == "generator" else None

            def call(j, fn=fn, mode=mode, gen=gen):
                ids, lm, keys = sets[j]
                return fn(ids, lm, gen, keys if mode.startswith("keys") else None)

            notes = ""
            with switched(corruption, "FUSED_KEYED_KERNELS", mode != "keys, eager"):
                if mode != "generator":  # deterministic: check against the CPU result (keyed = device-independent)
                    out = call(0)
                    ref_key = (name, "-" if mode == "-" else "keys")
                    if device.type == "cpu":
                        cpu_reference[ref_key] = tuple(t.clone() for t in out)
                    elif ref_key in cpu_reference:
                        same = same_outputs(out, cpu_reference[ref_key])
                        notes = "= CPU result" if same else "DIFFERS from CPU result"
                timing = time_calls(call, device, warmup, reps, rotate)
            table.add(f"{name} [{mode}]", device.type, shape, timing, notes=notes)


def first_sync_point(call) -> str:
    """Run ``call()`` once with ``torch.cuda.set_sync_debug_mode("error")``: where does it first make
    the host wait for the device (the usual reason a CUDA-graph capture fails)?"""
    torch.cuda.set_sync_debug_mode("error")
    try:
        call()
        return "no synchronising op found"
    except RuntimeError as err:
        frames = [f for f in traceback.extract_tb(err.__traceback__) if "lit_dllm" in f.filename]
        where = f"{os.path.basename(frames[-1].filename)}:{frames[-1].lineno} `{frames[-1].line}`" if frames else "?"
        return f"first sync at {where} ({str(err).splitlines()[0][:60]})"
    finally:
        torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()


def capture(call):
    """Warm up on a side stream, then capture ``call()`` in a CUDA graph: ``(graph, outputs)``."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            call()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = call()
    torch.cuda.synchronize()
    return graph, outputs


@switched(corruption, "FUSED_KEYED_KERNELS", False)
def bench_graphs(table: Table, device: torch.device, quick: bool) -> None:
    """CUDA-graph capture + replay of the eager keyed kernels (static inputs; new keys copied in).

    Where capture fails, the row says why and where an eager call first synchronises.
    """
    batch, length, block, vocab = 8, 4096, 32, 128256
    mask_id = vocab - 1
    shape = f"B={batch} L={length}"
    warmup, reps = (5, 50) if quick else (20, 300)
    sets = make_batches(2, batch, length, vocab, device, seed=1)
    for name, fn, keyed in kernel_specs(mask_id, vocab, block):
        ids, lm, keys0 = (t.clone() for t in sets[0])
        keys = keys0.clone()
        call = lambda fn=fn, keyed=keyed: fn(ids, lm, None, keys if keyed else None)  # noqa: E731
        label = f"{name} [{'keys' if keyed else '-'}] graph replay"
        sync_note = first_sync_point(call)
        try:
            graph, static_out = capture(call)
        except Exception as err:  # capture is not possible for this kernel: say why
            msg = " ".join(str(err).split())[:200]
            table.add(label, "cuda", shape, median_override="n/a",
                      notes=f"capture FAILED: {type(err).__name__}: {msg}; eager {sync_note}")
            torch.cuda.synchronize()  # raises if the context is poisoned: stop the section
            continue
        # Correctness: new keys copied into the static input; the replay must equal eager.
        keys.copy_(sets[1][2])
        graph.replay()
        torch.cuda.synchronize()
        replayed = tuple(t.clone() for t in static_out)
        timing = time_calls(lambda j: graph.replay(), device, warmup, reps)
        eager = fn(ids, lm, None, keys.clone() if keyed else None)
        ok = same_outputs(replayed, eager)
        table.add(label, "cuda", shape, timing,
                  notes="replay = eager on new keys" if ok else "replay DIFFERS from eager (capture unsafe)")
        del graph, static_out


# ------------------------------------------------------------------------------------------------
# Losses


def loss_sizes(device: torch.device, quick: bool) -> dict:
    if device.type == "cuda":
        return {
            "mdlm": [(4, 4096, v) for v in ((32000,) if quick else (32000, 128256))],
            "linear": [(16384, 2048, v) for v in ((32000,) if quick else (32000, 128256))],
            # DFlash: T = N·(bs-1) with bs=16; 16 x 1020 = 16320 positions.
            "dflash": [(16, 1020, 2048, v) for v in ((32000,) if quick else (32000, 128256))],
            "warmup": 2 if quick else 3,
            "reps": 5 if quick else 20,
        }
    return {
        "mdlm": [(2, 256, 4096)] if quick else [(4, 512, 8192)],
        "linear": [(512, 256, 4096)] if quick else [(2048, 512, 8192)],
        "dflash": [(2, 255, 256, 4096)] if quick else [(4, 510, 512, 8192)],
        "warmup": 1 if quick else 2,
        "reps": 3 if quick else 7,
    }


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def bench_mdlm_loss(table: Table, device: torch.device, sizes: dict) -> None:
    loss_fn = MDLMCrossEntropyLoss()
    for batch, length, vocab in sizes["mdlm"]:
        for dtype in (torch.bfloat16, torch.float32):
            g = torch.Generator(device=device).manual_seed(0)
            logits = torch.randn(batch, length, vocab, device=device, dtype=dtype, generator=g).requires_grad_(True)
            ids = torch.randint(0, vocab - 1, (batch, length), device=device, generator=g)
            loss_mask = torch.ones(batch, length, device=device)
            loss_mask[:, : length // 10] = 0
            _, noise, p = corrupt_uniform(ids, loss_mask, vocab - 1, generator=g)
            count = loss_mask.sum()

            def step(_j=0):
                logits.grad = None
                out = loss_fn(logits, ids, noise, p, loss_mask, num_diffusion_tokens=count)
                out.total_loss.backward()
                return out

            timing = time_calls(step, device, sizes["warmup"], sizes["reps"], wall_loop=False)
            peak = peak_memory(step, device)
            dt = "bf16" if dtype == torch.bfloat16 else "fp32"
            frac = float(noise.float().mean())
            table.add(f"MDLMCrossEntropyLoss fwd+bwd ({dt} logits)", device.type,
                      f"B={batch} L={length} V={vocab}", timing, peak, notes=f"{frac:.0%} positions corrupted")
            del logits, ids, loss_mask, noise, p
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()


def bench_linear_ce(table: Table, device: torch.device, sizes: dict) -> None:
    dtype = torch.bfloat16
    for rows, dim, vocab in sizes["linear"]:
        g = torch.Generator(device=device).manual_seed(0)
        hidden = (torch.randn(rows, dim, device=device, dtype=dtype, generator=g)).requires_grad_(True)
        weight = (torch.randn(vocab, dim, device=device, dtype=dtype, generator=g) / math.sqrt(dim)).requires_grad_(True)
        targets = torch.randint(0, vocab, (rows,), device=device, generator=g)

        def dense(_j=0):
            hidden.grad = weight.grad = None
            nll = F.cross_entropy(F.linear(hidden, weight).float(), targets, reduction="none")
            nll.sum().backward()
            return nll

        def fused(_j=0, chunk=1024, compiled=False):
            hidden.grad = weight.grad = None
            with switched(lit_dllm.losses, "COMPILE_LINEAR_CE_ON_CUDA", compiled):
                nll, _ = fused_linear_cross_entropy(hidden, weight, targets, chunk_size=chunk)
                nll.sum().backward()
            return nll

        def weighted(_j=0, chunk=1024, compiled=False):
            hidden.grad = weight.grad = None
            with switched(lit_dllm.losses, "COMPILE_LINEAR_CE_ON_CUDA", compiled):
                total, nll, _ = weighted_linear_cross_entropy(hidden, weight, targets, chunk_size=chunk)
                total.backward()
            return nll

        # float64 reference, chunked (eager): nll, dW, dh
        h64, w64 = hidden.detach().double().requires_grad_(True), weight.detach().double().requires_grad_(True)
        nll64, _ = fused_linear_cross_entropy(h64, w64, targets)
        nll64.sum().backward()
        reference = (nll64.detach(), w64.grad, h64.grad)
        del h64, w64, nll64

        def error(fn) -> str:
            got = (fn().detach(), weight.grad, hidden.grad)
            errs = ", ".join(f"{n} {rel_err(a, b):.1e}" for n, a, b in zip(("nll", "dW", "dh"), got, reference))
            return f"rel err vs fp64: {errs}"

        shape = f"N={rows} D={dim} V={vocab} bf16"
        variants = [
            ("dense linear + fp32 CE fwd+bwd", dense, "materialises [N, V]; "),
            ("fused_linear_cross_entropy fwd+bwd (chunk 1024)", fused, ""),
            ("fused_linear_cross_entropy fwd+bwd (chunk 4096)", lambda j=0: fused(j, 4096), ""),
        ]
        if device.type == "cuda":
            variants += [
                (f"fused_linear_cross_entropy compiled fwd+bwd (chunk {c})", lambda j=0, c=c: fused(j, c, True), "")
                for c in (1024, 4096)
            ]
        variants += [("weighted_linear_cross_entropy fwd+bwd (chunk 2048)", lambda j=0: weighted(j, 2048), "")]
        if device.type == "cuda":
            variants += [(f"weighted_linear_cross_entropy compiled fwd+bwd (chunk {c})",
                          lambda j=0, c=c: weighted(j, c, True), "") for c in (1024, 2048, 4096)]
        for label, fn, note in variants:
            note += error(fn)  # also the warm-up (and compile) call
            timing = time_calls(fn, device, sizes["warmup"], sizes["reps"], wall_loop=False)
            table.add(label, device.type, shape, timing, peak_memory(fn, device), notes=note)
        del reference
        del hidden, weight, targets
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def bench_dflash(table: Table, device: torch.device, sizes: dict) -> None:
    dtype = torch.bfloat16
    block = 16
    loss_fn = DFlashDecayLoss(loss_gamma=7.0, chunk_size=1024, normalize="tokens")
    for batch, length, dim, vocab in sizes["dflash"]:
        assert length % (block - 1) == 0
        g = torch.Generator(device=device).manual_seed(0)
        hidden = torch.randn(batch, length, dim, device=device, dtype=dtype, generator=g).requires_grad_(True)
        weight = (torch.randn(vocab, dim, device=device, dtype=dtype, generator=g) / math.sqrt(dim)).requires_grad_(True)
        targets = torch.randint(0, vocab, (batch, length), device=device, generator=g)
        block_mask = (torch.rand(batch, length, device=device, generator=g) < 0.9).float()
        count = block_mask.sum()

        def unfused(_j=0):
            hidden.grad = weight.grad = None
            logits = F.linear(hidden, weight)
            out = loss_fn(logits, targets, block_mask, num_tokens=count, block_size=block)
            out.total_loss.backward()
            return out

        def fused(_j=0):
            hidden.grad = weight.grad = None
            out = loss_fn.forward_fused(hidden, weight, targets, block_mask, num_tokens=count, block_size=block)
            out.total_loss.backward()
            return out

        ref = unfused().total_loss.detach().clone()
        ref_gw = weight.grad.clone()
        got = fused().total_loss.detach()
        err = f"rel err vs forward: loss {rel_err(got, ref):.1e}, dW {rel_err(weight.grad, ref_gw):.1e}"
        del ref_gw
        shape = f"B={batch} T={length} D={dim} V={vocab} bs={block} bf16"
        for label, fn, note in (
            ("DFlashDecayLoss.forward fwd+bwd (incl. LM head)", unfused, "materialises [B, T, V]"),
            ("DFlashDecayLoss.forward_fused fwd+bwd", fused, err),
        ):
            timing = time_calls(fn, device, sizes["warmup"], sizes["reps"], wall_loop=False)
            table.add(label, device.type, shape, timing, peak_memory(fn, device), notes=note)
        del hidden, weight, targets, block_mask
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------------------


def run_section(table: Table, title: str, fn, *args) -> None:
    print(f"## {title}", flush=True)
    t0 = time.perf_counter()
    try:
        fn(table, *args)
    except torch.cuda.OutOfMemoryError as err:
        table.add(title, str(args[0]), "-", notes=f"OOM: {str(err)[:120]}", median_override="OOM")
    except Exception as err:
        traceback.print_exc()
        table.add(title, str(args[0]), "-", notes=f"ERROR {type(err).__name__}: {str(err)[:160]}",
                  median_override="error")
    print(f"   ({time.perf_counter() - t0:.1f} s)", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda", "all"], default="all")
    parser.add_argument("--quick", action="store_true", help="fewer repeats, smaller loss sizes")
    parser.add_argument("--out", default=None, help="also write the markdown table to this file")
    parser.add_argument("--skip", default="", help="comma list of sections to skip: kernels,graphs,losses")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads for the CPU runs")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    skip = set(filter(None, args.skip.split(",")))

    devices: list[torch.device] = []
    if args.device in ("cpu", "all"):
        devices.append(torch.device("cpu"))
    if args.device in ("cuda", "all"):
        if torch.cuda.is_available():
            devices.append(torch.device("cuda"))
        elif args.device == "cuda":
            raise SystemExit("--device cuda but torch.cuda.is_available() is False")
        else:
            print("(no CUDA device: CPU only)")
    env = environment_line()
    print(env, flush=True)
    if any(d.type == "cuda" for d in devices):
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 stays fp32 in the loss timings

    table = Table()
    cpu_reference: dict = {}
    t_start = time.perf_counter()
    if "kernels" not in skip and any(d.type == "cuda" for d in devices) and not any(d.type == "cpu" for d in devices):
        # keyed results are device-independent: compute the CPU reference quietly for the check
        sets = make_batches(1, 8, 4096, 128256, torch.device("cpu"), seed=0)
        for name, fn, keyed in kernel_specs(128255, 128256, 32):
            mode = "keys" if keyed else "-"
            ids, lm, keys = sets[0]
            cpu_reference[(name, mode)] = fn(ids, lm, None, keys if keyed else None)
    for device in devices:
        if "kernels" not in skip:
            run_section(table, f"corruption kernels on {device.type}", bench_kernels, device, args.quick, cpu_reference)
        if "losses" not in skip:
            sizes = loss_sizes(device, args.quick)
            run_section(table, f"MDLM loss on {device.type}", bench_mdlm_loss, device, sizes)
            run_section(table, f"fused linear CE on {device.type}", bench_linear_ce, device, sizes)
            run_section(table, f"DFlash loss on {device.type}", bench_dflash, device, sizes)
        if device.type == "cuda" and "graphs" not in skip:  # last: a failed capture could poison the context
            run_section(table, "CUDA graphs (keyed kernels)", bench_graphs, device, args.quick)

    text = "\n".join([
        "# lit_dllm primitives benchmark",
        "",
        env,
        f"mode: {'quick' if args.quick else 'full'}; total {time.perf_counter() - t_start:.0f} s. "
        "median / p10–p90 over per-call times (CUDA events on GPU); 'wall' = host time per call of a "
        "back-to-back loop. Peak MiB = torch.cuda.max_memory_allocated during one call (Δ = above the "
        "allocation before the call). Kernels: B=8 L=4096 block 32, V=128256, 4 input sets rotated.",
        "",
        markdown_table(HEADER, table.rows),
    ])
    print()
    emit(text, args.out)


if __name__ == "__main__":
    main()
