"""Keyed corruption in one Triton launch per call (the CUDA path of :mod:`lit_dllm.noise.corruption`).

Each kernel recomputes the same splitmix64 counters as the eager keyed draws (:mod:`lit_dllm.noise.keys`) and the same
float32 operations in the same order (fused multiply-add contraction off; ``tl.log`` is libdevice's
``logf``, as ``torch.log`` on CUDA), so its outputs equal the eager ones bit for bit. The callers in
``corruption.py`` validate the inputs first; these functions only launch.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from lit_dllm.noise.keys import Stream

# The eager path's streams, as compile-time constants of the kernels.
LEVEL, TOKEN_UNIFORM = tl.constexpr(int(Stream.LEVEL)), tl.constexpr(int(Stream.TOKEN_UNIFORM))
GUMBEL, REPLACEMENT = tl.constexpr(int(Stream.GUMBEL)), tl.constexpr(int(Stream.REPLACEMENT))
_ELEMENTS = 256  # positions per program of the element-wise kernels
# Launch settings, the fastest of sweeps at B8 x L4096 (docs/benchmarks/primitives.md): blocks of up
# to _SORTED_SPAN positions (padded to a power of two) are sorted in one program each, longer ones radix-selected.
_SORTED_SPAN = 1024
_SELECT_CHUNK, _SELECT_RADIX, _SELECT_WARPS = 4096, 2, 16
_NO_FMA = {"enable_fp_fusion": False}  # torch rounds every multiply and add on its own


@triton.jit
def _mix64(x):
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB
    return x ^ (x >> 31)


@triton.jit
def _absorb(state, value):
    """``keys._absorb`` on uint64 (wrapping multiply, logical shifts)."""
    return _mix64(state + (value.to(tl.uint64) + 1) * 0x9E3779B97F4A7C15)


@triton.jit
def _row_state(keys_ptr, row, stream: tl.constexpr):
    key = tl.load(keys_ptr + row).to(tl.uint64, bitcast=True)
    return _absorb(key, tl.cast(stream, tl.uint64))


@triton.jit
def _uniform(state, counter):
    """The 24 high bits of the hash, as a float32 multiple of 2**-24."""
    return (_absorb(state, counter) >> 40).to(tl.float32) * 5.9604644775390625e-08


@triton.jit
def _randint(state, counter, high):
    return (_absorb(state, counter) >> 2) % high.to(tl.uint64)


@triton.jit
def _threshold_kernel(ids_ptr, loss_mask_ptr, keys_ptr, noisy_ptr, noise_ptr, p_ptr, length, span,
                      eps, one_minus_eps, mask_token_id, vocab_size, RANDOM: tl.constexpr, BLOCK: tl.constexpr):
    """corrupt_uniform (``RANDOM=False``) and corrupt_uniform_random: one level per ``span`` positions."""
    row = tl.program_id(0)
    pos = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = pos < length
    offsets = row.to(tl.int64) * length + pos
    level = eps + one_minus_eps * _uniform(_row_state(keys_ptr, row, LEVEL), pos // span)
    u = _uniform(_row_state(keys_ptr, row, TOKEN_UNIFORM), pos)
    noise = (u < level) & (tl.load(loss_mask_ptr + offsets, mask=inside, other=0) != 0)
    ids = tl.load(ids_ptr + offsets, mask=inside)
    if RANDOM:
        new = _randint(_row_state(keys_ptr, row, REPLACEMENT), pos, vocab_size).to(ids.dtype)
        p = tl.full([BLOCK], 1.0, tl.float32)
    else:
        new = tl.full([BLOCK], mask_token_id, ids.dtype)
        p = level
    tl.store(noisy_ptr + offsets, tl.where(noise, new, ids), mask=inside)
    tl.store(noise_ptr + offsets, noise, mask=inside)
    tl.store(p_ptr + offsets, p, mask=inside)


@triton.jit
def _mix_kernel(ids_ptr, loss_mask_ptr, keys_ptr, noisy_ptr, changed_ptr, length, mask_prob, uniform_prob,
                mask_token_id, vocab_size, TENSOR_PROBS: tl.constexpr, BLOCK: tl.constexpr):
    """corrupt_mix; the probabilities are float32 scalars, or contiguous float32 ``[B, L]`` tensors."""
    row = tl.program_id(0)
    pos = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = pos < length
    offsets = row.to(tl.int64) * length + pos
    if TENSOR_PROBS:
        p_mask = tl.load(mask_prob + offsets, mask=inside)
        p_uniform = tl.load(uniform_prob + offsets, mask=inside)
    else:
        p_mask, p_uniform = mask_prob, uniform_prob
    ids = tl.load(ids_ptr + offsets, mask=inside)
    open_ = (tl.load(loss_mask_ptr + offsets, mask=inside, other=0) != 0) & (ids != mask_token_id)
    u = _uniform(_row_state(keys_ptr, row, TOKEN_UNIFORM), pos)
    absorbed = (u < p_mask) & open_
    transitioned = (u >= p_mask) & (u < p_mask + p_uniform) & open_
    draw = _randint(_row_state(keys_ptr, row, REPLACEMENT), pos, vocab_size - 2).to(ids.dtype)
    draw += (draw >= tl.minimum(ids, mask_token_id)).to(ids.dtype)
    draw += (draw >= tl.maximum(ids, mask_token_id)).to(ids.dtype)
    noisy = tl.where(transitioned, draw, tl.where(absorbed, mask_token_id, ids))
    tl.store(noisy_ptr + offsets, noisy, mask=inside)
    tl.store(changed_ptr + offsets, absorbed | transitioned, mask=inside)


@triton.jit
def _gumbel_scores(state, block, span, j, slope, block_len):
    """``log_w + Gumbel(u)`` at block offsets ``j``, as ``corruption._topk_from_uniforms`` forms them."""
    u = _uniform(state, block * span + j)
    gumbel = -tl.log(-tl.log(u + 1e-9) + 1e-9)
    log_w = tl.where(j >= block_len, -float("inf"), slope * j.to(tl.float32))
    return log_w + gumbel


@triton.jit
def _block_level(keys_ptr, row, block, length, span, eps, one_minus_eps, min_k):
    """The block's level ``m``, its real length and ``k = round(m · length)`` (at least ``min_k``)."""
    m = eps + one_minus_eps * _uniform(_row_state(keys_ptr, row, LEVEL), block)
    block_len = tl.minimum(length - span * block, span)
    # round half to even (torch.round) by adding and subtracting 2**23: exact for 0 <= x < 2**23
    k = tl.maximum(((m * block_len.to(tl.float32) + 8388608.0) - 8388608.0).to(tl.int32), min_k)
    return m, block_len, k


@triton.jit
def _store_chosen(ids_ptr, loss_mask_ptr, noisy_ptr, noise_ptr, p_ptr, row, block, i, chosen, m, length, span,
                  mask_token_id):
    pos = block * span + i
    inside = (i < span) & (pos < length)
    offsets = row.to(tl.int64) * length + pos
    noise = chosen & (tl.load(loss_mask_ptr + offsets, mask=inside, other=0) != 0)
    ids = tl.load(ids_ptr + offsets, mask=inside)
    tl.store(noisy_ptr + offsets, tl.where(noise, mask_token_id, ids), mask=inside)
    tl.store(noise_ptr + offsets, noise, mask=inside)
    tl.store(p_ptr + offsets, tl.zeros(i.shape, tl.float32) + m, mask=inside)


@triton.jit
def _ordered_bits(score):
    """The float32 ``score`` as an int32 in the same order (``-0.0`` equal to ``0.0``, as torch sorts them)."""
    bits = (score + 0.0).to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


@triton.jit
def _order_key(score, i):
    """``(score, -i)`` packed into an int64 in the same order: the larger key comes first in the stable descending
    sort of the scores (ties by index)."""
    return (_ordered_bits(score).to(tl.int64) << 32) | (0x7FFFFFFF - i).to(tl.int64)


@triton.jit
def _blockwise_sort_kernel(ids_ptr, loss_mask_ptr, keys_ptr, noisy_ptr, noise_ptr, p_ptr, length, span, n_blocks,
                           eps, one_minus_eps, log2_per_span, min_k, mask_token_id, SPAN: tl.constexpr):
    """corrupt_blockwise, one program per block (``span <= SPAN``, a power of two): the ``k`` largest keys
    (:func:`_order_key`) are the block's top ``k``; the ``k``-th largest, found by a bitonic sort, is the threshold."""
    row, block = tl.program_id(0) // n_blocks, tl.program_id(0) % n_blocks
    m, block_len, k = _block_level(keys_ptr, row, block, length, span, eps, one_minus_eps, min_k)
    i = tl.arange(0, SPAN)
    # positions past the block (or its short end) score -inf, below every real position
    score = _gumbel_scores(_row_state(keys_ptr, row, GUMBEL), block, span, i, log2_per_span * (1.0 - m), block_len)
    key = _order_key(score, i)
    kth = tl.sum(tl.where(i == k - 1, tl.sort(key, descending=True), 0))
    _store_chosen(ids_ptr, loss_mask_ptr, noisy_ptr, noise_ptr, p_ptr, row, block, i, (key >= kth) & (k > 0), m,
                  length, span, mask_token_id)


@triton.jit
def _blockwise_select_kernel(ids_ptr, loss_mask_ptr, keys_ptr, noisy_ptr, noise_ptr, p_ptr, length, span, n_blocks,
                             eps, one_minus_eps, log2_per_span, min_k, mask_token_id, CHUNK: tl.constexpr,
                             RADIX: tl.constexpr):
    """corrupt_blockwise for long blocks, one program per block, ``CHUNK`` positions at a time: the ``k``-th largest
    score is found digit by digit (a radix select, ``RADIX`` bits a pass, from the top) over the block's scores as
    unsigned ints in float order, kept in ``p`` until the last pass overwrites them with the level. Positions above
    it are chosen, and of those equal to it the lowest ones (the stable sort's order)."""
    row, block = tl.program_id(0) // n_blocks, tl.program_id(0) % n_blocks
    m, block_len, k = _block_level(keys_ptr, row, block, length, span, eps, one_minus_eps, min_k)
    slope = log2_per_span * (1.0 - m)
    state = _row_state(keys_ptr, row, GUMBEL)
    scratch = p_ptr + row.to(tl.int64) * length + block * span
    start = 0
    while start < block_len:  # not `for ... in range(...)`: Triton's interpreter rejects a runtime bound there
        j = start + tl.arange(0, CHUNK)
        ordered = _ordered_bits(_gumbel_scores(state, block, span, j, slope, block_len)) ^ -2147483648
        tl.store(scratch + j, ordered.to(tl.float32, bitcast=True), mask=j < block_len)
        start += CHUNK
    tl.debug_barrier()  # the passes below read what other threads stored

    digits = tl.arange(0, 1 << RADIX)
    prefix = tl.zeros([], tl.uint32)  # the top bits of the k-th largest, so far
    need = k  # how many positions with that prefix are still to choose
    for d in tl.static_range(32 // RADIX):
        shift = 32 - RADIX * (d + 1)
        counts = tl.zeros([1 << RADIX], tl.int32)
        start = 0
        while start < block_len:
            j = start + tl.arange(0, CHUNK)
            top = tl.load(scratch + j, mask=j < block_len).to(tl.uint32, bitcast=True) >> shift
            hit = (top >> RADIX == prefix) & (j < block_len)  # two shifts: u >> 32 is undefined
            digit = (top & ((1 << RADIX) - 1)).to(tl.int32)
            counts += tl.sum(((digit[:, None] == digits[None, :]) & hit[:, None]).to(tl.int32), axis=0)
            start += CHUNK
        above = tl.sum(tl.where(digits[None, :] > digits[:, None], counts[None, :], 0), axis=1)  # per digit
        pick = tl.min(tl.where(above < need, digits, 1 << RADIX))  # the k-th largest's digit
        need -= tl.sum(tl.where(digits == pick, above, 0))
        prefix = (prefix << RADIX) | pick.to(tl.uint32)

    tied = tl.zeros([], tl.int32)
    start = 0
    while start < block_len:
        j = start + tl.arange(0, CHUNK)
        u = tl.load(scratch + j, mask=j < block_len).to(tl.uint32, bitcast=True)
        tie = (u == prefix) & (j < block_len)
        chosen = ((u > prefix) | (tie & (tied + tl.cumsum(tie.to(tl.int32), axis=0) <= need))) & (k > 0)
        tl.debug_barrier()  # every thread has read this chunk's scratch before the level overwrites it
        _store_chosen(ids_ptr, loss_mask_ptr, noisy_ptr, noise_ptr, p_ptr, row, block, j, chosen, m, length, span,
                      mask_token_id)
        tied += tl.sum(tie.to(tl.int32))
        start += CHUNK


def _outputs(input_ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    return (torch.empty_like(input_ids), torch.empty(input_ids.shape, dtype=torch.bool, device=input_ids.device),
            torch.empty(input_ids.shape, dtype=torch.float32, device=input_ids.device))


def threshold(input_ids: Tensor, loss_mask: Tensor, keys: Tensor, span: int, eps: float,
              mask_token_id: int = 0, vocab_size: int | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Keyed ``corrupt_uniform`` (``vocab_size=None``) or ``corrupt_uniform_random``, one level per ``span``."""
    input_ids, loss_mask = input_ids.contiguous(), loss_mask.contiguous()
    rows, length = input_ids.shape
    noisy, noise, p = _outputs(input_ids)
    grid = (rows, triton.cdiv(length, _ELEMENTS))
    _threshold_kernel[grid](input_ids, loss_mask, keys, noisy, noise, p, length, span, eps, 1.0 - eps,
                            mask_token_id, vocab_size or 1, RANDOM=vocab_size is not None, BLOCK=_ELEMENTS, **_NO_FMA)
    return noisy, noise, p


def blockwise(input_ids: Tensor, loss_mask: Tensor, keys: Tensor, mask_token_id: int, n_blocks: int, span: int,
              eps: float, half_life_ratio: float, min_k: int) -> tuple[Tensor, Tensor, Tensor]:
    """Keyed ``corrupt_blockwise`` (``span < 2**23``): blocks of up to ``_SORTED_SPAN`` positions are sorted in one
    program each, longer ones radix-selected."""
    input_ids, loss_mask = input_ids.contiguous(), loss_mask.contiguous()
    rows, length = input_ids.shape
    noisy, noise, p = _outputs(input_ids)
    args = (input_ids, loss_mask, keys, noisy, noise, p, length, span, n_blocks, eps, 1.0 - eps,
            math.log(2.0) / (half_life_ratio * span), min_k, mask_token_id)
    padded = triton.next_power_of_2(span)
    if padded <= _SORTED_SPAN:
        warps = 4 if padded <= 256 else 8 if padded <= 512 else 32
        _blockwise_sort_kernel[(rows * n_blocks,)](*args, SPAN=padded, num_warps=warps, **_NO_FMA)
    else:
        _blockwise_select_kernel[(rows * n_blocks,)](*args, CHUNK=min(padded, _SELECT_CHUNK), RADIX=_SELECT_RADIX,
                                                     num_warps=_SELECT_WARPS, **_NO_FMA)
    return noisy, noise, p


def mix(input_ids: Tensor, loss_mask: Tensor, keys: Tensor, mask_token_id: int, vocab_size: int,
        mask_prob: float | Tensor, uniform_prob: float | Tensor) -> tuple[Tensor, Tensor]:
    """Keyed ``corrupt_mix``; probabilities are floats or float32 ``[B, L]`` tensors (broadcast views allowed)."""
    input_ids, loss_mask = input_ids.contiguous(), loss_mask.contiguous()
    rows, length = input_ids.shape
    noisy, changed, _ = _outputs(input_ids)
    tensors = isinstance(mask_prob, Tensor)
    if tensors:
        mask_prob, uniform_prob = mask_prob.expand(rows, length).contiguous(), uniform_prob.expand(rows, length).contiguous()
    grid = (rows, triton.cdiv(length, _ELEMENTS))
    _mix_kernel[grid](input_ids, loss_mask, keys, noisy, changed, length, mask_prob, uniform_prob, mask_token_id,
                      vocab_size, TENSOR_PROBS=tensors, BLOCK=_ELEMENTS, **_NO_FMA)
    return noisy, changed
