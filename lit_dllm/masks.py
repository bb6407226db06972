"""Attention masks for block-diffusion Gemma (SPEC §5.1-5.3).

Keep-masks are bool (True = may attend). Additive masks hold 0 where kept and ``finfo(dtype).min``
where masked, never -inf. Every mask is built from broadcast comparisons on the input's device.

Block-diffusion layout: the decoder's queries are the canvas ``j in [0, R)``, the response of an
example whose prompt has ``P`` tokens (canvas ``j`` is absolute position ``P + j``); its keys are the
``enc_len`` clean encoder positions followed by the ``R`` canvas positions.
"""

from __future__ import annotations

from typing import Dict, Optional, Union

import torch
from torch import Tensor


def build_block_diffusion_training_mask(
    prefix: Union[int, Tensor],
    R: int,
    enc_len: int,
    block_size: int,
    *,
    sliding_window: Optional[int] = None,
    batch_size: Optional[int] = None,
    dtype: Optional[torch.dtype] = None,
) -> Tensor:
    """Block-causal mask ``[B, 1, R, enc_len + R]`` of SPEC §5.2.

    Canvas query ``j`` (block ``qb = j // block_size``) sees every prompt column, the clean response
    of strictly earlier blocks (never its own block's clean answer, never tail padding past ``R``)
    and its own canvas block, bidirectionally. With ``sliding_window=W`` its encoder columns are
    further limited to the last ``W - 1`` before its block starts (``c >= P + qb * block_size - W + 1``);
    that is what a sliding-window KV cache holds at inference.

    Args:
        prefix: prompt length ``P``, an int (then ``batch_size`` is required) or a ``[B]`` tensor.
        R: canvas (response) length.
        enc_len: encoder (clean sequence) length, at least ``max(P) + R``.
        block_size: canvas block size.
        sliding_window: ``W``, or None for the full-attention mask.
        dtype: None for a bool keep-mask, else an additive mask of this float dtype.
    """
    prefix = _prefix_tensor(prefix, batch_size)
    lengths = torch.full_like(prefix, R)
    _check(prefix, lengths, R, enc_len, block_size, sliding_window)
    keep = _keep(prefix, lengths, R, enc_len, block_size, sliding_window).unsqueeze(1)
    return keep if dtype is None else _additive(keep, dtype)


def block_diffusion_batch_mask(
    prefix: Tensor,
    lengths: Tensor,
    R: int,
    enc_len: int,
    block_size: int,
    *,
    sliding_window: Optional[int] = None,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """Additive ``[B, 1, R, enc_len + R]`` training mask for per-example response lengths (SPEC §5.3 step 4).

    Rows ``j < R_b`` of example ``b`` equal :func:`build_block_diffusion_training_mask` with
    ``(P_b, R_b)`` (so canvas columns ``k >= R_b`` are hidden from them); pad rows ``j >= R_b`` see
    only their own canvas diagonal ``(j, enc_len + j)``, so no row is fully masked.

    Args:
        prefix: ``[B]`` prompt lengths ``P_b``.
        lengths: ``[B]`` response lengths ``R_b`` (0 allowed), with ``P_b + R_b <= enc_len``.
        R: canvas width, at least ``max(R_b)``.
    """
    prefix = _prefix_tensor(prefix, None)
    if not isinstance(lengths, Tensor) or lengths.shape != prefix.shape:
        got = tuple(lengths.shape) if isinstance(lengths, Tensor) else type(lengths).__name__
        raise ValueError(f"lengths must be a [B] tensor like prefix {tuple(prefix.shape)}, got {got}.")
    lengths = lengths.to(device=prefix.device, dtype=torch.long)
    if ((lengths < 0) | (lengths > R)).any():
        raise ValueError(f"lengths must lie in [0, R={R}], got {lengths.tolist()}; pass R >= max(lengths).")
    _check(prefix, lengths, R, enc_len, block_size, sliding_window)
    keep = _keep(prefix, lengths, R, enc_len, block_size, sliding_window)
    column = torch.arange(enc_len + R, device=prefix.device)
    canvas_diagonal = column == enc_len + torch.arange(R, device=prefix.device).view(R, 1)
    return _additive((keep | canvas_diagonal).unsqueeze(1), dtype)


def encoder_attention_masks(
    attention_mask: Tensor, sliding_window: Optional[int], dtype: torch.dtype = torch.float32
) -> Dict[str, Tensor]:
    """Additive ``[B, 1, S, S]`` causal masks for the encode pass (SPEC §5.1), by layer type.

    ``full_attention`` keeps ``k <= q``; ``sliding_attention`` also needs ``q - k < sliding_window``
    (None: same as full). Padded keys (``attention_mask == 0``) are hidden; every diagonal ``(q, q)``
    is kept so padded query rows are never fully masked.
    """
    if attention_mask.dim() != 2:
        raise ValueError(f"attention_mask must be [B, S], got shape {tuple(attention_mask.shape)}.")
    _check_window(sliding_window)
    S, device = attention_mask.shape[1], attention_mask.device
    q = torch.arange(S, device=device).view(S, 1)
    k = torch.arange(S, device=device).view(1, S)
    full = (k <= q) & attention_mask.bool()[:, None, None, :]
    sliding = full if sliding_window is None else full & (q - k < sliding_window)
    diagonal = q == k
    return {
        "full_attention": _additive(full | diagonal, dtype),
        "sliding_attention": _additive(sliding | diagonal, dtype),
    }


# --- helpers ---------------------------------------------------------------------------------------


def _keep(
    prefix: Tensor, lengths: Tensor, R: int, enc_len: int, block_size: int, sliding_window: Optional[int]
) -> Tensor:
    """Bool ``[B, R, enc_len + R]``: rows ``j < R_b`` follow §5.2 with ``R_b`` as R; other rows keep nothing."""
    device = prefix.device
    P, R_b = prefix.view(-1, 1, 1), lengths.view(-1, 1, 1)
    j = torch.arange(R, device=device).view(1, R, 1)  # canvas query
    qb = j // block_size
    rel = torch.arange(enc_len, device=device).view(1, 1, enc_len) - P  # encoder column minus prompt
    # Prompt (rel < 0), or clean response of a strictly earlier block that is not tail padding
    # (the strict block rule already implies rel < R_b; the spec states it, so it is kept explicit).
    encoder = (rel < 0) | ((rel // block_size < qb) & (rel < R_b))
    if sliding_window is not None:
        encoder = encoder & (rel >= qb * block_size - sliding_window + 1)
    k = torch.arange(R, device=device).view(1, 1, R)  # canvas key
    canvas = (k // block_size == qb) & (k < R_b)
    return torch.cat([encoder, canvas], dim=-1) & (j < R_b)


def _prefix_tensor(prefix: Union[int, Tensor], batch_size: Optional[int]) -> Tensor:
    if isinstance(prefix, Tensor):
        if prefix.dim() != 1 or prefix.dtype.is_floating_point or prefix.dtype.is_complex or prefix.dtype == torch.bool:
            raise ValueError(
                f"prefix must be an int or a 1-D [B] integer tensor, got shape {tuple(prefix.shape)} "
                f"({prefix.dtype}); pass one prompt length per example."
            )
        if batch_size is not None and batch_size != prefix.numel():
            raise ValueError(
                f"batch_size={batch_size} disagrees with the {prefix.numel()} prefix lengths; "
                "drop batch_size or pass one prefix length per example."
            )
        return prefix.long()
    if batch_size is None:
        raise ValueError(f"prefix={prefix} is an int, so batch_size is required; pass batch_size=B.")
    return torch.full((batch_size,), int(prefix), dtype=torch.long)


def _check(
    prefix: Tensor, lengths: Tensor, R: int, enc_len: int, block_size: int, sliding_window: Optional[int]
) -> None:
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}.")
    if R <= 0:
        raise ValueError(f"R (canvas length) must be positive, got {R}.")
    _check_window(sliding_window)
    if (prefix < 0).any():
        raise ValueError(f"prefix lengths must be >= 0, got {prefix.tolist()}.")
    end = prefix + lengths
    if (end > enc_len).any():
        raise ValueError(
            f"prefix + response length {end.tolist()} exceeds enc_len={enc_len}; "
            f"pass enc_len >= {end.max().item()} (the encoder must hold prompt and response)."
        )


def _check_window(sliding_window: Optional[int]) -> None:
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1 or None (full attention), got {sliding_window}.")


def _additive(keep: Tensor, dtype: torch.dtype) -> Tensor:
    if not dtype.is_floating_point:
        raise ValueError(f"an additive mask needs a float dtype, got {dtype}; pass dtype=None for a bool mask.")
    mask = torch.zeros(keep.shape, dtype=dtype, device=keep.device)
    return mask.masked_fill_(~keep, torch.finfo(dtype).min)
