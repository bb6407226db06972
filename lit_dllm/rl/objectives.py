"""The RL objectives on per-token log-probabilities ``[n, T]`` of ``n`` completions (``G`` per prompt, consecutive)
with a mask of their scored tokens: group advantages, GRPO's clipped policy ratio (for a dLLM, d1's diffu-GRPO),
ESPO's sequence-level ratio, wd1's ratio-free weighted likelihood and the KL penalty, chosen by name from
:data:`OBJECTIVES`.

Each objective returns one loss per completion (``[n]``) whose mean over the batch's ``N`` completions is the loss:
the terms of a micro-batch are its completions' own, so any split of the batch gives the unsplit loss and gradients.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

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


def tied_groups(rewards: Tensor, group_size: int) -> Tensor:
    """``[N / group_size]`` bool: the groups whose rewards all tie (every advantage 0, no gradient but a KL term's)."""
    grouped = rewards.view(-1, group_size)
    return grouped.max(1).values == grouped.min(1).values


def update_rows(rewards: Tensor, group_size: int, groups: int | None) -> Tensor:
    """``[n]`` rows (ascending) of the ``groups`` groups an update trains on: those whose rewards differ (they carry
    advantages) before those whose rewards all tie, each kind in batch order (DAPO's dynamic sampling as a filter over
    a batch rolled out for more prompts than an update takes); None or at least the batch's groups: every row."""
    tied = tied_groups(rewards, group_size)
    if groups is None or groups >= len(tied):
        return torch.arange(rewards.numel(), device=rewards.device)
    chosen = torch.argsort(tied.int(), stable=True)[:groups].sort().values
    return (chosen[:, None] * group_size + torch.arange(group_size, device=rewards.device)).flatten()


def completion_mean(values: Tensor, mask: Tensor) -> Tensor:
    """``[n]``: the mean of ``values`` ``[n, T]`` over each completion's scored tokens (``mask``; none: 0)."""
    mask = mask.to(values.dtype)
    return (values * mask).sum(-1) / mask.sum(-1).clamp_min(1)


def kl_penalty(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """Per-token ``KL(policy || reference)`` estimate (Schulman's k3: ``exp(r - l) - (r - l) - 1``, >= 0, unbiased),
    gradients flowing through ``logp`` only."""
    delta = ref_logp.detach() - logp
    return torch.exp(delta) - delta - 1


def _surrogate(ratio: Tensor, advantage: Tensor, clip_eps: float) -> tuple[Tensor, Tensor]:
    """``-min(r A, clip(r, 1 - eps, 1 + eps) A)`` and where the clipped term is the smaller."""
    unclipped, clipped = ratio * advantage, ratio.clamp(1 - clip_eps, 1 + clip_eps) * advantage
    return -torch.minimum(unclipped, clipped), (clipped < unclipped).detach()


def _ratio_stats(ratio: Tensor, clipped: Tensor) -> dict[str, Tensor]:
    seen = ratio.detach()
    if not seen.numel():
        return {}
    return {"clip_fraction": clipped.float().mean(), "ratio_mean": seen.mean(), "ratio_min": seen.min(),
            "ratio_max": seen.max()}


def clipped_objective(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, clip_eps: float
                      ) -> tuple[Tensor, dict[str, Tensor]]:
    """GRPO's loss per completion: the mean over its scored tokens of ``-min(r A, clip(r, 1 ± eps) A)``,
    ``r = exp(logp - old_logp)`` per token (for an unchanged policy exactly 1); statistics over the scored tokens:
    the fraction clipped and the ratio's mean, min and max."""
    ratio = torch.exp(logp - old_logp.detach())
    per_token, clipped = _surrogate(ratio, advantages[:, None].to(logp.dtype), clip_eps)
    scored = mask.bool()
    return completion_mean(per_token, mask), _ratio_stats(ratio[scored], clipped[scored])


def sequence_objective(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, clip_eps: float
                       ) -> tuple[Tensor, dict[str, Tensor]]:
    """ESPO's loss per completion: ``-min(r A, clip(r, 1 ± eps) A)`` with one ratio per completion, ``r = exp(mean
    over its scored tokens of (logp - old_logp))`` (the length-normalised sequence likelihood ratio: a token's noisy
    estimate moves the ratio by 1/length of its change, not by all of it); statistics over completions."""
    ratio = torch.exp(completion_mean(logp - old_logp.detach(), mask))
    per_completion, clipped = _surrogate(ratio, advantages.to(logp.dtype), clip_eps)
    return per_completion, _ratio_stats(ratio, clipped)


def wd1_coefficients(advantages: Tensor, group_size: int, temperature: float) -> Tensor:
    """``[N]``: wd1's weight of each completion's mean log-probability, ``G (w-_i - w+_i)`` with
    ``w± = softmax(±psi A)`` over its group (``psi``: ``temperature``), so that the mean over completions of
    ``coefficient · l_i`` is wd1's loss averaged over groups; a group of equal rewards: all 0."""
    scores = advantages.float().view(-1, group_size) * temperature
    weights = torch.softmax(-scores, 1) - torch.softmax(scores, 1)
    return (group_size * weights).reshape(-1)


def weighted_objective(logp: Tensor, coefficients: Tensor, mask: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    """wd1's ratio-free loss per completion: ``coefficient · l`` (:func:`wd1_coefficients`), ``l`` the completion's
    mean token log-probability. Statistics: the largest coefficient's magnitude."""
    return coefficients.to(logp.dtype) * completion_mean(logp, mask), {"top_weight": coefficients.abs().max()}


@dataclass(frozen=True)
class Objective:
    """An RL objective: ``loss(logp, old_logp, coefficients, mask, rl) -> ([n] losses, statistics)`` and whether it
    takes the old policy's log-probabilities (a pass before the updates); ``coefficients(advantages, rl)`` is what each
    completion carries into ``loss`` (the advantages themselves unless the objective says otherwise). ``rl``: the
    :class:`~lit_dllm.rl.settings.Reinforcement` group, which checks its ``objective`` against this table (so this
    module does not import it)."""

    loss: Callable[[Tensor, Tensor | None, Tensor, Tensor, Any], tuple[Tensor, dict[str, Tensor]]]
    needs_old: bool
    coefficients: Callable[[Tensor, Any], Tensor] = lambda advantages, rl: advantages


OBJECTIVES = {
    "clipped": Objective(lambda logp, old, a, mask, rl: clipped_objective(logp, old, a, mask, rl.clip_eps), True),
    "sequence": Objective(lambda logp, old, a, mask, rl: sequence_objective(logp, old, a, mask, rl.clip_eps), True),
    "weighted": Objective(lambda logp, old, c, mask, rl: weighted_objective(logp, c, mask), False,
                          lambda advantages, rl: wd1_coefficients(advantages, rl.group_size, rl.weight_temperature)),
}
"""``rl.objective`` -> :class:`Objective`: ``clipped`` (GRPO / d1's diffu-GRPO), ``sequence`` (ESPO's
length-normalised sequence ratio) and ``weighted`` (wd1)."""
