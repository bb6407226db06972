"""MDLM training-step benchmark: lit_dllm's Lightning ``MDLMModule`` vs a plain PyTorch loop.

Default model: a random-init, bidirectional, Llama-3.2-1B-shaped backbone (hidden 2048, 16 layers,
32 heads, 8 KV heads, intermediate 8192, vocab 128256, tied embeddings as in Llama-3.2-1B; ~1.24B
parameters) at batch 4 x 4096 tokens in bf16. Variants, all in one process (memory freed between):

* ``lightning``: ``MDLMModule`` (``attn_implementation="sdpa"``, or ``--attn``; ``fused_loss=True``, uniform
  corruption) trained by a real ``lightning.Trainer(precision="bf16-mixed")`` on synthetic batches
  (``input_ids``, ``loss_mask`` with a 10 % unsupervised prompt, ``attention_mask``,
  ``input_lengths``, ``example_index``). A callback records ``torch.cuda.synchronize()`` +
  ``perf_counter`` at ``on_train_batch_start`` / ``on_train_batch_end``: "step" is start->end
  (corruption, forward, loss, backward, optimizer step, Lightning hooks); "iter" is start->next
  start (also the data loader fetch and the host-to-device copy).
* ``lightning-bf16-true``: the same with ``precision="bf16-true"`` (parameters and AdamW states in bf16).
* ``*-compile``: the same with ``compile=True`` (``torch.compile`` of each decoder layer, inductor, applied in
  ``lit_dllm.parallel.parallelize``); the eager rows run ``compile=False`` (the default compiles on CUDA).
* ``*-ac``: with ``activation_checkpointing=True`` (each decoder layer recomputed in backward); ``lightning-ac`` and
  ``lightning-compile-ac`` (bf16-mixed) are not in the default list: ``bench/run_on_gpu.sh long-context`` runs them.

  These run settings are the strategy's (``lit_dllm.settings.Parallelism``, with the ``--fsdp-*`` options):
  ``lit_dllm.SingleDeviceStrategy``, or under torchrun ``lit_dllm.ExpertParallelStrategy`` (FSDP2 over every rank).
* ``lightning-compile-fp8-tensorwise`` / ``-rowwise`` (not in the default list; they need torchao and a GPU of compute
  capability >= 8.9): ``lightning-compile`` with ``fp8=<recipe>``, torchao's float8 linears in every decoder layer
  (``lit_dllm.fp8``). Their MFU keeps the same model FLOPs over the bf16 peak: a bf16-equivalent MFU, comparable
  with the other rows (fp8's speed-up raises it; the fp8 dense peak is twice the bf16 one).
* ``plain``: a plain loop over the same HF model (``AutoModelForCausalLM.from_config(LlamaConfig)``,
  ``config.is_causal=False``, sdpa): ``torch.autocast`` bf16, full ``model(ids).logits``, corruption
  with ``corrupt_uniform``, ``MDLMCrossEntropyLoss`` on the full logits, AdamW step -- the kind of
  loop the issue's comparison came from (45k tokens/s, 41 % MFU, 61 GiB on an H200).
* ``plain-fused``: the plain loop with lit_dllm's ``DiffusionLM`` fused head (LM head applied only at
  the corrupted positions, chunked): separates the loss change from the Lightning overhead.
* ``plain-compile``: the ``plain`` loop with each decoder layer wrapped in ``torch.compile`` (``layer.compile()``),
  the issue's compiled reference loop (fp32 master weights under autocast).

Both plain variants use AdamW (betas 0.9/0.95, weight decay 0.01 on matrices only: the same
parameter groups and optimizer as ``MDLMModule``; no LR schedule, which costs nothing measurable).
Inputs of the plain loops are pre-placed on the device; their step time is the whole iteration.

FLOPs per optimizer step (model FLOPs, the same formula for every variant, forward + backward):

    F = 6 * N * B * L  +  12 * n_layers * hidden * L^2 * B

``N`` = parameters excluding the input embedding but including the LM head (V x hidden, counted even
when tied to the embedding). The first term is the dense matmuls (2 FLOPs per parameter per token
forward, 4 backward); the second is the attention scores and the attention-weighted values
(2 * 2 * B * L^2 * hidden forward per layer, x3 with backward; bidirectional, so no causal halving).
MFU = F / step_time / peak, with peak = 989e12 (bf16 dense, H100 SXM and H200 datasheet) when the
card name has H100 or H200, else ``--peak-tflops``. Note the fused variants do less real work in
the LM head (only ~45 % of positions are corrupted, plus one recomputation), so their MFU on this
formula is a throughput measure ("model FLOPs"), not hardware utilisation.

Usage::

    python bench/bench_mdlm_step.py --out results/mdlm_step.md          # GPU, ~1B model
    python bench/bench_mdlm_step.py --tiny                              # CPU smoke test (< 1 min)
    python bench/bench_mdlm_step.py --variants lightning-compile,lightning-compile-fp8-tensorwise  # GPU, torchao
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import statistics
import time
import traceback
import warnings

from _common import (
    FP8_MFU_NOTE,
    FP8_VARIANTS,
    add_shape_arguments,
    emit,
    environment_line,
    fit_timed,
    markdown_table,
    split_fp8,
    sync,
)

import torch

# Submodules only: never lit_dllm.data.datamodule / lit_dllm.cli (they need datasets / jsonargparse).
import lit_dllm.parallel
from lit_dllm.noise.corruption import corrupt_uniform
from lit_dllm.noise.keys import example_keys
from lit_dllm.reference.losses import MDLMCrossEntropyLoss

ALL_VARIANTS = (  # plain (largest memory) last
    "lightning", "lightning-compile", "lightning-bf16-true", "lightning-bf16-true-compile",
    "lightning-bf16-true-compile-ac", "plain-fused", "plain-compile", "plain",
)
CHECKPOINTED_VARIANTS = ("lightning-ac", "lightning-compile-ac")
"""Not in the default list: bf16-mixed with every decoder layer recomputed (``run_on_gpu.sh long-context``'s rows)."""
H100_H200_BF16_PEAK = 989e12
SEED = 42


# ------------------------------------------------------------------------------------------------
# Model configuration, parameter counting, FLOPs


def llama_kwargs(args) -> dict:
    return dict(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=max(args.seq, 2048),
        tie_word_embeddings=not args.untied,
    )


def parameter_counts(model: torch.nn.Module) -> dict:
    """Unique parameter count, the input embedding's, and N for the FLOPs formula."""
    total = sum(p.numel() for p in model.parameters())  # tied tensors are yielded once
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    tied = embed is head  # (data_ptr is 0 for every meta tensor, so compare the objects)
    n_flops = total - embed.numel() + (head.numel() if tied else 0)
    return {"total": total, "embedding": embed.numel(), "n_flops": n_flops, "tied": tied}


def human(n: float) -> str:
    return f"{n / 1e9:.3f} B" if n >= 1e9 else f"{n / 1e6:.3f} M"


def step_flops(n_params: int, layers: int, hidden: int, batch: int, seq: int) -> float:
    return 6.0 * n_params * batch * seq + 12.0 * layers * hidden * seq**2 * batch


def count_on_meta(args) -> dict | None:
    from transformers import AutoModelForCausalLM, LlamaConfig

    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(LlamaConfig(**llama_kwargs(args)))
        return parameter_counts(model)
    except Exception as err:  # pragma: no cover - informational
        print(f"(could not count parameters on the meta device: {type(err).__name__}: {err})")
        return None


# ------------------------------------------------------------------------------------------------
# Checks


def check_bidirectional(device: torch.device) -> list[str]:
    """Does position 0 see position 5? For the plain path (config.is_causal=False before building)
    and for lit_dllm's DiffusionLM wrapper (which sets it after building)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from lit_dllm.families.mdlm.model import DiffusionLM

    lines = []
    kwargs = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=4, num_key_value_heads=2)
    ids = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(0)).to(device)
    changed = ids.clone()
    changed[0, 5] = (changed[0, 5] + 1) % 64
    for label in ("plain (config.is_causal=False)", "DiffusionLM wrapper"):
        config = LlamaConfig(**kwargs)
        if label.startswith("plain"):
            config.is_causal = False
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
        run = (lambda x: model(input_ids=x).logits) if label.startswith("plain") else DiffusionLM(model).logits
        with torch.no_grad():
            diff = (run(ids)[0, 0] - run(changed)[0, 0]).abs().max().item()
        verdict = "bidirectional OK" if diff > 0 else "WARNING: CAUSAL (position 0 ignores later tokens)"
        lines.append(f"{label}: {verdict} (|Δ logits[0]| = {diff:.3g})")
    return lines


# ------------------------------------------------------------------------------------------------
# Synthetic data


def synthetic_batch(step: int, batch: int, seq: int, vocab: int, prompt_frac: float = 0.1) -> dict:
    """Random ids in [1, vocab-1) (never pad 0 or the mask id vocab-1), first 10 % unsupervised."""
    g = torch.Generator().manual_seed(1000 + step)
    loss_mask = torch.ones(batch, seq, dtype=torch.float32)
    loss_mask[:, : int(prompt_frac * seq)] = 0
    return {
        "input_ids": torch.randint(1, vocab - 1, (batch, seq), generator=g),
        "loss_mask": loss_mask,
        "attention_mask": torch.ones(batch, seq, dtype=torch.long),
        "input_lengths": torch.full((batch,), seq, dtype=torch.long),
        "example_index": torch.arange(step * batch, (step + 1) * batch, dtype=torch.long),
    }


class SyntheticBatches(torch.utils.data.Dataset):
    """``n`` whole batches of ``synthetic_batch``; the first ``short`` of them ``short_seq`` tokens long."""

    def __init__(self, n: int, batch: int, seq: int, vocab: int, short: int = 0, short_seq: int | None = None):
        self.n, self.batch, self.seq, self.vocab = n, batch, seq, vocab
        self.short, self.short_seq = short, short_seq or seq

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        return synthetic_batch(i, self.batch, self.short_seq if i < self.short else self.seq, self.vocab)


# ------------------------------------------------------------------------------------------------
# Helpers


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def memory_stats(device: torch.device) -> dict:
    if device.type != "cuda":
        return {}
    return {"peak_alloc": torch.cuda.max_memory_allocated(), "peak_reserved": torch.cuda.max_memory_reserved()}


def summarise(step_times: list[float], iter_times: list[float] | None, losses: list[float]) -> dict:
    return {
        "step": statistics.median(step_times),
        "step_min": min(step_times),
        "step_max": max(step_times),
        "iter": statistics.median(iter_times) if iter_times else None,
        "n": len(step_times),
        "loss_first": losses[0] if losses else float("nan"),
        "loss_last": losses[-1] if losses else float("nan"),
    }


# ------------------------------------------------------------------------------------------------
# Variant (a): Lightning


def world_size() -> int:
    """Ranks started by torchrun (1 when run directly)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def keep_every_block_gathered() -> None:
    """Bench-only: every FSDP2 unit lit_dllm shards keeps its parameters gathered from forward to backward."""
    shard = lit_dllm.parallel._fully_shard
    lit_dllm.parallel._fully_shard = lambda unit, **kw: shard(unit, **{**kw, "reshard_after_forward": False})


def lightning_module(args):
    """The benchmarked ``MDLMModule``: ``args``' Llama shape (:func:`llama_kwargs`), uniform corruption, the fused
    head."""
    from lit_dllm.settings import CausalBackbone
    from lit_dllm.families.mdlm.module import LLaDAGeneration, MDLMModule

    return MDLMModule(
        vocab_size=args.vocab,
        mask_token_id=args.vocab - 1,
        pad_token_id=0,
        backbone=CausalBackbone(model_config={"model_type": "llama", **llama_kwargs(args)},
                                attn_implementation=args.attn),
        corruption="uniform",
        fused_loss=True,
        generation=LLaDAGeneration(val_generate_batches=0),
        noise_seed=SEED,
    )


def strategy_for_world(args, compile: bool = False, checkpointing: bool = False, fp8: str | None = None):
    """The run settings (``compile``, activation ``checkpointing``, ``fp8`` and ``args``' FSDP2 options:
    ``fsdp_defer_sync``, ``fsdp_prefetch``, ``fsdp_reduce_bf16``) on their strategy: under torchrun FSDP2 over every
    rank (``ExpertParallelStrategy``, as lit_dllm shards in configure_model), else one device."""
    from lit_dllm import ExpertParallelStrategy, Parallelism, SingleDeviceStrategy

    parallelism = Parallelism(
        compile=compile, activation_checkpointing=checkpointing, fp8=fp8,
        fsdp_defer_gradient_sync=args.fsdp_defer_sync, fsdp_prefetch_next_step=args.fsdp_prefetch,
        fsdp_reduce_dtype="bfloat16" if args.fsdp_reduce_bf16 else "float32",
    )
    if world_size() == 1:
        return SingleDeviceStrategy(parallelism=parallelism)
    return ExpertParallelStrategy(parallelism=parallelism)


def run_lightning(
    args, device: torch.device, precision: str, compile: bool = False, checkpointing: bool = False,
    fp8: str | None = None,
) -> dict:
    module = lightning_module(args)
    world, strategy = world_size(), strategy_for_world(args, compile, checkpointing, fp8)
    free_memory(device)
    accumulate = args.accumulate
    batches = SyntheticBatches((args.warmup + args.steps) * accumulate, args.batch, args.seq, args.vocab,
                               short=args.warmup * accumulate, short_seq=args.warmup_seq)
    times = fit_timed(module, batches, device, precision, not args.unsynchronised, devices=world, strategy=strategy,
                      use_distributed_sampler=False, accumulate_grad_batches=accumulate,
                      max_steps=args.warmup + args.steps)
    mem = memory_stats(device)
    counts = parameter_counts(module.model.hf)
    param_dtype = str(next(module.model.parameters()).dtype).replace("torch.", "")
    skip = args.warmup
    # per optimizer step, its micro-batches' mean time (the last micro-batch also reduces and steps)
    steps, iters = ([sum(t[i:i + accumulate]) / accumulate for i in range(0, len(t) - accumulate + 1, accumulate)]
                    for t in (times.steps, times.iters))
    result = summarise(steps[skip:], iters[skip:], times.losses)
    result.update(mem, counts=counts, wall=times.wall, param_dtype=param_dtype, steps_done=len(times.steps))
    del module
    return result


# ------------------------------------------------------------------------------------------------
# Variant (b): plain PyTorch


def run_plain(args, device: torch.device, fused: bool, compile: bool = False) -> dict:
    from transformers import AutoModelForCausalLM, LlamaConfig

    from lit_dllm.core.optim import decay_param_groups
    from lit_dllm.families.mdlm.model import DiffusionLM

    mixed = args.precision == "bf16-mixed"
    if args.precision not in ("bf16-mixed", "32", "32-true"):
        raise ValueError(f"plain variants run fp32 params with or without bf16 autocast, not {args.precision}")
    free_memory(device)
    t_build = time.perf_counter()
    config = LlamaConfig(**llama_kwargs(args))
    config.is_causal = False  # bidirectional attention (transformers' masking honours it)
    config.use_cache = False
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    model.train()
    if compile:
        for layer in model.model.layers:
            layer.compile(backend=args.compile_backend)
    counts = parameter_counts(model)
    wrapper = DiffusionLM(model, chunk_size=2048, fused=True) if fused else None
    optimizer = torch.optim.AdamW(decay_param_groups(model, 0.01), lr=3e-4, betas=(0.9, 0.95))
    loss_fn = MDLMCrossEntropyLoss()
    mask_id = args.vocab - 1
    total_steps = args.warmup + args.steps
    batches = [
        {k: v.to(device) for k, v in synthetic_batch(i, args.batch, args.seq, args.vocab).items()}
        for i in range(total_steps)
    ]
    build_s = time.perf_counter() - t_build

    def step(batch: dict) -> torch.Tensor:
        ids, loss_mask = batch["input_ids"], batch["loss_mask"]
        keys = example_keys(SEED, batch["example_index"], 0)
        noisy, noise, p_mask = corrupt_uniform(ids, loss_mask, mask_id, 1e-3, keys=keys)
        noise = noise & loss_mask.bool()
        count = loss_mask.sum().clamp_min(1.0)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=mixed):
            if fused:  # as MDLMModule.diffusion_sum
                scored = wrapper(noisy, targets=ids, positions=noise)
                weight = 1.0 / p_mask[noise].float().clamp_min(1e-8)
                loss = (scored.nll * weight).sum() / count
            else:
                logits = model(input_ids=noisy, use_cache=False).logits
        if not fused:
            loss = loss_fn(logits, ids, noise, p_mask, loss_mask, num_diffusion_tokens=count).total_loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    step_times, losses = [], []
    t0 = time.perf_counter()
    for i, batch in enumerate(batches):
        sync(device)
        start = time.perf_counter()
        loss = step(batch)
        sync(device)
        if i >= args.warmup:
            step_times.append(time.perf_counter() - start)
        losses.append(float(loss))
    wall = time.perf_counter() - t0 + build_s
    mem = memory_stats(device)
    param_dtype = str(next(model.parameters()).dtype).replace("torch.", "")
    result = summarise(step_times, None, losses)
    result.update(mem, counts=counts, wall=wall, param_dtype=param_dtype, steps_done=len(batches))
    del model, wrapper, optimizer, batches
    return result


# ------------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_arguments(parser)
    parser.add_argument("--untied", action="store_true", help="untie the LM head from the embedding")
    parser.add_argument("--variants", default=",".join(ALL_VARIANTS),
                        help=f"comma list of {ALL_VARIANTS + CHECKPOINTED_VARIANTS + FP8_VARIANTS} (default: "
                             f"{', '.join(ALL_VARIANTS)})")
    parser.add_argument("--attn", choices=["sdpa", "flex_attention"], default="sdpa",
                        help="lightning rows' attention (unpacked rows: no mask; flex computes every tile)")
    parser.add_argument("--precision", default=None, help="bf16-mixed (default on GPU) or 32 (default --tiny)")
    parser.add_argument("--accelerator", choices=["auto", "cpu", "gpu"], default="auto")
    parser.add_argument("--peak-tflops", type=float, default=None, help="override the bf16 peak used for MFU")
    parser.add_argument("--tiny", action="store_true",
                        help="CPU smoke preset: hidden 64, 2 layers, vocab 512, seq 128, batch 2, precision 32")
    parser.add_argument("--compile-backend", default="inductor", help="torch.compile backend (--tiny: aot_eager)")
    parser.add_argument("--out", default=None, help="also write the markdown table to this file")
    parser.add_argument("--warmup-seq", type=int, default=None,
                        help="lightning rows: the warm-up steps' length (default --seq). A short one makes Adam's "
                             "states and starts the kernels, so one measured step at a long --seq shows the steady "
                             "peak memory without a second long step")
    parser.add_argument("--accumulate", type=int, default=1,
                        help="micro-batches per optimizer step (lightning rows; a row's step is their mean time)")
    parser.add_argument("--fsdp-defer-sync", action="store_true",
                        help="lightning rows: parallelism.fsdp_defer_gradient_sync=True (under torchrun, with "
                             "--accumulate > 1)")
    parser.add_argument("--fsdp-prefetch", action="store_true",
                        help="lightning rows: parallelism.fsdp_prefetch_next_step=True (under torchrun)")
    parser.add_argument("--fsdp-reduce-bf16", action="store_true",
                        help="lightning rows: parallelism.fsdp_reduce_dtype=bfloat16 (under torchrun)")
    parser.add_argument("--unsynchronised", action="store_true",
                        help="lightning rows: time each step between device events at the batch starts, never "
                             "waiting for the device (as training runs), instead of synchronising at each batch's "
                             "start and end (_common.fit_timed)")
    parser.add_argument("--fsdp-keep-gathered", action="store_true",
                        help="bench-only (docs/BENCHMARKS.md §5): every FSDP2 block keeps its parameters gathered "
                             "from forward to backward, not only the last")
    args = parser.parse_args()

    if args.tiny:
        args.hidden, args.layers, args.heads, args.kv_heads, args.intermediate = 64, 2, 4, 2, 256
        args.vocab, args.seq, args.batch = 512, 128, 2
        args.steps, args.warmup = min(args.steps, 5), min(args.warmup, 2)
        if args.accelerator == "auto":
            args.accelerator = "cpu"
        args.precision = args.precision or "32"
        args.compile_backend = "aot_eager"  # inductor's C++ build takes minutes on a small CPU
    if args.accelerator == "auto":
        args.accelerator = "gpu" if torch.cuda.is_available() else "cpu"
    device = torch.device("cuda" if args.accelerator == "gpu" else "cpu")
    args.precision = args.precision or ("bf16-mixed" if device.type == "cuda" else "32")
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    known = ALL_VARIANTS + CHECKPOINTED_VARIANTS + FP8_VARIANTS
    unknown = [v for v in variants if v not in known]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; choose from {known}")

    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=".*num_workers.*")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    torch.manual_seed(SEED)
    lit_dllm.parallel.COMPILE_BACKEND = args.compile_backend
    if args.fsdp_keep_gathered:
        keep_every_block_gathered()

    env = environment_line()
    print(env, flush=True)
    card = torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu"
    if args.peak_tflops is not None:
        peak, peak_note = args.peak_tflops * 1e12, f"{args.peak_tflops:g} TFLOP/s (--peak-tflops)"
    elif device.type == "cuda" and ("H100" in card or "H200" in card):
        peak = H100_H200_BF16_PEAK
        peak_note = f"989 TFLOP/s bf16 dense (H100 SXM / H200 datasheet) for {card!r}"
        if "PCIe" in card:
            peak_note += " -- NOTE: an H100 PCIe's datasheet peak is 756 TFLOP/s"
    else:
        peak, peak_note = None, f"unknown for {card!r} (MFU not reported; pass --peak-tflops)"
    if peak and set(variants) & set(FP8_VARIANTS):
        peak_note += f" ({FP8_MFU_NOTE})"
    print(f"MFU peak: {peak_note}")

    counts = count_on_meta(args)
    shape = (f"hidden {args.hidden}, {args.layers} layers, {args.heads} heads, {args.kv_heads} KV heads, "
             f"intermediate {args.intermediate}, vocab {args.vocab}, {'untied' if args.untied else 'tied'} "
             f"embeddings; batch {args.batch} x seq {args.seq}; precision {args.precision}; lightning rows attend by "
             f"{args.attn}")
    print("model:", shape)
    flops = None
    if counts:
        flops = step_flops(counts["n_flops"], args.layers, args.hidden, args.batch, args.seq)
        print(f"parameters: {human(counts['total'])} total ({human(counts['embedding'])} embedding, "
              f"{'tied' if counts['tied'] else 'untied'} LM head); "
              f"N for FLOPs (no embedding, with LM head) = {human(counts['n_flops'])}; "
              f"FLOPs/step = 6·N·B·L + 12·layers·hidden·L²·B = {flops:.4g}")
    for line in check_bidirectional(device):
        print("attention check:", line)
    print(flush=True)

    results: dict[str, dict] = {}
    t_all = time.perf_counter()
    for variant in variants:
        print(f"=== {variant} ===", flush=True)
        try:
            base, fp8 = split_fp8(variant)
            compile, checkpointing = "compile" in base, base.endswith("-ac")
            if base.startswith("lightning"):
                precision = "bf16-true" if "bf16-true" in base else args.precision
                res = run_lightning(args, device, precision, compile, checkpointing, fp8)
            else:
                res = run_plain(args, device, fused=variant == "plain-fused", compile=compile)
        except torch.cuda.OutOfMemoryError as err:
            res = {"error": f"OOM: {' '.join(str(err).split())[:200]}", **memory_stats(device)}
        except Exception as err:
            traceback.print_exc()
            res = {"error": f"{type(err).__name__}: {' '.join(str(err).split())[:200]}"}
        results[variant] = res
        free_memory(device)
        if device.type == "cuda":
            print(f"(after cleanup: {torch.cuda.memory_allocated() / 2**30:.2f} GiB still allocated)")
        if "error" in res:
            print(f"{variant}: {res['error']}", flush=True)
        else:
            if flops is None:
                flops = step_flops(res["counts"]["n_flops"], args.layers, args.hidden, args.batch, args.seq)
            rate = args.batch * args.seq * world_size() / res["step"]
            mfu = f", MFU {100 * flops / res['step'] / peak:.1f} %" if peak else ""
            peak_gib = f", peak {res['peak_alloc'] / 2**30:.1f} GiB" if "peak_alloc" in res else ""
            print(f"{variant}: step {res['step'] * 1e3:.1f} ms (min {res['step_min'] * 1e3:.1f}, max "
                  f"{res['step_max'] * 1e3:.1f}, n={res['n']}), {rate:,.0f} tokens/s{mfu}{peak_gib}, params "
                  f"{res['param_dtype']}, loss {res['loss_first']:.3f} -> {res['loss_last']:.3f}, wall "
                  f"{res['wall']:.1f} s", flush=True)

    world = world_size()
    if world > 1:
        card = f"{world} x {card}, FSDP2"
        if int(os.environ.get("RANK", "0")) != 0:
            return
    tokens = args.batch * args.seq * world  # global tokens per step; MFU stays per GPU
    header = ["variant", "card", "params", "step ms (median)", "iter ms", "tokens/s", "MFU %",
              "peak GiB alloc", "peak GiB reserved", "loss first→last"]
    rows = []
    for variant, res in results.items():
        if "error" in res:
            peak_alloc = res.get("peak_alloc")
            rows.append([variant, card, "-", res["error"], "-", "-", "-",
                         f"{peak_alloc / 2**30:.1f}" if peak_alloc else "-", "-", "-"])
            continue
        step = res["step"]
        mfu = f"{100 * flops / step / peak:.1f}" if peak else "-"  # flops of one rank's batch
        rows.append([
            variant,
            card,
            res["param_dtype"],
            f"{step * 1e3:.1f}",
            f"{res['iter'] * 1e3:.1f}" if res.get("iter") else "-",
            f"{tokens / step:,.0f}",
            mfu,
            f"{res['peak_alloc'] / 2**30:.1f}" if "peak_alloc" in res else "-",
            f"{res['peak_reserved'] / 2**30:.1f}" if "peak_reserved" in res else "-",
            f"{res['loss_first']:.3f}→{res['loss_last']:.3f}",
        ])
    n_text = f"{human(counts['total'])} params, N={human(counts['n_flops'])}" if counts else "params: see log"
    text = "\n".join([
        "# MDLM training step benchmark",
        "",
        env,
        f"model: {shape}; {n_text}; FLOPs/step {flops:.4g} (6·N·B·L + 12·layers·hidden·L²·B)" if flops else shape,
        f"MFU peak: {peak_note}. {args.warmup} warm-up"
        + (f" ({args.warmup_seq} tokens a row)" if args.warmup_seq else "")
        + f" + {args.steps} measured steps per variant; medians. Lightning 'step' = " + (
            "the device's time from one on_train_batch_start to the next, the host never waiting "
            "(--unsynchronised), 'iter' the same; " if args.unsynchronised else "on_train_batch_start→end, "
            "'iter' = start→next start, the device synchronised at both; ") + "plain = whole "
        f"iteration, inputs already on device. Total {time.perf_counter() - t_all:.0f} s.",
        "",
        markdown_table(header, rows),
    ])
    print()
    emit(text, args.out)


if __name__ == "__main__":
    main()
