"""What every attention mask of the families is built with (their own rules live in ``families/<f>/masks.py``).

Keep-masks are bool (True = may attend). Additive masks hold 0 where kept and ``finfo(dtype).min`` where masked,
never -inf (:func:`additive_mask`). FlexAttention block masks of the same rules come from
:func:`build_block_mask`.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Callable, Optional

import torch
from torch import Tensor

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask

COMPILED_ON = ("cuda",)
"""Device types whose block masks :func:`build_block_mask` builds compiled."""
RECOMPILE_LIMIT = 32
"""Graphs the compiled build may keep (all mask kinds together)."""


def build_block_mask(mask_mod: Callable[..., Tensor], batch: int | None, q_len: int, kv_len: int,
                     device: torch.device) -> BlockMask:
    """FlexAttention's ``create_block_mask`` for all heads (and every example where ``batch`` is None), compiled on
    CUDA: run eagerly it evaluates ``mask_mod`` over every (example, query, key) through ``vmap``, launching many small
    kernels a mask from the host, which leaves the GPU idle (docs/benchmarks/gemma_moe.md). Eager elsewhere (on the
    CPU the compiled build would cost minutes of C++ compilation)."""
    from torch.nn.attention.flex_attention import create_block_mask as build

    if torch.device(device).type not in COMPILED_ON:
        return build(mask_mod, batch, None, q_len, kv_len, device=device)
    # every mask kind (the encoder's full and sliding, the decoder's, DFlash's) shares create_block_mask's graph cache,
    # and each takes up to three graphs as batches change shape (its first shapes, then dynamic ones): past the
    # default limit of 8 a kind would fall back to the slow eager build
    with torch.compiler.config.patch(recompile_limit=RECOMPILE_LIMIT):
        return _compiled(build)(mask_mod, batch, None, q_len, kv_len, device=device)


@functools.cache
def _compiled(function):
    return torch.compile(function)


def check_sliding_window(sliding_window: Optional[int]) -> None:
    """A ValueError unless ``sliding_window`` is None (full attention) or at least 1."""
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1 or None (full attention), got {sliding_window}.")


def additive_mask(keep: Tensor, dtype: torch.dtype) -> Tensor:
    """The bool ``keep`` as an additive mask of the float ``dtype``: 0 where kept, ``finfo(dtype).min`` elsewhere."""
    if not dtype.is_floating_point:
        raise ValueError(f"an additive mask needs a float dtype, got {dtype}; pass dtype=None for a bool mask.")
    mask = torch.zeros(keep.shape, dtype=dtype, device=keep.device)
    return mask.masked_fill_(~keep, torch.finfo(dtype).min)


def document_mask(document_ids: Tensor, causal: bool, implementation: str, dtype: torch.dtype,
                  rows: slice | None = None) -> Tensor | BlockMask:
    """Attention within documents only, for packed rows (``document_ids`` ``[B, L]``, as
    :class:`~lit_dllm.data.packing.PackedCollator` numbers them; the row's padding, ``-1``, sees only padding):
    bidirectional, or ``causal`` within each document. A FlexAttention block mask for ``flex_attention`` (blocks of
    other documents are skipped), else an additive ``[B, 1, L, L]`` mask of ``dtype`` (eager, sdpa); ``rows``: only
    those query rows of it, ``[B, 1, len(rows), L]`` (a context-parallel shard's queries; not for flex)."""
    batch, length = document_ids.shape
    if implementation == "flex_attention":
        if rows is not None:
            raise ValueError("a FlexAttention block mask covers every query row: build it without rows.")

        def within_document(b, h, q, k):
            same = document_ids[b, q] == document_ids[b, k]
            return same & (k <= q) if causal else same

        return build_block_mask(within_document, batch, length, length, document_ids.device)
    rows = rows or slice(None)
    keep = document_ids[:, rows, None] == document_ids[:, None, :]
    if causal:
        columns = torch.arange(length, device=document_ids.device)
        keep &= columns[rows, None] >= columns[None, :]
    return additive_mask(keep[:, None], dtype)
