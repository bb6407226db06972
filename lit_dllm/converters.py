"""The model-converter protocol (torchtitan's ``ModelConverter``): what changes a built model before it is parallelised
and keeps it right after each optimizer step. fp8 (:class:`lit_dllm.fp8.Float8Converter`, the strategy's) and LoRA
(:class:`lit_dllm.lora.LoRAConverter`, the module's) are converters; a module applies them in one place
(``TokenLossModule.configure_model``, then ``optimizer_step``)."""

from __future__ import annotations

from typing import Protocol

from torch import nn


class ModelConverter(Protocol):
    def convert(self, model: nn.Module) -> None:
        """Change ``model`` in place, before parallelisation (expert parallelism, compile, FSDP2)."""

    def after_optimizer_step(self, model: nn.Module) -> None:
        """Bring derived state up to date with the weights the optimizer just changed."""
