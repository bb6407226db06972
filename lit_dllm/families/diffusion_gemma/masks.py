"""Block-diffusion Gemma's attention masks (docs/DESIGN.md §9.2), dense and as FlexAttention block masks, with
the conventions of :mod:`lit_dllm.attention`. Every mask is built from broadcast comparisons on the input's device.

Block-diffusion layout: the decoder's queries are the canvas ``j in [0, R)``, the response of an
example whose prompt has ``P`` tokens (canvas ``j`` is absolute position ``P + j``); its keys are the
``enc_len`` clean encoder positions followed by the ``R`` canvas positions.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Dict, Optional, Tuple, Union

import torch
from torch import Tensor

from lit_dllm.attention import additive_mask, build_block_mask, check_sliding_window

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask


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
    """Block-causal mask ``[B, 1, R, enc_len + R]`` of docs/DESIGN.md §9.2.

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
    return keep if dtype is None else additive_mask(keep, dtype)


def block_diffusion_batch_mask(
    prefix: Tensor,
    lengths: Tensor,
    R: int,
    enc_len: int,
    block_size: int,
    *,
    sliding_window: Optional[int] = None,
    dtype: torch.dtype = torch.float32,
    check_values: bool = True,
) -> Tensor:
    """Additive ``[B, 1, R, enc_len + R]`` training mask for per-example response lengths (docs/DESIGN.md §9.2).

    Rows ``j < R_b`` of example ``b`` equal :func:`build_block_diffusion_training_mask` with
    ``(P_b, R_b)`` (so canvas columns ``k >= R_b`` are hidden from them); pad rows ``j >= R_b`` see
    only their own canvas diagonal ``(j, enc_len + j)``, so no row is fully masked.

    Args:
        prefix: ``[B]`` prompt lengths ``P_b``.
        lengths: ``[B]`` response lengths ``R_b`` (0 allowed), with ``P_b + R_b <= enc_len``.
        R: canvas width, at least ``max(R_b)``.
        check_values: check the lengths' values (one device-to-host transfer on a GPU); False for a caller whose
            ``prefix`` and ``lengths`` are valid by construction, so the host does not wait for the device.
    """
    prefix, lengths = _batch_lengths(prefix, lengths, R, enc_len, block_size, sliding_window, check_values)
    keep = _keep(prefix, lengths, R, enc_len, block_size, sliding_window)
    return additive_mask(keep.unsqueeze(1), dtype)


def block_diffusion_block_mask(
    prefix: Tensor,
    lengths: Tensor,
    R: int,
    enc_len: int,
    block_size: int,
    *,
    sliding_window: Optional[int] = None,
    check_values: bool = True,
) -> BlockMask:
    """FlexAttention ``BlockMask`` of :func:`block_diffusion_batch_mask` (same rule, same arguments; ``B`` masks, one
    for all heads, 128 tiles, on ``prefix``'s device; built by :func:`build_block_mask`)."""
    prefix, lengths = _batch_lengths(prefix, lengths, R, enc_len, block_size, sliding_window, check_values)
    # the rule's sizes as 0-d tensors (no window: one wider than every row), so that both layer types and every
    # batch length share one compiled graph (a closed-over int or None is a guard: a recompile per value)
    sizes = _tensors(prefix.device, enc_len, block_size, sliding_window or enc_len + R + 1)

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return _block_diffusion_rule(prefix, lengths, *sizes, b, q_idx, kv_idx)

    return build_block_mask(mask_mod, len(prefix), R, enc_len + R, prefix.device)


def encoder_attention_masks(
    attention_mask: Tensor, sliding_window: Optional[int], dtype: torch.dtype = torch.float32
) -> Dict[str, Tensor]:
    """Additive ``[B, 1, S, S]`` causal masks for the encode pass (docs/DESIGN.md §9.2), by layer type.

    ``full_attention`` keeps ``k <= q``; ``sliding_attention`` also needs ``q - k < sliding_window``
    (None: same as full). Padded keys (``attention_mask == 0``) are hidden; every diagonal ``(q, q)``
    is kept so padded query rows are never fully masked.
    """
    attended = _attended(attention_mask, sliding_window)
    B, S = attended.shape
    b = torch.arange(B, device=attended.device).view(B, 1, 1)
    q = torch.arange(S, device=attended.device).view(1, S, 1)
    k = torch.arange(S, device=attended.device).view(1, 1, S)
    return {
        name: additive_mask(_causal_rule(attended, window, b, q, k).unsqueeze(1), dtype)
        for name, window in (("full_attention", None), ("sliding_attention", sliding_window))
    }


def encoder_block_masks(attention_mask: Tensor, sliding_window: Optional[int]) -> Dict[str, BlockMask]:
    """FlexAttention ``BlockMask`` of each of :func:`encoder_attention_masks` (same rule; ``B`` masks, one for all
    heads, 128 tiles, on ``attention_mask``'s device; built by :func:`build_block_mask`)."""
    attended = _attended(attention_mask, sliding_window)
    B, S = attended.shape

    def block_mask(window: Optional[int]) -> BlockMask:
        (width,) = _tensors(attended.device, window or S + 1)  # a tensor, as in block_diffusion_block_mask

        def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            return _causal_rule(attended, width, b, q_idx, kv_idx)

        return build_block_mask(mask_mod, B, S, S, attended.device)

    full = block_mask(None)
    return {"full_attention": full, "sliding_attention": full if sliding_window is None else block_mask(sliding_window)}


# --- helpers ---------------------------------------------------------------------------------------


def _keep(
    prefix: Tensor, lengths: Tensor, R: int, enc_len: int, block_size: int, sliding_window: Optional[int]
) -> Tensor:
    """Bool ``[B, R, enc_len + R]``: :func:`_block_diffusion_rule` on every (example, canvas row, column)."""
    device = prefix.device
    b = torch.arange(len(prefix), device=device).view(-1, 1, 1)
    j = torch.arange(R, device=device).view(1, R, 1)
    kv = torch.arange(enc_len + R, device=device).view(1, 1, -1)
    return _block_diffusion_rule(prefix, lengths, enc_len, block_size, sliding_window, b, j, kv)


def _block_diffusion_rule(
    prefix: Tensor,
    lengths: Tensor,
    enc_len: Union[int, Tensor],
    block_size: Union[int, Tensor],
    sliding_window: Union[int, Tensor, None],
    b: Tensor,
    j: Tensor,
    kv: Tensor,
) -> Tensor:
    """The block-diffusion keep rule (docs/DESIGN.md §9.2) on broadcastable index tensors (the dense builder's grids
    or flex's scalars): example ``b``, canvas row ``j``, column ``kv`` (``enc_len`` encoder columns, then the canvas).
    Rows ``j < R_b`` follow §9.2 with ``R_b`` as R; every row keeps its own canvas diagonal ``enc_len + j`` (the only
    column of a pad row ``j >= R_b``; already kept by the rule for the others)."""
    P, R_b = prefix[b], lengths[b]
    qb = j // block_size  # canvas query block
    rel = kv - P  # encoder column minus prompt
    # Prompt (rel < 0), or clean response of a strictly earlier block that is not tail padding
    # (the strict block rule already implies rel < R_b; the spec states it, so it is kept explicit).
    encoder = (kv < enc_len) & ((rel < 0) | ((rel // block_size < qb) & (rel < R_b)))
    if sliding_window is not None:
        encoder = encoder & (rel >= qb * block_size - sliding_window + 1)
    k = kv - enc_len  # canvas key; negative for encoder columns
    canvas = (k >= 0) & (k // block_size == qb) & (k < R_b)
    return ((encoder | canvas) & (j < R_b)) | (k == j)


def _tensors(device: torch.device, *sizes: int) -> Tuple[Tensor, ...]:
    """Each size as a 0-d long tensor on ``device``, filled there (no host-to-device copy)."""
    return tuple(torch.full((), size, dtype=torch.long, device=device) for size in sizes)


def _causal_rule(attended: Tensor, sliding_window: Union[int, Tensor, None], b: Tensor, q: Tensor, k: Tensor) -> Tensor:
    """The encoder keep rule on broadcastable index tensors: attended ``k <= q`` (and ``q - k < W``), or ``k == q``."""
    keep = (k <= q) & attended[b, k]
    if sliding_window is not None:
        keep = keep & (q - k < sliding_window)
    return keep | (q == k)


def _attended(attention_mask: Tensor, sliding_window: Optional[int]) -> Tensor:
    if attention_mask.dim() != 2:
        raise ValueError(f"attention_mask must be [B, S], got shape {tuple(attention_mask.shape)}.")
    check_sliding_window(sliding_window)
    return attention_mask.bool()


def _batch_lengths(
    prefix: Tensor, lengths: Tensor, R: int, enc_len: int, block_size: int, sliding_window: Optional[int],
    check_values: bool,
) -> Tuple[Tensor, Tensor]:
    """``[B]`` long prompt and response lengths on ``prefix``'s device, their shapes checked and, with
    ``check_values``, their values (:func:`_check`)."""
    prefix = _prefix_tensor(prefix, None)
    if not isinstance(lengths, Tensor) or lengths.shape != prefix.shape:
        got = tuple(lengths.shape) if isinstance(lengths, Tensor) else type(lengths).__name__
        raise ValueError(f"lengths must be a [B] tensor like prefix {tuple(prefix.shape)}, got {got}.")
    lengths = lengths.to(device=prefix.device, dtype=torch.long)
    if check_values:
        _check(prefix, lengths, R, enc_len, block_size, sliding_window)
    else:
        _check_sizes(R, block_size, sliding_window)
    return prefix, lengths


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
    _check_sizes(R, block_size, sliding_window)
    end = prefix + lengths
    # one device-to-host transfer for the three value checks (the error paths may read more)
    bad_lengths, bad_prefix, too_long = torch.stack([
        ((lengths < 0) | (lengths > R)).any(), (prefix < 0).any(), (end > enc_len).any()
    ]).tolist()
    if bad_lengths:
        raise ValueError(f"lengths must lie in [0, R={R}], got {lengths.tolist()}; pass R >= max(lengths).")
    if bad_prefix:
        raise ValueError(f"prefix lengths must be >= 0, got {prefix.tolist()}.")
    if too_long:
        raise ValueError(
            f"prefix + response length {end.tolist()} exceeds enc_len={enc_len}; "
            f"pass enc_len >= {end.max().item()} (the encoder must hold prompt and response)."
        )


def _check_sizes(R: int, block_size: int, sliding_window: Optional[int]) -> None:
    """The host-side arguments (no device transfer)."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}.")
    if R <= 0:
        raise ValueError(f"R (canvas length) must be positive, got {R}.")
    check_sliding_window(sliding_window)
