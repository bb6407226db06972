"""The fast sampler answers each rank's own prompts under FSDP2 and FSDP2 + EP=2 as one unsharded process does.

Not collected by pytest (``tests/families/mdlm/test_fast_sampler.py`` proves the same on the CPU with gloo); run on a
2-GPU machine:
    torchrun --nproc_per_node=2 tests/multigpu/check_fast_sampler_parallel.py
    torchrun --nproc_per_node=2 tests/multigpu/check_fast_sampler_parallel.py --accelerator cpu   # the same on gloo
Every rank answers its own prompts (different counts and lengths) with ``MDLMModule.generate_ids``, ``sampler="fast"``,
threshold 0.5 and each cache (``none``, ``prefix``, ``dual``), from the tiny MoE MDLM (fp32) sharded over both ranks
(``tests.families.mdlm.test_fast_sampler.sharded_answers``), and compares them with its own unsharded run of the same
prompts.
Prints PASS and exits 0 when every answer is the same.
"""

import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from lit_dllm.families.mdlm.fast_sampler import CACHES  # noqa: E402
from tests.families.mdlm.test_fast_sampler import RANK_PROMPTS, sharded_answers, single_process_answers  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--accelerator", default="gpu", choices=["gpu", "cpu"])
    args = parser.parse_args()
    device = torch.device("cpu")
    if args.accelerator == "gpu":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if args.accelerator == "gpu" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    expected = {cache: single_process_answers(cache, RANK_PROMPTS[rank], device) for cache in CACHES}
    lines = [f"rank {rank} {cache:6s} {layout:9s} {'same' if got == expected[cache][0] else 'DIFFERENT'} "
             f"(alone: {expected[cache][1]} passes)" for cache, layouts in sharded_answers(device).items()
             for layout, got in layouts.items()]
    everyone = [None] * world
    dist.all_gather_object(everyone, lines)
    passed = not any("DIFFERENT" in line for rank_lines in everyone for line in rank_lines)
    if rank == 0:
        print("\n".join(line for rank_lines in everyone for line in rank_lines))
        print("PASS" if passed else "FAIL")
    dist.destroy_process_group()
    sys.exit(0 if passed else 1)


if __name__ == "__main__":
    main()
