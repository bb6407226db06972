"""DFlash draft training under FSDP2 follows the single-process run step by step.

Not collected by pytest (tests/families/dflash/test_parallel_dflash.py runs its CPU path with gloo). On 2 GPUs:

    torchrun --nproc_per_node=2 tests/multigpu/check_dflash_parallel.py

``DFlashModule`` (a tiny random Llama target from ``target.model_config``, a 2-layer draft, block 4, 3 anchors per row, fp32,
SGD with momentum at a constant LR) is trained by ``lightning.Trainer`` with Lightning's ``ModelParallelStrategy``:
the module's ``configure_model`` shards target and draft with FSDP2 (``lit_dllm.parallel.parallelize``). Step ``s``
takes the global rows ``8s .. 8s+7`` (random lengths, a 4-token prompt), rank ``r`` of ``D`` the rows ``r, r+D, ...``
(Lightning's distributed sampler would shuffle rows across steps); anchors are keyed by example, so every layout
draws the same blocks. Rank 0 then runs the same steps unsharded on one device (the module's own hooks in a plain
loop) and prints every step's loss and gradient norm with their relative differences; the script exits 1 if one
exceeds ``--tolerance``.

Measured 2026-11-26 on 2 x H100 80GB (NCCL, torch 2.11+cu130, transformers 5.24, lightning 2.6.6), 5 steps: largest
relative difference of loss and gradient norm 1.7e-7 (largest loss difference 4.8e-7). On a 2-core CPU with
``--accelerator cpu`` (gloo, torch 2.13): 2.3e-7 (docs/BENCHMARKS.md §8).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

import lightning as L
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.utils.data import DataLoader, default_collate

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from lit_dllm.families.dflash.module import DFlashGeneration, DFlashModule  # noqa: E402
from lit_dllm.settings import CausalBackbone, Optimization  # noqa: E402
from lit_dllm.meshes import grad_norm  # noqa: E402
from lit_dllm.testing import TINY_DFLASH_DRAFT, TINY_LLAMA  # noqa: E402
from tests.multigpu.check_moe_parallel import Record  # noqa: E402
from tests.test_parallel import make_optimizer, momentum_sgd, report_differences  # noqa: E402

VOCAB, MASK, SEQ, PROMPT, GLOBAL_BATCH = 64, 63, 24, 4, 8


class SeededDFlash(DFlashModule):
    """``DFlashModule`` whose new draft is drawn from a fixed seed: the same weights on every rank and in the
    reference, whatever the trainer drew from the global generator before ``configure_model``."""

    def build_model(self):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            return super().build_model()


def make_module(lr: float) -> SeededDFlash:
    return SeededDFlash(
        vocab_size=VOCAB, mask_token_id=MASK, pad_token_id=0, target=CausalBackbone(model_config=TINY_LLAMA),
        draft_config=TINY_DFLASH_DRAFT, target_layer_ids=[0, 1], block_size=4, num_anchors=3,
        generation=DFlashGeneration(val_generate_batches=0),
        optimization=Optimization(lr=lr, optimizer=functools.partial(momentum_sgd, lr=lr), weight_decay=0.0, warmup=0,
                                  min_lr_ratio=1.0),
    )


def make_rows(steps: int) -> list[dict[str, torch.Tensor]]:
    """``steps`` global batches of rows: random ids, lengths in [SEQ/2, SEQ] (the rest padding), a 4-token prompt."""
    generator = torch.Generator().manual_seed(0)
    count = steps * GLOBAL_BATCH
    ids = torch.randint(1, MASK, (count, SEQ), generator=generator)
    lengths = torch.randint(SEQ // 2, SEQ + 1, (count,), generator=generator)
    real = torch.arange(SEQ)[None] < lengths[:, None]
    loss_mask = (real & (torch.arange(SEQ)[None] >= PROMPT)).float()
    return [{"input_ids": ids[i] * real[i], "loss_mask": loss_mask[i], "attention_mask": real[i].long(),
             "input_lengths": lengths[i], "example_index": torch.tensor(i)} for i in range(count)]


def reference(steps: int, lr: float, device: torch.device) -> list[tuple[float, float]]:
    """(loss, gradient norm) of each step on one device, unsharded: the module's hooks on the whole global batch."""
    module = make_module(lr)
    module.configure_model()
    module.to(device)
    optimizer = make_optimizer(module)
    rows, history = make_rows(steps), []
    for step in range(steps):
        batch = {k: v.to(device) for k, v in default_collate(rows[step * GLOBAL_BATCH:][:GLOBAL_BATCH]).items()}
        prepared = module.prepare_batch(batch, module.noise_keys(batch, 0))
        total = module.token_counts(batch, prepared)["weighted_targets"].float()
        loss = module.compute_loss(batch, prepared, {"weighted_targets": total}).output.total_loss
        loss.backward()
        norm = grad_norm(module.model.parameters())
        optimizer.step()
        optimizer.zero_grad()
        history.append((float(loss.detach()), float(norm)))
    return history


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--accelerator", choices=["gpu", "cpu"], default="gpu")
    parser.add_argument("--tolerance", type=float, default=1e-5)
    args = parser.parse_args()
    devices = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if GLOBAL_BATCH % devices:
        parser.error(f"the global batch of {GLOBAL_BATCH} rows does not split over {devices} ranks")
    if args.accelerator == "gpu":
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 as on the CPU
    else:
        torch.set_num_threads(1)
    record = Record()
    trainer = L.Trainer(
        accelerator=args.accelerator, devices=devices, precision="32-true", max_steps=args.steps,
        strategy=ModelParallelStrategy(data_parallel_size=devices, tensor_parallel_size=1) if devices > 1 else "auto",
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=0, num_sanity_val_steps=0, use_distributed_sampler=False, callbacks=[record],
    )
    rank, rows = int(os.environ.get("RANK", 0)), make_rows(args.steps)
    own = [row for step in range(args.steps) for row in rows[step * GLOBAL_BATCH:][:GLOBAL_BATCH][rank::devices]]
    trainer.fit(make_module(args.lr), DataLoader(own, batch_size=GLOBAL_BATCH // devices))
    if trainer.global_rank != 0:
        return 0
    device = torch.device("cuda" if args.accelerator == "gpu" else "cpu")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"DFlash FSDP2 over {devices} ranks ({name}), {args.steps} steps, global batch {GLOBAL_BATCH}, lr {args.lr}")
    expected = reference(args.steps, args.lr, device)
    print(f"max |loss difference| {max(abs(a[0] - b[0]) for a, b in zip(record.history, expected)):.2e}")
    return report_differences(record.history, expected, args.tolerance)


if __name__ == "__main__":
    sys.exit(main())
