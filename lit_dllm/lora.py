"""LoRA through PEFT: adapters injected into a module's transformers backbone, and their export.

The adapters are PEFT's own: :func:`apply_lora` injects them in place with ``peft.inject_adapter_in_model``, so the
backbone keeps its transformers class and its blocks (activation checkpointing, compile, FSDP2 and EP see the same
tree, with the adapters inside each block), and PEFT marks every other parameter frozen. :func:`save_lora` writes a
trained backbone the way PEFT does, from a fresh copy built on the meta device and loaded with the trained weights
(gathered to rank 0 under FSDP2): merged into a plain transformers folder, or as the adapter folder that
``peft.PeftModel.from_pretrained(base, path)`` loads.

:class:`LoRAConverter` is the module's model converter (``lora:`` on every module): it adapts the model's transformers
backbone before parallelisation.

Tied stacks (DiffusionGemma: encoder layer ``i`` and decoder layer ``i`` are different modules holding the same
weights) get one adapter per shared weight (:func:`share_tied_adapters`), so the stack stays one stack.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel

from lit_dllm.hub.blocks import hf_backbone

LLAMA_STYLE_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
"""Attention and MLP projections of Llama-style blocks (DiffusionGemma's dense layers use these names too)."""


def lora_config(settings: dict[str, Any], defaults: dict[str, Any]):
    """``peft.LoraConfig`` of the family's ``defaults`` updated by the user's ``settings`` (LoraConfig's own names:
    ``r``, ``lora_alpha``, ``lora_dropout``, ``target_modules``, ``exclude_modules``, ``target_parameters``, ...)."""
    try:
        from peft import LoraConfig
    except ImportError as err:
        raise ImportError("lora needs PEFT: pip install 'lit_dllm[lora]' (peft>=0.21).") from err
    try:
        return LoraConfig(**{**defaults, **settings})
    except (TypeError, ValueError) as err:
        raise ValueError(
            f"lora={settings!r} is not a valid LoRA setting ({err}). Use peft.LoraConfig's names, e.g. "
            "{r: 16, lora_alpha: 32, lora_dropout: 0.05, target_modules: [q_proj, v_proj]}."
        ) from err


class LoRAConverter:
    """LoRA as a model converter: PEFT's adapters (``config``) in the model's transformers backbone, refused inside a
    frozen module (``frozen``: dotted names from the LightningModule, whose ``model`` the converter receives)."""

    def __init__(self, config, frozen: list[str]) -> None:
        self.config, self.frozen = config, frozen

    def convert(self, model: nn.Module) -> None:
        name, backbone = hf_backbone(model)
        dotted = f"model.{name}" if name else "model"
        for frozen in self.frozen:
            if dotted == frozen or dotted.startswith(f"{frozen}."):
                raise ValueError(
                    f"lora would adapt {dotted}, which is frozen (frozen_modules={self.frozen}): its adapters would "
                    "never train. Drop lora for this module, or unfreeze it."
                )
        apply_lora(backbone, self.config)

    def after_optimizer_step(self, model: nn.Module) -> None:
        pass


def apply_lora(backbone: PreTrainedModel, config) -> None:
    """Inject ``config``'s adapters into ``backbone`` in place (PEFT), only the adapters left trainable; a
    ``target_modules`` that names no module of ``backbone`` is an error listing the linear layers it has."""
    from peft import inject_adapter_in_model

    try:
        inject_adapter_in_model(config, backbone)
    except ValueError as err:
        if "not found in the base model" not in str(err):
            raise
        names = sorted({name.rsplit(".", 1)[-1] for name, m in backbone.named_modules() if isinstance(m, nn.Linear)})
        raise ValueError(
            f"lora target_modules={config.target_modules!r} (target_parameters={config.target_parameters!r}) match "
            f"nothing in {type(backbone).__name__}: its linear layers are named {names}. Name some of them "
            "(or 'all-linear')."
        ) from err
    share_tied_adapters(backbone)


@contextmanager
def adapters_off(model: nn.Module):
    """``model`` without its LoRA adapters for the block (the base it was fine-tuned from; e.g. RL's reference
    policy), with them again after: no second copy of the weights."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [module for module in model.modules() if isinstance(module, BaseTunerLayer)]
    if not layers:
        raise ValueError(f"{type(model).__name__} holds no LoRA adapters to switch off.")
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield model
    finally:
        for layer in layers:
            layer.enable_adapters(True)


def share_tied_adapters(model: nn.Module) -> None:
    """Give every adapted module that holds the same base weights as an earlier one that earlier module (adapter and
    all), so a tied stack trains one adapter per shared weight. Also re-ties plain layers after a merge."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    owners: dict[tuple[int, ...], nn.Module] = {}
    for parent in list(model.modules()):
        if isinstance(parent, BaseTunerLayer):  # its base layer (nested adapters on one module) goes with it
            continue
        for name, child in list(parent.named_children()):
            adapted = isinstance(child, BaseTunerLayer)
            key = tuple(id(p) for p in (child.get_base_layer() if adapted else child).parameters(recurse=False))
            if key and owners.setdefault(key, child) is not child and adapted:
                setattr(parent, name, owners[key])


def save_lora(backbone: PreTrainedModel, state: dict[str, torch.Tensor], path: str | os.PathLike, config,
              merge: bool) -> None:
    """Write ``backbone`` (adapted with ``config``) holding the full ``state`` (its own keys) to ``path``: merged, a
    plain transformers folder; else PEFT's adapter folder. ``backbone`` and ``state`` are left as they were."""
    from peft import get_peft_model

    with torch.device("meta"):
        fresh = type(backbone)(backbone.config)
    peft_model = get_peft_model(fresh, config)
    share_tied_adapters(fresh)
    # the copy shares the given tensors (no second copy of the model), except the weights a merge changes in place
    fresh.load_state_dict({k: v.clone() if merge and ".base_layer." in k else v for k, v in state.items()}, assign=True)
    if not merge:
        peft_model.save_pretrained(path)
        return
    merged = peft_model.merge_and_unload()
    share_tied_adapters(merged)
    merged.save_pretrained(path)
