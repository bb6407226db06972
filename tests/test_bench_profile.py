"""bench/_common.py's profile analysis (idle device time attributed to the host code that launched what ended it; the
device's kernels without annotation ranges), its unsynchronised step timer, and bench/bench_block_masks.py's CPU
run."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

spec = importlib.util.spec_from_file_location("bench_common", Path(__file__).parents[1] / "bench" / "_common.py")
bench_common = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench_common)

MAIN, BACKWARD = 1, 2  # host threads


def span(cat: str, name: str, ts: float, dur: float, tid: int = MAIN, **args) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid, "args": args}


def kernel(name: str, ts: float, dur: float, correlation: int) -> dict:
    return span("kernel", name, ts, dur, tid=7, correlation=correlation)


def launch(ts: float, correlation: int, tid: int = MAIN) -> dict:
    return span("cuda_runtime", "cudaLaunchKernel", ts, 1, tid=tid, correlation=correlation)


@pytest.fixture
def trace() -> list[dict]:
    """Kernels (device µs): a 0-10, b 30-40 (gap 20, launched in a transformers forward), c 35-50 on another stream
    (no gap), d 55-60 (gap 5, launched by the backward's engine, no Python frame), e 70-80 (gap 10, launched inside
    an outer and an inner frame that start together: the inner one names it)."""
    return [
        span("python_function", "/site/lightning/pytorch/loop.py(10): run", 0, 100),
        span("python_function", "/site/transformers/models/gemma.py(5): forward", 1, 20),
        span("python_function", "/site/torch/nn/modules/module.py(1): _call_impl", 2, 10),
        span("cpu_op", "aten::mm", 3, 5),
        span("cpu_op", "autograd::engine::evaluate_function: MmBackward0", 40, 20, tid=BACKWARD),
        span("cpu_op", "aten::mm", 41, 5, tid=BACKWARD),
        span("python_function", "/work/lit_dllm/model.py(3): denoise", 60, 30),
        span("python_function", "/work/lit_dllm/model.py(9): logits", 60, 5),
        launch(0, 1), launch(4, 2), launch(5, 3), launch(42, 4, tid=BACKWARD), launch(62, 5),
        kernel("a", 0, 10, 1), kernel("b", 30, 10, 2), kernel("c", 35, 15, 3), kernel("d", 55, 5, 4),
        kernel("e", 70, 10, 5),
    ]


def test_idle_gaps_go_to_the_innermost_frame_of_our_code_or_the_outermost_operator(trace):
    assert bench_common.gap_sources(trace) == {
        "transformers/models/gemma.py(5): forward": 20,
        "autograd::engine::evaluate_function: MmBackward0": 5,
        "lit_dllm/model.py(9): logits": 10,
    }


def test_without_device_work_there_are_no_gaps(trace):
    assert bench_common.gap_sources([e for e in trace if e["cat"] != "kernel"]) == {}


def test_cuda_kernels_leave_out_annotation_ranges_and_host_events():
    """With CPU activity recorded, ``record_function`` ranges (NCCL's, the optimizer's) also appear on the device:
    they are not kernels (they would hide idle time and count their kernels twice)."""
    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU

    def event(name, start, end, device, annotation=False):
        return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end), device_type=device,
                               is_user_annotation=annotation)

    prof = SimpleNamespace(events=lambda: [
        event("gemm", 12, 20, cuda), event("nccl:_all_gather_base", 0, 10, cuda, annotation=True),
        event("ncclDevKernel_AllGather", 1, 9, cuda), event("aten::mm", 0, 5, cpu),
    ])
    assert bench_common.cuda_kernels(prof) == [(1, 9, "ncclDevKernel_AllGather"), (12, 20, "gemm")]


def test_block_mask_bench_runs_on_the_cpu(tmp_path):
    """Eager on both sides there (lit_dllm compiles only on CUDA), so the same blocks and a table."""
    out = tmp_path / "masks.md"
    result = subprocess.run([sys.executable, "bench/bench_block_masks.py", "--batch", "2", "--seq", "256", "--width",
                             "128", "--block", "32", "--window", "64", "--repeats", "2", "--out", str(out)],
                            cwd=Path(__file__).parents[1], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    text = out.read_text()
    assert "- same blocks as eager: PASS" in text and "at width 64 (a new shape): PASS" in text


def test_unsynchronised_step_times_cover_every_batch_and_the_same_losses():
    """``fit_timed(..., synchronise=False)`` times each batch from its start to the next one's (the last to the end
    of training) and reads the losses only after training: the same losses as the synchronised timer."""
    import lightning as L

    class Regression(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            loss = torch.nn.functional.mse_loss(self.layer(batch[0]), batch[1])
            self.log("train/loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    generator = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 4, generator=generator), torch.randn(8, 1, generator=generator)) for _ in range(6)]
    runs = {synchronise: bench_common.fit_timed(Regression(), batches, torch.device("cpu"), "32", synchronise,
                                                accumulate_grad_batches=2, max_steps=3)
            for synchronise in (True, False)}
    unsynchronised = runs[False]
    assert len(unsynchronised.steps) == 6 and all(t > 0 for t in unsynchronised.steps)
    assert unsynchronised.iters == unsynchronised.steps
    assert len(runs[True].losses) == 6 and unsynchronised.losses == runs[True].losses
