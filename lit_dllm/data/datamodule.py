"""``DLLMDataModule``: data (hub, local files or built-in tasks) -> tokenised unshifted examples -> dLLM batches.

Training batches come from ``lit_dllm.data.loader`` (``EpochBatchSampler`` seeded per epoch, sharded by data-parallel rank,
optionally length-grouped, through ``ResumableLoader``), which Lightning checkpoints so a resumed fit continues with the
next unseen batch. Its settings come in the groups of :mod:`lit_dllm.settings` (:data:`GROUPS`); what is wrong with a
local file or folder is diagnosed in :mod:`lit_dllm.data.files`.
"""

from __future__ import annotations

import dataclasses
import logging
import numbers
import reprlib
import sys
import warnings
from pathlib import Path
from typing import Any, Callable, Iterable

import datasets
import lightning as L
import numpy as np
from datasets.fingerprint import Hasher
from torch.utils.data import DataLoader
from transformers import PreTrainedTokenizerBase

from lit_dllm import compat
from lit_dllm.data.collate import DLLMCollator
from lit_dllm.data.files import (
    FILE_BUILDERS,
    Part,
    check_utf8,
    check_values,
    csv_text_features,
    file_problem,
    folder_files,
)
from lit_dllm.data.formats import (
    ENCODING_VERSION,
    encode_chat,
    encode_prompt_response,
    encode_texts,
    supervised_turns,
    truncate_prompt,
)
from lit_dllm.data.loader import EpochBatchSampler, ResumableLoader
from lit_dllm.data.packing import PackedCollator, PackedRows, pack_windows, span_length
from lit_dllm.data.prompts import PromptRows, collate_prompts
from lit_dllm.data.streaming import PackedStream, StreamingSource, StreamLoader
from lit_dllm.data.tasks import TASK_PREFIX, get_task, make_task_splits
from lit_dllm.data.tokenizer import load_tokenizer
from lit_dllm.settings import (
    BuiltinTask,
    Collation,
    DataSource,
    Formatting,
    Loader,
    Settings,
    Splits,
    Tokenizer,
    settings_group,
)

log = logging.getLogger(__name__)

BATCH_COLUMNS = ["input_ids", "loss_mask", "attention_mask", "example_index"]
NEEDS = {"chat": ("messages",), "prompt_response": ("prompt", "response"), "text": ("text",)}  # field keys

GROUPS: dict[str, type[Settings]] = {"source": DataSource, "tokenizer": Tokenizer, "formatting": Formatting,
                                     "collation": Collation, "loader": Loader, "splits": Splits, "task": BuiltinTask}
"""The data module's settings groups: argument -> group class (a config: ``data.init_args.<argument>.<field>``)."""

FLAT_SETTINGS: dict[str, tuple[str, str]] = {
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
"""Each flat argument of the earlier signature (before the settings groups; ``max_seq_len`` and ``seed`` stay flat)
and its (group, field). Checkpoints of that layout hold them as their ``datamodule_hyper_parameters``."""


@dataclasses.dataclass(frozen=True)
class _Encoder:
    """Batched ``datasets.map`` function: raw columns -> unshifted examples plus their ``length`` and ``num_unk``
    (how many tokens are ``unk_token_id``; 0 when that is None)."""

    tokenizer: PreTrainedTokenizerBase
    format: str
    fields: dict[str, str]
    mask_history: bool
    use_chat_template: bool
    max_seq_len: int
    pack_text: bool
    unk_token_id: int | None

    @property
    def columns(self) -> dict[str, str]:
        """The columns this format reads, each with its field key, e.g. ``{"question": "prompt", ...}``."""
        return {self.fields[key]: key for key in NEEDS[self.format]}

    def __call__(self, batch: dict[str, list]) -> dict[str, list]:
        if self.format == "text":
            examples = encode_texts(self.tokenizer, batch[self.fields["text"]], self.max_seq_len, self.pack_text)
        elif self.format == "chat":
            examples = [encode_chat(self.tokenizer, m, self.mask_history) for m in batch[self.fields["messages"]]]
        else:
            pairs = zip(batch[self.fields["prompt"]], batch[self.fields["response"]])
            examples = [encode_prompt_response(self.tokenizer, p, r, self.use_chat_template) for p, r in pairs]
        columns = {key: [example[key] for example in examples] for key in ("input_ids", "loss_mask", "attention_mask")}
        columns["length"] = [len(ids) for ids in columns["input_ids"]]
        columns["num_unk"] = [ids.count(self.unk_token_id) for ids in columns["input_ids"]]
        return columns


class DLLMDataModule(L.LightningDataModule):
    """Tokenised dLLM data in the unshifted format, batched by ``DLLMCollator`` with each example's ``example_index``.

    Batches: ``input_ids`` / ``attention_mask`` (long ``[B, T]``), ``loss_mask`` (float32 ``[B, T]``),
    ``input_lengths`` (long ``[B]``) and ``example_index`` (long ``[B]``, the example's stable index in its
    tokenised split, to key its noise). With ``collation.prompts`` (RL post-training), batches of prompts with their raw
    columns instead, for reward functions (:func:`lit_dllm.data.prompts.collate_prompts`).

    Nothing is dropped or changed silently: examples with an empty response (chat: an empty supervised assistant
    turn), too long or with no supervised token are dropped with a logged count, and unknown tokens are counted
    in a warning. Malformed files (empty, invalid JSON, a csv with only a header, a null or non-string value in a
    needed column) raise a ValueError naming the file, the line and the column (:mod:`lit_dllm.data.files`).

    Chat and prompt/response examples keep their raw row (:meth:`source_row`; :meth:`replace_response` swaps its
    answer), and predict can leave examples out (:meth:`exclude_from_predict`): what
    :class:`~lit_dllm.callbacks.RegeneratedDataWriter` needs to write a model's own answers as data.

    A family states the collation it requires (``required_collation()`` of the module under the attached trainer,
    e.g. Gemma's whole canvases); :meth:`setup` checks it against :attr:`collation`.

    Args:
        source, tokenizer, formatting, collation, loader, splits, task: the settings groups; see
            :class:`lit_dllm.settings.DataSource`, :class:`~lit_dllm.settings.Tokenizer`,
            :class:`~lit_dllm.settings.Formatting`, :class:`~lit_dllm.settings.Collation`,
            :class:`~lit_dllm.settings.Loader`, :class:`~lit_dllm.settings.Splits` and
            :class:`~lit_dllm.settings.BuiltinTask` (a config: ``data.init_args.loader.batch_size``). Each is kept as
            a read-only attribute of the same name, but ``tokenizer``: :attr:`tokenizer_settings` (:attr:`tokenizer` is
            the loaded tokenizer); the CLI links it into the module's ``tokenizer_settings``.
        max_seq_len: chat and prompt/response examples longer than this are handled by ``formatting.overlong``; text
            is cut to it; the collator caps batches at it.
        seed: seed of the held-out split, of the built-in tasks and of the training order.
        **flat: the arguments of the earlier flat signature (``data="task:sort"``, ``batch_size=8``,
            ``tokenizer="gpt2"``...: :data:`FLAT_SETTINGS`), moved into their group with a ``DeprecationWarning``
            that names the grouped spelling; any other name is a ``TypeError``.
    """

    def __init__(
        self,
        source: DataSource = DataSource(),
        tokenizer: Tokenizer = Tokenizer(),
        formatting: Formatting = Formatting(),
        collation: Collation = Collation(),
        loader: Loader = Loader(),
        splits: Splits = Splits(),
        task: BuiltinTask = BuiltinTask(),
        max_seq_len: int = 256,
        seed: int = 42,
        **flat: Any,
    ) -> None:
        super().__init__()
        given = {"source": source, "tokenizer": tokenizer, "formatting": formatting, "collation": collation,
                 "loader": loader, "splits": splits, "task": task}
        self._groups = _settings_groups(given, flat)
        if isinstance(max_seq_len, bool) or not isinstance(max_seq_len, numbers.Integral) or max_seq_len <= 0:
            raise ValueError(f"max_seq_len must be a positive int, got {max_seq_len!r}.")
        self._max_seq_len, self._seed = max_seq_len, seed
        saved = {name: group.saved() for name, group in self._groups.items()}
        self.save_hyperparameters({**compat.cli_records(), **saved, "max_seq_len": max_seq_len, "seed": seed})
        self._check_settings()
        tokenizer_settings, collation = self.tokenizer_settings, self.collation
        # No mask token is fine for autoregressive training; diffusion modules refuse a None mask_token_id.
        self._tokenizer = load_tokenizer(tokenizer_settings.name, tokenizer_settings.mask_token,
                                         tokenizer_settings.trust_remote_code, require_mask=False,
                                         gguf_file=tokenizer_settings.gguf_file)
        self.collator = DLLMCollator(
            pad_token_id=self._tokenizer.pad_token_id,
            eos_token_id=self._tokenizer.eos_token_id,
            block_size=collation.pad_block_size,
            pad_seq_len_divisible=collation.pad_seq_len_divisible,
            max_seq_len=max_seq_len,
            supervise_padding=collation.supervise_padding,
            response_window=collation.response_window,
        )
        self.packed_collator = PackedCollator(self.collator, max_seq_len) if collation.pack else None
        self.train_dataset: datasets.Dataset | None = None
        self.val_dataset: datasets.Dataset | None = None
        self.test_dataset: datasets.Dataset | None = None
        self._raw: dict[str, datasets.Dataset] = {}  # the raw rows behind each tokenised split (role -> rows)
        self._source_rows: dict[str, np.ndarray] = {}  # role -> each example's row in _raw[role] (not for text)
        self._encoded_with: _Encoder | None = None  # the encoder of the built splits
        self._predict_exclude: frozenset[int] = frozenset()
        self._built = False
        self._train_loader: ResumableLoader | StreamLoader | None = None
        self._resume_state: dict | None = None

    @compat.lightning_classmethod  # as Lightning's own: refuses a call on an instance
    def load_from_checkpoint(cls, checkpoint_path, *args, **kwargs):
        """Lightning's ``load_from_checkpoint``, the checkpoint's ``datamodule_hyper_parameters`` of the earlier flat
        layout moved into today's groups as read (:func:`current_hparams`)."""
        with compat.converting_checkpoints(_current_checkpoint):
            return super().load_from_checkpoint(checkpoint_path, *args, **kwargs)

    # ------------------------------------------------------------------ settings (read-only)
    @property
    def source(self) -> DataSource:
        return self._groups["source"]

    @property
    def tokenizer_settings(self) -> Tokenizer:
        """The ``tokenizer`` argument (:attr:`tokenizer` is the tokenizer it loaded)."""
        return self._groups["tokenizer"]

    @property
    def formatting(self) -> Formatting:
        return self._groups["formatting"]

    @property
    def collation(self) -> Collation:
        return self._groups["collation"]

    @property
    def loader(self) -> Loader:
        return self._groups["loader"]

    @property
    def splits(self) -> Splits:
        return self._groups["splits"]

    @property
    def task(self) -> BuiltinTask:
        return self._groups["task"]

    @property
    def max_seq_len(self) -> int:
        return self._max_seq_len

    @property
    def seed(self) -> int:
        return self._seed

    def _check_settings(self) -> None:
        """What no single group can check: the source against the task and splits groups."""
        path = self.source.path
        if path.startswith(TASK_PREFIX):
            get_task(path[len(TASK_PREFIX) :], **(self.task.kwargs or {}))
            if self.splits.test is not None:
                raise ValueError(
                    f"Built-in tasks have no test split: leave splits.test=None (got {self.splits.test!r}); test and "
                    "predict then use the task's validation set."
                )
        elif Path(path).suffix in FILE_BUILDERS and not Path(path).exists():
            raise ValueError(f"Data file {path!r} does not exist (resolved: {Path(path).resolve()}).")
        if self.collation.prompts and self.source.streaming:
            raise ValueError("collation.prompts serves the prompts of a split read whole: set source.streaming: false.")
        self._check_packing()

    def _check_packing(self) -> None:
        """Packing and streaming against the other groups."""
        collation, formatting, loader = self.collation, self.formatting, self.loader
        if self.source.streaming and not collation.pack:
            raise ValueError("source.streaming packs its documents into rows on the fly: set collation.pack: true.")
        if self.source.streaming and formatting.overlong == "truncate_prompt":
            raise ValueError("formatting.overlong='truncate_prompt' is not applied to streamed examples: set it to "
                             "'drop' and choose collation.long_documents (split or drop).")
        if not collation.pack:
            return
        if loader.group_by_length:
            raise ValueError("loader.group_by_length with collation.pack: packed rows are full already; set "
                             "loader.group_by_length: false.")
        if formatting.pack_text:
            raise ValueError("formatting.pack_text: true concatenates text documents into rows that attend across them; "
                             "collation.pack keeps each document apart: leave formatting.pack_text unset (or false).")
        if collation.pad_block_size and self.max_seq_len % collation.pad_block_size:
            raise ValueError(f"collation.pack fills rows of max_seq_len={self.max_seq_len} tokens with documents of whole "
                             f"blocks of collation.pad_block_size={collation.pad_block_size}: make max_seq_len a "
                             "multiple of it.")

    def _check_collation(self) -> None:
        """The collation that the module under the attached trainer requires (its ``required_collation()``), against
        :attr:`collation`."""
        module = getattr(self.trainer, "lightning_module", None) if self.trainer is not None else None
        packing_problem = getattr(module, "packing_problem", None)
        problem = packing_problem(self.collation.pad_block_size) if self.collation.pack and callable(packing_problem) \
            else None
        if problem:
            raise ValueError(f"data.init_args.collation.pack: true, but {type(module).__name__} cannot train on packed "
                             f"rows: {problem}.")
        required = getattr(module, "required_collation", None)
        if not callable(required):
            return
        required = required()
        unknown = sorted(set(required) - {field.name for field in dataclasses.fields(Collation)})
        if unknown:
            raise TypeError(f"{type(module).__name__}.required_collation() names {unknown}, which are not settings of "
                            "the data module's collation group (lit_dllm.settings.Collation).")
        wrong = {name: value for name, value in required.items() if getattr(self.collation, name) != value}
        if wrong:
            have = ", ".join(f"collation.{name}={getattr(self.collation, name)!r}" for name in wrong)
            fix = " and ".join(f"data.init_args.collation.{name}: {_yaml(value)}" for name, value in wrong.items())
            raise ValueError(f"{type(module).__name__} requires a collation the data module does not have ({have}): "
                             f"set {fix}.")

    # ------------------------------------------------------------------ tokenizer facts (linked by the CLI)
    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        return self._tokenizer

    @property
    def vocab_size(self) -> int:
        """``len(tokenizer)``: covers tokens added on top of the base vocabulary."""
        return len(self._tokenizer)

    @property
    def mask_token_id(self) -> int:
        return self._tokenizer.mask_token_id

    @property
    def pad_token_id(self) -> int:
        return self._tokenizer.pad_token_id

    @property
    def eos_token_id(self) -> int:
        return self._tokenizer.eos_token_id

    # ------------------------------------------------------------------ data
    def prepare_data(self) -> None:
        """Load and tokenise the splits; ``datasets`` caches the work for file and hub data. Under a trainer, the
        collation its module requires is checked first (as in :meth:`setup`), before any tokenisation."""
        self._check_collation()
        self._build()

    def setup(self, stage: str | None = None) -> None:
        """Load the tokenised splits (from ``datasets``' cache when ``prepare_data`` ran in another process).

        The loaders call it too, so ``train_dataloader()`` works without an explicit setup. Under a trainer, the
        collation its module requires (its ``required_collation()``) is checked first: a ``ValueError`` names the
        setting to change and the module.
        """
        self._check_collation()
        if not self._built:
            self._build()

    def _build(self) -> None:
        raw, encoder = self._load_raw()
        encoder_hash = Hasher.hash([encoder, ENCODING_VERSION])  # a large tokenizer takes seconds: once for every split
        tokenized = {split: self._tokenize(dataset, encoder, encoder_hash, split) for split, dataset in raw.items()}
        numbered = {split: examples for split, examples in tokenized.items() if "source_row" in examples.column_names}
        self._source_rows = {split: examples.with_format("numpy")["source_row"] for split, examples in numbered.items()}
        tokenized |= {split: examples.remove_columns("source_row") for split, examples in numbered.items()}
        self.train_dataset, self.val_dataset, self.test_dataset = map(tokenized.get, ("train", "val", "test"))
        self._raw, self._encoded_with, self._built = raw, encoder, True

    def _load_raw(self) -> tuple[dict[str, datasets.Dataset], _Encoder]:
        """The raw train / val (/ test) examples, their needed columns checked, and the encoder for them."""
        path, task, splits = self.source.path, self.task, self.splits
        if path.startswith(TASK_PREFIX):
            task_splits = make_task_splits(
                path[len(TASK_PREFIX) :], task.num_train, task.num_val, self.seed, **(task.kwargs or {})
            )
            raw = dict(zip(("train", "val"), task_splits))
            encoder = self._encoder(raw["train"].column_names)
        else:
            streaming = self.source.streaming  # the training split is streamed by train_dataloader
            names = {"train": None if streaming else splits.train, "val": splits.val, "test": splits.test}
            parts = self._load_parts(list(dict.fromkeys(name for name in names.values() if name is not None)))
            columns = self._stream_source().columns() if streaming else parts[splits.train][0].rows.column_names
            encoder = self._encoder(columns)
            joined = {name: self._join(split_parts, encoder) for name, split_parts in parts.items()}
            raw = {role: joined[name] for role, name in names.items() if name is not None}
            if splits.val is None and not streaming:
                held_out = raw["train"].train_test_split(test_size=splits.val_fraction, seed=self.seed)
                raw["train"], raw["val"] = held_out["train"], held_out["test"]
        limits = splits.limits()
        return {role: _first(dataset, limits[role]) for role, dataset in raw.items()}, encoder

    def _load_parts(self, names: list[str]) -> dict[str, list[Part]]:
        """The parts of each named split: each local file loaded on its own, or the hub split."""
        source = self.source
        path = Path(source.path)
        if path.is_file() or path.is_dir():
            if path.is_file() and path.suffix not in FILE_BUILDERS:
                raise ValueError(f"Unsupported data file {source.path!r}; use one of {sorted(FILE_BUILDERS)}.")
            files = {"train": [path]} if path.is_file() else folder_files(path.resolve())
            self._check_splits(names, files)
            return {name: [self._load_file(file) for file in files[name]] for name in names}
        try:
            splits = datasets.load_dataset(source.path, name=source.config, cache_dir=source.cache_dir)
        except (ConnectionError, FileNotFoundError, OSError) as err:
            raise ValueError(
                f"Could not load dataset {source.path!r}: it is not a local file or folder, and the hub is unreachable "
                f"or has no such dataset ({err}). Pass a local json/jsonl/parquet/csv path or 'task:<name>'."
            ) from err
        self._check_splits(names, splits)
        return {name: [Part(splits[name], f"split {name!r} of {source.path!r}")] for name in names}

    def _check_splits(self, names: list[str], available: dict) -> None:
        for name in names:
            if name not in available:
                raise ValueError(
                    f"Dataset {self.source.path!r} has no split {name!r}; its splits are {list(available)}."
                )

    def _load_file(self, path: Path) -> Part:
        """One local file; an empty, header-only or malformed one is a ValueError naming it and the fault."""
        with path.open("rb") as lines:
            if not any(line.strip() for line in lines):
                raise ValueError(f"Data file {path} is empty; fill it or remove it.")
        builder = FILE_BUILDERS[path.suffix]
        if builder != "parquet":
            check_utf8(path)
        # csv cells stay text as written: no "NA" -> null, "007" -> 7, "" -> NaN
        kwargs = {"features": csv_text_features(path), "keep_default_na": False} if builder == "csv" else {}
        try:
            rows = datasets.load_dataset(
                builder, data_files=str(path), split="train", cache_dir=self.source.cache_dir, **kwargs
            )
        except Exception as err:  # datasets / pyarrow / pandas errors, diagnosed for the user
            columns = {column: key for key, column in self._fields().items()}
            raise ValueError(file_problem(path, builder, err, columns)) from err
        return Part(rows, f"data file {path}", path)

    def _join(self, parts: list[Part], encoder: _Encoder) -> datasets.Dataset:
        """The parts' needed columns (all their columns for ``collation.prompts``: rewards read them), type-checked
        (errors name the file and line), as one dataset."""
        for part in parts:
            for column, key in encoder.columns.items():
                if column not in part.rows.column_names:
                    raise ValueError(
                        f"{part.name} has no column {column!r} ({key}_field); its columns are "
                        f"{part.rows.column_names}. Give every file of a split the same columns."
                    )
                check_values(part, column, key)
        rows = [part.rows if self.collation.prompts else part.rows.select_columns(list(encoder.columns))
                for part in parts]
        try:
            return datasets.concatenate_datasets(rows)
        except ValueError as err:
            features = "; ".join(f"{part.name}: {part_rows.features}" for part, part_rows in zip(parts, rows))
            raise ValueError(f"Files of one split have different column types ({features}); align them.") from err

    def _fields(self) -> dict[str, str]:
        """The column of each field key."""
        return {key: getattr(self.source, f"{key}_field") for key in ("messages", "prompt", "response", "text")}

    def _encoder(self, columns: list[str]) -> _Encoder:
        """The encoder for these columns; raises before any tokenisation if the format or a field is missing."""
        source, formatting = self.source, self.formatting
        fields = self._fields()
        data_format = source.format
        if data_format == "auto":
            found = [fmt for fmt, keys in NEEDS.items() if all(fields[key] in columns for key in keys)]
            if not found:
                raise ValueError(
                    f"Cannot infer the format of {source.path!r} from its columns {columns}: expected "
                    f"{source.messages_field!r} (chat), {source.prompt_field!r} and {source.response_field!r} "
                    f"(prompt_response) or {source.text_field!r} (text). Set source.format and the matching "
                    "source.*_field settings."
                )
            data_format = found[0]
        for key in NEEDS[data_format]:
            if fields[key] not in columns:
                raise ValueError(
                    f"format={data_format!r} needs the column {fields[key]!r} ({key}_field) but {source.path!r} has "
                    f"columns {columns}; set source.{key}_field to one of them."
                )
        if data_format == "text" and self.collation.prompts:
            raise ValueError(f"collation.prompts serves prompts with their reference answers, but {source.path!r} is "
                             "text data: use prompt/response or chat data (source.format), or collation.prompts: false.")
        if data_format == "chat" or (data_format == "prompt_response" and formatting.use_chat_template):
            self._check_chat_support(data_format)
        tok = self._tokenizer
        # Some tokenizers reuse a structural token as unk (GPT-2: <|endoftext|>); unk can't be counted there.
        structural = {tok.eos_token_id, tok.bos_token_id, tok.pad_token_id, tok.mask_token_id}
        unk_token_id = tok.unk_token_id if tok.unk_token_id not in structural else None
        pack = self.collation.pack
        pack_text = not pack if formatting.pack_text is None else formatting.pack_text
        # packed text documents stay whole here: split (or dropped) when longer than a row, with a logged count
        max_seq_len = sys.maxsize if pack and data_format == "text" else self.max_seq_len
        return _Encoder(
            tok, data_format, fields, formatting.mask_history, formatting.use_chat_template, max_seq_len, pack_text,
            unk_token_id,
        )

    def _check_chat_support(self, data_format: str) -> None:
        name = self.tokenizer_settings.name or "the embedded default"
        if not self._tokenizer.chat_template:
            raise ValueError(
                f"format={data_format!r} uses the chat template, but tokenizer {name!r} has none. Set "
                "tokenizer.chat_template and save it with save_pretrained (or, for prompt/response data, set "
                "formatting.use_chat_template=False)."
            )
        if not self._tokenizer.is_fast:
            raise ValueError(
                f"format={data_format!r} with the chat template needs a fast tokenizer (its token offsets locate the "
                f"assistant turns), but tokenizer {name!r} is a slow one."
            )

    def _tokenize(self, raw: datasets.Dataset, encoder: _Encoder, encoder_hash: str, split: str) -> datasets.Dataset:
        """Encode; drop empty-response, overlong (or truncate them) and unsupervised examples, warn about unknown
        tokens (logged counts); number the rest. Chat and prompt/response examples keep their ``source_row`` (the
        row of ``raw`` they come from); text has none (packing and chunking change the row count)."""
        path, max_seq_len = self.source.path, self.max_seq_len
        answered, chat = raw, encoder.format == "chat"
        if encoder.format != "text":
            key, what = ("messages", "supervised assistant turn") if chat else ("response", "response")
            kwargs = {"chat": chat, "mask_history": encoder.mask_history}
            numbered = raw.add_column("source_row", np.arange(len(raw)))
            answered = _drop(numbered, _answered, encoder.fields[key], kwargs, f"with an empty {what}", split)
            if len(answered) == 0 and len(raw) > 0:
                raise ValueError(
                    f"All {len(raw)} {split} examples of {path!r} have an empty {what}: check the column "
                    f"{encoder.fields[key]!r} ({key}_field)."
                )
        encoded = answered.map(
            encoder,
            batched=True,
            remove_columns=raw.column_names,
            new_fingerprint=Hasher.hash([compat.dataset_fingerprint(answered), encoder_hash]),
            desc=f"Tokenizing {split}",
        )
        self._warn_unknown(answered, encoded, encoder, split)
        encoded = encoded.remove_columns("num_unk")
        if encoder.format == "text" and self.collation.pack and self.collation.long_documents == "split":
            encoded = self._split_documents(encoded, split)
        too_long = f"longer than max_seq_len={max_seq_len}"
        if self.formatting.overlong == "truncate_prompt" and encoder.format != "text":
            encoded, too_long = self._truncate_prompts(encoded, split), f"whose response alone is {too_long}"
        fitting = _drop(encoded, _fits, "length", {"max_seq_len": max_seq_len}, too_long, split)
        kept = _drop(fitting, _supervised, "loss_mask", {}, "with no supervised token", split)
        if len(kept) == 0 and len(raw) > 0:
            raise ValueError(
                f"All {len(raw)} {split} examples of {path!r} were dropped (empty responses, {too_long}, or no "
                f"supervised token: see the warnings; format {encoder.format!r}, fields {encoder.fields}). Raise "
                "max_seq_len or set formatting.overlong='truncate_prompt', or check the response / messages fields."
            )
        return kept.add_column("example_index", list(range(len(kept))))

    def _split_documents(self, encoded: datasets.Dataset, split: str) -> datasets.Dataset:
        """Text documents longer than a packed row cut into rows' worth of tokens, each piece a document of its own;
        logs the count."""
        long = _count_longer(encoded, self.max_seq_len)
        if not long:
            return encoded
        pieces = encoded.map(_split_batch, batched=True, fn_kwargs={"piece": self.max_seq_len},
                             desc=f"Splitting long {split} documents")
        log.warning("Split %d of %d %s documents longer than a packed row (max_seq_len=%d) into %d pieces "
                    "(collation.long_documents='split'; 'drop' drops them).", long, len(encoded), split,
                    self.max_seq_len, len(pieces) - len(encoded) + long)
        return pieces

    def _truncate_prompts(self, encoded: datasets.Dataset, split: str) -> datasets.Dataset:
        """``encoded`` with overlong examples' prompts cut from the left to fit (those that can); logs the count."""
        max_seq_len = self.max_seq_len
        overlong = _count_longer(encoded, max_seq_len)
        if not overlong:
            return encoded
        special_ids = tuple(sorted(self._tokenizer.all_special_ids))
        kwargs = {"max_seq_len": max_seq_len, "special_ids": special_ids}
        truncated = encoded.map(_truncate_batch, batched=True, fn_kwargs=kwargs, desc=f"Truncating {split}")
        count = overlong - _count_longer(truncated, max_seq_len)
        if count:
            log.warning(
                "Truncated the prompt of %d of %d %s examples longer than max_seq_len=%d (cut from the left).",
                count,
                len(encoded),
                split,
                max_seq_len,
            )
        return truncated

    def _warn_unknown(self, raw: datasets.Dataset, encoded: datasets.Dataset, encoder: _Encoder, split: str) -> None:
        """Warn with counts, and the characters behind them, when ``split`` holds the tokenizer's unknown token."""
        counts = encoded.select_columns(["num_unk", "length"]).with_format("numpy")[:]
        num_unk, total = int(counts["num_unk"].sum()), int(counts["length"].sum())
        if not num_unk:
            return
        chars = _unknown_characters(raw, encoder)
        shown = ", ".join(map(repr, chars[:10])) + (f" and {len(chars) - 10} more" if len(chars) > 10 else "")
        log.warning(
            "%s: %d unknown tokens (%r) = %.2f%% of %d tokens, in %d of %d examples%s. The tokenizer cannot "
            "represent that text: use one that covers it, or clean the data.",
            split,
            num_unk,
            self._tokenizer.unk_token,
            100 * num_unk / total,
            total,
            np.count_nonzero(counts["num_unk"]),
            len(encoded),
            f"; characters it stands for: {shown}" if chars else "",
        )

    # ------------------------------------------------------------------ loaders
    def _data_parallel(self) -> tuple[int, int]:
        """(num_replicas, rank) of the data-parallel group; (1, 0) without a distributed trainer."""
        kwargs = self.trainer.distributed_sampler_kwargs if self.trainer is not None else None
        return (kwargs["num_replicas"], kwargs["rank"]) if kwargs else (1, 0)

    def train_dataloader(self) -> ResumableLoader | StreamLoader:
        """This rank's training batches, resumable mid-epoch: examples padded per batch, packed rows
        (``collation.pack``), or a stream of packed rows (``source.streaming``)."""
        self.setup()
        self._train_loader = self._stream_loader() if self.source.streaming else self._map_loader()
        if self._resume_state is not None:
            self._train_loader.load_state_dict(self._resume_state)
            self._resume_state = None
        return self._train_loader

    def _map_loader(self) -> ResumableLoader:
        loader = self.loader
        num_replicas, rank = self._data_parallel()
        lengths = self.train_dataset.with_format("numpy")["length"]
        rows = self._packed_rows(lengths) if self.collation.pack else None
        units = lengths if rows is None else [sum(self._span(lengths[i]) for i in row) for row in rows]
        sampler = EpochBatchSampler(units, loader.batch_size, self.seed, num_replicas, rank, loader.drop_last,
                                    loader.group_by_length, rows=rows)
        if len(sampler) == 0:
            what = f"{len(lengths)} training examples" if rows is None else f"{len(rows)} packed rows"
            raise ValueError(
                f"The {what} make no batch of loader.batch_size={loader.batch_size} x {num_replicas} data-parallel "
                "ranks with loader.drop_last=True; lower loader.batch_size, add data or set loader.drop_last=False."
            )
        examples = self.train_dataset.select_columns(BATCH_COLUMNS)
        if self.collation.prompts:
            return ResumableLoader(self._prompt_rows(examples, "train"), sampler, collate_prompts, loader.num_workers)
        if rows is None:
            return ResumableLoader(examples, sampler, self.collator, loader.num_workers)
        return ResumableLoader(PackedRows(examples), sampler, self.packed_collator, loader.num_workers)

    def _span(self, length: int) -> int:
        return span_length(int(length), self.collation.pad_block_size)

    def _packed_rows(self, lengths: np.ndarray) -> list[list[int]]:
        """The training examples packed into rows once (a shuffled order, packed window by window); logs the fill."""
        spans = [self._span(length) for length in lengths]
        order = np.random.default_rng([self.seed, len(lengths)]).permutation(len(lengths)).tolist()
        rows = pack_windows(order, spans, self.max_seq_len, self.collation.pack_window)
        log.info("Packed %d training examples into %d rows of %d tokens: %.1f%% of the rows' tokens are the examples' "
                 "own (block fill included: %.1f%%).", len(lengths), len(rows), self.max_seq_len,
                 100 * int(np.sum(lengths)) / (len(rows) * self.max_seq_len),
                 100 * sum(spans) / (len(rows) * self.max_seq_len))
        return rows

    def _stream_source(self) -> StreamingSource:
        """This rank's share of the training shards: the ``splits.train`` files of a folder, a file, or a hub id."""
        path, (num_replicas, rank) = Path(self.source.path), self._data_parallel()
        if path.is_dir():
            files = folder_files(path.resolve())
            self._check_splits([self.splits.train], files)
            return StreamingSource.open(files[self.splits.train], rank, num_replicas)
        return StreamingSource.open(self.source.path, rank, num_replicas)

    def _stream_loader(self) -> StreamLoader:
        trainer = self.trainer
        if trainer is not None and (trainer.max_steps is None or trainer.max_steps < 0):
            raise ValueError("source.streaming: the stream has no length (it goes on epoch after epoch); set "
                             "trainer.max_steps (and an int trainer.val_check_interval).")
        stream = PackedStream(self._stream_source(), self._encoded_with, self.packed_collator, self.loader.batch_size,
                              window=self.collation.pack_window, long_documents=self.collation.long_documents,
                              seed=self.seed)
        # Lightning fetches one batch ahead of the step: the saved position leaves it out
        return StreamLoader(stream, num_workers=self.loader.num_workers, lookahead=1)

    def _eval_loader(self, dataset: datasets.Dataset, stage: str) -> DataLoader:
        loader, examples, prompts = self.loader, dataset.select_columns(BATCH_COLUMNS), self.collation.prompts
        return DataLoader(
            self._prompt_rows(examples, self._role(stage)) if prompts else examples,
            batch_size=loader.val_batch_size or loader.batch_size,
            shuffle=False,
            drop_last=False,
            collate_fn=collate_prompts if prompts else self.collator,
            num_workers=loader.num_workers,
        )

    def _prompt_rows(self, examples: datasets.Dataset, role: str) -> PromptRows:
        """``examples`` of the split ``role`` as prompts with their raw rows (``collation.prompts``)."""
        encoder = self._encoded_with
        return PromptRows(examples, self._raw[role], self._source_rows[role], encoder.columns, self._tokenizer,
                          encoder.mask_history)

    def val_dataloader(self) -> DataLoader | list:
        """The validation examples in order; none (an empty list: Lightning skips validation) for a streamed
        training split without ``splits.val``."""
        examples = self._examples("validate")
        return [] if examples is None else self._eval_loader(examples, "validate")

    def test_dataloader(self) -> DataLoader:
        """``splits.test``'s examples in order; the validation examples when ``splits.test`` is None."""
        return self._eval_loader(self._examples("test"), "test")

    def predict_dataloader(self) -> DataLoader:
        """The same examples as ``test_dataloader``, less those named by :meth:`exclude_from_predict`."""
        examples = self._examples("predict")
        if self._predict_exclude:
            indices = examples.with_format("numpy")["example_index"]
            examples = examples.select(np.flatnonzero(~np.isin(indices, list(self._predict_exclude))))
        return self._eval_loader(examples, "predict")

    # ------------------------------------------------------------------ source rows (regeneration)
    def _role(self, stage: str) -> str:
        """The split (train, val or test) that ``stage`` reads; test and predict read val without ``splits.test``."""
        roles = {"fit": "train", "validate": "val", "test": "test", "predict": "test"}
        if stage not in roles:
            raise ValueError(f"Unknown stage {stage!r}; use one of {list(roles)}.")
        self.setup()
        role = roles[stage]
        return "val" if role == "test" and self.test_dataset is None else role

    def _examples(self, stage: str) -> datasets.Dataset:
        """The tokenised examples of ``stage`` (``fit``, ``validate``, ``test`` or ``predict``)."""
        role = self._role(stage)  # builds the splits first
        return {"train": self.train_dataset, "val": self.val_dataset, "test": self.test_dataset}[role]

    def num_examples(self, stage: str = "predict") -> tuple[int, int]:
        """(tokenised examples, raw rows) of ``stage``'s split: the difference is what the logged drops removed."""
        return len(self._examples(stage)), len(self._raw[self._role(stage)])

    def source_row(self, example_index: int, stage: str = "predict") -> dict[str, Any]:
        """The raw row (the columns the format reads, as read) behind tokenised example ``example_index`` of
        ``stage``'s split. Chat and prompt/response data only: packed or chunked text has no row per example."""
        role = self._role(stage)
        if role not in self._source_rows:
            raise ValueError("Text examples have no source row: packing and chunking change the row count.")
        rows = self._source_rows[role]
        if not 0 <= example_index < len(rows):
            raise ValueError(f"example_index={example_index} is outside the {len(rows)} {stage} examples.")
        return self._raw[role][int(rows[int(example_index)])]

    def replace_response(self, row: dict[str, Any], response: str) -> dict[str, Any]:
        """A copy of the source row ``row`` with its response replaced: the response field (prompt/response), or
        the content of the one supervised assistant turn (chat; multi-turn chats need ``mask_history=True``, so
        the prompt is the whole conversation before the last assistant turn)."""
        self.setup()
        encoder = self._encoded_with
        if encoder.format == "prompt_response":
            return {**row, encoder.fields["response"]: response}
        if encoder.format != "chat":
            raise ValueError(f"format={encoder.format!r} data has no response to replace.")
        messages = [dict(message) for message in row[encoder.fields["messages"]]]
        turns = supervised_turns(messages, encoder.mask_history)
        if len(turns) != 1:
            raise ValueError(
                f"The conversation {reprlib.repr(messages)} has {len(turns)} supervised assistant turns, and its "
                "prompt ends before the first: set data.init_args.formatting.mask_history=true to make it everything "
                "before the last."
            )
        messages[turns[0]]["content"] = response
        return {**row, encoder.fields["messages"]: messages}

    def exclude_from_predict(self, example_indices: Iterable[int]) -> None:
        """Leave these ``example_index`` values out of ``predict_dataloader`` (e.g. answers already written)."""
        self._predict_exclude = frozenset(int(index) for index in example_indices)

    # ------------------------------------------------------------------ resume
    def state_dict(self) -> dict[str, Any]:
        """The training position, also saved by Lightning through the train loader.

        Both copies hold the same position and loading one *sets* it, so restoring both never double-counts.
        This copy is needed when the train loader was built before Lightning restores loader states (e.g. by
        ``trainer.estimated_stepping_batches`` in ``configure_optimizers``), which then skips them.
        """
        return self._train_loader.state_dict() if self._train_loader is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self._train_loader is not None:
            self._train_loader.load_state_dict(state_dict)
        else:
            self._resume_state = dict(state_dict)


# ---------------------------------------------------------------------------- tokens


def _settings_groups(given: dict[str, Any], flat: dict[str, Any]) -> dict[str, Settings]:
    """The data module's groups (:data:`GROUPS`), checked: ``given`` (each a group, a dict of its fields, or None:
    the defaults) with the arguments of the earlier flat signature in ``flat`` moved in (:data:`FLAT_SETTINGS`, with a
    ``DeprecationWarning`` naming the grouped spelling). ``source`` and ``tokenizer`` given as a string are the earlier
    ``data`` and ``tokenizer`` (a name). Any other name in ``flat`` is a ``TypeError``."""
    flat, given = dict(flat), dict(given)
    for name, old in (("source", "data"), ("tokenizer", "tokenizer")):
        if isinstance(given[name], str):
            if old in flat:
                raise TypeError(f"DLLMDataModule got both {name}={given[name]!r} and {old}={flat[old]!r}.")
            flat, given[name] = {old: given[name], **flat}, None  # the earlier first argument comes first
    unknown = sorted(set(flat) - set(FLAT_SETTINGS))
    if unknown:
        raise TypeError(f"DLLMDataModule got unexpected settings {unknown}: see its docstring (or `python train.py fit "
                        "--data.help lit_dllm.DLLMDataModule`) for the settings and their groups.")
    moved: dict[str, dict[str, Any]] = {}
    for old, value in flat.items():
        group, field = FLAT_SETTINGS[old]
        moved.setdefault(group, {})[field] = value
    if flat:
        spelled = ", ".join(f"{old} -> data.init_args.{'.'.join(FLAT_SETTINGS[old])}" for old in flat)
        group, field = FLAT_SETTINGS[next(iter(flat))]
        warnings.warn(
            f"{', '.join(flat)}: the data module's flat settings are deprecated; pass them grouped ({spelled}; in "
            f"Python {group}={GROUPS[group].__name__}({field}=...)).",
            DeprecationWarning,
            stacklevel=3,
        )
    groups = {}
    for name, kind in GROUPS.items():
        value = given[name]
        if dataclasses.is_dataclass(value) and not isinstance(value, kind):
            raise TypeError(f"DLLMDataModule's {name} must be a {kind.__name__} (lit_dllm.settings), got "
                            f"{type(value).__name__}.")
        values = ({field.name: getattr(value, field.name) for field in dataclasses.fields(value)}
                  if dataclasses.is_dataclass(value) else dict(value or {}))
        groups[name] = settings_group(name, kind, {**values, **moved.get(name, {})}, {})
    return groups


def current_hparams(saved: dict[str, Any]) -> dict[str, Any]:
    """Data-module hyper-parameters (a checkpoint's) in today's groups: those of the earlier flat layout
    (:data:`FLAT_SETTINGS`; ``tokenizer`` a name or None) moved in, without a warning (the checkpoint's layout, not the
    user's spelling); today's as they are."""
    flat = {key: value for key, value in saved.items()
            if key in FLAT_SETTINGS and not (key in GROUPS and isinstance(value, dict))}
    if not flat:
        return saved
    given = {name: saved.get(name) if isinstance(saved.get(name), dict) else None for name in GROUPS}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        groups = _settings_groups(given, flat)
    return {**{key: value for key, value in saved.items() if key not in flat},
            **{name: group.saved() for name, group in groups.items()}}


def _current_checkpoint(checkpoint: dict) -> dict:
    key = DLLMDataModule.CHECKPOINT_HYPER_PARAMS_KEY
    if isinstance(checkpoint.get(key), dict):
        checkpoint[key] = current_hparams(checkpoint[key])
    return checkpoint


def _yaml(value: Any) -> str:
    """``value`` as YAML writes it (``true``, ``null``, ``8``)."""
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def _unknown_characters(raw: datasets.Dataset, encoder: _Encoder) -> list[str]:
    """The distinct characters of ``raw``'s text that the tokenizer encodes as its unknown token."""
    chars: set[str] = set()
    for batch in raw.select_columns(list(encoder.columns)).iter(batch_size=1000):
        for column, values in batch.items():
            if encoder.columns[column] == "messages":
                values = [message["content"] for messages in values for message in messages]
            chars.update(*values)
    candidates = sorted(chars)
    encoded = encoder.tokenizer(candidates, add_special_tokens=False)["input_ids"] if candidates else []
    return [char for char, ids in zip(candidates, encoded) if encoder.unk_token_id in ids]


def _answered(values: list, chat: bool, mask_history: bool) -> list[bool]:
    """Batched ``filter`` predicate on the response (chat: messages) column: False where the response, or a
    supervised assistant turn, is empty or whitespace."""
    if not chat:
        return [bool(response.strip()) for response in values]
    return [all(m[i]["content"].strip() for i in supervised_turns(m, mask_history)) for m in values]


def _truncate_batch(batch: dict[str, list], max_seq_len: int, special_ids: tuple[int, ...]) -> dict[str, list]:
    """Batched ``map``: ``truncate_prompt`` on each example; those it can't fit stay as they are (dropped later)."""
    keys, special = ("input_ids", "loss_mask", "attention_mask"), set(special_ids)
    examples = [dict(zip(keys, values)) for values in zip(*(batch[key] for key in keys))]
    examples = [truncate_prompt(example, max_seq_len, special) or example for example in examples]
    columns = {key: [example[key] for example in examples] for key in keys}
    columns["length"] = [len(ids) for ids in columns["input_ids"]]
    return columns


def _count_longer(dataset: datasets.Dataset, max_seq_len: int) -> int:
    return int(np.count_nonzero(dataset.select_columns(["length"]).with_format("numpy")[:]["length"] > max_seq_len))


def _split_batch(batch: dict[str, list], piece: int) -> dict[str, list]:
    """Batched ``map``: each example cut into pieces of at most ``piece`` tokens."""
    keys = ("input_ids", "loss_mask", "attention_mask")
    columns = {key: [values[start : start + piece] for values in batch[key] for start in range(0, len(values), piece)]
               for key in keys}
    columns["length"] = [len(ids) for ids in columns["input_ids"]]
    return columns


def _fits(lengths: list[int], max_seq_len: int) -> list[bool]:
    return [length <= max_seq_len for length in lengths]


def _supervised(loss_masks: list[list[int]]) -> list[bool]:
    return [any(mask) for mask in loss_masks]


def _drop(dataset: datasets.Dataset, keep: Callable, column: str, kwargs: dict, reason: str, split: str):
    """``dataset`` filtered by the batched predicate ``keep`` on ``column``; logs how many were dropped."""
    kept = dataset.filter(keep, input_columns=column, batched=True, fn_kwargs=kwargs, desc=f"Filtering {split}")
    if len(kept) < len(dataset):
        log.warning("Dropped %d of %d %s examples %s.", len(dataset) - len(kept), len(dataset), split, reason)
    return kept


def _first(dataset: datasets.Dataset, limit: int | None) -> datasets.Dataset:
    return dataset if limit is None or limit >= len(dataset) else dataset.select(range(limit))
