"""``DLLMModule``: the masked-diffusion layer on top of :class:`TokenLossModule`.

It adds what every diffusion family shares: a mask id that must exist (distinct from padding and eos, as every
family checks), the :meth:`corrupt` hook (keyed noise per example) as the batch preparation, corrupted-token
counts in the logs and masked-token accuracy in evaluation. The sampler is the family's :meth:`generate_ids`.
"""

from __future__ import annotations

import torch

from lit_dllm.core.evaluation import VALIDATION_EPOCH
from lit_dllm.core.token_loss import StepLoss, TokenLossModule
from lit_dllm.data.batch import is_packed
from lit_dllm.data.packing import DocumentView

__all__ = ["DLLMModule", "StepLoss", "VALIDATION_EPOCH"]


class DLLMModule(TokenLossModule):
    """Base LightningModule for diffusion LMs: :meth:`corrupt` the batch, score the noised positions.

    Args:
        vocab_size, mask_token_id, pad_token_id, eos_token_id: linked from the data module; the mask id is required.
        Other arguments: see :class:`TokenLossModule`.
    """

    accuracy_name = "masked_accuracy"
    mask_needed_for = "masked diffusion noises tokens into it"

    def __init__(self, vocab_size: int, mask_token_id: int, pad_token_id: int = 0, eos_token_id: int | None = None,
                 *args, **kwargs) -> None:
        super().__init__(vocab_size, mask_token_id, pad_token_id, eos_token_id, *args, **kwargs)

    def corrupt(self, batch: dict, keys: torch.Tensor) -> dict:
        """Noise the batch; return at least ``noisy_ids``, ``noise_mask``, ``p_mask``."""
        raise NotImplementedError

    def prepare_batch(self, batch: dict, keys: torch.Tensor) -> dict:
        """:meth:`corrupt` the batch; packed rows document by document (``keys`` has one per document), each as a row
        of its own (:class:`~lit_dllm.data.packing.DocumentView`), so a document draws the same noise packed or
        alone."""
        if not is_packed(batch):
            return self.corrupt(batch, keys)
        view = DocumentView(batch)
        documents = {"input_ids": view.gather(batch["input_ids"], self.pad_token_id),
                     "loss_mask": view.gather(batch["loss_mask"])}
        noisy = self.corrupt(documents, keys)
        return {"noisy_ids": view.scatter(noisy["noisy_ids"], batch["input_ids"]),
                "noise_mask": view.scatter(noisy["noise_mask"], torch.zeros_like(batch["loss_mask"], dtype=torch.bool)),
                "p_mask": view.scatter(noisy["p_mask"], torch.ones_like(batch["loss_mask"]))}

    def token_counts(self, batch: dict, noisy: dict) -> dict[str, torch.Tensor]:
        return {"diffusion": batch["loss_mask"].sum()}

    def token_sums(self, batch: dict, noisy: dict) -> dict[str, torch.Tensor]:
        return {**super().token_sums(batch, noisy), "corrupted_tokens": noisy["noise_mask"].sum()}
