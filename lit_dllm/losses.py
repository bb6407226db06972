"""dLLM losses (docs/DESIGN.md §6): MDLM, hybrid diffusion + AR, block diffusion, encoder AR and DFlash.

Every loss computes the per-token negative log-likelihood only at the positions it reduces over:
those rows of the logits are gathered, then cross-entropy runs in chunks of positions, each chunk
under activation checkpointing, so neither an fp32 copy of ``[B, L, V]`` nor its log-softmax is ever
held. Reductions accumulate in fp32. Token counts (``num_*``) may be ints or 0-d tensors (e.g. a
DP all-reduced sum); when given they are the denominators, clamped to at least 1.
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

Count = Union[int, Tensor]

NLL_CHUNK_SIZE = 1024
"""Positions per cross-entropy chunk for losses that take logits."""

P_MASK_FLOOR = 1e-8

COMPILE_LINEAR_CE_ON_CUDA = True
"""Score :func:`fused_linear_cross_entropy`'s chunks on CUDA with a ``torch.compile``d chunk (the upcast,
log-sum-exp, gather and argmax fused after the matmul): on an H100 at N=16384, D=2048, V=128256 it took
73 ms and +0.75 GiB against 110 ms and +1.5 GiB eager (docs/BENCHMARKS.md §3). The CPU path is always eager."""


class DLLMLossOutput(NamedTuple):
    """What every dLLM loss returns; ``dllm_loss`` is a detached copy for logging."""

    total_loss: Tensor
    dllm_loss: Tensor
    draft_correct_per_pos: Optional[Tensor] = None
    draft_count_per_pos: Optional[Tensor] = None


# --- per-token NLL ---------------------------------------------------------------------------------


def _logits_chunk(logits: Tensor, targets: Tensor, fp32_upcast: bool) -> Tuple[Tensor]:
    return (F.cross_entropy(logits.float() if fp32_upcast else logits, targets, reduction="none"),)


def _linear_chunk(
    hidden: Tensor, targets: Tensor, weight: Tensor, bias: Optional[Tensor], softcap: Optional[float]
) -> Tuple[Tensor, Tensor]:
    logits = F.linear(hidden, weight, bias).float()
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    return F.cross_entropy(logits, targets, reduction="none"), logits.argmax(-1) == targets


@functools.cache
def _compiled_linear_chunk() -> Callable[..., Tuple[Tensor, Tensor]]:
    return torch.compile(_linear_chunk, dynamic=True, fullgraph=True)


def _checkpointed_chunks(
    chunk_fn: Callable[..., Tuple[Tensor, ...]], rows: Tensor, targets: Tensor, chunk_size: int, *params
) -> Tuple[Tensor, ...]:
    """Run ``chunk_fn(rows, targets, *params)`` over chunks of rows, recomputing each in backward.

    Returns each of ``chunk_fn``'s outputs concatenated over the chunks.
    """
    per_chunk = [
        checkpoint(chunk_fn, row_chunk, target_chunk, *params, use_reentrant=False)
        for row_chunk, target_chunk in zip(rows.split(chunk_size), targets.split(chunk_size))
    ]
    return tuple(torch.cat(parts) for parts in zip(*per_chunk))


def fused_linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    bias: Optional[Tensor] = None,
    chunk_size: int = 1024,
    softcap: Optional[float] = None,
) -> Tuple[Tensor, Tensor]:
    """Per-row NLL of ``linear(hidden, weight, bias)`` without materialising the ``[N, V]`` logits.

    Each chunk of ``chunk_size`` rows is projected, upcast to fp32, optionally soft-capped
    (``c * tanh(x / c)``) and scored, under non-reentrant checkpointing: backward recomputes the
    chunk's logits, so peak extra memory is one ``[chunk_size, V]`` block. Plain autograd (works
    under FSDP2). Values and gradients equal the dense computation. On CUDA the chunk runs
    compiled (``COMPILE_LINEAR_CE_ON_CUDA``).

    Args:
        hidden: ``[N, D]`` rows to score (select them before calling).
        weight: ``[V, D]`` LM-head weight.
        targets: ``[N]`` token ids.
        bias: optional ``[V]`` LM-head bias.

    Returns:
        ``(nll, correct)``: fp32 ``[N]`` NLL and bool ``[N]`` argmax-equals-target.
    """
    _check_linear_inputs(hidden, weight, targets, chunk_size)
    plain = not hasattr(weight, "device_mesh")  # a DTensor head (tensor parallel) stays eager
    chunk_fn = _compiled_linear_chunk() if hidden.is_cuda and plain and COMPILE_LINEAR_CE_ON_CUDA else _linear_chunk
    return _checkpointed_chunks(chunk_fn, hidden, targets, chunk_size, weight, bias, softcap)


def _scored_chunk(
    logits: Tensor, targets: Tensor, row_weights: Tensor, softcap: Optional[float]
) -> Tuple[Tensor, Tensor]:
    """NLL and argmax hits of one chunk; ``logits`` is overwritten with ``d(Σ row_weights · nll) / d logits`` (one
    ``[chunk, V]`` buffer for both: compiled, the gradient is written in place)."""
    z = logits.float()
    if softcap is not None:
        tanh = torch.tanh(z / softcap)
        z = softcap * tanh
    lse = torch.logsumexp(z, -1)
    nll = lse - z.gather(1, targets[:, None]).squeeze(1)
    correct = z.argmax(-1) == targets  # before the copy below: z may be logits itself
    grad = torch.exp(z - lse[:, None])
    grad = torch.where(torch.arange(z.shape[1], device=z.device) == targets[:, None], grad - 1.0, grad)
    grad = grad * row_weights[:, None]
    if softcap is not None:
        grad = grad * (1.0 - tanh * tanh)
    logits.copy_(grad)
    return nll, correct


@functools.cache
def _compiled_scored_chunk() -> Callable[..., Tuple[Tensor, Tensor]]:
    return torch.compile(_scored_chunk, dynamic=True, fullgraph=True)


class _WeightedLinearCrossEntropy(torch.autograd.Function):
    """``Σ_i w_i · nll_i`` of ``linear(hidden, weight, bias)``, with its gradients formed chunk by chunk in the
    forward pass (the weights are known there): one matmul and one pass over each chunk's logits fewer than
    recomputing them in backward, which only scales the stored gradients by the upstream one."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, row_weights, chunk_size, softcap, chunk_fn):
        device = hidden.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype
        with torch.autocast(device, enabled=False):
            h, w = hidden.to(dtype), weight.to(dtype)
            b = None if bias is None else bias.to(dtype)
            grad_hidden = torch.empty_like(h) if ctx.needs_input_grad[0] else None
            grad_weight = torch.zeros_like(w) if ctx.needs_input_grad[1] else None
            wants_bias = bias is not None and ctx.needs_input_grad[2]
            grad_bias = torch.zeros(w.shape[0], device=w.device) if wants_bias else None
            nll = torch.empty(h.shape[0], device=h.device)
            correct = torch.empty(h.shape[0], device=h.device, dtype=torch.bool)
            for start in range(0, h.shape[0], chunk_size):
                rows = slice(start, start + chunk_size)
                grad = F.linear(h[rows], w, b)  # the logits, until chunk_fn overwrites them with their gradient
                nll[rows], correct[rows] = chunk_fn(grad, targets[rows], row_weights[rows], softcap)
                if grad_hidden is not None:
                    torch.mm(grad, w, out=grad_hidden[rows])
                if grad_weight is not None:
                    grad_weight.addmm_(grad.T, h[rows])
                if grad_bias is not None:
                    grad_bias += grad.float().sum(0)
        ctx.save_for_backward(grad_hidden, grad_weight, grad_bias)
        ctx.mark_non_differentiable(nll, correct)
        return (nll * row_weights).sum(), nll, correct

    @staticmethod
    def backward(ctx, grad_total, _grad_nll, _grad_correct):
        if getattr(ctx, "done", False):
            raise RuntimeError("weighted_linear_cross_entropy scales its stored gradients in place: backward through "
                               "it runs once (no retain_graph); use fused_linear_cross_entropy to differentiate twice.")
        ctx.done = True
        scaled = [None if grad is None else grad.mul_(grad_total) for grad in ctx.saved_tensors]
        return *scaled, None, None, None, None, None


def weighted_linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    row_weights: Optional[Tensor] = None,
    bias: Optional[Tensor] = None,
    chunk_size: int = 1024,
    softcap: Optional[float] = None,
) -> Tuple[Tensor, Tensor, Tensor]:
    """``Σ_i row_weights[i] · nll_i`` of ``linear(hidden, weight, bias)``, without the ``[N, V]`` logits and without
    recomputing them in backward.

    :func:`fused_linear_cross_entropy` for a loss that is a weighted sum of the rows' NLL with weights known before
    the head (MDLM's ``1/p``, an AR sum): each chunk's gradient with respect to its logits is formed in the forward
    pass and turned at once into the gradients of ``hidden``, ``weight`` and ``bias`` (held until backward: one
    ``weight``-sized buffer in the compute dtype), so backward does no matmul. Under autocast the matmuls run in
    the autocast dtype. On CUDA the per-chunk softmax runs compiled (``COMPILE_LINEAR_CE_ON_CUDA``).

    Args:
        hidden: ``[N, D]`` rows to score (select them before calling).
        weight: ``[V, D]`` LM-head weight.
        targets: ``[N]`` token ids.
        row_weights: ``[N]`` weights (not differentiated), or None for 1.
        bias: optional ``[V]`` LM-head bias.

    Returns:
        ``(total, nll, correct)``: the fp32 weighted sum (differentiable), and the detached fp32 ``[N]`` NLL and bool
        ``[N]`` argmax-equals-target.
    """
    _check_linear_inputs(hidden, weight, targets, chunk_size)
    rows = torch.ones(hidden.shape[0], device=hidden.device) if row_weights is None else row_weights.float()
    if rows.shape != targets.shape:
        raise ValueError(f"row_weights {tuple(rows.shape)} must be [N] for hidden {tuple(hidden.shape)}.")
    if hasattr(weight, "device_mesh"):  # a DTensor head (tensor parallel): plain autograd on the local chunks
        nll, correct = fused_linear_cross_entropy(hidden, weight, targets, bias, chunk_size, softcap)
        return (nll * rows).sum(), nll.detach(), correct
    compiled = hidden.is_cuda and COMPILE_LINEAR_CE_ON_CUDA
    chunk_fn = _compiled_scored_chunk() if compiled else _scored_chunk
    return _WeightedLinearCrossEntropy.apply(hidden, weight, bias, targets, rows, chunk_size, softcap, chunk_fn)


def selected_nll(
    logits: Tensor, targets: Tensor, selected: Tensor, fp32_upcast: bool = True, chunk_size: int = NLL_CHUNK_SIZE
) -> Tensor:
    """fp32 NLL at the ``selected`` positions of ``[B, L, V]`` logits (CE in fp32 if ``fp32_upcast``)."""
    fn = functools.partial(_logits_chunk, fp32_upcast=fp32_upcast)
    (nll,) = _checkpointed_chunks(fn, logits[selected], targets[selected], chunk_size)
    return nll.float()


# --- shared checks and reductions ------------------------------------------------------------------


def _full(logits: Tensor) -> Tensor:
    """Gather a DTensor (e.g. vocab-sharded logits) into a plain tensor."""
    return logits.full_tensor() if hasattr(logits, "full_tensor") else logits


def _check_linear_inputs(hidden: Tensor, weight: Tensor, targets: Tensor, chunk_size: int) -> None:
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"hidden {tuple(hidden.shape)} must be [N, D] and weight {tuple(weight.shape)} [V, D] with the same D."
        )
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"targets {tuple(targets.shape)} must be [N] for hidden {tuple(hidden.shape)}.")
    _check_chunk_size(chunk_size)


def _check_chunk_size(chunk_size: int) -> None:
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}.")


def _check_positions(logits: Tensor, logits_name: str, **per_position: Optional[Tensor]) -> None:
    """Require ``[B, L, V]`` logits and ``[B, L]`` per-position tensors."""
    if logits.dim() != 3:
        raise ValueError(f"{logits_name} must be [B, L, V], got {tuple(logits.shape)}.")
    for name, tensor in per_position.items():
        if tensor is not None and tensor.shape != logits.shape[:2]:
            raise ValueError(
                f"{name} {tuple(tensor.shape)} does not match {logits_name} {tuple(logits.shape)}; "
                f"expected {tuple(logits.shape[:2])}."
            )


def _per_count(total: Tensor, count: Optional[Count]) -> Tensor:
    """``total / max(count, 1)``; ``total`` unchanged when ``count`` is None."""
    if count is None:
        return total
    if isinstance(count, Tensor):
        return total / count.to(total.device).clamp(min=1)
    return total / max(count, 1)


def _output(total: Tensor, dllm: Optional[Tensor] = None, **draft_stats: Optional[Tensor]) -> DLLMLossOutput:
    dllm = total if dllm is None else dllm
    return DLLMLossOutput(total, dllm.detach(), **draft_stats)


def _inverse_p(p_mask: Tensor) -> Tensor:
    return 1.0 / p_mask.float().clamp(min=P_MASK_FLOOR)


def _diffusion_sum(
    logits: Tensor, target_ids: Tensor, noise_mask: Tensor, p_mask: Tensor, loss_mask: Tensor, fp32_upcast: bool
) -> Tensor:
    """``Σ nll / p`` over corrupted, supervised positions."""
    selected = _corrupted_supervised(noise_mask, p_mask, loss_mask)
    nll = selected_nll(logits, target_ids, selected, fp32_upcast)
    return (nll * _inverse_p(p_mask[selected])).sum()


def _corrupted_supervised(noise_mask: Tensor, p_mask: Tensor, loss_mask: Tensor) -> Tensor:
    """The positions the diffusion term scores; a non-bool ``noise_mask``, or a ``p_mask`` that is not a float in
    (0, 1] there (an integer, 0 or NaN would weigh a token 1e8 times or poison the loss), is an error."""
    if noise_mask.dtype != torch.bool:
        raise ValueError(f"noise_mask must be a bool tensor (True where corrupted), got {noise_mask.dtype}; pass "
                         "the corruption's noise mask, or noise_mask.bool() of a 0/1 mask.")
    if not p_mask.is_floating_point():
        raise ValueError(f"p_mask must be a float tensor of masking probabilities, got {p_mask.dtype}; pass the "
                         "corruption's p_mask (each position's masking probability).")
    selected = noise_mask & (loss_mask != 0)
    p = p_mask[selected]
    bad = ~((p > 0) & (p <= 1))  # NaN fails both comparisons
    if bad.any():
        raise ValueError(f"p_mask must be in (0, 1] at every corrupted supervised position, got {p[bad][0].item()} "
                         f"({int(bad.sum())} such positions); a corrupted token's masking probability is never 0.")
    return selected


def elbo_weight(p_mask: Tensor) -> Tensor:
    """The diffusion ELBO weight ``nan_to_num(1 / clamp(p, 1e-8))`` (NaN→0, ±inf→1), in fp32."""
    return torch.nan_to_num(_inverse_p(p_mask), nan=0.0, posinf=1.0, neginf=1.0)


# --- losses -----------------------------------------------------------------------------------------


class MDLMCrossEntropyLoss(nn.Module):
    """Masked-diffusion ELBO: ``Σ_{noise ∧ loss_mask} nll / p_mask``, per ``num_diffusion_tokens``.

    Without ``num_diffusion_tokens`` the raw sum is returned (no normalisation). With
    ``fp32_upcast`` the cross-entropy runs in fp32; otherwise in the logits' dtype. ``noise_mask`` must be
    bool and ``p_mask`` a float in (0, 1] at the scored positions (an integer, 0 or NaN is an error).
    """

    def __init__(self, fp32_upcast: bool = True) -> None:
        super().__init__()
        self.fp32_upcast = fp32_upcast

    def forward(
        self,
        logits: Tensor,
        target_ids: Tensor,
        noise_mask: Tensor,
        p_mask: Tensor,
        loss_mask: Tensor,
        loss_mask_ar: Optional[Tensor] = None,
        num_diffusion_tokens: Optional[Count] = None,
        num_ar_tokens: Optional[Count] = None,
        causal_logits: Optional[Tensor] = None,
    ) -> DLLMLossOutput:
        """``loss_mask_ar``, ``num_ar_tokens`` and ``causal_logits`` are accepted and ignored."""
        logits = _full(logits)
        _check_positions(logits, "logits", target_ids=target_ids, noise_mask=noise_mask, p_mask=p_mask,
                         loss_mask=loss_mask)
        loss = _diffusion_sum(logits, target_ids, noise_mask, p_mask, loss_mask, self.fp32_upcast)
        return _output(_per_count(loss, num_diffusion_tokens))


class HybridDiffusionLLMLoss(nn.Module):
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

    def __init__(self, alpha: float = 1.0, fp32_upcast: bool = True) -> None:
        super().__init__()
        self.alpha = alpha
        self.fp32_upcast = fp32_upcast

    def forward(
        self,
        logits: Tensor,
        target_ids: Tensor,
        noise_mask: Tensor,
        p_mask: Tensor,
        loss_mask: Tensor,
        loss_mask_ar: Optional[Tensor] = None,
        num_diffusion_tokens: Optional[Count] = None,
        num_ar_tokens: Optional[Count] = None,
        causal_logits: Optional[Tensor] = None,
    ) -> DLLMLossOutput:
        logits = _full(logits)
        seq_len = target_ids.shape[-1]
        if causal_logits is None and logits.dim() == 3 and logits.shape[1] > seq_len:
            if logits.shape[1] != 2 * seq_len:
                raise ValueError(
                    f"logits {tuple(logits.shape)} are longer than target_ids {tuple(target_ids.shape)} but are not "
                    f"the legacy [diffusion | causal] concatenation of length {2 * seq_len}."
                )
            logits, causal_logits = logits[:, :seq_len], logits[:, seq_len:]
        _check_positions(logits, "logits", target_ids=target_ids, noise_mask=noise_mask, p_mask=p_mask,
                         loss_mask=loss_mask)
        diffusion = _diffusion_sum(logits, target_ids, noise_mask, p_mask, loss_mask, self.fp32_upcast)
        dllm = self.alpha * _per_count(diffusion, num_diffusion_tokens)
        if causal_logits is None and loss_mask_ar is None:
            return _output(dllm)
        _check_ar_inputs(causal_logits, loss_mask_ar)
        causal_logits = _full(causal_logits)
        _check_positions(causal_logits, "causal_logits", target_ids=target_ids, loss_mask_ar=loss_mask_ar)
        selected = loss_mask_ar[:, 1:] != 0
        nll = selected_nll(causal_logits[:, :-1], target_ids[:, 1:], selected, self.fp32_upcast)
        ar = _per_count((nll * loss_mask_ar[:, 1:][selected].float()).sum(), num_ar_tokens)
        return _output(dllm + ar, dllm)


def _check_ar_inputs(causal_logits: Optional[Tensor], loss_mask_ar: Optional[Tensor]) -> None:
    """The AR term needs both its logits and its mask: with one of them it would vanish without a word."""
    if loss_mask_ar is None:
        raise ValueError("causal_logits are given but loss_mask_ar is None, so the AR term would be dropped: pass "
                         "loss_mask_ar (which next-token targets to score, e.g. the loss_mask), or no causal logits.")
    if causal_logits is None:
        raise ValueError("loss_mask_ar is given but causal_logits is None, so the AR term would be dropped: pass the "
                         "causal pass's logits as causal_logits (or append them to logits), or no loss_mask_ar.")


class BlockDiffusionCrossEntropyLoss(nn.Module):
    """Flat mean cross-entropy over every ``loss_mask`` position (corrupted or not; no 1/t).

    The denominator is ``num_diffusion_tokens`` if given, else the local ``loss_mask`` count
    (clamped to 1). ``noise_mask``, ``p_mask`` and the AR arguments are accepted and ignored.
    """

    def __init__(self, fp32_upcast: bool = True) -> None:
        super().__init__()
        self.fp32_upcast = fp32_upcast

    def forward(
        self,
        logits: Tensor,
        target_ids: Tensor,
        noise_mask: Tensor,
        p_mask: Tensor,
        loss_mask: Tensor,
        loss_mask_ar: Optional[Tensor] = None,
        num_diffusion_tokens: Optional[Count] = None,
        num_ar_tokens: Optional[Count] = None,
        causal_logits: Optional[Tensor] = None,
    ) -> DLLMLossOutput:
        logits = _full(logits)
        _check_positions(logits, "logits", target_ids=target_ids, loss_mask=loss_mask)
        selected = loss_mask != 0
        nll = selected_nll(logits, target_ids, selected, self.fp32_upcast)
        count = selected.sum() if num_diffusion_tokens is None else num_diffusion_tokens
        return _output(_per_count(nll.sum(), count))


def encoder_ar_loss(
    encoder_logits: Tensor,
    input_ids: Tensor,
    valid_mask: Optional[Tensor] = None,
    num_tokens: Optional[Count] = None,
) -> Tensor:
    """Next-token CE of ``logits[:, :-1]`` vs ``ids[:, 1:]`` where both positions are valid.

    Divided by ``max(num_tokens, 1)``, or by the local valid-pair count. Computed in fp32.
    """
    encoder_logits = _full(encoder_logits)
    _check_positions(encoder_logits, "encoder_logits", input_ids=input_ids, valid_mask=valid_mask)
    valid = torch.ones_like(input_ids, dtype=torch.bool) if valid_mask is None else valid_mask.bool()
    pairs = valid[:, :-1] & valid[:, 1:]
    nll = selected_nll(encoder_logits[:, :-1], input_ids[:, 1:], pairs)
    return _per_count(nll.sum(), pairs.sum() if num_tokens is None else num_tokens)


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
        _check_chunk_size(chunk_size)
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
        logits = _full(logits)
        _check_positions(logits, "logits", target_ids=target_ids, block_mask=block_mask)
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
            loss = _per_count(loss, num_tokens)
        correct, count = None, None
        if block_size is not None and block_size > 1 and num_positions % (block_size - 1) == 0:
            hit_mask = torch.zeros_like(mask)
            hit_mask[selected] = hits.float() * mask[selected]
            per_offset = (batch, num_positions // (block_size - 1), block_size - 1)
            correct = hit_mask.reshape(per_offset).sum((0, 1))
            count = mask.reshape(per_offset).sum((0, 1))
        return _output(loss, draft_correct_per_pos=correct, draft_count_per_pos=count)
