"""Hugging Face export of a trained module (:class:`ExportMixin`): the transformers backbone and the tokenizer."""

from __future__ import annotations

import os
from functools import partial
from typing import Any

from lit_dllm.lora import save_lora
from lit_dllm.hub.blocks import hf_backbone
from lit_dllm.parallel import export_hf


class ExportMixin:
    """``save_pretrained`` for a module with ``model``, ``tokenizer``, ``lora_config`` and :meth:`export_config`."""

    def export_config(self) -> dict[str, Any]:
        """Entries the exported transformers config records besides the backbone's own (a family's sampler, ids)."""
        return {}

    def save_pretrained(self, path: str | os.PathLike, merge: bool = True) -> None:
        """Write the transformers backbone and the tokenizer to ``path`` for the family's ``from_pretrained``
        (``AutoModelForCausalLM`` for MDLM, hybrid and CausalLM; ``DiffusionGemmaForBlockDiffusion`` for Gemma). With
        ``lora``: the adapters merged into the weights (``merge=True``, a plain transformers folder), or PEFT's
        adapter folder (``merge=False``, for ``peft.PeftModel.from_pretrained(base, path)``). Sharded (FSDP2, EP):
        call it on every rank; rank 0 writes the gathered weights. From a trained run:
        ``<Module>.load_from_checkpoint(ckpt).save_pretrained(path)``."""
        if self.model is None:
            self.configure_model()
        lora = self.lora_config()
        if not merge and lora is None:
            raise ValueError("merge=False writes LoRA adapters, but this module has no lora: use merge=True.")
        hf_backbone(self.model)[1].config.update(self.export_config())
        write = None if lora is None else partial(save_lora, config=lora, merge=merge)
        strategy = getattr(self.attached_trainer, "strategy", None)
        export_hf(self.model, strategy, path, self.tokenizer, write)
