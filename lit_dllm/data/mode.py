"""The data module's mode, chosen once from its settings: what a training batch is, and so which encoder, loader and
collator serve it. Every other part of :mod:`lit_dllm.data` asks the mode, never the four flags behind it."""

from __future__ import annotations

import enum

from lit_dllm.settings import Collation, DataSource, Formatting, Loader


class Mode(enum.Enum):
    """What a training batch is.

    - ``PADDED``: one example a row, padded to the batch's longest (the default).
    - ``PACKED``: rows of ``max_seq_len`` tokens holding whole examples, packed once (``collation.pack``).
    - ``STREAMED``: packed rows of a corpus read as a stream (``source.streaming``, which needs ``collation.pack``).
    - ``PROMPTS``: prompts with their raw columns, for RL post-training (``collation.prompts``).

    Evaluation batches are one example a row in every mode but ``PROMPTS``.
    """

    PADDED = "padded"
    PACKED = "packed"
    STREAMED = "streamed"
    PROMPTS = "prompts"

    @classmethod
    def of(cls, source: DataSource, collation: Collation) -> Mode:
        """The mode the flags ``source.streaming``, ``collation.pack`` and ``collation.prompts`` choose; a combination
        that names no mode is a ``ValueError`` with the fix (``pack`` with ``prompts``: :meth:`Collation.check`)."""
        if source.streaming and collation.prompts:
            raise ValueError("collation.prompts serves the prompts of a split read whole: set source.streaming: false.")
        if source.streaming and not collation.pack:
            raise ValueError("source.streaming packs its documents into rows on the fly: set collation.pack: true.")
        if source.streaming:
            return cls.STREAMED
        return cls.PROMPTS if collation.prompts else cls.PACKED if collation.pack else cls.PADDED

    @property
    def packs(self) -> bool:
        """Whether training rows hold several examples (documents)."""
        return self in (Mode.PACKED, Mode.STREAMED)

    def pack_text(self, formatting: Formatting) -> bool:
        """Whether text documents are concatenated into rows (``formatting.pack_text``; None: unless packed)."""
        return not self.packs if formatting.pack_text is None else formatting.pack_text

    def check(self, formatting: Formatting, loader: Loader, collation: Collation, max_seq_len: int) -> None:
        """The other groups' settings against this mode; a ``ValueError`` names the setting and the fix."""
        if self is Mode.STREAMED and formatting.overlong == "truncate_prompt":
            raise ValueError("formatting.overlong='truncate_prompt' is not applied to streamed examples: set it to "
                             "'drop' and choose collation.long_documents (split or drop).")
        if not self.packs:
            return
        if loader.group_by_length:
            raise ValueError("loader.group_by_length with collation.pack: packed rows are full already; set "
                             "loader.group_by_length: false.")
        if formatting.pack_text:
            raise ValueError("formatting.pack_text: true concatenates text documents into rows that attend across "
                             "them; collation.pack keeps each document apart: leave formatting.pack_text unset (or "
                             "false).")
        if collation.pad_block_size and max_seq_len % collation.pad_block_size:
            raise ValueError(f"collation.pack fills rows of max_seq_len={max_seq_len} tokens with documents of whole "
                             f"blocks of collation.pad_block_size={collation.pad_block_size}: make max_seq_len a "
                             "multiple of it.")
