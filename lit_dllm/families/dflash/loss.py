"""The DFlash draft's loss (docs/DESIGN.md §6.5), which its model trains through (``forward_fused``)."""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor, nn

from lit_dllm.losses import (
    Count,
    DLLMLossOutput,
    check_chunk_size,
    check_positions,
    full_tensor,
    loss_output,
    per_count,
    selected_nll,
    weighted_linear_cross_entropy,
)


class DFlashDecayLoss(nn.Module):
    """Position-decay cross-entropy for DFlash draft training (DFlash paper, Eq. 4).

    Position ``j`` of each block's ``block_size − 1`` predictions weighs ``exp(−j / loss_gamma)``
    (``loss_gamma=None``: uniform); without ``block_size`` the decay runs over all ``T``
    positions. The loss is ``Σ nll · w · block_mask`` divided by:

    * ``normalize="tokens"``: ``max(num_tokens, 1)`` when given, else nothing (raw sum). The
      denominator is an *unweighted* token count while the numerator is decay-weighted, as in the
      reference; use ``"mean"`` for a true weighted mean.
    * ``normalize="mean"``: ``Σ w · block_mask + 1e-6``.

    Cross-entropy always runs in fp32. ``use_fused_linear_ce`` tells callers to use
    :meth:`forward_fused` (hidden states + LM head, chunked) instead of :meth:`forward`.
    """

    NORMALIZE_MODES = ("tokens", "mean")

    def __init__(
        self,
        loss_gamma: Optional[float] = 7.0,
        use_fused_linear_ce: bool = False,
        chunk_size: int = 1024,
        normalize: str = "tokens",
    ) -> None:
        super().__init__()
        if normalize not in self.NORMALIZE_MODES:
            raise ValueError(f"normalize must be one of {self.NORMALIZE_MODES}, got {normalize!r}.")
        if loss_gamma is not None and loss_gamma <= 0:
            raise ValueError(f"loss_gamma must be positive or None (uniform weights), got {loss_gamma}.")
        check_chunk_size(chunk_size)
        self.loss_gamma = None if loss_gamma is None else float(loss_gamma)
        self.use_fused_linear_ce = bool(use_fused_linear_ce)
        self.chunk_size = int(chunk_size)
        self.normalize = normalize

    def decay_weights(self, num_positions: int, block_size: Optional[int] = None, device=None) -> Tensor:
        """fp32 weights ``exp(−j / γ)`` for ``num_positions`` predictions; ``j`` resets every block."""
        offsets = torch.arange(num_positions, device=device, dtype=torch.float32)
        if block_size is not None:
            if block_size < 2:
                raise ValueError(f"block_size must be >= 2 (anchor + predictions), got {block_size}.")
            offsets = offsets % (block_size - 1)
        if self.loss_gamma is None:
            return torch.ones_like(offsets)
        return torch.exp(-offsets / self.loss_gamma)

    def forward(
        self,
        logits: Tensor,
        target_ids: Tensor,
        block_mask: Tensor,
        num_tokens: Optional[Count] = None,
        block_size: Optional[int] = None,
    ) -> DLLMLossOutput:
        """Loss from ``[B, T, V]`` draft logits, ``T = N · (block_size − 1)``."""
        logits = full_tensor(logits)
        check_positions(logits, "logits", target_ids=target_ids, block_mask=block_mask)
        selected = block_mask != 0
        nll = selected_nll(logits, target_ids, selected, chunk_size=self.chunk_size)
        hits = (logits.argmax(-1) == target_ids)[selected]
        weighted = (nll * self.position_weights(block_mask, block_size)[selected]).sum()
        return self.reduce(weighted, hits, selected, block_mask, num_tokens, block_size)

    def forward_fused(
        self,
        hidden: Tensor,
        lm_head_weight: Tensor,
        target_ids: Tensor,
        block_mask: Tensor,
        num_tokens: Optional[Count] = None,
        block_size: Optional[int] = None,
        lm_head_bias: Optional[Tensor] = None,
        softcap: Optional[float] = None,
    ) -> DLLMLossOutput:
        """Same loss from ``[B, T, D]`` hidden states and the LM head, never building ``[B, T, V]``:
        :meth:`score_fused`, then :meth:`reduce`."""
        weighted, hits, selected = self.score_fused(
            hidden, lm_head_weight, target_ids, block_mask, block_size, lm_head_bias, softcap
        )
        return self.reduce(weighted, hits, selected, block_mask, num_tokens, block_size)

    def position_weights(self, block_mask: Tensor, block_size: Optional[int]) -> Tensor:
        """``[B, T]`` fp32 ``decay weight · block_mask``: each position's share of the loss's numerator."""
        return self.decay_weights(block_mask.shape[1], block_size, block_mask.device) * block_mask.float()

    def score_fused(
        self,
        hidden: Tensor,
        lm_head_weight: Tensor,
        target_ids: Tensor,
        block_mask: Tensor,
        block_size: Optional[int] = None,
        lm_head_bias: Optional[Tensor] = None,
        softcap: Optional[float] = None,
    ) -> Tuple[Tensor, Tensor, Tensor]:
        """``Σ nll · w · block_mask`` over the scored targets (differentiable), each one's argmax hit (``[K]``, in
        the order of ``selected``) and ``selected`` (``block_mask != 0``, ``[B, T]``). Only those rows are projected,
        ``chunk_size`` at a time, with the gradients formed in the forward pass (see
        :func:`weighted_linear_cross_entropy`); ``softcap`` applies ``c · tanh(logits / c)``."""
        if hidden.dim() != 3 or target_ids.shape != hidden.shape[:2] or block_mask.shape != hidden.shape[:2]:
            raise ValueError(
                f"hidden {tuple(hidden.shape)} must be [B, T, D] with target_ids {tuple(target_ids.shape)} "
                f"and block_mask {tuple(block_mask.shape)} both [B, T]."
            )
        selected = block_mask != 0
        weighted, _, hits = weighted_linear_cross_entropy(
            hidden[selected], lm_head_weight, target_ids[selected],
            self.position_weights(block_mask, block_size)[selected], lm_head_bias, self.chunk_size, softcap,
        )
        return weighted, hits, selected

    def reduce(
        self,
        weighted: Tensor,
        hits: Tensor,
        selected: Tensor,
        block_mask: Tensor,
        num_tokens: Optional[Count],
        block_size: Optional[int],
    ) -> DLLMLossOutput:
        """The loss and per-offset accuracy from the weighted NLL sum ``Σ nll · w · block_mask`` and the scored
        targets' ``hits`` at ``selected``."""
        batch, num_positions = block_mask.shape
        mask = block_mask.float()
        loss = weighted
        if self.normalize == "mean":
            loss = loss / (self.position_weights(block_mask, block_size).sum() + 1e-6)
        else:
            loss = per_count(loss, num_tokens, "num_tokens")
        correct, count = None, None
        if block_size is not None and block_size > 1 and num_positions % (block_size - 1) == 0:
            hit_mask = torch.zeros_like(mask)
            hit_mask[selected] = hits.float() * mask[selected]
            per_offset = (batch, num_positions // (block_size - 1), block_size - 1)
            correct = hit_mask.reshape(per_offset).sum((0, 1))
            count = mask.reshape(per_offset).sum((0, 1))
        return loss_output(loss, draft_correct_per_pos=correct, draft_count_per_pos=count)
