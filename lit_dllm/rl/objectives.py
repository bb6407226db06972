"""The RL objectives on per-token log-probabilities ``[N, T]`` of ``N`` completions (``G`` per prompt, consecutive)
with a mask of their scored tokens: group advantages, GRPO's clipped policy ratio (for a dLLM, d1's diffu-GRPO:
the log-probabilities are its one-pass estimate), wd1's ratio-free weighted likelihood and the KL penalty.

Each loss averages its per-token terms over a completion's scored tokens, then over completions (GRPO's
normalisation), and returns the statistics a user steers by.
"""

from __future__ import annotations

import torch
from torch import Tensor


def group_advantages(rewards: Tensor, group_size: int, scale: bool = True, eps: float = 1e-4) -> Tensor:
    """``[N]`` advantages: each reward minus its group's mean, divided by the group's standard deviation (+ ``eps``)
    when ``scale``; groups are ``group_size`` consecutive completions of one prompt."""
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards must be [N] with N a multiple of group_size={group_size}, got {tuple(rewards.shape)}.")
    grouped = rewards.float().view(-1, group_size)
    centred = grouped - grouped.mean(1, keepdim=True)
    if scale:
        centred = centred / (grouped.std(1, keepdim=True) + eps)
    return centred.reshape(-1)


def completion_mean(values: Tensor, mask: Tensor) -> Tensor:
    """``[N]``: the mean of ``values`` ``[N, T]`` over each completion's scored tokens (``mask``; none: 0)."""
    mask = mask.to(values.dtype)
    return (values * mask).sum(-1) / mask.sum(-1).clamp_min(1)


def kl_penalty(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """Per-token ``KL(policy || reference)`` estimate (Schulman's k3: ``exp(r - l) - (r - l) - 1``, >= 0, unbiased),
    gradients flowing through ``logp`` only."""
    delta = ref_logp.detach() - logp
    return torch.exp(delta) - delta - 1


def clipped_objective(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, clip_eps: float,
                      kl: Tensor | None = None, kl_beta: float = 0.0) -> tuple[Tensor, dict[str, Tensor]]:
    """GRPO's loss: ``-min(r A, clip(r, 1 - eps, 1 + eps) A) + beta KL`` per token, ``r = exp(logp - old_logp)``
    (for an unchanged policy exactly 1), and its statistics: the fraction of scored tokens clipped and the ratio's
    mean, min and max over them."""
    ratio = torch.exp(logp - old_logp.detach())
    advantage = advantages[:, None].to(logp.dtype)
    unclipped, clipped = ratio * advantage, ratio.clamp(1 - clip_eps, 1 + clip_eps) * advantage
    per_token = -torch.minimum(unclipped, clipped)
    if kl is not None and kl_beta:
        per_token = per_token + kl_beta * kl
    loss = completion_mean(per_token, mask).mean()
    scored = mask.bool()
    seen = ratio.detach()[scored]
    stats = {"clip_fraction": (clipped.detach() < unclipped.detach())[scored].float().mean(),
             "ratio_mean": seen.mean(), "ratio_min": seen.min(), "ratio_max": seen.max()} if seen.numel() else {}
    return loss, stats


def weighted_objective(logp: Tensor, advantages: Tensor, mask: Tensor, group_size: int, temperature: float,
                       kl: Tensor | None = None, kl_beta: float = 0.0) -> tuple[Tensor, dict[str, Tensor]]:
    """wd1's ratio-free loss: per group, ``-sum_i w+_i l_i + sum_i w-_i l_i`` with ``l_i`` completion i's mean
    token log-probability, ``w+ = softmax(psi A)`` and ``w- = softmax(-psi A)`` over the group (``psi``:
    ``temperature``), averaged over groups; ``+ beta KL`` as in :func:`clipped_objective`. A group of equal rewards
    weighs its completions equally both ways: no gradient. Statistics: the largest positive weight's mean."""
    logp_mean = completion_mean(logp, mask).view(-1, group_size)
    scores = advantages.to(logp.dtype).view(-1, group_size) * temperature
    positive, negative = torch.softmax(scores, 1), torch.softmax(-scores, 1)
    loss = (-(positive.detach() * logp_mean).sum(1) + (negative.detach() * logp_mean).sum(1)).mean()
    if kl is not None and kl_beta:
        loss = loss + kl_beta * completion_mean(kl, mask).mean()
    return loss, {"top_weight": positive.max(1).values.mean().detach()}
