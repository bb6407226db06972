"""Packed vs padded MDLM training on GSM8K-length prompt/response data: real (non-pad) tokens per second and MFU.

The examples: ``--examples`` prompt/response pairs whose lengths follow GSM8K under SmolLM2's chat template (101 to
552 tokens, median 212: a log-normal of median 212 clipped to that range, ``--sigma`` chosen so that random batches
of 8 / 16 / 32 hold about 68 / 62 / 57 % real tokens, as measured on the real set); the prompt (unsupervised) is 45 %
of each example; random token ids. Rows, all from one call on one device:

* ``padded``: random batches of ``--padded-batch`` examples, each padded to its longest rounded up to a multiple of
  64 (``DLLMCollator(pad_seq_len_divisible=64)``: at most 8 shapes), each shape compiled as a static graph during
  the warm-up (one batch of each shape first): the best case of padded batches;
* ``padded-dynamic``: the same batches under torch.compile's default automatic dynamic shapes (after the first
  shape change the layers run one dynamic-shape graph), what a run gets without tuning;
* ``grouped``: examples length-grouped (``EpochBatchSampler(group_by_length=True)``), static shapes as ``padded``;
* ``packed-sdpa`` / ``packed-flex``: rows of ``--pack-length`` tokens filled by best-fit decreasing
  (``pack_windows``), ``--rows`` rows a step, each document attending only to itself: SDPA with a dense additive
  mask, or FlexAttention with a block mask that skips other documents' tiles.

Every row trains the 1.24B Llama-shaped ``MDLMModule`` (``bench_mdlm_step.py``'s model) with ``--precision``
(bf16-true) under ``lit_dllm.SingleDeviceStrategy`` with ``compile`` on, through a real ``lightning.Trainer``
(``_common.fit_timed``, unsynchronised). MFU is counted on real tokens for every row: the documents' own matmuls and
their attention within each document (``lit_dllm.throughput.packed_transformer_flops`` over the examples' lengths),
so padding and block fill count nothing. The ideal gain of packing is padded tokens / real tokens of the padded
batches.

Usage::

    python bench/bench_packing.py --out results/packing.md     # GPU, 1.24B
    python bench/bench_packing.py --tiny                        # CPU smoke test
"""

from __future__ import annotations

import argparse
import gc
import math

from _common import add_shape_arguments, emit, environment_line, fit_timed, markdown_table

import numpy as np
import torch

from lit_dllm.data.batch import real_tokens
from lit_dllm.data.collate import DLLMCollator
from lit_dllm.data.loader import EpochBatchSampler
from lit_dllm.data.packing import PackedCollator, pack_windows
from lit_dllm.throughput import packed_transformer_flops

VARIANTS = ("padded", "padded-dynamic", "grouped", "packed-sdpa", "packed-flex")
PAD_MULTIPLE = 64
H100_H200_BF16_PEAK = 989e12
SHORTEST, LONGEST, MEDIAN = 101, 552, 212


def gsm8k_lengths(count: int, sigma: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.clip(np.round(MEDIAN * np.exp(sigma * rng.standard_normal(count))), SHORTEST, LONGEST).astype(int)


def real_share(lengths: np.ndarray, batch: int, seed: int) -> float:
    """Real tokens / padded tokens of random batches of ``batch`` examples, each padded to its longest."""
    order = np.random.default_rng(seed).permutation(len(lengths))
    batches = [lengths[order[i : i + batch]] for i in range(0, len(order) - batch + 1, batch)]
    return sum(b.sum() for b in batches) / sum(b.max() * len(b) for b in batches)


def examples(lengths: np.ndarray, vocab: int, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for index, length in enumerate(lengths.tolist()):
        prompt = int(0.45 * length)
        out.append({"input_ids": torch.randint(2, vocab - 1, (length,), generator=g),
                    "loss_mask": torch.tensor([0] * prompt + [1] * (length - prompt)), "example_index": index})
    return out


def batches_of(variant: str, data: list[dict], lengths: np.ndarray, args) -> list[dict]:
    """The warm-up batches (padded: one of each shape first), then ``args.steps`` measured ones."""
    if variant.startswith("packed"):
        order = np.random.default_rng(args.seed).permutation(len(data)).tolist()
        rows = pack_windows(order, lengths.tolist(), args.pack_length, window=len(order))
        packed = PackedCollator(DLLMCollator(pad_token_id=0, eos_token_id=1), args.pack_length)
        return [packed([[data[i] for i in row] for row in rows[s * args.rows : (s + 1) * args.rows]])
                for s in range(args.warmup + args.steps)]
    collator = DLLMCollator(pad_token_id=0, eos_token_id=1, pad_seq_len_divisible=PAD_MULTIPLE)
    sampler = EpochBatchSampler(lengths, args.padded_batch, args.seed, group_by_length=variant == "grouped")
    batches = [collator([data[i] for i in batch]) for batch in sampler.epoch_batches(0)]
    measured = batches[args.warmup : args.warmup + args.steps]
    shapes = {tuple(b["input_ids"].shape): b for b in batches}  # every shape of the run, compiled in the warm-up
    return list(shapes.values()) + batches[: args.warmup] + measured


def module_for(args, attention: str):
    from lit_dllm.families.mdlm.module import LLaDAGeneration, MDLMModule
    from lit_dllm.settings import CausalBackbone

    config = {"model_type": "llama", "vocab_size": args.vocab, "hidden_size": args.hidden,
              "intermediate_size": args.intermediate, "num_hidden_layers": args.layers,
              "num_attention_heads": args.heads, "num_key_value_heads": args.kv_heads,
              "max_position_embeddings": max(args.pack_length, LONGEST), "tie_word_embeddings": True}
    return MDLMModule(vocab_size=args.vocab, mask_token_id=args.vocab - 1, pad_token_id=0, eos_token_id=1,
                      backbone=CausalBackbone(model_config=config, attn_implementation=attention),
                      generation=LLaDAGeneration(val_generate_batches=0), noise_seed=42)


def run(variant: str, data, lengths, args, device) -> dict:
    from lit_dllm import Parallelism, SingleDeviceStrategy

    batches = batches_of(variant, data, lengths, args)
    warmup = len(batches) - args.steps
    if warmup < args.warmup:
        raise SystemExit(f"{variant}: too few batches from {len(data)} examples; raise --examples.")
    module = module_for(args, "flex_attention" if variant == "packed-flex" else "sdpa")
    strategy = SingleDeviceStrategy(parallelism=Parallelism(compile=not args.tiny))
    # static shapes: one graph per padded shape (all compiled in the warm-up), unless the variant is the dynamic one
    with torch._dynamo.config.patch(automatic_dynamic_shapes=variant == "padded-dynamic", recompile_limit=16):
        times = fit_timed(module, batches, device, args.precision, synchronise=False, strategy=strategy)
    measured = batches[warmup:]
    seconds = sum(times.steps[warmup:])
    config = module.model.hf.config
    real = sum(int(real_tokens(b).sum()) for b in measured)
    shape = sum(b["input_ids"].numel() for b in measured)
    doc_lengths = torch.cat([b["input_lengths"] for b in measured])
    flops = float(packed_transformer_flops(module.model, config, doc_lengths))
    del module
    gc.collect()
    torch.cuda.empty_cache() if device.type == "cuda" else None
    return {"variant": variant, "step_ms": 1e3 * seconds / len(measured), "tokens": shape / len(measured),
            "real_share": real / shape, "real_tps": real / seconds, "mfu": flops / seconds / args.peak,
            "loss": times.losses[-1] if times.losses else math.nan}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_arguments(parser)
    parser.add_argument("--examples", type=int, default=8000)
    parser.add_argument("--sigma", type=float, default=0.29, help="log-normal sigma of the lengths")
    parser.add_argument("--padded-batch", type=int, default=40, help="examples per padded step (~16k tokens)")
    parser.add_argument("--pack-length", type=int, default=4096)
    parser.add_argument("--rows", type=int, default=4, help="packed rows per step")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--precision", default="bf16-true")
    parser.add_argument("--peak", type=float, default=H100_H200_BF16_PEAK, help="device peak FLOP/s")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tiny", action="store_true", help="CPU smoke test: a tiny model, fp32, eager")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    if args.tiny:
        args.hidden, args.layers, args.heads, args.kv_heads, args.intermediate, args.vocab = 64, 2, 4, 2, 128, 512
        args.examples, args.steps, args.warmup, args.precision, args.pack_length = 400, 2, 1, "32-true", 1024
        args.padded_batch, args.rows = 8, 2
    lengths = gsm8k_lengths(args.examples, args.sigma, args.seed)
    shares = {b: real_share(lengths, b, args.seed) for b in (8, 16, 32)}
    data = examples(lengths, args.vocab, args.seed)
    variants = [v for v in args.variants.split(",") if not (args.tiny and v == "packed-flex")]
    results = [run(variant, data, lengths, args, device) for variant in variants]
    base = next((r for r in results if r["variant"] == "padded"), None)
    rows = [[r["variant"], f"{r['tokens']:,.0f}", f"{100 * r['real_share']:.1f} %", f"{r['step_ms']:.1f}",
             f"{r['real_tps']:,.0f}", f"{r['real_tps'] / base['real_tps']:.2f}x" if base else "",
             f"{100 * r['mfu']:.1f} %", f"{r['loss']:.3f}"] for r in results]
    lines = [environment_line(),
             f"lengths: {len(lengths)} examples, {lengths.min()}-{lengths.max()} tokens, median {int(np.median(lengths))}; "
             "real share of random batches of 8/16/32: " + " / ".join(f"{100 * s:.0f} %" for s in shares.values()),
             f"model: hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}; {args.precision}, "
             f"{args.steps} measured steps after {args.warmup}",
             markdown_table(["variant", "tokens/step", "real", "step ms", "real tok/s", "gain", "MFU (real)", "loss"],
                            rows)]
    if base:
        lines.append(f"ideal gain (padded tokens / real tokens of the padded batches): {1 / base['real_share']:.2f}x")
    emit("\n".join(lines), args.out)


if __name__ == "__main__":
    main()
