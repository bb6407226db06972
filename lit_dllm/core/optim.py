"""Default optimisation: AdamW without decay on norms and biases, linear warm-up then cosine decay."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

OptimizerCallable = Callable[[Iterable], Optimizer]


def decay_param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two groups: matrices (decayed) and 1-D params such as norms and biases (not decayed)."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]


def warmup_cosine(warmup_steps: int, total_steps: int, min_lr_ratio: float) -> Callable[[int], float]:
    """LR multiplier: ``(s+1)/warmup`` during warm-up, then cosine from 1 down to ``min_lr_ratio``."""
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise ValueError(f"min_lr_ratio={min_lr_ratio} must lie in [0, 1].")
    warmup_steps = max(1, warmup_steps)
    decay_steps = max(1, total_steps - warmup_steps)

    def multiplier(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / decay_steps)
        return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return multiplier


def build_optimization(
    model: nn.Module,
    total_steps: int,
    *,
    lr: float,
    weight_decay: float,
    betas: tuple[float, float],
    warmup: float,
    min_lr_ratio: float,
    optimizer: OptimizerCallable | None = None,
) -> dict:
    """Lightning ``configure_optimizers`` dict: ``optimizer(groups)``, or AdamW (fused on CUDA). ``warmup`` < 1 is a
    fraction of ``total_steps``, else a step count."""
    groups = decay_param_groups(model, weight_decay)
    if optimizer is None:
        # one fused kernel per step on CUDA (FSDP2's sharded parameters too) instead of foreach's chain of kernels
        on_cuda = all(p.is_cuda for group in groups for p in group["params"])
        opt = torch.optim.AdamW(groups, lr=lr, betas=betas, fused=True if on_cuda else None)
    else:
        opt = optimizer(groups)
    warmup_steps = int(warmup * total_steps) if warmup < 1 else int(warmup)
    schedule = LambdaLR(opt, warmup_cosine(warmup_steps, total_steps, min_lr_ratio))
    return {"optimizer": opt, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}
