import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import lit_dllm.losses
import lit_dllm.reference
from lit_dllm.losses import (
    SOFTCAP_SHIFT_MAX, DLLMLossOutput, fused_linear_cross_entropy, weighted_linear_cross_entropy,
)
from lit_dllm.reference.losses import (
    BlockDiffusionCrossEntropyLoss,
    HybridDiffusionLLMLoss,
    MDLMCrossEntropyLoss,
    encoder_ar_loss,
)

LOG2, LOG4, LOG4_3 = math.log(2), math.log(4), math.log(4 / 3)
# Two-class logit rows with known NLLs: [log 3, 0] -> target 0: log(4/3), target 1: log 4; [0, 0] -> log 2.
FAVOURS_0 = [math.log(3), 0.0]
EVEN = [0.0, 0.0]


def t(values, dtype=torch.float32):
    return torch.tensor(values, dtype=dtype)


def approx(value):
    return pytest.approx(value, rel=1e-6, abs=1e-6)


class FakeDTensor:
    """Duck-typed stand-in for a sharded DTensor: only ``full_tensor()`` is used."""

    def __init__(self, full):
        self.full = full

    def full_tensor(self):
        return self.full


# --- MDLM ------------------------------------------------------------------------------------------

# B=1, L=4, V=4 zeros: every NLL is log 4. Corrupted ∧ supervised = positions 0, 1.
ZEROS_1x4x4 = torch.zeros(1, 4, 4)
TARGETS_1x4 = t([[0, 1, 2, 3]], torch.long)
NOISE = t([[1, 1, 0, 1]], torch.bool)
LOSS_MASK = t([[1, 1, 1, 0]])
P_MASK = t([[0.5, 0.25, 0.5, 0.5]])


@pytest.mark.parametrize(
    "num_tokens, expected",
    [(None, 6 * LOG4), (3, 2 * LOG4), (torch.tensor(3), 2 * LOG4), (0, 6 * LOG4), (torch.tensor(0), 6 * LOG4)],
)
def test_mdlm_is_inverse_p_weighted_sum_over_corrupted_supervised_positions(num_tokens, expected):
    out = MDLMCrossEntropyLoss()(ZEROS_1x4x4, TARGETS_1x4, NOISE, P_MASK, LOSS_MASK, num_diffusion_tokens=num_tokens)
    assert isinstance(out, DLLMLossOutput)
    assert out.total_loss.item() == approx(expected)  # log4/0.5 + log4/0.25
    assert out.dllm_loss.item() == approx(expected) and out.dllm_loss.grad_fn is None
    assert out.draft_correct_per_pos is None and out.draft_count_per_pos is None


def test_mdlm_two_class_values_and_p_floor():
    logits = t([[FAVOURS_0, FAVOURS_0, EVEN]])
    targets = t([[0, 1, 1]], torch.long)
    ones = torch.ones(1, 3)
    out = MDLMCrossEntropyLoss()(logits, targets, ones.bool(), t([[1.0, 0.5, 1e-12]]), ones)
    assert out.total_loss.item() == pytest.approx(LOG4_3 + LOG4 / 0.5 + LOG2 / 1e-8, rel=1e-6)


def test_mdlm_gathers_dtensor_logits_and_propagates_gradients():
    logits = ZEROS_1x4x4.clone().requires_grad_()
    out = MDLMCrossEntropyLoss()(FakeDTensor(logits), TARGETS_1x4, NOISE, P_MASK, LOSS_MASK)
    out.total_loss.backward()
    assert out.total_loss.item() == approx(6 * LOG4)
    # d/dlogits of CE at zeros: (softmax - onehot) * weight; unselected positions get 0
    expected = torch.full((1, 4, 4), 0.25)
    expected[0, 0] *= 2
    expected[0, 0, 0] -= 2
    expected[0, 1] *= 4
    expected[0, 1, 1] -= 4
    expected[0, 2:] = 0
    torch.testing.assert_close(logits.grad, expected)


# --- Hybrid ----------------------------------------------------------------------------------------

# Diffusion logits: zeros (NLL log 2). Causal logits predict x[i] from row i-1:
# CE(causal[0]=[log3,0], x[1]=0) = log 4/3, CE(causal[1]=[0,0], x[2]=1) = log 2.
HYB_TARGETS = t([[1, 0, 1]], torch.long)
HYB_DIFFUSION = torch.zeros(1, 3, 2)
HYB_CAUSAL = t([[FAVOURS_0, EVEN, FAVOURS_0]])
HYB_NOISE = t([[1, 1, 0]], torch.bool)
HYB_P = torch.full((1, 3), 0.5)
HYB_LOSS = torch.ones(1, 3)
HYB_AR_MASK = t([[1.0, 1.0, 1.0]])
HYB_D = 2 * LOG2 / 0.5
HYB_A = LOG4_3 + LOG2


@pytest.mark.parametrize("legacy_layout", [False, True])
def test_hybrid_total_is_alpha_diffusion_plus_ar(legacy_layout):
    loss = HybridDiffusionLLMLoss(alpha=0.5)
    if legacy_layout:
        logits, causal = torch.cat([HYB_DIFFUSION, HYB_CAUSAL], dim=1), None
    else:
        logits, causal = HYB_DIFFUSION, HYB_CAUSAL
    out = loss(logits, HYB_TARGETS, HYB_NOISE, HYB_P, HYB_LOSS, HYB_AR_MASK, num_diffusion_tokens=2,
               num_ar_tokens=torch.tensor(2), causal_logits=causal)
    assert out.dllm_loss.item() == approx(0.5 * HYB_D / 2)
    assert out.total_loss.item() == approx(0.5 * HYB_D / 2 + HYB_A / 2)


def test_hybrid_ar_term_weights_targets_by_the_ar_mask():
    weighted = HybridDiffusionLLMLoss()(HYB_DIFFUSION, HYB_TARGETS, HYB_NOISE, HYB_P, HYB_LOSS, t([[1.0, 0.0, 0.5]]),
                                        causal_logits=HYB_CAUSAL)
    assert weighted.total_loss.item() == approx(HYB_D + 0.5 * LOG2)
    diffusion_only = HybridDiffusionLLMLoss()(HYB_DIFFUSION, HYB_TARGETS, HYB_NOISE, HYB_P, HYB_LOSS)
    assert diffusion_only.total_loss.item() == approx(HYB_D)  # neither AR input: the diffusion term alone


@pytest.mark.parametrize(("logits", "ar_mask", "causal", "message"), [
    (HYB_DIFFUSION, None, HYB_CAUSAL, r"causal_logits are given but loss_mask_ar is None"),
    (torch.cat([HYB_DIFFUSION, HYB_CAUSAL], 1), None, None, r"causal_logits are given but loss_mask_ar is None"),
    (HYB_DIFFUSION, HYB_AR_MASK, None, r"loss_mask_ar is given but causal_logits is None"),
])
def test_hybrid_half_given_ar_term_is_an_error(logits, ar_mask, causal, message):
    """The AR term needs both inputs: with one of them it would vanish from the loss without a word."""
    with pytest.raises(ValueError, match=message + ".*AR term"):
        HybridDiffusionLLMLoss()(logits, HYB_TARGETS, HYB_NOISE, HYB_P, HYB_LOSS, ar_mask, causal_logits=causal)


@pytest.mark.parametrize("loss_cls", [MDLMCrossEntropyLoss, HybridDiffusionLLMLoss])
@pytest.mark.parametrize(("noise", "p", "message"), [
    (HYB_NOISE, t([[1, 1, 1]], torch.long), r"p_mask must be a float tensor of masking probabilities, got torch.int64"),
    (HYB_NOISE, t([[0.5, 0.0, 1.0]]), r"p_mask must be in \(0, 1\] at every corrupted supervised position, got 0.0"),
    (HYB_NOISE, t([[float("nan"), 0.5, 1.0]]), r"p_mask must be in \(0, 1\] .* got nan"),
    (HYB_NOISE, t([[0.5, 2.0, 1.0]]), r"p_mask must be in \(0, 1\] .* got 2.0"),
    (HYB_NOISE.float(), HYB_P, r"noise_mask must be a bool tensor \(True where corrupted\), got torch.float32"),

    (None, HYB_P, r"noise_mask must be a bool tensor \(True where corrupted\), got None"),
    (HYB_NOISE, None, r"p_mask must be a float tensor of masking probabilities, got None"),
])
def test_bad_noise_inputs_are_errors(loss_cls, noise, p, message):
    """An integer or zero probability would weigh a token 1e8 times, a NaN one poison the loss or vanish."""
    with pytest.raises(ValueError, match=message):
        loss_cls()(HYB_DIFFUSION, HYB_TARGETS, noise, p, HYB_LOSS)


def test_bad_probabilities_where_nothing_is_scored_are_left_alone():
    p = t([[0.5, float("nan"), 0.0]])  # position 1 is unsupervised, position 2 not corrupted
    out = MDLMCrossEntropyLoss()(HYB_DIFFUSION, HYB_TARGETS, HYB_NOISE, p, t([[1.0, 0.0, 1.0]]))
    assert out.total_loss.item() == approx(LOG2 / 0.5)


# --- Block diffusion and encoder AR ----------------------------------------------------------------


@pytest.mark.parametrize("num_tokens, expected", [(None, (LOG4_3 + LOG2) / 2), (4, (LOG4_3 + LOG2) / 4)])
def test_block_diffusion_is_flat_mean_over_all_supervised_positions(num_tokens, expected):
    logits = t([[FAVOURS_0, EVEN, FAVOURS_0]])
    targets = t([[0, 1, 1]], torch.long)
    no_noise = torch.zeros(1, 3, dtype=torch.bool)  # not read: the loss is flat over loss_mask
    out = BlockDiffusionCrossEntropyLoss()(logits, targets, no_noise, torch.zeros(1, 3), t([[1, 1, 0]]),
                                           num_diffusion_tokens=num_tokens)
    assert out.total_loss.item() == approx(expected)
    empty = BlockDiffusionCrossEntropyLoss()(logits, targets, no_noise, torch.zeros(1, 3), torch.zeros(1, 3))
    assert empty.total_loss.item() == 0.0
    unread = BlockDiffusionCrossEntropyLoss()(logits, targets, None, None, t([[1, 1, 0]]),
                                              num_diffusion_tokens=num_tokens)
    assert unread.total_loss.item() == approx(expected)


@pytest.mark.parametrize(
    "valid, num_tokens, expected",
    [(None, None, (LOG4_3 + LOG2) / 2), ([[1, 1, 0]], None, LOG4_3), (None, 4, (LOG4_3 + LOG2) / 4),
     ([[0, 0, 0]], None, 0.0)],
)
def test_encoder_ar_loss_scores_valid_next_token_pairs(valid, num_tokens, expected):
    logits = t([[FAVOURS_0, EVEN, EVEN]])
    ids = t([[1, 0, 1]], torch.long)
    valid = None if valid is None else t(valid, torch.bool)
    assert encoder_ar_loss(logits, ids, valid, num_tokens).item() == approx(expected)


# --- fp32 upcast -----------------------------------------------------------------------------------


@pytest.mark.parametrize("loss_cls", [MDLMCrossEntropyLoss, HybridDiffusionLLMLoss, BlockDiffusionCrossEntropyLoss])
def test_fp32_upcast_really_computes_in_fp32(loss_cls):
    # log 2 is not representable in bf16 (nearest: 0.69140625), so a bf16 CE is off by ~2e-3.
    logits = torch.zeros(1, 1, 2, dtype=torch.bfloat16, requires_grad=True)
    args = (t([[1]], torch.long), t([[True]], torch.bool), t([[1.0]]), t([[1.0]]))
    upcast = loss_cls(fp32_upcast=True)(logits, *args).total_loss
    native = loss_cls(fp32_upcast=False)(logits, *args).total_loss
    exact = F.cross_entropy(logits.detach().float()[0], args[0][0])
    assert upcast.dtype == native.dtype == torch.float32
    assert abs(upcast.item() - exact.item()) < 1e-6
    assert abs(native.item() - exact.item()) > 1e-3
    upcast.backward()
    assert logits.grad.dtype == torch.bfloat16


class OutputRecorder(TorchDispatchMode):
    """Records (numel, dtype) of every tensor produced by any op, forward and backward."""

    def __init__(self):
        super().__init__()
        self.outputs = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        self.outputs += [(x.numel(), x.dtype) for x in tree_leaves(result) if isinstance(x, torch.Tensor)]
        return result


def test_upcast_never_builds_an_fp32_copy_of_the_full_logits():
    batch, length, vocab = 2, 8, 32
    logits = torch.randn(batch, length, vocab, dtype=torch.bfloat16, requires_grad=True)
    noise = torch.arange(length).expand(batch, -1) % 2 == 0
    ones = torch.ones(batch, length)
    with OutputRecorder() as recorder:
        MDLMCrossEntropyLoss()(logits, torch.zeros(batch, length, dtype=torch.long), noise, ones, ones) \
            .total_loss.backward()
    fp32_sizes = [n for n, dtype in recorder.outputs if dtype == torch.float32]
    assert max(fp32_sizes) < batch * length * vocab


def test_fused_linear_cross_entropy_matches_cross_entropy():
    torch.manual_seed(1)
    hidden, weight, targets = torch.randn(9, 4), torch.randn(6, 4), torch.randint(0, 6, (9,))
    nll, correct = fused_linear_cross_entropy(hidden.bfloat16(), weight.bfloat16(), targets, chunk_size=4)
    logits = (hidden.bfloat16() @ weight.bfloat16().T).float()
    assert nll.dtype == torch.float32 and correct.dtype == torch.bool
    torch.testing.assert_close(nll, F.cross_entropy(logits, targets, reduction="none"))
    assert correct.tolist() == (logits.argmax(-1) == targets).tolist()


def relative_error(got, reference):
    return float((got.double() - reference).norm() / reference.norm())


def linear_ce_and_grads(hidden, weight, targets, softcap, chunk_size=96):
    hidden, weight = hidden.detach().requires_grad_(True), weight.detach().requires_grad_(True)
    nll, correct = fused_linear_cross_entropy(hidden, weight, targets, chunk_size=chunk_size, softcap=softcap)
    (nll * torch.linspace(0.5, 1.5, len(nll), device=nll.device, dtype=nll.dtype)).sum().backward()
    return nll.detach(), correct, hidden.grad, weight.grad


def dense_weighted(hidden, weight, bias, targets, row_weights, softcap):
    logits = F.linear(hidden, weight, bias)
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    nll = F.cross_entropy(logits.float(), targets, reduction="none")
    return (nll * row_weights).sum(), nll, logits.argmax(-1) == targets


@pytest.mark.parametrize("chunk_size, softcap, with_bias", [(1, None, True), (4, None, False), (7, 3.0, True),
                                                             (64, 3.0, False)])
def test_weighted_linear_cross_entropy_equals_dense_values_and_gradients(chunk_size, softcap, with_bias):
    torch.manual_seed(0)
    rows, dim, vocab = 10, 8, 13  # chunks of 4 and 7 leave a short tail
    hidden = torch.randn(rows, dim, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(vocab, dim, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(vocab, dtype=torch.float64, requires_grad=True) if with_bias else None
    targets = torch.randint(0, vocab, (rows,))
    row_weights = torch.rand(rows) * 3
    leaves = [x for x in (hidden, weight, bias) if x is not None]

    total, nll, correct = weighted_linear_cross_entropy(hidden, weight, targets, row_weights, bias, chunk_size, softcap)
    want_total, want_nll, want_correct = dense_weighted(hidden, weight, bias, targets, row_weights, softcap)
    # an upstream gradient other than 1 (the loss is scaled after the head, e.g. by 1 / token count)
    got_grads = torch.autograd.grad(total * 2.5, leaves)
    want_grads = torch.autograd.grad(want_total * 2.5, leaves)

    torch.testing.assert_close(total, want_total.float(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(nll, want_nll.float(), rtol=1e-6, atol=1e-6)
    assert torch.equal(correct, want_correct) and not nll.requires_grad
    for got, want in zip(got_grads, want_grads):
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)  # both upcast the logits to fp32


@pytest.mark.parametrize("softcap", [3.0, SOFTCAP_SHIFT_MAX, 60.0])  # 60: above the one-pass shift's bound
@pytest.mark.parametrize("scale", [1e-6, 1.0, 1e4, -1e4])  # near zero, typical, saturated, all at -softcap
def test_softcapped_weighted_linear_cross_entropy_equals_dense_at_extreme_logits(softcap, scale):
    """The soft-cap's cheaper tanh and one-pass log-sum-exp against float64 torch.tanh and logsumexp: logits near 0
    (where ``2 sigmoid - 1`` cancels), saturated ones, and rows whose logits all sit at ``-softcap`` (every
    ``exp(z - c)`` term at its smallest, ``exp(-2c)``)."""
    torch.manual_seed(0)
    rows, dim, vocab = 6, 4, 50
    hidden = torch.randn(rows, dim, dtype=torch.float64)
    if scale < 0:  # every logit -1e4 · |h·w| < 0: z = -softcap up to rounding
        hidden = hidden.abs()
    weight = (torch.randn(vocab, dim, dtype=torch.float64).abs() if scale < 0 else
              torch.randn(vocab, dim, dtype=torch.float64)) * scale
    hidden.requires_grad_(True), weight.requires_grad_(True)
    targets = torch.randint(0, vocab, (rows,))
    row_weights = torch.rand(rows) + 0.5

    total, nll, correct = weighted_linear_cross_entropy(hidden, weight, targets, row_weights, chunk_size=4,
                                                        softcap=softcap)
    want_total, want_nll, _ = dense_weighted(hidden, weight, None, targets, row_weights, softcap)
    got_grads = torch.autograd.grad(total, (hidden, weight))
    want_grads = torch.autograd.grad(want_total, (hidden, weight))

    assert torch.isfinite(nll).all()
    torch.testing.assert_close(nll, want_nll.float(), rtol=1e-6, atol=2e-6)
    for got, want in zip(got_grads, want_grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * max(1.0, abs(scale)))


def test_weighted_linear_cross_entropy_defaults_to_unit_weights_and_skips_frozen_inputs():
    torch.manual_seed(1)
    hidden = torch.randn(9, 4, requires_grad=True)
    weight = torch.randn(6, 4)  # frozen head: no gradient formed for it
    targets = torch.randint(0, 6, (9,))
    total, nll, correct = weighted_linear_cross_entropy(hidden, weight, targets, chunk_size=4)
    torch.testing.assert_close(total, F.cross_entropy(hidden @ weight.T, targets, reduction="sum"))
    assert torch.equal(correct, (hidden @ weight.T).argmax(-1) == targets)  # fp32 logits: scored before overwritten
    (grad,) = torch.autograd.grad(total, hidden)
    (want,) = torch.autograd.grad(F.cross_entropy(hidden @ weight.T, targets, reduction="sum"), hidden)
    torch.testing.assert_close(grad, want)


def test_weighted_linear_cross_entropy_under_autocast_matches_the_fused_path():
    """bf16 autocast with fp32 weights (bf16-mixed): the same values and gradients as fused_linear_cross_entropy's
    autograd, in the leaves' dtypes."""
    torch.manual_seed(2)
    hidden = torch.randn(50, 16, requires_grad=True)
    weight = torch.randn(40, 16, requires_grad=True)
    targets, row_weights = torch.randint(0, 40, (50,)), torch.rand(50)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        total, nll, correct = weighted_linear_cross_entropy(hidden, weight, targets, row_weights, chunk_size=16)
        want_nll, want_correct = fused_linear_cross_entropy(hidden, weight, targets, chunk_size=16)
    grads = torch.autograd.grad(total, (hidden, weight))
    want_grads = torch.autograd.grad((want_nll * row_weights).sum(), (hidden, weight))
    torch.testing.assert_close(nll, want_nll.detach())
    assert torch.equal(correct, want_correct)
    for got, want in zip(grads, want_grads):
        assert got.dtype == torch.float32
        assert relative_error(got, want.double()) < 1e-2  # bf16 gradients of the logits, rounded at other points


def test_weighted_linear_cross_entropy_of_no_rows_is_zero_with_zero_gradients():
    """No chunk runs: the head's gradient buffer (otherwise written by the first chunk) is zeros, not garbage."""
    hidden = torch.randn(0, 4, requires_grad=True)
    weight = torch.randn(6, 4, requires_grad=True)
    total, nll, correct = weighted_linear_cross_entropy(hidden, weight, torch.zeros(0, dtype=torch.long))
    total.backward()
    assert total.item() == 0.0 and nll.shape == correct.shape == (0,)
    assert torch.equal(weight.grad, torch.zeros(6, 4)) and hidden.grad.shape == (0, 4)


def test_weighted_linear_cross_entropy_backward_runs_once():
    hidden = torch.randn(3, 2, requires_grad=True)
    total, _, _ = weighted_linear_cross_entropy(hidden, torch.randn(5, 2), torch.zeros(3, dtype=torch.long))
    total.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="runs once"):
        total.backward()


@pytest.mark.parametrize("softcap", [None, 30.0])
def test_compile_switch_leaves_the_cpu_path_eager(monkeypatch, softcap):
    hidden, weight, targets = torch.randn(200, 16), torch.randn(50, 16), torch.randint(0, 50, (200,))
    monkeypatch.setattr(lit_dllm.losses, "COMPILE_LINEAR_CE_ON_CUDA", False)
    eager = linear_ce_and_grads(hidden, weight, targets, softcap)
    monkeypatch.setattr(lit_dllm.losses, "COMPILE_LINEAR_CE_ON_CUDA", True)
    monkeypatch.setattr(lit_dllm.losses, "_compiled_linear_chunk", None)  # would raise if the CPU path used it
    assert all(torch.equal(a, b) for a, b in zip(eager, linear_ce_and_grads(hidden, weight, targets, softcap)))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("softcap", [None, 30.0])
def test_compiled_linear_ce_chunk_matches_float64_on_gpu(monkeypatch, softcap):
    """bf16 operands: values and gradients within the bf16 band (METHOD.md) of a float64 reference, like eager."""
    torch.manual_seed(0)
    rows, dim, vocab = 1000, 256, 5000  # 1000 = 10 chunks of 96 and a tail of 40
    hidden = torch.randn(rows, dim, device="cuda").bfloat16()
    weight = (torch.randn(vocab, dim, device="cuda") / dim**0.5).bfloat16()
    targets = torch.randint(0, vocab, (rows,), device="cuda")
    reference = linear_ce_and_grads(hidden.double(), weight.double(), targets, softcap)
    compiled = linear_ce_and_grads(hidden, weight, targets, softcap)
    monkeypatch.setattr(lit_dllm.losses, "COMPILE_LINEAR_CE_ON_CUDA", False)
    eager = linear_ce_and_grads(hidden, weight, targets, softcap)
    for index in (0, 2, 3):  # nll, d hidden, d weight
        assert relative_error(compiled[index], reference[index]) < 1e-2
        assert relative_error(compiled[index], reference[index]) < 2 * relative_error(eager[index], reference[index]) + 1e-3
    assert (compiled[1] == reference[1]).float().mean() > 0.99  # argmax hits, up to bf16 near-ties


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("softcap", [None, 30.0])
def test_weighted_linear_cross_entropy_on_gpu_matches_float64(monkeypatch, softcap):
    """bf16 operands, compiled per-chunk softmax: within the bf16 band of a float64 reference, like eager chunks."""
    torch.manual_seed(0)
    rows, dim, vocab = 1000, 256, 5000
    hidden = torch.randn(rows, dim, device="cuda").bfloat16()
    weight = (torch.randn(vocab, dim, device="cuda") / dim**0.5).bfloat16()
    targets = torch.randint(0, vocab, (rows,), device="cuda")
    row_weights = torch.rand(rows, device="cuda") + 0.5

    def run(h, w):
        h, w = h.detach().requires_grad_(True), w.detach().requires_grad_(True)
        total, nll, _ = weighted_linear_cross_entropy(h, w, targets, row_weights, chunk_size=96, softcap=softcap)
        (total * 0.37).backward()  # an upstream gradient other than 1: the compiled in-place scale on CUDA
        return total.detach(), nll, h.grad, w.grad

    reference = run(hidden.double(), weight.double())
    compiled = run(hidden, weight)
    monkeypatch.setattr(lit_dllm.losses, "COMPILE_LINEAR_CE_ON_CUDA", False)
    eager = run(hidden, weight)
    for index in range(4):  # total, nll, d hidden, d weight
        error = relative_error(compiled[index], reference[index])
        assert error < 1e-2 and error < 2 * relative_error(eager[index], reference[index]) + 1e-3


# --- errors ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("loss_cls", [MDLMCrossEntropyLoss, HybridDiffusionLLMLoss, BlockDiffusionCrossEntropyLoss])
def test_shape_mismatches_name_both_shapes(loss_cls):
    ones = torch.ones(1, 4)
    with pytest.raises(ValueError, match=r"target_ids \(1, 5\).*logits \(1, 4, 4\)"):
        loss_cls()(ZEROS_1x4x4, torch.zeros(1, 5, dtype=torch.long), ones.bool(), ones, ones)
    with pytest.raises(ValueError, match=r"loss_mask \(2, 4\).*logits \(1, 4, 4\)"):
        loss_cls()(ZEROS_1x4x4, TARGETS_1x4, ones.bool(), ones, torch.ones(2, 4))
    with pytest.raises(ValueError, match=r"logits must be \[B, L, V\], got \(4, 4\)"):
        loss_cls()(ZEROS_1x4x4[0], TARGETS_1x4, ones.bool(), ones, ones)


@pytest.mark.parametrize("loss_cls", [MDLMCrossEntropyLoss, BlockDiffusionCrossEntropyLoss])
@pytest.mark.parametrize(("ar_arguments", "named"), [
    ({"causal_logits": ZEROS_1x4x4}, "causal_logits"),
    ({"loss_mask_ar": LOSS_MASK, "num_ar_tokens": 3}, "loss_mask_ar, num_ar_tokens"),
])
def test_a_loss_without_an_ar_term_refuses_the_ar_arguments(loss_cls, ar_arguments, named):
    """The reference accepts and ignores them: an AR term the caller meant to train would vanish without a word."""
    with pytest.raises(ValueError, match=f"{loss_cls.__name__} has no AR term, so {named} would be ignored.*Hybrid"):
        loss_cls()(ZEROS_1x4x4, TARGETS_1x4, NOISE, P_MASK, LOSS_MASK, **ar_arguments)


def test_the_reference_losses_are_exported_by_lit_dllm_and_only_there():
    for name in lit_dllm.reference.__all__:
        assert getattr(lit_dllm.reference, name) is getattr(lit_dllm, name)
        assert not hasattr(lit_dllm.losses, name)  # the primitives know nothing above them


def test_more_shape_errors():
    ones = torch.ones(1, 4)
    with pytest.raises(ValueError, match=r"noise_mask \(1, 2\)"):
        MDLMCrossEntropyLoss()(ZEROS_1x4x4, TARGETS_1x4, torch.ones(1, 2).bool(), ones, ones)
    with pytest.raises(ValueError, match=r"p_mask \(1, 2\)"):
        BlockDiffusionCrossEntropyLoss()(ZEROS_1x4x4, TARGETS_1x4, None, torch.ones(1, 2), ones)
    with pytest.raises(ValueError, match=r"logits \(1, 7, 4\).*target_ids \(1, 4\).*legacy"):
        HybridDiffusionLLMLoss()(torch.zeros(1, 7, 4), TARGETS_1x4, ones.bool(), ones, ones)
    with pytest.raises(ValueError, match=r"target_ids \(1, 4\).*causal_logits \(1, 3, 4\)"):
        HybridDiffusionLLMLoss()(ZEROS_1x4x4, TARGETS_1x4, ones.bool(), ones, ones, ones,
                                 causal_logits=torch.zeros(1, 3, 4))
    with pytest.raises(ValueError, match=r"valid_mask \(1, 2\)"):
        encoder_ar_loss(ZEROS_1x4x4, TARGETS_1x4, torch.ones(1, 2))
    with pytest.raises(ValueError, match=r"hidden \(3, 2\).*weight \(5, 4\)"):
        fused_linear_cross_entropy(torch.zeros(3, 2), torch.zeros(5, 4), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"targets \(2,\)"):
        fused_linear_cross_entropy(torch.zeros(3, 2), torch.zeros(5, 2), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match=r"row_weights \(2,\)"):
        weighted_linear_cross_entropy(torch.zeros(3, 2), torch.zeros(5, 2), torch.zeros(3, dtype=torch.long),
                                      torch.ones(2))


@pytest.mark.parametrize("count", [-5, torch.tensor(-5.0), float("nan")])
def test_a_negative_or_nan_token_count_is_refused_not_clamped(count):
    """Clamped to 1, a negative count would silently give another loss (the raw sum)."""
    logits = torch.tensor([[FAVOURS_0, EVEN]])
    ids, mask = torch.tensor([[0, 1]]), torch.ones(1, 2)
    with pytest.raises(ValueError, match=r"num_diffusion_tokens=.* must be a count of tokens >= 0"):
        MDLMCrossEntropyLoss()(logits, ids, mask.bool(), torch.ones(1, 2), mask, num_diffusion_tokens=count)
    with pytest.raises(ValueError, match=r"num_tokens=.* must be a count of tokens >= 0"):
        encoder_ar_loss(logits, ids, num_tokens=count)
