"""Every family's training step against its own plain PyTorch loop: hybrid MDLM + AR, CausalLM, block-diffusion Gemma.

One table per family (``--family``), each from one process, memory freed between rows (``--variants``):

* ``plain``: the step written as a user would: the Hugging Face model's forward, the loss with torch ops on its
  full logits (``F.cross_entropy``), ``torch.autocast`` bf16 over fp32 weights, AdamW; inputs pre-placed on the
  device, step = the whole iteration. Run first, so a timeout still leaves the baseline.
* ``lightning-compile``: the family's module under a real ``lightning.Trainer(precision="bf16-mixed")`` and
  ``lit_dllm.SingleDeviceStrategy`` with ``compile=True`` (its ``Parallelism``: ``torch.compile`` of each transformer
  block, inductor; ``aot_eager`` with ``--tiny``).
* ``lightning``: the same with ``compile=False`` (eager).
* ``lightning-compile-fp8-tensorwise`` / ``-rowwise`` (not in the default list: torchao and a GPU of compute capability
  >= 8.9): ``lightning-compile`` with ``fp8=<recipe>`` (``lit_dllm.fp8``: torchao's float8 linears in the blocks).
  Their MFU is over the bf16 peak, the same model FLOPs: a bf16-equivalent MFU, comparable with the other rows.

Lightning rows are timed by ``_common.fit_timed``: step = ``on_train_batch_start`` -> ``on_train_batch_end``
(the module's batch preparation, forward, loss, backward, AdamW, Lightning hooks), iter = start -> next start (adds
the data loader and the host-to-device copy). AdamW everywhere: betas 0.9/0.95, weight decay 0.01 on matrices
(``decay_param_groups``, the modules' own groups); the plain loops have no LR schedule.

Families and shapes (random init, synthetic batches of ``bench_mdlm_step.synthetic_batch``: random ids, the first
10 % of each row an unsupervised prompt):

* ``hybrid``: ``HybridMDLMModule`` (uniform corruption, ``alpha=1``) on ``bench_mdlm_step``'s 1.24B Llama-3.2-1B
  shape (hidden 2048, 16 layers, 32/8 heads, intermediate 8192, vocab 128256, tied), batch **2** x 4096: a
  bidirectional pass over the noised row plus a causal pass over the clean one (two passes' activations: 4 rows
  do not fit an 80 GB card beside the plain loop's full logits). Plain: ``config.is_causal`` switched per pass
  (transformers then keeps SDPA's flash kernels for both; the module passes an additive causal mask instead).
* ``causal``: ``CausalLMModule`` on the same shape, causal, batch 4 x 4096; next-token loss where
  ``loss_mask[i+1]``.
* ``gemma``: ``BlockDiffusionGemmaModule`` on a random-init DiffusionGemma with the 26B-A4B checkpoint's layer shapes
  (hidden 2816, 16/8 heads of 256, full layers 512 with 2 KV heads, sliding window 1024, dense MLP 2112, expert
  width 704, top-8 routing, vocab 262144, canvas 256; ``bench_moe_step.GEMMA_26B_LAYER``) but 4 layers (3 sliding,
  1 full) and 16 experts instead of 128: 1.36B parameters, 1.17B active per token. Batch 2 x 2048: a 1024-token
  prompt then 4 canvases; a step encodes the row (with the encoder's next-token loss), denoises the canvases twice
  (self-conditioning, the first pass without grad) and scores one canvas per row. The plain loop prepares the
  batch with the module's ``prepare_batch`` (noise, canvas, masks, coins: the same inputs), then calls
  transformers' encoder and ``DiffusionGemmaForBlockDiffusion`` forward (its full soft-capped fp32 logits) twice and
  ``F.cross_entropy``. (4 x 2048 would put 50 GB of vocabulary-wide fp32 logits in the plain loop.)

Model FLOPs per step (forward + backward; MFU = F / step / peak, peak from ``lit_dllm.throughput.peak_flops``:
989.5 TFLOP/s bf16 dense for an H100 SXM or H200, or ``--peak-tflops``). ``lit_dllm.throughput.transformer_flops``
gives ``T(n) = B·n·(6·P + 3·A(n))`` for ``B`` rows of ``n`` tokens, ``P`` the matmul parameters (embedding excluded, the
tied LM head included; experts scaled by top-k / experts; frozen ones count 2 instead of 6) and ``A(n) = 4·layers·
heads·head_dim·n`` the forward attention per token (full, not halved for causal: the kernels with a mask compute it):

    hybrid   2·T(L)                                   HybridMDLMModule.training_flops (two passes)
    causal   T(L)                                     CausalLMModule.training_flops
    gemma    T(S) + T_R(S + R) + T_R(S + R) / 3       encoder over S; decoder over R canvas tokens, its attention
                                                      over S + R keys, fwd + bwd, plus its no-grad pass (1/3)

(Gemma: ``A`` summed over the layers, head_dim 256 in sliding and 512 in full ones; ``P`` counted in every pass,
the decoder-only self-conditioning projection in the encoder's too, so a slight overcount.) The LM head is counted at every
position, as the plain loops compute it; the modules apply it only at scored positions, so their MFU on this formula
is a throughput figure. tokens/s counts the ``B·L`` tokens of the rows.

Usage::

    python bench/bench_families.py --out $OUT/families.md                 # GPU: every family, every variant
    python bench/bench_families.py --family causal --variants plain,lightning-compile
    python bench/bench_families.py --tiny                                 # CPU smoke test (< 90 s on 2 cores)
    python bench/bench_families.py --variants lightning-compile,lightning-compile-fp8-tensorwise  # GPU, torchao
"""

from __future__ import annotations

import argparse
import copy
import os
import time
import traceback
import warnings
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Callable

from _common import FP8_MFU_NOTE, FP8_VARIANTS, emit, environment_line, fit_timed, loop_timed, markdown_table, split_fp8
from bench_mdlm_step import SEED, free_memory, human, llama_kwargs, memory_stats, summarise, synthetic_batch

import torch
import torch.nn.functional as F

import lit_dllm.parallel
from lit_dllm.core.optim import decay_param_groups
from lit_dllm.settings import Backbone, CausalBackbone, Generation, Optimization
from lit_dllm.noise.corruption import corrupt_uniform
from lit_dllm.noise.keys import example_keys
from lit_dllm.throughput import expert_share, matmul_params, peak_flops

FAMILIES = ("hybrid", "causal", "gemma")
VARIANTS = ("plain", "lightning-compile", "lightning")
LR, BETAS, WEIGHT_DECAY = 3e-4, (0.9, 0.95), 0.01
NO_GENERATION = Generation(val_generate_batches=0)
"""The modules generate nothing here: the step alone is timed."""
OPTIMIZATION = Optimization(lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY)
DEFAULT_SHAPES = {"hybrid": (2, 4096), "causal": (4, 4096), "gemma": (2, 2048)}  # (batch, seq)


# ------------------------------------------------------------------------------------------------ batches
class Batches(torch.utils.data.Dataset):
    """``count`` whole batches, ``make(i)`` each (the Trainer's loader yields them as they are)."""

    def __init__(self, count: int, make: Callable[[int], dict]):
        self.count, self.make = count, make

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> dict:
        return self.make(i)


def gemma_batch(args, step: int) -> dict:
    """``synthetic_batch`` with the prompt cut where ``args.canvases`` whole canvases of response fill the row."""
    batch = synthetic_batch(step, args.batch, args.seq, args.vocab)
    batch["loss_mask"][:, : args.seq - args.canvases * args.canvas] = 0
    batch["loss_mask"][:, args.seq - args.canvases * args.canvas :] = 1
    return batch


# ------------------------------------------------------------------------------------------------ families
@dataclass
class Family:
    """How one family builds its module, its batches and its plain step."""

    module: Callable  # (args) -> TokenLossModule
    batch: Callable  # (args, step) -> dict on the CPU
    plain: Callable  # (args, device) -> (model to optimise, step(batch) -> loss)
    flops: Callable  # (args, module with a built model, batch) -> model FLOPs of one step


def llama_config(args, causal: bool):
    from transformers import LlamaConfig

    config = LlamaConfig(**llama_kwargs(args))
    config.is_causal, config.use_cache = causal, False
    return config


def hybrid_module(args):
    from lit_dllm.families.mdlm.module import HybridMDLMModule

    return HybridMDLMModule(
        vocab_size=args.vocab, mask_token_id=args.vocab - 1,
        backbone=CausalBackbone(model_config={"model_type": "llama", **llama_kwargs(args)}), corruption="uniform",
        generation=NO_GENERATION, noise_seed=SEED, optimization=OPTIMIZATION,
    )


def causal_module(args):
    from lit_dllm.families.causal_lm.module import CausalLMModule

    return CausalLMModule(
        vocab_size=args.vocab, backbone=CausalBackbone(model_config={"model_type": "llama", **llama_kwargs(args)}),
        generation=NO_GENERATION, noise_seed=SEED, optimization=OPTIMIZATION,
    )


def gemma_module(args):
    from lit_dllm.families.diffusion_gemma.module import BlockDiffusionGemmaModule

    return BlockDiffusionGemmaModule(
        vocab_size=args.vocab, backbone=Backbone(model_config=gemma_config(args)), generation=NO_GENERATION,
        noise_seed=SEED, optimization=OPTIMIZATION,
    )


def gemma_config(args) -> dict:
    from bench_moe_step import model_config

    config = copy.deepcopy(model_config(SimpleNamespace(family="gemma", tiny=args.tiny, layers=args.gemma_layers)))
    if not args.tiny:
        config["text_config"].update(num_experts=args.experts)
    return config


def next_token_nll(logits: torch.Tensor, ids: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Mean NLL of ``ids[i+1]`` from ``logits[i]`` where ``loss_mask[i+1]`` (fp32)."""
    scored = loss_mask[:, 1:].bool()
    return F.cross_entropy(logits[:, :-1][scored].float(), ids[:, 1:][scored])


def hybrid_plain(args, device: torch.device):
    from transformers import AutoModelForCausalLM

    with torch.device(device):
        model = AutoModelForCausalLM.from_config(llama_config(args, causal=False), attn_implementation="sdpa")

    def step(batch: dict) -> torch.Tensor:
        ids, loss_mask = batch["input_ids"], batch["loss_mask"]
        keys = example_keys(SEED, batch["example_index"], 0)
        noisy, noise, p_mask = corrupt_uniform(ids, loss_mask, args.vocab - 1, 1e-3, keys=keys)
        noise &= loss_mask.bool()
        model.config.is_causal = False  # the diffusion pass: bidirectional
        logits = model(input_ids=noisy).logits
        nll = F.cross_entropy(logits[noise].float(), ids[noise], reduction="none")
        diffusion = (nll / p_mask[noise]).sum() / noise.sum().clamp_min(1)
        model.config.is_causal = True  # the AR pass over the clean row
        return diffusion + next_token_nll(model(input_ids=ids).logits, ids, loss_mask)

    return model, step


def causal_plain(args, device: torch.device):
    from transformers import AutoModelForCausalLM

    with torch.device(device):
        model = AutoModelForCausalLM.from_config(llama_config(args, causal=True), attn_implementation="sdpa")

    def step(batch: dict) -> torch.Tensor:
        ids = batch["input_ids"]
        return next_token_nll(model(input_ids=ids).logits, ids, batch["loss_mask"])

    return model, step


def gemma_plain(args, device: torch.device):
    from transformers import DynamicCache

    prep = gemma_module(args)  # only for prepare_batch (noise, canvas, masks, coins)
    with torch.device(device):
        prep.model = prep.build_model()  # freezes the vision tower and the router, as the module does
    hf, cap = prep.model.hf, prep.model.text_config.final_logit_softcapping

    def step(batch: dict) -> torch.Tensor:
        ids = batch["input_ids"]
        inputs = prep.prepare_batch(batch, example_keys(SEED, batch["example_index"], 0))
        positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
        encoded = hf.model.encoder(input_ids=ids, attention_mask=inputs["encoder_masks"], cache=DynamicCache(),
                                   position_ids=positions)
        decode = dict(cache=encoded.cache, decoder_input_ids=inputs["canvas_ids"],
                      decoder_attention_mask=inputs["decoder_masks"], decoder_position_ids=inputs["decoder_positions"])
        with torch.no_grad():
            first = hf(**decode).logits
        logits = hf(**decode, self_conditioning_logits=first, self_conditioning_mask=inputs["coins"]).logits
        scored = inputs["scored"]  # [B, K] at the canvas offsets loss_index
        logits = logits.take_along_dim(inputs["loss_index"][..., None], dim=1)
        diffusion = F.cross_entropy(logits[scored], inputs["targets"][scored])
        ar_logits = cap * torch.tanh(hf.lm_head(encoded.last_hidden_state).float() / cap)
        ar = inputs["ar_scored"]
        return diffusion + F.cross_entropy(ar_logits[ar], inputs["ar_targets"][ar])

    return prep.model, step


def module_flops(args, module, batch: dict) -> float:
    return module.training_flops(batch)


def gemma_flops(args, module, batch: dict) -> float:
    """Encoder over the row, decoder over the canvases (fwd + bwd) and its no-grad pass (module docstring). The
    attention is summed layer by layer: transformers' config refuses one ``head_dim`` when full layers differ."""
    text = gemma_config(args)["text_config"]
    wide = {"full_attention": text.get("global_head_dim", text["head_dim"])}
    width = sum(text["num_attention_heads"] * wide.get(kind, text["head_dim"]) for kind in text["layer_types"])
    trained, frozen = matmul_params(module.model, expert_share(module.model.text_config))
    rows, length = batch["input_ids"].shape
    canvas = args.canvases * args.canvas

    def passes(tokens: int, keys: int) -> float:  # forward + backward of `tokens` per row attending to `keys`
        return rows * tokens * (6 * trained + 2 * frozen + 3 * 4 * width * keys)

    return passes(length, length) + passes(canvas, length + canvas) * 4 / 3


FAMILY = {
    "hybrid": Family(hybrid_module, lambda args, i: synthetic_batch(i, args.batch, args.seq, args.vocab), hybrid_plain,
                     module_flops),
    "causal": Family(causal_module, lambda args, i: synthetic_batch(i, args.batch, args.seq, args.vocab), causal_plain,
                     module_flops),
    "gemma": Family(gemma_module, gemma_batch, gemma_plain, gemma_flops),
}


# ------------------------------------------------------------------------------------------------ rows
def run_lightning(args, family: Family, device: torch.device, compile: bool, fp8: str | None = None) -> dict:
    from lit_dllm import Parallelism, SingleDeviceStrategy

    torch.manual_seed(SEED)  # the plain loop's initial weights (configure_model builds the model inside fit)
    module = family.module(args)
    free_memory(device)
    strategy = SingleDeviceStrategy(parallelism=Parallelism(compile=compile, fp8=fp8))
    times = fit_timed(module, Batches(args.warmup + args.steps, lambda i: family.batch(args, i)), device,
                      args.precision, strategy=strategy)
    result = summarise(times.steps[args.warmup:], times.iters[args.warmup:], times.losses)
    result.update(memory_stats(device), wall=times.wall)
    del module
    return result


def run_plain(args, family: Family, device: torch.device) -> dict:
    free_memory(device)
    torch.manual_seed(SEED)
    model, step = family.plain(args, device)
    model.train()
    optimizer = torch.optim.AdamW(decay_param_groups(model, WEIGHT_DECAY), lr=LR, betas=BETAS)
    batches = [{k: v.to(device) for k, v in family.batch(args, i).items()} for i in range(args.warmup + args.steps)]
    mixed = args.precision == "bf16-mixed"

    def loss_of(batch: dict) -> torch.Tensor:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=mixed):
            return step(batch)

    times = loop_timed(loss_of, batches, device, optimizer)
    result = summarise(times.steps[args.warmup:], None, times.losses)
    result.update(memory_stats(device), wall=times.wall)
    del model, step, optimizer, batches
    return result


def run_variant(args, family: Family, variant: str, device: torch.device) -> dict:
    try:
        if variant == "plain":
            return run_plain(args, family, device)
        base, fp8 = split_fp8(variant)
        return run_lightning(args, family, device, compile=base == "lightning-compile", fp8=fp8)
    except torch.cuda.OutOfMemoryError as err:
        return {"error": f"OOM: {' '.join(str(err).split())[:160]}", **memory_stats(device)}
    except Exception as err:
        traceback.print_exc()
        return {"error": f"{type(err).__name__}: {' '.join(str(err).split())[:200]}"}


def describe(args, name: str, family: Family) -> tuple[str, float]:
    """A line on the model and batch, and the step's model FLOPs (the module built on the meta device)."""
    module = family.module(args)
    with torch.device("meta"):
        module.model = module.build_model()
    batch = family.batch(args, 0)
    flops = family.flops(args, module, batch)
    params = sum(p.numel() for p in module.model.parameters())
    config = module.model.hf.config.get_text_config()
    share = expert_share(config)
    experts = f", {config.num_experts} experts top-{config.top_k_experts}" if share < 1 else ""
    line = (f"{name}: {type(module).__name__}, {human(params)} parameters{experts}, hidden {config.hidden_size}, "
            f"{config.num_hidden_layers} layers, vocab {config.vocab_size}; batch {args.batch} x {args.seq}"
            + (f" ({args.seq - args.canvases * args.canvas}-token prompt + {args.canvases} canvases of {args.canvas})"
               if name == "gemma" else "") + f"; FLOPs/step {flops:.4g}")
    return line, flops


def family_table(args, name: str, device: torch.device, card: str, peak: float | None) -> str:
    family = FAMILY[name]
    line, flops = describe(args, name, family)
    print(line, flush=True)
    results, start = {}, time.perf_counter()
    for variant in args.variants:
        print(f"=== {name} / {variant} ===", flush=True)
        res = results[variant] = run_variant(args, family, variant, device)
        free_memory(device)
        if "error" in res:
            print(f"{variant}: {res['error']}", flush=True)
        else:
            print(f"{variant}: step {res['step'] * 1e3:.1f} ms, loss {res['loss_first']:.4f} -> {res['loss_last']:.4f}, "
                  f"wall {res['wall']:.1f} s", flush=True)
    tokens = args.batch * args.seq
    plain = results.get("plain", {}).get("step")
    header = ["variant", "card", "step ms", "iter ms", "tokens/s", "vs plain", "MFU %", "peak GiB alloc",
              "peak GiB reserved", "loss first→last"]
    rows = []
    for variant, res in results.items():
        gib = {k: f"{res[k] / 2**30:.1f}" if k in res else "-" for k in ("peak_alloc", "peak_reserved")}
        if "error" in res:
            rows.append([variant, card, res["error"], "-", "-", "-", "-", gib["peak_alloc"], "-", "-"])
            continue
        step = res["step"]
        rows.append([
            variant, card, f"{step * 1e3:.1f}", f"{res['iter'] * 1e3:.1f}" if res["iter"] else "-",
            f"{tokens / step:,.0f}", f"{plain / step:.2f}x" if plain else "-",
            f"{100 * flops / step / peak:.1f}" if peak else "-", gib["peak_alloc"], gib["peak_reserved"],
            f"{res['loss_first']:.4f}→{res['loss_last']:.4f}",
        ])
    return "\n".join([
        f"## {name}", "", line,
        f"{args.warmup} warm-up + {args.steps} measured steps per variant, medians; precision {args.precision}. "
        f"Total {time.perf_counter() - start:.0f} s.", "", markdown_table(header, rows), "",
    ])


# ------------------------------------------------------------------------------------------------ main
def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", default=",".join(FAMILIES), help=f"comma list of {FAMILIES}")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help=f"comma list of {VARIANTS + FP8_VARIANTS} (in run order; default: all but the fp8 ones)")
    parser.add_argument("--batch", type=int, default=None, help="rows per step (default per family: "
                        + ", ".join(f"{k} {b}" for k, (b, _) in DEFAULT_SHAPES.items()) + ")")
    parser.add_argument("--seq", type=int, default=None, help="tokens per row (default per family: "
                        + ", ".join(f"{k} {s}" for k, (_, s) in DEFAULT_SHAPES.items()) + ")")
    parser.add_argument("--steps", type=int, default=8, help="measured steps per variant")
    parser.add_argument("--warmup", type=int, default=3, help="warm-up steps per variant (compilation included)")
    parser.add_argument("--gemma-layers", type=int, default=4, help="Gemma: layers of the 26B shapes")
    parser.add_argument("--experts", type=int, default=16, help="Gemma: experts per layer (top-8 kept)")
    parser.add_argument("--canvases", type=int, default=4, help="Gemma: canvases of response per row")
    parser.add_argument("--peak-tflops", type=float, default=None, help="override the bf16 peak used for MFU")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke preset: tiny models, fp32, aot_eager compile")
    parser.add_argument("--out", default=None, help="also write the markdown tables to this file")
    args = parser.parse_args()
    args.families = [f for f in args.family.split(",") if f]
    args.variants = [v for v in args.variants.split(",") if v]
    known_variants = VARIANTS + FP8_VARIANTS
    for given, known, what in ((args.families, FAMILIES, "family"), (args.variants, known_variants, "variants")):
        if set(given) - set(known):
            parser.error(f"unknown {what} {sorted(set(given) - set(known))}; choose from {known}")
    args.device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    args.precision = "bf16-mixed" if args.device.type == "cuda" else "32"
    return args


def family_args(args, name: str) -> argparse.Namespace:
    """``args`` with the family's shapes: the 1.24B Llama (``bench_mdlm_step``'s defaults) or the Gemma layers."""
    shaped = argparse.Namespace(**vars(args))
    batch, seq = DEFAULT_SHAPES[name]
    shaped.batch, shaped.seq = args.batch or batch, args.seq or seq
    shaped.hidden, shaped.layers, shaped.heads, shaped.kv_heads = 2048, 16, 32, 8  # llama_kwargs reads these
    shaped.intermediate, shaped.untied, shaped.canvas = 8192, False, 256
    shaped.vocab = 262144 if name == "gemma" else 128256
    if args.tiny:
        shaped.hidden, shaped.layers, shaped.heads, shaped.kv_heads, shaped.intermediate = 64, 2, 4, 2, 256
        shaped.vocab, shaped.batch, shaped.seq, shaped.canvas = 512, 2, 64, 4
        shaped.steps, shaped.warmup = min(args.steps, 3), min(args.warmup, 1)
    return shaped


def main() -> None:
    args = parse_args()
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    lit_dllm.parallel.COMPILE_BACKEND = "inductor" if args.device.type == "cuda" else "aot_eager"  # no C++ build
    env = environment_line()
    card = torch.cuda.get_device_name(0) if args.device.type == "cuda" else "cpu"
    peak = args.peak_tflops * 1e12 if args.peak_tflops else peak_flops(args.device, args.precision)
    peak_note = f"{peak / 1e12:g} TFLOP/s" if peak else "unknown (MFU not reported; pass --peak-tflops)"
    if peak and set(args.variants) & set(FP8_VARIANTS):
        peak_note += f" ({FP8_MFU_NOTE})"
    print(env, f"\nMFU peak: {peak_note}", flush=True)
    tables = [f"# Every family's step against its plain loop\n\n{env}\nMFU peak: {peak_note} (card {card})\n"]
    for name in args.families:
        tables.append(family_table(family_args(args, name), name, args.device, card, peak))
        print(tables[-1], flush=True)
        if args.out:  # after each family, so a run cut short keeps the tables it finished
            emit("\n".join(tables), args.out, echo=False)


if __name__ == "__main__":
    main()
