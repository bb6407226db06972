"""FP8 training on a GPU with float8 tensor cores (compute capability >= 8.9; skipped elsewhere, and without torchao):
compiled fp8 MDLM runs train as the compiled bf16 run does, within bf16 noise. Run on the lent GPU by
``bash bench/run_on_gpu.sh fp8-tests``.

Noise, derived as ``tests/test_compile_cuda.py`` derives it: the same steps in fp32 (eager) measure the rounding noise
of the bf16 run. The criterion compares the curves' level, not each step: over the run, fp8's mean signed distance to
the bf16 curve must stay within twice bf16's mean distance to fp32, plus 1e-3. Step by step fp8 cannot stay within
bf16's noise: with identical weights, at step 0, quantisation already moves the real-shaped loss by 0.007 and 0.013 on
two seeds, against bf16's 0.001 (docs/BENCHMARKS.md §13, twelfth session).

Two runs: the tiny model of ``test_compile_cuda`` on random tokens (50 steps), and the issue's real-shaped run of 200
steps (the 1.24B model's layer shapes with 4 layers, 8 x 1024 tokens a step).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from lit_dllm.fp8 import MIN_CAPABILITY, RECIPES

from .test_compile_cuda import losses

REAL_VOCAB, REAL_STEPS = 32768, 200
REAL_SHAPED = {  # bench/bench_mdlm_step.py's 1.24B Llama layers, 4 of them
    "model_type": "llama", "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 4,
    "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 1024,
}


def periodic_rows(steps: int = REAL_STEPS, rows: int = 8, length: int = 1024, period: int = 32,
                  vocab: int = REAL_VOCAB) -> list[dict]:
    """Batches whose rows repeat their own random ``period`` tokens: a masked token can be read from its copies
    ``period`` positions away (learnable, unlike uniform tokens; a tiny model on the CPU does not learn it within
    200 steps, so the test does not require the loss to fall)."""
    g = torch.Generator().manual_seed(0)
    out = []
    for step in range(steps):
        pattern = torch.randint(1, vocab - 1, (rows, period), generator=g)
        out.append({
            "input_ids": pattern.repeat(1, length // period), "loss_mask": torch.ones(rows, length),
            "attention_mask": torch.ones(rows, length, dtype=torch.long), "input_lengths": torch.full((rows,), length),
            "example_index": torch.arange(step * rows, (step + 1) * rows),
        })
    return out


def real_losses(precision: str, **options) -> list[float]:
    return losses(precision, config=REAL_SHAPED, vocab=REAL_VOCAB, data=periodic_rows(), lr=3e-4, **options)

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < MIN_CAPABILITY,
                       reason="needs a CUDA GPU with float8 tensor cores (compute capability >= 8.9)"),
    pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="needs torchao: pip install -e '.[fp8]'"),
]


def assert_trains_like_bf16(fp8: torch.Tensor, reference: torch.Tensor, noise: torch.Tensor, what: str) -> None:
    """``fp8``'s losses lie on ``reference``'s curve on average: |mean(fp8 - reference)| <= 2 x mean(noise) + 1e-3."""
    offset, gap = (fp8 - reference).mean(), (fp8 - reference).abs()
    print(f"bf16 vs fp32: mean {noise.mean():.4f} max {noise.max():.4f}; {what}: mean offset {offset:+.4f}, "
          f"per step mean {gap.mean():.4f} max {gap.max():.4f}; loss {fp8[0]:.3f} -> {fp8[-1]:.3f}")
    assert torch.isfinite(fp8).all()
    assert offset.abs() <= 2 * noise.mean() + 1e-3


def noise_and_reference(run) -> tuple[torch.Tensor, torch.Tensor]:
    """``run``'s eager bf16 distance to fp32 (the noise) and its compiled bf16 losses (the reference)."""
    fp32 = torch.tensor(run("32-true", compile=False))
    eager = torch.tensor(run("bf16-mixed", compile=False))
    return (eager - fp32).abs(), torch.tensor(run("bf16-mixed", compile=True))


@pytest.fixture(scope="module")
def bf16():
    return noise_and_reference(losses)


@pytest.mark.parametrize("recipe", RECIPES)
def test_compiled_fp8_trains_like_bf16_within_bf16_noise(bf16, recipe):
    noise, reference = bf16
    fp8 = torch.tensor(losses("bf16-mixed", compile=True, fp8=recipe))
    assert_trains_like_bf16(fp8, reference, noise, f"{recipe} fp8 vs compiled bf16")


@pytest.fixture(scope="module")
def real_bf16():
    return noise_and_reference(real_losses)


@pytest.mark.parametrize("recipe", RECIPES)
def test_real_shaped_fp8_trains_like_bf16_over_200_steps(real_bf16, recipe):
    noise, reference = real_bf16
    fp8 = torch.tensor(real_losses("bf16-mixed", compile=True, fp8=recipe))
    assert_trains_like_bf16(fp8, reference, noise, f"real-shaped {recipe} fp8 vs compiled bf16")
