"""What every family's masks are built with (:mod:`lit_dllm.attention`), and the checks the families' mask tests
share: no leak through a masked position, flex attention under a block mask equal to SDPA under the dense mask."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from lit_dllm.attention import additive_mask, build_block_mask, check_sliding_window, document_mask

PROPERTY = settings(max_examples=50, deadline=None)


def b(rows):
    return torch.tensor(rows, dtype=torch.bool)


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


def test_additive_mask_is_zero_where_kept_and_the_dtype_minimum_elsewhere():
    keep = b([[1, 0], [0, 1]])
    for dtype in (torch.float32, torch.bfloat16):
        mask = additive_mask(keep, dtype)
        assert mask.dtype == dtype and torch.isfinite(mask).all()
        assert torch.equal(mask, torch.where(keep, 0.0, torch.finfo(dtype).min).to(dtype))
    with pytest.raises(ValueError, match=r"float dtype, got torch.int32"):
        additive_mask(keep, torch.int32)


def test_a_document_mask_keeps_what_each_query_shares_a_document_with():
    """Row [0, 0, 1, -1]: two documents and a pad; bidirectional, and causal within each document."""
    ids = torch.tensor([[0, 0, 1, -1]])
    same = b([[1, 1, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]])
    for causal, keep in ((False, same), (True, same & b([[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]]))):
        mask = document_mask(ids, causal, "sdpa", torch.float32)
        assert torch.equal(mask, additive_mask(keep[None, None], torch.float32))


@PROPERTY
@given(st.lists(st.integers(1, 5), min_size=1, max_size=5), st.integers(1, 4), st.booleans(), st.data())
def test_the_query_rows_of_a_document_mask_are_those_rows_of_the_whole_mask(lengths, shards, causal, data):
    """What a context-parallel shard under ``all_gather`` builds: its rows, equal to the whole mask's."""
    ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
    ids = torch.cat([ids, torch.full((-len(ids) % shards,), -1)])[None]
    width = ids.shape[1] // shards
    rank = data.draw(st.integers(0, shards - 1))
    rows = slice(rank * width, (rank + 1) * width)
    whole = document_mask(ids, causal, "sdpa", torch.float32)
    assert torch.equal(document_mask(ids, causal, "sdpa", torch.float32, rows), whole[:, :, rows])
    with pytest.raises(ValueError, match="covers every query row"):
        document_mask(ids, causal, "flex_attention", torch.float32, rows)


def test_a_sliding_window_is_none_or_positive():
    check_sliding_window(None)
    check_sliding_window(1)
    with pytest.raises(ValueError, match=r"sliding_window must be >= 1 or None.*got 0"):
        check_sliding_window(0)


def test_a_block_mask_skips_only_the_tiles_that_keep_nothing():
    def lower_triangle(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx

    mask = build_block_mask(lower_triangle, 1, 256, 256, torch.device("cpu"))  # 2 x 2 tiles of 128
    assert mask.shape == (1, 1, 256, 256)
    assert mask.to_dense()[0, 0].tolist() == [[1, 0], [1, 1]]
