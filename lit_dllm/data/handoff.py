"""The one hand-off between the data module and the module, declared: what each needs of the other.

At ``setup`` the module states what it requires of its batches (:class:`DataNeeds`) and the data module, having
checked them, answers with what the module needs to know of the data (:class:`DataFacts`): one call each way,
``module.connect(datamodule.connect(module.data_needs()))`` (``TokenizerMixin.setup`` makes it). Neither reads the
other's settings.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from transformers import PreTrainedTokenizerBase


def _packs_anything(fill_block_size: int | None) -> str | None:
    return None


@dataclass(frozen=True)
class DataNeeds:
    """What a module requires of its batches.

    Attributes:
        module: the module's class name, for messages.
        collation: the :class:`~lit_dllm.settings.Collation` values it needs (e.g. ``{"pad_block_size": 4,
            "response_window": True}``; empty: any).
        packing_problem: why it cannot train on packed rows whose documents are filled to multiples of a
            ``pad_block_size`` (the argument), or None when it can.
    """

    module: str
    collation: dict[str, Any] = field(default_factory=dict)
    packing_problem: Callable[[int | None], str | None] = _packs_anything


@dataclass(frozen=True)
class DataFacts:
    """What a module learns of its data: the tokenizer that made the batches, their longest row, how many examples
    a training batch holds on each device and the multiple its rows' width is rounded up to (None: not rounded)."""

    tokenizer: PreTrainedTokenizerBase
    max_seq_len: int
    batch_size: int
    row_multiple: int | None = None
