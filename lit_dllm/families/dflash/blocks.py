"""DFlash's blocks (docs/DESIGN.md §10.2, §10.3), plain PyTorch: where each row's blocks start and what the draft
reads and is scored on in them.

A block of ``bs`` tokens starts at an anchor ``a``, where serving would put one (:func:`anchor_candidates`); ``N``
anchors per row are drawn keyed per example (:func:`sample_anchors`), and :func:`build_blocks` turns them into the
draft's inputs ``[x_a, MASK, ..., MASK]`` (the first ``ℓ`` tokens real in variable-prefix mode:
:func:`sample_prefix_lengths`) at positions ``a .. a+bs-1``, their targets ``a+1 .. a+bs-1`` and the targets' decay
weights (γ: :func:`default_loss_gamma`). Under context parallelism each rank takes its share of the blocks
(:func:`shard_blocks`).

Packed rows (:class:`~lit_dllm.data.packing.PackedCollator`'s, several documents side by side) train as their documents
would alone: anchors are drawn on each document as a row of its own (:class:`~lit_dllm.data.packing.DocumentView`,
keyed by the document), ``num_anchors`` per document, and placed in the packed row that holds it
(:func:`place_blocks`); a block's inputs and targets stop at its document's end (as they stop at a row's end), and its
positions are the document's.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from lit_dllm.noise.keys import Stream, keyed_uniform
from lit_dllm.families.dflash.loss import DFlashDecayLoss

DEFAULT_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}
"""Decay γ of the DFlash loss per block size (docs/DESIGN.md §10.5); other sizes get ``max(2, bs / 2)``."""

LOSS_TYPES = ("dflash", "variable_prefix")
"""The ``loss_type`` choices, one per block layout: plain DFlash blocks ``[x_a, MASK, ...]`` or variable-prefix ones
(:func:`sample_prefix_lengths`)."""


def default_loss_gamma(block_size: int) -> float:
    """γ of the position decay ``exp(-(k-1)/γ)``: 7 / 5 / 4 at block sizes 16 / 10 / 8, else ``max(2, bs/2)``."""
    return DEFAULT_GAMMA.get(block_size, max(2.0, block_size / 2))


class Blocks(NamedTuple):
    """The blocks of one micro-batch: ``anchors`` ``[B, N]`` (0 where not kept), ``keep`` ``[B, N]`` bool and
    ``prefix`` ``[B, N]`` (real tokens at the start of each block: 1 for plain DFlash, ``ℓ`` in variable-prefix)."""

    anchors: Tensor
    keep: Tensor
    prefix: Tensor


def anchor_candidates(scored: Tensor, block_size: int) -> Tensor:
    """``[B, S]`` bool: the positions a block can start at, i.e. where serving puts one.

    Serving anchors each block on the last committed token, a response token ``a >= 1`` (the prompt's last token
    is never one: the target's prefill commits the first response token). So a candidate is a scored token
    (``scored``: supervised and the example's own, not padding) at ``a >= 1`` with at least one scored token among
    ``a+1 .. a+bs-1``; blocks running past the row's end keep their in-bounds targets (short answers are mostly
    partial blocks)."""
    rows, length = scored.shape
    ahead = F.pad(scored.int(), (1, block_size)).cumsum(1)  # ahead[:, j] = scored tokens before position j
    index = torch.arange(length, device=scored.device)
    following = ahead[:, index + block_size] - ahead[:, index + 1]  # scored tokens in a+1 .. a+bs-1
    candidates = scored & (following > 0)
    candidates[:, 0] = False
    return candidates


def sample_anchors(candidates: Tensor, keys: Tensor, num_anchors: int, block_size: int, overlap: bool = True) -> Blocks:
    """``num_anchors`` blocks per row, keyed by example (never by batch, rank or accumulation split).

    ``overlap=True`` (default; docs/DESIGN.md §10.2's overlapping draw): each block's anchor is uniform over the row's
    candidates, independently, with replacement, so blocks may overlap or repeat. A row without candidates keeps no
    block.

    ``overlap=False``: disjoint blocks per row in the span ``[lo, hi]`` of its candidates: ``n = min(num_anchors,
    (hi - lo) // bs + 1)`` blocks (always >= 1), slack ``s = hi - lo - (n - 1) bs >= 0``, sorted offsets
    ``g_1 <= .. <= g_n`` drawn uniformly from ``0..s``, anchors ``lo + g_k + (k - 1) bs``; blocks ``n+1..N`` are not
    kept. Valid for every length (the reference draws distinct offsets with ``randperm(avail)[:n]`` and crashes when
    ``1 < avail < n``, docs/DESIGN.md §14 (b)); an anchor between two supervised regions only scores its supervised
    targets.
    """
    rows, length = candidates.shape
    device = candidates.device
    counts = candidates.sum(1)
    uniforms = keyed_uniform(keys, Stream.DFLASH_ANCHOR, num_anchors)
    slots = torch.arange(num_anchors, device=device)
    ones = torch.ones(rows, num_anchors, dtype=torch.long, device=device)
    if overlap:
        positions = torch.where(candidates, torch.arange(length, device=device), length).sort(1).values
        picks = (uniforms * counts[:, None]).long().clamp(min=0)
        picks = torch.minimum(picks, (counts[:, None] - 1).clamp(min=0))
        anchors = positions.gather(1, picks).sort(1).values  # in position order
        keep = (counts > 0)[:, None].expand(rows, num_anchors)
    else:
        index = torch.arange(length, device=device).expand(rows, length)
        lo = torch.where(candidates, index, length).min(1).values
        hi = torch.where(candidates, index, -1).max(1).values
        span = (hi - lo).clamp(min=0)
        blocks = torch.clamp(span // block_size + 1, max=num_anchors)
        slack = span - (blocks - 1) * block_size
        offsets = (uniforms * (slack + 1)[:, None]).long()
        keep = (slots[None] < blocks[:, None]) & (counts > 0)[:, None]
        offsets = torch.where(keep, offsets, slack[:, None]).sort(1).values  # kept offsets first, ascending
        anchors = lo[:, None] + offsets + slots[None] * block_size
    return Blocks(torch.where(keep, anchors, 0), keep, ones)


def sample_prefix_lengths(keys: Tensor, num_anchors: int, block_size: int, base: float) -> Tensor:
    """Variable-prefix mode (docs/DESIGN.md §10.3): ``[B, N]`` prefix lengths ``ℓ`` in ``[min(2, bs-1), bs-1]``,
    drawn with probability proportional to ``base ** ℓ``, keyed by example."""
    lengths = torch.arange(min(2, block_size - 1), block_size, device=keys.device)
    weights = torch.tensor(base, dtype=torch.float64, device=keys.device) ** lengths
    cdf = (weights.cumsum(0) / weights.sum()).float()
    uniforms = keyed_uniform(keys, Stream.DFLASH_PREFIX, num_anchors)
    return lengths[torch.searchsorted(cdf, uniforms.contiguous(), right=True).clamp(max=len(lengths) - 1)]


def place_blocks(blocks: Blocks, document_offsets: Tensor, rows: int, length: int) -> Blocks:
    """Packed rows: the blocks of each document (``[D, N]``, drawn on the document as a row of its own), placed in the
    packed row that holds it, ``[R, M * N]`` with ``M`` the most documents of a row: slots ``k N .. (k + 1) N - 1`` of
    row ``r`` hold the blocks of its ``k``-th document, anchors moved by the document's start in the row; the spare
    slots of rows with fewer documents keep no block. ``document_offsets`` (``[D]``, starts in the flattened ``[R *
    length]`` batch) number the documents row after row, as :class:`~lit_dllm.data.packing.PackedCollator` does. One
    device-to-host read (``M``)."""
    anchors, keep, prefix = blocks
    documents, num = anchors.shape
    row, start = document_offsets // length, document_offsets % length
    per_row = torch.bincount(row, minlength=rows)
    rank = torch.arange(documents, device=anchors.device) - (per_row.cumsum(0) - per_row)[row]  # k in its row
    most = int(per_row.max())
    slots = row * most + rank

    def place(values: Tensor, fill: int | bool) -> Tensor:
        return values.new_full((rows * most, num), fill).index_copy_(0, slots, values).view(rows, most * num)

    return Blocks(place(torch.where(keep, anchors + start[:, None], 0), 0), place(keep, False), place(prefix, 1))


class BlockBatch(NamedTuple):
    """Everything the draft forward needs for one micro-batch of ``N`` blocks of ``bs`` per row."""

    block_ids: Tensor  # [B, N*bs] block inputs: the prefix's real tokens, then MASK
    positions: Tensor  # [B, S + N*bs] positions: context 0..S-1, block n offset k -> a_n + k
    targets: Tensor  # [B, N*(bs-1)] token a+k for offsets k = 1..bs-1
    scored: Tensor  # [B, N*(bs-1)] bool: kept, in the row, supervised, and past the prefix
    weights: Tensor  # [B, N*(bs-1)] float: each target's loss weight (0 where not scored)
    block_mask: Tensor  # what the loss takes as block_mask: `scored` (DFlash), `weights` (variable prefix)
    blocks: Blocks
    document_ids: Tensor | None = None  # [B, S] packed rows' document of each position; None: one example per row

    @property
    def context_length(self) -> int:
        """``S``: the positions of the whole rows' context (before the blocks' positions)."""
        return self.positions.shape[1] - self.block_ids.shape[1]


def build_blocks(
    input_ids: Tensor,
    scored_tokens: Tensor,
    blocks: Blocks,
    block_size: int,
    mask_token_id: int,
    loss_gamma: float | None,
    variable_prefix: bool = False,
    *,
    document_ids: Tensor | None = None,
    position_ids: Tensor | None = None,
) -> BlockBatch:
    """Block inputs, positions, targets and loss weights of ``blocks`` (docs/DESIGN.md §10.3).

    Targets: block offset ``k`` <-> token ``a+k``, offset 0 (the anchor) dropped; scored where the block is kept,
    ``a+k`` lies in the row and ``scored_tokens[a+k]``. Weights: :class:`DFlashDecayLoss`'s decay ``exp(-(k-1)/γ)``
    (plain DFlash), or ``exp(-(k-ℓ)/γ)`` for ``k >= ℓ`` in variable-prefix mode, whose first ``ℓ`` block tokens are
    real (``loss_gamma=None``: weight 1).

    Packed rows (the batch's ``document_ids`` and ``position_ids``): a block ends where its anchor's document ends, as
    it ends at a row's end (past it no real input, no target), and its positions are its document's."""
    rows, length = input_ids.shape
    anchors, keep, prefix = blocks
    num = anchors.shape[1]
    offsets = torch.arange(block_size, device=input_ids.device)
    where = anchors[:, :, None] + offsets  # [B, N, bs] absolute positions
    inside = where < length
    flat = where.clamp(max=length - 1).flatten(1)
    if document_ids is not None:
        inside &= document_ids.gather(1, flat).view_as(where) == document_ids.gather(1, anchors)[:, :, None]
    tokens = input_ids.gather(1, flat).view(rows, num, block_size)
    real = (offsets < prefix[:, :, None]) & keep[:, :, None] & inside
    block_ids = torch.where(real, tokens, mask_token_id).flatten(1)
    if position_ids is None:
        position_ids = torch.arange(length, device=input_ids.device).expand(rows, length)
    positions = torch.cat([position_ids, (position_ids.gather(1, anchors)[:, :, None] + offsets).flatten(1)], dim=1)
    scored = scored_tokens.gather(1, flat).view(rows, num, block_size) & inside & keep[:, :, None]
    scored = (scored & (offsets >= prefix[:, :, None]))[:, :, 1:].flatten(1)
    if variable_prefix:
        distance = (offsets[1:] - prefix[:, :, None]).float().flatten(1)
        weights = torch.ones_like(distance) if loss_gamma is None else torch.exp(-distance / loss_gamma)
    else:
        decay = DFlashDecayLoss(loss_gamma).decay_weights(num * (block_size - 1), block_size, input_ids.device)
        weights = decay.expand(rows, -1)
    weights = torch.where(scored, weights, 0.0)
    block_mask = weights if variable_prefix else scored
    return BlockBatch(block_ids, positions, tokens[:, :, 1:].flatten(1), scored, weights, block_mask, blocks,
                      document_ids)


def shard_blocks(batch: BlockBatch, rank: int, size: int, block_size: int) -> BlockBatch:
    """Context-parallel rank ``rank`` of ``size``: its share of the ``N`` blocks of every row, blocks
    ``[rank N / size, (rank + 1) N / size)`` (``N`` divisible by ``size``), with the whole rows' context positions and
    documents (blocks attend to the context and to themselves only, so a share is scored as in the whole)."""
    anchors, keep, prefix = batch.blocks
    count = anchors.shape[1] // size

    def share(per_block: int) -> slice:  # this rank's entries of a row holding ``per_block`` entries a block
        return slice(rank * count * per_block, (rank + 1) * count * per_block)

    blocks, tokens, targets = share(1), share(block_size), share(block_size - 1)
    context = batch.context_length
    positions = torch.cat([batch.positions[:, :context], batch.positions[:, context:][:, tokens]], dim=1)
    return BlockBatch(batch.block_ids[:, tokens], positions, batch.targets[:, targets], batch.scored[:, targets],
                      batch.weights[:, targets], batch.block_mask[:, targets],
                      Blocks(anchors[:, blocks], keep[:, blocks], prefix[:, blocks]), batch.document_ids)
