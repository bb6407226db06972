"""A tiny MoE MDLM trains the same under every data- and expert-parallel layout as in one process.

Not collected by pytest (tests/test_parallel.py runs its CPU path). On the lent GPU machines:

    python tests/multigpu/check_moe_parallel.py --mode single                          # 1 GPU, no torchrun
    torchrun --nproc_per_node=2 tests/multigpu/check_moe_parallel.py --mode ddp
    torchrun --nproc_per_node=2 tests/multigpu/check_moe_parallel.py --mode fsdp --accumulate 2
    torchrun --nproc_per_node=2 tests/multigpu/check_moe_parallel.py --mode ep         # FSDP2 + EP=2
    torchrun --nproc_per_node=4 tests/multigpu/check_moe_parallel.py --mode ep         # DP4: experts EP2 x 2 copies
    torchrun --nproc_per_node=2 tests/multigpu/check_moe_parallel.py --mode ep --keep-gathered  # no reshard after forward
    torchrun --nproc_per_node=2 tests/multigpu/check_moe_parallel.py --mode fsdp --accumulate 2 --defer-sync
    torchrun --nproc_per_node=2 tests/multigpu/check_moe_parallel.py --mode ep --prefetch

Each run trains ``MDLMModule`` (tests/test_parallel.py: the tiny Qwen3-MoE in fp32, its ``configure_model``
applying the strategy's plan, ``lit_dllm.strategies.parallelize_model``; SGD with momentum, or ``--optimizer adamw``;
clipping at 1.0) with ``lightning.Trainer`` for ``--steps`` optimizer steps, each on the same global batch with keyed
noise, split over the ranks (and ``--accumulate`` micro-batches). It stops at ``--resume-at``, saves a checkpoint
(sharded under FSDP2) and resumes from it in a fresh Trainer and module. The reference is the same steps in a plain
PyTorch loop on one device (``tests.test_parallel.train``). Rank 0 prints every step's relative loss and gradient-norm
difference and the script exits 1 if one exceeds ``--tolerance``. ``--accelerator cpu`` runs it on gloo. Rank 0 also
counts the reduce-scatters of each optimizer step: one per sharded FSDP2 parameter group and micro-batch, or, with
``--defer-sync`` (the strategy's ``parallelism.fsdp_defer_gradient_sync: true``), one per group; and the all-gathers
between optimizer steps (outside any forward): two with ``--prefetch`` (``parallelism.fsdp_prefetch_next_step: true``:
the root's and the first block's), else none; another count also exits 1.

Measured 2026-11-26 on 4 x H100 80GB (torch 2.11+cu130, transformers 5.24, lightning 2.6.6; NCCL), 20 steps,
resume at 10, largest relative difference over all steps: single 0; ddp x2 2.1e-6; fsdp x2 with --accumulate 2
2.1e-6; ep (FSDP2 + EP=2) x2 7.2e-7; ep x4 (experts EP2 x 2 copies) with --accumulate 2 8.6e-7; ep x2
--optimizer adamw --lr 1e-3 2.2e-7. With AdamW at lr 1e-2 every layout, DDP included, leaves the reference by
~1e-3 after step 17 (see ``momentum_sgd``). 2026-11-28 on 2 x H200 (same software): ep x2 --keep-gathered 8.2e-7; on
the 2-core CPU (gloo, 6 steps, resume at 3) 1.3e-7.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import os
import sys
import tempfile
from pathlib import Path

import lightning as L
import torch
from torch.distributed.fsdp import FSDPModule
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from lit_dllm.settings import Parallelism  # noqa: E402
from lit_dllm.strategies import ExpertParallelStrategy, SingleDeviceStrategy  # noqa: E402
from tests.core.test_training_step import collate, make_examples  # noqa: E402
from tests.test_parallel import (  # noqa: E402
    GLOBAL_BATCH, OPTIMIZATION, fsdp_param_groups, make_module, make_optimizer, momentum_sgd, report_differences, train,
)

CLIP = 1.0
SHARDED = ("fsdp", "ep")


def module_settings(args) -> dict:
    """SGD with momentum (``tests.test_parallel.momentum_sgd``, which says why) or the module's own AdamW."""
    optimizer = None if args.optimizer == "adamw" else functools.partial(momentum_sgd, lr=args.lr)
    return {"optimization": dataclasses.replace(OPTIMIZATION, lr=args.lr, optimizer=optimizer)}


def strategy(args):
    """The strategy of ``--mode``, with the run settings ``--keep-gathered`` (``fsdp_reshard_after_forward: false``),
    ``--defer-sync`` (``fsdp_defer_gradient_sync: true``) and ``--prefetch`` (``fsdp_prefetch_next_step: true``)."""
    parallelism = Parallelism(fsdp_reshard_after_forward=not args.keep_gathered,
                              fsdp_defer_gradient_sync=args.defer_sync, fsdp_prefetch_next_step=args.prefetch)
    if args.mode in ("single", "ddp"):
        return SingleDeviceStrategy(parallelism=parallelism) if args.mode == "single" else "ddp"
    return ExpertParallelStrategy(expert_parallel_size=args.ep if args.mode == "ep" else 1, parallelism=parallelism)


class Record(L.Callback):
    """(loss, gradient norm) logged at each optimizer step (on rank 0, where the module logs them), the number of
    reduce-scatters each optimizer step ran against the number of FSDP2 parameter groups sharded over more than one
    rank (a group over one rank, as the experts under EP=2 of 2 ranks, has nothing to reduce), and the all-gathers
    started between one step's optimizer (``on_before_optimizer_step``: every backward of the step has run, and the
    prefetch for the next step comes after the optimizer) and the next step's first micro-batch."""

    COLLECTIVES = {"reduce_scatter_single": "scatters", "reduce_scatter_tensor": "scatters",  # FSDP2's (torch >= 2.12,
                   "all_gather_into_tensor": "gathers", "all_gather_single": "gathers"}    # and before)

    def __init__(self) -> None:
        self.history: list[tuple[float, float]] = []
        self.reduce_scatters: list[tuple[int, int]] = []
        self.gathers_between_steps: list[int] = []
        self.calls, self.originals = collections.Counter(), {}

    def setup(self, trainer, module, stage: str) -> None:
        """Count the calls of FSDP2's collectives (looked up on ``torch.distributed`` at each call)."""
        for name, kind in self.COLLECTIVES.items():
            if hasattr(torch.distributed, name):
                self.originals[name] = original = getattr(torch.distributed, name)
                setattr(torch.distributed, name, functools.partial(self._counted, kind, original))

    def teardown(self, trainer, module, stage: str) -> None:
        for name, original in self.originals.items():
            setattr(torch.distributed, name, original)

    def _counted(self, kind: str, collective, *args, **kwargs):
        self.calls[kind] += 1
        return collective(*args, **kwargs)

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        """Runs before the module's hooks: the gathers counted since the last step's end came from between steps."""
        if batch_idx % trainer.accumulate_grad_batches == 0 and trainer.global_step > self.first_step:
            self.gathers_between_steps.append(self.calls["gathers"])

    def on_train_start(self, trainer, module) -> None:
        self.first_step = trainer.global_step  # a resumed fit's first step follows no step of its own

    def on_before_optimizer_step(self, trainer, module, optimizer) -> None:
        """Runs once the step's backward passes have, before the optimizer and what follows it (the converters:
        the prefetch for the next step)."""
        if trainer.is_global_zero:
            units = (unit for unit in module.modules() if isinstance(unit, FSDPModule))
            groups = sum(group.mesh_info.shard_mesh_size > 1 for unit in units for group in fsdp_param_groups(unit))
            self.reduce_scatters.append((self.calls["scatters"], groups))
        self.calls.clear()

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        if (batch_idx + 1) % trainer.accumulate_grad_batches == 0 and trainer.is_global_zero:
            metrics = trainer.callback_metrics  # the module logs them after this callback's on_before_optimizer_step
            self.history.append((float(metrics["train/loss"]), float(metrics["train/grad_norm"])))


def fit(args, devices: int, steps: int, checkpoint: Path, resume: bool) -> list[tuple[float, float]]:
    """Train to ``steps`` optimizer steps (from ``checkpoint`` if ``resume``, else saving it at the end)."""
    record = Record()
    trainer = L.Trainer(
        accelerator=args.accelerator, devices=devices, strategy=strategy(args), precision="32-true",
        max_epochs=steps, accumulate_grad_batches=args.accumulate, gradient_clip_val=CLIP, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
        callbacks=[record],
    )
    # One optimizer step per epoch: the whole example set, noise keyed by the epoch (= the step). Stopping at an
    # epoch's end (max_epochs, not max_steps) lets the resumed run start the next epoch at its first micro-batch.
    per_device = GLOBAL_BATCH // (devices * args.accumulate)
    loader = DataLoader(make_examples(n=GLOBAL_BATCH), batch_size=per_device, collate_fn=collate)
    trainer.fit(make_module(**module_settings(args)), loader, ckpt_path=checkpoint if resume else None)
    if not resume:
        trainer.save_checkpoint(checkpoint)
    return record


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=["single", "ddp", "fsdp", "ep"], required=True)
    parser.add_argument("--ep", type=int, default=2, help="expert-parallel size of --mode ep")
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--resume-at", type=int, default=10)
    parser.add_argument("--optimizer", choices=["sgd", "adamw"], default="sgd")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--accelerator", default="gpu")
    parser.add_argument("--tolerance", type=float, default=1e-5)
    parser.add_argument("--keep-gathered", action="store_true",
                        help="parallelism.fsdp_reshard_after_forward: false (blocks gathered from their forward to "
                             "backward)")
    parser.add_argument("--defer-sync", action="store_true",
                        help="parallelism.fsdp_defer_gradient_sync: true (a reduce-scatter per optimizer step, not per "
                             "micro-batch)")
    parser.add_argument("--prefetch", action="store_true",
                        help="parallelism.fsdp_prefetch_next_step: true (the next step's first all-gathers start after "
                             "each step)")
    parser.add_argument("--workdir", default=tempfile.gettempdir())
    args = parser.parse_args()
    devices = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    checkpoint = Path(args.workdir) / f"check_moe_parallel_{args.mode}_{devices}.ckpt"
    records = [fit(args, devices, args.resume_at, checkpoint, resume=False),
               fit(args, devices, args.steps, checkpoint, resume=True)]
    if int(os.environ.get("RANK", 0)) != 0:
        return 0
    history = [step for record in records for step in record.history]
    reduce_scatters = [step for record in records for step in record.reduce_scatters]
    gathers = sorted({count for record in records for count in record.gathers_between_steps})
    gathered_right = args.mode not in SHARDED or gathers == [2 if args.prefetch else 0]
    per_group = 1 if args.defer_sync else args.accumulate
    counted_right = args.mode not in SHARDED or all(calls == groups * per_group for calls, groups in reduce_scatters)
    device = torch.device("cuda" if args.accelerator == "gpu" else "cpu")
    reference_module = make_module(**module_settings(args)).to(device)
    reference = train(reference_module, make_optimizer(reference_module), range(args.steps), clip=CLIP)
    print(f"mode={args.mode} devices={devices} ep={args.ep if args.mode == 'ep' else 1} accumulate={args.accumulate} "
          f"optimizer={args.optimizer} lr={args.lr} keep_gathered={args.keep_gathered} defer_sync={args.defer_sync} "
          f"prefetch={args.prefetch}")
    if args.mode in SHARDED:
        print(f"reduce-scatters per optimizer step (FSDP2 parameter groups x {per_group}): "
              f"{sorted(set(reduce_scatters))} as (counted, groups): {'PASS' if counted_right else 'FAIL'}")
        print(f"all-gathers between optimizer steps ({2 if args.prefetch else 0} expected): {gathers}: "
              f"{'PASS' if gathered_right else 'FAIL'}")
    return report_differences(history, reference, args.tolerance, {args.resume_at: "  (resumed)"}) or int(
        not (counted_right and gathered_right))


if __name__ == "__main__":
    sys.exit(main())
