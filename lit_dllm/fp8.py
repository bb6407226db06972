"""FP8 training through torchao's float8 linears (``parallelism.fp8: tensorwise | rowwise`` on the strategy).

:func:`apply_fp8` swaps the dense matmuls of the transformer blocks for torchao's ``Float8Linear``
(``torchao.float8.convert_to_float8_training`` with ``Float8LinearConfig.from_recipe_name(recipe)``): each forward
and backward matmul casts its operands to float8 with dynamic scales (one per tensor, or one per row) and runs
``torch._scaled_mm``; the weights, their gradients and the optimizer stay in their own dtype, so checkpoints are
those of the plain model (same keys, same tensors) and load with ``fp8`` on or off. :class:`Float8Converter` applies
it before expert parallelism, compile and FSDP2, as torchtitan converts the model before parallelising it.

Which layers convert (:func:`fp8_linears`): the plain ``nn.Linear`` layers inside the transformer blocks (the
classes transformers lists in ``_no_split_modules``) whose weight trains and whose in and out features are
multiples of 16 (``_scaled_mm``'s requirement), except routers (a module named ``router`` or ``gate`` on the way:
their top-k choice is sensitive to rounding). So the LM head, the embeddings, the routers, the MoE experts (3-D
parameters, not ``nn.Linear``), DiffusionGemma's vision tower and DFlash's frozen target keep their precision.

Under FSDP2 the tensorwise recipe also all-gathers the weights in float8 (``enable_fsdp_float8_all_gather``: half
the bytes of bf16), with the scales of all weights computed in one all-reduce after each optimizer step
(:func:`precompute_fp8_scales`, also after weights are loaded, so that restored weights never meet old scales);
rowwise scales cannot be all-gathered that way and gather the weights as they are. Until the first step (and after
weights are loaded into a converted model) each all-gather computes its own scale.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from lit_dllm.hub.blocks import transformer_blocks
from lit_dllm.settings import FP8_RECIPES as RECIPES

ROUTER_NAMES = {"router", "gate"}
"""Module names (one part of a dotted name) under which a linear layer is a router and keeps its precision."""

MIN_CAPABILITY = (8, 9)
"""CUDA compute capability of the first float8 tensor cores (Ada; Hopper is 9.0)."""

INSTALL = "pip install -e '.[fp8]' (torchao>=0.18)"


def check_recipe(recipe: str | None) -> None:
    """An unknown ``fp8`` recipe is a ValueError naming the known ones."""
    if recipe is not None and recipe not in RECIPES:
        raise ValueError(f"fp8={recipe!r} is not a float8 recipe: use one of {RECIPES}, or null for no fp8.")


def check_fp8_device(device: torch.device) -> None:
    """fp8 needs a CUDA GPU with float8 tensor cores (compute capability >= 8.9): a ValueError otherwise."""
    if device.type != "cuda":
        raise ValueError(
            f"fp8 training needs a CUDA GPU with float8 tensor cores (compute capability >= 8.9: Ada, Hopper or "
            f"newer), but this run is on {device.type}: set parallelism.fp8: null on the strategy (checkpoints of fp8 "
            "runs load without it)."
        )
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < MIN_CAPABILITY:
        raise ValueError(
            f"fp8 training needs float8 tensor cores (compute capability >= 8.9: Ada, Hopper or newer), but "
            f"{torch.cuda.get_device_name(device)} has compute capability {major}.{minor}: set parallelism.fp8: null."
        )


def fp8_linears(model: nn.Module) -> dict[str, nn.Linear]:
    """The linear layers of ``model`` that fp8 converts (see the module docstring), by name."""
    blocks = {id(block) for block in transformer_blocks(model, "fp8", "set parallelism.fp8: null for this model")}
    linears = {}
    for block_name, block in model.named_modules():
        if id(block) not in blocks:
            continue
        for name, module in block.named_modules(prefix=block_name):
            if (type(module) is nn.Linear and module.weight.requires_grad and not ROUTER_NAMES & set(name.split("."))
                    and module.in_features % 16 == 0 and module.out_features % 16 == 0):
                linears[name] = module
    return linears


def uses_fp8_all_gather(recipe: str | None, sharded: bool) -> bool:
    """Whether FSDP2 all-gathers the converted weights in float8 (tensorwise scales only)."""
    return sharded and recipe == "tensorwise"


def apply_fp8(model: nn.Module, recipe: str, sharded: bool = False) -> list[str]:
    """Swap :func:`fp8_linears` for torchao's ``Float8Linear`` (``recipe``; FSDP2 float8 all-gather when ``sharded``
    and tensorwise), in place; returns the names of the converted layers.

    Layers that held one weight (a tied stack: DiffusionGemma's encoder and decoder layer ``i``) still do after it."""
    check_recipe(recipe)
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as err:
        raise ImportError(f"fp8={recipe!r} needs torchao: {INSTALL}.") from err
    config = Float8LinearConfig.from_recipe_name(recipe)
    if uses_fp8_all_gather(recipe, sharded):
        config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
    targets = {id(module) for module in fp8_linears(model).values()}
    weights: dict[str, nn.Parameter] = {}  # converted name -> its weight before (torchao wraps it for the all-gather)

    def convert(module: nn.Module, name: str) -> bool:
        if id(module) in targets:
            weights[name] = module.weight
        return id(module) in targets

    convert_to_float8_training(model, module_filter_fn=convert, config=config)
    shared: dict[int, nn.Parameter] = {}
    for name, weight in weights.items():
        linear = model.get_submodule(name)
        linear.weight = shared.setdefault(id(weight), linear.weight)
    return list(weights)


def precompute_fp8_scales(model: nn.Module) -> None:
    """torchao's ``precompute_float8_dynamic_scale_for_fsdp``: the float8 scales of every weight that FSDP2 gathers in
    float8, from one all-reduce (without it each weight's all-gather reduces its own amax)."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    precompute_float8_dynamic_scale_for_fsdp(model)


class Float8Converter:
    """fp8 as a model converter: :func:`apply_fp8` with ``recipe`` (on a GPU with float8 tensor cores), and, where
    FSDP2 gathers the weights in float8, their scales from the current weights after each optimizer step and after
    weights are loaded into the model (a checkpoint's never meet the scales of others)."""

    def __init__(self, recipe: str, device: torch.device, sharded: bool) -> None:
        check_recipe(recipe)
        check_fp8_device(device)
        self.recipe, self.sharded = recipe, sharded

    def convert(self, model: nn.Module) -> None:
        if any(".lora_" in name for name, _ in model.named_parameters()):  # PEFT's adapters
            raise ValueError(f"parallelism.fp8={self.recipe!r} with lora is not supported: fp8 converts only trainable "
                             "linear layers, which under LoRA are the small rank-r adapters (no speed-up, coarser "
                             "updates). Drop one of them.")
        apply_fp8(model, self.recipe, self.sharded)
        if uses_fp8_all_gather(self.recipe, self.sharded):
            model.register_load_state_dict_post_hook(lambda module, _: self.after_optimizer_step(module))

    def after_optimizer_step(self, model: nn.Module) -> None:
        if uses_fp8_all_gather(self.recipe, self.sharded):
            precompute_fp8_scales(model)
