"""The DFlash draft's loss (docs/DESIGN.md §6.5): decay weights, normalisation and per-offset accuracy on
hand-derived values; the fused path against the dense one, values and gradients, and its memory."""

import math

import pytest
import torch
import torch.nn.functional as F

from lit_dllm.families.dflash.loss import DFlashDecayLoss

from ...test_losses import LOG4, TARGETS_1x4, ZEROS_1x4x4, OutputRecorder, approx, t


def test_decay_weights():
    e = math.exp
    torch.testing.assert_close(DFlashDecayLoss(loss_gamma=1).decay_weights(4, block_size=3),
                               t([1, e(-1), 1, e(-1)]))
    torch.testing.assert_close(DFlashDecayLoss(loss_gamma=2).decay_weights(4), t([1, e(-0.5), e(-1), e(-1.5)]))
    torch.testing.assert_close(DFlashDecayLoss(loss_gamma=None).decay_weights(3, block_size=4), torch.ones(3))


@pytest.mark.parametrize(
    "normalize, num_tokens, expected",
    [
        ("tokens", None, (2 + math.exp(-1)) * LOG4),
        ("tokens", 3, (2 + math.exp(-1)) * LOG4 / 3),
        ("tokens", torch.tensor(0), (2 + math.exp(-1)) * LOG4),
        ("mean", 3, (2 + math.exp(-1)) * LOG4 / (2 + math.exp(-1) + 1e-6)),
    ],
)
def test_dflash_normalisation(normalize, num_tokens, expected):
    loss = DFlashDecayLoss(loss_gamma=1.0, normalize=normalize)
    block_mask = t([[1, 1, 1, 0]])  # weights 1, e^-1, 1, (e^-1 masked)
    out = loss(ZEROS_1x4x4, TARGETS_1x4, block_mask, num_tokens=num_tokens, block_size=3)
    assert out.total_loss.item() == approx(expected)


def test_dflash_per_offset_accuracy_counts():
    predictions = t([[0, 1, 2, 0], [1, 1, 1, 1]], torch.long)
    logits = F.one_hot(predictions, 3).float()
    targets = t([[0, 1, 0, 0], [1, 0, 1, 2]], torch.long)
    block_mask = t([[1, 1, 1, 0], [1, 1, 1, 1]])
    out = DFlashDecayLoss()(logits, targets, block_mask, block_size=3)
    # hits ∧ mask: [[1,1,0,0],[1,0,1,0]]; offset 0 = positions 0, 2; offset 1 = positions 1, 3
    assert out.draft_correct_per_pos.tolist() == [3, 1]
    assert out.draft_count_per_pos.tolist() == [4, 3]
    assert DFlashDecayLoss()(logits, targets, block_mask, block_size=4).draft_count_per_pos is None
    assert DFlashDecayLoss()(logits, targets, block_mask).draft_correct_per_pos is None


def dense_reference(hidden, weight, bias, targets, block_mask, loss, block_size, softcap=None):
    logits = F.linear(hidden, weight, bias).float()
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    return loss(logits, targets, block_mask, num_tokens=7, block_size=block_size)


@pytest.mark.parametrize("chunk_size, softcap", [(1, None), (5, None), (7, 3.0), (1024, None)])
def test_fused_matches_dense_values_and_gradients(chunk_size, softcap):
    torch.manual_seed(0)
    batch, length, dim, vocab, block_size = 2, 6, 8, 11, 4
    hidden = torch.randn(batch, length, dim, requires_grad=True)
    weight = torch.randn(vocab, dim, requires_grad=True)
    bias = torch.randn(vocab, requires_grad=True)
    targets = torch.randint(0, vocab, (batch, length))
    block_mask = (torch.rand(batch, length) < 0.8).float()  # ~10 of 12 rows: chunk 5/7 don't divide
    loss = DFlashDecayLoss(chunk_size=chunk_size, use_fused_linear_ce=True)

    fused = loss.forward_fused(hidden, weight, targets, block_mask, 7, block_size, bias, softcap)
    fused_grads = torch.autograd.grad(fused.total_loss, (hidden, weight, bias))
    dense = dense_reference(hidden, weight, bias, targets, block_mask, loss, block_size, softcap)
    dense_grads = torch.autograd.grad(dense.total_loss, (hidden, weight, bias))

    torch.testing.assert_close(fused.total_loss, dense.total_loss, atol=1e-5, rtol=1e-5)
    for fused_grad, dense_grad in zip(fused_grads, dense_grads):
        torch.testing.assert_close(fused_grad, dense_grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fused.draft_correct_per_pos, dense.draft_correct_per_pos)
    torch.testing.assert_close(fused.draft_count_per_pos, dense.draft_count_per_pos)


def test_fused_never_holds_the_full_logits():
    batch, length, dim, vocab = 2, 16, 4, 64
    hidden = torch.randn(batch, length, dim, requires_grad=True)
    weight = torch.randn(vocab, dim, requires_grad=True)
    targets = torch.randint(0, vocab, (batch, length))
    block_mask = torch.ones(batch, length)
    loss = DFlashDecayLoss(chunk_size=4)
    with OutputRecorder() as fused:
        loss.forward_fused(hidden, weight, targets, block_mask).total_loss.backward()
    with OutputRecorder() as dense:
        loss(F.linear(hidden, weight), targets, block_mask).total_loss.backward()
    full = batch * length * vocab
    assert max(n for n, _ in dense.outputs) >= full  # the recorder sees the dense logits ...
    assert max(n for n, _ in fused.outputs) <= 4 * vocab  # ... and at most one chunk in the fused path


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fused_peak_memory_is_a_fraction_of_dense_on_gpu():
    torch.manual_seed(0)
    batch, length, dim, vocab = 4, 1024, 512, 65536
    hidden = torch.randn(batch, length, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(vocab, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    targets = torch.randint(0, vocab, (batch, length), device="cuda")
    block_mask = torch.ones(batch, length, device="cuda")
    loss = DFlashDecayLoss(chunk_size=256)

    def peak_extra(step):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step().total_loss.backward()
        torch.cuda.synchronize()
        hidden.grad = weight.grad = None
        return torch.cuda.max_memory_allocated() - base

    fused = peak_extra(lambda: loss.forward_fused(hidden, weight, targets, block_mask))
    dense = peak_extra(lambda: dense_reference(hidden, weight, None, targets, block_mask, loss, None))
    full_fp32_logits = batch * length * vocab * 4
    print(f"peak extra memory: fused {fused / 2**20:.0f} MiB, dense {dense / 2**20:.0f} MiB")
    assert dense >= full_fp32_logits
    assert fused < full_fp32_logits / 2 and fused < dense / 4, (fused, dense)


def test_shape_errors_name_both_shapes():
    with pytest.raises(ValueError, match=r"block_mask \(1, 3\).*logits \(1, 4, 4\)"):
        DFlashDecayLoss()(ZEROS_1x4x4, TARGETS_1x4, torch.ones(1, 3))
    with pytest.raises(ValueError, match=r"hidden \(1, 4, 2\).*block_mask \(1, 3\)"):
        DFlashDecayLoss().forward_fused(torch.zeros(1, 4, 2), torch.zeros(5, 2), TARGETS_1x4, torch.ones(1, 3))


@pytest.mark.parametrize(
    "kwargs, match",
    [({"normalize": "sum"}, "normalize"), ({"chunk_size": 0}, "chunk_size"), ({"loss_gamma": 0.0}, "loss_gamma")],
)
def test_dflash_invalid_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DFlashDecayLoss(**kwargs)


def test_dflash_block_size_below_two_raises():
    with pytest.raises(ValueError, match="block_size must be >= 2"):
        DFlashDecayLoss()(ZEROS_1x4x4, TARGETS_1x4, torch.ones(1, 4), block_size=1)
