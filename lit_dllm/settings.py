"""Declared, typed groups of settings, each owned by whoever reads it.

What to learn is the module's: where the backbone comes from (:class:`Backbone`, :class:`CausalBackbone`), how it
is optimised (:class:`Optimization`), which tokenizer it speaks (:class:`Tokenizer`, linked from the data module) and
how answers are generated (:class:`Generation`, :class:`DenoisingGeneration`; a family with more knobs subclasses
them beside its module). How to run is the strategy's (:class:`Parallelism`, on :mod:`lit_dllm.strategies`), so
checkpoints hold no machine layout.

A module takes each group as one argument (``MDLMModule(..., generation=LLaDAGeneration(gen_length=10))``; in a
config ``model.init_args.generation.gen_length``, grouped in ``--help``), keeps it as an attribute
(``self.generation``) and saves it explicitly (:meth:`Settings.saved`: its hyper-parameters, and so its checkpoints,
hold the group as a dict). The flat keyword arguments of the earlier signatures (``gen_length=10``,
``model_config={...}``) are moved into their group by :func:`settings_group`, with a ``DeprecationWarning`` that names
the grouped spelling; checkpoints that hold them are upgraded by :mod:`lit_dllm.core.upgrade`.
"""

from __future__ import annotations

import functools
import re
import typing
import warnings
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, fields, is_dataclass
from typing import Any

from torch.optim import Optimizer

__all__ = ["Backbone", "CausalBackbone", "DenoisingGeneration", "FP8_RECIPES", "Generation", "Optimization",
           "OptimizerCallable", "Parallelism", "REDUCE_DTYPES", "Settings", "Tokenizer", "check_positive_or_none",
           "settings_group", "settings_groups"]

OptimizerCallable = Callable[[Iterable], Optimizer]

FP8_RECIPES = ("tensorwise", "rowwise")
"""torchao's float8 recipes (``Float8LinearRecipeName`` values) that ``Parallelism.fp8`` takes."""

REDUCE_DTYPES = ("float32", "bfloat16")
"""The dtypes FSDP2 reduces gradients in (``Parallelism.fsdp_reduce_dtype``)."""


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

    def __post_init__(self) -> None:
        # jsonargparse (4.53) hands a group in a subclass's init_args the string 'None' for `--a.b.field=null`
        for field in fields(self):
            if getattr(self, field.name) == "None" and "None" in str(field.type):
                object.__setattr__(self, field.name, None)

    def check(self) -> None:
        pass

    def saved(self) -> dict[str, Any]:
        """The group as the hyper-parameters hold it (checkpoints load it with ``weights_only``): its fields, less
        those that are code (``Optimization.optimizer``)."""
        return {key: value for key, value in asdict(self).items() if not callable(value)}


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
    """

    gguf_file: str | None = None
    pad_vocab_multiple_of: int | None = None

    def check(self) -> None:
        check_positive_or_none(self, {"pad_vocab_multiple_of": "exactly the tokenizer's size"})


@dataclass(frozen=True)
class Tokenizer(Settings):
    """The tokenizer a module speaks; linked from the data module (``train.py`` fills it), so configs never set it.
    Training takes the data module's tokenizer object itself, and every checkpoint stores its files.

    Attributes:
        name: hub id or local path (None: the embedded default tokenizer).
        mask_token: the mask token added to it (None: its own, if any).
        gguf_file: the GGUF file in ``name`` (a folder or hub id) that holds the tokenizer.
        trust_remote_code: run the tokenizer's and the model's own code from the hub (transformers' flag).
    """

    name: str | None = None
    mask_token: str | None = None
    gguf_file: str | None = None
    trust_remote_code: bool = False


@dataclass(frozen=True)
class Optimization(Settings):
    """AdamW (without decay on norms and biases) with a linear warm-up, then cosine decay to ``min_lr_ratio · lr``.

    Attributes:
        lr: peak learning rate.
        weight_decay: AdamW's decoupled weight decay of the matrices.
        betas: AdamW's betas.
        warmup: warm-up length: a fraction of the run's optimizer steps (< 1) or a number of steps (>= 1).
        min_lr_ratio: the final learning rate as a fraction of ``lr``.
        optimizer: a callable taking the parameter groups that replaces AdamW (a config: ``class_path`` and
            ``init_args``, e.g. ``torch.optim.SGD``); not saved in checkpoints.
    """

    lr: float = 3e-4
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.95)
    warmup: float = 0.05
    min_lr_ratio: float = 0.1
    optimizer: OptimizerCallable | None = None

    def check(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"lr={self.lr!r} must be a positive learning rate, e.g. 3e-4.")
        if self.weight_decay < 0:
            raise ValueError(f"weight_decay={self.weight_decay!r} must be >= 0.")
        if self.warmup < 0:
            raise ValueError(f"warmup={self.warmup!r} must be >= 0: a fraction of the run (< 1) or a number of steps "
                             "(>= 1).")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio={self.min_lr_ratio!r} must lie in [0, 1] (the final lr is min_lr_ratio * "
                             "lr).")


@dataclass(frozen=True)
class Parallelism(Settings):
    """How a run executes, owned by the strategy (``trainer.strategy.init_args.parallelism``): none of it changes
    what is learned, so checkpoints do not hold it and a run resumes under other settings.

    Attributes:
        compile: ``torch.compile`` each transformer block in place (None: on CUDA, not on the CPU).
        experts_implementation: what runs the experts of a transformers MoE model (``grouped_mm``, ``batched_mm``,
            ``eager``...; None: transformers' choice). Logged when ``fit`` starts, with a warning where, on CUDA, it is a
            loop over the experts.
        activation_checkpointing: recompute each transformer block in backward (non-reentrant: composes with FSDP2),
            every family.
        fp8: float8 training of the blocks' dense linear layers through torchao: ``tensorwise`` or ``rowwise`` (a GPU
            of compute capability >= 8.9; extra ``fp8``). Weights, gradients and checkpoints keep their dtype.
        fsdp_reshard_after_forward: free each block's gathered parameters after its forward (True: the least memory)
            or keep them to its backward (False: no all-gather in the backward; the unsharded parameters of every block
            on each GPU). The last block always keeps them.
        fsdp_defer_gradient_sync: with ``accumulate_grad_batches > 1``, reduce-scatter once per optimizer step (at the
            window's last micro-batch) instead of after each micro-batch, for an unsharded copy of the gradients and
            the parameters on each GPU.
        fsdp_prefetch_next_step: all-gather the root's and the first block's parameters for the next step as soon as
            the optimizer stepped, while the host logs and loads the next batch.
        fsdp_reduce_dtype: the dtype gradients are reduce-scattered (and accumulated) in: ``float32`` or ``bfloat16``
            (half the bytes; over two ranks under ``bf16-true`` the same gradients bit for bit).

    The ``fsdp_*`` settings tune FSDP2 and do nothing (a warning) under a strategy that does not shard.
    """

    compile: bool | None = None
    experts_implementation: str | None = None
    activation_checkpointing: bool = False
    fp8: str | None = None
    fsdp_reshard_after_forward: bool = True
    fsdp_defer_gradient_sync: bool = False
    fsdp_prefetch_next_step: bool = False
    fsdp_reduce_dtype: str = "float32"

    def check(self) -> None:
        if self.fp8 is not None and self.fp8 not in FP8_RECIPES:
            raise ValueError(f"fp8={self.fp8!r} is not a float8 recipe: use one of {FP8_RECIPES}, or null for no fp8.")
        if self.fsdp_reduce_dtype not in REDUCE_DTYPES:
            raise ValueError(f"fsdp_reduce_dtype={self.fsdp_reduce_dtype!r} is not a dtype FSDP2 reduces gradients in "
                             f"here: use one of {', '.join(REDUCE_DTYPES)}.")

    def fsdp_only(self) -> list[str]:
        """The settings chosen here that tune FSDP2 (each does nothing without it)."""
        return [f"{field.name}={getattr(self, field.name)!r}" for field in fields(self)
                if field.name.startswith("fsdp_") and getattr(self, field.name) != field.default]


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
        if self.answer_pattern in (None, "None"):  # YAML read `answer_pattern: #### (\S+)` as a comment: null
            raise ValueError(
                f"answer_pattern={self.answer_pattern!r}: no pattern arrived (in YAML a value starting with # is a "
                "comment, so the key is left with none). Quote it: answer_pattern: '#### (\\S+)', or give '' to "
                "compare whole answers."
            )
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


def settings_group(name: str, kind: type[Settings], given: Settings | dict | None, flat: dict[str, Any]) -> Settings:
    """The ``kind`` group of the argument ``name``, checked: ``given`` (a group, a dict of its fields, or None: the
    defaults) with the entries of ``flat`` (keyword arguments of the earlier flat layout) that name its fields moved in
    (popped from ``flat``; a ``DeprecationWarning`` names the grouped spelling)."""
    moved = {field.name: flat.pop(field.name) for field in fields(kind) if field.name in flat}
    if moved:
        warnings.warn(
            f"{', '.join(moved)}: flat settings are deprecated; pass them grouped, as {name}={kind.__name__}("
            f"{', '.join(f'{key}=...' for key in moved)}) (a config: model.init_args.{name}.{next(iter(moved))}).",
            DeprecationWarning,
            stacklevel=3,
        )
    values = {field.name: getattr(given, field.name) for field in fields(given)} if is_dataclass(given) else given
    group = kind(**{**(values or {}), **moved})
    group.check()
    return group


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
