"""``DLLMDataModule``: data (hub, local files or built-in tasks) -> tokenised unshifted examples -> dLLM batches.

Training batches come from ``lit_dllm.data.loader`` (``EpochBatchSampler`` seeded per epoch, sharded by data-parallel rank,
optionally length-grouped, through ``ResumableLoader``), which Lightning checkpoints so a resumed fit continues with the
next unseen batch.
"""

from __future__ import annotations

import csv
import dataclasses
import itertools
import json
import logging
import numbers
import reprlib
from pathlib import Path
from typing import Any, Callable, Iterable

import datasets
import lightning as L
import numpy as np
import pyarrow.compute as pc
from datasets.fingerprint import Hasher
from torch.utils.data import DataLoader
from transformers import PreTrainedTokenizerBase

from lit_dllm import compat
from lit_dllm.data.collate import DLLMCollator
from lit_dllm.data.formats import (
    encode_chat,
    encode_prompt_response,
    encode_texts,
    supervised_turns,
    truncate_prompt,
)
from lit_dllm.data.loader import EpochBatchSampler, ResumableLoader
from lit_dllm.data.tasks import get_task, make_task_splits
from lit_dllm.data.tokenizer import load_tokenizer

log = logging.getLogger(__name__)

TASK_PREFIX = "task:"
FORMATS = ("auto", "chat", "prompt_response", "text")
FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv", ".txt": "text"}
BATCH_COLUMNS = ["input_ids", "loss_mask", "attention_mask", "example_index"]
NEEDS = {"chat": ("messages",), "prompt_response": ("prompt", "response"), "text": ("text",)}  # field keys
EXPECTED = {"messages": "a list of {'role': str, 'content': str} messages"}  # the other fields: a string
STRINGS = (datasets.Value("string"), datasets.Value("large_string"))
JSON_TYPES = {bool: "boolean", int: "number", float: "number", str: "string", list: "list", dict: "object"}
OVERLONG = ("drop", "truncate_prompt")
LIMITS = ("max_train_examples", "max_val_examples", "max_test_examples")


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


@dataclasses.dataclass(frozen=True)
class _Part:
    """The raw rows of one local file or one hub split, named for error messages."""

    rows: datasets.Dataset
    name: str
    path: Path | None = None

    def where(self, row: int) -> str:
        """Row ``row`` (0-based) for people: the 1-based line of a JSON Lines file, else the 1-based row."""
        lines = _json_lines(self.path) if self.path is not None and self.path.suffix in (".json", ".jsonl") else None
        return f"{self.path} line {lines[row]}" if lines else f"{self.name} row {row + 1}"


class DLLMDataModule(L.LightningDataModule):
    """Tokenised dLLM data in the unshifted format, batched by ``DLLMCollator`` with each example's ``example_index``.

    Batches: ``input_ids`` / ``attention_mask`` (long ``[B, T]``), ``loss_mask`` (float32 ``[B, T]``),
    ``input_lengths`` (long ``[B]``) and ``example_index`` (long ``[B]``, the example's stable index in its
    tokenised split, to key its noise).

    Nothing is dropped or changed silently: examples with an empty response (chat: an empty supervised assistant
    turn), too long or with no supervised token are dropped with a logged count, and unknown tokens are counted
    in a warning. Malformed files (empty, invalid JSON, a csv with only a header, a null or non-string value in a
    needed column) raise a ValueError naming the file, the line and the column.

    Chat and prompt/response examples keep their raw row (:meth:`source_row`; :meth:`replace_response` swaps its
    answer), and predict can leave examples out (:meth:`exclude_from_predict`): what
    :class:`~lit_dllm.callbacks.RegeneratedDataWriter` needs to write a model's own answers as data.

    Args:
        data: ``task:<name>`` (a built-in task: reverse, sort, add), a local json/jsonl/parquet/csv/txt file or a
            folder of them, or a hub dataset id. A folder holds one file type (files of another type are an
            error, other files are skipped with a warning); its splits come from the file names as in
            ``datasets`` (``train.jsonl``, ``validation-1.jsonl``, ...). Each file is read on its own; csv cells
            are read as text, as written (``007`` and ``NA`` stay strings, an empty cell is ``""``).
        data_config: hub dataset configuration name.
        format: ``auto`` (by columns: messages -> chat, prompt and response -> prompt_response, text -> text),
            ``chat``, ``prompt_response`` or ``text``.
        prompt_field, response_field, messages_field, text_field: column names (e.g. GSM8K: question/answer).
            Their values must be strings; messages a list of ``{"role": str, "content": str}``.
        mask_history: chat: supervise only the last assistant turn.
        use_chat_template: prompt_response: wrap the pair in the tokenizer's chat template as a user and an
            assistant turn.
        pack_text: text: pack documents (eos-separated) into ``max_seq_len`` chunks, else chunk each document.
        tokenizer: hub id or local path of a ``transformers`` tokenizer; None for the embedded default.
        tokenizer_gguf_file: the name of a GGUF file in ``tokenizer`` (the folder or hub id holding it) whose
            tokenizer to use, e.g. ``SmolLM2-135M-Instruct.Q4_1.gguf`` (transformers' GGUF reader; needs
            ``pip install 'lit_dllm[real]'``).
        mask_token: mask token to add when the tokenizer has none (the model's embedding must cover
            ``vocab_size``); a string that is not an ordinary token of the tokenizer, or one of its special tokens.
        trust_remote_code: for ``AutoTokenizer.from_pretrained``.
        max_seq_len: chat and prompt/response examples longer than this are handled by ``overlong``; text is
            cut to it; the collator caps batches at it.
        overlong: chat and prompt/response examples longer than ``max_seq_len``: ``drop`` them, or
            ``truncate_prompt``: cut their unsupervised prefix from the left (after its leading special tokens,
            e.g. bos) until they fit, dropping those whose response alone does not fit. Counts are logged.
        pad_block_size: the collator's ``block_size`` (EOS block fill; named as the reference's
            ``dllm.pad_block_size``, apart from the module's corruption ``block_size``).
        pad_seq_len_divisible, response_window, supervise_padding: ``DLLMCollator`` options.
        batch_size: per-device training batch size.
        val_batch_size: per-device validation (and test / predict) batch size (default ``batch_size``).
        train_split: dataset split for training (built-in tasks generate their own train and val sets).
        val_split: dataset split for validation; None holds out ``val_fraction`` of ``train_split``.
        test_split: dataset split for ``test_dataloader`` and ``predict_dataloader``, tokenised like the others
            with its own ``example_index``; None: they use the validation set. Built-in tasks have none (an
            error: their validation set serves).
        val_fraction: held-out fraction (deterministic given ``seed``), in (0, 1).
        max_train_examples, max_val_examples, max_test_examples: keep the first N raw examples of each split
            (a positive int, or None for all; ``max_test_examples`` needs ``test_split``).
        seed: seed of the held-out split, of the built-in tasks and of the training order.
        num_workers: DataLoader worker processes.
        group_by_length: training batches of examples of similar length.
        task_num_train, task_num_val: built-in task sizes (val prompts never occur in train).
        task_kwargs: built-in task difficulty, e.g. ``{"min_len": 2, "max_len": 8}``.
        drop_last: drop the incomplete last training batch.
        cache_dir: ``datasets`` cache directory (default: its own).
    """

    def __init__(
        self,
        data: str = "task:reverse",
        data_config: str | None = None,
        format: str = "auto",
        prompt_field: str = "prompt",
        response_field: str = "response",
        messages_field: str = "messages",
        text_field: str = "text",
        mask_history: bool = False,
        use_chat_template: bool = False,
        pack_text: bool = True,
        tokenizer: str | None = None,
        tokenizer_gguf_file: str | None = None,
        mask_token: str | None = None,
        trust_remote_code: bool = False,
        max_seq_len: int = 256,
        pad_block_size: int | None = None,
        pad_seq_len_divisible: int | None = None,
        response_window: bool = False,
        supervise_padding: bool = False,
        batch_size: int = 32,
        val_batch_size: int | None = None,
        train_split: str = "train",
        val_split: str | None = None,
        val_fraction: float = 0.05,
        max_train_examples: int | None = None,
        max_val_examples: int | None = None,
        seed: int = 42,
        num_workers: int = 0,
        group_by_length: bool = False,
        task_num_train: int = 20000,
        task_num_val: int = 256,
        task_kwargs: dict | None = None,
        drop_last: bool = True,
        cache_dir: str | None = None,
        overlong: str = "drop",
        test_split: str | None = None,
        max_test_examples: int | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self._check_args()
        # No mask token is fine for autoregressive training; diffusion modules refuse a None mask_token_id.
        self._tokenizer = load_tokenizer(
            tokenizer, mask_token, trust_remote_code, require_mask=False, gguf_file=tokenizer_gguf_file
        )
        self.collator = DLLMCollator(
            pad_token_id=self._tokenizer.pad_token_id,
            eos_token_id=self._tokenizer.eos_token_id,
            block_size=pad_block_size,
            pad_seq_len_divisible=pad_seq_len_divisible,
            max_seq_len=max_seq_len,
            supervise_padding=supervise_padding,
            response_window=response_window,
        )
        self.train_dataset: datasets.Dataset | None = None
        self.val_dataset: datasets.Dataset | None = None
        self.test_dataset: datasets.Dataset | None = None
        self._raw: dict[str, datasets.Dataset] = {}  # the raw rows behind each tokenised split (role -> rows)
        self._source_rows: dict[str, np.ndarray] = {}  # role -> each example's row in _raw[role] (not for text)
        self._encoded_with: _Encoder | None = None  # the encoder of the built splits
        self._predict_exclude: frozenset[int] = frozenset()
        self._train_loader: ResumableLoader | None = None
        self._resume_state: dict | None = None

    def _check_args(self) -> None:
        hp = self.hparams
        for name in ("batch_size", "val_batch_size", "max_seq_len", "task_num_train", "task_num_val", *LIMITS):
            value = hp[name]
            if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0):
                every = "; or None to keep every example" if name in LIMITS else ""
                raise ValueError(f"{name} must be a positive int, got {value!r}{every}.")
        if not 0 < hp.val_fraction < 1:
            raise ValueError(f"val_fraction must be in (0, 1), got {hp.val_fraction!r}; or name a val_split.")
        if hp.format not in FORMATS:
            raise ValueError(f"Unknown data format {hp.format!r}; choose one of {list(FORMATS)}.")
        if hp.overlong not in OVERLONG:
            raise ValueError(f"Unknown overlong={hp.overlong!r}; choose one of {list(OVERLONG)}.")
        if hp.max_test_examples is not None and hp.test_split is None:
            raise ValueError("max_test_examples applies to test_split, which is None; set test_split or drop it.")
        if hp.data.startswith(TASK_PREFIX):
            get_task(hp.data[len(TASK_PREFIX) :], **(hp.task_kwargs or {}))
            if hp.test_split is not None:
                raise ValueError(
                    f"Built-in tasks have no test split: leave test_split=None (got {hp.test_split!r}); test and "
                    "predict then use the task's validation set."
                )
        elif Path(hp.data).suffix in FILE_BUILDERS and not Path(hp.data).exists():
            raise ValueError(f"Data file {hp.data!r} does not exist (resolved: {Path(hp.data).resolve()}).")

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
        """Load and tokenise the splits; ``datasets`` caches the work for file and hub data."""
        self._build()

    def setup(self, stage: str | None = None) -> None:
        """Load the tokenised splits (from ``datasets``' cache when ``prepare_data`` ran in another process).

        The loaders call it too, so ``train_dataloader()`` works without an explicit setup.
        """
        if self.train_dataset is None:
            self._build()

    def _build(self) -> None:
        raw, encoder = self._load_raw()
        encoder_hash = Hasher.hash(encoder)  # hashing a large tokenizer takes seconds: once for every split
        tokenized = {split: self._tokenize(dataset, encoder, encoder_hash, split) for split, dataset in raw.items()}
        numbered = {split: examples for split, examples in tokenized.items() if "source_row" in examples.column_names}
        self._source_rows = {split: examples.with_format("numpy")["source_row"] for split, examples in numbered.items()}
        tokenized |= {split: examples.remove_columns("source_row") for split, examples in numbered.items()}
        self.train_dataset, self.val_dataset, self.test_dataset = map(tokenized.get, ("train", "val", "test"))
        self._raw, self._encoded_with = raw, encoder

    def _load_raw(self) -> tuple[dict[str, datasets.Dataset], _Encoder]:
        """The raw train / val (/ test) examples, their needed columns checked, and the encoder for them."""
        hp = self.hparams
        if hp.data.startswith(TASK_PREFIX):
            splits = make_task_splits(
                hp.data[len(TASK_PREFIX) :], hp.task_num_train, hp.task_num_val, hp.seed, **(hp.task_kwargs or {})
            )
            raw = dict(zip(("train", "val"), splits))
            encoder = self._encoder(raw["train"].column_names)
        else:
            names = {"train": hp.train_split, "val": hp.val_split, "test": hp.test_split}
            parts = self._load_parts(list(dict.fromkeys(name for name in names.values() if name is not None)))
            encoder = self._encoder(parts[hp.train_split][0].rows.column_names)
            joined = {name: self._join(split_parts, encoder) for name, split_parts in parts.items()}
            raw = {role: joined[name] for role, name in names.items() if name is not None}
            if hp.val_split is None:
                held_out = raw["train"].train_test_split(test_size=hp.val_fraction, seed=hp.seed)
                raw["train"], raw["val"] = held_out["train"], held_out["test"]
        limits = dict(zip(("train", "val", "test"), (hp[name] for name in LIMITS)))
        return {role: _first(dataset, limits[role]) for role, dataset in raw.items()}, encoder

    def _load_parts(self, names: list[str]) -> dict[str, list[_Part]]:
        """The parts of each named split: each local file loaded on its own, or the hub split."""
        hp = self.hparams
        path = Path(hp.data)
        if path.is_file() or path.is_dir():
            if path.is_file() and path.suffix not in FILE_BUILDERS:
                raise ValueError(f"Unsupported data file {hp.data!r}; use one of {sorted(FILE_BUILDERS)}.")
            files = {"train": [path]} if path.is_file() else _folder_files(path.resolve())
            self._check_splits(names, files)
            return {name: [self._load_file(file) for file in files[name]] for name in names}
        try:
            splits = datasets.load_dataset(hp.data, name=hp.data_config, cache_dir=hp.cache_dir)
        except (ConnectionError, FileNotFoundError, OSError) as err:
            raise ValueError(
                f"Could not load dataset {hp.data!r}: it is not a local file or folder, and the hub is unreachable "
                f"or has no such dataset ({err}). Pass a local json/jsonl/parquet/csv path or 'task:<name>'."
            ) from err
        self._check_splits(names, splits)
        return {name: [_Part(splits[name], f"split {name!r} of {hp.data!r}")] for name in names}

    def _check_splits(self, names: list[str], available: dict) -> None:
        for name in names:
            if name not in available:
                raise ValueError(
                    f"Dataset {self.hparams.data!r} has no split {name!r}; its splits are {list(available)}."
                )

    def _load_file(self, path: Path) -> _Part:
        """One local file; an empty, header-only or malformed one is a ValueError naming it and the fault."""
        with path.open("rb") as lines:
            if not any(line.strip() for line in lines):
                raise ValueError(f"Data file {path} is empty; fill it or remove it.")
        builder = FILE_BUILDERS[path.suffix]
        if builder != "parquet":
            _check_utf8(path)
        # csv cells stay text as written: no "NA" -> null, "007" -> 7, "" -> NaN
        kwargs = {"features": _csv_text_features(path), "keep_default_na": False} if builder == "csv" else {}
        try:
            rows = datasets.load_dataset(
                builder, data_files=str(path), split="train", cache_dir=self.hparams.cache_dir, **kwargs
            )
        except Exception as err:  # datasets / pyarrow / pandas errors, diagnosed for the user
            columns = {column: key for key, column in self._fields().items()}
            raise ValueError(_file_problem(path, builder, err, columns)) from err
        return _Part(rows, f"data file {path}", path)

    def _join(self, parts: list[_Part], encoder: _Encoder) -> datasets.Dataset:
        """The parts' needed columns, type-checked (errors name the file and line), as one dataset."""
        for part in parts:
            for column, key in encoder.columns.items():
                if column not in part.rows.column_names:
                    raise ValueError(
                        f"{part.name} has no column {column!r} ({key}_field); its columns are "
                        f"{part.rows.column_names}. Give every file of a split the same columns."
                    )
                _check_values(part, column, key)
        rows = [part.rows.select_columns(list(encoder.columns)) for part in parts]
        try:
            return datasets.concatenate_datasets(rows)
        except ValueError as err:
            features = "; ".join(f"{part.name}: {part_rows.features}" for part, part_rows in zip(parts, rows))
            raise ValueError(f"Files of one split have different column types ({features}); align them.") from err

    def _fields(self) -> dict[str, str]:
        """The column of each field key."""
        return {key: self.hparams[f"{key}_field"] for key in ("messages", "prompt", "response", "text")}

    def _encoder(self, columns: list[str]) -> _Encoder:
        """The encoder for these columns; raises before any tokenisation if the format or a field is missing."""
        hp = self.hparams
        fields = self._fields()
        data_format = hp.format
        if data_format == "auto":
            found = [fmt for fmt, keys in NEEDS.items() if all(fields[key] in columns for key in keys)]
            if not found:
                raise ValueError(
                    f"Cannot infer the format of {hp.data!r} from its columns {columns}: expected "
                    f"{hp.messages_field!r} (chat), {hp.prompt_field!r} and {hp.response_field!r} (prompt_response) "
                    f"or {hp.text_field!r} (text). Set format= and the matching *_field arguments."
                )
            data_format = found[0]
        for key in NEEDS[data_format]:
            if fields[key] not in columns:
                raise ValueError(
                    f"format={data_format!r} needs the column {fields[key]!r} ({key}_field) but {hp.data!r} has "
                    f"columns {columns}; set {key}_field= to one of them."
                )
        if data_format == "chat" or (data_format == "prompt_response" and hp.use_chat_template):
            self._check_chat_support(data_format)
        tok = self._tokenizer
        # Some tokenizers reuse a structural token as unk (GPT-2: <|endoftext|>); unk can't be counted there.
        structural = {tok.eos_token_id, tok.bos_token_id, tok.pad_token_id, tok.mask_token_id}
        unk_token_id = tok.unk_token_id if tok.unk_token_id not in structural else None
        return _Encoder(
            tok, data_format, fields, hp.mask_history, hp.use_chat_template, hp.max_seq_len, hp.pack_text, unk_token_id
        )

    def _check_chat_support(self, data_format: str) -> None:
        name = self.hparams.tokenizer or "the embedded default"
        if not self._tokenizer.chat_template:
            raise ValueError(
                f"format={data_format!r} uses the chat template, but tokenizer {name!r} has none. Set "
                "tokenizer.chat_template and save it with save_pretrained (or, for prompt/response data, set "
                "use_chat_template=False)."
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
        hp = self.hparams
        answered, chat = raw, encoder.format == "chat"
        if encoder.format != "text":
            key, what = ("messages", "supervised assistant turn") if chat else ("response", "response")
            kwargs = {"chat": chat, "mask_history": encoder.mask_history}
            numbered = raw.add_column("source_row", np.arange(len(raw)))
            answered = _drop(numbered, _answered, encoder.fields[key], kwargs, f"with an empty {what}", split)
            if len(answered) == 0 and len(raw) > 0:
                raise ValueError(
                    f"All {len(raw)} {split} examples of {hp.data!r} have an empty {what}: check the column "
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
        too_long = f"longer than max_seq_len={hp.max_seq_len}"
        if hp.overlong == "truncate_prompt" and encoder.format != "text":
            encoded, too_long = self._truncate_prompts(encoded, split), f"whose response alone is {too_long}"
        fitting = _drop(encoded, _fits, "length", {"max_seq_len": hp.max_seq_len}, too_long, split)
        kept = _drop(fitting, _supervised, "loss_mask", {}, "with no supervised token", split)
        if len(kept) == 0 and len(raw) > 0:
            raise ValueError(
                f"All {len(raw)} {split} examples of {hp.data!r} were dropped (empty responses, {too_long}, or no "
                f"supervised token: see the warnings; format {encoder.format!r}, fields {encoder.fields}). Raise "
                "max_seq_len or set overlong='truncate_prompt', or check the response / messages fields."
            )
        return kept.add_column("example_index", list(range(len(kept))))

    def _truncate_prompts(self, encoded: datasets.Dataset, split: str) -> datasets.Dataset:
        """``encoded`` with overlong examples' prompts cut from the left to fit (those that can); logs the count."""
        max_seq_len = self.hparams.max_seq_len
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

    def train_dataloader(self) -> ResumableLoader:
        self.setup()
        hp = self.hparams
        num_replicas, rank = self._data_parallel()
        lengths = self.train_dataset.with_format("numpy")["length"]
        sampler = EpochBatchSampler(
            lengths, hp.batch_size, hp.seed, num_replicas, rank, hp.drop_last, hp.group_by_length
        )
        if len(sampler) == 0:
            raise ValueError(
                f"The {len(lengths)} training examples make no batch of batch_size={hp.batch_size} x {num_replicas} "
                "data-parallel ranks with drop_last=True; lower batch_size, add data or set drop_last=False."
            )
        self._train_loader = ResumableLoader(
            self.train_dataset.select_columns(BATCH_COLUMNS), sampler, self.collator, hp.num_workers
        )
        if self._resume_state is not None:
            self._train_loader.load_state_dict(self._resume_state)
            self._resume_state = None
        return self._train_loader

    def _eval_loader(self, dataset: datasets.Dataset) -> DataLoader:
        hp = self.hparams
        return DataLoader(
            dataset.select_columns(BATCH_COLUMNS),
            batch_size=hp.val_batch_size or hp.batch_size,
            shuffle=False,
            drop_last=False,
            collate_fn=self.collator,
            num_workers=hp.num_workers,
        )

    def val_dataloader(self) -> DataLoader:
        return self._eval_loader(self._examples("validate"))

    def test_dataloader(self) -> DataLoader:
        """``test_split``'s examples in order; the validation examples when ``test_split`` is None."""
        return self._eval_loader(self._examples("test"))

    def predict_dataloader(self) -> DataLoader:
        """The same examples as ``test_dataloader``, less those named by :meth:`exclude_from_predict`."""
        examples = self._examples("predict")
        if self._predict_exclude:
            indices = examples.with_format("numpy")["example_index"]
            examples = examples.select(np.flatnonzero(~np.isin(indices, list(self._predict_exclude))))
        return self._eval_loader(examples)

    # ------------------------------------------------------------------ source rows (regeneration)
    def _role(self, stage: str) -> str:
        """The split (train, val or test) that ``stage`` reads; test and predict read val without ``test_split``."""
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
                "prompt ends before the first: set data.mask_history=true to make it everything before the last."
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


# ---------------------------------------------------------------------------- local files


def _folder_files(folder: Path) -> dict[str, list[Path]]:
    """The data files of each split of ``folder`` (split names from file names, as in ``datasets``).

    Raises if the folder mixes data file types or has none; warns about the files it skips.
    """
    files = sorted(p for p in folder.rglob("*") if p.is_file() and not p.relative_to(folder).as_posix().startswith("."))
    by_type: dict[str, list[Path]] = {}
    for file in files:
        if file.suffix in FILE_BUILDERS:
            by_type.setdefault(FILE_BUILDERS[file.suffix], []).append(file)

    def names(paths: list[Path]) -> str:
        return ", ".join(path.relative_to(folder).as_posix() for path in paths)

    if len(by_type) > 1:
        kinds = "; ".join(f"{kind}: {names(paths)}" for kind, paths in sorted(by_type.items()))
        raise ValueError(
            f"Data folder {folder} mixes file types ({kinds}), but only one type would be read. Keep one type per "
            "folder, or convert the files to one format."
        )
    if not by_type:
        raise ValueError(
            f"Data folder {folder} holds no data file of a supported type ({', '.join(sorted(FILE_BUILDERS))}); "
            f"found {names(files) or 'nothing'}."
        )
    (data_files,) = by_type.values()
    found = datasets.data_files.DataFilesDict.from_patterns(
        datasets.data_files.get_data_patterns(str(folder)), base_path=str(folder)
    )
    splits = {str(split): [file for file in data_files if str(file) in paths] for split, paths in found.items()}
    unused = [file for file in data_files if not any(file in split_files for split_files in splits.values())]
    skipped = {
        "of an unsupported type": [file for file in files if file.suffix not in FILE_BUILDERS],
        "whose names match no split (train, validation, test, ...)": unused,
    }
    for why, paths in skipped.items():
        if paths:
            log.warning("Ignoring %d file(s) in data folder %s %s: %s.", len(paths), folder, why, names(paths))
    return {split: split_files for split, split_files in splits.items() if split_files}


def _check_utf8(path: Path) -> None:
    """Raise, naming the line and column, at the first byte of the text file ``path`` that is not UTF-8 (``datasets``
    would fail with a bare UnicodeDecodeError). Read in chunks that end at a line end, so no character is split."""
    lines = 0
    with path.open("rb") as file:
        while chunk := file.read(1 << 24) + file.readline():
            try:
                chunk.decode("utf-8")
            except UnicodeDecodeError as err:
                line, line_start = lines + chunk.count(b"\n", 0, err.start) + 1, chunk.rfind(b"\n", 0, err.start) + 1
                raise ValueError(
                    f"Data file {path} line {line} is not UTF-8 (byte "
                    f"{chunk[err.start]:#04x} at column {err.start - line_start + 1}: {err.reason}); data files are "
                    "read as UTF-8. Convert the file (e.g. iconv -f latin1 -t utf-8 if it is Latin-1) or fix that line."
                ) from err
            lines += chunk.count(b"\n")


def _csv_text_features(path: Path) -> datasets.Features:
    """Every column of the csv file ``path`` as a string column."""
    with path.open(newline="", encoding="utf-8", errors="replace") as lines:
        header = next((row for row in csv.reader(lines) if row), [])
    return datasets.Features({name: datasets.Value("string") for name in header})


def _file_problem(path: Path, builder: str, err: Exception, columns: dict[str, str]) -> str:
    """What is wrong with the file ``path``, which ``datasets`` failed to read with ``err``.

    ``columns`` maps the configured field columns to their keys, to name a value of the wrong type.
    """
    if builder == "csv":
        with path.open(newline="", encoding="utf-8", errors="replace") as lines:
            records = list(itertools.islice((row for row in csv.reader(lines) if row), 2))
        if len(records) == 1:
            return f"Data file {path} has only a header row {records[0]} and no data rows; add rows or remove it."
    if builder == "json":
        problem = _json_problem(path, columns)
        if problem:
            return problem
    cause = f" ({err.__cause__})" if err.__cause__ else ""
    return f"Could not read data file {path} as {builder}: {type(err).__name__}: {err}{cause}"


def _json_problem(path: Path, columns: dict[str, str]) -> str | None:
    """The first fault of a JSON Lines file (or JSON document): invalid JSON, a line that is not an object, a
    field column value of the wrong type (``columns``: column -> field key), or a column changing type."""
    text = path.read_text(encoding="utf-8", errors="replace")
    if text.lstrip().startswith("["):
        try:
            json.loads(text)
        except json.JSONDecodeError as err:
            return f"{path} line {err.lineno} is not valid JSON ({err.msg}, column {err.colno})."
        return None
    kinds: dict[str, tuple[str, int]] = {}  # column -> (its JSON type, the line that set it)
    for number, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            return f"{path} line {number} is not valid JSON ({err.msg}, column {err.colno})."
        if not isinstance(record, dict):
            return f"{path} line {number} is not a JSON object: {reprlib.repr(record)}."
        for column, value in record.items():
            if column in columns and not _valid(value, columns[column]):
                return _bad_value(f"{path} line {number}", column, columns[column], value)
            if value is None:
                continue
            kind = JSON_TYPES[type(value)]
            first_kind, first_line = kinds.setdefault(column, (kind, number))
            if kind != first_kind:
                return f"{path} line {number}: column {column!r} is a {kind}, but a {first_kind} on line {first_line}."
    return None


def _json_lines(path: Path) -> list[int] | None:
    """The 1-based line of each record of a JSON Lines file (blank lines hold none); None for a JSON document."""
    lines = path.read_text(encoding="utf-8", errors="replace").split("\n")
    numbers = [number for number, line in enumerate(lines, 1) if line.strip()]
    return None if not numbers or lines[numbers[0] - 1].lstrip().startswith("[") else numbers


# ---------------------------------------------------------------------------- values and tokens


def _valid(value: Any, key: str) -> bool:
    """Whether ``value`` fits field ``key``: a string, or (messages) a list of {role, content} strings."""
    if key != "messages":
        return isinstance(value, str)
    return isinstance(value, list) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value
    )


def _typed(rows: datasets.Dataset, column: str, key: str) -> bool:
    """Fast check on arrow types and null counts, without Python values: does every value of ``column`` fit?"""
    feature, values = rows.features[column], rows.data.column(column)
    if key != "messages":
        return feature in STRINGS and values.null_count == 0
    item = getattr(feature, "feature", None)
    if not (isinstance(item, dict) and all(item.get(name) in STRINGS for name in ("role", "content"))):
        return False
    messages = pc.list_flatten(values)
    nulls = [pc.struct_field(messages, name).null_count for name in ("role", "content")]
    return values.null_count == messages.null_count == sum(nulls) == 0


def _check_values(part: _Part, column: str, key: str) -> None:
    """Raise, naming the file and line, at the first value of ``column`` that does not fit field ``key``."""
    if _typed(part.rows, column, key):
        return
    rows = part.rows.select_columns([column])
    for start in range(0, len(rows), 1000):
        for offset, value in enumerate(rows[start : start + 1000][column]):
            if not _valid(value, key):
                raise ValueError(_bad_value(part.where(start + offset), column, key, value))


def _bad_value(where: str, column: str, key: str, value: Any) -> str:
    expected = EXPECTED.get(key, "a string")
    return f"{where}: column {column!r} ({key}_field) must be {expected}, got {reprlib.repr(value)}; fix or remove it."


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
