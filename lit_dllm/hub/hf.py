"""Loading Hugging Face backbones: a hub id, a local path, a GGUF file in either, or a config for random init; what
their attention can train on."""

from __future__ import annotations

import difflib
import inspect
import os
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from lit_dllm import compat
from lit_dllm.hub.gguf import load_gguf_model

LEGACY_CONFIG_KEYS = ("rope_theta", "rope_scaling", "partial_rotary_factor", "torch_dtype")
"""Keys transformers still accepts and converts (e.g. ``rope_theta`` into ``rope_parameters``)."""
UNDECLARED_CONFIG_KEYS = ("head_dim",)
"""Keys that modeling code reads with ``getattr(config, key, default)`` where its config class does not define them:
transformers 5.24's ``Qwen3MoeConfig`` lacks ``head_dim``, which its attention and rotary embedding read
(Qwen3-30B-A3B's ``config.json`` sets 128, not hidden_size / heads = 64)."""


FLEX_MIN_HEAD_DIM = 16
"""The smallest head size FlexAttention's CUDA (Triton) kernels compile for (torch 2.11's inductor: "NYI: embedding
dimension of the query, key, and value must be at least 16")."""

HUB_OR_PATH = "a hub id or local path"
RANDOM_INIT = "a dict with model_type and sizes for random init"


def check_config_keys(hf_config: PretrainedConfig, given: dict[str, Any]) -> None:
    """Reject the keys of ``given`` that ``hf_config``'s class does not define (transformers would keep them as
    inert attributes). Known: the default config's keys, the class's ``__init__`` parameters, attribute
    aliases, :data:`LEGACY_CONFIG_KEYS` and :data:`UNDECLARED_CONFIG_KEYS`; any key transformers consumes itself
    passes too."""
    cls = type(hf_config)
    known = set(cls().to_dict()) | set(inspect.signature(cls.__init__).parameters) | set(cls.attribute_map)
    known |= set(LEGACY_CONFIG_KEYS) | set(UNDECLARED_CONFIG_KEYS)
    stored = hf_config.to_dict()
    unknown = sorted(key for key in given if key not in known and key in stored)
    if unknown:
        hints = [f"{key} -> {' or '.join(difflib.get_close_matches(key, known, n=2)) or '?'}" for key in unknown]
        raise ValueError(
            f"model_config has unknown key(s) {unknown} for model_type={hf_config.model_type!r} ({cls.__name__} "
            f"does not define them, so they would be ignored). Close matches: {'; '.join(hints)}."
        )


def require_exactly_one(first: tuple[str, Any, str], second: tuple[str, Any, str]) -> None:
    """Raise a ValueError naming both options unless exactly one of two ``(name, value, what it is)`` is given."""
    (name_a, value_a, what_a), (name_b, value_b, what_b) = first, second
    if (value_a is None) == (value_b is None):
        raise ValueError(f"Give exactly one of {name_a}={value_a!r} ({what_a}) or {name_b}={value_b!r} ({what_b}).")


def saved_model_type(path: str | os.PathLike, expected: str, what: str, fix: str) -> None:
    """Raise unless ``path`` holds a transformers config of ``model_type == expected``: an OSError when it cannot be
    read (``fix``: what to pass instead), a ValueError naming the model type found and ``what`` was expected."""
    try:
        model_type = AutoConfig.from_pretrained(path).model_type
    except OSError as err:
        raise OSError(f"Could not load {what} from {str(path)!r}: {fix} Cause: {err}") from err
    if model_type != expected:
        raise ValueError(f"{str(path)!r} is a {model_type!r} model, not {what} ({expected!r}). {fix}")


def load_causal_lm(
    pretrained: str | None = None,
    config: dict[str, Any] | None = None,
    *,
    trust_remote_code: bool = False,
    torch_dtype: str | None = None,
    attn_implementation: str | None = None,
    gguf_file: str | None = None,
) -> PreTrainedModel:
    """Build a transformers causal LM from ``pretrained`` (hub id or local path) or from ``config``.

    ``config`` is a dict with ``model_type`` plus the sizes, e.g.
    ``{"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, ...}``; the model is
    randomly initialised; keys the model type's config does not define (typos) are rejected. Exactly one
    of the two must be given.

    ``gguf_file``: the name of a GGUF file in ``pretrained`` (the folder or hub id holding it), read by transformers'
    GGUF loader (:func:`~lit_dllm.hub.gguf.load_gguf_model`: packages, file and architecture checked first). Its
    weights are dequantized into a plain, trainable model (in ``torch_dtype``; default float32) that
    ``save_pretrained`` writes as a Hugging Face folder.
    """
    require_exactly_one(("pretrained", pretrained, HUB_OR_PATH), ("config", config, RANDOM_INIT))
    if gguf_file is not None:
        if pretrained is None:
            raise ValueError(f"gguf_file={gguf_file!r} needs pretrained: the folder (or hub id) that holds it.")
        return load_gguf_model(pretrained, gguf_file, torch_dtype, trust_remote_code, attn_implementation)
    dtype = getattr(torch, torch_dtype) if torch_dtype else None
    kwargs: dict[str, Any] = {"trust_remote_code": trust_remote_code}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    if config is not None:
        config = dict(config)
        model_type = config.pop("model_type", None)
        if model_type is None:
            raise ValueError(f"config={config!r} has no 'model_type'; add one, e.g. model_type: llama.")
        hf_config = AutoConfig.for_model(model_type, **config)
        check_config_keys(hf_config, config)
        if dtype is not None:
            kwargs["dtype"] = dtype
        return AutoModelForCausalLM.from_config(hf_config, **kwargs)
    try:
        return AutoModelForCausalLM.from_pretrained(pretrained, dtype=dtype, **kwargs)
    except OSError as err:
        offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False")
        hint = " The hub is not reachable (HF_HUB_OFFLINE is set)." if offline else ""
        raise OSError(
            f"Could not load model {pretrained!r}.{hint} Pass a local directory that holds "
            f"config.json and the weights (for example one written by save_pretrained), or a "
            f"'config' dict for a randomly initialised model. Cause: {err}"
        ) from err


def grow_embeddings(hf_model: PreTrainedModel, vocab_size: int, multiple_of: int | None = None) -> None:
    """Grow ``hf_model``'s input embeddings (and an untied LM head) to ``vocab_size`` rows, rounded up to
    ``multiple_of``; every new row (and head bias) starts at the mean of the existing ones, so the added tokens begin
    as an average token, deterministically. ``config.vocab_size`` follows, so an export records the new size."""
    old = hf_model.get_input_embeddings().weight.shape[0]
    hf_model.resize_token_embeddings(vocab_size, pad_to_multiple_of=multiple_of, mean_resizing=False)
    layers = [hf_model.get_input_embeddings(), hf_model.get_output_embeddings()]
    with torch.no_grad():
        for param in {id(p): p for layer in layers if layer is not None for p in (layer.weight, getattr(layer, "bias", None))
                      if p is not None}.values():
            param[old:] = param[:old].float().mean(0).to(param.dtype)


def check_flex_training(model: torch.nn.Module, requested: str | None, device: torch.device) -> None:
    """Before a fit: the trainable transformers models of ``model`` that attend with ``flex_attention`` (in their
    config, or ``requested`` for all of them) need a CUDA device and heads of >= :data:`FLEX_MIN_HEAD_DIM` dims; a
    ValueError naming the fix otherwise (instead of torch's error at the first backward or inductor's at compile)."""
    trained = [module for module in model.modules() if isinstance(module, PreTrainedModel)
               and any(p.requires_grad for p in module.parameters())]
    flex = [module for module in trained if "flex_attention" in (requested, compat.attn_implementation(module.config))]
    if not flex:
        return
    if device.type != "cuda":
        raise ValueError(
            f"attn_implementation='flex_attention' trains on CUDA GPUs only (torch's FlexAttention has no backward on "
            f"{device.type}): set attn_implementation: sdpa for this run (the checkpoint loads with either)."
        )
    heads = {layer.head_dim for module in flex for layer in module.modules()  # the trained attention layers' (a
             if isinstance(getattr(layer, "head_dim", None), int)  # config's head_dim may vary by layer)
             and any(p.requires_grad for p in layer.parameters())}
    small = sorted(dim for dim in heads if dim < FLEX_MIN_HEAD_DIM)
    if small:
        raise ValueError(
            f"attn_implementation='flex_attention' needs heads of at least {FLEX_MIN_HEAD_DIM} dims on CUDA "
            f"(FlexAttention's Triton kernels), but this model has heads of {small}: set attn_implementation: sdpa, or "
            f"head_dim >= {FLEX_MIN_HEAD_DIM}."
        )
