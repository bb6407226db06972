"""The DFlash draft's attention mask (docs/DESIGN.md §10.4), dense and as a FlexAttention ``BlockMask``, with the
conventions of :mod:`lit_dllm.attention`.

Layout: the draft's queries are ``N`` noise blocks of ``block_size`` rows (row ``n * bs + o`` is offset ``o`` of block
``n``, at absolute position ``a_n + o``); its keys are the ``ctx_len`` target-feature context positions followed by the
same ``N * bs`` noise positions. In packed rows (``document_ids``) a block sees only the context of its anchor's
document.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Tuple, Union

import torch
from torch import Tensor

from lit_dllm.attention import additive_mask, build_block_mask, check_sliding_window

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask


def create_dflash_attention_mask(
    anchors: Tensor,
    keep: Tensor,
    ctx_len: int,
    block_size: int,
    *,
    causal: bool = False,
    sliding_window: Optional[int] = None,
    dtype: Optional[torch.dtype] = None,
    document_ids: Optional[Tensor] = None,
) -> Tensor:
    """Dense DFlash draft mask ``[B, 1, N * block_size, ctx_len + N * block_size]`` (docs/DESIGN.md §10.4).

    Query row ``n * bs + o`` (block ``n``, offset ``o``, anchor ``a = anchors[b, n]``) keeps

    * context column ``c`` iff ``c < a`` and ``keep[b, n]`` (and ``(a + o) - c < W`` with
      ``sliding_window=W``, and ``document_ids[b, c] == document_ids[b, a]`` in packed rows): only target
      features strictly before the anchor (in its document), never the anchor's own feature nor anything
      after it;
    * noise column ``ctx_len + n * bs + k`` of its own block only: every ``k``, or ``k <= o`` with
      ``causal=True``. Other blocks' noise is never visible, so overlapping blocks stay independent.

    A non-kept block sees only its own noise block, so no row is ever fully masked. ``N = 1`` is masked
    exactly like any other ``N`` (the reference passes no mask there and leaks context after the
    anchor, docs/DESIGN.md §14 (a)).

    Args:
        anchors: ``[B, N]`` integer anchor positions, each in ``[0, ctx_len)`` (non-kept ones too).
        keep: ``[B, N]`` bool, False for padding blocks.
        ctx_len: context length ``S`` (the number of target-feature positions).
        block_size: ``bs``, rows per block.
        causal: causal attention inside each noise block.
        sliding_window: ``W`` for sliding-window layers, or None for full attention.
        dtype: None for a bool keep-mask, else an additive mask of this float dtype.
        document_ids: packed rows' ``[B, ctx_len]`` document of each context position
            (:class:`~lit_dllm.data.packing.PackedCollator`'s), or None for rows of one example.
    """
    anchors, keep = _check_dflash(anchors, keep, ctx_len, block_size, sliding_window, document_ids)
    B, N = anchors.shape
    device = anchors.device
    b = torch.arange(B, device=device).view(B, 1, 1)
    q = torch.arange(N * block_size, device=device).view(1, -1, 1)
    kv = torch.arange(ctx_len + N * block_size, device=device).view(1, 1, -1)
    mask = _dflash_rule(anchors, keep, ctx_len, block_size, causal, sliding_window, document_ids, b, q, kv)
    mask = mask.unsqueeze(1)
    return mask if dtype is None else additive_mask(mask, dtype)


def create_dflash_block_mask(
    anchors: Tensor,
    keep: Tensor,
    ctx_len: int,
    block_size: int,
    *,
    causal: bool = False,
    sliding_window: Optional[int] = None,
    device: Optional[Union[str, torch.device]] = None,
    document_ids: Optional[Tensor] = None,
) -> BlockMask:
    """FlexAttention ``BlockMask`` of :func:`create_dflash_attention_mask` (same rule, same arguments).

    ``B = anchors.shape[0]``, one mask for all heads, ``Q_LEN = N * block_size``,
    ``KV_LEN = ctx_len + N * block_size``, default 128 tiles. ``device`` defaults to ``anchors.device``;
    ``anchors``, ``keep`` (and ``document_ids``) are moved there because the mask_mod reads them. Built by
    :func:`build_block_mask`.
    """
    anchors, keep = _check_dflash(anchors, keep, ctx_len, block_size, sliding_window, document_ids)
    device = anchors.device if device is None else torch.device(device)
    anchors, keep = anchors.to(device), keep.to(device)
    documents = None if document_ids is None else document_ids.to(device)
    B, N = anchors.shape

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return _dflash_rule(anchors, keep, ctx_len, block_size, causal, sliding_window, documents, b, q_idx, kv_idx)

    return build_block_mask(mask_mod, B, N * block_size, ctx_len + N * block_size, device)


def _dflash_rule(
    anchors: Tensor,
    keep: Tensor,
    ctx_len: int,
    block_size: int,
    causal: bool,
    sliding_window: Optional[int],
    document_ids: Optional[Tensor],
    b: Tensor,
    q: Tensor,
    kv: Tensor,
) -> Tensor:
    """The DFlash keep rule on broadcastable index tensors: the dense builder's grids or flex's scalars."""
    # Clamp keeps the gather in bounds should a kernel evaluate padded query rows; real rows are unchanged.
    n = torch.clamp(q // block_size, max=anchors.shape[1] - 1)  # query block
    o = q - n * block_size  # offset in the block
    a = anchors[b, n]
    context = (kv < ctx_len) & (kv < a) & keep[b, n]
    if sliding_window is not None:
        context = context & (a + o - kv < sliding_window)
    if document_ids is not None:  # packed rows: the anchor's document only (noise columns read a clamped index)
        context = context & (document_ids[b, kv.clamp(max=ctx_len - 1)] == document_ids[b, a])
    k = kv - ctx_len  # noise column; negative for context columns, whose block (k // bs <= -1) never matches
    noise = (k >= 0) & (k // block_size == n)
    if causal:
        noise = noise & (k - n * block_size <= o)
    return context | noise


def _check_dflash(
    anchors: Tensor,
    keep: Tensor,
    ctx_len: int,
    block_size: int,
    sliding_window: Optional[int],
    document_ids: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor]:
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}.")
    if ctx_len < 1:
        raise ValueError(f"ctx_len must be >= 1 (the target context length), got {ctx_len}.")
    check_sliding_window(sliding_window)
    if not isinstance(anchors, Tensor) or anchors.dim() != 2:
        got = tuple(anchors.shape) if isinstance(anchors, Tensor) else type(anchors).__name__
        raise ValueError(f"anchors must be a 2-D [B, N] tensor (one anchor per block), got {got}.")
    if anchors.dtype.is_floating_point or anchors.dtype.is_complex or anchors.dtype == torch.bool:
        raise ValueError(f"anchors must be an integer tensor, got {anchors.dtype}; pass anchors.long().")
    if not isinstance(keep, Tensor) or keep.shape != anchors.shape:
        got = tuple(keep.shape) if isinstance(keep, Tensor) else type(keep).__name__
        raise ValueError(f"keep must be a [B, N] tensor shaped like anchors {tuple(anchors.shape)}, got {got}.")
    if keep.dtype != torch.bool:
        raise ValueError(f"keep must be a bool tensor, got {keep.dtype}; pass keep.bool().")
    shape = (anchors.shape[0], ctx_len)
    if document_ids is not None and (document_ids.shape != shape or document_ids.is_floating_point()):
        raise ValueError(f"document_ids must be an integer [B, ctx_len] = {list(shape)} tensor (the packed rows' "
                         f"document of each context position), got {document_ids.dtype} {tuple(document_ids.shape)}.")
    if anchors.numel() == 0:
        raise ValueError(f"anchors must hold at least one block, got shape {tuple(anchors.shape)}.")
    bad = (anchors < 0) | (anchors >= ctx_len)
    if bad.any():
        raise ValueError(
            f"anchors must lie in [0, ctx_len={ctx_len}), got {anchors[bad].tolist()}; "
            "set non-kept anchors to 0 and pass the full context length."
        )
    return anchors.long(), keep.to(anchors.device)
