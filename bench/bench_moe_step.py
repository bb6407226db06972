"""Mixture-of-experts training step: FSDP2 alone vs FSDP2 + expert parallelism, bf16.

Models (``--family``):

* ``mdlm``: ``configs/mdlm_moe_ep.yaml``'s ``model_config`` (a random-init bidirectional Qwen3-MoE, 16 layers,
  hidden 1024, 8 experts top-2; ~1.1B parameters with ``--vocab 32768``) in ``MDLMModule`` with the fused LM head.
* ``gemma``: ``BlockDiffusionGemmaModule`` on a random-init DiffusionGemma with the 26B-A4B checkpoint's layer
  shapes (hidden 2816, 128 experts top-8 of width 704, vocabulary 262144, canvas 256) but ``--layers`` layers;
  each sequence is a prompt then one canvas of response, so a step runs the encoder, both decoder passes
  (self-conditioning) and both losses.

Each variant shards it with :func:`lit_dllm.parallel.parallelize` (``param_dtype=bf16``: FSDP2 computes in
bf16, reduces gradients in fp32 and keeps fp32 weights; the step runs under bf16 autocast: Lightning's
``bf16-mixed``) on meshes from
:func:`lit_dllm.strategies.init_meshes`, then runs ``--warmup`` untimed and ``--steps`` timed AdamW steps on
synthetic batches (``--batch`` x ``--seq`` tokens per GPU, uniform corruption; step = corruption, forward, loss,
backward, optimizer step, with the same per-token normalisation as training). Reports the median step time,
tokens/s over all GPUs and peak memory (max over ranks), one table.

    torchrun --nproc_per_node=2 bench/bench_moe_step.py --out $OUT/moe_step.md   # FSDP2 vs FSDP2 + EP=2
    torchrun --nproc_per_node=2 bench/bench_moe_step.py --family gemma --out $OUT/gemma_step.md
    torchrun --nproc_per_node=2 bench/bench_moe_step.py --tiny [--family gemma]  # CPU smoke test (gloo, ~1 min)
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

from lit_dllm.families.diffusion_gemma.module import BlockDiffusionGemmaModule
from lit_dllm.families.mdlm.module import MDLMModule
from lit_dllm.parallel import data_parallel_group, data_parallel_size, parallelize
from lit_dllm.strategies import init_meshes


GEMMA_26B_LAYER = {  # google/diffusiongemma-26B-A4B's shapes (docs/DESIGN.md §9.1), with fewer layers
    "canvas_length": 256,
    "text_config": {
        "hidden_size": 2816, "intermediate_size": 2112, "num_attention_heads": 16, "num_key_value_heads": 8,
        "head_dim": 256, "global_head_dim": 512, "num_global_key_value_heads": 2, "sliding_window": 1024,
        "num_experts": 128, "top_k_experts": 8, "moe_intermediate_size": 704, "max_position_embeddings": 8192,
    },
    "vision_config": {"model_type": "gemma4_vision", "hidden_size": 32, "intermediate_size": 64,
                      "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16},
}


def model_config(args) -> dict:
    if args.family == "gemma":
        if args.tiny:
            from lit_dllm.testing import TINY_DIFFUSION_GEMMA

            return TINY_DIFFUSION_GEMMA
        layers = (["sliding_attention"] * 5 + ["full_attention"]) * args.layers
        text = dict(GEMMA_26B_LAYER["text_config"], num_hidden_layers=args.layers, layer_types=layers[-args.layers:])
        return dict(GEMMA_26B_LAYER, text_config=text)
    if args.tiny:
        from lit_dllm.testing import TINY_MOE

        return dict(TINY_MOE)
    config = yaml.safe_load((Path(REPO_ROOT) / "configs" / "mdlm_moe_ep.yaml").read_text())
    return dict(config["model"]["init_args"]["model_config"], max_position_embeddings=args.seq)


def build(args, device: torch.device):
    torch.manual_seed(0)  # the same weights on every rank: EP and FSDP keep their own slices of them
    if args.family == "gemma":
        module = BlockDiffusionGemmaModule(vocab_size=args.vocab, model_config=model_config(args),
                                           val_generate_batches=0)
    else:
        module = MDLMModule(vocab_size=args.vocab, mask_token_id=args.vocab - 1, model_config=model_config(args),
                            val_generate_batches=0)
    with device:
        module.configure_model()
    return module.train()


def parameter_counts(module) -> tuple[int, int]:
    """(total, active per token): experts count top-k / num_experts of theirs (shared encoder/decoder weights once)."""
    config = module.model.hf.config.get_text_config()
    top_k = getattr(config, "num_experts_per_tok", None) or config.top_k_experts
    params = dict(module.model.named_parameters())  # named_parameters() yields each shared parameter once
    total = sum(p.numel() for p in params.values())
    experts = sum(p.numel() for name, p in params.items() if ".experts." in name)
    return total, total - experts + experts * top_k // config.num_experts


def synthetic_batch(step: int, rank: int, args, device: torch.device) -> dict:
    """Random tokens; for Gemma, a prompt then ``--canvas`` supervised tokens (one canvas, attended)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    ids = torch.randint(0, args.vocab - 1, (args.batch, args.seq), generator=g)
    rows = torch.arange(args.batch) + (step * dist.get_world_size() + rank) * args.batch
    loss_mask = torch.ones_like(ids, dtype=torch.float)
    if args.family == "gemma":
        loss_mask[:, : args.seq - args.canvas] = 0
    batch = {"input_ids": ids, "loss_mask": loss_mask, "example_index": rows,
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
        with torch.autocast(device.type, dtype=torch.bfloat16):  # what Lightning's bf16-mixed adds to FSDP2's policy
            prepared = module.prepare_batch(batch, module.noise_keys(batch, 0))
            local = module.token_counts(batch, prepared)
            totals = torch.stack([count.float() for count in local.values()])
            dist.all_reduce(totals, group=group)
            loss = module.compute_loss(batch, prepared, dict(zip(local, totals))).output.total_loss
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
    parser.add_argument("--family", choices=["mdlm", "gemma"], default="mdlm")
    parser.add_argument("--layers", type=int, default=2, help="Gemma: layers of the 26B shapes")
    parser.add_argument("--canvas", type=int, default=256, help="Gemma: supervised tokens per sequence")
    parser.add_argument("--vocab", type=int, default=None, help="default: 32768 (mdlm), 262144 (gemma)")
    parser.add_argument("--batch", type=int, default=4, help="sequences per GPU")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--ep", type=int, default=2, help="expert-parallel size of the EP variant")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke test: the tests' tiny MoE, gloo")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    args.vocab = args.vocab or (262144 if args.family == "gemma" else 32768)
    if args.tiny:
        args.vocab, args.batch, args.seq, args.warmup, args.steps, args.canvas = 100, 2, 32, 1, 2, 8
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
            f"MoE {args.family} step, {total / 1e6:,.1f}M parameters ({active / 1e6:,.1f}M active per token), bf16 compute, "
            f"{args.batch} x {args.seq} tokens per GPU, {world} ranks, median of {args.steps} steps",
            environment_line(), "", markdown_table(header, rows),
        ]), args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
