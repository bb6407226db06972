import functools
import warnings

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from lit_dllm.masks import (
    block_diffusion_batch_mask,
    block_diffusion_block_mask,
    build_block_diffusion_training_mask,
    create_dflash_attention_mask,
    create_dflash_block_mask,
    encoder_attention_masks,
    encoder_block_masks,
)

PROPERTY = settings(max_examples=50, deadline=None)


def b(rows):
    return torch.tensor(rows, dtype=torch.bool)


def build(prefix, R, enc_len, block_size, **kwargs):
    if isinstance(prefix, int):
        kwargs.setdefault("batch_size", 1)
    return build_block_diffusion_training_mask(prefix, R, enc_len, block_size, **kwargs)


# --- hand-derived masks ----------------------------------------------------------------------------

# P=2, R=4, enc_len=7, block_size=2. Encoder columns c=0..6 have rel = c - 2 = -2..4: prompt c=0,1;
# response block 0 at c=2,3, block 1 at c=4,5; c=6 is tail padding. Queries j=0,1 are block 0,
# j=2,3 block 1. Columns: 7 encoder | 4 canvas.
FULL_P2 = b(
    [
        [1, 1, 0, 0, 0, 0, 0, 1, 1, 0, 0],  # block 0: prompt only
        [1, 1, 0, 0, 0, 0, 0, 1, 1, 0, 0],
        [1, 1, 1, 1, 0, 0, 0, 0, 0, 1, 1],  # block 1: prompt + clean block 0, never its own block
        [1, 1, 1, 1, 0, 0, 0, 0, 0, 1, 1],
    ]
)
# Sliding W: encoder columns c >= P + qb*2 - W + 1, i.e. the last W-1 before the block start (c=2, c=4).
SLIDING_P2 = {
    2: b(
        [
            [0, 1, 0, 0, 0, 0, 0, 1, 1, 0, 0],  # c >= 1
            [0, 1, 0, 0, 0, 0, 0, 1, 1, 0, 0],
            [0, 0, 0, 1, 0, 0, 0, 0, 0, 1, 1],  # c >= 3
            [0, 0, 0, 1, 0, 0, 0, 0, 0, 1, 1],
        ]
    ),
    3: b(
        [
            [1, 1, 0, 0, 0, 0, 0, 1, 1, 0, 0],  # c >= 0
            [1, 1, 0, 0, 0, 0, 0, 1, 1, 0, 0],
            [0, 0, 1, 1, 0, 0, 0, 0, 0, 1, 1],  # c >= 2
            [0, 0, 1, 1, 0, 0, 0, 0, 0, 1, 1],
        ]
    ),
}
# Same shapes with P=3: rel = -3..3; prompt c=0..2, block 0 at c=3,4, block 1 at c=5,6.
FULL_P3 = b(
    [
        [1, 1, 1, 0, 0, 0, 0, 1, 1, 0, 0],
        [1, 1, 1, 0, 0, 0, 0, 1, 1, 0, 0],
        [1, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1],
        [1, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1],
    ]
)


def test_full_mask_hand_derived():
    mask = build(2, 4, 7, 2)
    assert mask.dtype == torch.bool and mask.shape == (1, 1, 4, 11)
    assert torch.equal(mask[0, 0], FULL_P2)


def test_int_prefix_repeats_over_batch():
    assert torch.equal(build_block_diffusion_training_mask(2, 4, 7, 2, batch_size=3), FULL_P2.expand(3, 1, 4, 11))


@pytest.mark.parametrize("window", [2, 3])
def test_sliding_mask_hand_derived(window):
    assert torch.equal(build(2, 4, 7, 2, sliding_window=window)[0, 0], SLIDING_P2[window])


def test_per_example_prefix_tensor():
    mask = build(torch.tensor([2, 3]), 4, 7, 2)
    assert torch.equal(mask[:, 0], torch.stack([FULL_P2, FULL_P3]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 2])
def test_additive_form(dtype, window):
    keep = build(torch.tensor([2, 3]), 4, 7, 2, sliding_window=window)
    additive = build(torch.tensor([2, 3]), 4, 7, 2, sliding_window=window, dtype=dtype)
    assert additive.dtype == dtype
    assert torch.equal(additive, torch.where(keep, 0.0, torch.finfo(dtype).min).to(dtype))
    assert torch.isfinite(additive).all()


def assert_rows_do_not_leak(mask: torch.Tensor) -> None:
    """Each query row's attention output under the additive float64 ``mask`` ``[B, 1, Q, K]`` is unchanged when
    every key and value that row must not see is replaced by fresh noise."""
    gen = torch.Generator().manual_seed(0)
    batch, _, queries, keys = mask.shape
    q, k, v = (torch.randn(batch, 1, n, 8, generator=gen, dtype=torch.float64) for n in (queries, keys, keys))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    for row in range(queries):
        hidden = (mask[:, :, row] < 0).unsqueeze(-1)  # [B, 1, K, 1]
        k2 = torch.where(hidden, torch.randn(k.shape, generator=gen, dtype=k.dtype), k)
        v2 = torch.where(hidden, torch.randn(v.shape, generator=gen, dtype=v.dtype), v)
        assert torch.equal(F.scaled_dot_product_attention(q, k2, v2, attn_mask=mask)[:, :, row], out[:, :, row])


def test_masked_positions_do_not_leak():
    """Attention output of each canvas row is unchanged when every key/value it must not see changes."""
    assert_rows_do_not_leak(build(torch.tensor([2, 3]), 4, 7, 2, sliding_window=3, dtype=torch.float64))


# --- properties ------------------------------------------------------------------------------------


@st.composite
def mask_cases(draw):
    block_size = draw(st.integers(1, 4))
    R = draw(st.integers(1, 9))
    prefixes = draw(st.lists(st.integers(0, 6), min_size=1, max_size=3))
    enc_len = max(prefixes) + R + draw(st.integers(0, 3))
    window = draw(st.integers(1, enc_len + 2))
    return torch.tensor(prefixes), R, enc_len, block_size, window


@st.composite
def batch_mask_cases(draw):
    """A :func:`mask_cases` case with per-example response lengths (0 .. what fits) and a window or None:
    ``(prefix, lengths, R, enc_len, block_size, window)``."""
    prefix, R, enc_len, block_size, window = draw(mask_cases())
    lengths = torch.tensor([draw(st.integers(0, min(R, enc_len - p))) for p in prefix.tolist()])
    return prefix, lengths, R, enc_len, block_size, draw(st.sampled_from([None, window]))


def _grid(prefix, R, enc_len, block_size):
    """rel ``[B, 1, enc_len]``, query block ``[1, R, 1]`` and canvas key block ``[1, 1, R]``."""
    rel = torch.arange(enc_len).view(1, 1, -1) - prefix.view(-1, 1, 1)
    return rel, (torch.arange(R) // block_size).view(1, R, 1), (torch.arange(R) // block_size).view(1, 1, R)


@PROPERTY
@given(mask_cases())
def test_block_causal_properties(case):
    prefix, R, enc_len, block_size, window = case
    rel, qb, kb = _grid(prefix, R, enc_len, block_size)
    for window_or_none in (None, window):
        mask = build(prefix, R, enc_len, block_size, sliding_window=window_or_none)[:, 0]
        encoder, canvas = mask[..., :enc_len], mask[..., enc_len:]
        seen_response = encoder & (rel >= 0)
        assert not (seen_response & (rel // block_size >= qb)).any()  # strict: not its own block, nor later
        assert not (encoder & (rel >= R)).any()  # never tail padding
        assert torch.equal(canvas, (kb == qb).expand_as(canvas))  # exactly its own canvas block
    full = build(prefix, R, enc_len, block_size)[:, 0, :, :enc_len]
    assert torch.equal(full, (rel < qb * block_size).expand_as(full))  # prompt + every earlier block


@PROPERTY
@given(mask_cases())
def test_sliding_is_block_anchored_subset_of_full(case):
    prefix, R, enc_len, block_size, window = case
    full = build(prefix, R, enc_len, block_size)
    sliding = build(prefix, R, enc_len, block_size, sliding_window=window)
    assert not (sliding & ~full).any()
    rel, qb, _ = _grid(prefix, R, enc_len, block_size)
    kept_cache = full[:, 0, :, :enc_len] & (rel >= qb * block_size - window + 1)
    assert torch.equal(sliding[:, 0, :, :enc_len], kept_cache)
    assert (sliding[:, 0, :, :enc_len].sum(-1) <= window - 1).all()
    assert torch.equal(build(prefix, R, enc_len, block_size, sliding_window=max(window, enc_len)), full)


# --- errors ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, kwargs, match",
    [
        ((2, 4, 7, 2), {}, r"prefix=2 .*batch_size"),
        ((torch.zeros(2, 1, dtype=torch.long), 4, 7, 2), {}, r"shape \(2, 1\)"),
        ((torch.tensor([1.0]), 4, 7, 2), {}, r"torch.float32"),
        ((torch.tensor([1, 2]), 4, 7, 2), {"batch_size": 3}, r"batch_size=3"),
        ((torch.tensor([1, -1]), 4, 7, 2), {}, r"\[1, -1\]"),
        ((torch.tensor([2, 4]), 4, 7, 2), {}, r"\[6, 8\] exceeds enc_len=7.*enc_len >= 8"),
        ((2, 4, 7, 0), {"batch_size": 1}, r"block_size must be positive, got 0"),
        ((2, 0, 7, 2), {"batch_size": 1}, r"R .* got 0"),
        ((2, 4, 7, 2), {"batch_size": 1, "sliding_window": 0}, r"sliding_window .* got 0"),
        ((2, 4, 7, 2), {"batch_size": 1, "dtype": torch.int32}, r"float dtype, got torch.int32"),
    ],
)
def test_errors_name_the_value(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        build_block_diffusion_training_mask(*args, **kwargs)


# --- batched training mask -------------------------------------------------------------------------


def test_batch_mask_hand_derived():
    # enc_len=4, R=2, block_size=2 (one canvas block). Columns: 4 encoder | 2 canvas.
    # b0: P=1, R_b=2 -> prompt c=0. b1: P=2, R_b=1 -> prompt c=0,1; canvas 1 and row 1 are padding.
    # b2: P=4, R_b=0 (no supervision) -> only the canvas diagonal.
    mask = block_diffusion_batch_mask(torch.tensor([1, 2, 4]), torch.tensor([2, 1, 0]), 2, 4, 2)
    expected = b(
        [
            [[1, 0, 0, 0, 1, 1], [1, 0, 0, 0, 1, 1]],
            [[1, 1, 0, 0, 1, 0], [0, 0, 0, 0, 0, 1]],
            [[0, 0, 0, 0, 1, 0], [0, 0, 0, 0, 0, 1]],
        ]
    )
    assert mask.dtype == torch.float32 and mask.shape == (3, 1, 2, 6)
    assert torch.equal(mask[:, 0] == 0, expected)
    assert torch.equal(mask, torch.where(mask == 0, 0.0, torch.finfo(torch.float32).min))


@PROPERTY
@given(batch_mask_cases())
def test_batch_mask_matches_single_example_mask(case):
    prefix, lengths, R, enc_len, block_size, window = case
    mask = block_diffusion_batch_mask(prefix, lengths, R, enc_len, block_size, sliding_window=window)
    keep = mask[:, 0] == 0
    assert mask.dtype == torch.float32 and mask.shape == (len(prefix), 1, R, enc_len + R)
    assert keep.any(-1).all()  # no row fully masked
    for i, (p, r) in enumerate(zip(prefix.tolist(), lengths.tolist())):
        if r > 0:
            single = build(p, r, enc_len, block_size, sliding_window=window)[0, 0]
            assert torch.equal(keep[i, :r, : enc_len + r], single)
            assert not keep[i, :r, enc_len + r :].any()  # pad canvas columns invisible to real rows
        pad_rows = torch.arange(r, R)
        expected = torch.zeros(R - r, enc_len + R, dtype=torch.bool)
        expected[torch.arange(R - r), enc_len + pad_rows] = True
        assert torch.equal(keep[i, r:], expected)  # pad rows: only their own diagonal


def test_batch_mask_bf16_and_errors():
    mask = block_diffusion_batch_mask(torch.tensor([1]), torch.tensor([2]), 2, 4, 2, dtype=torch.bfloat16)
    assert mask.dtype == torch.bfloat16 and mask.min() == torch.finfo(torch.bfloat16).min
    with pytest.raises(ValueError, match=r"R=2.*got \[3\]"):
        block_diffusion_batch_mask(torch.tensor([1]), torch.tensor([3]), 2, 4, 2)
    with pytest.raises(ValueError, match=r"\(2,\)"):
        block_diffusion_batch_mask(torch.tensor([1]), torch.tensor([1, 1]), 2, 4, 2)
    with pytest.raises(ValueError, match=r"enc_len=4"):
        block_diffusion_batch_mask(torch.tensor([3]), torch.tensor([2]), 2, 4, 2)


# --- encoder masks ---------------------------------------------------------------------------------


def test_encoder_masks_hand_derived():
    # S=4, W=2; row 0 has 3 real tokens, row 1 has 2. Padded keys hidden; diagonal always kept.
    masks = encoder_attention_masks(torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]]), sliding_window=2)
    full = b(
        [
            [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]],  # q3 is padding: real keys + itself
            [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 0, 1]],
        ]
    )
    sliding = b(
        [
            [[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]],  # keys q-1 and q only
            [[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 0, 1]],
        ]
    )
    assert set(masks) == {"full_attention", "sliding_attention"}
    for name, expected in (("full_attention", full), ("sliding_attention", sliding)):
        mask = masks[name]
        assert mask.dtype == torch.float32 and mask.shape == (2, 1, 4, 4)
        assert torch.equal(mask[:, 0], torch.where(expected, 0.0, torch.finfo(torch.float32).min))


def test_encoder_masks_dtype_and_errors():
    masks = encoder_attention_masks(torch.ones(1, 3, dtype=torch.bool), None, dtype=torch.bfloat16)
    assert torch.equal(masks["full_attention"], masks["sliding_attention"])
    assert masks["full_attention"].dtype == torch.bfloat16
    with pytest.raises(ValueError, match=r"\[B, S\].*\(3,\)"):
        encoder_attention_masks(torch.ones(3), 2)
    with pytest.raises(ValueError, match=r"sliding_window .* got 0"):
        encoder_attention_masks(torch.ones(1, 3), 0)



# --- FlexAttention block masks of the block-diffusion and encoder masks -----------------------------


def assert_block_mask_is(block_mask, keep: torch.Tensor) -> None:
    """``block_mask``'s mask_mod, evaluated at every (b, q, kv), is exactly the bool ``keep`` ``[B, Q, KV]``, and its
    tiles are exactly those that keep something (only fully masked tiles are skipped)."""
    from torch.nn.attention.flex_attention import create_mask

    B, Q, KV = keep.shape
    assert block_mask.shape == (B, 1, Q, KV)
    assert torch.equal(create_mask(block_mask.mask_mod, B, 1, Q, KV, device=keep.device)[:, 0], keep)
    tile_q, tile_kv = block_mask.BLOCK_SIZE
    padded = F.pad(keep, (0, -KV % tile_kv, 0, -Q % tile_q))
    tiles = padded.unflatten(2, (-1, tile_kv)).unflatten(1, (-1, tile_q)).any(4).any(2)
    assert torch.equal(block_mask.to_dense()[:, 0].bool(), tiles)


@PROPERTY
@given(batch_mask_cases())
def test_block_diffusion_block_mask_is_the_dense_mask(case):
    """Padding rows (R_b < R, R_b = 0), windows below a block, prompts of any length: the same keep-mask."""
    prefix, lengths, R, enc_len, block_size, window = case
    args = (prefix, lengths, R, enc_len, block_size)
    dense = block_diffusion_batch_mask(*args, sliding_window=window)
    assert_block_mask_is(block_diffusion_block_mask(*args, sliding_window=window), dense[:, 0] == 0)


@st.composite
def encoder_cases(draw):
    B, S = draw(st.integers(1, 3)), draw(st.integers(1, 12))
    attention = torch.tensor(draw(st.lists(st.lists(st.booleans(), min_size=S, max_size=S), min_size=B, max_size=B)))
    return attention, draw(st.one_of(st.none(), st.integers(1, S + 2)))


@PROPERTY
@given(encoder_cases())
def test_encoder_block_masks_are_the_dense_masks(case):
    """Padded keys anywhere (fully padded rows too), any window: the same keep-mask per layer type."""
    attention, window = case
    dense, flex = encoder_attention_masks(attention, window), encoder_block_masks(attention, window)
    assert set(flex) == set(dense)
    for name, mask in dense.items():
        assert_block_mask_is(flex[name], mask[:, 0] == 0)


def test_block_masks_across_tiles_equal_the_dense_masks_in_attention():
    """Several 128-tiles with partial last tiles: masks and eager flex attention outputs equal the dense ones
    (decoder: per-example prompts, pad rows, an empty response, a window below the canvas block; encoder: padding)."""
    prefix, lengths = torch.tensor([0, 57, 150, 300]), torch.tensor([160, 96, 0, 32])
    R, enc_len, block_size = 160, 332, 32
    for window in (None, 20, 200):
        args = (prefix, lengths, R, enc_len, block_size)
        dense = block_diffusion_batch_mask(*args, sliding_window=window)
        block_mask = block_diffusion_block_mask(*args, sliding_window=window)
        assert_block_mask_is(block_mask, dense[:, 0] == 0)
        assert_flex_equals_sdpa(block_mask, dense)
    attention = torch.arange(300)[None] < torch.tensor([[300], [211], [1]])
    dense, flex = encoder_attention_masks(attention, 100), encoder_block_masks(attention, 100)
    for name in dense:
        assert_block_mask_is(flex[name], dense[name][:, 0] == 0)
        assert_flex_equals_sdpa(flex[name], dense[name])


def test_block_masks_check_their_arguments():
    with pytest.raises(ValueError, match=r"R=2.*got \[3\]"):
        block_diffusion_block_mask(torch.tensor([1]), torch.tensor([3]), 2, 4, 2)
    with pytest.raises(ValueError, match=r"\[B, S\].*\(3,\)"):
        encoder_block_masks(torch.ones(3), 2)


# --- DFlash draft mask (docs/DESIGN.md §10.4) -----------------------------------------------------------


def dflash(anchors, keep, ctx_len, block_size, **kwargs):
    return create_dflash_attention_mask(
        torch.tensor(anchors), torch.tensor(keep, dtype=torch.bool), ctx_len, block_size, **kwargs
    )


# ctx_len=8, bs=3. Columns: 8 context | 3 noise of block 0 | 3 noise of block 1. Block n, offset o is
# position a_n + o; it sees context c < a_n (never the anchor's own feature) and its own noise block.
# Overlapping: anchors [2, 3] span positions 2..4 and 3..5.
DFLASH_OVERLAP = b(
    [
        [1, 1, 0, 0, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0],  # block 0, a=2: c0, c1
        [1, 1, 0, 0, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1],  # block 1, a=3: c0..c2; never block 0's noise
        [1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1],
        [1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1],
    ]
)
# causal=True: same context, noise offsets k <= o.
DFLASH_OVERLAP_CAUSAL = b(
    [
        [1, 1, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0, 0, 1, 1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0],
        [1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 0],
        [1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1],
    ]
)
# Non-overlapping: anchors [1, 5] span positions 1..3 and 5..7.
DFLASH_APART = b(
    [
        [1, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0],  # a=1: c0
        [1, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0],
        [1, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 1, 1, 1],  # a=5: c0..c4
        [1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 1, 1, 1],
        [1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 1, 1, 1],
    ]
)
# Sliding W on anchors [1, 5]: context c < a and (a + o) - c < W, i.e. c >= a + o - W + 1. Deeper offsets
# lose context (their window ends before the anchor); the noise block is never windowed.
DFLASH_APART_SLIDING = {
    2: b(
        [
            [1, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0],  # pos 1: c >= 0
            [0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0],  # pos 2: c >= 1, none below a=1
            [0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0],
            [0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 1, 1, 1],  # pos 5: c >= 4
            [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1],  # pos 6: c >= 5, none below a=5
            [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1],
        ]
    ),
    3: b(
        [
            [1, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0],  # pos 1: c >= -1
            [1, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0],  # pos 2: c >= 0
            [0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0],  # pos 3: c >= 1
            [0, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0, 1, 1, 1],  # pos 5: c >= 3
            [0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 1, 1, 1],  # pos 6: c >= 4
            [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1],
        ]
    ),
}
# Non-kept block 1 (anchor 3 left in place): no context at all, still its own noise block.
DFLASH_NOT_KEPT = b(
    [
        [1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0],  # a=4: c0..c3
        [1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0],
        [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1],
        [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1],
        [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1],
    ]
)


def test_dflash_mask_hand_derived():
    mask = dflash([[2, 3], [1, 5]], [[True, True], [True, True]], 8, 3)
    assert mask.dtype == torch.bool and mask.shape == (2, 1, 6, 14)
    assert torch.equal(mask[:, 0], torch.stack([DFLASH_OVERLAP, DFLASH_APART]))
    assert torch.equal(dflash([[2, 3]], [[True, True]], 8, 3, causal=True)[0, 0], DFLASH_OVERLAP_CAUSAL)
    assert torch.equal(dflash([[4, 3]], [[True, False]], 8, 3)[0, 0], DFLASH_NOT_KEPT)


@pytest.mark.parametrize("window", [2, 3])
def test_dflash_sliding_mask_hand_derived(window):
    mask = dflash([[1, 5]], [[True, True]], 8, 3, sliding_window=window)
    assert torch.equal(mask[0, 0], DFLASH_APART_SLIDING[window])


def test_dflash_single_block_is_masked():
    """N=1 gets the same mask as any N (docs/DESIGN.md §14 (a): the reference passes none and leaks context)."""
    # ctx_len=5, bs=3. Columns: 5 context | 3 noise. Anchor 2 sees c0, c1; anchor 0 sees no context.
    mask = dflash([[2], [0]], [[True], [True]], 5, 3)
    expected = b(
        [
            [[1, 1, 0, 0, 0, 1, 1, 1]] * 3,
            [[0, 0, 0, 0, 0, 1, 1, 1]] * 3,
        ]
    )
    assert mask.shape == (2, 1, 3, 8)
    assert torch.equal(mask[:, 0], expected)


def test_dflash_masked_positions_do_not_leak():
    """Each row's attention output is unchanged when every key/value it must not see changes."""
    assert_rows_do_not_leak(
        dflash([[2, 3], [1, 5]], [[True, True], [True, False]], 8, 3, sliding_window=3, dtype=torch.float64)
    )


@st.composite
def dflash_cases(draw):
    B, N = draw(st.integers(1, 3)), draw(st.integers(1, 4))
    block_size, ctx_len = draw(st.integers(1, 4)), draw(st.integers(1, 10))
    def grid(values):
        return torch.tensor(draw(st.lists(st.lists(values, min_size=N, max_size=N), min_size=B, max_size=B)))

    anchors, keep = grid(st.integers(0, ctx_len - 1)), grid(st.booleans())
    window = draw(st.integers(1, ctx_len + block_size + 2))
    return anchors, keep, ctx_len, block_size, draw(st.booleans()), window


def _dflash_grid(anchors, keep, ctx_len, block_size):
    """Per query row ``[B, Q, 1]``: anchor, keep, offset, block; context column ``[1, 1, S]``;
    noise column's block and offset ``[1, 1, Q]``."""
    Q = anchors.shape[1] * block_size
    a = anchors.repeat_interleave(block_size, dim=1).unsqueeze(-1)
    kept = keep.repeat_interleave(block_size, dim=1).unsqueeze(-1)
    rows = torch.arange(Q).view(1, Q, 1)
    cols = torch.arange(Q).view(1, 1, Q)
    c = torch.arange(ctx_len).view(1, 1, -1)
    return a, kept, rows % block_size, rows // block_size, c, cols // block_size, cols % block_size


@PROPERTY
@given(dflash_cases())
def test_dflash_mask_properties(case):
    anchors, keep, ctx_len, block_size, causal, window = case
    a, kept, o, n, c, kn, ko = _dflash_grid(anchors, keep, ctx_len, block_size)
    make = functools.partial(create_dflash_attention_mask, anchors, keep, ctx_len, block_size, causal=causal)
    full, sliding = make()[:, 0], make(sliding_window=window)[:, 0]
    assert full.shape == (len(anchors), anchors.shape[1] * block_size, ctx_len + anchors.shape[1] * block_size)
    own_block = (kn == n) & (ko <= o) if causal else kn == n
    for mask in (full, sliding):
        context, noise = mask[..., :ctx_len], mask[..., ctx_len:]
        assert not (context & (c >= a)).any()  # never the anchor's feature or anything after it
        assert not (context & ~kept).any()  # non-kept blocks see no context
        assert not (noise & (kn != n)).any()  # never another block's noise
        assert torch.equal(noise, own_block.expand_as(noise))
        assert mask.any(-1).all()  # no fully masked row
    assert torch.equal(full[..., :ctx_len], (c < a) & kept)
    assert not (sliding & ~full).any()  # sliding keeps a subset
    assert torch.equal(sliding[..., :ctx_len], full[..., :ctx_len] & (a + o - c < window))
    assert torch.equal(make(sliding_window=ctx_len + block_size)[:, 0], full)
    for dtype in (torch.float32, torch.bfloat16):
        additive = make(sliding_window=window, dtype=dtype)
        assert additive.dtype == dtype and torch.isfinite(additive).all()
        assert torch.equal(additive[:, 0], torch.where(sliding, 0.0, torch.finfo(dtype).min).to(dtype))


def assert_flex_equals_sdpa(block_mask, dense: torch.Tensor, heads: int = 2, seed: int = 0) -> None:
    """Eager flex attention under ``block_mask`` equals SDPA under the additive fp32 ``dense`` ``[B, 1, Q, K]``."""
    flex = pytest.importorskip("torch.nn.attention.flex_attention", reason="FlexAttention is not in this torch build")
    B, _, Q, K = dense.shape
    assert block_mask.shape == (B, 1, Q, K)
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, heads, n, 16, generator=gen) for n in (Q, K, K))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        out = flex.flex_attention(q, k, v, block_mask=block_mask)  # eager on CPU: the dense reference path
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, attn_mask=dense), rtol=0, atol=1e-5)


def _flex_vs_sdpa(anchors, keep, ctx_len, block_size, *, causal=False, sliding_window=None, heads=2, seed=0):
    kwargs = dict(causal=causal, sliding_window=sliding_window)
    block_mask = create_dflash_block_mask(anchors, keep, ctx_len, block_size, **kwargs)
    dense = create_dflash_attention_mask(anchors, keep, ctx_len, block_size, dtype=torch.float32, **kwargs)
    assert_flex_equals_sdpa(block_mask, dense, heads, seed)


@pytest.mark.parametrize(
    "anchors, keep, kwargs",
    [
        ([[2, 3], [1, 5]], [[True, True], [True, True]], {}),
        ([[2, 3], [1, 5]], [[True, True], [True, False]], {"causal": True}),
        ([[2, 3], [1, 5]], [[True, True], [False, True]], {"sliding_window": 3}),
        ([[2], [0]], [[True], [True]], {}),
    ],
)
def test_dflash_block_mask_matches_dense(anchors, keep, kwargs):
    _flex_vs_sdpa(torch.tensor(anchors), torch.tensor(keep), 8, 3, **kwargs)


def test_dflash_block_mask_matches_dense_across_tiles():
    """Q_LEN=160, KV_LEN=360: several 128-tiles, partial last tiles, overlapping random anchors."""
    gen = torch.Generator().manual_seed(1)
    anchors = torch.randint(0, 200, (2, 40), generator=gen)
    keep = torch.rand(2, 40, generator=gen) < 0.8
    for kwargs in ({}, {"causal": True, "sliding_window": 50}):
        _flex_vs_sdpa(anchors, keep, 200, 4, **kwargs)


@settings(max_examples=10, deadline=None)
@given(dflash_cases())
def test_dflash_block_mask_matches_dense_property(case):
    anchors, keep, ctx_len, block_size, causal, window = case
    _flex_vs_sdpa(anchors, keep, ctx_len, block_size, causal=causal, sliding_window=window)


@pytest.mark.parametrize("builder", [create_dflash_attention_mask, create_dflash_block_mask])
@pytest.mark.parametrize(
    "args, kwargs, match",
    [
        ((torch.tensor([1, 2]), torch.tensor([True, True]), 8, 3), {}, r"anchors must be a 2-D .*got \(2,\)"),
        ((torch.zeros(1, 2, 1, dtype=torch.long), torch.ones(1, 2, 1, dtype=torch.bool), 8, 3), {}, r"\(1, 2, 1\)"),
        ((torch.tensor([[1, 2]]), torch.tensor([[True]]), 8, 3), {}, r"keep .*\(1, 2\), got \(1, 1\)"),
        ((torch.tensor([[1.0, 2.0]]), torch.tensor([[True, True]]), 8, 3), {}, r"integer tensor, got torch.float32"),
        ((torch.tensor([[1, 2]]), torch.tensor([[1, 1]]), 8, 3), {}, r"bool tensor, got torch.int64"),
        ((torch.tensor([[1, 8]]), torch.tensor([[True, True]]), 8, 3), {}, r"ctx_len=8\), got \[8\]"),
        ((torch.tensor([[-1, 2]]), torch.tensor([[True, False]]), 8, 3), {}, r"ctx_len=8\), got \[-1\]"),
        ((torch.tensor([[1, 2]]), torch.tensor([[True, True]]), 8, 0), {}, r"block_size must be >= 1, got 0"),
        ((torch.tensor([[0, 0]]), torch.tensor([[True, True]]), 0, 3), {}, r"ctx_len must be >= 1.*got 0"),
        ((torch.tensor([[1, 2]]), torch.tensor([[True, True]]), 8, 3), {"sliding_window": 0}, r"window .* got 0"),
        ((torch.zeros(1, 0, dtype=torch.long), torch.zeros(1, 0, dtype=torch.bool), 8, 3), {}, r"one block.*\(1, 0\)"),
    ],
)
def test_dflash_errors_name_the_value(builder, args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        builder(*args, **kwargs)


def test_dflash_additive_needs_float_dtype():
    with pytest.raises(ValueError, match=r"float dtype, got torch.int32"):
        dflash([[1]], [[True]], 8, 3, dtype=torch.int32)


def test_compiled_block_masks_stop_recompiling_once_shapes_vary(monkeypatch):
    """On CUDA every block mask is built by ``torch.compile(create_block_mask)``, and batches change shape (batch size,
    padded length, response width). After the first shapes the builds must go dynamic, not compile a graph per batch
    (each inductor compile costs ~10 s on a GPU), and no kind may fall back to the eager build for want of room in the
    graph cache the kinds share. The same guards run here with dynamo's eager backend: the three mask kinds (the
    encoder's full and sliding, the decoder's) compile at most three rounds over eight shapes, then none."""
    import lit_dllm.masks as masks
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    monkeypatch.setattr(masks, "_COMPILED_ON", ("cpu",))
    monkeypatch.setattr(masks, "_compiled", functools.cache(lambda build: torch.compile(build, backend="eager")))
    shapes = [(4, 256, 64), (4, 384, 96), (4, 512, 128), (2, 640, 64), (4, 768, 160), (3, 896, 96), (4, 1024, 192),
              (2, 1152, 64)]  # batch, encoder length, decoder width
    graphs = []
    try:
        for batch, length, width in shapes:
            masks.encoder_block_masks(torch.ones(batch, length, dtype=torch.long), 128)
            masks.block_diffusion_block_mask(torch.full((batch,), length - width), torch.full((batch,), width), width,
                                             length, 32, sliding_window=128)
            graphs.append(counters["stats"]["unique_graphs"])
        frames = dict(counters["frames"])
    finally:
        torch._dynamo.reset()
    assert graphs[0] == 3 and graphs[-4:] == [graphs[-1]] * 4 and graphs[-1] <= 9, graphs
    assert frames["ok"] == frames["total"], frames  # no compile refused (past the recompile limit: an eager build)
