"""The transformers models inside a module: the outermost one (what LoRA adapts and exports write) and their repeated
blocks (what compile, FSDP2 and fp8 apply to, each block alone)."""

from __future__ import annotations

from torch import nn
from transformers import PreTrainedModel

from lit_dllm import compat


def block_class_names(model: nn.Module) -> set[str]:
    """Names of the repeated blocks of every transformers model inside ``model``."""
    names: set[str] = set()
    for module in model.modules():
        names.update(compat.no_split_modules(module))
    return names


def transformer_blocks(model: nn.Module, purpose: str, fix: str) -> list[nn.Module]:
    """The blocks of every transformers model inside ``model`` (instances of :func:`block_class_names`), or a
    ValueError naming ``purpose`` and the ``fix`` when there are none."""
    names = block_class_names(model)
    blocks = [m for m in model.modules() if type(m).__name__ in names]
    if not blocks:
        raise ValueError(f"{purpose}: no transformer blocks found in {type(model).__name__} (looked for "
                         f"{sorted(names)}); {fix}.")
    return blocks


def hf_backbone(model: nn.Module) -> tuple[str, PreTrainedModel]:
    """The outermost transformers model inside ``model`` and its name there (``""`` for ``model`` itself)."""
    for name, module in model.named_modules():
        if isinstance(module, PreTrainedModel):
            return name, module
    raise ValueError(f"{type(model).__name__} holds no transformers model to export.")
