"""What a DFlash draft is saved with and in (docs/DESIGN.md §10.6), plain PyTorch: the identity of the target it is
trained against, which every training checkpoint records, and the two folder layouts a trained draft is written in and
read from.

The identity (:func:`target_identity`: the target's text config, vocabulary rows and a fingerprint of its weights) is
compared on resuming, validating or loading, and a different target is named by its differences
(:func:`identity_differences`). A draft folder is a ``MuseGlimmerAssistantModel`` one (``save_pretrained``) or z-lab's
``DFlashDraftModel`` one (:func:`export_zlab`, what SGLang / vLLM DFlash backends read); :func:`load_draft` reads
either.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from transformers import AutoModel, MuseGlimmerAssistantConfig, MuseGlimmerAssistantModel, PreTrainedModel

from lit_dllm.hub.hf import saved_model_type


# ------------------------------------------------------------------------------------------- target identity
UNTRACKED_CONFIG = ("transformers_version", "torch_dtype", "dtype", "name_or_path", "architectures", "use_cache")
"""Target config keys that say how it was loaded or saved, not what it computes (the dtype is in the weights)."""


def target_identity(target: PreTrainedModel) -> dict[str, Any]:
    """What a draft is trained against: the target's text config, its vocabulary (embedding rows) and a fingerprint of
    its weights (each tensor's name, shape, dtype, float64 sum and 1024 evenly spaced values, hashed: cheap for an 8B
    target, and any retraining moves them)."""
    config = {key: value for key, value in target.config.get_text_config().to_dict().items()
              if not key.startswith("_") and key not in UNTRACKED_CONFIG}
    digest = hashlib.sha256()
    with torch.no_grad():
        for name, tensor in sorted(target.state_dict().items()):
            flat = tensor.detach().reshape(-1)
            digest.update(f"{name} {tuple(tensor.shape)} {tensor.dtype} {flat.double().sum().item()!r}".encode())
            digest.update(flat[:: max(1, flat.numel() // 1024)][:1024].float().cpu().numpy().tobytes())
    rows = target.get_input_embeddings().weight.shape[0]
    config = json.loads(json.dumps(config, default=str))
    return {"config": config, "vocabulary": rows, "weights": digest.hexdigest()[:16]}


def identity_differences(recorded: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """How ``current`` (a :func:`target_identity`) differs from ``recorded``, one phrase per difference."""
    then, now = recorded["config"], current["config"]
    changed = [f"config {key} {now.get(key)!r} (checkpoint: {then.get(key)!r})"
               for key in sorted(set(then) | set(now)) if then.get(key) != now.get(key)]
    for name in ("vocabulary", "weights"):
        if recorded[name] != current[name]:
            what = "weights fingerprint" if name == "weights" else "vocabulary rows"
            changed.append(f"{what} {current[name]} (checkpoint: {recorded[name]})")
    return changed


# ----------------------------------------------------------------------------------------------- draft folders
ZLAB_KEYS = {"encoder.fc.weight": "fc.weight", "encoder.output_norm_enc.weight": "hidden_norm.weight"}
"""Muse key -> z-lab ``DFlashDraftModel`` key; every other key (``layers.*``, ``norm.weight``) is the same."""


def is_zlab_checkpoint(path: str | os.PathLike) -> bool:
    """Whether ``path`` holds a z-lab ``DFlashDraftModel`` checkpoint (a qwen3 config with ``dflash_config``)."""
    config = Path(path) / "config.json"
    if not config.is_file():
        return False
    settings = json.loads(config.read_text())
    return "dflash_config" in settings and "DFlashDraftModel" in settings.get("architectures", [])


def load_draft(path: str | os.PathLike, attn_implementation: str | None = None) -> MuseGlimmerAssistantModel:
    """A trained draft from ``path``: a ``MuseGlimmerAssistantModel`` folder (``save_pretrained``) or a z-lab
    ``DFlashDraftModel`` one (:func:`export_zlab`'s layout; its keys are renamed back)."""
    kwargs = {"attn_implementation": attn_implementation} if attn_implementation else {}
    if is_zlab_checkpoint(path):
        settings = json.loads((Path(path) / "config.json").read_text())
        config = muse_config_from_zlab(settings)
        model = AutoModel.from_config(config, **kwargs)
        state = _read_safetensors(Path(path))
        renamed = {key: state[zlab] for key, zlab in ((k, ZLAB_KEYS.get(k, k)) for k in model.state_dict())
                   if zlab in state}
        missing = sorted(set(model.state_dict()) - set(renamed))
        if missing:
            raise ValueError(f"{path} is a z-lab DFlash checkpoint without the tensors {missing[:4]}...")
        model.load_state_dict(renamed, strict=True)
        return model
    saved_model_type(path, MuseGlimmerAssistantConfig.model_type, "a DFlash draft",
                     "pass a folder written by DFlashModule.save_pretrained or export_zlab (z-lab's DFlashDraftModel), "
                     "or draft_config for a new draft.")
    return MuseGlimmerAssistantModel.from_pretrained(path, **kwargs)


def muse_config_from_zlab(settings: dict[str, Any]) -> MuseGlimmerAssistantConfig:
    """The ``MuseGlimmerAssistantConfig`` of a z-lab ``config.json`` dict (qwen3 keys + ``dflash_config``)."""
    dflash = settings["dflash_config"]
    keys = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "head_dim", "rms_norm_eps", "rope_parameters", "max_position_embeddings", "hidden_act", "bos_token_id",
            "eos_token_id", "pad_token_id", "attention_dropout")
    config = {key: settings[key] for key in keys if key in settings}
    config["layer_types"] = ["full_attention"] * settings["num_hidden_layers"]
    config.update(block_size=dflash.get("block_size", settings.get("block_size")),
                  mask_token_id=dflash["mask_token_id"], target_layer_ids=dflash["target_layer_ids"])
    return MuseGlimmerAssistantConfig(**config)


def _read_safetensors(folder: Path) -> dict[str, Tensor]:
    from safetensors.torch import load_file

    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    state: dict[str, Tensor] = {}
    for name in files:
        state.update(load_file(folder / name))
    return state


def export_zlab(draft: MuseGlimmerAssistantModel, path: str | os.PathLike, *, vocab_size: int,
                num_target_layers: int) -> None:
    """Write ``draft`` in z-lab's ``DFlashDraftModel`` layout (what SGLang / vLLM DFlash backends and z-lab's
    ``AutoModel(trust_remote_code)`` code read): ``config.json`` with ``model_type: qwen3``, ``architectures:
    [DFlashDraftModel]``, ``is_causal: false``, full-attention ``layer_types``, ``block_size`` and ``dflash_config``
    (``block_size``, ``mask_token_id``, ``target_layer_ids``), and ``model.safetensors`` whose keys are Muse's
    with ``encoder.fc`` -> ``fc`` and ``encoder.output_norm_enc`` -> ``hidden_norm`` (:data:`ZLAB_KEYS`)."""
    from safetensors.torch import save_file

    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    config = draft.config
    layers = config.num_hidden_layers
    settings = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "attention_bias": False,
        "attention_dropout": float(config.attention_dropout),
        "hidden_act": config.hidden_act,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_parameters": dict(config.rope_parameters),
        "rope_theta": config.rope_parameters.get("rope_theta"),
        "max_position_embeddings": config.max_position_embeddings,
        "layer_types": ["full_attention"] * layers,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": layers,
        "is_causal": False,
        "tie_word_embeddings": False,
        "use_cache": False,
        "vocab_size": vocab_size,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_id,
        "pad_token_id": config.pad_token_id,
        "num_target_layers": num_target_layers,
        "block_size": config.block_size,
        "dflash_config": {
            "block_size": config.block_size,
            "mask_token_id": config.mask_token_id,
            "target_layer_ids": list(config.target_layer_ids),
        },
        "dtype": str(next(draft.parameters()).dtype).removeprefix("torch."),
    }
    (folder / "config.json").write_text(json.dumps(settings, indent=2) + "\n")
    state = {ZLAB_KEYS.get(key, key): value.detach().contiguous().cpu() for key, value in draft.state_dict().items()}
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
