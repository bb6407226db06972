"""FSDP2 + LoRA through Lightning's ModelParallelStrategy gives the single-process update, and exports from the shards.

Not collected by pytest (``tests/test_lora.py`` proves the same on the CPU with gloo); run on a 2-GPU machine:
    torchrun --nproc_per_node=2 tests/multigpu/check_lora_parallel.py
    torchrun --nproc_per_node=2 tests/multigpu/check_lora_parallel.py --accelerator cpu   # the same on gloo
A tiny MDLM with LoRA (r 4) takes one SGD(lr=1) step over 16 rows, each rank half of every micro-batch, two
micro-batches per step. Checks: every adapter's update equals minus the single-process gradient, the base weights
did not move, and ``save_pretrained`` (called on every rank, gathered to rank 0) writes the merged model that the
single process writes. Then 4 steps on a pretrained base, stopped after 2 and resumed from the sharded checkpoint, give
the uninterrupted run's losses. Prints PASS and exits 0 on success.
"""

import argparse
import os
import sys
import tempfile

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from lit_dllm import CausalBackbone, LLaDAGeneration, MDLMModule, Optimization  # noqa: E402
from tests.core.test_training_step import (  # noqa: E402
    EOS, MASK, PAD, VOCAB, collate, make_examples, make_module, sgd,
)

LORA = {"r": 4, "lora_alpha": 8}
TOLERANCE = 1e-4


def reference(folder: str) -> dict[str, torch.Tensor]:
    """The single-process gradients of one step on the whole batch; the updated module's merged export in ``folder``."""
    module = make_module(lora=LORA)
    batch = collate(make_examples(n=16))
    noisy = module.corrupt(batch, module.noise_keys(batch, 0))
    total = module.token_counts(batch, noisy)["diffusion"].float()
    module.compute_loss(batch, noisy, {"diffusion": total}).output.total_loss.backward()
    grads = {name: param.grad.detach().clone() for name, param in module.named_parameters() if param.requires_grad}
    with torch.no_grad():
        for name, param in module.named_parameters():
            if param.requires_grad:
                param -= grads[name]
    module.save_pretrained(folder)
    return grads


def trainer(args, root: str, steps: int, callbacks=()) -> L.Trainer:
    return L.Trainer(
        accelerator=args.accelerator, devices=2, strategy=ModelParallelStrategy(data_parallel_size=2,
        tensor_parallel_size=1), max_steps=steps, accumulate_grad_batches=2, precision="32-true", logger=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, default_root_dir=root,
        callbacks=[*callbacks, L.pytorch.callbacks.ModelCheckpoint(dirpath=root, save_last=True,
                                                                   every_n_train_steps=1)],
    )


class Losses(L.Callback):
    """Each optimizer step's logged loss; stops the run after step ``stop_at`` (same schedule as the whole run)."""

    def __init__(self, stop_at: int | None = None):
        self.losses, self.stop_at = [], stop_at

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        if batch_idx % 2 == 1:  # the second micro-batch: the optimizer step has logged its loss
            self.losses.append(float(trainer.callback_metrics["train/loss"]))
        if trainer.global_step == self.stop_at:
            trainer.should_stop = True


def resumed_losses(args, folder: str) -> tuple[list[float], list[float]]:
    """Losses of 4 steps of LoRA on a pretrained base without a stop, and stopped after 2 (an epoch: a plain
    DataLoader restarts its epoch on resume) then resumed."""
    base = os.path.join(folder, "base")
    if int(os.environ.get("RANK", 0)) == 0:
        make_module().model.hf.save_pretrained(base)
    if dist.is_initialized():
        dist.barrier()
    runs = []
    for root, plan in (("whole", [(None, None)]), ("parts", [(2, None), (None, "last")])):
        losses = Losses()
        for stop_at, ckpt in plan:
            losses.stop_at = stop_at
            torch.manual_seed(0)  # the adapters' initial weights
            module = MDLMModule(vocab_size=VOCAB, mask_token_id=MASK, pad_token_id=PAD, eos_token_id=EOS,
                                backbone=CausalBackbone(model=base),
                                optimization=Optimization(optimizer=sgd, warmup=0, weight_decay=0.0),
                                generation=LLaDAGeneration(val_generate_batches=0), lora=LORA)
            path = os.path.join(folder, root, "last.ckpt") if ckpt else None
            trainer(args, os.path.join(folder, root), 4, [losses]).fit(
                module, DataLoader(make_examples(n=16), batch_size=4, collate_fn=collate), ckpt_path=path)
        runs.append(losses.losses)
    return runs[0], runs[1]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--accelerator", default="gpu", choices=["gpu", "cpu"])
    args = parser.parse_args()
    # one folder for both ranks (torchrun gives them one run id)
    folder = os.path.join(tempfile.gettempdir(), f"check_lora_parallel_{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}")
    single, sharded = os.path.join(folder, "single"), os.path.join(folder, "sharded")
    expected = reference(single) if int(os.environ.get("RANK", 0)) == 0 else None
    module = make_module(lora=LORA)  # built on the CPU; sharded by configure_model once the trainer runs
    before = {name: param.detach().clone() for name, param in make_module(lora=LORA).named_parameters()}
    trainer = L.Trainer(
        accelerator=args.accelerator, devices=2, strategy=ModelParallelStrategy(data_parallel_size=2,
        tensor_parallel_size=1), max_steps=1, accumulate_grad_batches=2, precision="32-true", logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
    )
    trainer.fit(module, DataLoader(make_examples(n=16), batch_size=4, collate_fn=collate))
    after = {name: param.detach().full_tensor().cpu() for name, param in module.named_parameters()}
    module.save_pretrained(sharded)  # collective
    whole, parts = resumed_losses(args, folder)
    if trainer.global_rank == 0:
        from transformers import AutoModelForCausalLM

        worst = max(((before[n] - after[n] - g).abs().max() / g.abs().max().clamp_min(1e-12)).item()
                    for n, g in expected.items())
        base_moved = [n for n in after if n not in expected and not torch.equal(after[n], before[n])]
        exports = [AutoModelForCausalLM.from_pretrained(path).state_dict() for path in (single, sharded)]
        export_gap = max((exports[0][k] - exports[1][k]).abs().max().item() for k in exports[0])
        print(f"adapter updates: max relative difference to the single process {worst:.2e}")
        print(f"base weights moved: {base_moved or 'none'}; merged exports differ by at most {export_gap:.2e}")
        print(f"losses without a stop {whole}, stopped after 2 and resumed {parts}")
        passed = worst < TOLERANCE and not base_moved and export_gap < TOLERANCE and len(whole) == 4
        passed &= torch.allclose(torch.tensor(whole), torch.tensor(parts), rtol=0, atol=1e-6)
        print("PASS" if passed else "FAIL")
        code = 0 if passed else 1
    else:
        code = 0
    dist.barrier()
    sys.exit(code)


if __name__ == "__main__":
    main()
