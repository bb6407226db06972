"""Block-aligned padding of unshifted dLLM examples into batch tensors.

Each row becomes ``[content][block fill][global pad]``:

* content: the example's tokens (truncated at ``max_seq_len``);
* block fill: ``eos_token_id`` (else ``pad_token_id``) up to the row's fill end, always supervised;
* global pad: ``pad_token_id`` up to the batch length ``T``, supervised only with
  ``supervise_padding``.

Without ``response_window`` the fill end is the content length rounded up to a multiple of
``block_size`` and the fill is not attended (LLaDA / Nemotron). With it, the rounding is measured
from the first supervised token (the response start) and the fill is attended (Gemma canvases).
"""

from __future__ import annotations

import logging
import math
from typing import Any, Dict, List, Optional, Sequence

import torch
from torch import Tensor

logger = logging.getLogger(__name__)

PAD_TOKEN_IDS_KEY = "___PAD_TOKEN_IDS___"
"""Key some tokenisation pipelines attach to samples; dropped by the collator."""

_SEQUENCE_KEYS = ("input_ids", "loss_mask", "attention_mask")
_KNOWN_KEYS = frozenset(_SEQUENCE_KEYS) | {PAD_TOKEN_IDS_KEY, "example_index"}


class MultiTurnLossMaskError(ValueError, AssertionError):
    """A loss mask with several supervised runs reached the single-turn response-window collator."""


def _check_positive(name: str, value: Optional[int]) -> None:
    if value is not None and value <= 0:
        raise ValueError(f"{name} must be a positive int or None, got {value!r}.")


def _check_token_id(name: str, value: Optional[int], allow_none: bool) -> None:
    if value is None and allow_none:
        return
    if value is None or value < 0:
        raise ValueError(f"{name} must be a non-negative token id, got {value!r} (use the tokenizer's id).")


def _as_row(sample: Dict[str, Any], key: str, dtype: torch.dtype, row: int) -> Tensor:
    values = sample[key]
    listed = values if isinstance(values, (list, tuple)) else ()
    text = values if isinstance(values, str) else next((v for v in listed if isinstance(v, str)), None)
    if text is not None:
        raise ValueError(
            f"Sample {row}: {key} must be integer token ids, got {text!r} (str); tokenize the text first "
            "(tokenizer(text)['input_ids']) instead of passing strings."
        )
    values = torch.as_tensor(values)
    if values.dim() != 1:
        raise ValueError(f"Sample {row}: {key} must be a list or 1-D tensor, got shape {tuple(values.shape)}.")
    if key == "input_ids" and len(values) and (values.is_floating_point() or values.dtype == torch.bool):
        fractional = values[values.double() != values.double().trunc()]
        bad = (fractional if len(fractional) else values)[0].item()  # the first non-integral value, else the first
        raise ValueError(
            f"Sample {row}: input_ids must be integer token ids, got {bad!r} ({values.dtype}); convert them "
            "to ints in the dataset's tokenisation step instead of rounding here."
        )
    return values.to(dtype)


def _cat(rows: List[Tensor], dtype: torch.dtype) -> Tensor:
    return torch.cat(rows) if rows else torch.zeros(0, dtype=dtype)


class DLLMCollator:
    """Collate unshifted ``{input_ids, loss_mask[, attention_mask, example_index]}`` samples.

    Returns ``input_ids`` / ``attention_mask`` (long, ``[B, T]``), ``loss_mask`` (float32,
    ``[B, T]``), ``input_lengths`` (long ``[B]``, raw lengths before truncation) and, when the
    samples carry it, ``example_index`` (long ``[B]``). A missing ``attention_mask`` means all ones.
    ``input_ids`` must be non-negative integers: a float (even 3.0) or negative id raises, naming the sample.

    Args:
        pad_token_id: token of the global padding.
        eos_token_id: token of the block fill; ``pad_token_id`` when None.
        block_size: round each row's fill end to this block size (None or 1: no fill).
        pad_seq_len_divisible: round ``T`` up to a multiple of ``lcm(block_size or 1, this)``.
        max_seq_len: truncate rows and cap ``T`` at this length.
        supervise_padding: set ``loss_mask=1`` on the global padding too.
        response_window: response-relative, attended fill; rejects multi-turn loss masks.
    """

    def __init__(
        self,
        pad_token_id: int = 0,
        eos_token_id: Optional[int] = None,
        block_size: Optional[int] = None,
        pad_seq_len_divisible: Optional[int] = None,
        max_seq_len: Optional[int] = None,
        supervise_padding: bool = False,
        response_window: bool = False,
    ) -> None:
        _check_token_id("pad_token_id", pad_token_id, allow_none=False)
        _check_token_id("eos_token_id", eos_token_id, allow_none=True)
        _check_positive("block_size", block_size)
        _check_positive("pad_seq_len_divisible", pad_seq_len_divisible)
        _check_positive("max_seq_len", max_seq_len)
        if block_size is not None and max_seq_len is not None and block_size > max_seq_len:
            raise ValueError(
                f"block_size={block_size} is larger than max_seq_len={max_seq_len}: no row could hold a whole block. "
                "Lower the block size or raise max_seq_len."
            )
        self.pad_token_id = pad_token_id
        self.eos_token_id = eos_token_id
        self.block_size = block_size
        self.pad_seq_len_divisible = pad_seq_len_divisible
        self.max_seq_len = max_seq_len
        self.supervise_padding = supervise_padding
        self.response_window = response_window
        self._warned_truncation = False

    @property
    def block_fill_token_id(self) -> int:
        return self.pad_token_id if self.eos_token_id is None else self.eos_token_id

    def __call__(self, batch: Sequence[Dict[str, Any]]) -> Dict[str, Tensor]:
        ids, loss, attn, example_index = self._rows(batch)
        lengths = torch.tensor([len(row) for row in ids], dtype=torch.long)
        flat_ids, flat_loss, flat_attn = _cat(ids, torch.long), _cat(loss, torch.float32), _cat(attn, torch.long)
        row_of = torch.repeat_interleave(torch.arange(len(ids)), lengths)
        negative = torch.nonzero(flat_ids < 0).flatten()
        if len(negative):
            position = int(negative[0])
            raise ValueError(
                f"Sample {int(row_of[position])}: input_ids holds the negative id {int(flat_ids[position])}; "
                "token ids are non-negative vocabulary indices."
            )
        pos_in_row = torch.arange(len(flat_ids)) - (torch.cumsum(lengths, 0) - lengths)[row_of]

        if self.response_window:
            supervised = flat_loss != 0
            self._check_single_turn(supervised, row_of, pos_in_row, len(ids))
            prefix = self._first_supervised(supervised, row_of, pos_in_row, lengths)
        else:
            prefix = torch.zeros_like(lengths)
        fill_ends = self._fill_ends(lengths, prefix)
        target_len = self._target_length(fill_ends)
        self._log_truncation(lengths, target_len)

        layout = _Layout(row_of, pos_in_row, lengths, fill_ends, target_len)
        out = {
            "input_ids": layout(flat_ids, self.block_fill_token_id, self.pad_token_id),
            "loss_mask": layout(flat_loss, 1.0, float(self.supervise_padding)),
            "attention_mask": layout(flat_attn, int(self.response_window), 0),
            "input_lengths": lengths,
        }
        if example_index is not None:
            out["example_index"] = example_index
        return out

    def _rows(self, batch: Sequence[Dict[str, Any]]):
        """Validate the samples and convert their sequences to 1-D tensors."""
        ids, loss, attn, indices = [], [], [], []
        for row, sample in enumerate(batch):
            unknown = sorted(set(sample) - _KNOWN_KEYS)
            if unknown:
                raise ValueError(
                    f"Sample {row} has unexpected key(s) {unknown}; the collator accepts "
                    f"{sorted(_KNOWN_KEYS)}. Remove them in the dataset's formatting step."
                )
            for key in ("input_ids", "loss_mask"):
                if key not in sample:
                    raise ValueError(f"Sample {row} has no {key!r}; produce unshifted examples with {_SEQUENCE_KEYS}.")
            ids.append(_as_row(sample, "input_ids", torch.long, row))
            loss.append(_as_row(sample, "loss_mask", torch.float32, row))
            if "attention_mask" in sample:
                attn.append(_as_row(sample, "attention_mask", torch.long, row))
            else:
                attn.append(torch.ones_like(ids[-1]))
            shapes = {key: len(t) for key, t in zip(_SEQUENCE_KEYS, (ids[-1], loss[-1], attn[-1]))}
            if len(set(shapes.values())) > 1:
                raise ValueError(f"Sample {row} has sequences of different lengths {shapes}; they must be equal.")
            if "example_index" in sample:
                indices.append(int(sample["example_index"]))
        if indices and len(indices) != len(batch):
            raise ValueError(
                f"Only {len(indices)} of {len(batch)} samples carry 'example_index'; attach it to all or none."
            )
        example_index = torch.tensor(indices, dtype=torch.long) if indices else None
        return ids, loss, attn, example_index

    @staticmethod
    def _check_single_turn(supervised: Tensor, row_of: Tensor, pos_in_row: Tensor, batch_size: int) -> None:
        """Raise if any row's raw loss mask has more than one maximal run of supervised tokens."""
        previous = torch.cat([supervised.new_zeros(1), supervised[:-1]]) & (pos_in_row > 0)
        run_starts = supervised & ~previous
        runs_per_row = torch.bincount(row_of[run_starts], minlength=batch_size)
        bad_rows = torch.nonzero(runs_per_row > 1).flatten().tolist()
        if bad_rows:
            raise MultiTurnLossMaskError(
                f"Batch row(s) {bad_rows} have {runs_per_row[bad_rows].tolist()} separate supervised runs in "
                "loss_mask (multi-turn), but response_window=True supports one response per example. "
                "Format the examples with mask_history=True so only the last turn is supervised."
            )

    @staticmethod
    def _first_supervised(supervised: Tensor, row_of: Tensor, pos_in_row: Tensor, lengths: Tensor) -> Tensor:
        """Per-row index of the first supervised token (the response start), else the row length."""
        return lengths.clone().scatter_reduce_(0, row_of[supervised], pos_in_row[supervised], reduce="amin")

    def _fill_ends(self, lengths: Tensor, prefix: Tensor) -> Tensor:
        """End of each row's block fill: the response length rounded up to whole blocks."""
        content = lengths if self.max_seq_len is None else lengths.clamp(max=self.max_seq_len)
        if self.block_size is None or self.block_size <= 1:
            return content
        start = torch.minimum(prefix, content)
        blocks = torch.div(content - start + self.block_size - 1, self.block_size, rounding_mode="floor")
        return start + blocks * self.block_size

    @property
    def row_multiple(self) -> int | None:
        """The multiple a batch's width is rounded up to, ``lcm(block_size or 1, pad_seq_len_divisible)`` (1 for
        ``pad_seq_len_divisible: 1``; None: not rounded; ``max_seq_len`` still caps it)."""
        if self.pad_seq_len_divisible is None:
            return None
        return math.lcm(self.block_size or 1, self.pad_seq_len_divisible) if self.pad_seq_len_divisible > 1 else 1

    def _target_length(self, fill_ends: Tensor) -> int:
        target = int(fill_ends.max()) if len(fill_ends) else 0
        if self.row_multiple:
            target = -(-target // self.row_multiple) * self.row_multiple
        if self.max_seq_len is not None:
            target = min(target, self.max_seq_len)
        return max(target, 1)

    def _log_truncation(self, lengths: Tensor, target_len: int) -> None:
        truncated = int((lengths > target_len).sum())
        if truncated:
            level = logging.DEBUG if self._warned_truncation else logging.WARNING
            logger.log(level, "Truncated %d row(s) longer than max_seq_len=%s.", truncated, self.max_seq_len)
            self._warned_truncation = True


class _Layout:
    """Where a batch's content, block fill and padding go in the ``[B, T]`` output."""

    def __init__(self, row_of: Tensor, pos_in_row: Tensor, lengths: Tensor, fill_ends: Tensor, target_len: int):
        positions = torch.arange(target_len).unsqueeze(0)
        self.fill = (positions >= lengths.unsqueeze(1)) & (positions < fill_ends.unsqueeze(1))
        self.kept = pos_in_row < target_len
        self.content_index = (row_of[self.kept], pos_in_row[self.kept])

    def __call__(self, flat: Tensor, fill_value: float, pad_value: float) -> Tensor:
        """Scatter the flat row contents, set the fill region, pad the rest."""
        out = torch.full(self.fill.shape, pad_value, dtype=flat.dtype)
        out[self.fill] = fill_value
        out[self.content_index] = flat[self.kept]
        return out
