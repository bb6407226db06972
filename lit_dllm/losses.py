"""dLLM loss primitives (docs/DESIGN.md §6): what the families' fused paths and the loss classes compute with.

* :func:`fused_linear_cross_entropy` / :func:`weighted_linear_cross_entropy`: the LM head applied only at the scored
  positions, chunk by chunk, never materialising ``[B, L, V]`` logits (the MDLM, hybrid, causal-LM and Gemma paths);
  :func:`elbo_weight`, the MDLM weight ``1 / p``; :func:`selected_nll` on logits already built; :func:`linear_log_probs`,
  the log-probabilities and entropies the RL objectives take, chunked the same way.
* The shared checks and reductions of the loss classes: :func:`check_positions`, :func:`per_count`,
  :func:`loss_output`, :func:`full_tensor`, :func:`check_chunk_size`. The classes themselves live where they are
  used: the DFlash draft's loss in :mod:`lit_dllm.families.dflash.loss`, the reference's full-logits formulations
  (the parity targets of the fused paths) in :mod:`lit_dllm.reference.losses`.

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
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from lit_dllm import compat

Count = Union[int, Tensor]

NLL_CHUNK_SIZE = 1024
"""Positions per cross-entropy chunk for losses that take logits."""

P_MASK_FLOOR = 1e-8

COMPILE_LINEAR_CE_ON_CUDA = True
"""Score :func:`fused_linear_cross_entropy`'s chunks on CUDA with a ``torch.compile``d chunk (the upcast,
log-sum-exp, gather and argmax fused after the matmul): faster and half the extra memory of the eager chunk
(docs/benchmarks/primitives.md). The CPU path is always eager."""


class DLLMLossOutput(NamedTuple):
    """What every dLLM loss returns; ``dllm_loss`` is a detached copy for logging."""

    total_loss: Tensor
    dllm_loss: Tensor
    draft_correct_per_pos: Optional[Tensor] = None
    draft_count_per_pos: Optional[Tensor] = None


# --- per-token NLL ---------------------------------------------------------------------------------


def _logits_chunk(logits: Tensor, targets: Tensor, fp32_upcast: bool) -> Tuple[Tensor]:
    return (F.cross_entropy(logits.float() if fp32_upcast else logits, targets, reduction="none"),)


def _head_logits(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], softcap: Optional[float]) -> Tensor:
    """One chunk's fp32 logits, soft-capped (``c * tanh(x / c)``) where ``softcap`` is set."""
    logits = F.linear(hidden, weight, bias).float()
    return logits if softcap is None else softcap * torch.tanh(logits / softcap)


def _linear_chunk(
    hidden: Tensor, targets: Tensor, weight: Tensor, bias: Optional[Tensor], softcap: Optional[float]
) -> Tuple[Tensor, Tensor]:
    logits = _head_logits(hidden, weight, bias, softcap)
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


def _log_prob_chunk(
    hidden: Tensor, targets: Tensor, weight: Tensor, bias: Optional[Tensor], softcap: Optional[float]
) -> Tuple[Tensor, Tensor]:
    logp = torch.log_softmax(_head_logits(hidden, weight, bias, softcap), -1)
    entropy = -(logp.exp() * logp).sum(-1)
    return logp.gather(-1, targets[:, None]).squeeze(-1), entropy.detach()


def linear_log_probs(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    bias: Optional[Tensor] = None,
    chunk_size: int = 1024,
    softcap: Optional[float] = None,
) -> Tuple[Tensor, Tensor]:
    """Per-row log-probability of ``targets`` under ``linear(hidden, weight, bias)`` (fp32, differentiable) and the
    prediction's entropy (fp32, detached), chunk by chunk under checkpointing as :func:`fused_linear_cross_entropy`:
    never more than one ``[chunk_size, V]`` block of fp32 logits (the RL objectives' log-probabilities).

    Args: as :func:`fused_linear_cross_entropy`. Returns: ``(logp, entropy)``, ``[N]`` each.
    """
    _check_linear_inputs(hidden, weight, targets, chunk_size)
    return _checkpointed_chunks(_log_prob_chunk, hidden, targets, chunk_size, weight, bias, softcap)


SOFTCAP_SHIFT_MAX = 40.0
"""Soft-capped logits ``z = c · tanh(x / c)`` lie in ``[-c, c]``: for ``c`` up to this, :func:`_scored_chunk`'s
log-sum-exp shifts by ``c`` instead of the row's maximum, one pass over the chunk instead of two (every term
``exp(z - c) >= exp(-2c)`` stays a normal fp32 number, so the sum is never 0)."""


def _scored_chunk(
    logits: Tensor, targets: Tensor, row_weights: Tensor, softcap: Optional[float]
) -> Tuple[Tensor, Tensor]:
    """NLL and argmax hits of one chunk; ``logits`` is overwritten with ``d(Σ row_weights · nll) / d logits`` (one
    ``[chunk, V]`` buffer for both: compiled, the gradient is written in place). Under a soft-cap ``tanh(x / c)`` is
    ``2 · sigmoid(2x / c) - 1`` (one exp; compiled, cheaper than the accurate tanh, within 3e-7 of it)."""
    z = logits.float()
    if softcap is not None:
        tanh = 2.0 * torch.sigmoid(z * (2.0 / softcap)) - 1.0
        z = softcap * tanh
    if softcap is not None and softcap <= SOFTCAP_SHIFT_MAX:
        lse = softcap + torch.log(torch.exp(z - softcap).sum(-1))
    else:
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
    """:func:`_scored_chunk` compiled for any number of rows but the vocabulary and soft-cap it first meets as
    constants: all sizes symbolic would give a kernel that divides each element's index by a runtime vocabulary and
    scales by the soft-cap in fp64, about half as fast."""
    compiled = torch.compile(_scored_chunk, fullgraph=True)

    def chunk(logits: Tensor, targets: Tensor, row_weights: Tensor, softcap: Optional[float]):
        for tensor in (logits, targets, row_weights):
            compat.maybe_mark_dynamic(tensor, 0)
        return compiled(logits, targets, row_weights, softcap)

    return chunk


def _scale(tensor: Tensor, scale: Tensor) -> Tensor:
    """``tensor *= scale``, in place."""
    return tensor.mul_(scale)


@functools.cache
def _compiled_scale() -> Callable[[Tensor, Tensor], Tensor]:
    """:func:`_scale` compiled for any size (one flat view): eager, a bf16 tensor times a 0-dim fp32 CUDA tensor takes
    a slow per-element casting path, about twice the compiled kernel's time."""
    compiled = torch.compile(_scale, fullgraph=True, dynamic=True)

    def scale_(tensor: Tensor, scale: Tensor) -> Tensor:
        compiled(tensor.view(-1), scale)
        return tensor

    return scale_


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
            grad_weight = None  # the first chunk writes it (beta=0), the others add to it
            if ctx.needs_input_grad[1]:
                grad_weight = torch.empty_like(w) if len(h) else torch.zeros_like(w)
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
                    grad_weight.addmm_(grad.T, h[rows], beta=int(start > 0))
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
        scale_ = _compiled_scale() if grad_total.is_cuda and COMPILE_LINEAR_CE_ON_CUDA else _scale
        scaled = [None if grad is None else scale_(grad, grad_total) for grad in ctx.saved_tensors]
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


def full_tensor(logits: Tensor) -> Tensor:
    """``logits`` as a plain tensor: a DTensor (e.g. vocab-sharded logits) gathered, any other as it is."""
    return logits.full_tensor() if hasattr(logits, "full_tensor") else logits


def _check_linear_inputs(hidden: Tensor, weight: Tensor, targets: Tensor, chunk_size: int) -> None:
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"hidden {tuple(hidden.shape)} must be [N, D] and weight {tuple(weight.shape)} [V, D] with the same D."
        )
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"targets {tuple(targets.shape)} must be [N] for hidden {tuple(hidden.shape)}.")
    check_chunk_size(chunk_size)


def check_chunk_size(chunk_size: int) -> None:
    """A ValueError unless ``chunk_size`` (positions per cross-entropy chunk) is positive."""
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}.")


def check_positions(logits: Tensor, logits_name: str, **per_position: Optional[Tensor]) -> None:
    """Require ``[B, L, V]`` logits and ``[B, L]`` per-position tensors."""
    if logits.dim() != 3:
        raise ValueError(f"{logits_name} must be [B, L, V], got {tuple(logits.shape)}.")
    for name, tensor in per_position.items():
        if tensor is not None and tensor.shape != logits.shape[:2]:
            raise ValueError(
                f"{name} {tuple(tensor.shape)} does not match {logits_name} {tuple(logits.shape)}; "
                f"expected {tuple(logits.shape[:2])}."
            )


def per_count(total: Tensor, count: Optional[Count], name: str = "count") -> Tensor:
    """``total / max(count, 1)``; ``total`` unchanged when ``count`` is None. A negative (or NaN) count, the argument
    ``name``, is a ValueError: clamped, it would silently give another loss."""
    if count is None:
        return total
    lowest = float(count.min()) if isinstance(count, Tensor) else count
    if not lowest >= 0:
        raise ValueError(f"{name}={lowest!r} must be a count of tokens >= 0 (the loss's denominator, e.g. the scored "
                         "tokens summed over the data-parallel ranks), or None for the raw sum.")
    if isinstance(count, Tensor):
        return total / count.to(total.device).clamp(min=1)
    return total / max(count, 1)


def loss_output(total: Tensor, dllm: Optional[Tensor] = None, **draft_stats: Optional[Tensor]) -> DLLMLossOutput:
    """A :class:`DLLMLossOutput` of ``total`` whose ``dllm_loss`` is ``dllm`` (default ``total``), detached."""
    dllm = total if dllm is None else dllm
    return DLLMLossOutput(total, dllm.detach(), **draft_stats)


def _inverse_p(p_mask: Tensor) -> Tensor:
    return 1.0 / p_mask.float().clamp(min=P_MASK_FLOOR)


def elbo_weight(p_mask: Tensor) -> Tensor:
    """The diffusion ELBO weight ``nan_to_num(1 / clamp(p, 1e-8))`` (NaN→0, ±inf→1), in fp32."""
    return torch.nan_to_num(_inverse_p(p_mask), nan=0.0, posinf=1.0, neginf=1.0)
