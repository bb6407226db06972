"""The RL objectives against hand-derived values and their defining properties."""

import math

import pytest
import torch

from lit_dllm.rl.objectives import (
    OBJECTIVES,
    clipped_objective,
    completion_mean,
    group_advantages,
    kl_penalty,
    sequence_objective,
    tied_groups,
    update_rows,
    wd1_coefficients,
    weighted_objective,
)


def test_group_advantages_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 3.0, 3.0])
    # groups of 2: [1, 0] -> mean 0.5, unbiased std sqrt(0.5); [0, 0] -> 0; [3, 3] -> 0
    scaled = group_advantages(rewards, 2)
    half = 0.5 / (math.sqrt(0.5) + 1e-4)
    assert torch.allclose(scaled, torch.tensor([half, -half, 0, 0, 0, 0]))
    assert torch.equal(group_advantages(rewards, 2, scale=False), torch.tensor([0.5, -0.5, 0, 0, 0, 0]))
    with pytest.raises(ValueError, match="multiple of group_size=4"):
        group_advantages(rewards, 4)


def test_updates_take_the_groups_whose_rewards_differ_first_in_batch_order():
    """Groups of 2: tied, differ, tied, differ, differ. Two groups: the first two that differ; four: the three that
    differ and the first tied; five or more, or None: every row."""
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 2.0, 0.5, 0.0, 3.0])
    assert torch.equal(tied_groups(rewards, 2), torch.tensor([True, False, True, False, False]))
    assert update_rows(rewards, 2, 2).tolist() == [2, 3, 6, 7]
    assert update_rows(rewards, 2, 4).tolist() == [0, 1, 2, 3, 6, 7, 8, 9]
    for groups in (5, 9, None):
        assert torch.equal(update_rows(rewards, 2, groups), torch.arange(10))


def test_completion_mean_counts_scored_tokens_only():
    values = torch.tensor([[1.0, 2.0, 30.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0]])
    assert torch.equal(completion_mean(values, mask), torch.tensor([1.5, 5.0, 0.0]))


def test_kl_is_zero_at_the_reference_and_positive_elsewhere():
    logp = torch.tensor([-1.0, -2.0, -0.5])
    assert torch.equal(kl_penalty(logp, logp), torch.zeros(3))
    ref = torch.tensor([-1.5, -1.0, -0.5])
    delta = ref - logp
    assert torch.allclose(kl_penalty(logp, ref), torch.exp(delta) - delta - 1)
    assert (kl_penalty(logp, ref)[:2] > 0).all()


def scored_case(seed=0, N=4, T=5):
    g = torch.Generator().manual_seed(seed)
    logp = (-torch.rand(N, T, generator=g) * 3).requires_grad_()
    mask = torch.ones(N, T, dtype=torch.bool)
    mask[1, 3:] = False
    mask[3, 1:] = False
    return logp, mask, torch.tensor([1.0, -0.5, 0.25, -2.0])


def test_an_unchanged_policy_has_ratio_one_and_the_plain_policy_gradient():
    logp, mask, advantages = scored_case()
    losses, stats = clipped_objective(logp, logp.detach(), advantages, mask, clip_eps=0.2)
    loss = losses.mean()
    assert stats["ratio_mean"] == 1 and stats["ratio_min"] == 1 and stats["ratio_max"] == 1
    assert stats["clip_fraction"] == 0
    (grad,) = torch.autograd.grad(loss, logp)
    plain = -(advantages[:, None] * mask / mask.sum(1, keepdim=True)) / len(advantages)
    assert torch.allclose(grad, plain, atol=1e-7)


def test_clipping_stops_the_gradient_past_the_trust_region():
    logp, mask, advantages = scored_case()
    old = logp.detach() - torch.tensor([0.5, 0.0, 0.0, 0.5])[:, None]  # rows 0 and 3: ratio e^0.5 > 1.2
    losses, stats = clipped_objective(logp, old, advantages, mask, clip_eps=0.2)
    (grad,) = torch.autograd.grad(losses.mean(), logp)
    assert (grad[0] == 0).all()  # positive advantage, ratio above 1 + eps: clipped
    assert (grad[3, :1] != 0).all()  # negative advantage: the unclipped term is the minimum, kept
    clipped_tokens = mask[0].sum()
    assert torch.isclose(stats["clip_fraction"], clipped_tokens / mask.sum())


def test_weighted_objective_by_hand_and_no_gradient_for_equal_rewards():
    logp, mask, _ = scored_case()
    advantages = torch.tensor([1.0, -1.0, 0.0, 0.0])
    losses, _ = weighted_objective(logp, wd1_coefficients(advantages, 2, 2.0), mask)
    loss = losses.mean()
    means = completion_mean(logp, mask).detach()
    p = torch.softmax(torch.tensor([2.0, -2.0]), 0)
    group0 = -(p[0] * means[0] + p[1] * means[1]) + (p[1] * means[0] + p[0] * means[1])
    group1 = -(0.5 * means[2] + 0.5 * means[3]) + (0.5 * means[2] + 0.5 * means[3])
    assert torch.isclose(loss, (group0 + group1) / 2)
    (grad,) = torch.autograd.grad(loss, logp)
    assert (grad[2:] == 0).all() and (grad[0][mask[0]] < 0).all() and (grad[1][mask[1]] > 0).all()


def test_sequence_objective_by_hand():
    """ESPO: one ratio per completion, exp(mean token log-ratio), clipped as GRPO's; at an unchanged policy the plain
    policy gradient of the mean token log-probability."""
    logp, mask, advantages = scored_case()
    losses, stats = sequence_objective(logp, logp.detach(), advantages, mask, clip_eps=0.2)
    assert stats["ratio_min"] == 1 and stats["ratio_max"] == 1 and stats["clip_fraction"] == 0
    assert torch.allclose(losses, -advantages)
    shift = torch.tensor([0.5, 0.1, -0.1, 0.5])  # row 0: ratio e^0.5 > 1.2 with A > 0, clipped; row 3: A < 0, kept
    losses, stats = sequence_objective(logp, logp.detach() - shift[:, None], advantages, mask, clip_eps=0.2)
    ratio = torch.exp(shift)
    expected = -torch.minimum(ratio * advantages, ratio.clamp(0.8, 1.2) * advantages)
    assert torch.allclose(losses, expected)
    (grad,) = torch.autograd.grad(losses.sum(), logp)
    assert (grad[0] == 0).all() and (grad[3][mask[3]] != 0).all()
    assert stats["clip_fraction"] == 0.25


def test_every_objective_splits_over_completions():
    """Each completion's loss is its own: the losses of any split of the rows are the unsplit ones."""
    logp, mask, _ = scored_case()
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5])
    old = logp.detach() - 0.1
    settings = type("RL", (), {"clip_eps": 0.2, "group_size": 2, "weight_temperature": 1.0})()
    for objective in OBJECTIVES.values():
        coefficients = objective.coefficients(advantages, settings)
        whole = objective.loss(logp, old, coefficients, mask, settings)[0]
        parts = torch.cat([objective.loss(logp[rows], old[rows], coefficients[rows], mask[rows], settings)[0]
                           for rows in (slice(0, 1), slice(1, 4))])
        assert torch.equal(whole, parts)
