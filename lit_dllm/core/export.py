"""Hugging Face export of a trained module (:class:`ExportMixin`): the transformers backbone and the tokenizer, into a
folder made ready by :func:`export_folder`."""

from __future__ import annotations

import json
import os
from functools import partial
from pathlib import Path
from typing import Any

import torch.distributed as dist
from lightning.pytorch.utilities import rank_zero_warn

from lit_dllm.lora import save_lora
from lit_dllm.hub.blocks import hf_backbone
from lit_dllm.hub.marker import check_export_folder, mark_export
from lit_dllm.parallel import export_hf

WEIGHTS_FILES = ("model.safetensors", "pytorch_model.bin", "adapter_model.safetensors", "adapter_model.bin",
                 "adapter_config.json")
"""What transformers' and PEFT's ``save_pretrained`` write as a model's weights (and PEFT's adapter config, which
makes ``from_pretrained`` load an adapter instead of the folder's weights); shards come with a ``*.index.json``."""


def previous_export(folder: Path) -> list[Path]:
    """The weights a previous export left in ``folder``: :data:`WEIGHTS_FILES`, and each ``*.index.json`` of sharded
    weights (one with a ``weight_map``) with the shard files it names. Nothing else: a user's files are not in it."""
    found = [folder / name for name in WEIGHTS_FILES]
    for index in folder.glob("*.index.json"):
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (ValueError, KeyError, TypeError, AttributeError):
            continue  # not a weights index
        found += [index, *(folder / name for name in shards if isinstance(name, str) and Path(name).name == name)]
    return [path for path in found if path.is_file()]


def check_export_path(path: str | os.PathLike, overwrite: bool = False) -> Path:
    """``path`` as a Path, checked before any model is built (:func:`~lit_dllm.hub.marker.check_export_folder`): a
    file, or a folder of files no export wrote (another model, your own) unless ``overwrite``, is a ValueError naming
    it and the fix."""
    return check_export_folder(path, overwrite)


def export_folder(path: str | os.PathLike, overwrite: bool = False, collective: bool = False, **record) -> Path:
    """``path`` made ready for an export (:func:`check_export_path`): a folder (created if missing), marked as an
    export's (:func:`~lit_dllm.hub.marker.mark_export` of ``record``), without a previous export's weights
    (:func:`previous_export`, removed on global rank 0), so that loading it afterwards reads the new weights, never a
    stale shard index. Other files there stay. Call it once the model is built: its weights may come from this very
    folder. ``collective``: every rank of the process group calls it, and rank 0 changes the folder once every rank
    has checked it (a rank checking it while rank 0 wrote saw files without a mark and refused them)."""
    folder = check_export_path(path, overwrite)
    distributed = dist.is_available() and dist.is_initialized()
    if distributed and collective:
        dist.barrier()
    if not distributed or dist.get_rank() == 0:
        folder.mkdir(parents=True, exist_ok=True)
        mark_export(folder, **record)
        for stale in previous_export(folder):
            stale.unlink()
    return folder


class ExportMixin:
    """``save_pretrained`` for a module with ``model``, ``tokenizer``, ``lora_config`` and :meth:`export_config`."""

    def export_config(self) -> dict[str, Any]:
        """Entries the exported transformers config records besides the backbone's own (a family's sampler, ids)."""
        return {}

    def export_tokenizer(self):
        """The tokenizer to write beside the model, or None (with a warning) when its length or mask id is not the
        module's ``vocab_size`` / ``mask_token_id`` (a module built in Python without one has the embedded default)."""
        tokenizer, mask_id = self.tokenizer, self.mask_token_id
        if len(tokenizer) == self.vocab_size and mask_id in (None, tokenizer.mask_token_id):
            return tokenizer
        rank_zero_warn(
            f"Exporting the model without a tokenizer: the module's tokenizer ({len(tokenizer)} tokens, mask id "
            f"{tokenizer.mask_token_id}) does not match its vocab_size={self.vocab_size} and mask_token_id={mask_id}. "
            "Set module.tokenizer to the one the model was trained with (training through the data module sets it, a "
            "checkpoint holds it) and export again."
        )
        return None

    def save_pretrained(self, path: str | os.PathLike, merge: bool = True, overwrite: bool = False) -> None:
        """Write the transformers backbone and the tokenizer (:meth:`export_tokenizer`) to the folder ``path``
        (:func:`export_folder`: new, empty or an earlier export; ``overwrite=True`` writes into a folder of other
        files, replacing those of the same names) for the family's ``from_pretrained`` (``AutoModelForCausalLM`` for
        MDLM, hybrid and CausalLM; ``DiffusionGemmaForBlockDiffusion`` for Gemma). With ``lora``: the adapters merged
        into the weights (``merge=True``, a plain transformers folder), or PEFT's adapter folder (``merge=False``, for
        ``peft.PeftModel.from_pretrained(base, path)``). Sharded (FSDP2, EP): call it on every rank; rank 0 writes the
        gathered weights. From a trained run: ``<Module>.load_from_checkpoint(ckpt).save_pretrained(path)``."""
        lora = self.lora_config()
        if not merge and lora is None:
            raise ValueError("merge=False writes LoRA adapters, but this module has no lora: use merge=True.")
        check_export_path(path, overwrite)  # before building a model it could not write
        if self.model is None:
            self.configure_model()
        hf_backbone(self.model)[1].config.update(self.export_config())
        write = None if lora is None else partial(save_lora, config=lora, merge=merge)
        strategy = getattr(self.attached_trainer, "strategy", None)
        folder = export_folder(path, overwrite, collective=True,
                               module=f"{type(self).__module__}.{type(self).__qualname__}")
        export_hf(self.model, strategy, folder, self.export_tokenizer(), write)
