"""The reference's loss classes (docs/DESIGN.md §6; NeMo AutoModel's ``dllm_loss``), on full ``[B, L, V]`` logits.

What each family trains with is its module's fused path (:mod:`lit_dllm.losses`' chunked LM-head cross-entropy at
the scored positions only). These classes are the formulations those paths are tested against: the MDLM and hybrid
modules against :class:`MDLMCrossEntropyLoss` / :class:`HybridDiffusionLLMLoss` (``tests/core/
test_training_step.py``), block-diffusion Gemma against :class:`BlockDiffusionCrossEntropyLoss` +
:func:`encoder_ar_loss` (``tests/families/diffusion_gemma/test_diffusion_gemma.py``). DFlash trains through
:class:`~lit_dllm.families.dflash.loss.DFlashDecayLoss` itself.

The classes share the reference's signature ``(logits, target_ids, noise_mask, p_mask, loss_mask, loss_mask_ar,
num_diffusion_tokens, num_ar_tokens, causal_logits)``, so one call serves every class. The reference accepts and
ignores the arguments a class has no use for; here an AR argument given to a loss without an AR term is an error
(the term would vanish without a word), and ``noise_mask`` / ``p_mask``, which the flat block-diffusion loss does
not read, may be None (their shapes are checked when given).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

from lit_dllm.losses import (
    Count,
    DLLMLossOutput,
    check_positions,
    elbo_weight,
    full_tensor,
    loss_output,
    per_count,
    selected_nll,
)

__all__ = ["BlockDiffusionCrossEntropyLoss", "HybridDiffusionLLMLoss", "MDLMCrossEntropyLoss", "encoder_ar_loss"]


def _diffusion_sum(logits: Tensor, target_ids: Tensor, noise_mask: Optional[Tensor], p_mask: Optional[Tensor],
                   loss_mask: Tensor, fp32_upcast: bool) -> Tensor:
    """``Σ nll / p`` over corrupted, supervised positions (``1 / p`` is :func:`~lit_dllm.losses.elbo_weight`, the
    weight the MDLM family's fused path uses)."""
    selected = _corrupted_supervised(noise_mask, p_mask, loss_mask)
    nll = selected_nll(logits, target_ids, selected, fp32_upcast)
    return (nll * elbo_weight(p_mask[selected])).sum()


def _corrupted_supervised(noise_mask: Optional[Tensor], p_mask: Optional[Tensor], loss_mask: Tensor) -> Tensor:
    """The positions the diffusion term scores; a non-bool ``noise_mask``, or a ``p_mask`` that is not a float in
    (0, 1] there (an integer, 0 or NaN would weigh a token 1e8 times or poison the loss), is an error."""
    if not isinstance(noise_mask, Tensor) or noise_mask.dtype != torch.bool:
        raise ValueError(f"noise_mask must be a bool tensor (True where corrupted), got "
                         f"{getattr(noise_mask, 'dtype', noise_mask)}; pass the corruption's noise mask, or "
                         "noise_mask.bool() of a 0/1 mask.")
    if not isinstance(p_mask, Tensor) or not p_mask.is_floating_point():
        raise ValueError(f"p_mask must be a float tensor of masking probabilities, got "
                         f"{getattr(p_mask, 'dtype', p_mask)}; pass the corruption's p_mask (each position's masking "
                         "probability).")
    selected = noise_mask & (loss_mask != 0)
    p = p_mask[selected]
    bad = ~((p > 0) & (p <= 1))  # NaN fails both comparisons
    if bad.any():
        raise ValueError(f"p_mask must be in (0, 1] at every corrupted supervised position, got {p[bad][0].item()} "
                         f"({int(bad.sum())} such positions); a corrupted token's masking probability is never 0.")
    return selected


class _ReferenceLoss(nn.Module):
    """The reference's one call for every loss class, so a recipe calls any of them alike: ``alpha`` × the class's
    :meth:`diffusion` term (per ``num_diffusion_tokens``; by default the masked-diffusion ELBO), plus the AR term where
    the class has one (:attr:`has_ar_term`; elsewhere the AR arguments are an error). Logits may be DTensors (gathered
    first)."""

    alpha = 1.0
    has_ar_term = False

    def __init__(self, fp32_upcast: bool = True) -> None:
        super().__init__()
        self.fp32_upcast = fp32_upcast

    def forward(self, logits: Tensor, target_ids: Tensor, noise_mask: Optional[Tensor], p_mask: Optional[Tensor],
                loss_mask: Tensor, loss_mask_ar: Optional[Tensor] = None, num_diffusion_tokens: Optional[Count] = None,
                num_ar_tokens: Optional[Count] = None, causal_logits: Optional[Tensor] = None) -> DLLMLossOutput:
        logits = full_tensor(logits)
        if self.has_ar_term:
            logits, causal_logits = _split_legacy_concat(logits, target_ids, causal_logits)
        else:
            _check_no_ar_term(self, loss_mask_ar, num_ar_tokens, causal_logits)
        check_positions(logits, "logits", target_ids=target_ids, noise_mask=noise_mask, p_mask=p_mask,
                         loss_mask=loss_mask)
        dllm = self.alpha * self.diffusion(logits, target_ids, noise_mask, p_mask, loss_mask, num_diffusion_tokens)
        if causal_logits is None and loss_mask_ar is None:
            return loss_output(dllm)
        return loss_output(dllm + self.ar(causal_logits, target_ids, loss_mask_ar, num_ar_tokens), dllm)

    def diffusion(self, logits: Tensor, target_ids: Tensor, noise_mask: Optional[Tensor], p_mask: Optional[Tensor],
                  loss_mask: Tensor, num_diffusion_tokens: Optional[Count]) -> Tensor:
        """The diffusion term, divided by its denominator: the masked-diffusion ELBO ``Σ_{noise ∧ loss_mask} nll / p``
        per ``num_diffusion_tokens`` (the raw sum without it)."""
        loss = _diffusion_sum(logits, target_ids, noise_mask, p_mask, loss_mask, self.fp32_upcast)
        return per_count(loss, num_diffusion_tokens, "num_diffusion_tokens")

    def ar(self, causal_logits: Optional[Tensor], target_ids: Tensor, loss_mask_ar: Optional[Tensor],
           num_ar_tokens: Optional[Count]) -> Tensor:
        """``A = Σ_{i≥1} CE(causal[i−1], x[i]) · loss_mask_ar[i]`` per ``num_ar_tokens``; needs both inputs."""
        _check_ar_inputs(causal_logits, loss_mask_ar)
        causal_logits = full_tensor(causal_logits)
        check_positions(causal_logits, "causal_logits", target_ids=target_ids, loss_mask_ar=loss_mask_ar)
        selected = loss_mask_ar[:, 1:] != 0
        nll = selected_nll(causal_logits[:, :-1], target_ids[:, 1:], selected, self.fp32_upcast)
        return per_count((nll * loss_mask_ar[:, 1:][selected].float()).sum(), num_ar_tokens, "num_ar_tokens")


class MDLMCrossEntropyLoss(_ReferenceLoss):
    """Masked-diffusion ELBO: ``Σ_{noise ∧ loss_mask} nll / p_mask``, per ``num_diffusion_tokens``.

    Without ``num_diffusion_tokens`` the raw sum is returned (no normalisation). With
    ``fp32_upcast`` the cross-entropy runs in fp32; otherwise in the logits' dtype. ``noise_mask`` must be
    bool and ``p_mask`` a float in (0, 1] at the scored positions (an integer, 0 or NaN is an error).
    ``loss_mask_ar``, ``num_ar_tokens`` and ``causal_logits`` must be None: there is no AR term.
    """


class HybridDiffusionLLMLoss(_ReferenceLoss):
    """Hybrid diffusion + AR loss: ``total = alpha · D + A``, ``dllm_loss = alpha · D``.

    ``D`` is the MDLM sum per ``num_diffusion_tokens``. ``A = Σ_{i≥1} CE(causal[i−1], x[i]) · loss_mask_ar[i]``
    per ``num_ar_tokens``, given ``causal_logits`` and ``loss_mask_ar`` (one without the other is an error; neither:
    ``A = 0``). Logits of sequence length > L are the legacy ``[diffusion | causal]`` concatenation and are split
    at L. As in MDLM, ``noise_mask`` must be bool and ``p_mask`` in (0, 1] where it is scored (the reference's
    NaN→0 weight would hide a broken corruption).
    Note ``alpha`` weights the diffusion term, not the AR term (as in the reference), and that the AR
    sum starts at position 1, so ``num_ar_tokens`` should count ``loss_mask_ar[:, 1:]`` (the
    reference recipe also counts position 0, docs/DESIGN.md §14 (e)).
    """

    has_ar_term = True

    def __init__(self, alpha: float = 1.0, fp32_upcast: bool = True) -> None:
        super().__init__(fp32_upcast)
        self.alpha = alpha


def _split_legacy_concat(logits: Tensor, target_ids: Tensor, causal_logits: Optional[Tensor]
                         ) -> tuple[Tensor, Optional[Tensor]]:
    """Logits longer than the targets, without ``causal_logits``: the legacy ``[diffusion | causal]`` concatenation,
    split at L (any other length is an error)."""
    seq_len = target_ids.shape[-1]
    if causal_logits is None and logits.dim() == 3 and logits.shape[1] > seq_len:
        if logits.shape[1] != 2 * seq_len:
            raise ValueError(
                f"logits {tuple(logits.shape)} are longer than target_ids {tuple(target_ids.shape)} but are not "
                f"the legacy [diffusion | causal] concatenation of length {2 * seq_len}."
            )
        return logits[:, :seq_len], logits[:, seq_len:]
    return logits, causal_logits


def _check_ar_inputs(causal_logits: Optional[Tensor], loss_mask_ar: Optional[Tensor]) -> None:
    """The AR term needs both its logits and its mask: with one of them it would vanish without a word."""
    if loss_mask_ar is None:
        raise ValueError("causal_logits are given but loss_mask_ar is None, so the AR term would be dropped: pass "
                         "loss_mask_ar (which next-token targets to score, e.g. the loss_mask), or no causal logits.")
    if causal_logits is None:
        raise ValueError("loss_mask_ar is given but causal_logits is None, so the AR term would be dropped: pass the "
                         "causal pass's logits as causal_logits (or append them to logits), or no loss_mask_ar.")


def _check_no_ar_term(loss: nn.Module, loss_mask_ar: Optional[Tensor], num_ar_tokens: Optional[Count],
                      causal_logits: Optional[Tensor]) -> None:
    """A loss without an AR term refuses the AR arguments (the reference ignores them: the term would vanish)."""
    given = [name for name, value in (("loss_mask_ar", loss_mask_ar), ("num_ar_tokens", num_ar_tokens),
                                      ("causal_logits", causal_logits)) if value is not None]
    if given:
        raise ValueError(f"{type(loss).__name__} has no AR term, so {', '.join(given)} would be ignored: drop "
                         f"{'it' if len(given) == 1 else 'them'}, or use HybridDiffusionLLMLoss for diffusion + AR.")


class BlockDiffusionCrossEntropyLoss(_ReferenceLoss):
    """Flat mean cross-entropy over every ``loss_mask`` position (corrupted or not; no 1/t).

    The denominator is ``num_diffusion_tokens`` if given, else the local ``loss_mask`` count
    (clamped to 1). ``noise_mask`` and ``p_mask`` are not read (None is fine; given, their shapes are checked); the AR
    arguments must be None (there is no AR term: :func:`encoder_ar_loss` is the block-diffusion family's AR term).
    """

    def diffusion(self, logits, target_ids, noise_mask, p_mask, loss_mask, num_diffusion_tokens):
        selected = loss_mask != 0
        nll = selected_nll(logits, target_ids, selected, self.fp32_upcast)
        count = selected.sum() if num_diffusion_tokens is None else num_diffusion_tokens
        return per_count(nll.sum(), count, "num_diffusion_tokens")


def encoder_ar_loss(
    encoder_logits: Tensor,
    input_ids: Tensor,
    valid_mask: Optional[Tensor] = None,
    num_tokens: Optional[Count] = None,
) -> Tensor:
    """Next-token CE of ``logits[:, :-1]`` vs ``ids[:, 1:]`` where both positions are valid.

    Divided by ``max(num_tokens, 1)``, or by the local valid-pair count. Computed in fp32.
    """
    encoder_logits = full_tensor(encoder_logits)
    check_positions(encoder_logits, "encoder_logits", input_ids=input_ids, valid_mask=valid_mask)
    valid = torch.ones_like(input_ids, dtype=torch.bool) if valid_mask is None else valid_mask.bool()
    pairs = valid[:, :-1] & valid[:, 1:]
    nll = selected_nll(encoder_logits[:, :-1], input_ids[:, 1:], pairs)
    return per_count(nll.sum(), pairs.sum() if num_tokens is None else num_tokens, "num_tokens")
