"""Block-diffusion Gemma's attention masks (docs/DESIGN.md §9.2): hand-derived masks, leakage, properties, the
FlexAttention block masks equal to the dense ones, and the compiled build's graph cache."""

import functools

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

import lit_dllm.attention as attention
from lit_dllm.families.diffusion_gemma.masks import (
    block_diffusion_batch_mask,
    block_diffusion_block_mask,
    build_block_diffusion_training_mask,
    encoder_attention_masks,
    encoder_block_masks,
)

from ...test_attention import PROPERTY, assert_flex_equals_sdpa, assert_rows_do_not_leak, b


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


def test_compiled_block_masks_stop_recompiling_once_shapes_vary(monkeypatch):
    """On CUDA every block mask is built by ``torch.compile(create_block_mask)``, and batches change shape (batch size,
    padded length, response width). After the first shapes the builds must go dynamic, not compile a graph per batch
    (each inductor compile costs ~10 s on a GPU), and no kind may fall back to the eager build for want of room in the
    graph cache the kinds share. The same guards run here with dynamo's eager backend: the two mask kinds (the
    encoder's, whose full and sliding layers share a graph, and the decoder's) compile at most three rounds over
    eight shapes, then none."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    monkeypatch.setattr(attention, "COMPILED_ON", ("cpu",))
    monkeypatch.setattr(attention, "_compiled", functools.cache(lambda build: torch.compile(build, backend="eager")))
    shapes = [(4, 256, 64), (4, 384, 96), (4, 512, 128), (2, 640, 64), (4, 768, 160), (3, 896, 96), (4, 1024, 192),
              (2, 1152, 64)]  # batch, encoder length, decoder width
    graphs = []
    try:
        for batch, length, width in shapes:
            encoder_block_masks(torch.ones(batch, length, dtype=torch.long), 128)
            block_diffusion_block_mask(torch.full((batch,), length - width), torch.full((batch,), width), width,
                                       length, 32, sliding_window=128)
            graphs.append(counters["stats"]["unique_graphs"])
        frames = dict(counters["frames"])
    finally:
        torch._dynamo.reset()
    assert graphs[0] == 2 and graphs[-4:] == [graphs[-1]] * 4 and graphs[-1] <= 6, graphs
    assert frames["ok"] == frames["total"], frames  # no compile refused (past the recompile limit: an eager build)


def test_flex_masks_of_both_layer_types_and_every_length_share_compiled_graphs():
    """Each mask kind (encoder, decoder) compiles at most twice (its first shapes, then dynamic ones), whatever the
    layer type and the batch length: the masks close over tensors, not over an int or None that dynamo would guard on
    (issue 49: the flex training step hit the recompile limit and fell back to a path that waits for the GPU)."""
    from torch._dynamo.testing import CompileCounter
    from torch.nn.attention.flex_attention import flex_attention

    counter = CompileCounter()

    @torch.compile(backend=counter)
    def attend(query, key, mask):
        return flex_attention(query, key, key, block_mask=mask)

    torch._dynamo.reset()
    prefix, lengths, R = torch.tensor([5, 7]), torch.tensor([8, 6]), 8
    for S in (20, 24, 28, 32, 36):
        attention_mask = torch.ones(2, S, dtype=torch.long)
        attention_mask[1, -3:] = 0
        encoder = torch.randn(2, 1, S, 16)
        for mask in encoder_block_masks(attention_mask, 4).values():
            attend(encoder, encoder, mask)
        for window in (None, 4):
            mask = block_diffusion_block_mask(prefix, lengths, R, S, 4, sliding_window=window)
            attend(torch.randn(2, 1, R, 16), torch.randn(2, 1, S + R, 16), mask)
    assert counter.frame_count <= 4
