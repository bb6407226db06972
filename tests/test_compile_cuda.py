"""Compiled blocks with inductor on a GPU: 50 bf16-mixed MDLM steps equal eager's within bf16 noise (skipped without
CUDA; run on the lent GPU by ``bash bench/run_on_gpu.sh tests``).

Tolerance: bf16 rounds each activation to 8 significant bits, and inductor rounds differently from eager (it fuses
element-wise chains in fp32), so the two runs are not bit-equal and drift apart as the optimizer follows slightly
different gradients. The scale of that noise is measured in the same test: the same 50 steps in fp32. The compiled
bf16 losses must stay as close to the eager bf16 ones as twice the distance from eager bf16 to fp32 (step by step
at most, and on average), plus 1e-3 for steps where the two eager runs happen to agree.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch

from lit_dllm import CausalBackbone, LLaDAGeneration, Optimization, Parallelism, SingleDeviceStrategy
from lit_dllm.families.mdlm.module import MDLMModule

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

VOCAB, STEPS = 512, 50
CONFIG = {
    "model_type": "llama", "hidden_size": 256, "intermediate_size": 1024, "num_hidden_layers": 4,
    "num_attention_heads": 8, "num_key_value_heads": 4, "max_position_embeddings": 256,
}


def batches() -> list[dict]:
    """Batches of 8 rows at bucketed lengths (64, 96, 128, as ``pad_seq_len_divisible=32`` makes them)."""
    g = torch.Generator().manual_seed(0)
    out = []
    for step in range(STEPS):
        length = (64, 96, 128)[step % 3]
        loss_mask = torch.ones(8, length)
        loss_mask[:, : length // 4] = 0
        out.append({
            "input_ids": torch.randint(1, VOCAB - 1, (8, length), generator=g), "loss_mask": loss_mask,
            "attention_mask": torch.ones(8, length, dtype=torch.long), "input_lengths": torch.full((8,), length),
            "example_index": torch.arange(step * 8, step * 8 + 8),
        })
    return out


def losses(precision: str, *, config: dict = CONFIG, vocab: int = VOCAB, data: list[dict] | None = None,
           lr: float = 1e-3, **parallelism) -> list[float]:
    """Each step's ``train/loss`` of the MDLM (``config``, ``vocab``) trained on ``data`` (default :func:`batches`)
    at learning rate ``lr`` under the run settings ``parallelism`` (e.g. ``compile``, ``fp8``)."""
    torch.manual_seed(0)
    data = batches() if data is None else data
    module = MDLMModule(
        vocab_size=vocab, mask_token_id=vocab - 1, backbone=CausalBackbone(model_config=config),
        generation=LLaDAGeneration(val_generate_batches=0), optimization=Optimization(lr=lr, warmup=0),
    )
    recorded = []

    class Record(L.Callback):
        def on_train_batch_end(self, trainer, *args):
            recorded.append(float(trainer.callback_metrics["train/loss"]))

    trainer = L.Trainer(
        accelerator="gpu", devices=1, strategy=SingleDeviceStrategy(parallelism=Parallelism(**parallelism)),
        precision=precision, max_steps=len(data), logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0, callbacks=[Record()],
    )
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=None))
    return recorded


def assert_within_bf16_noise(losses_: torch.Tensor, reference: torch.Tensor, noise: torch.Tensor, what: str) -> None:
    """``losses_`` stay within twice bf16's distance to fp32 (``noise``, per step) of ``reference``, plus 1e-3."""
    gap = (losses_ - reference).abs()
    print(f"bf16 vs fp32: max {noise.max():.4f} mean {noise.mean():.4f}; {what}: max {gap.max():.4f} "
          f"mean {gap.mean():.4f}; loss {losses_[0]:.3f} -> {losses_[-1]:.3f}")
    assert torch.isfinite(losses_).all()
    assert gap.max() <= 2 * noise.max() + 1e-3
    assert gap.mean() <= 2 * noise.mean() + 1e-3


def test_compiled_bf16_losses_equal_eager_within_bf16_noise():
    fp32 = torch.tensor(losses("32-true", compile=False))
    eager = torch.tensor(losses("bf16-mixed", compile=False))
    compiled = torch.tensor(losses("bf16-mixed", compile=True))
    assert_within_bf16_noise(compiled, eager, (eager - fp32).abs(), "compiled vs eager bf16")
