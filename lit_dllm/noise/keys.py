"""Example keys and keyed draws: every random choice of a training step as a function of the example, not the batch.

An example's key (:func:`example_keys`) mixes ``(seed, global example index, epoch or step)``. A draw for row ``b``
is a counter-based hash of ``(keys[b], stream, counter)`` -- the splitmix64 sequence started at
``absorb(keys[b], stream)`` and read at ``counter`` (a position, a block or a draw number within the row). A row's
draws therefore depend on its key alone: not on the batch size, its row number, the other rows, the device or the
data-parallel / grad-accumulation split, so resuming or changing the topology reproduces the same noise.

Every kind of draw has its own ``stream`` id, listed once in :class:`Stream`.
"""

from __future__ import annotations

import enum
import math
import operator

import torch
from torch import Tensor

__all__ = ["FIRST_FAMILY_STREAM", "Stream", "example_keys", "is_integer_tensor", "keyed_categorical", "keyed_rand",
           "keyed_randint", "keyed_uniform"]


@enum.unique
class Stream(enum.IntEnum):
    """The keyed-draw stream ids of the whole package: one per kind of draw, so no two kinds share draws.

    ==================  =====  ====================================================================================
    stream              value  draws
    ==================  =====  ====================================================================================
    LEVEL               0      corruption: the corruption level of a row or a block
    TOKEN_UNIFORM       1      corruption: one uniform per position (masked or replaced below the level)
    GUMBEL              2      corruption: the Gumbel scores of blockwise / Gumbel-top-k selection
    REPLACEMENT         3      corruption: replacement tokens (uniform-random and mix corruption)
    CANVAS_BLOCK        16     DiffusionGemma: which canvas block a row trains on
    SELF_CONDITIONING   17     DiffusionGemma: the self-conditioning coin
    DFLASH_ANCHOR       18     DFlash: the anchor positions
    DFLASH_PREFIX       19     DFlash: the variable-prefix lengths
    RL_PROMPT_MASK      20     RL (a dLLM policy): the prompt tokens masked by the log-probability estimate
    RL_ROLLOUT          21     keyed sampling: a position's token (:func:`keyed_categorical`; RL's rollouts)
    RANDOM_REMASK       22     keyed sampling: the masked-diffusion samplers' ``remasking="random"`` scores
    RL_ELBO_TIME        23     RL (a dLLM policy): the ELBO estimate's masking rate of each Monte-Carlo sample
    RL_ELBO_MASK        24     RL (a dLLM policy): the ELBO estimate's masked completion positions
    ==================  =====  ====================================================================================

    The values are part of every run's noise: changing one changes the draws (and breaks the bit-exact resume of
    runs started before). Add a new kind of draw as a new member; never renumber. The corruption kernels use the
    values below :data:`FIRST_FAMILY_STREAM` (the Triton kernels of :mod:`lit_dllm.noise.fused_corruption` too);
    the families' own choices, through :func:`keyed_uniform`, the values from it on.
    """

    LEVEL = 0
    TOKEN_UNIFORM = 1
    GUMBEL = 2
    REPLACEMENT = 3
    CANVAS_BLOCK = 16
    SELF_CONDITIONING = 17
    DFLASH_ANCHOR = 18
    DFLASH_PREFIX = 19
    RL_PROMPT_MASK = 20
    RL_ROLLOUT = 21
    RANDOM_REMASK = 22
    RL_ELBO_TIME = 23
    RL_ELBO_MASK = 24


FIRST_FAMILY_STREAM = 16
"""Streams below this belong to the corruption kernels; :func:`keyed_uniform` refuses them."""


def _wrap64(value: int) -> int:
    """A Python int reduced mod 2**64 into the signed int64 range (torch constants must fit)."""
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >= 1 << 63 else value


_GOLDEN = _wrap64(0x9E3779B97F4A7C15)  # splitmix64 increment
_MIX1 = _wrap64(0xBF58476D1CE4E5B9)
_MIX2 = _wrap64(0x94D049BB133111EB)


def _shr(x: Tensor, n: int) -> Tensor:
    """Logical right shift of int64 (torch's ``>>`` is arithmetic)."""
    return (x >> n) & ((1 << (64 - n)) - 1)


def _mix64(x: Tensor) -> Tensor:
    """splitmix64 finaliser: a bijection on 64 bits with full avalanche (int64 mul wraps)."""
    x = (x ^ _shr(x, 30)) * _MIX1
    x = (x ^ _shr(x, 27)) * _MIX2
    return x ^ _shr(x, 31)


def _absorb(state: Tensor, value: Tensor | int) -> Tensor:
    """One splitmix64 step folding ``value`` into ``state``; bijective in each argument."""
    if isinstance(value, Tensor):
        return _mix64(state + (value + 1) * _GOLDEN)
    # A Python int stays a scalar operand: no host-to-device copy, so the kernels can be graph-captured.
    return _mix64(state + _wrap64((value + 1) * _GOLDEN))


def is_integer_tensor(x: object) -> bool:
    """Whether ``x`` is a tensor of integers (not float, complex or bool)."""
    return isinstance(x, Tensor) and not (x.is_floating_point() or x.is_complex() or x.dtype == torch.bool)


def example_keys(seed: int, example_index: Tensor, epoch: int = 0) -> Tensor:
    """One well-mixed int64 key per example from ``(seed, global example index, epoch or step)``.

    For a fixed ``(seed, epoch)`` distinct indices always get distinct keys (the map is a
    bijection); other collisions have probability ~2**-64. Any Python int is taken mod 2**64.
    """
    if not is_integer_tensor(example_index):
        got = getattr(example_index, "dtype", type(example_index))
        raise TypeError(f"example_index must be an integer tensor, got {got}; pass e.g. torch.arange(B)")
    try:
        seed, epoch = operator.index(seed), operator.index(epoch)
    except TypeError:
        raise TypeError(f"seed and epoch must be ints, got seed={seed!r}, epoch={epoch!r}") from None
    state = torch.zeros((), dtype=torch.int64, device=example_index.device)
    state = _absorb(_absorb(state, _wrap64(seed)), _wrap64(epoch))
    return _absorb(state, example_index.to(torch.int64))


def check_keys(keys: object, rows: int, device: torch.device) -> Tensor:
    """``keys`` as int64 on ``device``; a TypeError or ValueError naming the fix unless it is ``[rows]`` integers."""
    if not is_integer_tensor(keys):
        got = getattr(keys, "dtype", type(keys))
        raise TypeError(f"keys must be an integer tensor of shape [{rows}], got {got}; see example_keys")
    if tuple(keys.shape) != (rows,):
        raise ValueError(f"keys must have shape [{rows}] (one per row), got {tuple(keys.shape)}")
    return keys.to(device=device, dtype=torch.int64)


def _bits(keys: Tensor, stream: int, shape: tuple[int, ...], start: int = 0) -> Tensor:
    """``shape`` (``[B, *i]``) int64 hashes: element ``(b, *i)`` is ``(keys[b], stream, start + flat index of i)``."""
    counters = torch.arange(start, start + math.prod(shape[1:]), device=keys.device).view(shape[1:])
    row_state = _absorb(keys, stream).view(-1, *([1] * counters.dim()))
    return _absorb(row_state, counters)


def keyed_rand(keys: Tensor, stream: int, shape: tuple[int, ...], dtype: torch.dtype = torch.float32,
               start: int = 0) -> Tensor:
    """Uniforms in [0, 1) of ``shape`` (``[B, *i]``, one row per key): multiples of 2**-24 (the hash's 24 high bits),
    exact in float32. ``start`` reads each row's sequence from that counter on (e.g. a later step's draws)."""
    return (_shr(_bits(keys, stream, shape, start), 40).to(torch.float32) * 2.0**-24).to(dtype)


def keyed_randint(keys: Tensor, stream: int, high: int, shape: tuple[int, ...]) -> Tensor:
    """int64 uniforms in [0, high) of ``shape`` (``[B, *i]``): 62 hash bits reduced (bias < high / 2**62)."""
    return _shr(_bits(keys, stream, shape), 2) % high


def keyed_categorical(probs: Tensor, keys: Tensor, stream: int, start: int = 0) -> Tensor:
    """One index per row and position of ``probs`` ``[B, *i, V]`` (each ``[V]`` a distribution, normalised or not),
    drawn by inverse CDF from one keyed uniform (:func:`keyed_rand` at ``(keys[b], stream, start + flat index of
    i)``): distributed as ``torch.multinomial`` or Gumbel-max over ``log(probs)`` (to the uniforms' grain, 2**-24),
    hashing one number per position instead of one per token."""
    cdf = probs.float().cumsum(-1)
    uniforms = keyed_rand(keys, stream, tuple(probs.shape[:-1]), start=start)
    index = torch.searchsorted(cdf, (uniforms * cdf[..., -1])[..., None], right=True)
    return index.squeeze(-1).clamp_max(probs.shape[-1] - 1)


def keyed_uniform(keys: Tensor, stream: int, count: int | None = None) -> Tensor:
    """Uniforms in [0, 1) from a family's own ``stream`` (a :class:`Stream` >= :data:`FIRST_FAMILY_STREAM`): one per
    key (``[B]``), or ``[B, count]`` with element ``(b, i)`` hashed from ``(keys[b], stream, i)`` (column 0 is the
    one-per-key draw). A training step's other per-example choices (a canvas block, a self-conditioning coin,
    DFlash anchors) keyed like its noise, so they too are independent of batch composition, rank and
    accumulation split."""
    if stream < FIRST_FAMILY_STREAM:
        raise ValueError(
            f"stream={stream} is reserved for the corruption kernels; use a Stream >= {FIRST_FAMILY_STREAM} "
            "(add one to lit_dllm.noise.keys.Stream for a new kind of draw)."
        )
    keys = check_keys(keys, len(keys), keys.device)
    draws = keyed_rand(keys, stream, (len(keys), count or 1))
    return draws[:, 0] if count is None else draws
