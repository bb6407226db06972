"""Mixture-of-experts training step, bf16: FSDP2 alone vs FSDP2 + expert parallelism, with compiled blocks, balanced
routing and another experts kernel as further levers, one row each.

Models (``--family``):

* ``mdlm``: ``configs/mdlm_moe_ep.yaml``'s ``model_config`` (a random-init bidirectional Qwen3-MoE, 16 layers,
  hidden 1024, 8 experts top-2; ~1.1B parameters with ``--vocab 32768``) in ``MDLMModule`` with the fused LM head.
* ``qwen3-30b``: the same module on a random-init Qwen3-MoE with Qwen3-30B-A3B's layer shapes (hidden 2048, 32 heads,
  4 KV heads of 128, 128 experts top-8 of width 768, vocabulary 151936) but ``--layers`` layers (the model has 48).
* ``gemma``: ``BlockDiffusionGemmaModule`` on a random-init DiffusionGemma with the 26B-A4B checkpoint's layer
  shapes (hidden 2816, 128 experts top-8 of width 704, vocabulary 262144, canvas 256) but ``--layers`` layers;
  each sequence is a prompt then one canvas of response, so a step runs the encoder, both decoder passes
  (self-conditioning) and both losses.

Rows (``--variants``, comma-separated; default ``fsdp,ep``): ``fsdp`` (FSDP2 over every rank) or ``ep`` (FSDP2 +
expert parallelism over groups of ``--ep`` ranks), each optionally followed by ``+compile`` (``parallelize(...,
compile=True)``: each transformer block's ``forward`` compiled by inductor; experts under EP stay eager),
``+balanced`` (:func:`force_balanced_routing`: every expert gets the same number of tokens, beside the learned
router's choice) and, for ``gemma``, ``+flex`` (the module built with ``attn_implementation: flex_attention``: its
masks become FlexAttention block masks, fully masked tiles skipped, in place of dense ones on PyTorch's
memory-efficient SDPA kernel; CUDA only: FlexAttention has no CPU backward, so ``--tiny`` refuses it),
``+gathered`` (``parallelize(..., reshard_after_forward=False)``, the strategy's
``parallelism.fsdp_reshard_after_forward: false``: every block keeps its gathered parameters from its forward to its
backward), ``+bf16reduce``
(``reduce_dtype=bf16``, ``parallelism.fsdp_reduce_dtype: bfloat16``: gradients reduce-scattered in bf16) and
``+defer`` (with ``--accumulate N`` > 1: ``parallelism.fsdp_defer_gradient_sync: true``, every FSDP2 unit
reduce-scatters its gradients and reshards after the backward of a step's last micro-batch only).
``--accumulate N``: each step is N micro-batches of ``--batch`` x ``--seq`` tokens per GPU, then one optimizer step
(training's ``accumulate_grad_batches``); tokens/s and MFU count all N.
``--experts IMPL`` sets transformers' experts kernel of every row (``parallelism.experts_implementation``):
``grouped_mm`` (transformers' default: one grouped GEMM), ``eager`` (a loop over the experts), ``batched_mm`` (one
``bmm`` over the token-expert pairs, for decoding: it gathers a copy of the expert's weights per pair and keeps it for
the backward, ``tokens × top-k × 3 × hidden × width × 2`` bytes per layer:
~620 GB for 4 x 2048 tokens of Qwen3-30B's experts, ~4.8 GB for 1 x 64, so it fits small ``--batch``/``--seq``);
``deepgemm`` and ``sonicmoe`` need Hugging Face hub kernels.

Each row shards the model with :func:`lit_dllm.parallel.parallelize` (``param_dtype=bf16``: FSDP2 computes in
bf16, reduces gradients in fp32 and keeps fp32 weights; the step runs under bf16 autocast: Lightning's
``bf16-mixed``) on meshes from :func:`lit_dllm.strategies.init_meshes`, then runs ``--warmup`` untimed and
``--steps`` timed AdamW steps (training's optimizer: decay on matrices only, fused on CUDA) on synthetic batches
(``--batch`` x ``--seq`` tokens per GPU, uniform corruption; step = corruption, forward, loss, backward, optimizer
step, with the same per-token normalisation as training). Reports the median step time and rank 0's fastest and
slowest step, tokens/s over all GPUs, MFU (the module's ``training_flops``, as ``train/mfu`` counts it: active
parameters, i.e. the top-k experts, plus attention; over the GPU's dense bf16 peak), the experts' load in the first
warm-up step (tokens of the busiest expert over the mean, averaged over the MoE calls; eager rows only) and peak
memory (max over ranks). The timer synchronises at each step's start and end, so the device idles while the host
starts a step; ``--unsynchronised`` adds the median of ``--steps`` more steps run back to back without a wait, as
training runs them (:func:`unsynchronised_times`), and its MFU. Batches are made on the CPU and moved by the module's
``transfer_batch_to_device``, as Lightning moves them.

``--profile N``: each row then runs N more steps under a CUDA-only ``torch.profiler`` (as ``profile_step.py``; every
rank profiles, rank 0 reports), and one section per row follows the table: kernel time by kind (:data:`MOE_KINDS`:
expert grouped GEMMs apart from the dense ones, routing/permutation/indexing, attention, NCCL communication — FSDP2's
all-gathers and reduce-scatters, EP's all-to-alls — copies, optimizer, compiled (triton) and elementwise kernels), the
top kernels, idle gaps between kernels, and the communication time that no other kernel overlaps. ``--stacks`` adds
the idle gaps by the host code that launched the work ending each (``_common.gap_sources``: Python stacks recorded
too). ``--operators`` adds the operators that launched the most device time, with their input shapes (CPU operators
recorded too): which copy, addition or GEMM a kernel kind is made of. Under ``--tiny`` (CPU) the section profiles the
host's leaf operators instead: a smoke test of the section, not a GPU profile.

    torchrun --nproc_per_node=2 bench/bench_moe_step.py --out $OUT/moe_step.md   # FSDP2 vs FSDP2 + EP=2
    torchrun --nproc_per_node=2 bench/bench_moe_step.py --family gemma --out $OUT/gemma_step.md
    torchrun --nproc_per_node=4 bench/bench_moe_step.py --family qwen3-30b --layers 8 --ep 4 \
        --variants fsdp,ep,fsdp+compile,ep+compile,fsdp+balanced,ep+balanced --out $OUT/qwen3_30b_step.md
    torchrun --nproc_per_node=4 bench/bench_moe_step.py --family qwen3-30b --layers 8 --ep 4 --experts eager \
        --variants fsdp,ep --out $OUT/qwen3_30b_eager.md
    torchrun --nproc_per_node=4 bench/bench_moe_step.py --family gemma --layers 4 --ep 4 \
        --variants fsdp+compile+balanced,fsdp+compile --steps 5 --profile 2 --out $OUT/moe_profile.md
    torchrun --nproc_per_node=4 bench/bench_moe_step.py --family gemma --layers 4 --ep 4 \
        --variants fsdp+compile+flex+gathered --steps 5 --profile 2 --stacks --out $OUT/gemma_gaps.md
    torchrun --nproc_per_node=2 bench/bench_moe_step.py --family gemma --layers 4 --ep 2 \
        --variants fsdp+compile+balanced,fsdp+compile+balanced+flex --steps 5 --out $OUT/flex.md
    torchrun --nproc_per_node=2 bench/bench_moe_step.py --family gemma --layers 4 --ep 2 --steps 5 --accumulate 4 \
        --variants fsdp+compile+flex+gathered+bf16reduce+defer --out $OUT/gemma_accumulated.md
    torchrun --nproc_per_node=1 bench/bench_moe_step.py --family gemma --layers 4 --ep 1 --steps 3 --profile 1 \
        --operators --variants fsdp+compile+flex+gathered+bf16reduce --out $OUT/gemma_operators.md
    torchrun --nproc_per_node=4 bench/bench_moe_step.py --family gemma --layers 4 --ep 4 --unsynchronised \
        --variants fsdp+compile+flex+gathered+bf16reduce --out $OUT/gemma_unsynchronised.md
    torchrun --nproc_per_node=2 bench/bench_moe_step.py --tiny [--family gemma] [--profile 1]  # CPU smoke test (gloo)

Under ``--tiny`` (and on any GPU) every eager ``+balanced`` row checks that its experts received equal token counts.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from _common import (
    KINDS, REPO_ROOT, cuda_kernels, emit, environment_line, gap_sources_section, markdown_table, report, sync,
)

import torch
import torch.distributed as dist
import yaml
from torch import nn
from torch.profiler import ProfilerActivity, profile

from lit_dllm.core.optim import build_optimization
from lit_dllm.families.diffusion_gemma.module import BlockDiffusionGemmaModule
from lit_dllm.families.mdlm.module import MDLMModule
from lit_dllm.experts import experts_implementation, moe_experts, set_experts_implementation
from lit_dllm.meshes import data_parallel_group, data_parallel_size
from lit_dllm.parallel import parallelize, sync_gradients_in_backward
from lit_dllm.strategies import init_meshes
from lit_dllm.throughput import expert_counts, peak_flops


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

QWEN3_30B_LAYER = {  # Qwen/Qwen3-30B-A3B's config.json shapes (keys of transformers' Qwen3MoeConfig), fewer layers
    "model_type": "qwen3_moe", "hidden_size": 2048, "num_attention_heads": 32, "num_key_value_heads": 4,
    "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
    "intermediate_size": 6144, "norm_topk_prob": True, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
}

VOCAB = {"mdlm": 32768, "qwen3-30b": 151936, "gemma": 262144}

MOE_KINDS = {  # --profile's kernel kinds (report: the first whose key is in the name), KINDS's with MoE's apart
    "communication": KINDS["communication"] + ("gloo",),  # NCCL: FSDP2's all-gather, reduce-scatter; EP's all-to-all
    "attention": KINDS["attention"],
    "expert GEMM (grouped)": ("grouped", "groupproblemshape"),  # torch._grouped_mm: CUTLASS GroupProblemShape
    "dense GEMM": KINDS["gemm"],  # also the experts' GEMMs of --experts eager (a loop of plain GEMMs)
    "optimizer": KINDS["optimizer"],
    "inductor (triton)": KINDS["inductor (triton)"],  # compiled blocks: their fused routing/elementwise kernels too
    "routing, permutation, indexing (also embeddings)": ("sort", "topk", "histc", "histogram", "bincount", "scan",
                                                         "index", "scatter", "gather"),
    "copies": KINDS["copies"] + ("copy",),
    "elementwise, reductions": ("elementwise", "reduce"),
}


# ------------------------------------------------------------------------------------------------------ variants
@dataclass(frozen=True)
class Variant:
    """One row: ``fsdp`` or ``ep``, then any of ``+compile``, ``+balanced``, ``+flex``, ``+gathered``,
    ``+bf16reduce``."""

    ep: bool
    compile: bool = False
    balanced: bool = False
    flex: bool = False
    gathered: bool = False
    bf16reduce: bool = False
    defer: bool = False

    @classmethod
    def parse(cls, text: str) -> "Variant":
        base, *options = text.strip().split("+")
        known = ("compile", "balanced", "flex", "gathered", "bf16reduce", "defer")
        if base not in ("fsdp", "ep") or set(options) - set(known) or len(set(options)) < len(options):
            raise SystemExit(f"--variants: {text!r} is not fsdp or ep followed by any of +{', +'.join(known)}")
        return cls(ep=base == "ep", **{option: True for option in options})

    def name(self, world: int, ep: int) -> str:
        parts = [f"FSDP2 x{world}" + (f" + EP={ep}" if self.ep else "")]
        parts += ["compiled"] * self.compile + ["balanced routing"] * self.balanced + ["flex attention"] * self.flex
        parts += ["kept gathered to the backward"] * self.gathered + ["reduced in bf16"] * self.bf16reduce
        parts += ["gradient sync deferred to the last micro-batch"] * self.defer
        return ", ".join(parts)


# ------------------------------------------------------------------------------------------------------- models
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
    if args.family == "qwen3-30b":
        return dict(QWEN3_30B_LAYER, num_hidden_layers=args.layers, max_position_embeddings=args.seq)
    config = yaml.safe_load((Path(REPO_ROOT) / "configs" / "mdlm_moe_ep.yaml").read_text())
    return dict(config["model"]["init_args"]["backbone"]["model_config"], max_position_embeddings=args.seq)


def build(args, variant: Variant, device: torch.device):
    torch.manual_seed(0)  # the same weights on every rank: EP and FSDP keep their own slices of them
    backbone = {"model_config": model_config(args)}
    if variant.flex:
        backbone["attn_implementation"] = "flex_attention"
    common = {"vocab_size": args.vocab, "backbone": backbone, "generation": {"val_generate_batches": 0}}
    if args.family == "gemma":
        module = BlockDiffusionGemmaModule(**common)
    else:
        module = MDLMModule(mask_token_id=args.vocab - 1, **common)
    with device:
        module.configure_model()
    if args.experts is not None:  # as lit_dllm.strategies.parallelize_model applies parallelism.experts_implementation
        set_experts_implementation(module.model, args.experts)
    return module.train()


def parameter_counts(module) -> tuple[int, int]:
    """(total, active per token): experts count top-k / num_experts of theirs (shared encoder/decoder weights once)."""
    experts, top_k = expert_counts(module.model.hf.config.get_text_config())
    params = dict(module.model.named_parameters())  # named_parameters() yields each shared parameter once
    total = sum(p.numel() for p in params.values())
    expert_params = sum(p.numel() for name, p in params.items() if ".experts." in name)
    return total, total - expert_params + expert_params * top_k // experts


# --------------------------------------------------------------------------------------------------- routing
def routers(model: nn.Module) -> list[nn.Module]:
    """The MoE routers of the transformers models inside ``model``: transformers' ``*Router`` classes (Qwen3-MoE's
    ``Qwen3MoeTopKRouter``, the ``gate`` of ``Qwen3MoeSparseMoeBlock``; DiffusionGemma's ``DiffusionGemmaTextRouter``,
    Gemma 4's ``Gemma4TextRouter``: ``router`` of each decoder layer, the encoder's and decoder's alike). Each
    returns ``(logits or probabilities, top_k_weights, top_k_index)`` for the flattened tokens, which the layer hands
    to its experts."""
    found = [module for module in model.modules() if type(module).__name__.endswith("Router")]
    if not found:
        raise ValueError(f"{type(model).__name__} has no MoE router (a transformers *Router module)")
    return found


def force_balanced_routing(model: nn.Module, experts: int, top_k: int) -> list:
    """Make every MoE router of ``model`` (:func:`routers`) spread tokens evenly: token ``t`` (of the ``N`` its layer
    routes in one call) goes to experts ``(t·k + j) mod E`` for ``j < k``, each with weight ``1/k``. Each expert then
    gets ``N·k/E`` tokens (within one when ``E`` does not divide ``N·k``), on every rank, so EP's all-to-alls are even
    too. The router still runs, and its first output (logits or probabilities, for an auxiliary loss) is kept; the
    weights are ``1/k`` in value but keep their gradient path to the router (``w - w.detach() + 1/k``), so the
    backward does the same work as under learned routing. A forward hook per router; returns the hook handles."""

    def balanced(router, inputs, output):
        scores, weights, index = output
        token = torch.arange(index.shape[0], device=index.device)[:, None]
        index = ((token * top_k + torch.arange(top_k, device=index.device)) % experts).to(index.dtype)
        return scores, weights - weights.detach() + 1.0 / top_k, index

    return [router.register_forward_hook(balanced) for router in routers(model)]


@contextmanager
def expert_loads(model: nn.Module, experts: int):
    """Yields a list that receives, for each call of an experts module of ``model`` in the block, its tokens per
    expert (``(E,)`` counts of the ``top_k_index`` it is called with; under EP, before the dispatch)."""
    loads: list[torch.Tensor] = []

    def count(module, args):
        loads.append(torch.bincount(args[1].flatten(), minlength=experts))

    modules = [m for name, m in model.named_modules()
               if name.rpartition(".")[2] == "experts" and experts_implementation(m) is not None]
    handles = [module.register_forward_pre_hook(count) for module in modules]
    try:
        yield loads
    finally:
        for handle in handles:
            handle.remove()


def load_ratio(loads: list[torch.Tensor], balanced: bool) -> float:
    """Busiest expert's tokens over the mean, averaged over the calls; checks the balance of a ``balanced`` row."""
    if balanced:
        for counts in loads:
            uneven = int(counts.sum()) % counts.numel() != 0
            assert int(counts.max() - counts.min()) <= uneven, f"balanced routing, yet tokens per expert {counts}"
    return statistics.mean(float(c.max() / c.float().mean()) for c in loads)


# --------------------------------------------------------------------------------------------------------- steps
def synthetic_batch(step: int, rank: int, args) -> dict:
    """Random tokens on the CPU, as a data loader gives them; for Gemma, a prompt then ``--canvas`` supervised tokens
    (one canvas, attended)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    ids = torch.randint(0, args.vocab - 1, (args.batch, args.seq), generator=g)
    rows = torch.arange(args.batch) + (step * dist.get_world_size() + rank) * args.batch
    loss_mask = torch.ones_like(ids, dtype=torch.float)
    if args.family == "gemma":
        loss_mask[:, : args.seq - args.canvas] = 0
    batch = {"input_ids": ids, "loss_mask": loss_mask, "example_index": rows,
             "input_lengths": torch.full((args.batch,), args.seq), "attention_mask": torch.ones_like(ids)}
    return {key: value.pin_memory() if torch.cuda.is_available() else value for key, value in batch.items()}


def step_batches(step: int, rank: int, args) -> list[dict]:
    """The ``--accumulate`` micro-batches of one step."""
    return [synthetic_batch(step * args.accumulate + index, rank, args) for index in range(args.accumulate)]


def train_step(module, optimizer, batches: list[dict], group, world: int, device: torch.device, defer: bool) -> None:
    """One step as training runs it: per micro-batch, token counts summed over the data-parallel ranks and loss × ranks
    / micro-batches backward (training instead rescales the accumulated gradients to the window's token count once:
    a count all-reduce and one multiply over the local shards, left out here); ``defer``: gradients synchronised in
    the last micro-batch's backward only (the lit_dllm strategies' ``on_train_batch_start``); then the optimizer step.
    Each micro-batch goes to the device through the module's ``transfer_batch_to_device``, as in Lightning."""
    for index, batch in enumerate(batches):
        batch = module.transfer_batch_to_device(batch, device, 0)
        if defer:
            sync_gradients_in_backward(module.model, index == len(batches) - 1)
        with torch.autocast(device.type, dtype=torch.bfloat16):  # what Lightning's bf16-mixed adds to FSDP2's policy
            prepared = module.prepare_batch(batch, module.noise_keys(batch, 0))
            local = module.token_counts(batch, prepared)
            totals = torch.stack([count.float() for count in local.values()])
            dist.all_reduce(totals, group=group)
            loss = module.compute_loss(batch, prepared, dict(zip(local, totals))).output.total_loss
        (loss * world / len(batches)).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def run(args, variant: Variant, device: torch.device) -> dict:
    meshes = init_meshes(dist.get_world_size(), args.ep if variant.ep else 1, device.type)
    module = build(args, variant, device)
    counts = parameter_counts(module)
    experts, top_k = expert_counts(module.model.hf.config.get_text_config())
    kernel = experts_implementation(moe_experts(module.model)[0])
    rank = dist.get_rank()
    flops = args.accumulate * module.training_flops(synthetic_batch(0, rank, args))  # whole parameters
    if variant.balanced:
        force_balanced_routing(module.model, experts, top_k)
    parallelize(module.model, meshes, param_dtype=torch.bfloat16, compile=variant.compile,
                reshard_after_forward=not variant.gathered,
                reduce_dtype=torch.bfloat16 if variant.bf16reduce else torch.float32)
    optimizer = build_optimization(module.model, args.warmup + args.steps, lr=1e-4, weight_decay=0.01,
                                   betas=(0.9, 0.95), warmup=0, min_lr_ratio=1.0)["optimizer"]  # as training: fused
    world, group = data_parallel_size(meshes), data_parallel_group(meshes)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    def step(batches: list[dict]) -> None:
        train_step(module, optimizer, batches, group, world, device, variant.defer)

    times, load = [], float("nan")
    for index in range(args.warmup + args.steps):
        batches = step_batches(index, rank, args)
        sync(device)
        start = time.perf_counter()
        if index == 0 and args.warmup and not variant.compile:  # counted once, untimed: bincount waits for the GPU
            with expert_loads(module.model, experts) as loads:
                step(batches)
            load = load_ratio(loads, variant.balanced)
        else:
            step(batches)
        sync(device)
        if index >= args.warmup:
            times.append(time.perf_counter() - start)
    unsynchronised = None
    if args.unsynchronised:
        first = args.warmup + args.steps
        unsynchronised = statistics.median(
            unsynchronised_times(step, [step_batches(first + i, rank, args) for i in range(args.steps)], device))
    section = profiled_steps(args, step, rank, device) if args.profile else None
    stats = torch.tensor([torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan"), load],
                         device=device)
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    del module, optimizer
    gc.collect()
    torch._dynamo.reset()  # each compiled row compiles its own blocks afresh
    if device.type == "cuda":
        torch.cuda.empty_cache()
    step_time = statistics.median(times)
    peak = peak_flops(device, "bf16-mixed")

    def mfu(seconds: float | None) -> float | None:
        return flops / seconds / peak if peak and seconds else None

    return {"counts": counts, "kernel": kernel, "step": step_time, "range": (min(times), max(times)),
            "tokens": world * args.accumulate * args.batch * args.seq / step_time, "mfu": mfu(step_time),
            "unsynchronised": unsynchronised, "mfu_unsynchronised": mfu(unsynchronised), "peak_flops": peak,
            "load": float(stats[1]), "peak": float(stats[0]), "profile": section}


def unsynchronised_times(step, steps: list[list[dict]], device: torch.device) -> list[float]:
    """Seconds of each ``step(batches)`` over ``steps``, run back to back without waiting for the device (as training
    runs: the host queues a step while the device runs the last): the distances between CUDA events recorded at each
    step's start and after the last (on the CPU, the host's clock)."""
    cuda, marks = device.type == "cuda", []

    def mark() -> None:
        marks.append(torch.cuda.Event(enable_timing=True) if cuda else time.perf_counter())
        if cuda:
            marks[-1].record()

    sync(device)
    for batches in steps:
        mark()
        step(batches)
    mark()
    sync(device)
    if cuda:
        return [start.elapsed_time(end) / 1e3 for start, end in zip(marks, marks[1:])]
    return [end - start for start, end in zip(marks, marks[1:])]


def profiled_steps(args, step, rank: int, device: torch.device) -> str | None:
    """``step(batches)`` on ``--profile`` more steps' micro-batches (made beforehand) under ``torch.profiler``: CUDA
    kernels, or on the CPU the leaf operators (no others inside them); :func:`report`'s tables with :data:`MOE_KINDS`
    (rank 0)."""
    cuda, first = device.type == "cuda", args.warmup + args.steps
    steps = [step_batches(first + i, rank, args) for i in range(args.profile)]
    activities = {ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU}
    activities |= {ProfilerActivity.CPU} if args.stacks or args.operators else set()  # the launching host code
    sync(device)
    with profile(activities=list(activities), with_stack=args.stacks, record_shapes=args.operators) as prof:
        start = time.perf_counter()
        for batches in steps:
            step(batches)
        sync(device)
        seconds = time.perf_counter() - start
    if rank != 0:
        return None
    events = cuda_kernels(prof) if cuda else sorted(
        (e.time_range.start, e.time_range.end, e.name) for e in prof.events() if not e.cpu_children)
    what = "CUDA kernels" if cuda else "leaf CPU operators (no CUDA here: a smoke test of this section, no GPU profile)"
    section = (f"{args.profile} profiled steps after the timed ones, {seconds / args.profile * 1e3:.1f} ms a step "
               f"under the profiler; rank 0's {what}\n\n" + report(events, args.profile, MOE_KINDS))
    if args.stacks:  # on the CPU (no device work) the table stays empty: a smoke test
        section += gap_sources_section(prof, args.profile)
    if args.operators:
        section += operators_section(prof, args.profile)
    return section


def operators_section(prof, steps: int) -> str:
    """The 30 ATen operators of a finished ``torch.profiler`` run (CPU activity, shapes recorded) that launched the most
    device time of their own, per step, by input shapes. On the CPU (no device time) a smoke test: the CPU time."""
    operators = [event for event in prof.key_averages(group_by_input_shape=True) if event.key.startswith("aten::")]
    device_time = any(event.self_device_time_total for event in operators)
    own_time = (lambda e: e.self_device_time_total) if device_time else (lambda e: e.self_cpu_time_total)
    rows = [(f"`{event.key}`", f"`{str(event.input_shapes)[:100]}`", f"{event.count / steps:g}",
             f"{own_time(event) / 1e3 / steps:.2f}") for event in sorted(operators, key=own_time, reverse=True)[:30]]
    what = "device" if device_time else "CPU (no device here)"
    return (f"\n\nOperators by the {what} time they launched, per step:\n\n"
            + markdown_table(["operator", "input shapes", "calls", "ms/step"], rows))


def table(args, results: dict, world: int) -> str:
    first = next(iter(results.values()))
    total, active = first["counts"]
    peak = f"{first['peak_flops'] / 1e12:,.1f} TFLOP/s" if first["peak_flops"] else "unknown here: no MFU"
    header = ["variant", "step (median)", "fastest – slowest step", "tokens/s (all GPUs)", "MFU",
              "expert load (max/mean)", "peak memory / GPU"]
    rows = [[name, f"{r['step'] * 1e3:.1f} ms", f"{r['range'][0] * 1e3:.1f} – {r['range'][1] * 1e3:.1f} ms",
             f"{r['tokens']:,.0f}",
             "—" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%",
             "—" if r["load"] != r["load"] else f"{r['load']:.2f}",
             "—" if r["peak"] != r["peak"] else f"{r['peak']:.2f} GiB"]
            for name, r in results.items()]
    if args.unsynchronised:
        header += ["step, unsynchronised (median)", "MFU, unsynchronised"]
        for row, r in zip(rows, results.values()):
            row += [f"{r['unsynchronised'] * 1e3:.1f} ms",
                    "—" if r["mfu_unsynchronised"] is None else f"{100 * r['mfu_unsynchronised']:.1f}%"]
    return "\n".join([
        f"MoE {args.family} step, {total / 1e6:,.1f}M parameters ({active / 1e6:,.1f}M active per token), "
        f"bf16 compute, experts kernel {first['kernel']}, {args.batch} x {args.seq} tokens per GPU and micro-batch, "
        f"{args.accumulate} micro-batch(es) a step, {world} ranks, "
        f"median of {args.steps} steps",
        f"MFU: the module's training_flops (as train/mfu: 6 FLOPs per active matmul parameter per token, experts "
        f"counted top-k of their number, plus attention; forward + backward) / step time / dense bf16 peak per GPU "
        f"({peak}). Expert load: busiest expert's tokens / mean, per MoE call of the first warm-up step, averaged, "
        f"max over ranks (— where compiled)",
        environment_line(), "", markdown_table(header, rows),
    ])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=list(VOCAB), default="mdlm")
    parser.add_argument("--layers", type=int, default=2, help="gemma, qwen3-30b: layers of the real model's shapes")
    parser.add_argument("--canvas", type=int, default=256, help="Gemma: supervised tokens per sequence")
    parser.add_argument("--vocab", type=int, default=None,
                        help="default: 32768 (mdlm), 151936 (qwen3-30b), 262144 (gemma)")
    parser.add_argument("--batch", type=int, default=4, help="sequences per GPU")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--accumulate", type=int, default=1, metavar="N",
                        help="micro-batches per optimizer step (training's accumulate_grad_batches)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--ep", type=int, default=2, help="expert-parallel size of the ep rows")
    parser.add_argument("--variants", default="fsdp,ep",
                        help="rows, comma-separated: fsdp or ep, each optionally +compile, +balanced, +flex (gemma), "
                             "+gathered, +bf16reduce, +defer (with --accumulate > 1)")
    parser.add_argument("--experts", default=None, metavar="IMPL",
                        help="transformers' experts implementation of every row (grouped_mm: its default; eager: a "
                             "loop over the experts; batched_mm: small batches only, see the docstring)")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="profile N more steps per row (CUDA kernels) and print where their time goes")
    parser.add_argument("--stacks", action="store_true",
                        help="with --profile on GPUs: also record Python stacks and attribute the idle gaps to the "
                             "host code that launched the work ending each (slower steps under the profiler)")
    parser.add_argument("--operators", action="store_true",
                        help="with --profile: also the operators that launched the most device time, by input shapes")
    parser.add_argument("--unsynchronised", action="store_true",
                        help="also time --steps more steps back to back without waiting for the device between them, "
                             "as training runs (the other columns synchronise at each step's start and end)")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke test: the tests' tiny MoE, gloo")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    variants = [Variant.parse(text) for text in args.variants.split(",")]
    if args.accumulate < 1 or any(variant.defer for variant in variants) and args.accumulate == 1:
        raise SystemExit(f"--accumulate {args.accumulate}: give 1 or more micro-batches a step, and more than 1 "
                         "for a +defer row (it defers the gradient sync to a step's last micro-batch)")
    if any(variant.flex for variant in variants) and (args.family != "gemma" or args.tiny):
        raise SystemExit("--variants: +flex (FlexAttention block masks) is for --family gemma on GPUs: "
                         + ("torch's FlexAttention has no backward on the CPU, so --tiny cannot run it"
                            if args.tiny else f"the {args.family} family builds dense masks only"))
    args.vocab = args.vocab or VOCAB[args.family]
    if args.tiny:
        args.vocab, args.batch, args.seq, args.warmup, args.steps, args.canvas = 100, 2, 32, 1, 2, 8
    device = torch.device("cpu") if args.tiny else torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("gloo" if device.type == "cpu" else "nccl")
    world = dist.get_world_size()
    results = {}
    for variant in variants:
        name = variant.name(world, args.ep)
        results[name] = run(args, variant, device)
        if dist.get_rank() == 0:  # progress, for a run cut short
            print(f"{name}: {results[name]['step'] * 1e3:.1f} ms", flush=True)
    if dist.get_rank() == 0:
        sections = [f"## Profile: {name}\n\n{r['profile']}" for name, r in results.items() if r["profile"]]
        emit("\n\n".join([table(args, results, world)] + sections), args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
