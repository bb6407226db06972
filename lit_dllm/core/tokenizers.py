"""What a module takes from the data module, and what it requires of it (:class:`TokenizerMixin`), exchanged once at
``setup`` through :mod:`lit_dllm.data.handoff`: the module states its :class:`~lit_dllm.data.handoff.DataNeeds` (the
collation it requires, whether it packs), the data module checks them and answers with
:class:`~lit_dllm.data.handoff.DataFacts` (the tokenizer that made the batches, ``max_seq_len``). The tokenizer's files
go into every checkpoint, so ``load_from_checkpoint(path).generate(...)`` decodes with the right one."""

from __future__ import annotations

from typing import Any

from lit_dllm.checkpointing import TOKENIZER_KEY, tokenizer_files, tokenizer_from_files
from lit_dllm.data.datamodule import DLLMDataModule
from lit_dllm.data.handoff import DataFacts, DataNeeds
from lit_dllm.data.tokenizer import load_tokenizer


class TokenizerMixin:
    """``tokenizer`` for a LightningModule whose ``tokenizer_settings`` (:class:`~lit_dllm.settings.Tokenizer`) and
    ``mask_token_id`` are set; its side of the hand-off with the data module (:meth:`data_needs`, :meth:`connect`)."""

    _tokenizer = None
    _tokenizer_files: dict[str, bytes] | None = None
    data_max_seq_len: int | None = None
    """The data's ``max_seq_len``, once connected (None: no ``DLLMDataModule`` attached)."""
    data_batch_size: int | None = None
    """The examples of a training batch on each device, once connected (None: no ``DLLMDataModule`` attached)."""
    mask_needed_for: str | None = None
    """Why the family needs a ``mask_token_id`` (None: it may be None); the one check of it, in the constructor, says
    so when it is missing (``lit_dllm.data.tokenizer.check_mask_token_id``)."""

    @property
    def tokenizer(self):
        """The tokenizer object: the data module's, a checkpoint's, or the one ``tokenizer_settings`` names (loaded on
        first use)."""
        if self._tokenizer is None:
            settings = self.tokenizer_settings
            self._tokenizer = load_tokenizer(settings.name, settings.mask_token, settings.trust_remote_code,
                                             require_mask=False, gguf_file=settings.gguf_file)
        return self._tokenizer

    @tokenizer.setter
    def tokenizer(self, value) -> None:
        self._tokenizer, self._tokenizer_files = value, None

    def required_collation(self) -> dict[str, Any]:
        """The :class:`~lit_dllm.settings.Collation` field values this module needs its batches collated with (e.g.
        ``{"pad_block_size": 4, "response_window": True}``); ``{}``: any."""
        return {}

    def data_needs(self) -> DataNeeds:
        """What this module requires of its batches: :meth:`required_collation` and ``packing_problem``."""
        return DataNeeds(type(self).__name__, self.required_collation(), self.packing_problem)

    def connect(self, facts: DataFacts) -> None:
        """Take what the data module tells: its tokenizer (unless one was set explicitly), whose mask id must be the
        module's, its ``max_seq_len`` and its ``batch_size``."""
        if self._tokenizer is None:
            self._tokenizer = facts.tokenizer
        mask_id = self.mask_token_id
        if mask_id is not None and self._tokenizer.mask_token_id != mask_id:
            raise ValueError(
                f"The tokenizer's mask id ({self._tokenizer.mask_token_id}) differs from the model's mask_token_id="
                f"{mask_id}: build the module with the data module's ids (mask_token_id=datamodule.mask_token_id; "
                "train.py links them)."
            )
        self.data_max_seq_len, self.data_batch_size = facts.max_seq_len, facts.batch_size

    def setup(self, stage: str) -> None:
        """The hand-off with the attached ``DLLMDataModule`` (a data module of another kind, or none: nothing to
        exchange)."""
        super().setup(stage)
        datamodule = self.trainer.datamodule
        if isinstance(datamodule, DLLMDataModule):
            self.connect(datamodule.connect(self.data_needs()))

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        super().on_save_checkpoint(checkpoint)
        if self._tokenizer_files is None:  # written once per tokenizer, not at every checkpoint
            self._tokenizer_files = tokenizer_files(self.tokenizer)
        checkpoint[TOKENIZER_KEY] = self._tokenizer_files

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        super().on_load_checkpoint(checkpoint)
        if self._tokenizer is None and TOKENIZER_KEY in checkpoint:
            self._tokenizer = tokenizer_from_files(checkpoint[TOKENIZER_KEY], self.tokenizer_settings.trust_remote_code)
