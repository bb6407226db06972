"""What runs the experts of transformers' MoE models: the kernel each model's experts dispatch on, setting it, and
why a kernel would loop over the experts on a given GPU (logged at the start of training)."""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

from lit_dllm import compat
from lit_dllm.meshes import device_meshes
from lit_dllm.throughput import expert_counts


def experts_implementation(experts: nn.Module) -> str | None:
    """The implementation transformers runs a MoE ``experts`` module with (``grouped_mm``, ``batched_mm``, ``eager``,
    ...): the one its decorated ``forward`` dispatches on, read from its config; None for one without a transformers
    config (e.g. a remote-code list of per-expert MLPs)."""
    config = getattr(experts, "config", None)
    return compat.experts_implementation(config) if isinstance(config, PretrainedConfig) else None


def moe_experts(model: nn.Module) -> list[nn.Module]:
    """One transformers MoE ``experts`` module per experts config in ``model``: one per MoE model (DiffusionGemma's
    encoder and decoder layers share theirs)."""
    found: dict[int, nn.Module] = {}
    for name, module in model.named_modules():
        if name.rpartition(".")[2] == "experts" and experts_implementation(module) is not None:
            found.setdefault(id(module.config), module)
    return list(found.values())


def set_experts_implementation(model: nn.Module, implementation: str) -> None:
    """transformers' ``set_experts_implementation(implementation)`` on every transformers model in ``model`` that holds
    MoE experts (its own checks: an unknown name, or ``grouped_mm`` on a model without it, raise a ValueError)."""
    experts = {id(module) for module in moe_experts(model)}
    done: set[int] = set()
    for module in model.modules():
        if isinstance(module, PreTrainedModel) and id(module) not in done:
            inner = {id(m) for m in module.modules()}
            if experts & inner:
                module.set_experts_implementation(implementation)
                done |= inner
    if not done:
        raise ValueError(f"experts_implementation={implementation!r}, but {type(model).__name__} has no "
                         "transformers MoE experts: drop experts_implementation.")


def experts_loop_reason(implementation: str, weight_dtype: torch.dtype, capability: tuple[int, int]) -> str | None:
    """Why MoE experts that transformers runs with ``implementation`` loop over the experts (one matmul each, after a
    device-to-host copy of the group sizes) on a CUDA GPU of compute ``capability``, and the fix; None where one
    grouped GEMM kernel runs them (or another kernel: ``batched_mm``, ``deepgemm``, ``sonicmoe``). ``weight_dtype``:
    the expert weights as the forward sees them.

    transformers 5.24 (``modeling_utils.get_correct_experts_implementation``) picks ``grouped_mm`` for every model
    whose experts it made, unless ``experts_implementation`` says otherwise. Its ``integrations/moe.py`` then calls
    torch's ``grouped_mm`` (which every torch that pyproject.toml allows has), or loops itself
    (``grouped_mm_fallback``) where ``_can_use_grouped_mm`` refuses: under ``torch.compile`` with weights other than
    bf16, or on a GPU below compute capability 8.0. torch's CUDA ``grouped_mm`` (``_grouped_mm_cuda``) runs its
    CUTLASS kernel for bf16 on compute capability 9.x and 10.x only and loops over the groups otherwise. Neither
    warns.
    """
    if implementation == "eager":
        return "experts_implementation='eager' is a Python loop; set experts_implementation='grouped_mm' (or unset it)."
    if implementation != "grouped_mm":
        return None
    if weight_dtype != torch.bfloat16:
        dtype = str(weight_dtype).removeprefix("torch.")
        return (f"the expert weights are {dtype} in the forward, and torch's grouped GEMM kernel takes bfloat16 only "
                "(transformers loops under torch.compile, torch's grouped_mm without it); train in precision "
                "bf16-true, or bf16-mixed under ModelParallelStrategy or ExpertParallelStrategy (FSDP2 computes in "
                "bf16).")
    if capability[0] not in (9, 10):
        return (f"torch's grouped GEMM kernel needs a GPU of compute capability 9.x or 10.x (H100, H200, B200) and "
                f"this one is {capability[0]}.{capability[1]}; train on such a GPU.")
    return None


def experts_kernels(model: nn.Module, strategy, param_dtype: torch.dtype | None = None) -> list[tuple[str, str | None]]:
    """What runs the experts of each MoE model in ``model`` (:func:`moe_experts`) once :func:`parallelize`, with the
    same ``strategy`` and ``param_dtype``, and the precision plugin set it up: ``(line, loop)`` pairs, e.g.
    ``("MoE experts (Qwen3MoeExperts): grouped_mm (128 experts, top-8)", None)``. On CUDA ``loop`` is
    :func:`experts_loop_reason`'s; elsewhere it is None (speed is not the point there)."""
    device = strategy.root_device
    sharded = device_meshes(strategy)[0] is not None  # FSDP2 gathers the weights in param_dtype
    report = []
    for experts in moe_experts(model):
        implementation = experts_implementation(experts)
        counts = expert_counts(experts.config)
        sizes = f" ({counts[0]} experts, top-{counts[1]})" if counts else ""
        loop = None
        if device.type == "cuda":
            dtype = param_dtype if sharded and param_dtype is not None else next(experts.parameters()).dtype
            capability = torch.cuda.get_device_capability(device)
            loop = experts_loop_reason(implementation, dtype, capability)
        report.append((f"MoE experts ({type(experts).__name__}): {implementation}{sizes}", loop))
    return report
