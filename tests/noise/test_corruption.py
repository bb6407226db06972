"""Tests for lit_dllm.noise.corruption: hand-derived cases, properties, keyed invariance, statistics.

Statistical tests use fixed seeds (so they are deterministic) and tolerances of ``Z`` standard
deviations of the binomial/uniform law under test.
"""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import Tensor
from hypothesis import given, settings
from hypothesis import strategies as st

from lit_dllm.noise import corruption
from lit_dllm.noise.corruption import (
    _batched_gumbel_topk,
    _topk_from_uniforms,
    batched_gumbel_topk,
    corrupt_all_masked,
    corrupt_blockwise,
    corrupt_mix,
    corrupt_uniform,
    corrupt_uniform_random,
    gumbel_topk,
)
from lit_dllm.noise.keys import example_keys

MASK, VOCAB, PAD, BLOCK = 0, 50, 1, 4
Z = 4.5  # tolerance in standard deviations for the statistical checks
SETTINGS = settings(deadline=None, max_examples=40)
SEEDS = st.integers(0, 2**31)
BLOCK_SIZES = st.one_of(st.none(), st.integers(1, 9))

# Every kernel that takes a random source, as f(input_ids, loss_mask, **source) -> tuple.
KERNELS = {
    "uniform": lambda ids, lm, **kw: corrupt_uniform(ids, lm, MASK, **kw),
    "blockwise_row": lambda ids, lm, **kw: corrupt_blockwise(ids, lm, MASK, **kw),
    "blockwise_block": lambda ids, lm, **kw: corrupt_blockwise(ids, lm, MASK, block_size=BLOCK, **kw),
    "uniform_random": lambda ids, lm, **kw: corrupt_uniform_random(ids, lm, VOCAB, **kw),
    "uniform_random_block": lambda ids, lm, **kw: corrupt_uniform_random(ids, lm, VOCAB, block_size=BLOCK, **kw),
    "mix": lambda ids, lm, **kw: corrupt_mix(ids, lm, MASK, VOCAB, 0.3, 0.4, **kw),
}
PAD_INVARIANT = ["uniform", "blockwise_block", "uniform_random", "uniform_random_block", "mix"]


def make_batch(seed: int, rows: int, length: int, supervised: float = 0.7, loss_dtype=torch.float32):
    """Token ids in [2, VOCAB) (never MASK or PAD) and a random loss mask of ``loss_dtype``."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, VOCAB, (rows, length), generator=g)
    loss_mask = (torch.rand(rows, length, generator=g) < supervised).to(loss_dtype)
    return ids, loss_mask


def source(kind: str, seed: int, rows: int) -> dict:
    if kind == "generator":
        return {"generator": torch.Generator().manual_seed(seed)}
    return {"keys": example_keys(seed, torch.arange(rows))}


# ------------------------------------------------------------------ Gumbel top-k


@SETTINGS
@given(rows=st.integers(1, 6), width=st.integers(1, 24), seed=SEEDS, keyed=st.booleans(), data=st.data())
def test_batched_gumbel_topk_selects_exactly_k_finite(rows, width, seed, keyed, data):
    g = torch.Generator().manual_seed(seed)
    log_w = torch.randn(rows, width, generator=g)
    log_w[torch.rand(rows, width, generator=g) < 0.3] = -math.inf
    finite = torch.isfinite(log_w).sum(1)
    k = torch.tensor([data.draw(st.integers(0, int(n))) for n in finite])
    chosen = batched_gumbel_topk(log_w, k, **source("keys" if keyed else "generator", seed, rows))
    assert chosen.dtype == torch.bool
    assert torch.equal(chosen.sum(1), k)
    assert not chosen[torch.isinf(log_w)].any()


def test_batched_gumbel_topk_edge_k_and_alias():
    log_w = torch.zeros(3, 5)
    chosen = _batched_gumbel_topk(log_w, torch.tensor([0, 5, 2]), torch.Generator().manual_seed(0))
    assert _batched_gumbel_topk is batched_gumbel_topk
    assert chosen[0].sum() == 0 and chosen[1].all() and chosen[2].sum() == 2


def test_gumbel_topk_exact_k_and_follows_weights():
    log_w = torch.tensor([0.0, 0.0, -math.inf, 50.0])
    g = torch.Generator().manual_seed(0)
    for k in range(4):
        assert gumbel_topk(log_w, k, g).sum() == k
    assert gumbel_topk(log_w, 1, g).tolist() == [False, False, False, True]  # weight e^50 dominates


def test_topk_ties_break_by_index():
    """Equal scores (possible with 24-bit uniforms) pick the lowest indices, on every device."""
    chosen = _topk_from_uniforms(torch.zeros(1, 6), torch.tensor([2]), torch.full((1, 6), 0.5))
    assert chosen.tolist() == [[True, True, False, False, False, False]]


def test_gumbel_topk_flat_weights_select_uniformly():
    rows, width, k = 20_000, 8, 3
    chosen = batched_gumbel_topk(torch.zeros(rows, width), torch.full((rows,), k), torch.Generator().manual_seed(1))
    p = k / width
    assert ((chosen.sum(0) - rows * p).abs() < Z * math.sqrt(rows * p * (1 - p))).all()


# ------------------------------------------------------------------ hand-derived examples


def test_all_masked_hand_example():
    ids = torch.tensor([[5, 6, 7], [8, 9, 10]])
    loss_mask = torch.tensor([[0.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    noisy, noise, p_mask = corrupt_all_masked(ids, loss_mask, 3)
    assert noisy.tolist() == [[5, 3, 3], [3, 9, 10]]
    assert noise.tolist() == [[False, True, True], [True, False, False]]
    assert p_mask.dtype == torch.float32 and torch.equal(p_mask, torch.ones(2, 3))


def test_mix_mask_prob_one_masks_every_supervised_token():
    ids, loss_mask = make_batch(0, 4, 20)
    ids[0, :3], loss_mask[0, :3] = MASK, 1.0  # a clean MASK that is absorbed stays unchanged
    noisy, changed = corrupt_mix(ids, loss_mask, MASK, VOCAB, 1.0, 0.0, torch.Generator().manual_seed(0))
    assert torch.equal(noisy, torch.where(loss_mask.bool(), MASK, ids))
    assert torch.equal(changed, loss_mask.bool() & (ids != MASK))


@pytest.mark.parametrize("probs", [(float("nan"), 0.0), (0.2, float("nan")), (torch.tensor([0.1, float("nan")]), 0.0)])
def test_mix_refuses_a_nan_probability(probs):
    """A NaN probability compares false with every draw: unchecked, it would corrupt nothing without a word."""
    ids, loss_mask = make_batch(0, 2, 8)
    with pytest.raises(ValueError, match="must be a probability >= 0, got a minimum of nan"):
        corrupt_mix(ids, loss_mask, MASK, VOCAB, *probs, torch.Generator().manual_seed(0))


def test_mix_vocab_of_three_has_one_choice():
    ids = torch.tensor([[1, 2, 0, 1]])  # MASK = 0: 1 <-> 2, a clean MASK stays
    noisy, changed = corrupt_mix(ids, torch.ones(1, 4), 0, 3, 0.0, 1.0, torch.Generator().manual_seed(0))
    assert noisy.tolist() == [[2, 1, 0, 2]]
    assert changed.tolist() == [[True, True, False, True]]


@pytest.mark.parametrize("kind", ["generator", "keys"])
def test_mix_uniform_prob_one_changes_every_supervised_token_uniformly(kind):
    vocab, mask_id, clean = 7, 3, 5
    rows, length = 100, 100
    ids = torch.full((rows, length), clean)
    noisy, changed = corrupt_mix(ids, torch.ones(rows, length), mask_id, vocab, 0.0, 1.0, **source(kind, 0, rows))
    assert changed.all()
    counts = torch.bincount(noisy.flatten(), minlength=vocab)
    assert counts[mask_id] == 0 and counts[clean] == 0 and counts.numel() == vocab
    n, p = rows * length, 1 / (vocab - 2)
    allowed = counts[[0, 1, 2, 4, 6]]
    assert ((allowed - n * p).abs() < Z * math.sqrt(n * p * (1 - p))).all()


@SETTINGS
@given(seed=SEEDS, vocab=st.integers(3, 12), keyed=st.booleans())
def test_mix_uniform_channel_never_masks_nor_keeps(seed, vocab, keyed):
    ids, loss_mask = make_batch(seed, 3, 16)
    ids = ids % vocab
    mask_id = seed % vocab
    kw = source("keys" if keyed else "generator", seed, 3)
    noisy, changed = corrupt_mix(ids, loss_mask, mask_id, vocab, 0.0, 1.0, **kw)
    expected = loss_mask.bool() & (ids != mask_id)
    assert torch.equal(changed, expected) and torch.equal(changed, noisy != ids)
    assert (noisy[changed] != mask_id).all() and ((0 <= noisy) & (noisy < vocab)).all()


# ------------------------------------------------------------------ properties of every kernel


@SETTINGS
@given(
    name=st.sampled_from(sorted(KERNELS)),
    rows=st.integers(1, 5),
    length=st.integers(1, 30),
    seed=SEEDS,
    keyed=st.booleans(),
    loss_dtype=st.sampled_from([torch.float32, torch.bool, torch.long]),
)
def test_only_supervised_positions_change(name, rows, length, seed, keyed, loss_dtype):
    ids, loss_mask = make_batch(seed, rows, length, loss_dtype=loss_dtype)
    noisy, noise = KERNELS[name](ids, loss_mask, **source("keys" if keyed else "generator", seed, rows))[:2]
    assert noise.dtype == torch.bool and noisy.dtype == ids.dtype and noisy.shape == ids.shape
    assert not noise[~loss_mask.bool()].any()
    assert torch.equal(noisy[~noise], ids[~noise])
    if name.startswith(("uniform", "blockwise")) and not name.startswith("uniform_random"):
        assert (noisy[noise] == MASK).all()  # the mask id exactly where noise_mask
    if name.startswith("uniform_random"):
        assert ((0 <= noisy) & (noisy < VOCAB)).all()


@SETTINGS
@given(rows=st.integers(1, 5), length=st.integers(1, 30), seed=SEEDS, eps=st.sampled_from([0.0, 1e-3, 0.5]))
def test_uniform_p_mask_constant_per_row_in_range(rows, length, seed, eps):
    ids, loss_mask = make_batch(seed, rows, length)
    _, _, p_mask = corrupt_uniform(ids, loss_mask, MASK, eps, torch.Generator().manual_seed(seed))
    assert p_mask.dtype == torch.float32 and p_mask.shape == ids.shape
    assert (p_mask == p_mask[:, :1]).all() and ((eps <= p_mask) & (p_mask <= 1)).all()


@SETTINGS
@given(
    rows=st.integers(1, 5),
    length=st.integers(1, 30),
    block_size=BLOCK_SIZES,
    seed=SEEDS,
    keyed=st.booleans(),
    eps=st.sampled_from([0.0, 1e-3, 0.3]),
)
def test_blockwise_exact_k_per_block(rows, length, block_size, seed, keyed, eps):
    ids, _ = make_batch(seed, rows, length)
    kw = source("keys" if keyed else "generator", seed, rows)
    noisy, noise, p_mask = corrupt_blockwise(ids, torch.ones(rows, length), MASK, block_size, eps, **kw)
    span = length if block_size is None else block_size
    assert p_mask.dtype == torch.float32 and ((eps <= p_mask) & (p_mask <= 1)).all()
    for start in range(0, length, span):  # loop in the test only; blocks are few
        block = slice(start, min(start + span, length))
        m = p_mask[:, block]
        assert (m == m[:, :1]).all()
        real_len = block.stop - block.start  # the short last block never selects past its end
        k = torch.round(m[:, 0] * real_len).long().clamp(1 if block_size is None else 0, real_len)
        assert torch.equal(noise[:, block].sum(1), k)


@SETTINGS
@given(rows=st.integers(1, 5), length=st.integers(1, 30), block_size=BLOCK_SIZES, seed=SEEDS)
def test_blockwise_gating_after_selection(rows, length, block_size, seed):
    """Same draws with and without a loss mask: gating only removes unsupervised picks."""
    ids, loss_mask = make_batch(seed, rows, length)
    ones = torch.ones(rows, length)
    full = corrupt_blockwise(ids, ones, MASK, block_size, generator=torch.Generator().manual_seed(seed))
    gated = corrupt_blockwise(ids, loss_mask, MASK, block_size, generator=torch.Generator().manual_seed(seed))
    assert torch.equal(gated[1], full[1] & loss_mask.bool())
    assert torch.equal(gated[2], full[2])


# ------------------------------------------------------------------ determinism and draw order


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_seeded_and_keyed_determinism(name):
    ids, loss_mask = make_batch(0, 4, 64, supervised=1.0)
    kernel = KERNELS[name]

    def run(**kw):
        return kernel(ids, loss_mask, **kw)

    def same(a, b):
        return all(torch.equal(x, y) for x, y in zip(a, b))

    assert same(run(**source("generator", 1, 4)), run(**source("generator", 1, 4)))
    assert not same(run(**source("generator", 1, 4)), run(**source("generator", 2, 4)))
    assert same(run(**source("keys", 1, 4)), run(**source("keys", 1, 4)))
    assert not same(run(**source("keys", 1, 4)), run(**source("keys", 2, 4)))


def test_generator_draw_order_uniform_and_uniform_random():
    rows, length, eps = 3, 10, 0.1
    ids, loss_mask = make_batch(0, rows, length)
    noisy, noise, p_mask = corrupt_uniform(ids, loss_mask, MASK, eps, torch.Generator().manual_seed(5))
    g = torch.Generator().manual_seed(5)
    p = eps + (1 - eps) * torch.rand(rows, generator=g)
    assert torch.equal(p_mask, p[:, None].expand(rows, length))
    assert torch.equal(noise, (torch.rand(rows, length, generator=g) < p[:, None]) & loss_mask.bool())

    noisy, noise, _ = corrupt_uniform_random(ids, loss_mask, VOCAB, BLOCK, eps, torch.Generator().manual_seed(5))
    g = torch.Generator().manual_seed(5)
    t = (eps + (1 - eps) * torch.rand(rows * 3, generator=g)).view(rows, 3).repeat_interleave(BLOCK, 1)[:, :length]
    assert torch.equal(noise, (torch.rand(rows, length, generator=g) < t) & loss_mask.bool())
    tokens = torch.randint(0, VOCAB, (rows, length), generator=g)
    assert torch.equal(noisy, torch.where(noise, tokens, ids))


def test_generator_draw_order_blockwise_and_mix():
    rows, length, eps, hlr = 2, 10, 1e-3, 0.25
    ids, _ = make_batch(0, rows, length)
    ones = torch.ones(rows, length)
    _, noise, p_mask = corrupt_blockwise(ids, ones, MASK, BLOCK, eps, hlr, torch.Generator().manual_seed(9))
    g = torch.Generator().manual_seed(9)
    m = eps + (1 - eps) * torch.rand(rows * 3, generator=g)
    lens = torch.tensor([4, 4, 2] * rows)
    k = torch.round(m * lens).long()
    log_w = (math.log(2) / (hlr * BLOCK) * (1 - m))[:, None] * torch.arange(BLOCK).float()
    log_w[torch.arange(BLOCK) >= lens[:, None]] = -math.inf
    expected = batched_gumbel_topk(log_w, k, g).view(rows, 12)[:, :length]
    assert torch.equal(noise, expected)
    assert torch.equal(p_mask, m.view(rows, 3).repeat_interleave(BLOCK, 1)[:, :length])

    _, changed = corrupt_mix(ids, ones, MASK, VOCAB, 0.2, 0.5, torch.Generator().manual_seed(9))
    u = torch.rand(rows, length, generator=torch.Generator().manual_seed(9))
    assert torch.equal(changed, u < 0.7)


# ------------------------------------------------------------------ keyed invariance


def _embed(example: torch.Tensor, example_mask: torch.Tensor, rows: int, row: int, length: int, seed: int):
    """A batch of ``rows`` random rows of ``length`` with ``example`` (right-padded) at ``row``."""
    ids, loss_mask = make_batch(seed, rows, length)
    ids[row], loss_mask[row] = PAD, 0.0
    ids[row, : example.numel()], loss_mask[row, : example.numel()] = example, example_mask
    return ids, loss_mask


@pytest.mark.parametrize("name", sorted(KERNELS))
@SETTINGS
@given(
    content=st.integers(1, 24),
    pads=st.tuples(st.integers(0, 9), st.integers(0, 9)),
    rows=st.integers(2, 5),
    seed=st.integers(0, 2**40),
    epoch=st.integers(0, 100),
    index=st.integers(0, 10**6),
    data=st.data(),
)
def test_keyed_noise_independent_of_batch_layout(name, content, pads, rows, seed, epoch, index, data):
    """The same example inside two different batches gets identical noise on its positions."""
    example, example_mask = make_batch(seed + 1, 1, content)
    lengths = [content + pad for pad in pads]
    if name not in PAD_INVARIANT:
        lengths = [lengths[0]] * 2  # the row path depends on L by definition
    if name == "blockwise_block":
        lengths = [math.ceil(n / BLOCK) * BLOCK for n in lengths]  # only full blocks
    row = data.draw(st.integers(0, rows - 1))
    others = torch.tensor([i for i in range(10**6 + 1, 10**6 + rows + 1)])
    others[row] = index

    alone_ids, alone_mask = _embed(example[0], example_mask[0], 1, 0, lengths[0], seed + 2)
    batch_ids, batch_mask = _embed(example[0], example_mask[0], rows, row, lengths[1], seed + 3)
    alone = KERNELS[name](alone_ids, alone_mask, keys=example_keys(seed, torch.tensor([index]), epoch))
    batched = KERNELS[name](batch_ids, batch_mask, keys=example_keys(seed, others, epoch))
    for a, b in zip(alone, batched):
        assert torch.equal(a[0, :content], b[row, :content])


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_keyed_noise_differs_across_epochs_and_examples(name):
    ids, loss_mask = make_batch(0, 1, 64, supervised=1.0)
    kernel = KERNELS[name]

    def noise(index: int, epoch: int):
        return kernel(ids, loss_mask, keys=example_keys(3, torch.tensor([index]), epoch))

    def same(a, b):
        return all(torch.equal(x, y) for x, y in zip(a, b))

    assert same(noise(7, 0), noise(7, 0))
    assert not same(noise(7, 0), noise(7, 1))
    assert not same(noise(7, 0), noise(8, 0))


# ------------------------------------------------------------------ statistics


@pytest.mark.parametrize("kind", ["generator", "keys"])
def test_uniform_masking_rate_follows_p(kind):
    rows, length = 4000, 64
    ids, loss_mask = make_batch(0, rows, length, supervised=1.0)
    _, noise, p_mask = corrupt_uniform(ids, loss_mask, MASK, **source(kind, 11, rows))
    fraction, p = noise.float().mean(1), p_mask[:, 0]
    assert p.min() < 0.05 and p.max() > 0.95  # t covers [eps, 1)
    for low in torch.arange(0, 1, 0.2):  # rows bucketed by p: mean realised fraction ~ p
        bucket = (p >= low) & (p < low + 0.2)
        std = math.sqrt((p[bucket] * (1 - p[bucket])).sum() / length)
        assert abs((fraction[bucket] - p[bucket]).sum()) < Z * std


@pytest.mark.parametrize("kind", ["generator", "keys"])
def test_uniform_random_rate_and_token_distribution(kind):
    rows, length, vocab, eps = 4000, 32, 8, 1e-3
    ids = torch.zeros(rows, length, dtype=torch.long)
    ones = torch.ones(rows, length)
    noisy, noise, p_mask = corrupt_uniform_random(ids, ones, vocab, None, eps, **source(kind, 4, rows))
    assert torch.equal(p_mask, torch.ones(rows, length))
    # Row fraction f: E f = E t; Var f = Var t + E[t(1-t)] / L, with t ~ U(eps, 1).
    mean_t, mean_t2 = (1 + eps) / 2, (1 + eps + eps**2) / 3
    var_f = (1 - eps) ** 2 / 12 + (mean_t - mean_t2) / length
    assert abs(noise.float().mean(1).mean() - mean_t) < Z * math.sqrt(var_f / rows)
    # Replacements are uniform over the whole vocab, the clean token (0) included.
    counts, n = torch.bincount(noisy[noise], minlength=vocab), int(noise.sum())
    assert ((counts - n / vocab).abs() < Z * math.sqrt(n * (1 / vocab) * (1 - 1 / vocab))).all()


def test_keyed_randint_covers_a_2_to_31_vocab():
    rows, length, vocab = 64, 256, 2**31 - 1
    ids = torch.zeros(rows, length, dtype=torch.long)
    keys = example_keys(0, torch.arange(rows))
    out = corrupt_uniform_random(ids, torch.ones(rows, length), vocab, eps=0.999, keys=keys)
    tokens = out[0][out[1]].double()
    n = tokens.numel()
    assert ((0 <= tokens) & (tokens < vocab)).all() and n > 0.99 * rows * length
    assert abs(tokens.mean() - vocab / 2) < Z * vocab / math.sqrt(12 * n)
    assert abs((tokens < 2**24).double().mean() - 2**24 / vocab) < Z * math.sqrt(2**24 / vocab / n)


@pytest.mark.parametrize("kind", ["generator", "keys"])
def test_mix_channel_rates_follow_per_row_probabilities(kind):
    rows, length = 2000, 64
    ids, _ = make_batch(0, rows, length)
    g = torch.Generator().manual_seed(1)
    mask_prob, uniform_prob = 0.5 * torch.rand(rows, 1, generator=g), 0.5 * torch.rand(rows, 1, generator=g)
    ones = torch.ones(rows, length)
    noisy, changed = corrupt_mix(ids, ones, MASK, VOCAB, mask_prob, uniform_prob, **source(kind, 2, rows))
    absorbed = (noisy == MASK).sum(1).float()
    transitioned = (changed & (noisy != MASK)).sum(1).float()
    for count, p in ((absorbed, mask_prob[:, 0]), (transitioned, uniform_prob[:, 0])):
        assert abs((count - length * p).sum()) < Z * math.sqrt((length * p * (1 - p)).sum())


def test_blockwise_position_bias_strong_for_few_masks_flat_for_many():
    rows, length = 20_000, 32
    ids, _ = make_batch(0, rows, length)
    ones = torch.ones(rows, length)
    _, noise, p_mask = corrupt_blockwise(ids, ones, MASK, generator=torch.Generator().manual_seed(0))
    m = p_mask[:, 0]
    quarter = length // 4

    few = noise[m < 0.25].float()  # weights rise 2^(3(1-m)) >= 4.8x from first to last quarter
    first, last = few[:, :quarter].sum(), few[:, -quarter:].sum()
    assert last > 3 * first
    assert (last - first) > Z * math.sqrt(last + first)  # far beyond the no-bias (Poisson) spread

    many = noise[m > 0.9].float()  # slope (1-m) < 0.1: weights within 2^0.3 of each other
    ratio = many[:, -quarter:].mean() / many[:, :quarter].mean()
    assert 1.0 <= ratio < 1.05


# ------------------------------------------------------------------ bad input

IDS, LM = make_batch(0, 3, 8)
ERRORS = [
    (lambda: corrupt_uniform(IDS[0], LM[0], MASK), ValueError, r"\[B, L\].*\(8,\)"),
    (lambda: corrupt_uniform(IDS, LM[:, :5], MASK), ValueError, r"\(3, 8\) and \(3, 5\)"),
    (lambda: corrupt_uniform(IDS.float(), LM, MASK), TypeError, "torch.float32"),
    (lambda: corrupt_uniform(IDS, LM, MASK, eps=1.0), ValueError, r"eps must be in \[0, 1\), got 1.0"),
    (lambda: corrupt_uniform(IDS, LM, MASK, eps=-0.1), ValueError, "got -0.1"),
    (lambda: corrupt_uniform(IDS, LM, -1), ValueError, "mask_token_id.*got -1"),
    (lambda: corrupt_blockwise(IDS, LM, MASK, block_size=0), ValueError, "block_size.*got 0"),
    (lambda: corrupt_uniform_random(IDS, LM, VOCAB, block_size=-2), ValueError, "block_size.*got -2"),
    (lambda: corrupt_blockwise(IDS, LM, MASK, half_life_ratio=0.0), ValueError, "half_life_ratio.*got 0.0"),
    (lambda: corrupt_uniform_random(IDS, LM, 0), ValueError, "vocab_size must be an int >= 1, got 0"),
    (lambda: corrupt_mix(IDS, LM, MASK, 2, 0.1, 0.1), ValueError, "vocab_size must be an int >= 3, got 2"),
    (lambda: corrupt_mix(IDS, LM, VOCAB, VOCAB, 0.1, 0.1), ValueError, f"vocab_size={VOCAB}, got {VOCAB}"),
    (lambda: corrupt_mix(IDS, LM, MASK, VOCAB, 0.7, 0.5), ValueError, "<= 1, got up to 1.2"),
    (lambda: corrupt_mix(IDS, LM, MASK, VOCAB, -0.1, 0.5), ValueError, "mask_prob must be a probability >= 0.*-0.1"),
    (lambda: corrupt_mix(IDS, LM, MASK, VOCAB, torch.rand(5), 0.1), ValueError, r"mask_prob of shape \(5,\)"),
    (lambda: corrupt_uniform(IDS, LM, MASK, generator=torch.Generator(), keys=torch.arange(3)), ValueError, "not both"),
    (lambda: corrupt_uniform(IDS, LM, MASK, keys=torch.arange(4)), ValueError, r"shape \[3\].*\(4,\)"),
    (lambda: corrupt_mix(IDS, LM, MASK, VOCAB, 0.1, 0.1, keys=torch.rand(3)), TypeError, "integer tensor"),
    (lambda: batched_gumbel_topk(torch.zeros(2, 4), torch.tensor([1])), ValueError, r"shape \[2\]"),
    (lambda: gumbel_topk(torch.zeros(4), 5), ValueError, r"\[0, 4\].*got 5"),
]


@pytest.mark.parametrize(("call", "error", "message"), ERRORS)
def test_bad_input_raises_naming_the_value(call, error, message):
    with pytest.raises(error, match=message):
        call()


# ------------------------------------------------------------------ CUDA


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", sorted(KERNELS))
def test_cuda_keyed_matches_cpu_bit_for_bit(name):
    rows, length = 16, 200
    ids, loss_mask = make_batch(0, rows, length)
    keys = example_keys(123, torch.arange(rows), 4)
    on_cpu = KERNELS[name](ids, loss_mask, keys=keys)
    on_gpu = KERNELS[name](ids.cuda(), loss_mask.cuda(), keys=keys.cuda())
    assert all(torch.equal(a, b.cpu()) for a, b in zip(on_cpu, on_gpu))

    noisy, noise = KERNELS[name](ids.cuda(), loss_mask.cuda(), generator=torch.Generator("cuda").manual_seed(0))[:2]
    assert noisy.is_cuda and not noise[~loss_mask.cuda().bool()].any()
    log_w = torch.randn(rows, length)
    k = torch.randint(0, length, (rows,))
    chosen_gpu = batched_gumbel_topk(log_w.cuda(), k.cuda(), keys=keys.cuda())
    assert torch.equal(batched_gumbel_topk(log_w, k, keys=keys), chosen_gpu.cpu())


# ------------------------------------------------------------------ fused (Triton) keyed kernels

# The keyed kernels with the shapes and options the fused path must reproduce, as f(ids, loss_mask, keys).
FUSED_CASES = {
    **KERNELS,
    "uniform_eps0": lambda ids, lm, **kw: corrupt_uniform(ids, lm, MASK, eps=0.0, **kw),
    "blockwise_5": lambda ids, lm, **kw: corrupt_blockwise(ids, lm, MASK, 5, 0.2, 0.3, **kw),
    "blockwise_1": lambda ids, lm, **kw: corrupt_blockwise(ids, lm, MASK, 1, **kw),
    "blockwise_long": lambda ids, lm, **kw: corrupt_blockwise(ids, lm, MASK, 200, **kw),
    "mix_mask_id_inside": lambda ids, lm, **kw: corrupt_mix(ids, lm, 7, VOCAB, 0.5, 0.3, **kw),
    "mix_tensor_probs": lambda ids, lm, **kw: corrupt_mix(ids, lm, MASK, VOCAB, *tensor_probs(ids), **kw),
}


def tensor_probs(ids: Tensor) -> tuple[Tensor, Tensor]:
    """A per-row mask probability and a per-position uniform one, the same on every call."""
    per_position = torch.rand(ids.shape, generator=torch.Generator().manual_seed(0))
    return torch.linspace(0, 0.6, len(ids)).to(ids.device), (0.4 * per_position).to(ids.device)


def assert_fused_equals_eager(device: str, rows: int, length: int, prefix: str = "") -> None:
    """Every keyed kernel (whose case name starts with ``prefix``) through the fused path equals the eager path on
    ``device`` and on the CPU, bit for bit."""
    for loss_dtype in (torch.float32, torch.bool):
        ids, loss_mask = make_batch(length, rows, length, loss_dtype=loss_dtype)
        ids[0, : length // 4] = 7  # clean tokens equal to mix's mask id
        keys = example_keys(11, torch.arange(rows) + 5, 2)
        for name, kernel in FUSED_CASES.items():
            if not name.startswith(prefix):
                continue
            fused = kernel(ids.to(device), loss_mask.to(device), keys=keys.to(device))
            corruption.FUSED_KEYED_KERNELS = False
            try:
                eager = kernel(ids.to(device), loss_mask.to(device), keys=keys.to(device))
                on_cpu = kernel(ids, loss_mask, keys=keys)
            finally:
                corruption.FUSED_KEYED_KERNELS = True
            for a, b, c in zip(fused, eager, on_cpu):
                assert a.dtype == b.dtype and torch.equal(a, b) and torch.equal(a.cpu(), c), (name, loss_dtype)


def run_under_triton_interpreter(code: str) -> None:
    """Runs ``code`` in a fresh interpreter with ``TRITON_INTERPRET=1`` (Triton's CPU interpreter); fails if it does."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="needs Triton (its interpreter runs on CPU)")


@needs_triton
def test_the_triton_kernels_under_its_cpu_interpreter_equal_eager_and_break_ties_as_the_sort_does():
    """In one interpreter (its start costs more than the checks): the Triton kernels equal the eager torch path bit for
    bit, with blocks sorted in one program and with blocks longer than the sorted span radix-selected in chunks smaller
    than a row (only the blockwise kernels sort); then, with scores rounded down to whole numbers (many ties, some
    straddling chunks), the radix-select kernel chooses exactly what the sorting kernel chooses: above the k-th score,
    then the lowest positions tied with it."""
    run_under_triton_interpreter("""
import torch, triton, triton.language as tl
import lit_dllm.noise.fused_corruption as fc
from lit_dllm.noise.corruption import corrupt_blockwise
from lit_dllm.noise.keys import example_keys
from tests.noise.test_corruption import assert_fused_equals_eager
fc._SORTED_SPAN, fc._SELECT_CHUNK = 64, 16
assert_fused_equals_eager("cpu", 3, 37)
fc._SORTED_SPAN = 8
assert_fused_equals_eager("cpu", 3, 37, "blockwise")

exact = fc._gumbel_scores
@triton.jit
def coarse(state, block, span, j, slope, block_len):
    return tl.floor(exact(state, block, span, j, slope, block_len))
fc._gumbel_scores = coarse
ids, loss_mask, keys = torch.arange(4 * 45).view(4, 45) + 2, torch.ones(4, 45), example_keys(3, torch.arange(4), 1)
for block_size in (None, 20):
    fc._SORTED_SPAN = 64
    by_sort = corrupt_blockwise(ids, loss_mask, 1, block_size, keys=keys)
    fc._SORTED_SPAN, fc._SELECT_CHUNK = 8, 8
    by_select = corrupt_blockwise(ids, loss_mask, 1, block_size, keys=keys)
    noise = by_sort[1]
    assert 0 < noise.sum() < noise.numel() and all(map(torch.equal, by_sort, by_select)), block_size
""")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
# rows > 1024 positions are radix-selected (2000 and 4096: one chunk; 5000: two)
@pytest.mark.parametrize(("rows", "length"), [(3, 37), (2, 2000), (8, 4096), (2, 5000)])
def test_cuda_fused_keyed_kernels_equal_eager_and_cpu(rows, length):
    pytest.importorskip("triton")
    assert_fused_equals_eager("cuda", rows, length)
