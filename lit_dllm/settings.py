"""Declared, typed groups of the settings several families share: where the backbone comes from (:class:`Backbone`,
:class:`CausalBackbone`) and how answers are generated (:class:`Generation`, :class:`DenoisingGeneration`; a family
with more knobs subclasses them beside its module).

A module takes each group as one argument (``MDLMModule(..., generation=LLaDAGeneration(gen_length=10))``; in a
config ``model.init_args.generation.gen_length``, grouped in ``--help``); its hyper-parameters, and so its checkpoints,
hold the group as a dict, and its mixins read the typed group (``self.generation``). The flat keyword arguments of the
earlier signatures (``gen_length=10``, ``model_config={...}``), and checkpoints that hold them, are moved into their
group by :func:`settings_group`, with a ``DeprecationWarning`` that names the grouped spelling.
"""

from __future__ import annotations

import functools
import re
import typing
import warnings
from dataclasses import asdict, dataclass, fields, is_dataclass
from typing import Any

__all__ = ["Backbone", "CausalBackbone", "DenoisingGeneration", "Generation", "Settings", "check_positive_or_none",
           "grouped_settings", "settings_group", "settings_groups"]


def check_positive_or_none(settings, defaults: dict[str, str]) -> None:
    """Raise a ``ValueError`` unless each named setting of ``settings`` is a positive int or None (``defaults`` says
    what None means)."""
    for name, default in defaults.items():
        value = getattr(settings, name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
            raise ValueError(f"{name}={value!r} must be a positive int, or None ({default}).")


@dataclass(frozen=True)
class Settings:
    """Base of the settings groups: :meth:`check` raises a ``ValueError`` naming the first bad value and its fix."""

    def check(self) -> None:
        pass


@dataclass(frozen=True)
class Backbone(Settings):
    """Where a family's transformers stack comes from, and how it is loaded.

    Attributes:
        model: hub id or local path of a pretrained model (``from_pretrained``).
        model_config: instead of ``model``, a dict with ``model_type`` and sizes for random init; the family fills
            the tokenizer's ``vocab_size`` (and special ids) where it leaves them out.
        torch_dtype: dtype the weights are loaded in (e.g. ``bfloat16``; None: transformers' default).
        attn_implementation: transformers' attention (``sdpa``, ``eager``, ``flex_attention``, ...).
    """

    model: str | None = None
    model_config: dict[str, Any] | None = None
    torch_dtype: str | None = None
    attn_implementation: str | None = "sdpa"


@dataclass(frozen=True)
class CausalBackbone(Backbone):
    """A :class:`Backbone` that is any transformers causal-LM stack (the MDLM, hybrid and causal-LM families:
    :func:`~lit_dllm.core.build_backbone.build_backbone`).

    Attributes:
        gguf_file: the name of a GGUF file in ``model`` (the folder or hub id holding it), e.g.
            ``SmolLM2-135M-Instruct.Q4_1.gguf``, loaded by transformers' GGUF reader and dequantized (needs
            ``pip install 'lit_dllm[real]'``).
        pad_vocab_multiple_of: when the tokenizer has more tokens than a pretrained ``model`` has embedding rows (an
            added mask or pad token), the embeddings (and an untied head) grow to cover them, rounded up to this
            multiple (None: exactly); new rows start at the mean embedding.
        activation_checkpointing: recompute each transformer block in backward (transformers' gradient checkpointing,
            non-reentrant, so it composes with FSDP2).
    """

    gguf_file: str | None = None
    pad_vocab_multiple_of: int | None = None
    activation_checkpointing: bool = False


@dataclass(frozen=True)
class Generation(Settings):
    """How a family answers prompts (:class:`~lit_dllm.core.generation.GenerationMixin`: ``generate``, ``predict``
    and exact-match validation).

    Attributes:
        gen_length: new tokens at most per answer (None: the reference answer's length + 1 in evaluation, else 64).
        temperature: 0 decodes greedily; > 0 samples at this temperature.
        val_generate_batches: validation / test batches per pass whose prompts are answered and scored into
            ``exact_match`` (0 disables).
        answer_pattern: regex whose first capture group (first match, stripped) is the answer, e.g. GSM8K's
            ``"#### (\\S+)"``; exact match then compares the answers extracted from the generation and the reference
            (no match scores 0; a reference without one also warns, once). Empty: compare the whole decoded answers.
            Typed ``str`` on purpose: jsonargparse would read a ``str | None`` value starting with ``#`` as a YAML
            comment, i.e. None.
    """

    gen_length: int | None = None
    temperature: float = 0.0
    val_generate_batches: int = 1
    answer_pattern: str = ""

    def check(self) -> None:
        check_positive_or_none(self, {"gen_length": "the reference answer's length"})
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0 (0: greedy).")
        if self.val_generate_batches < 0:
            raise ValueError(f"val_generate_batches={self.val_generate_batches} must be >= 0 (0: no generation).")
        if self.answer_pattern:
            try:
                groups = re.compile(self.answer_pattern).groups
            except re.error as err:
                raise ValueError(
                    f"answer_pattern={self.answer_pattern!r} is not a valid regular expression: {err}."
                ) from err
            if groups == 0:
                raise ValueError(
                    f"answer_pattern={self.answer_pattern!r} has no capture group: put the answer in parentheses, "
                    r"e.g. '#### (\S+)'."
                )


@dataclass(frozen=True)
class DenoisingGeneration(Generation):
    """:class:`Generation` of a diffusion family, which denoises each answer in steps.

    Attributes:
        gen_steps: denoising steps per answer (None: the family's default: LLaDA sampling commits one token per
            step; DiffusionGemma takes transformers' ``max_denoising_steps``).
    """

    gen_steps: int | None = None

    def check(self) -> None:
        super().check()
        check_positive_or_none(self, {"gen_steps": "one token per step with LLaDA sampling, transformers' default with "
                                                   "DiffusionGemma"})


def settings_group(name: str, kind: type[Settings], given: Settings | dict | None, flat: dict[str, Any]) -> dict:
    """The ``kind`` group of the argument ``name``, checked, as the dict of all its fields that the hyper-parameters
    hold (checkpoints load it with ``weights_only``): ``given`` (a group, a dict of its fields, or None: the defaults)
    with the entries of ``flat`` (keyword arguments or a checkpoint's hyper-parameters) that name its fields moved in
    (popped from ``flat``; a ``DeprecationWarning`` names the grouped spelling)."""
    moved = {field.name: flat.pop(field.name) for field in fields(kind) if field.name in flat}
    if moved:
        warnings.warn(
            f"{', '.join(moved)}: flat settings are deprecated; pass them grouped, as {name}={kind.__name__}("
            f"{', '.join(f'{key}=...' for key in moved)}) (a config: model.init_args.{name}.{next(iter(moved))}).",
            DeprecationWarning,
            stacklevel=3,
        )
    values = asdict(given) if is_dataclass(given) else dict(given or {})
    group = kind(**{**values, **moved})
    group.check()
    return asdict(group)


def grouped_settings(hparams: dict[str, Any], cls: type) -> dict[str, Any]:
    """``hparams`` (a module's hyper-parameters) with each of ``cls``'s settings groups as a dict of all its fields,
    the flat settings it declares moved in (:func:`settings_group`): a checkpoint's, written before the groups."""
    hparams = dict(hparams)
    for name, kind in settings_groups(cls).items():
        hparams[name] = settings_group(name, kind, hparams.get(name), hparams)
    return hparams


@functools.cache
def settings_groups(cls: type) -> dict[str, type[Settings]]:
    """The settings groups that ``cls``'s constructor (or a base's) takes: argument name -> group class."""
    groups = {}
    for klass in reversed(cls.__mro__):
        try:
            hints = typing.get_type_hints(vars(klass)["__init__"])
        except (KeyError, NameError, TypeError):  # no constructor of its own, or annotations that do not resolve
            continue
        for arg, hint in hints.items():
            if isinstance(hint, type) and issubclass(hint, Settings):
                groups[arg] = hint
    return groups
