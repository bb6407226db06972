"""Mixture-of-experts MDLM training step: FSDP2 alone vs FSDP2 + expert parallelism, bf16.

Model: ``configs/mdlm_moe_ep.yaml``'s ``model_config`` (a random-init bidirectional Qwen3-MoE, 16 layers, hidden
1024, 8 experts top-2; ~1.1B parameters with ``--vocab 32768``) in ``MDLMModule``'s ``DiffusionLM`` with the fused
LM head. Each variant shards it with :func:`lit_dllm.parallel.parallelize` (``param_dtype=bf16``: FSDP2 computes in
bf16, reduces gradients in fp32 and keeps fp32 weights, as the config's ``bf16-mixed``) on meshes from
:func:`lit_dllm.strategies.init_meshes`, then runs ``--warmup`` untimed and ``--steps`` timed AdamW steps on
synthetic batches (``--batch`` x ``--seq`` tokens per GPU, uniform corruption; step = corruption, forward, loss,
backward, optimizer step, with the same per-token normalisation as training). Reports the median step time,
tokens/s over all GPUs and peak memory (max over ranks), one table.

    torchrun --nproc_per_node=2 bench/bench_moe_step.py --out $OUT/moe_step.md   # FSDP2 vs FSDP2 + EP=2
    torchrun --nproc_per_node=2 bench/bench_moe_step.py --tiny                   # CPU smoke test (gloo, ~1 min)
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time
from pathlib import Path

from _common import REPO_ROOT, emit, environment_line, markdown_table

import torch
import torch.distributed as dist
import yaml

from lit_dllm.modules.mdlm import MDLMModule
from lit_dllm.parallel import data_parallel_group, data_parallel_size, parallelize
from lit_dllm.strategies import init_meshes


def model_config(args) -> dict:
    if args.tiny:
        from tests.test_parallel import TINY_MOE

        return dict(TINY_MOE)
    config = yaml.safe_load((Path(REPO_ROOT) / "configs" / "mdlm_moe_ep.yaml").read_text())
    return dict(config["model"]["init_args"]["model_config"], max_position_embeddings=args.seq)


def build(args, device: torch.device) -> MDLMModule:
    torch.manual_seed(0)  # the same weights on every rank: EP and FSDP keep their own slices of them
    module = MDLMModule(vocab_size=args.vocab, mask_token_id=args.vocab - 1, model_config=model_config(args),
                        val_generate_batches=0)
    with device:
        module.configure_model()
    return module


def parameter_counts(module: MDLMModule) -> tuple[int, int]:
    """(total, active per token): experts count top-k / num_experts of theirs."""
    config = module.model.hf.config
    total = sum(p.numel() for p in module.model.parameters())
    experts = sum(p.numel() for name, p in module.model.named_parameters() if ".experts." in name)
    return total, total - experts + experts * config.num_experts_per_tok // config.num_experts


def synthetic_batch(step: int, rank: int, args, device: torch.device) -> dict:
    g = torch.Generator().manual_seed(1000 * step + rank)
    ids = torch.randint(0, args.vocab - 1, (args.batch, args.seq), generator=g)
    rows = torch.arange(args.batch) + (step * dist.get_world_size() + rank) * args.batch
    batch = {"input_ids": ids, "loss_mask": torch.ones_like(ids, dtype=torch.float), "example_index": rows,
             "input_lengths": torch.full((args.batch,), args.seq), "attention_mask": torch.ones_like(ids)}
    return {key: value.to(device) for key, value in batch.items()}


def run(args, expert_parallel_size: int, device: torch.device) -> dict:
    meshes = init_meshes(dist.get_world_size(), expert_parallel_size, device.type)
    module = build(args, device)
    counts = parameter_counts(module)
    parallelize(module.model, meshes, param_dtype=torch.bfloat16)
    optimizer = torch.optim.AdamW(module.model.parameters(), lr=1e-4, betas=(0.9, 0.95))
    world, group = data_parallel_size(meshes), data_parallel_group(meshes)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for step in range(args.warmup + args.steps):
        batch = synthetic_batch(step, dist.get_rank(), args, device)
        sync(device)
        start = time.perf_counter()
        noisy = module.prepare_batch(batch, module.noise_keys(batch, 0))
        total = module.token_counts(batch, noisy)["diffusion"].float()
        dist.all_reduce(total, group=group)
        loss = module.compute_loss(batch, noisy, {"diffusion": total}).output.total_loss
        (loss * world).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync(device)
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
    peak = torch.tensor(peak, device=device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    del module, optimizer
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    step_time = statistics.median(times)
    tokens_per_second = world * args.batch * args.seq / step_time
    return {"counts": counts, "step": step_time, "tokens": tokens_per_second, "peak": float(peak)}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--batch", type=int, default=4, help="sequences per GPU")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--ep", type=int, default=2, help="expert-parallel size of the EP variant")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke test: the tests' tiny MoE, gloo")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.tiny:
        args.vocab, args.batch, args.seq, args.warmup, args.steps = 100, 2, 32, 1, 2
    device = torch.device("cpu") if args.tiny else torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("gloo" if device.type == "cpu" else "nccl")
    world = dist.get_world_size()
    results = {f"FSDP2 x{world}": run(args, 1, device), f"FSDP2 x{world} + EP={args.ep}": run(args, args.ep, device)}
    if dist.get_rank() == 0:
        total, active = next(iter(results.values()))["counts"]
        header = ["variant", "step (median)", "tokens/s (all GPUs)", "peak memory / GPU"]
        rows = [
            [name, f"{r['step'] * 1e3:.1f} ms", f"{r['tokens']:,.0f}", f"{r['peak']:.2f} GiB"]
            for name, r in results.items()
        ]
        emit("\n".join([
            f"MoE MDLM step, {total / 1e6:,.1f}M parameters ({active / 1e6:,.1f}M active per token), bf16 compute, "
            f"{args.batch} x {args.seq} tokens per GPU, {world} ranks, median of {args.steps} steps",
            environment_line(), "", markdown_table(header, rows),
        ]), args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
