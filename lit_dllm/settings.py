"""Declared, typed groups of settings, each owned by whoever reads it.

What to learn is the module's: where the backbone comes from (:class:`Backbone`, :class:`CausalBackbone`), how it
is optimised (:class:`Optimization`), which tokenizer it speaks (:class:`Tokenizer`, linked from the data module) and
how answers are generated (:class:`Generation`, :class:`DenoisingGeneration`; a family with more knobs subclasses
them beside its module). How to run is the strategy's (:class:`Parallelism`, on :mod:`lit_dllm.strategies`), so
checkpoints hold no machine layout. What the data looks like is the data module's (``DLLMDataModule``):
:class:`DataSource`, :class:`Tokenizer` (the same group, linked into the module), :class:`Formatting`,
:class:`Collation`, :class:`Loader`, :class:`Splits` and :class:`BuiltinTask`.

A module takes each group as one argument (``MDLMModule(..., generation=LLaDAGeneration(gen_length=10))``; in a
config ``model.init_args.generation.gen_length``, grouped in ``--help``), keeps it as an attribute
(``self.generation``) and saves it explicitly (:meth:`Settings.saved`: its hyper-parameters, and so its checkpoints,
hold the group as a dict). The flat keyword arguments of the earlier signatures (``gen_length=10``,
``model_config={...}``), and checkpoints that hold them, are moved into their group by :mod:`lit_dllm.upgrade`.
"""

from __future__ import annotations

import functools
import importlib.util
import numbers
import re
import typing
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, fields, is_dataclass
from typing import Any

from torch.optim import Optimizer

__all__ = ["Backbone", "BuiltinTask", "CausalBackbone", "Collation", "DATA_FORMATS", "DataSource",
           "DenoisingGeneration", "FP8_RECIPES", "Formatting", "Generation", "LONG_DOCUMENTS", "Loader", "OVERLONG", "Optimization",
           "OptimizerCallable", "Parallelism", "REDUCE_DTYPES", "Settings", "Splits", "Tokenizer",
           "check_positive_or_none", "settings_group", "settings_groups"]

OptimizerCallable = Callable[[Iterable], Optimizer]

FP8_RECIPES = ("tensorwise", "rowwise")
"""torchao's float8 recipes (``Float8LinearRecipeName`` values) that ``Parallelism.fp8`` takes."""

REDUCE_DTYPES = ("float32", "bfloat16")
"""The dtypes FSDP2 reduces gradients in (``Parallelism.fsdp_reduce_dtype``)."""

CONTEXT_PARALLEL_ATTENTION = ("ulysses", "all_gather", "ring")
"""How attention spans the shards under context parallelism (``Parallelism.context_parallel_attention``;
:mod:`lit_dllm.context_parallel`)."""

DATA_FORMATS = ("auto", "chat", "prompt_response", "text")
"""The data formats :class:`DataSource` takes (``auto``: by columns)."""

OVERLONG = ("drop", "truncate_prompt")
"""What :class:`Formatting` does with an example longer than ``max_seq_len``."""

LONG_DOCUMENTS = ("split", "drop")
"""What :class:`Collation` does with a packed text document longer than a row."""


def check_positive_or_none(settings, defaults: dict[str, str]) -> None:
    """Raise a ``ValueError`` unless each named setting of ``settings`` is a positive int or None (``defaults`` says
    what None means)."""
    for name, default in defaults.items():
        check_positive_int_or_none(name, getattr(settings, name), default)


def check_positive_int_or_none(name: str, value, default: str) -> None:
    """Raise a ``ValueError`` naming ``name`` unless ``value`` is a positive int or None (``default`` says what None
    means)."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
        raise ValueError(f"{name}={value!r} must be a positive int, or None ({default}).")


def check_drawable(settings, name: str = "val_trace") -> None:
    """Raise an ``ImportError`` when the named setting asks for pictures and matplotlib, which draws them, is missing,
    and a ``ValueError`` when no validation batch is answered to draw them from."""
    if not getattr(settings, name):
        return
    if importlib.util.find_spec("matplotlib") is None:
        raise ImportError(f"{name}=True draws with matplotlib, which is not installed: pip install "
                          "'lit_dllm[notebooks]', or set it to false.")
    if not settings.val_generate_batches:
        raise ValueError(f"{name}=True with val_generate_batches=0: the pictures are drawn from the first answered "
                         "validation batch, and none is answered. Set val_generate_batches >= 1, or val_trace: false.")


def check_context_parallel_attention(scheme: str) -> None:
    """A ValueError naming the schemes unless ``scheme`` is one of :data:`CONTEXT_PARALLEL_ATTENTION`."""
    if scheme not in CONTEXT_PARALLEL_ATTENTION:
        raise ValueError(f"context_parallel_attention={scheme!r} is not a context-parallel attention: use one of "
                         f"{', '.join(CONTEXT_PARALLEL_ATTENTION)}.")


def check_positive_ints(settings, group: str, names: Iterable[str], none: str | None = None) -> None:
    """Raise a ``ValueError`` naming ``group.name`` unless each named setting of ``settings`` is a positive int (or
    None, when ``none`` says what None means)."""
    for name in names:
        value = getattr(settings, name)
        if value is None and none is not None:
            continue
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
            or_none = f"; or None {none}" if none else ""
            raise ValueError(f"{group}.{name} must be a positive int, got {value!r}{or_none}.")


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
    """The tokenizer the data is tokenised with and a module speaks: set once, on the data module
    (``data.init_args.tokenizer``), and linked whole into the module's ``tokenizer_settings`` (``train.py`` does it), so
    configs never set it on the model. Training takes the data module's tokenizer object itself, and every checkpoint
    stores its files.

    Attributes:
        name: hub id or local path of a ``transformers`` tokenizer (None: the embedded default tokenizer).
        mask_token: the mask token to add when the tokenizer has none (None: its own, if any; the model's embedding
            must cover ``vocab_size``): a string that is not an ordinary token of the tokenizer, or one of its special
            tokens.
        gguf_file: the GGUF file in ``name`` (a folder or hub id) whose tokenizer to use, e.g.
            ``SmolLM2-135M-Instruct.Q4_1.gguf`` (transformers' GGUF reader; needs ``pip install 'lit_dllm[real]'``).
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
        context_parallel_size: ranks each sequence is split over along its positions (``ExpertParallelStrategy``
            only; 1: none). The mesh becomes data x context, data over ``world / context_parallel_size`` ranks;
            MDLM, hybrid, CausalLM and DFlash take it (:mod:`lit_dllm.context_parallel`).
        context_parallel_attention: how attention spans the shards: ``ulysses`` (an all-to-all over heads; query and
            KV heads divisible by ``context_parallel_size``), ``all_gather`` (each rank gathers the whole
            sequence's keys and values; any head count) or ``ring`` (torch's ring attention: keys and values passed
            shard by shard; any head count, no mask: unpacked rows; bf16 or fp16 on CUDA).

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
    context_parallel_size: int = 1
    context_parallel_attention: str = "ulysses"

    def check(self) -> None:
        check_positive_ints(self, "parallelism", ["context_parallel_size"])
        check_context_parallel_attention(self.context_parallel_attention)
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
        val_trace: each validation / test pass also draws the denoising of its first answer into TensorBoard's
            images (``<stage>/trace``: a step × position picture of the positions committed and their confidence,
            :class:`~lit_dllm.core.trace.DenoisingTrace`); needs matplotlib (the ``notebooks`` extra).
    """

    gen_steps: int | None = None
    val_trace: bool = False

    def check(self) -> None:
        super().check()
        check_drawable(self)
        check_positive_or_none(self, {"gen_steps": "one token per step with LLaDA sampling, transformers' default with "
                                                   "DiffusionGemma"})


# ---------------------------------------------------------------------------- the data module's groups
# Each is an argument of :class:`~lit_dllm.data.datamodule.DLLMDataModule` (a config: ``data.init_args.<argument>``);
# their checks name that spelling.


@dataclass(frozen=True)
class DataSource(Settings):
    """Where the data comes from, and which columns hold it (``data.init_args.source``).

    Attributes:
        path: ``task:<name>`` (a built-in task: reverse, sort, add), a local json/jsonl/parquet/csv/txt file or a
            folder of them, or a hub dataset id. A folder holds one file type (files of another type are an
            error, other files are skipped with a warning); its splits come from the file names as in
            ``datasets`` (``train.jsonl``, ``validation-1.jsonl``, ...). Each file is read on its own; csv cells
            are read as text, as written (``007`` and ``NA`` stay strings, an empty cell is ``""``).
        config: hub dataset configuration name.
        format: ``auto`` (by columns: messages -> chat, prompt and response -> prompt_response, text -> text),
            ``chat``, ``prompt_response`` or ``text``.
        prompt_field, response_field, messages_field, text_field: column names (e.g. GSM8K: question/answer).
            Their values must be strings; messages a list of ``{"role": str, "content": str}``.
        cache_dir: ``datasets`` cache directory (default: its own).
        streaming: read the training split as a stream (:mod:`lit_dllm.data.streaming`): its shards (the files of
            ``splits.train`` in a folder, one file, or a hub id) are read lazily, tokenised in the loader's workers
            and packed on the fly (needs ``collation.pack``); the position, workers included, is saved in
            checkpoints. Validation and test splits, if any, are read as usual. The stream has no length: set
            ``trainer.max_steps`` (and an int ``trainer.val_check_interval``).
    """

    path: str = "task:reverse"
    config: str | None = None
    format: str = "auto"
    prompt_field: str = "prompt"
    response_field: str = "response"
    messages_field: str = "messages"
    text_field: str = "text"
    cache_dir: str | None = None
    streaming: bool = False

    def check(self) -> None:
        if self.streaming and self.path.startswith("task:"):
            raise ValueError(f"source.streaming reads shards of a corpus; the built-in task {self.path!r} is "
                             "generated in memory: set source.streaming: false.")
        if self.format not in DATA_FORMATS:
            raise ValueError(f"Unknown source.format={self.format!r}; choose one of {list(DATA_FORMATS)}.")


@dataclass(frozen=True)
class Formatting(Settings):
    """How raw rows become examples (``data.init_args.formatting``).

    Attributes:
        mask_history: chat: supervise only the last assistant turn.
        use_chat_template: prompt_response: wrap the pair in the tokenizer's chat template as a user and an
            assistant turn.
        pack_text: text: concatenate the documents (eos-separated) and cut the stream into ``max_seq_len`` rows
            (attention crosses documents), else cut each document on its own. None: concatenated unless
            ``collation.pack`` (packed rows keep documents apart: each is a document of its own).
        overlong: chat and prompt/response examples longer than ``max_seq_len``: ``drop`` them, or
            ``truncate_prompt``: cut their unsupervised prefix from the left (after its leading special tokens,
            e.g. bos) until they fit, dropping those whose response alone does not fit. Counts are logged.
    """

    mask_history: bool = False
    use_chat_template: bool = False
    pack_text: bool | None = None
    overlong: str = "drop"

    def check(self) -> None:
        if self.overlong not in OVERLONG:
            raise ValueError(f"Unknown formatting.overlong={self.overlong!r}; choose one of {list(OVERLONG)}.")


@dataclass(frozen=True)
class Collation(Settings):
    """How examples are padded into batches by ``DLLMCollator`` (``data.init_args.collation``; docs/DESIGN.md §3). A
    family states the values it requires (``required_collation``), which the data module checks.

    Attributes:
        pad_block_size: the collator's ``block_size``: each row's content is filled with eos to whole blocks (named
            as the reference's ``dllm.pad_block_size``, apart from a module's corruption ``block_size``; None: no
            fill).
        pad_seq_len_divisible: the batch length is rounded up to a multiple of this (None: not rounded).
        response_window: block-diffusion Gemma's mode: the fill is measured from the response start and attended.
        supervise_padding: the global padding carries the loss too.
        pack: training rows of ``max_seq_len`` tokens holding several examples each (:mod:`lit_dllm.data.packing`):
            each example (document) attends only to itself, restarts its positions and draws its own noise, so the
            loss is the documents' own; ``loader.batch_size`` counts rows. Only for training (evaluation stays one
            example a row), for the families that take it (MDLM, hybrid, causal LM, DFlash; not block-diffusion
            Gemma, whose rows are response canvases).
        pack_window: examples packed together: each run of this many (in a shuffled order) is packed best-fit
            decreasing; larger fills rows better, an example moves at most one window from its place.
        long_documents: with ``pack``, text documents longer than a row: ``split`` into rows' worth of tokens (each
            piece its own document), or ``drop``; chat and prompt/response examples follow ``formatting.overlong``
            (streamed ones too are split or dropped by this setting). Counts are logged.
        prompts: batches of prompts with their raw columns instead of padded examples, for RL post-training
            (:mod:`lit_dllm.data.prompts`: ``prompt_ids``, ``prompt_lengths``, ``prompt_text``, ``columns``,
            ``example_index``); prompt/response or chat data, not packed or streamed.
    """

    pad_block_size: int | None = None
    pad_seq_len_divisible: int | None = None
    response_window: bool = False
    supervise_padding: bool = False
    pack: bool = False
    pack_window: int = 1000
    long_documents: str = "split"
    prompts: bool = False

    def check(self) -> None:
        check_positive_ints(self, "collation", ("pad_block_size",), none="for no block fill")
        check_positive_ints(self, "collation", ("pad_seq_len_divisible",), none="for no rounding")
        check_positive_ints(self, "collation", ("pack_window",))
        if self.long_documents not in LONG_DOCUMENTS:
            raise ValueError(f"Unknown collation.long_documents={self.long_documents!r}; choose one of "
                             f"{list(LONG_DOCUMENTS)}.")
        if self.pack and self.supervise_padding:
            raise ValueError("collation.pack with collation.supervise_padding: packed rows have no padding of their "
                             "own to supervise; set collation.supervise_padding: false to pack.")
        if self.pack and self.response_window:  # the family that needs the window cannot pack: say that first
            raise ValueError("collation.pack with collation.response_window: a response window lays out one example a "
                             "row, and packed rows hold several. Block-diffusion Gemma (BlockDiffusionGemmaModule), "
                             "which trains on response windows, cannot train on packed rows: set collation.pack: "
                             "false. Another family packs with collation.response_window: false.")
        if self.pack and self.prompts:
            raise ValueError("collation.prompts with collation.pack: prompt batches hold one prompt per row; set "
                             "collation.pack: false.")


@dataclass(frozen=True)
class Loader(Settings):
    """How batches are loaded (``data.init_args.loader``).

    Attributes:
        batch_size: per-device training batch size.
        val_batch_size: per-device validation (and test / predict) batch size (None: ``batch_size``).
        num_workers: DataLoader worker processes.
        group_by_length: training batches of examples of similar length.
        drop_last: drop the incomplete last training batch.
    """

    batch_size: int = 32
    val_batch_size: int | None = None
    num_workers: int = 0
    group_by_length: bool = False
    drop_last: bool = True

    def check(self) -> None:
        check_positive_ints(self, "loader", ("batch_size",))
        check_positive_ints(self, "loader", ("val_batch_size",), none="to use batch_size")
        workers = self.num_workers
        if isinstance(workers, bool) or not isinstance(workers, numbers.Integral) or workers < 0:
            raise ValueError(f"loader.num_workers must be an int >= 0, got {self.num_workers!r}.")


@dataclass(frozen=True)
class Splits(Settings):
    """Which splits train, validate and test, and how many of their rows (``data.init_args.splits``). Built-in tasks
    generate their own train and validation sets.

    Attributes:
        train: dataset split for training.
        val: dataset split for validation; None holds out ``val_fraction`` of ``train``.
        test: dataset split for ``test_dataloader`` and ``predict_dataloader``, tokenised like the others with its
            own ``example_index``; None: they use the validation set. Built-in tasks have none (an error: their
            validation set serves).
        val_fraction: held-out fraction (deterministic given the data module's ``seed``), in (0, 1).
        max_train_examples, max_val_examples, max_test_examples: keep the first N raw examples of each split (a
            positive int, or None for all; ``max_test_examples`` needs ``test``).
    """

    train: str = "train"
    val: str | None = None
    test: str | None = None
    val_fraction: float = 0.05
    max_train_examples: int | None = None
    max_val_examples: int | None = None
    max_test_examples: int | None = None

    def check(self) -> None:
        check_positive_ints(self, "splits", ("max_train_examples", "max_val_examples", "max_test_examples"),
                            none="to keep every example")
        if isinstance(self.val_fraction, bool) or not isinstance(self.val_fraction, numbers.Real) \
                or not 0 < self.val_fraction < 1:
            raise ValueError(f"splits.val_fraction must be in (0, 1), got {self.val_fraction!r}; or name a "
                             "splits.val.")
        if self.max_test_examples is not None and self.test is None:
            raise ValueError("splits.max_test_examples applies to splits.test, which is None; set splits.test or drop "
                             "it.")

    def limits(self) -> dict[str, int | None]:
        """The raw-row limit of each split role (train, val, test)."""
        return {"train": self.max_train_examples, "val": self.max_val_examples, "test": self.max_test_examples}


@dataclass(frozen=True)
class BuiltinTask(Settings):
    """The size and difficulty of a built-in task (``source.path: task:<name>``; ``data.init_args.task``).

    Attributes:
        num_train, num_val: built-in task sizes (validation prompts never occur in training).
        kwargs: built-in task difficulty, e.g. ``{"min_len": 2, "max_len": 8}``.
    """

    num_train: int = 20000
    num_val: int = 256
    kwargs: dict[str, Any] | None = None

    def check(self) -> None:
        check_positive_ints(self, "task", ("num_train", "num_val"))


def settings_group(name: str, kind: type[Settings], given: Settings | dict | None) -> Settings:
    """The ``kind`` group of the argument ``name``, checked: ``given`` (a group, a dict of its fields, or None: the
    defaults)."""
    values = {field.name: getattr(given, field.name) for field in fields(given)} if is_dataclass(given) else given
    group = kind(**(values or {}))
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
