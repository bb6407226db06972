"""FlexAttention at DiffusionGemma 26B-A4B's attention shapes on a GPU (skipped without CUDA): the encoder's and the
decoder's BlockMasks (:mod:`lit_dllm.families.diffusion_gemma.masks`), compiled ``flex_attention`` forward + backward
in bf16, against SDPA with the same dense masks. Prints each case's errors and both kernels' forward + backward time.

    pytest tests/families/diffusion_gemma/test_flex_attention_cuda.py -x -q -s

Shapes: 16 query heads; sliding layers 8 KV heads of 256 (window 1024), global layers 2 KV heads of 512. Encoder:
2 rows of 2000 tokens (not a multiple of flex's 128 tiles), the second with 300 padded; decoder: a 512-token canvas
(2 blocks of 256) over those 2000 encoder positions, the second row's response one block (pad rows). Head dim 512
is past what flash-style kernels usually fit in shared memory: with torch 2.11's default forward tiles it needs 256 KiB
(an H200 has 227 KiB) and does not compile, so the module passes its own tiles per head dim
(:func:`~lit_dllm.families.diffusion_gemma.model.flex_kernel_options`), which every case here uses.

Tolerance: the bf16 output and q/k/v gradients are compared with an fp32 SDPA reference; flex's relative error
(norm of the difference over the reference's) must stay within twice bf16 SDPA's, plus 1e-3.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import flex_attention

import lit_dllm.attention
from lit_dllm.families.diffusion_gemma.masks import (
    block_diffusion_batch_mask,
    block_diffusion_block_mask,
    encoder_attention_masks,
    encoder_block_masks,
)
from lit_dllm.families.diffusion_gemma.model import flex_kernel_options

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

HEADS, SEQ, CANVAS, WIDTH, WINDOW = 16, 2000, 256, 512, 1024  # lengths not multiples of the 128 tiles
LAYERS = {"sliding_attention": (256, 8), "full_attention": (512, 2)}  # head dim, KV heads


def masks(encoder: bool, layer: str):
    """(BlockMask, dense bool keep-mask ``[B, 1, Q, K]``) of the encoder or decoder pass for ``layer``'s type."""
    if encoder:
        attention = torch.arange(SEQ, device="cuda")[None] < torch.tensor([[SEQ], [SEQ - 300]], device="cuda")
        block_mask = encoder_block_masks(attention, WINDOW)[layer]
        dense = encoder_attention_masks(attention, WINDOW)[layer]
    else:
        prefix, lengths = torch.tensor([SEQ - WIDTH, SEQ // 2], device="cuda"), torch.tensor([WIDTH, CANVAS], device="cuda")
        args = (prefix, lengths, WIDTH, SEQ, CANVAS)
        window = WINDOW if layer == "sliding_attention" else None
        block_mask = block_diffusion_block_mask(*args, sliding_window=window)
        dense = block_diffusion_batch_mask(*args, sliding_window=window)
    return block_mask, dense == 0


def forward_backward(attend, inputs: list[torch.Tensor], grad: torch.Tensor, dtype: torch.dtype) -> list[torch.Tensor]:
    """``attend(q, k, v)`` on ``inputs`` cast to ``dtype``, backward of ``grad``: fp32 output and q/k/v gradients."""
    q, k, v = (t.detach().to(dtype).requires_grad_() for t in inputs)
    out = attend(q, k, v)
    out.backward(grad.to(dtype))
    return [t.detach().float() for t in (out, q.grad, k.grad, v.grad)]


def milliseconds(run, repeats: int = 5) -> float:
    run()  # compiled, autotuned
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        run()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


@pytest.mark.parametrize("layer", list(LAYERS))
@pytest.mark.parametrize("encoder", [True, False], ids=["encoder", "decoder"])
def test_compiled_flex_attention_matches_sdpa_at_gemma_26b_shapes(encoder, layer):
    head_dim, kv_heads = LAYERS[layer]
    torch._dynamo.reset()  # each case compiles its own kernels (no recompile limit, no dynamic shapes)
    # built eagerly: this test is the attention kernel's (test_compiled_block_masks_have_eager_blocks checks the
    # compiled build), and after the reset a compiled build would compile again, about 30 s a case
    with mock.patch.object(lit_dllm.attention, "_compiled", lambda build: build):
        block_mask, keep = masks(encoder, layer)
    B, _, Q, K = keep.shape
    gen = torch.Generator(device="cuda").manual_seed(0)
    inputs = [torch.randn(B, heads, n, head_dim, device="cuda", generator=gen)
              for heads, n in ((HEADS, Q), (kv_heads, K), (kv_heads, K))]
    grad = torch.randn(B, HEADS, Q, head_dim, device="cuda", generator=gen)
    compiled = torch.compile(flex_attention, dynamic=False)
    options = flex_kernel_options(head_dim, torch.device("cuda"))

    def flex(q, k, v):
        return compiled(q, k, v, block_mask=block_mask, enable_gqa=True, kernel_options=options)

    def sdpa(q, k, v):
        groups = HEADS // kv_heads
        k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=keep)

    reference = forward_backward(sdpa, inputs, grad, torch.float32)
    got = forward_backward(flex, inputs, grad, torch.bfloat16)
    baseline = forward_backward(sdpa, inputs, grad, torch.bfloat16)
    q, k, v = (t.to(torch.bfloat16).requires_grad_() for t in inputs)
    times = [milliseconds(lambda: attend(q, k, v).backward(grad.to(torch.bfloat16))) for attend in (flex, sdpa)]
    print(f"\n{'encoder' if encoder else 'decoder'} {layer} (head dim {head_dim}, {kv_heads} KV heads), "
          f"fwd+bwd flex {times[0]:.2f} ms, sdpa {times[1]:.2f} ms; "
          f"{100 * (1 - block_mask.to_dense().float().mean()):.0f}% of the 128-tiles skipped")
    for name, want, flex_value, sdpa_value in zip(("out", "dq", "dk", "dv"), reference, got, baseline):
        flex_error = float((flex_value - want).norm() / want.norm())
        sdpa_error = float((sdpa_value - want).norm() / want.norm())
        print(f"  {name}: relative error flex {flex_error:.2e}, bf16 sdpa {sdpa_error:.2e}")
        assert flex_error <= 2 * sdpa_error + 1e-3, name


def test_compiled_block_masks_have_eager_blocks():
    """On CUDA lit_dllm compiles ``create_block_mask`` (:func:`lit_dllm.attention.build_block_mask`, 10x faster at
    26B-A4B shapes: bench/bench_block_masks.py); every mask of both passes has the blocks that the eager build gives."""
    for encoder in (True, False):
        for layer in LAYERS:
            compiled, _ = masks(encoder, layer)
            with mock.patch.object(lit_dllm.attention, "_compiled", lambda build: build):  # eager create_block_mask
                eager, _ = masks(encoder, layer)
            for field in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"):
                assert torch.equal(getattr(compiled, field), getattr(eager, field)), (encoder, layer, field)
