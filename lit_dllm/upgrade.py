"""Every conversion from lit_dllm's earlier layouts (0.1's module paths, flat settings, run settings on the module, the
data module's flat arguments) to today's, in one leaf file (it imports ``settings`` and ``compat`` only). **Removed in
lit_dllm 0.3**: ``git rm -r lit_dllm/upgrade.py tests/upgrade``, then delete the lines that import from it and undo
their calls:

- ``cli``: ``upgrade_hparams(saved, ...)`` becomes ``saved``, ``current_class_path(saved_class)`` ``saved_class``, and
  the hints of a config that does not parse lose ``*layout_hints(...)``;
- ``core/token_loss``: ``group_flat_settings(self, flat)`` and ``**flat`` go (a flat or unknown setting is then
  Python's ``TypeError``), as does ``load_from_checkpoint``'s ``converting_checkpoints(current_checkpoint ...)``;
- ``families/dflash/module``: ``flat_target(target, kwargs)`` becomes ``target``;
- ``data/datamodule``: ``grouped_data_settings(...)``, ``**flat`` and ``load_from_checkpoint`` go;
- ``eval/harness``: ``current_class_path(name)`` becomes ``name``;
- ``tests/test_strategies.py``: ``RUN_SETTINGS`` becomes ``Parallelism``'s field names;
- ``pyproject.toml``: the ``filterwarnings`` line that makes the flat spellings' ``DeprecationWarning`` an error.

No other test spells a setting flat (that error fails any that does); ``tests/upgrade`` alone does, on purpose.

What it converts:

- **Module paths** before ``core/`` + ``families/`` (``lit_dllm.modules.dflash.DFlashModule``): :data:`MOVED_MODULES`.
- **Flat settings** before the groups (``gen_length``, ``model_config``, ``lr``...): moved into the group that holds
  them, a module's (:func:`group_flat_settings`, called once, from ``TokenLossModule``) or a checkpoint's
  (:func:`upgrade_hparams`).
- **The tokenizer** as four flat settings (``tokenizer``, ``mask_token``, ``tokenizer_gguf_file``,
  ``trust_remote_code``): one :class:`~lit_dllm.settings.Tokenizer` group, ``tokenizer_settings``.
- **DFlash's target** as flat settings (``target`` as a name, ``target_config``, ``target_gguf_file``, ``torch_dtype``):
  one :class:`~lit_dllm.settings.CausalBackbone` group, like every backbone.
- **The data module's flat arguments** (``data``, ``batch_size``, ``tokenizer`` as a name...): its groups
  (:data:`FLAT_DATA_SETTINGS`, :func:`grouped_data_settings`, :func:`current_data_checkpoint`).
- **Run settings on the module** (``compile``, ``fp8``, ``fsdp_*``, ``experts_implementation``,
  ``backbone.activation_checkpointing``): the strategy's now (:class:`~lit_dllm.settings.Parallelism`); a checkpoint's
  are dropped (it resumes under the strategy's), a config that sets them stops with :func:`run_settings_hint`.
- **The CLI's hints** for a config written in an earlier layout (:func:`layout_hints`).
"""

from __future__ import annotations

import inspect
import os
import pydoc
import sys
import warnings
from dataclasses import fields, is_dataclass
from typing import Any

from lit_dllm import compat
from lit_dllm.settings import CausalBackbone, Parallelism, Settings, Tokenizer, settings_group, settings_groups

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


def flat_groups(cls: type, flat: dict[str, Any], groups: set[str] | None = None) -> dict[str, dict[str, Any]]:
    """The flat settings in ``flat`` (popped) that a group of ``cls``'s constructor (:func:`settings_groups`) now holds,
    by group: argument -> {field: value}. The tokenizer's are its flat names (:data:`TOKENIZER_SETTINGS`), every other
    group's its field names; ``groups`` (None: all) limits the groups."""
    moved = {}
    for name, kind in settings_groups(cls).items():
        if groups is not None and name not in groups:
            continue
        names = TOKENIZER_SETTINGS if kind is Tokenizer else {field.name: field.name for field in fields(kind)}
        found = {field: flat.pop(old) for old, field in names.items() if old in flat}
        if found:
            moved[name] = found
    return moved


def group_flat_settings(module: Any, flat: dict[str, Any]) -> None:
    """Move the keyword arguments of the earlier flat signatures (``MDLMModule(gen_length=10, model_config={...})``,
    ``lr=...``, ``tokenizer="gpt2"``), which every module passes on to ``TokenLossModule``'s ``**flat``, into
    ``module``'s groups (each an attribute named as its argument, built from the argument before; a group not built
    yet takes none): each group is rebuilt with them over its fields, and checked, with a ``DeprecationWarning``
    naming the grouped spelling (pointing at the first caller outside lit_dllm). Run settings (``compile``, ``fp8``,
    ``fsdp_*``...) are a ``TypeError`` naming their place on the strategy, any other name one naming the class."""
    run = [name for name in RUN_SETTINGS if name in flat]
    if run:
        raise TypeError(run_settings_hint(run))
    groups = settings_groups(type(module))
    built = {name for name, kind in groups.items() if isinstance(getattr(module, name, None), kind)}
    for name, moved in flat_groups(type(module), flat, built).items():
        kind, current = groups[name], getattr(module, name)
        olds = list(moved) if kind is not Tokenizer else [old for old, field in TOKENIZER_SETTINGS.items()
                                                           if field in moved]
        config = "data.init_args.tokenizer" if kind is Tokenizer else f"model.init_args.{name}"
        _warn_caller(f"{', '.join(olds)}: flat settings are deprecated; pass them grouped, as {name}={kind.__name__}("
                     f"{', '.join(f'{key}=...' for key in moved)}) (a config: {config}.{next(iter(moved))}).")
        setattr(module, name, settings_group(name, kind, {**_values(current), **moved}))
    if flat:
        raise TypeError(f"{type(module).__name__} got unexpected settings {sorted(flat)}: see its docstring (or "
                        "`python train.py fit --help`) for the settings and their groups.")


def _values(group: Settings | dict | None) -> dict[str, Any]:
    """The fields of ``group`` (a group, a dict of its fields, or None: none)."""
    if is_dataclass(group):
        return {field.name: getattr(group, field.name) for field in fields(group)}
    return dict(group or {})


def _warn_caller(message: str) -> None:
    """A ``DeprecationWarning`` pointing at the first caller outside lit_dllm (a module's constructor calls it through
    its bases')."""
    package, frame, level = os.path.dirname(os.path.abspath(__file__)) + os.sep, sys._getframe(1), 2
    while frame is not None and frame.f_code.co_filename.startswith(package):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, DeprecationWarning, stacklevel=level)


TARGET_SETTINGS = {"target_config": "model_config", "target_gguf_file": "gguf_file", "torch_dtype": "torch_dtype"}
"""DFlash's flat target settings and their field of the ``target`` group (``target`` itself: ``model``)."""


def flat_target(target: Any, flat: dict[str, Any]) -> Any:
    """DFlash's ``target`` group: ``target`` as given, or, when it is a name (or None beside flat target settings),
    the group of the flat settings in ``flat`` (popped, with a ``DeprecationWarning``)."""
    unset = target is None or target == CausalBackbone()
    if not (isinstance(target, str) or (unset and set(TARGET_SETTINGS) & set(flat))):
        return target
    group = {"model": None if unset else target, **{field: flat.pop(name) for name, field in TARGET_SETTINGS.items() if name in flat}}
    _warn_caller(f"DFlash's flat target settings are deprecated; pass them grouped, as target=CausalBackbone("
                 f"{', '.join(f'{key}=...' for key in group)}) (a config: model.init_args.target.model).")
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
    groups = settings_groups(cls)
    if "target" in groups:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # a checkpoint's layout, not the user's spelling
            saved["target"] = flat_target(saved.get("target"), saved)
    moved = flat_groups(cls, saved)
    for name, kind in groups.items():
        saved[name] = settings_group(name, kind, {**_values(saved.get(name)), **moved.get(name, {})}).saved()
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


# ---------------------------------------------------------------------------- the data module's flat arguments

FLAT_DATA_SETTINGS: dict[str, tuple[str, str]] = {
    "data": ("source", "path"), "data_config": ("source", "config"), "format": ("source", "format"),
    "prompt_field": ("source", "prompt_field"), "response_field": ("source", "response_field"),
    "messages_field": ("source", "messages_field"), "text_field": ("source", "text_field"),
    "cache_dir": ("source", "cache_dir"),
    "tokenizer": ("tokenizer", "name"), "mask_token": ("tokenizer", "mask_token"),
    "tokenizer_gguf_file": ("tokenizer", "gguf_file"), "trust_remote_code": ("tokenizer", "trust_remote_code"),
    "mask_history": ("formatting", "mask_history"), "use_chat_template": ("formatting", "use_chat_template"),
    "pack_text": ("formatting", "pack_text"), "overlong": ("formatting", "overlong"),
    "pad_block_size": ("collation", "pad_block_size"), "pad_seq_len_divisible": ("collation", "pad_seq_len_divisible"),
    "response_window": ("collation", "response_window"), "supervise_padding": ("collation", "supervise_padding"),
    "batch_size": ("loader", "batch_size"), "val_batch_size": ("loader", "val_batch_size"),
    "num_workers": ("loader", "num_workers"), "group_by_length": ("loader", "group_by_length"),
    "drop_last": ("loader", "drop_last"),
    "train_split": ("splits", "train"), "val_split": ("splits", "val"), "test_split": ("splits", "test"),
    "val_fraction": ("splits", "val_fraction"), "max_train_examples": ("splits", "max_train_examples"),
    "max_val_examples": ("splits", "max_val_examples"), "max_test_examples": ("splits", "max_test_examples"),
    "task_num_train": ("task", "num_train"), "task_num_val": ("task", "num_val"), "task_kwargs": ("task", "kwargs"),
}
"""Each flat argument of the data module's earlier signature (before its settings groups; ``max_seq_len`` and ``seed``
stay flat) and its (group, field). Checkpoints of that layout hold them as their ``datamodule_hyper_parameters``."""


def grouped_data_settings(given: dict[str, Any], flat: dict[str, Any], groups: dict[str, type[Settings]],
                          warn: bool = True) -> dict[str, Any]:
    """The data module's group arguments ``given`` (each a group, a dict of its fields, or None) with the arguments of
    its earlier flat signature in ``flat`` moved in (a dict per group then), with a ``DeprecationWarning`` naming the
    grouped spelling unless ``warn`` is False. ``source`` and ``tokenizer`` given as a string are the earlier ``data``
    and ``tokenizer`` (a name). Any other name in ``flat`` is a ``TypeError``."""
    flat, given = dict(flat), dict(given)
    for name, old in (("source", "data"), ("tokenizer", "tokenizer")):
        if isinstance(given[name], str):
            if old in flat:
                raise TypeError(f"DLLMDataModule got both {name}={given[name]!r} and {old}={flat[old]!r}.")
            flat, given[name] = {old: given[name], **flat}, None  # the earlier first argument comes first
    unknown = sorted(set(flat) - set(FLAT_DATA_SETTINGS))
    if unknown:
        raise TypeError(f"DLLMDataModule got unexpected settings {unknown}: see its docstring (or `python train.py fit "
                        "--data.help lit_dllm.DLLMDataModule`) for the settings and their groups.")
    if not flat:
        return given
    if warn:
        spelled = ", ".join(f"{old} -> data.init_args.{'.'.join(FLAT_DATA_SETTINGS[old])}" for old in flat)
        group, field = FLAT_DATA_SETTINGS[next(iter(flat))]
        warnings.warn(f"{', '.join(flat)}: the data module's flat settings are deprecated; pass them grouped ({spelled}; "
                      f"in Python {group}={groups[group].__name__}({field}=...)).", DeprecationWarning, stacklevel=3)
    for old, value in flat.items():
        group, field = FLAT_DATA_SETTINGS[old]
        current = given[group]
        values = dict(current) if isinstance(current, dict) else {} if current is None else \
            {each.name: getattr(current, each.name) for each in fields(current)}
        given[group] = {**values, field: value}
    return given


def current_data_checkpoint(checkpoint: dict, groups: dict[str, type[Settings]]) -> dict:
    """A data module's checkpoint (as loaded) with ``datamodule_hyper_parameters`` of the earlier flat layout moved into
    today's groups, in place, without a warning (the checkpoint's layout, not the user's spelling)."""
    saved = checkpoint.get("datamodule_hyper_parameters")
    if not isinstance(saved, dict):
        return checkpoint
    flat = {key: value for key, value in saved.items()
            if key in FLAT_DATA_SETTINGS and not (key in groups and isinstance(value, dict))}
    if flat:
        given = {name: saved.get(name) if isinstance(saved.get(name), dict) else None for name in groups}
        moved = grouped_data_settings(given, flat, groups, warn=False)
        kept = {key: value for key, value in saved.items() if key not in flat}
        checkpoint["datamodule_hyper_parameters"] = {**kept, **{name: moved[name] or {} for name in groups}}
    return checkpoint


# ---------------------------------------------------------------------------- the CLI's hints


def layout_hints(model_written: set[str], data_written: dict[str, Any], modules: list[type]) -> list[str]:
    """For a config that does not parse: how today's layout spells what it wrote in an earlier one. ``model_written``:
    the model settings it wrote (``backbone`` fields dotted, ``backbone.activation_checkpointing``); ``data_written``:
    the data settings it wrote, with their values; ``modules``: the exported module classes."""
    return [hint for hint in (_run_settings_hint(model_written), _flat_model_hint(model_written, modules),
                              _flat_data_hint(data_written)) if hint]


def _run_settings_hint(written: set[str]) -> str | None:
    run = sorted(name for name in written if name in RUN_SETTINGS or name == "backbone.activation_checkpointing")
    return run_settings_hint(run) if run else None


def _flat_model_hint(written: set[str], modules: list[type]) -> str | None:
    """The model settings written flat (``gen_length``) that a group now holds, with their grouped spelling. Names that
    a module still takes flat (DFlash's ``torch_dtype``) are left out."""
    taken_flat = {name for cls in modules for name in inspect.signature(cls.__init__).parameters}
    grouped = {field.name: group for cls in modules for group, kind in settings_groups(cls).items()
               for field in fields(kind) if field.name not in taken_flat}
    flat = sorted(name for name in written if name in grouped)
    if not flat:
        return None
    return ("The model's settings now come in groups: write " + ", ".join(f"{grouped[name]}.{name}" for name in flat)
            + f" (in a config: model.init_args.{grouped[flat[0]]}: {{{flat[0]}: ...}}) instead of "
            + ", ".join(flat) + "; docs/settings.md.")


def _flat_data_hint(written: dict[str, Any]) -> str | None:
    """The data module's settings written flat (``batch_size``, ``tokenizer: gpt2``), with their grouped spelling."""
    # a group's name (tokenizer) is a flat setting only when it holds a value of its own (a name), not the group
    flat = sorted(name for name, value in written.items() if name in FLAT_DATA_SETTINGS and (
        name != "tokenizer" or (isinstance(value, str) and not value.lstrip().startswith("{"))))
    if not flat:
        return None
    spelled = [".".join(FLAT_DATA_SETTINGS[name]) for name in flat]
    group, field = FLAT_DATA_SETTINGS[flat[0]]
    return (f"The data module's settings now come in groups: write {', '.join(spelled)} (in a config: "
            f"data.init_args.{group}: {{{field}: ...}}) instead of {', '.join(flat)}; docs/settings.md.")
