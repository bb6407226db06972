"""FSDP2 through Lightning's ModelParallelStrategy gives the single-process gradient.

Not collected by pytest (needs 2 GPUs); run on a 2-GPU machine:
    torchrun --nproc_per_node=2 tests/multigpu/check_fsdp_step.py
Each rank takes half of every micro-batch, with two micro-batches per optimizer step
(accumulate_grad_batches=2), so the step exercises the DP count all-reduce, the ×DP loss scale and
the gradient correction on sharded (DTensor) gradients. Prints PASS and exits 0 on success.
"""

import os
import sys

import lightning as L
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from tests.core.test_training_step import collate, make_examples, make_module  # noqa: E402


def reference_update() -> dict[str, torch.Tensor]:
    """One SGD(lr=1) step on the whole batch in one process: the update is minus the gradient."""
    module = make_module()
    batch = collate(make_examples(n=16))
    noisy = module.corrupt(batch, module.noise_keys(batch, 0))
    total = module.token_counts(batch, noisy)["diffusion"].float()
    module.compute_loss(batch, noisy, {"diffusion": total}).output.total_loss.backward()
    return {name: param.grad.detach() for name, param in module.named_parameters()}


def main() -> None:
    expected = reference_update()
    module = make_module()  # built on the CPU; sharded by configure_model once the trainer runs
    before = {name: param.detach().clone() for name, param in make_module().named_parameters()}
    trainer = L.Trainer(
        accelerator="gpu", devices=2, strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
        max_steps=1, accumulate_grad_batches=2, precision="32-true", logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
    )
    trainer.fit(module, DataLoader(make_examples(n=16), batch_size=4, collate_fn=collate))
    worst = 0.0
    for name, param in module.named_parameters():
        update = before[name].cuda() - param.detach().full_tensor()
        worst = max(worst, ((update - expected[name].cuda()).abs().max() / expected[name].abs().max().clamp_min(1e-12)).item())
    if trainer.global_rank == 0:
        print(f"max relative difference to the single-process update: {worst:.2e}")
        print("PASS" if worst < 1e-4 else "FAIL")
    sys.exit(0 if worst < 1e-4 else 1)


if __name__ == "__main__":
    main()
