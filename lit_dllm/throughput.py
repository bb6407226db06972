"""Throughput arithmetic: a GPU's peak FLOP/s at the trainer's precision, and the model FLOPs of a training step.

MFU = model FLOPs per second per device / that device's peak. Model FLOPs follow the PaLM paper's accounting (appendix
B, as nanoGPT and ``bench/bench_mdlm_step.py`` count them): per token, 2 FLOPs per matmul parameter forward and 4
backward, plus the attention scores and weighted values, ``4 · layers · heads · head_dim · context`` forward (full
attention, masked positions included: the kernels compute them). A mixture-of-experts layer counts the parameters a
token uses: its top-k experts' (the active parameters), not all experts'.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

PEAK_FLOPS = {
    "h100 sxm": {"bf16": 989.5e12, "tf32": 494.5e12, "fp32": 67e12},
    "h100 pcie": {"bf16": 756.5e12, "tf32": 378e12, "fp32": 51e12},
    "h100 nvl": {"bf16": 835.5e12, "tf32": 417.5e12, "fp32": 60e12},
    "h200 sxm": {"bf16": 989.5e12, "tf32": 494.5e12, "fp32": 67e12},
    "h200 nvl": {"bf16": 835.5e12, "tf32": 417.5e12, "fp32": 60e12},
}
"""Dense peak FLOP/s of one GPU (NVIDIA's H100 and H200 datasheets; their tensor-core figures are with sparsity, halved
here; fp16 equals bf16). Lightning's own table lacks the plain "NVIDIA H200" name and lists sparsity peaks for some."""


def hopper_chip(device_name: str) -> str | None:
    """The :data:`PEAK_FLOPS` row of a CUDA device name (``torch.cuda.get_device_name``), None if not an H100/H200.

    "NVIDIA H200" and "NVIDIA H100 80GB HBM3" are the SXM parts; PCIe and NVL cards say so in their names."""
    name = device_name.lower()
    chip = "h200" if "h200" in name else "h100" if "h100" in name or "gh200" in name else None
    if chip is None:
        return None
    if "nvl" in name:
        return f"{chip} nvl"
    if chip == "h100" and ("pcie" in name or "hbm2e" in name):
        return "h100 pcie"
    return f"{chip} sxm"


def compute_format(precision: str) -> str | None:
    """The matmul format a Lightning ``precision`` computes in: ``bf16`` (also fp16), ``tf32`` (fp32 with
    ``torch.set_float32_matmul_precision`` below "highest"), ``fp32``, or None (e.g. fp64, fp8)."""
    precision = str(precision)
    if "16" in precision:
        return "bf16"
    if precision in ("32", "32-true"):
        return "fp32" if torch.get_float32_matmul_precision() == "highest" else "tf32"
    return None


def peak_flops(device: torch.device, precision: str) -> float | None:
    """Peak FLOP/s of ``device`` at ``precision``: :data:`PEAK_FLOPS` for H100/H200, Lightning's table for other GPUs,
    None on a CPU or where neither knows the card."""
    if device.type != "cuda":
        return None
    chip, form = hopper_chip(torch.cuda.get_device_name(device)), compute_format(precision)
    if chip is not None:
        return PEAK_FLOPS[chip].get(form)
    if form is None:
        return None
    from lightning.fabric.utilities.throughput import get_available_flops

    half = torch.float16 if str(precision).startswith("16") else torch.bfloat16
    return get_available_flops(device, half if form == "bf16" else torch.float32)  # it picks tf32 itself


_COUNTED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def matmul_params(model: nn.Module, expert_share: float = 1.0) -> tuple[float, float]:
    """(trained, frozen) parameters used in matmuls per token: every module's except embeddings' (a tied LM head counts,
    as the matmul it is), those inside ``*experts`` modules scaled by ``expert_share`` (top-k / experts). Counted
    once per model (the throughput monitor asks every micro-batch; an 8B model's walk takes ~1 ms)."""
    counted = _COUNTED.setdefault(model, {})
    if expert_share not in counted:
        counted[expert_share] = _count_matmul_params(model, expert_share)
    return counted[expert_share]


def _count_matmul_params(model: nn.Module, expert_share: float) -> tuple[float, float]:
    counts = [0.0, 0.0]
    for name, module in model.named_modules():
        if isinstance(module, nn.Embedding):
            continue
        share = expert_share if "experts" in name.split(".") else 1.0
        for param in module.parameters(recurse=False):
            counts[not param.requires_grad] += share * param.numel()
    return counts[0], counts[1]


def expert_counts(config) -> tuple[int, int] | None:
    """(experts, top-k) of each mixture-of-experts layer of a transformers config; None for a dense model."""
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    top_k = getattr(config, "num_experts_per_tok", None) or getattr(config, "top_k_experts", None)
    return (experts, top_k) if experts and top_k else None


def expert_share(config) -> float:
    """Share of a mixture-of-experts layer's experts each token uses (1 for a dense model), from a transformers config."""
    counts = expert_counts(config)
    return counts[1] / counts[0] if counts else 1.0


def attention_flops(config, context: int) -> float:
    """Forward FLOPs per token of attention over ``context`` positions, from a transformers config: layer by layer where
    the config is heterogeneous (transformers' ``per_layer_config``: Gemma 4's full-attention layers have wider heads,
    ``global_head_dim``, and reading ``config.head_dim`` raises there)."""
    if getattr(config, "is_heterogeneous", False):
        layers = [config.per_layer_config[index] for index in range(config.num_hidden_layers)]
    else:
        layers = [config] * config.num_hidden_layers
    width = sum(layer.num_attention_heads * (getattr(layer, "head_dim", None)
                                             or layer.hidden_size // layer.num_attention_heads) for layer in layers)
    return 4.0 * width * context


def packed_transformer_flops(model: nn.Module, config, spans: torch.Tensor, frozen_flops: int = 2) -> torch.Tensor:
    """:func:`transformer_flops` of packed rows, counted on their documents (``spans``: each document's tokens): the
    matmuls on the documents' tokens, attention within each document; the rows' tail padding is not counted. A tensor
    on ``spans``' device (no host sync)."""
    trained, frozen = matmul_params(model, expert_share(config))
    spans = spans.double()
    return spans.sum() * (6 * trained + frozen_flops * frozen) + 3 * attention_flops(config, 1) * (spans**2).sum()


def transformer_flops(model: nn.Module, config, batch_size: int, length: int, frozen_flops: int = 2) -> float:
    """Model FLOPs of one training step of ``model`` on ``batch_size`` rows of ``length`` tokens, forward and backward:
    6 per trained matmul parameter and ``frozen_flops`` per frozen one (2: forward only, a frozen model; 4: its input
    gradients too, a frozen base under trained adapters), per token, plus 3 × :func:`attention_flops`."""
    trained, frozen = matmul_params(model, expert_share(config))
    return batch_size * length * (6 * trained + frozen_flops * frozen + 3 * attention_flops(config, length))
