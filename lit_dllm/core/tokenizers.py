"""What a module takes from the data module (:class:`TokenizerMixin`): the tokenizer it speaks (the data module's in
training, its own files inside every checkpoint, so ``load_from_checkpoint(path).generate(...)`` decodes with the right
one), and the collation it requires (:meth:`TokenizerMixin.required_collation`, which the data module checks)."""

from __future__ import annotations

from typing import Any

from lit_dllm.checkpointing import TOKENIZER_KEY, tokenizer_files, tokenizer_from_files
from lit_dllm.data.tokenizer import load_tokenizer


class TokenizerMixin:
    """``tokenizer`` for a LightningModule whose ``tokenizer_settings`` (:class:`~lit_dllm.settings.Tokenizer`) and
    ``mask_token_id`` are set, and the collation it requires of the data (:meth:`required_collation`)."""

    _tokenizer = None
    _tokenizer_files: dict[str, bytes] | None = None

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
        ``{"pad_block_size": 4, "response_window": True}``); ``{}``: any. ``DLLMDataModule.setup`` checks them against
        its ``collation`` group and names the setting to change; a family never reads the data module's settings."""
        return {}

    def setup(self, stage: str) -> None:
        """Take the data module's tokenizer (the one that made the batches) unless one was set explicitly; its mask id
        must be the module's."""
        super().setup(stage)
        datamodule = getattr(self.trainer, "datamodule", None)
        if self._tokenizer is None and getattr(datamodule, "tokenizer", None) is not None:
            self._tokenizer = datamodule.tokenizer
        mask_id = self.mask_token_id
        if self._tokenizer is not None and mask_id is not None and self._tokenizer.mask_token_id != mask_id:
            raise ValueError(
                f"The tokenizer's mask id ({self._tokenizer.mask_token_id}) differs from the model's mask_token_id="
                f"{mask_id}: build the module with the data module's ids (mask_token_id=datamodule.mask_token_id; train.py "
                "links them)."
            )

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        super().on_save_checkpoint(checkpoint)
        if self._tokenizer_files is None:  # written once per tokenizer, not at every checkpoint
            self._tokenizer_files = tokenizer_files(self.tokenizer)
        checkpoint[TOKENIZER_KEY] = self._tokenizer_files

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        super().on_load_checkpoint(checkpoint)
        if self._tokenizer is None and TOKENIZER_KEY in checkpoint:
            self._tokenizer = tokenizer_from_files(checkpoint[TOKENIZER_KEY], self.tokenizer_settings.trust_remote_code)
