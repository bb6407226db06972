"""Fast-dLLM-style sampling: confidence-threshold parallel decoding and a block-wise approximate KV cache.

The canvas, blocks, schedule and EOS handling are those of :func:`~lit_dllm.families.mdlm.sampler.llada_generate`. Two
additions (Wu et al., 2025, "Fast-dLLM"):

* ``threshold``: besides its share of the LLaDA schedule, a step commits every masked position of the block whose
  chosen token has probability ``>= threshold``, so a block may finish in fewer steps (> 1: the LLaDA schedule only).
* ``cache``: the first step of a block runs the whole canvas and keeps every layer's keys / values; the block's
  later steps run only a window of columns against them. ``"prefix"`` keeps the columns before the block and runs
  the block and everything after it; ``"dual"`` also keeps the columns after the block and runs the block alone
  (with prompts of different lengths, "the block" spans every row's block: first start to last end).
  Cached entries are not refreshed while the block is decoded, so with more than one layer they are stale (the
  cached columns attended to the block's old tokens): approximate, and exact for a one-layer model.

Every pass, cached or not, is a call of the model given (``model(ids, cache=..., use_cache=True, position_ids=...)``
for the cached ones), never of a module inside it: under FSDP2 the root's hooks gather the parameters it holds
(embedding, final norm, LM head). With ``everywhere``, ranks that answer different prompts take every step together.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import DynamicCache

from lit_dllm.data.batch import cut_at_eos
from lit_dllm.families.mdlm.sampler import (
    _confidence, check_schedule, column_logits, keeps_columns, masked_canvas, transfer_schedule, transformers_model
)

CACHES = ("none", "prefix", "dual")
"""``none``: every step runs the whole canvas; ``prefix`` / ``dual``: see the module docstring."""


def block_start_pass(model: Callable, x: torch.Tensor, cols: torch.Tensor, keep: bool
                     ) -> tuple[torch.Tensor, DynamicCache]:
    """Logits ``[B, C, V]`` of the denoiser ``model`` over ``x`` at columns ``cols`` (see
    :func:`~lit_dllm.families.mdlm.sampler.column_logits`) and every layer's keys / values over all of ``x``."""
    cache = DynamicCache()
    return column_logits(model, x, cols, keep, cache=cache, use_cache=True), cache


def keep_outside(cache: DynamicCache, start: int, end: int) -> DynamicCache:
    """The cache without columns ``[start, end)`` (attention is order-free: each key already carries its position)."""
    for layer in cache.layers:
        layer.keys = torch.cat([layer.keys[:, :, :start], layer.keys[:, :, end:]], dim=2)
        layer.values = torch.cat([layer.values[:, :, :start], layer.values[:, :, end:]], dim=2)
    return cache


def window_pass(model: Callable, x: torch.Tensor, cache: DynamicCache, start: int, end: int, cols: torch.Tensor,
                keep: bool) -> torch.Tensor:
    """Logits ``[B, C, V]`` at columns ``cols`` (inside ``[start, end)``) of a pass over columns ``[start, end)`` of
    ``x`` attending to themselves and the cache; the cache is left as it was."""
    positions = torch.arange(start, end, device=x.device)[None]
    logits = column_logits(model, x[:, start:end], cols - start, keep, position_ids=positions, cache=cache,
                           use_cache=True)
    cache.crop(start - end)
    return logits


@torch.no_grad()
def fast_generate(
    model: Callable[[torch.Tensor], torch.Tensor],
    prompts: list[torch.Tensor],
    *,
    mask_token_id: int,
    pad_token_id: int,
    eos_token_id: int | None = None,
    gen_length: int = 64,
    steps: int = 64,
    block_length: int = 32,
    remasking: str = "low_confidence",
    temperature: float = 0.0,
    threshold: float = 0.9,
    cache: str = "none",
    generator: torch.Generator | None = None,
    everywhere: Callable[[bool], bool] = bool,
) -> list[torch.Tensor]:
    """:func:`~lit_dllm.families.mdlm.sampler.llada_generate` with threshold decoding and an optional KV cache.

    Args:
        model: ``[B, L]`` ids -> ``[B, L, V]`` logits of a bidirectional denoiser; a cache also needs ``model.hf``,
            the transformers model it runs, and ``model`` to pass ``cache``, ``use_cache`` and ``position_ids`` on
            to it (as :class:`~lit_dllm.families.mdlm.model.DiffusionLM` does, sharded or not). Or the
            bidirectional transformers model itself (an MDLM export: ``**hf.config.dllm_sampling``).
        threshold: each step also commits the masked positions of the block whose token probability is at least
            this (> 0; above 1: none, which reproduces ``llada_generate`` exactly with ``cache="none"``).
        cache: ``"none"``, ``"prefix"`` or ``"dual"`` (see the module docstring).
        Other arguments: see ``llada_generate``; ``steps`` is the most steps a block takes.
    """
    num_blocks = check_schedule(remasking, temperature, gen_length, block_length, steps)
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or threshold <= 0:
        raise ValueError(f"threshold={threshold!r} must be a number > 0 (above 1: the LLaDA schedule only).")
    if cache not in CACHES:
        raise ValueError(f"cache={cache!r}; use 'none', 'prefix' or 'dual'.")
    hf = transformers_model(model)
    if cache != "none" and hf is None:
        raise ValueError(f"cache={cache!r} needs model.hf, the transformers model the denoiser runs; use cache='none'.")
    if cache != "none" and set(getattr(hf.config, "layer_types", None) or []) - {"full_attention"}:
        raise ValueError(f"cache={cache!r} needs full-attention layers only (it drops columns); use cache='none'.")
    if not prompts:
        return []
    steps_per_block = steps // num_blocks
    x, rows, canvas = masked_canvas(prompts, gen_length, pad_token_id, mask_token_id)
    width = x.shape[1]
    done = torch.zeros(len(prompts), dtype=torch.bool, device=x.device)
    keep = keeps_columns(model)

    for block in range(num_blocks):
        cols = canvas[:, block * block_length : (block + 1) * block_length]
        if eos_token_id is not None and everywhere(bool(done.all())):
            x[rows, cols] = eos_token_id
            continue
        if eos_token_id is not None:
            x[rows, cols] = torch.where(done[:, None], torch.full_like(cols, eos_token_id), x[rows, cols])
        schedule = transfer_schedule((x[rows, cols] == mask_token_id).sum(1), steps_per_block)
        start = int(cols[:, 0].min())  # the window every row's block lies in
        end = int(cols[:, -1].max()) + 1 if cache == "dual" else width
        kv = None
        for step in range(steps_per_block):
            still_masked = x[rows, cols] == mask_token_id
            if everywhere(not still_masked.any()):
                break
            if cache == "none":
                logits = column_logits(model, x, cols, keep)
            elif kv is None:
                logits, kv = block_start_pass(model, x, cols, keep)
                kv = keep_outside(kv, start, end)
            else:
                logits = window_pass(model, x, kv, start, end, cols, keep)
            tokens, score = _confidence(logits, temperature, remasking, generator)
            # low_confidence's score already is the chosen token's probability: one softmax over the vocabulary
            probability = score if remasking == "low_confidence" else (
                torch.softmax(logits.float(), -1).gather(-1, tokens[..., None]).squeeze(-1))
            score = score.masked_fill(~still_masked, -torch.inf)
            rank = score.argsort(dim=1, descending=True).argsort(dim=1)
            commit = ((rank < schedule[:, step : step + 1]) | (probability >= threshold)) & still_masked
            x[rows, cols] = torch.where(commit, tokens, x[rows, cols])
        if eos_token_id is not None:
            done |= (x[rows, cols] == eos_token_id).any(1)

    return [cut_at_eos(answer, eos_token_id) for answer in x[rows, canvas]]
