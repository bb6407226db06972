"""Noise kernels for dLLM training, with optional keyed per-example randomness.

Every kernel takes ``[B, L]`` ``input_ids`` and ``loss_mask`` (truthy = supervised) and only ever
changes supervised positions. Random draws come from one of two sources:

* ``generator`` (or the global RNG): plain ``torch.rand``/``torch.randint`` calls in the order
  each docstring states: the same stream as NeMo AutoModel's kernels (bit parity; Gumbel-score
  ties, which need equal 24-bit uniforms, break by index here).
* ``keys`` (``[B]`` int64, see :func:`~lit_dllm.noise.keys.example_keys`): every draw for row ``b`` is
  hashed from ``(keys[b], stream, counter)`` (:mod:`lit_dllm.noise.keys`; the streams are
  :class:`~lit_dllm.noise.keys.Stream`'s corruption members), where the counter is the position (or the
  block index) within the row. A row's noise is then a function of its key alone: independent of
  the batch size, its row number, the other rows, the device, and (where the docstring says so)
  the padded length ``L``. This makes corruption exact under any DP/grad-accumulation split.

On CUDA the keyed kernels run as one Triton launch each (:mod:`lit_dllm.noise.fused_corruption`), with
outputs equal to the eager torch path bit for bit; set ``FUSED_KEYED_KERNELS = False`` for the eager one.
"""

from __future__ import annotations

import functools
import math
import os

import torch
from torch import Tensor

from lit_dllm.noise.keys import Stream, check_keys, example_keys, is_integer_tensor, keyed_rand, keyed_randint

__all__ = [
    "example_keys",
    "gumbel_topk",
    "batched_gumbel_topk",
    "_batched_gumbel_topk",
    "corrupt_uniform",
    "corrupt_blockwise",
    "corrupt_uniform_random",
    "corrupt_all_masked",
    "corrupt_mix",
]

FUSED_KEYED_KERNELS = True
"""Run keyed corruption on CUDA through the Triton kernels (when Triton is installed)."""


class _RandomSource:
    """Uniform draws for ``rows`` rows: from the torch RNG (``generator``) or hashed from ``keys``.

    Every shape starts with the row dimension. With the torch RNG, ``stream`` is ignored and the
    call order is the stream order; with keys, element ``(b, *i)`` hashes ``(keys[b], stream,
    flat index of i)``.
    """

    def __init__(self, rows: int, device: torch.device, generator: torch.Generator | None, keys: Tensor | None):
        if generator is not None and keys is not None:
            raise ValueError("pass either generator or keys, not both: keys already fix every draw")
        if generator is not None and generator.device.type != device.type:
            raise ValueError(
                f"generator is on {generator.device} but the inputs are on {device}; "
                f"create it with torch.Generator(device={str(device)!r})"
            )
        if keys is not None:
            keys = check_keys(keys, rows, device)
        self.device, self.generator, self.keys = device, generator, keys

    def rand(self, shape: tuple[int, ...], stream: Stream, dtype: torch.dtype = torch.float32) -> Tensor:
        """Uniforms in [0, 1); keyed ones are multiples of 2**-24 (24 high bits), exact in float32."""
        if self.keys is None:
            return torch.rand(shape, generator=self.generator, device=self.device, dtype=dtype)
        return keyed_rand(self.keys, stream, shape, dtype)

    def randint(self, high: int, shape: tuple[int, ...], stream: Stream) -> Tensor:
        """int64 uniforms in [0, high); keyed ones reduce 62 bits (bias < high / 2**62)."""
        if self.keys is None:
            return torch.randint(high, shape, generator=self.generator, device=self.device)
        return keyed_randint(self.keys, stream, high, shape)

    def fused(self, input_ids: Tensor):
        """The Triton kernels' module when they serve this call (keyed, on CUDA, non-empty), else None.

        With Triton's interpreter on (``TRITON_INTERPRET=1``) they also run on CPU tensors, for the tests.
        """
        on_device = self.device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
        if self.keys is None or not (FUSED_KEYED_KERNELS and on_device and input_ids.numel()):
            return None
        return _fused_module()


@functools.cache
def _fused_module():
    try:
        from lit_dllm.noise import fused_corruption
    except ImportError:  # no Triton: the eager path
        return None
    return fused_corruption


# ---------------------------------------------------------------------------------------------
# Input checks: each names the offending value and the fix, and runs before any work.


def _check_batch(input_ids: Tensor, loss_mask: Tensor) -> None:
    if not isinstance(input_ids, Tensor) or not isinstance(loss_mask, Tensor):
        raise TypeError(f"input_ids and loss_mask must be tensors, got {type(input_ids)} and {type(loss_mask)}")
    if not is_integer_tensor(input_ids):
        raise TypeError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}; cast with .long()")
    if input_ids.dim() != 2 or loss_mask.shape != input_ids.shape:
        raise ValueError(
            f"input_ids and loss_mask must both be [B, L], got {tuple(input_ids.shape)} and "
            f"{tuple(loss_mask.shape)}; batch the examples (e.g. with DLLMCollator)"
        )
    if loss_mask.device != input_ids.device:
        raise ValueError(f"loss_mask is on {loss_mask.device} but input_ids on {input_ids.device}; move them together")


def _check_eps(eps: float) -> None:
    if not 0.0 <= eps < 1.0:
        raise ValueError(f"eps must be in [0, 1), got {eps}; it is the minimum corruption level")


def _check_block_size(block_size: int | None) -> None:
    if block_size is not None and (not isinstance(block_size, int) or block_size <= 0):
        raise ValueError(f"block_size must be a positive int or None, got {block_size!r}")


def _check_vocab(vocab_size: int, minimum: int) -> None:
    if not isinstance(vocab_size, int) or vocab_size < minimum:
        raise ValueError(f"vocab_size must be an int >= {minimum}, got {vocab_size!r}; pass the tokenizer's vocab size")


def _first_outside(values: Tensor, high: int) -> tuple[int, ...] | None:
    """The index of the first entry of ``values`` outside ``[0, high)``, or None. Read on CPU tensors only: on an
    accelerator the verdict would make the host wait for the device in every training step (None there)."""
    if values.device.type != "cpu":
        return None
    outside = (values < 0) | (values >= high)
    return tuple(int(i) for i in outside.nonzero()[0]) if outside.any() else None


def _check_ids_in_vocab(input_ids: Tensor, vocab_size: int) -> None:
    if (at := _first_outside(input_ids, vocab_size)) is not None:
        raise ValueError(
            f"input_ids[{at[0]}, {at[1]}] = {int(input_ids[at])} is outside the vocabulary [0, vocab_size="
            f"{vocab_size}): pass the tokenizer's vocab size (len(tokenizer)) as vocab_size, or tokenize with the "
            "model's tokenizer"
        )


def _check_mask_id(mask_token_id: int, vocab_size: int | None = None) -> None:
    upper = math.inf if vocab_size is None else vocab_size
    if not isinstance(mask_token_id, int) or not 0 <= mask_token_id < upper:
        bound = "" if vocab_size is None else f" and < vocab_size={vocab_size}"
        raise ValueError(f"mask_token_id must be an int >= 0{bound}, got {mask_token_id!r}; check the tokenizer")


# ---------------------------------------------------------------------------------------------
# Shared pieces.


def _level(u: Tensor, eps: float) -> Tensor:
    """Map U[0, 1) to a corruption level in [eps, 1)."""
    return eps + (1.0 - eps) * u


def _block_grid(length: int, block_size: int | None) -> tuple[int, int]:
    """``(n_blocks, span)``: the whole row is one block of span ``L`` when ``block_size`` is None."""
    return (1, length) if block_size is None else (math.ceil(length / block_size), block_size)


def _spread(per_block: Tensor, span: int, length: int) -> Tensor:
    """``[B, n_blocks]`` values -> ``[B, L]``, each block's value over its positions."""
    rows, n_blocks = per_block.shape
    return per_block[:, :, None].expand(rows, n_blocks, span).reshape(rows, n_blocks * span)[:, :length]


def _topk_from_uniforms(log_w: Tensor, k: Tensor, u: Tensor) -> Tensor:
    """Rows of ``log_w`` [N, D]: mark the ``k`` largest ``log_w + Gumbel(u)`` scores.

    The sort is stable so ties (possible with 24-bit uniforms) break by index on every device.
    """
    gumbel = -torch.log(-torch.log(u + 1e-9) + 1e-9)
    order = torch.sort(log_w + gumbel, dim=1, descending=True, stable=True).indices
    in_top_k = torch.arange(log_w.shape[1], device=log_w.device) < k[:, None]
    return torch.zeros_like(log_w, dtype=torch.bool).scatter_(1, order, in_top_k)


# ---------------------------------------------------------------------------------------------
# Public kernels.


def batched_gumbel_topk(
    log_w: Tensor, k: Tensor, generator: torch.Generator | None = None, *, keys: Tensor | None = None
) -> Tensor:
    """Bool ``[N, D]`` with exactly ``k[i]`` True in row ``i``, sampled by the Gumbel-top-k trick.

    ``-inf`` log-weights are never chosen while ``k[i]`` <= the row's finite count; ``k=0`` gives an
    all-False row. ``k`` must lie in ``[0, D]`` (checked for CPU tensors: elsewhere the host would wait for the
    device). Draws: ``rand(N, D)``; keyed row ``i`` uses ``keys[i]`` and the column index.
    """
    if not isinstance(log_w, Tensor) or log_w.dim() != 2:
        raise ValueError(f"log_w must be a [N, D] tensor, got {getattr(log_w, 'shape', log_w)!r}")
    if not isinstance(k, Tensor) or tuple(k.shape) != (log_w.shape[0],):
        raise ValueError(f"k must be a tensor of shape [{log_w.shape[0]}], got {getattr(k, 'shape', k)!r}")
    width = log_w.shape[1]
    if (at := _first_outside(k, width + 1)) is not None:
        raise ValueError(f"k[{at[0]}] = {k[at].item()} is outside [0, {width}]: a row of log_w has {width} entries")
    source = _RandomSource(log_w.shape[0], log_w.device, generator, keys)
    u = source.rand(tuple(log_w.shape), Stream.GUMBEL, log_w.dtype)
    return _topk_from_uniforms(log_w, k.to(log_w.device), u)


_batched_gumbel_topk = batched_gumbel_topk  # the reference's name


def gumbel_topk(log_w: Tensor, k: int, generator: torch.Generator | None = None) -> Tensor:
    """Bool ``[D]`` with exactly ``k`` True entries (Gumbel-top-k on ``log_w``). Draws: ``rand(D)``."""
    if not isinstance(log_w, Tensor) or log_w.dim() != 1:
        raise ValueError(f"log_w must be a 1-D tensor, got {getattr(log_w, 'shape', log_w)!r}")
    if not isinstance(k, int) or not 0 <= k <= log_w.numel():
        raise ValueError(f"k must be an int in [0, {log_w.numel()}] (the length of log_w), got {k!r}")
    return batched_gumbel_topk(log_w[None], torch.tensor([k], device=log_w.device), generator)[0]


def corrupt_uniform(
    input_ids: Tensor,
    loss_mask: Tensor,
    mask_token_id: int,
    eps: float = 1e-3,
    generator: torch.Generator | None = None,
    *,
    keys: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """MDLM corruption: per row ``p = eps + (1-eps)·t``, each supervised token masked w.p. ``p``.

    Returns ``(noisy_ids, noise_mask, p_mask)``; ``p_mask`` is float32 ``p`` broadcast per row.
    Draws: ``rand(B)`` for ``t``, then ``rand(B, L)``. Keyed: invariant to the padded length ``L``.
    """
    _check_batch(input_ids, loss_mask)
    _check_mask_id(mask_token_id)
    _check_eps(eps)
    rows, length = input_ids.shape
    source = _RandomSource(rows, input_ids.device, generator, keys)
    if fused := source.fused(input_ids):
        return fused.threshold(input_ids, loss_mask, source.keys, length, eps, mask_token_id)
    p_mask = _spread(_level(source.rand((rows, 1), Stream.LEVEL), eps), length, length)
    noise_mask = (source.rand((rows, length), Stream.TOKEN_UNIFORM) < p_mask) & loss_mask.bool()
    return torch.where(noise_mask, mask_token_id, input_ids), noise_mask, p_mask


def corrupt_blockwise(
    input_ids: Tensor,
    loss_mask: Tensor,
    mask_token_id: int,
    block_size: int | None = None,
    eps: float = 1e-3,
    half_life_ratio: float = 0.25,
    generator: torch.Generator | None = None,
    *,
    keys: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Exact-``k`` masking with a late-position bias, per row or per block of ``block_size``.

    Per row/block: ``m = eps + (1-eps)·rand``, ``k = round(m·len)`` (len = the block's real length;
    clamped to ``[1, L]`` per row, ``[0, len]`` per block), then ``k`` positions by Gumbel-top-k on
    ``λ(1-m)·i`` with ``λ = ln2 / (half_life_ratio·span)`` (span = ``L`` or ``block_size``).
    Selection precedes loss-mask gating, so the realised count is ``<= k``; ``p_mask = m``.
    Draws: ``rand(B·n_blocks)`` for ``m``, then ``rand(B·n_blocks, span)``.
    Keyed: the row path depends on ``L`` by definition; the block path is invariant to ``L`` for
    every block that is full in both layouts (a short last block depends on its length).
    """
    _check_batch(input_ids, loss_mask)
    _check_mask_id(mask_token_id)
    _check_block_size(block_size)
    _check_eps(eps)
    if not half_life_ratio > 0:
        raise ValueError(f"half_life_ratio must be > 0, got {half_life_ratio}; 0.25 is the default")
    rows, length = input_ids.shape
    if length == 0:
        raise ValueError("input_ids has no positions (L=0); corrupt_blockwise needs L >= 1")
    device = input_ids.device
    n_blocks, span = _block_grid(length, block_size)
    source = _RandomSource(rows, device, generator, keys)
    if fused := source.fused(input_ids):
        min_k = 1 if block_size is None else 0
        return fused.blockwise(input_ids, loss_mask, source.keys, mask_token_id, n_blocks, span, eps,
                               half_life_ratio, min_k)

    m = _level(source.rand((rows, n_blocks), Stream.LEVEL), eps)  # [B, n_blocks]
    block_len = (length - span * torch.arange(n_blocks, device=device)).clamp(max=span)  # real lengths
    # m <= 1, so k <= the real length; the row path also keeps at least one position.
    k = torch.round(m * block_len).long().clamp(min=1 if block_size is None else 0)

    pos = torch.arange(span, device=device)
    log_w = (math.log(2.0) / (half_life_ratio * span) * (1.0 - m))[..., None] * pos.float()
    log_w = log_w.masked_fill(pos >= block_len[:, None], -math.inf)  # past a short block's end
    u = source.rand((rows, n_blocks, span), Stream.GUMBEL)
    chosen = _topk_from_uniforms(log_w.view(-1, span), k.view(-1), u.view(-1, span))

    noise_mask = chosen.view(rows, n_blocks * span)[:, :length] & loss_mask.bool()
    p_mask = _spread(m, span, length)
    return torch.where(noise_mask, mask_token_id, input_ids), noise_mask, p_mask


def corrupt_uniform_random(
    input_ids: Tensor,
    loss_mask: Tensor,
    vocab_size: int,
    block_size: int | None = None,
    eps: float = 1e-3,
    generator: torch.Generator | None = None,
    *,
    keys: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """D3PM-uniform corruption: per row/block ``t = eps + (1-eps)·rand``; each supervised token is
    replaced w.p. ``t`` by a uniform token of ``[0, vocab_size)`` (possibly itself). ``p_mask ≡ 1``.

    ``input_ids`` must lie in ``[0, vocab_size)``: a ValueError names the first id outside. Checked for CPU tensors
    only, so that a GPU training step never makes the host wait for the device (its ids come from the tokenizer).
    Draws: ``rand(B)`` or ``rand(B·n_blocks)`` for ``t``, ``rand(B, L)``, ``randint(vocab, (B, L))``.
    Keyed: invariant to the padded length ``L``.
    """
    _check_batch(input_ids, loss_mask)
    _check_vocab(vocab_size, 1)
    _check_ids_in_vocab(input_ids, vocab_size)
    _check_block_size(block_size)
    _check_eps(eps)
    rows, length = input_ids.shape
    n_blocks, span = _block_grid(length, block_size)
    source = _RandomSource(rows, input_ids.device, generator, keys)
    if fused := source.fused(input_ids):
        return fused.threshold(input_ids, loss_mask, source.keys, span, eps, vocab_size=vocab_size)
    t = _spread(_level(source.rand((rows, n_blocks), Stream.LEVEL), eps), span, length)
    noise_mask = (source.rand((rows, length), Stream.TOKEN_UNIFORM) < t) & loss_mask.bool()
    replacement = source.randint(vocab_size, (rows, length), Stream.REPLACEMENT).to(input_ids.dtype)
    p_mask = torch.ones((rows, length), dtype=torch.float32, device=input_ids.device)
    return torch.where(noise_mask, replacement, input_ids), noise_mask, p_mask


def corrupt_all_masked(input_ids: Tensor, loss_mask: Tensor, mask_token_id: int) -> tuple[Tensor, Tensor, Tensor]:
    """I-DLM corruption: every supervised position becomes ``mask_token_id``; ``p_mask ≡ 1``."""
    _check_batch(input_ids, loss_mask)
    _check_mask_id(mask_token_id)
    noise_mask = loss_mask.bool()
    p_mask = torch.ones(input_ids.shape, dtype=torch.float32, device=input_ids.device)
    return torch.where(noise_mask, mask_token_id, input_ids), noise_mask, p_mask


def _probability(value: float | Tensor, name: str, shape: tuple[int, int], device: torch.device) -> Tensor:
    """A float32 probability broadcast to ``[B, L]``; a 1-D tensor is read per row (``[B]``)."""
    prob = torch.as_tensor(value, dtype=torch.float32, device=device)
    if prob.dim() == 1:
        prob = prob[:, None]
    try:
        return prob.expand(shape)
    except RuntimeError:
        raise ValueError(
            f"{name} of shape {tuple(torch.as_tensor(value).shape)} does not broadcast to [B, L]={list(shape)}; "
            "pass a float, a [B] or [B, 1] tensor, or one broadcastable to [B, L]"
        ) from None


def corrupt_mix(
    input_ids: Tensor,
    loss_mask: Tensor,
    mask_token_id: int,
    vocab_size: int,
    mask_prob: float | Tensor,
    uniform_prob: float | Tensor,
    generator: torch.Generator | None = None,
    *,
    keys: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """SCDD two-channel corruption from one uniform ``u`` per position (supervised ones only).

    ``u < mask_prob`` -> MASK; ``mask_prob <= u < mask_prob + uniform_prob`` and clean != MASK -> a
    uniform token of the vocab minus {MASK, clean}. Probabilities are floats, ``[B]`` (per row) or
    tensors broadcastable to ``[B, L]``. Returns ``(noisy_ids, changed_mask)``, where
    ``changed_mask`` is exactly ``noisy_ids != input_ids`` (a clean MASK that is absorbed is
    unchanged). ``input_ids`` must lie in ``[0, vocab_size)`` (checked for CPU tensors, as in
    :func:`corrupt_uniform_random`). Draws: ``rand(B, L)``, then ``randint(V-2, (B, L))``. Keyed: invariant to ``L``.
    """
    _check_batch(input_ids, loss_mask)
    _check_vocab(vocab_size, 3)
    _check_mask_id(mask_token_id, vocab_size)
    _check_ids_in_vocab(input_ids, vocab_size)
    rows, length = input_ids.shape
    device = input_ids.device
    if isinstance(mask_prob, Tensor) or isinstance(uniform_prob, Tensor):
        mask_prob = _probability(mask_prob, "mask_prob", (rows, length), device)
        uniform_prob = _probability(uniform_prob, "uniform_prob", (rows, length), device)
    else:  # checked on the host, without a device sync
        mask_prob, uniform_prob = float(mask_prob), float(uniform_prob)
    for name, prob in (("mask_prob", mask_prob), ("uniform_prob", uniform_prob)):
        lowest = prob.min().item() if isinstance(prob, Tensor) else prob
        if not lowest >= 0:  # NaN too: it would corrupt nothing
            raise ValueError(f"{name} must be a probability >= 0, got a minimum of {lowest:.6g}")
    highest = mask_prob + uniform_prob
    highest = highest.max().item() if isinstance(highest, Tensor) else highest
    if highest > 1.0 + 1e-5:
        raise ValueError(f"mask_prob + uniform_prob must be <= 1, got up to {highest:.6f}; rescale the schedule")
    source = _RandomSource(rows, device, generator, keys)
    if fused := source.fused(input_ids):
        return fused.mix(input_ids, loss_mask, source.keys, mask_token_id, vocab_size, mask_prob, uniform_prob)

    p_mask = _probability(mask_prob, "mask_prob", (rows, length), device)
    p_uniform = _probability(uniform_prob, "uniform_prob", (rows, length), device)
    p_either = p_mask + p_uniform
    u = source.rand((rows, length), Stream.TOKEN_UNIFORM)
    supervised = loss_mask.bool()
    is_mask = input_ids == mask_token_id
    absorbed = (u < p_mask) & supervised & ~is_mask
    transitioned = (u >= p_mask) & (u < p_either) & supervised & ~is_mask

    # Uniform over V-2 slots, shifted past the two excluded ids in increasing order.
    draw = source.randint(vocab_size - 2, (rows, length), Stream.REPLACEMENT).to(input_ids.dtype)
    low = input_ids.clamp(max=mask_token_id)
    high = input_ids.clamp(min=mask_token_id)
    draw = draw + (draw >= low).to(draw.dtype)
    draw = draw + (draw >= high).to(draw.dtype)

    noisy = torch.where(absorbed, mask_token_id, input_ids)
    return torch.where(transitioned, draw, noisy), absorbed | transitioned
