"""Checkpoints and settings of earlier layouts, brought to today's in one place; all of it goes in lit_dllm 0.3.

- **Module paths** before ``core/`` + ``families/`` (``lit_dllm.modules.dflash.DFlashModule``): :data:`MOVED_MODULES`.
- **Flat settings** before the groups (``gen_length``, ``model_config``, ``lr``...): moved into their group.
- **The tokenizer** as four flat settings (``tokenizer``, ``mask_token``, ``tokenizer_gguf_file``,
  ``trust_remote_code``): one :class:`~lit_dllm.settings.Tokenizer` group, ``tokenizer_settings``.
- **DFlash's target** as flat settings (``target`` as a name, ``target_config``, ``target_gguf_file``, ``torch_dtype``):
  one :class:`~lit_dllm.settings.CausalBackbone` group, like every backbone.
- **The data module's flat settings** (``data``, ``batch_size``, ``tokenizer`` as a name...): its groups. The data
  module sits below ``core``, so its table and its ``load_from_checkpoint`` are its own
  (:data:`lit_dllm.data.datamodule.FLAT_SETTINGS`), and go with this file.
- **Run settings on the module** (``compile``, ``fp8``, ``fsdp_*``, ``experts_implementation``,
  ``backbone.activation_checkpointing``): the strategy's now (:class:`~lit_dllm.settings.Parallelism`); a checkpoint's
  are dropped (it resumes under the strategy's), a config that sets them stops with :func:`run_settings_hint`.
"""

from __future__ import annotations

import pydoc
import warnings
from typing import Any

from lit_dllm import compat
from lit_dllm.settings import CausalBackbone, Parallelism, settings_group, settings_groups

MOVED_MODULES = {
    "lit_dllm.modules.token_loss": "lit_dllm.core.token_loss",
    "lit_dllm.modules.base": "lit_dllm.core.base",
    "lit_dllm.modules.generation": "lit_dllm.core.generation",
    "lit_dllm.modules.optim": "lit_dllm.core.optim",
    "lit_dllm.modules.backbone": "lit_dllm.core.build_backbone",
    "lit_dllm.models.backbone": "lit_dllm.core.backbone",
    "lit_dllm.models.hf": "lit_dllm.hub.hf",
    "lit_dllm.models.gguf": "lit_dllm.hub.gguf",
    "lit_dllm.modules.mdlm": "lit_dllm.families.mdlm.module",
    "lit_dllm.models.diffusion_lm": "lit_dllm.families.mdlm.model",
    "lit_dllm.sampling.llada": "lit_dllm.families.mdlm.sampler",
    "lit_dllm.sampling.fast": "lit_dllm.families.mdlm.fast_sampler",
    "lit_dllm.modules.causal_lm": "lit_dllm.families.causal_lm.module",
    "lit_dllm.models.causal_lm": "lit_dllm.families.causal_lm.model",
    "lit_dllm.modules.dflash": "lit_dllm.families.dflash.module",
    "lit_dllm.models.dflash": "lit_dllm.families.dflash.model",
    "lit_dllm.modules.diffusion_gemma": "lit_dllm.families.diffusion_gemma.module",
    "lit_dllm.models.diffusion_gemma": "lit_dllm.families.diffusion_gemma.model",
}
"""Each module of the layout before ``lit_dllm/core`` + ``lit_dllm/families`` and where it went. ``train.py`` records
a run's module class among its checkpoint's hyper-parameters as its config named it (``_class_path``)."""

MOVED_CLASSES = {
    "lit_dllm.rl.module.DiffuGRPOModule": "lit_dllm.families.mdlm.grpo.DiffuGRPOModule",
    "lit_dllm.rl.module.CausalGRPOModule": "lit_dllm.families.causal_lm.grpo.CausalGRPOModule",
}
"""Classes whose module split in two (the RL modules went to their families' folders, 0.2); remove with
:data:`MOVED_MODULES`."""

RUN_SETTINGS = tuple(field for field in Parallelism.__dataclass_fields__)
"""The module settings that moved to the strategy's :class:`~lit_dllm.settings.Parallelism` group."""

TOKENIZER_SETTINGS = {"tokenizer": "name", "mask_token": "mask_token", "tokenizer_gguf_file": "gguf_file",
                      "trust_remote_code": "trust_remote_code"}
"""The flat tokenizer settings and their field of the ``tokenizer_settings`` group."""


def current_class_path(class_path: str | None) -> str | None:
    """``class_path`` with a module of the earlier layout replaced by where it went; any other path (None too) as it
    is."""
    if class_path is None:
        return None
    if class_path in MOVED_CLASSES:
        return MOVED_CLASSES[class_path]
    module, _, name = class_path.rpartition(".")
    return f"{MOVED_MODULES[module]}.{name}" if module in MOVED_MODULES else class_path


def run_settings_hint(names: list[str]) -> str:
    """Where the run settings ``names`` (written on the model) go now."""
    spelled = ", ".join(f"trainer.strategy.init_args.parallelism.{name.rpartition('.')[2]}" for name in names)
    return (f"{', '.join(names)} now belong to the strategy (how to run, not what to learn): write {spelled}, with "
            "trainer.strategy.class_path: lit_dllm.SingleDeviceStrategy (one device) or lit_dllm.ExpertParallelStrategy "
            "(FSDP2, expert parallelism); docs/settings.md.")


def flat_tokenizer(flat: dict[str, Any]) -> dict[str, Any] | None:
    """The ``tokenizer_settings`` group of the flat settings in ``flat`` (popped; None when it holds none):
    ``tokenizer`` (a name), ``mask_token``, ``tokenizer_gguf_file``, ``trust_remote_code``."""
    if not set(TOKENIZER_SETTINGS) & set(flat):
        return None
    return {field: flat.pop(name) for name, field in TOKENIZER_SETTINGS.items() if name in flat}


TARGET_SETTINGS = {"target_config": "model_config", "target_gguf_file": "gguf_file", "torch_dtype": "torch_dtype"}
"""DFlash's flat target settings and their field of the ``target`` group (``target`` itself: ``model``)."""


def flat_target(target: Any, flat: dict[str, Any]) -> Any:
    """DFlash's ``target`` group: ``target`` as given, or, when it is a name (or None beside flat target settings),
    the group of the flat settings in ``flat`` (popped, with a ``DeprecationWarning``)."""
    unset = target is None or target == CausalBackbone()
    if not (isinstance(target, str) or (unset and set(TARGET_SETTINGS) & set(flat))):
        return target
    group = {"model": None if unset else target, **{field: flat.pop(name) for name, field in TARGET_SETTINGS.items() if name in flat}}
    warnings.warn(f"DFlash's flat target settings are deprecated; pass them grouped, as target=CausalBackbone("
                  f"{', '.join(f'{key}=...' for key in group)}) (a config: model.init_args.target.model).",
                  DeprecationWarning, stacklevel=3)
    return group


def upgrade_hparams(saved: dict[str, Any], cls: type) -> dict[str, Any]:
    """A checkpoint's hyper-parameters in today's layout (for ``cls``): flat settings in their groups, the tokenizer
    as one group, run settings dropped (with a note: the strategy's apply)."""
    saved = dict(saved)
    backbone = saved.get("backbone")
    run = {name: saved.pop(name) for name in RUN_SETTINGS if name in saved}
    defaults = Parallelism()
    dropped = [f"{name}={value!r}" for name, value in run.items() if value != getattr(defaults, name)]
    if isinstance(backbone, dict) and "activation_checkpointing" in backbone:
        saved["backbone"] = {k: v for k, v in backbone.items() if k != "activation_checkpointing"}
        if backbone["activation_checkpointing"]:
            dropped.append("backbone.activation_checkpointing=True")
    if dropped:
        warnings.warn(f"This checkpoint records run settings on the module ({', '.join(dropped)}); they are the "
                      "strategy's now, and this run uses its strategy's (trainer.strategy.init_args.parallelism).",
                      UserWarning, stacklevel=2)
    tokenizer = flat_tokenizer(saved)
    if tokenizer is not None:
        saved["tokenizer_settings"] = tokenizer
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # a checkpoint's layout, not the user's spelling
        if "target" in settings_groups(cls):
            saved["target"] = flat_target(saved.get("target"), saved)
        for name, kind in settings_groups(cls).items():
            saved[name] = settings_group(name, kind, saved.get(name), saved).saved()
    return saved


def current_checkpoint(checkpoint: dict, cls: type, class_path: str | None = None) -> dict:
    """``checkpoint`` (as loaded) brought to today's layout, in place: unless ``class_path`` names the module class,
    a class recorded by a path of the earlier layout becomes today's (:func:`current_class_path`), and its
    hyper-parameters go through :func:`upgrade_hparams` (for that class; ``cls`` when it is not found)."""
    saved = checkpoint.get("hyper_parameters")
    if not isinstance(saved, dict):
        return checkpoint
    if class_path is None and compat.CLASS_PATH_KEY in saved:
        saved[compat.CLASS_PATH_KEY] = current_class_path(saved[compat.CLASS_PATH_KEY])
    named = class_path or saved.get(compat.CLASS_PATH_KEY)
    checkpoint["hyper_parameters"] = upgrade_hparams(saved, (named and pydoc.locate(current_class_path(named))) or cls)
    return checkpoint
