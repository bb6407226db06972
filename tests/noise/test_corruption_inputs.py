"""Issue 49: the corruption primitives refuse what their docstrings rule out (ids outside the vocabulary, ``k`` past a
row), on CPU tensors, and never make the host wait for the device on an accelerator."""

import pytest
import torch

from lit_dllm.noise.corruption import batched_gumbel_topk, corrupt_mix, corrupt_uniform_random

VOCAB = 50


def ids_with(value: int, row: int = 1, col: int = 3) -> torch.Tensor:
    ids = torch.arange(24).view(3, 8) % VOCAB
    ids[row, col] = value
    return ids


@pytest.mark.parametrize("bad", [VOCAB, VOCAB + 7, -1])
def test_uniform_random_refuses_an_id_outside_the_vocabulary(bad):
    with pytest.raises(ValueError, match=rf"input_ids\[1, 3\] = {bad} is outside .*vocab_size={VOCAB}\).*len\(tok"):
        corrupt_uniform_random(ids_with(bad), torch.ones(3, 8), VOCAB, generator=torch.Generator().manual_seed(0))


def test_an_unsupervised_position_is_checked_too():
    """The id reaches the model whether or not it is corrupted."""
    loss_mask = torch.ones(3, 8)
    loss_mask[1, 3] = 0
    with pytest.raises(ValueError, match=r"input_ids\[1, 3\] = 50"):
        corrupt_uniform_random(ids_with(VOCAB), loss_mask, VOCAB, keys=torch.arange(3))


def test_mix_refuses_an_id_outside_the_vocabulary():
    with pytest.raises(ValueError, match=rf"input_ids\[0, 2\] = {VOCAB} is outside .*vocab_size={VOCAB}\)"):
        corrupt_mix(ids_with(VOCAB, 0, 2), torch.ones(3, 8), 0, VOCAB, 0.3, 0.3)


@pytest.mark.parametrize("k", [[1, 5], [-1, 0]])
def test_batched_gumbel_topk_refuses_k_outside_the_row(k):
    bad = 0 if k[0] < 0 else 1
    with pytest.raises(ValueError, match=rf"k\[{bad}\] = {k[bad]} is outside \[0, 4\]"):
        batched_gumbel_topk(torch.zeros(2, 4), torch.tensor(k))


def test_in_range_inputs_pass():
    ids = ids_with(VOCAB - 1)
    noisy = corrupt_uniform_random(ids, torch.ones(3, 8), VOCAB, generator=torch.Generator().manual_seed(0))[0]
    assert ((0 <= noisy) & (noisy < VOCAB)).all()
    assert batched_gumbel_topk(torch.zeros(2, 4), torch.tensor([0, 4])).sum(1).tolist() == [0, 4]


def test_values_off_the_cpu_are_not_read():
    """On another device the check would make the host wait: tensors there (``meta``: no data at all) pass."""
    ids = ids_with(VOCAB).to("meta")
    noisy, noise, _ = corrupt_uniform_random(ids, torch.ones(3, 8, device="meta"), VOCAB)
    assert noisy.device.type == "meta" and noise.shape == (3, 8)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_cuda_step_never_syncs():
    ids, loss_mask = ids_with(VOCAB - 1).cuda(), torch.ones(3, 8, device="cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        corrupt_uniform_random(ids, loss_mask, VOCAB, keys=torch.arange(3, device="cuda"))
        corrupt_uniform_random(ids, loss_mask, VOCAB, generator=torch.Generator("cuda").manual_seed(0))
    finally:
        torch.cuda.set_sync_debug_mode("default")
