"""Packing: documents (tokenised examples) laid side by side in fixed-length rows, and the per-document view of
such rows.

A packed batch is what :class:`PackedCollator` returns: ``input_ids`` / ``attention_mask`` (long ``[R, P]``),
``loss_mask`` (float32 ``[R, P]``), and per token ``position_ids`` (restarting at 0 in each document and in the
row's tail padding, so no position exceeds the longest document) and
``document_ids`` (the document's number in the batch, ``-1`` on the row's tail padding); per document (``[D]``,
long): ``example_index`` (keys its noise), ``input_lengths`` (its own tokens, without block fill),
``document_offsets`` (where it starts in the flattened ``[R * P]`` batch) and ``document_spans`` (its tokens plus
block fill). Each document is laid out exactly as :class:`~lit_dllm.data.collate.DLLMCollator` lays out a row of
its own (content, then block fill up to a multiple of ``block_size``), so a family that attends within documents
(:func:`~lit_dllm.attention.document_mask`) and draws noise per document (:class:`DocumentView`) computes the same
loss as on the documents alone.

Rows are filled by best-fit decreasing within windows of documents (:func:`pack_documents`): the documents of a
window, longest first, each go into the open row with the least room that still holds it.
"""

from __future__ import annotations

import bisect
import logging
from typing import Any, Sequence

import numpy as np
import torch
from torch import Tensor

from lit_dllm.data.collate import DLLMCollator

__all__ = ["PackedCollator", "DocumentView", "pack_documents", "pack_windows", "packed_rows", "span_length"]

log = logging.getLogger(__name__)


def span_length(length: int, block_size: int | None) -> int:
    """Tokens a document of ``length`` tokens takes in a row: its length rounded up to whole blocks."""
    if not block_size or block_size <= 1:
        return length
    return -(-length // block_size) * block_size


def pack_documents(spans: Sequence[int], capacity: int) -> list[list[int]]:
    """Best-fit decreasing: the positions of ``spans`` grouped into rows of at most ``capacity`` tokens.

    Documents are placed longest first (ties: the earlier first), each into the open row whose free room is the
    smallest that still holds it, else into a new row; a row keeps its documents in placement order. Deterministic.
    A span longer than ``capacity`` is a ValueError (split or drop such documents before packing).
    """
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (free room, row number), sorted
    for i in sorted(range(len(spans)), key=lambda i: (-spans[i], i)):
        need = int(spans[i])
        if not 0 < need <= capacity:
            raise ValueError(f"Document {i} takes {need} tokens; a packed row holds 1 to {capacity}.")
        slot = bisect.bisect_left(free, (need, -1))
        if slot == len(free):
            rows.append([i])
            room, row = capacity - need, len(rows) - 1
        else:
            room, row = free.pop(slot)
            rows[row].append(i)
            room -= need
        if room:
            bisect.insort(free, (room, row))
    return rows


def pack_windows(order: Sequence[int], spans: Sequence[int], capacity: int, window: int) -> list[list[int]]:
    """The documents ``order`` (indices into ``spans``) packed window by window: each run of ``window`` documents of
    ``order`` is packed on its own (:func:`pack_documents`), so a document moves at most one window from its place
    in the order. Returns rows of indices into ``spans``."""
    rows = []
    for start in range(0, len(order), window):
        chunk = list(order[start : start + window])
        rows += [[chunk[j] for j in row] for row in pack_documents([spans[i] for i in chunk], capacity)]
    return rows


def packed_rows(lengths: Sequence[int], block_size: int | None, capacity: int, window: int, seed: int) -> list[list[int]]:
    """A split's documents of these ``lengths`` packed into rows once: a seeded order, packed window by window
    (:func:`pack_windows`); logs how full the rows are."""
    spans = [span_length(int(length), block_size) for length in lengths]
    order = np.random.default_rng([seed, len(lengths)]).permutation(len(lengths)).tolist()
    rows = pack_windows(order, spans, capacity, window)
    log.info("Packed %d training examples into %d rows of %d tokens: %.1f%% of the rows' tokens are the examples' "
             "own (block fill included: %.1f%%).", len(lengths), len(rows), capacity,
             100 * int(np.sum(lengths)) / (len(rows) * capacity), 100 * sum(spans) / (len(rows) * capacity))
    return rows


class PackedCollator:
    """Collate rows of documents (a list of rows, each a list of unshifted examples) into a packed batch of rows of
    ``pack_length`` tokens (the module docstring lists its keys).

    Args:
        collator: lays out each document (its block fill, ``pad_token_id``); its ``max_seq_len`` must not be below
            ``pack_length`` and it must not supervise padding (a packed row has none of its own to supervise).
        pack_length: tokens per row.
    """

    def __init__(self, collator: DLLMCollator, pack_length: int) -> None:
        if pack_length <= 0:
            raise ValueError(f"pack_length must be a positive number of tokens, got {pack_length!r}.")
        if collator.supervise_padding:
            raise ValueError("supervise_padding supervises a row's padding, which packed rows give to other documents; "
                             "set supervise_padding: false to pack (each document's block fill stays supervised).")
        if collator.response_window:
            raise ValueError("response_window lays out one response per row; it cannot be packed.")
        if collator.max_seq_len is not None and collator.max_seq_len < pack_length:
            raise ValueError(f"max_seq_len={collator.max_seq_len} is below pack_length={pack_length}.")
        self.collator, self.pack_length = collator, pack_length

    def span(self, length: int) -> int:
        """Tokens a document of ``length`` tokens takes in a row."""
        return span_length(length, self.collator.block_size)

    def __call__(self, rows: Sequence[Sequence[dict[str, Any]]]) -> dict[str, Tensor]:
        documents = [document for row in rows for document in row]
        if not documents:
            raise ValueError("A packed batch needs at least one document.")
        laid = self.collator(documents)  # [D, T]: each document as a row of its own
        lengths = laid["input_lengths"]
        spans = torch.tensor([self.span(int(n)) for n in lengths], dtype=torch.long)
        if int(spans.max()) > self.pack_length:
            longest = int(spans.argmax())
            raise ValueError(f"Document {longest} takes {int(spans[longest])} tokens (block fill included), more than "
                             f"a packed row of {self.pack_length}; split or drop it before packing.")
        row_of = torch.repeat_interleave(torch.arange(len(rows)), torch.tensor([len(row) for row in rows]))
        used = torch.zeros(len(rows), dtype=torch.long).index_add_(0, row_of, spans)
        if int(used.max()) > self.pack_length:
            raise ValueError(f"Row {int(used.argmax())} holds {int(used.max())} tokens, more than pack_length="
                             f"{self.pack_length}; pack it again.")
        starts = torch.cumsum(spans, 0) - spans  # the documents, row after row
        offsets = starts - (torch.cumsum(used, 0) - used)[row_of]  # within the row
        return self._lay_out(laid, row_of, offsets, spans, used)

    def _lay_out(self, laid: dict, row_of: Tensor, offsets: Tensor, spans: Tensor, used: Tensor) -> dict[str, Tensor]:
        """Scatter each document's first ``span`` tokens of ``laid`` to its row and offset."""
        width = laid["input_ids"].shape[1]
        inside = torch.arange(width)[None, :] < spans[:, None]  # [D, T]
        doc, col = inside.nonzero(as_tuple=True)
        target = (row_of[doc] * self.pack_length + offsets[doc] + col)
        num_rows = len(used)
        size = num_rows * self.pack_length

        def scatter(values: Tensor, pad: float) -> Tensor:
            out = torch.full((size,), pad, dtype=values.dtype)
            out[target] = values[doc, col]
            return out.view(num_rows, self.pack_length)

        batch = {
            "input_ids": scatter(laid["input_ids"], self.collator.pad_token_id),
            "loss_mask": scatter(laid["loss_mask"], 0.0),
            "attention_mask": scatter(torch.ones_like(laid["input_ids"]), 0),  # the documents' tokens, fill included
        }
        positions = (torch.arange(size) % self.pack_length).view(num_rows, -1)
        positions = (positions - used[:, None]).clamp(min=0).flatten()  # the tail padding counts from 0 too
        positions[target] = col
        document_ids = torch.full((size,), -1, dtype=torch.long)
        document_ids[target] = doc
        batch.update(
            position_ids=positions.view(num_rows, -1),
            document_ids=document_ids.view(num_rows, -1),
            input_lengths=laid["input_lengths"],
            document_offsets=row_of * self.pack_length + offsets,
            document_spans=spans,
        )
        if "example_index" in laid:
            batch["example_index"] = laid["example_index"]
        return batch


class DocumentView:
    """The documents of a packed batch as rows of their own, ``[D, P]`` (``P`` the packed row length; each document
    at the start of its row, the rest filled), and back: what per-document work (keyed noise, anchors) runs on, so
    that a document draws the same noise packed or alone. Index arithmetic on the batch's device: no host sync."""

    def __init__(self, batch: dict) -> None:
        ids = batch["input_ids"]
        self.shape, self.size = ids.shape, ids.numel()
        columns = torch.arange(ids.shape[1], device=ids.device)
        self.inside = columns[None, :] < batch["document_spans"][:, None]  # [D, P]
        index = batch["document_offsets"][:, None] + columns[None, :]
        self.index = torch.where(self.inside, index, self.size)  # outside a document: one spare slot past the end

    def gather(self, values: Tensor, fill: float | int = 0) -> Tensor:
        """``values`` (``[R, P]``, packed) as ``[D, P]`` document rows, ``fill`` past each document's end."""
        flat = torch.cat([values.flatten(), values.new_full((1,), fill)])
        return flat[self.index]

    def scatter(self, values: Tensor, into: Tensor) -> Tensor:
        """``into`` (``[R, P]``) with each document's positions replaced by its row of ``values`` (``[D, P]``)."""
        flat = torch.cat([into.flatten(), into.new_zeros(1)]).to(values.dtype)
        flat = flat.scatter(0, self.index.flatten(), values.flatten())
        return flat[:-1].view(self.shape)


class PackedRows(torch.utils.data.Dataset):
    """Examples read a packed row at a time: item ``row`` (a list of example indices, as
    :class:`~lit_dllm.data.loader.EpochBatchSampler` gives with ``rows``) is the list of those examples."""

    def __init__(self, examples) -> None:
        self.examples = examples

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, row: Sequence[int]) -> list[dict[str, Any]]:
        return [self.examples[int(index)] for index in row]
