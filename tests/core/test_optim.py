"""Default optimisation: no decay on norms and biases; linear warm-up then cosine to min_lr_ratio."""

import math

import pytest
import torch
from torch import nn

from lit_dllm.core.optim import build_optimization, decay_param_groups, warmup_cosine


def test_norms_and_biases_are_not_decayed():
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Embedding(5, 4))
    decayed, plain = decay_param_groups(model, 0.1)
    assert {id(p) for p in decayed["params"]} == {id(model[0].weight), id(model[2].weight)}
    assert {id(p) for p in plain["params"]} == {id(model[0].bias), id(model[1].weight), id(model[1].bias)}
    assert decayed["weight_decay"] == 0.1 and plain["weight_decay"] == 0.0


def test_warmup_then_cosine_values():
    f = warmup_cosine(warmup_steps=4, total_steps=14, min_lr_ratio=0.1)
    assert [f(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert f(4) == 1.0 and f(14) == pytest.approx(0.1) and f(100) == pytest.approx(0.1)
    assert f(9) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))


def test_a_custom_optimizer_callable_replaces_adamw():
    model = nn.Linear(3, 3)
    config = build_optimization(model, 10, lr=1.0, weight_decay=0.0, betas=(0.9, 0.95), warmup=0.2, min_lr_ratio=0.0,
                                optimizer=lambda groups: torch.optim.SGD(groups, lr=0.5))
    assert isinstance(config["optimizer"], torch.optim.SGD)
    assert config["lr_scheduler"]["interval"] == "step"
    assert config["optimizer"].param_groups[0]["lr"] == pytest.approx(0.5 * 0.5)  # warm-up step 0 of 2


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
def test_adamw_is_fused_on_cuda_only_and_steps_like_the_unfused_one(device):
    torch.manual_seed(0)
    model = nn.Linear(8, 4).to(device)
    reference = nn.Linear(8, 4).to(device)
    reference.load_state_dict(model.state_dict())
    opt = build_optimization(model, 10, lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), warmup=0, min_lr_ratio=0.1)
    assert bool(opt["optimizer"].defaults["fused"]) == (device == "cuda")
    plain = torch.optim.AdamW(decay_param_groups(reference, 0.1), lr=1e-2, betas=(0.9, 0.95), foreach=False)
    x = torch.randn(16, 8, device=device)
    for optimizer, net in ((opt["optimizer"], model), (plain, reference)):
        for _ in range(3):
            net(x).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    for got, want in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
