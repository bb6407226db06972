"""DFlash draft-training step benchmark: lit_dllm's Lightning ``DFlashModule`` vs a plain PyTorch loop.

Target: a Qwen3-8B-shaped causal LM (hidden 4096, 36 layers, 32 heads, 8 KV heads, head_dim 128, intermediate
12288, vocab 151936, untied head, RoPE θ 1e6) with random weights from its config, frozen, bf16. Draft: lit_dllm's
``draft_config`` shaped after it (5 layers of the target's width, ~1.05B parameters, features of target layers
1, 9, 17, 25, 33), block 16, 512 anchors per row, sequence 4096, batch 1. Variants, all in one process (memory
freed between), each on the same synthetic batches (``bench_mdlm_step.synthetic_batch``: random ids, a 10 %
unsupervised prompt) with the same keyed anchors:

* ``lightning``: ``DFlashModule`` (sdpa, dense DFlash mask, fused chunked LM head + CE) under a real
  ``lightning.Trainer(precision="bf16-mixed")``; step = ``on_train_batch_start`` -> ``on_train_batch_end``
  (anchors, target forward, draft forward, loss, backward, AdamW), iter = start -> next start.
* ``lightning-compile``: the same with ``compile=True`` (the strategy's ``Parallelism``: ``torch.compile`` of each
  target and draft layer, inductor; ``aot_eager`` on a CPU); every other Lightning row runs ``compile=False`` (the
  default compiles on CUDA). Each Lightning row runs under ``lit_dllm.SingleDeviceStrategy`` with these settings.
* ``lightning-bf16-true``: the same with ``precision="bf16-true"`` (draft weights and AdamW states in bf16).
* ``lightning-flex``: ``attn_implementation="flex_attention"`` (a block-sparse ``BlockMask``), bf16-mixed.
* ``lightning-compile-flex``: both (the compiled layers take static shapes under flex, as ``apply_compile`` says).
* ``lightning-compile-fp8-<recipe>`` and ``lightning-compile-flex-fp8-<recipe>`` (not in the default list: torchao and
  a GPU of compute capability >= 8.9), recipe one of ``lit_dllm.fp8.RECIPES``: with ``fp8=<recipe>`` (torchao's float8
  linears in the draft's layers; the frozen target keeps bf16). Their MFU is over the bf16 peak: bf16-equivalent.
* ``plain``: the step written as a user would, without ``DFlashDraft``: the target's ``model(...,
  output_hidden_states=True)`` under ``no_grad``, the same anchors and blocks (``lit_dllm.families.dflash.blocks``), the
  draft (``MuseGlimmerAssistantModel``) with the dense sdpa mask, the target's LM head on every draft output,
  ``F.cross_entropy`` weighted by the decay ``exp(-(k-1)/7)``, backward, AdamW; fp32 draft weights under bf16
  autocast. Inputs pre-placed on the device; step = the whole iteration.

Every variant uses AdamW (betas 0.9/0.95, weight decay 0.01 on matrices; the plain loop has no LR schedule).

Model FLOPs per step (``B`` rows of ``S`` tokens, ``N`` blocks of ``bs``, ``Q = B·N·bs`` block tokens, ``T`` scored
targets, ``d = heads·head_dim``):

    target forward        2·N_t·B·S + 2·L_t·B·S²·d        (causal attention: half of 4·B·S²·d per layer)
    draft fwd + bwd       6·(N_d - N_fc)·Q + 6·(N_fc + L_d·N_kv)·B·S + 12·L_d·P·d
    LM head fwd + bwd     4·H·V·T                         (frozen head: no weight gradient)

``N_t``: target parameters without embedding and head; ``N_d``: draft parameters; ``N_fc``: its feature projection
(``n·H -> H``, run on the ``B·S`` context tokens, as are each layer's K/V projections, ``N_kv`` per layer). ``P``: the
(query, key) pairs the DFlash mask attends, ``bs · Σ (a + bs)`` over the kept blocks of anchor ``a`` (each block's
queries see the context before its anchor and their own block), as the target's causal attention counts only its
attended half. "MFU %" = F / step / peak, peak = 989e12 (bf16 dense, H100 SXM / H200 datasheet) for an H100 or H200,
else ``--peak-tflops``. "MFU % dense" counts the draft's attention over all ``S + N·bs`` keys of every query
(``P = Q·(S + N·bs)``: what sdpa's dense mask computes, and how the tables before 2026-11-28 counted); the flex
variants skip the masked tiles, so only the first column compares them with the dense-mask rows.
tokens/s counts the ``B·S`` context tokens per step; block tok/s the ``Q`` block tokens.

Usage::

    python bench/bench_dflash_step.py --out results/dflash_step.md     # GPU, Qwen3-8B-shaped target
    python bench/bench_dflash_step.py --tiny                           # CPU smoke test (< 1 min)
    python bench/bench_dflash_step.py --variants lightning-compile,lightning-compile-fp8-rowwise  # GPU, torchao
"""

from __future__ import annotations

import argparse
import os
import time
import traceback
import warnings

from _common import FP8_MFU_NOTE, FP8_VARIANTS, emit, environment_line, fit_timed, loop_timed, markdown_table, split_fp8
from bench_mdlm_step import (
    H100_H200_BF16_PEAK,
    SyntheticBatches,
    free_memory,
    human,
    memory_stats,
    summarise,
    synthetic_batch,
)

import torch
import torch.nn.functional as F

import lit_dllm.parallel
from lit_dllm.noise.keys import example_keys
from lit_dllm.families.dflash.masks import create_dflash_attention_mask
from lit_dllm.families.dflash.blocks import anchor_candidates, build_blocks, default_loss_gamma, sample_anchors
from lit_dllm.families.dflash.model import default_target_layer_ids, draft_config
from lit_dllm.hub.hf import load_causal_lm

ALL_VARIANTS = ("lightning", "lightning-compile", "lightning-bf16-true", "lightning-flex", "lightning-compile-flex",
                "plain")
FP8_DFLASH_VARIANTS = FP8_VARIANTS + tuple(v.replace("-fp8-", "-flex-fp8-") for v in FP8_VARIANTS)
SEED = 42
LR, BETAS, WEIGHT_DECAY = 3e-4, (0.9, 0.95), 0.01


def target_config(args) -> dict:
    return {
        "model_type": "qwen3", "hidden_size": args.hidden, "num_hidden_layers": args.layers,
        "num_attention_heads": args.heads, "num_key_value_heads": args.kv_heads, "head_dim": args.head_dim,
        "intermediate_size": args.intermediate, "vocab_size": args.vocab, "rope_theta": 1e6,
        "tie_word_embeddings": False, "max_position_embeddings": max(args.seq, 4096), "pad_token_id": 0,
    }


def draft_overrides(args) -> dict:
    return {"num_hidden_layers": args.draft_layers}


def build_models(args, device: torch.device):
    """The frozen target and a fresh draft, built as ``DFlashModule.build_model`` builds them (same seeds, so the
    plain loop starts from the Lightning run's weights)."""
    from transformers import MuseGlimmerAssistantModel

    dtype = "bfloat16" if args.precision != "32" else None
    with torch.device(device):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(SEED)
            target = load_causal_lm(None, target_config(args), torch_dtype=dtype, attn_implementation="sdpa")
        layer_ids = default_target_layer_ids(args.layers, args.draft_layers)
        config = draft_config(target, block_size=args.block, mask_token_id=args.vocab - 1,
                              target_layer_ids=layer_ids, overrides=draft_overrides(args))
        draft = MuseGlimmerAssistantModel._from_config(config, attn_implementation="sdpa")
    return target.requires_grad_(False).eval(), draft


def step_flops(args, target, draft, scored: int, pairs: int) -> float:
    """Model FLOPs of one step (module docstring) with ``pairs`` attended (query, key) pairs in each draft layer;
    ``target`` and ``draft`` may live on the meta device."""
    d = args.heads * args.head_dim
    embed, head = target.get_input_embeddings().weight, target.get_output_embeddings().weight
    n_target = sum(p.numel() for p in target.parameters()) - embed.numel() - head.numel()
    n_draft = sum(p.numel() for p in draft.parameters())
    n_fc = draft.encoder.fc.weight.numel()
    n_kv = sum(p.numel() for n, p in draft.layers[0].named_parameters() if n.split(".")[-2] in ("k_proj", "v_proj"))
    context, blocks = args.batch * args.seq, args.batch * args.anchors * args.block
    target_f = 2 * n_target * context + 2 * args.layers * args.batch * args.seq**2 * d
    draft_f = (6 * (n_draft - n_fc) * blocks + 6 * (n_fc + args.draft_layers * n_kv) * context
               + 12 * args.draft_layers * pairs * d)
    return target_f + draft_f + 4 * args.hidden * args.vocab * scored


def first_batch_counts(args) -> tuple[int, int]:
    """Scored targets and attended (query, key) pairs of the first batch (every batch has the same layout)."""
    built = make_blocks(args, synthetic_batch(0, args.batch, args.seq, args.vocab))
    anchors, keep, _ = built.blocks
    return int(built.scored.sum()), args.block * int((anchors * keep + args.block).sum())


def make_blocks(args, batch: dict):
    """The keyed anchors and blocks of ``batch``, as ``DFlashModule.prepare_batch`` draws them."""
    scored = batch["loss_mask"].bool()
    keys = example_keys(SEED, batch["example_index"], 0)
    blocks = sample_anchors(anchor_candidates(scored, args.block), keys, args.anchors, args.block)
    return build_blocks(batch["input_ids"], scored, blocks, args.block, args.vocab - 1,
                        default_loss_gamma(args.block))


# ------------------------------------------------------------------------------------------------ Lightning
def run_lightning(args, device: torch.device, precision: str, attention: str, compile: bool = False,
                  fp8: str | None = None) -> dict:
    from lit_dllm import CausalBackbone, Optimization, Parallelism, SingleDeviceStrategy
    from lit_dllm.families.dflash.module import DFlashGeneration, DFlashModule

    torch.manual_seed(SEED)
    module = DFlashModule(
        vocab_size=args.vocab, mask_token_id=args.vocab - 1, pad_token_id=0,
        target=CausalBackbone(model_config=target_config(args), torch_dtype="bfloat16" if precision != "32" else None),
        draft_config=draft_overrides(args), block_size=args.block, num_anchors=args.anchors,
        attn_implementation=attention, generation=DFlashGeneration(val_generate_batches=0), noise_seed=SEED,
        optimization=Optimization(lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY),
    )
    free_memory(device)
    strategy = SingleDeviceStrategy(parallelism=Parallelism(compile=compile, fp8=fp8))
    times = fit_timed(module, SyntheticBatches(args.warmup + args.steps, args.batch, args.seq, args.vocab), device,
                      precision, strategy=strategy)
    result = summarise(times.steps[args.warmup:], times.iters[args.warmup:], times.losses)
    dtype = str(next(module.model.draft.parameters()).dtype).removeprefix("torch.")
    result.update(memory_stats(device), wall=times.wall, param_dtype=dtype)
    del module
    return result


# ------------------------------------------------------------------------------------------------ plain loop
def run_plain(args, device: torch.device) -> dict:
    from lit_dllm.core.optim import decay_param_groups

    free_memory(device)
    build_start = time.perf_counter()
    torch.manual_seed(SEED)
    target, draft = build_models(args, device)
    draft.train()
    layer_ids = list(draft.config.target_layer_ids)
    optimizer = torch.optim.AdamW(decay_param_groups(draft, WEIGHT_DECAY), lr=LR, betas=BETAS)
    batches = [{k: v.to(device) for k, v in synthetic_batch(i, args.batch, args.seq, args.vocab).items()}
               for i in range(args.warmup + args.steps)]
    build = time.perf_counter() - build_start
    mixed = args.precision == "bf16-mixed"
    rows, length, bs = args.batch, args.seq, args.block

    def loss_of(batch: dict) -> torch.Tensor:
        ids = batch["input_ids"]
        built = make_blocks(args, batch)
        with torch.no_grad():
            states = target.model(input_ids=ids, output_hidden_states=True).hidden_states
            context = torch.cat([states[i + 1] for i in layer_ids], dim=-1)
        mask = create_dflash_attention_mask(built.blocks.anchors, built.blocks.keep, length, bs)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=mixed):
            noise = target.model.embed_tokens(built.block_ids)
            hidden = draft(noise_embeds=noise, context_hidden_states=context, attention_mask={"full_attention": mask},
                           position_ids=built.positions).last_hidden_state
            logits = target.lm_head(hidden.view(rows, -1, bs, hidden.shape[-1])[:, :, 1:])  # offsets 1..bs-1
        nll = F.cross_entropy(logits.flatten(0, 2).float(), built.targets.flatten(), reduction="none")
        return (nll * built.weights.flatten()).sum() / built.weights.sum()

    times = loop_timed(loss_of, batches, device, optimizer)
    result = summarise(times.steps[args.warmup:], None, times.losses)
    dtype = str(next(draft.parameters()).dtype).removeprefix("torch.")
    result.update(memory_stats(device), wall=times.wall + build, param_dtype=dtype)
    del target, draft, optimizer, batches
    return result


# ------------------------------------------------------------------------------------------------ main
def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, default in (("hidden", 4096), ("layers", 36), ("heads", 32), ("kv-heads", 8), ("head-dim", 128),
                          ("intermediate", 12288), ("vocab", 151936), ("draft-layers", 5), ("block", 16),
                          ("anchors", 512), ("seq", 4096), ("batch", 1), ("steps", 6), ("warmup", 2)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--variants", default=None,
                        help=f"comma list of {ALL_VARIANTS + FP8_DFLASH_VARIANTS} (default: all but fp8 on a GPU, all "
                             "but fp8 and flex on the CPU)")
    parser.add_argument("--peak-tflops", type=float, default=None, help="override the bf16 peak used for MFU")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke preset: a 4-layer 64-wide target, fp32")
    parser.add_argument("--out", default=None, help="also write the markdown table to this file")
    args = parser.parse_args()
    if args.tiny:
        args.hidden, args.layers, args.heads, args.kv_heads, args.head_dim = 64, 4, 4, 2, 16
        args.intermediate, args.vocab, args.draft_layers, args.block, args.anchors = 128, 512, 2, 4, 8
        args.seq, args.batch, args.steps, args.warmup = 64, 2, 3, 1
    args.device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    args.precision = "bf16-mixed" if args.device.type == "cuda" else "32"
    gpu = args.device.type == "cuda"
    args.variants = args.variants.split(",") if args.variants else [v for v in ALL_VARIANTS if gpu or "flex" not in v]
    unknown = set(args.variants) - set(ALL_VARIANTS + FP8_DFLASH_VARIANTS)
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}; choose from {ALL_VARIANTS + FP8_DFLASH_VARIANTS}")
    return args


def run_variant(args, variant: str) -> dict:
    lit_dllm.parallel.COMPILE_BACKEND = "inductor" if args.device.type == "cuda" else "aot_eager"  # no C++ build
    device = args.device
    try:
        if variant == "plain":
            return run_plain(args, device)
        base, fp8 = split_fp8(variant)
        precision = "bf16-true" if base == "lightning-bf16-true" else args.precision
        attention = "flex_attention" if base.endswith("-flex") else "sdpa"
        compile = base.startswith("lightning-compile")
        return run_lightning(args, device, precision, attention, compile=compile, fp8=fp8)
    except torch.cuda.OutOfMemoryError as err:
        return {"error": f"OOM: {' '.join(str(err).split())[:160]}", **memory_stats(device)}
    except Exception as err:
        traceback.print_exc()
        return {"error": f"{type(err).__name__}: {' '.join(str(err).split())[:200]}"}


def main() -> None:
    args = parse_args()
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    device = args.device
    env = environment_line()
    card = torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu"
    if args.peak_tflops:
        peak = args.peak_tflops * 1e12
    else:
        peak = H100_H200_BF16_PEAK if "H100" in card or "H200" in card else None
    peak_note = f"{peak / 1e12:g} TFLOP/s" if peak else "unknown (pass --peak-tflops)"
    if peak and set(args.variants) & set(FP8_DFLASH_VARIANTS):
        peak_note += f" ({FP8_MFU_NOTE})"
    print(env, f"\nMFU peak: {peak_note}", flush=True)
    with torch.device("meta"):
        target, draft = build_models(args, torch.device("meta"))
    scored, pairs = first_batch_counts(args)
    flops = step_flops(args, target, draft, scored, pairs)
    dense_pairs = args.batch * args.anchors * args.block * (args.seq + args.anchors * args.block)
    dense_flops = step_flops(args, target, draft, scored, dense_pairs)
    n_target, n_draft = sum(p.numel() for p in target.parameters()), sum(p.numel() for p in draft.parameters())
    del target, draft
    context, block_tokens = args.batch * args.seq, args.batch * args.anchors * args.block
    shape = (f"target Qwen3-shaped {human(n_target)} (hidden {args.hidden}, {args.layers} layers, {args.heads}/"
             f"{args.kv_heads} heads x {args.head_dim}, intermediate {args.intermediate}, vocab {args.vocab}), frozen; "
             f"draft {human(n_draft)} ({args.draft_layers} layers); batch {args.batch} x seq {args.seq}, "
             f"{args.anchors} anchors x block {args.block} = {block_tokens} block tokens, {scored} scored targets, "
             f"{pairs} attended pairs per draft layer; FLOPs/step {flops:.4g} ({dense_flops:.4g} counting the draft's "
             "attention dense)")
    print(shape, flush=True)

    results, start = {}, time.perf_counter()
    for variant in args.variants:
        print(f"=== {variant} ===", flush=True)
        res = results[variant] = run_variant(args, variant)
        free_memory(device)
        if "error" in res:
            print(f"{variant}: {res['error']}", flush=True)
        else:
            print(f"{variant}: step {res['step'] * 1e3:.1f} ms (min {res['step_min'] * 1e3:.1f}, max "
                  f"{res['step_max'] * 1e3:.1f}), loss {res['loss_first']:.4f} -> {res['loss_last']:.4f}, "
                  f"wall {res['wall']:.1f} s", flush=True)

    header = ["variant", "card", "draft params", "step ms", "iter ms", "tokens/s", "block tok/s", "MFU %",
              "MFU % dense", "peak GiB alloc", "peak GiB reserved", "loss first→last"]
    rows = []
    for variant, res in results.items():
        gib = {k: f"{res[k] / 2**30:.1f}" if k in res else "-" for k in ("peak_alloc", "peak_reserved")}
        if "error" in res:
            rows.append([variant, card, "-", res["error"], "-", "-", "-", "-", "-", gib["peak_alloc"], "-", "-"])
            continue
        step = res["step"]
        rows.append([
            variant, card, res["param_dtype"], f"{step * 1e3:.1f}", f"{res['iter'] * 1e3:.1f}" if res["iter"] else "-",
            f"{context / step:,.0f}", f"{block_tokens / step:,.0f}",
            *(f"{100 * f / step / peak:.1f}" if peak else "-" for f in (flops, dense_flops)),
            gib["peak_alloc"], gib["peak_reserved"], f"{res['loss_first']:.4f}→{res['loss_last']:.4f}",
        ])
    text = "\n".join([
        "# DFlash draft-training step benchmark", "", env, shape, f"MFU peak: {peak_note}.",
        f"{args.warmup} warm-up + {args.steps} measured steps per variant, medians; Lightning step = "
        f"on_train_batch_start→end, iter = start→next start; plain = the whole iteration. Total "
        f"{time.perf_counter() - start:.0f} s.", "", markdown_table(header, rows),
    ])
    print()
    emit(text, args.out)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
