"""The DFlash draft's attention mask (docs/DESIGN.md §10.4): hand-derived masks, leakage, properties, and the
FlexAttention block mask equal to the dense one."""

import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lit_dllm.families.dflash.masks import create_dflash_attention_mask, create_dflash_block_mask

from ...test_attention import PROPERTY, assert_flex_equals_sdpa, assert_rows_do_not_leak, b


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
# Packed row, two documents and the row's tail: document ids [0, 0, 0, 1, 1, 1, 1, -1], anchors [2, 5]: block 1
# (document 1) sees c3, c4 only, never document 0 before it.
DOCUMENTS = [[0, 0, 0, 1, 1, 1, 1, -1]]
DFLASH_PACKED = b(
    [
        [1, 1, 0, 0, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0],  # a=2 in document 0: c0, c1
        [1, 1, 0, 0, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0],
        [0, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0, 1, 1, 1],  # a=5 in document 1: c3, c4
        [0, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0, 1, 1, 1],
        [0, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0, 1, 1, 1],
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


def test_dflash_packed_mask_hand_derived():
    mask = dflash([[2, 5]], [[True, True]], 8, 3, document_ids=torch.tensor(DOCUMENTS))
    assert torch.equal(mask[0, 0], DFLASH_PACKED)
    _flex_vs_sdpa(torch.tensor([[2, 5]]), torch.tensor([[True, True]]), 8, 3, document_ids=torch.tensor(DOCUMENTS))


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


def _flex_vs_sdpa(anchors, keep, ctx_len, block_size, *, causal=False, sliding_window=None, heads=2, seed=0,
                  document_ids=None):
    kwargs = dict(causal=causal, sliding_window=sliding_window, document_ids=document_ids)
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
    documents = torch.randint(0, 6, (2, 200), generator=gen).sort(1).values  # packed rows of 6 documents
    for kwargs in ({}, {"causal": True, "sliding_window": 50}, {"document_ids": documents}):
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
        ((torch.tensor([[1, 2]]), torch.tensor([[True, True]]), 8, 3),
         {"document_ids": torch.zeros(1, 7, dtype=torch.long)},
         r"document_ids must be an integer \[B, ctx_len\] = \[1, 8\] tensor .* got torch.int64 \(1, 7\)"),
    ],
)
def test_dflash_errors_name_the_value(builder, args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        builder(*args, **kwargs)


def test_dflash_additive_needs_float_dtype():
    with pytest.raises(ValueError, match=r"float dtype, got torch.int32"):
        dflash([[1]], [[True]], 8, 3, dtype=torch.int32)
