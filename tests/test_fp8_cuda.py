"""FP8 training on a GPU with float8 tensor cores (compute capability >= 8.9; skipped elsewhere, and without torchao):
50 bf16-mixed MDLM steps with compiled fp8 blocks follow the compiled bf16 ones within bf16 noise. Run on the lent GPU
by ``bash bench/run_on_gpu.sh fp8``.

Tolerance, derived as ``tests/test_compile_cuda.py`` derives it: the same 50 steps in fp32 (eager) measure the rounding
noise of the bf16 run. The fp8 losses must stay as close to the bf16 ones as twice the distance from eager bf16 to fp32
(step by step at most, and on average), plus 1e-3 for steps where the bf16 and fp32 runs happen to agree.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from lit_dllm.fp8 import MIN_CAPABILITY, RECIPES

from .test_compile_cuda import assert_within_bf16_noise, losses

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < MIN_CAPABILITY,
                       reason="needs a CUDA GPU with float8 tensor cores (compute capability >= 8.9)"),
    pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="needs torchao: pip install -e '.[fp8]'"),
]


@pytest.fixture(scope="module")
def bf16():
    """The eager bf16 run's distance to fp32 (the noise) and the compiled bf16 losses (the reference)."""
    fp32 = torch.tensor(losses("32-true", compile=False))
    eager = torch.tensor(losses("bf16-mixed", compile=False))
    return (eager - fp32).abs(), torch.tensor(losses("bf16-mixed", compile=True))


@pytest.mark.parametrize("recipe", RECIPES)
def test_compiled_fp8_losses_follow_bf16_within_bf16_noise(bf16, recipe):
    noise, reference = bf16
    fp8 = torch.tensor(losses("bf16-mixed", compile=True, fp8=recipe))
    assert_within_bf16_noise(fp8, reference, noise, f"{recipe} fp8 vs compiled bf16")
