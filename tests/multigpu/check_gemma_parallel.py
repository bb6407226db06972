"""A tiny DiffusionGemma (tied encoder/decoder stack) trains the same under FSDP2 and FSDP2 + EP as in one process.

Not collected by pytest (tests/families/diffusion_gemma/test_parallel_gemma.py runs the same comparison on CPU with
gloo). On GPUs:

    python tests/multigpu/check_gemma_parallel.py --mode single                 # 1 GPU: the reference, twice
    torchrun --nproc_per_node=2 tests/multigpu/check_gemma_parallel.py --mode fsdp
    torchrun --nproc_per_node=2 tests/multigpu/check_gemma_parallel.py --mode ep       # FSDP2 + EP=2
    torchrun --nproc_per_node=4 tests/multigpu/check_gemma_parallel.py --mode ep       # DP4: experts EP2 x 2 copies
    torchrun --nproc_per_node=2 tests/multigpu/check_gemma_parallel.py --mode ep --keep-gathered

Each run trains ``tests.families.diffusion_gemma.test_parallel_gemma``'s model (``make_model``: fp32, eager attention,
router frozen) through its training step (``BlockDiffusionStep``: encoder pass, decoder pass without gradients for
the self-conditioning logits, decoder pass with them) and loop (``train``: SGD with momentum, ``--steps`` steps, step ``s`` on the same
global batch of ``--global-batch`` rows split over the ranks, each rank's loss ``local sum / global count * D``),
sharded by ``lit_dllm.parallel.parallelize``. Rank 0 then runs the same steps on one device, unsharded, and prints
every step's relative loss and gradient-norm difference; the script exits 1 if one exceeds ``--tolerance``.
``--mode single`` runs the unsharded loop twice on one device (run-to-run determinism). ``--checkpointing`` adds
activation checkpointing, ``--decoder-loss-only`` drops the encoder's next-token loss (the last encoder layer then
gets gradients through the KV cache alone). ``--accelerator cpu`` runs it on gloo (``OMP_NUM_THREADS=1``).

Measured 2026-11-26 on 2 x H100 80GB (NCCL, torch 2.11+cu130, transformers 5.24), 20 steps, largest relative
difference over all steps: single 0; fsdp x2 5.9e-7; ep x2 2.9e-7 (docs/BENCHMARKS.md §7). On a 2-core CPU with
``--accelerator cpu`` (gloo; torch 2.13): single 0; fsdp x2 5.2e-7; ep x2 6.1e-7; ep x2 --checkpointing
--decoder-loss-only 3.5e-7; ep x4 (experts EP2 x 2 copies) 3.6e-7; ep x4 --ep 4 4.0e-7. 2026-11-28, 2 x H200:
ep x2 --keep-gathered 2.9e-7 (CPU, 6 steps: 9.8e-8).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from lit_dllm.parallel import parallelize  # noqa: E402
from lit_dllm.strategies import init_meshes  # noqa: E402
from tests.test_parallel import report_differences  # noqa: E402
from tests.families.diffusion_gemma.test_parallel_gemma import BlockDiffusionStep, make_model, train  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=["single", "fsdp", "ep"], required=True)
    parser.add_argument("--ep", type=int, default=2, help="expert-parallel size of --mode ep")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--global-batch", type=int, default=8, help="rows per step, split over the ranks")
    parser.add_argument("--checkpointing", action="store_true", help="activation checkpointing (decoder layers)")
    parser.add_argument("--decoder-loss-only", action="store_true", help="no encoder next-token loss")
    parser.add_argument("--keep-gathered", action="store_true",
                        help="parallelize(reshard_after_forward=False): each layer gathered from its forward on")
    parser.add_argument("--accelerator", choices=["gpu", "cpu"], default="gpu")
    parser.add_argument("--tolerance", type=float, default=1e-5)
    args = parser.parse_args()

    world, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
    if args.mode != "single" and world < 2:
        parser.error(f"--mode {args.mode} needs torchrun with 2 or more processes")
    if args.global_batch % world:
        parser.error(f"--global-batch {args.global_batch} does not split over {world} ranks")
    if args.accelerator == "gpu":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 as on the CPU (TF32 rounds to 10 bits)
        torch.backends.cudnn.allow_tf32 = False
    else:
        device = torch.device("cpu")
        torch.set_num_threads(1)
    options = {
        "encoder_loss": not args.decoder_loss_only, "device": device, "batch_size": args.global_batch,
    }

    def reference() -> list[tuple[float, float]]:
        model = BlockDiffusionStep(make_model()).to(device)
        if args.checkpointing:
            parallelize(model, None, activation_checkpointing=True)
        return train(model, range(args.steps), **options)

    if args.mode == "single":
        history, label = reference(), "a second unsharded run"
    else:
        dist.init_process_group("nccl" if args.accelerator == "gpu" else "gloo")
        strategy = init_meshes(world, args.ep if args.mode == "ep" else 1, device.type)
        model = BlockDiffusionStep(make_model()).to(device)
        parallelize(model, strategy, activation_checkpointing=args.checkpointing,
                    reshard_after_forward=not args.keep_gathered)
        history = train(model, range(args.steps), strategy, rank, **options)
        label = "the unsharded run on one device"
    if rank == 0:
        expected = reference()
    if args.mode != "single":
        dist.barrier()
        dist.destroy_process_group()
    if rank != 0:
        return 0

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(
        f"mode={args.mode} ranks={world} ep={args.ep if args.mode == 'ep' else 1} steps={args.steps} "
        f"global_batch={args.global_batch} checkpointing={args.checkpointing} keep_gathered={args.keep_gathered} "
        f"encoder_loss={not args.decoder_loss_only} device={name}"
    )
    print(f"relative differences to {label}")
    return report_differences(history, expected, args.tolerance)


if __name__ == "__main__":
    sys.exit(main())
