"""``DLLMDataModule``: the data room's stages behind one LightningDataModule.

Raw rows come from a source (:mod:`~lit_dllm.data.sources`: a task, a file, a folder, the hub, or a stream of
shards), are encoded into examples (:mod:`~lit_dllm.data.encode`), packed when asked (:mod:`~lit_dllm.data.packing`,
:mod:`~lit_dllm.data.packed_stream`) and loaded as resumable batches (:mod:`~lit_dllm.data.loader`). The data module
holds the settings groups and their cross-group checks, chooses the :class:`~lit_dllm.data.mode.Mode` once, builds the
splits in ``setup``, hands Lightning the loader the mode names and keeps its position.
"""

from __future__ import annotations

import dataclasses
import numbers
from functools import partial
from typing import Any, Callable

import datasets
import lightning as L
import numpy as np
from torch.utils.data import DataLoader
from transformers import PreTrainedTokenizerBase

from lit_dllm import compat
from lit_dllm.data.collate import DLLMCollator
from lit_dllm.data.encode import Encoder, Encoding, encoder_for
from lit_dllm.data.handoff import DataFacts, DataNeeds
from lit_dllm.data.loader import TrainLoader, eval_loader, map_loader
from lit_dllm.data.mode import Mode
from lit_dllm.data.packing import PackedCollator, PackedRows, packed_rows, span_length
from lit_dllm.data.prompts import PromptRows, collate_prompts
from lit_dllm.data.regeneration import SourceRowsMixin
from lit_dllm.data.sources import check_source, raw_splits, stream_source
from lit_dllm.data.packed_stream import PackedStream, StreamLoader
from lit_dllm.data.streaming import StreamingSource
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
from lit_dllm.upgrade import current_data_checkpoint, grouped_data_settings

BATCH_COLUMNS = ["input_ids", "loss_mask", "attention_mask", "example_index"]

GROUPS: dict[str, type[Settings]] = {"source": DataSource, "tokenizer": Tokenizer, "formatting": Formatting,
                                     "collation": Collation, "loader": Loader, "splits": Splits, "task": BuiltinTask}
"""The data module's settings groups: argument -> group class (a config: ``data.init_args.<argument>.<field>``)."""


class DLLMDataModule(SourceRowsMixin, L.LightningDataModule):
    """Tokenised dLLM data in the unshifted format, batched by ``DLLMCollator`` with each example's ``example_index``.

    Batches: ``input_ids`` / ``attention_mask`` (long ``[B, T]``), ``loss_mask`` (float32 ``[B, T]``),
    ``input_lengths`` (long ``[B]``) and ``example_index`` (long ``[B]``, the example's stable index in its
    tokenised split, to key its noise). With ``collation.prompts`` (RL post-training), batches of prompts with their raw
    columns instead, for reward functions (:func:`lit_dllm.data.prompts.collate_prompts`).

    Nothing is dropped or changed silently: examples with an empty response (chat: an empty supervised assistant
    turn), too long or with no supervised token are dropped with a logged count, and unknown tokens are counted
    in a warning. Malformed files (empty, invalid JSON, a csv with only a header, a null or non-string value in a
    needed column) raise a ValueError naming the file, the line and the column (:mod:`lit_dllm.data.files`).

    Chat and prompt/response examples keep their raw row, and predict can leave examples out: what
    :class:`~lit_dllm.callbacks.RegeneratedDataWriter` needs to write a model's own answers as data
    (:class:`~lit_dllm.data.regeneration.SourceRowsMixin`).

    A module and its data module meet once, at the module's ``setup`` (:mod:`lit_dllm.data.handoff`): :meth:`connect`
    checks what the module requires of the batches (e.g. Gemma's whole canvases) and answers with the tokenizer and
    ``max_seq_len``.

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
            ``tokenizer="gpt2"``...: :data:`lit_dllm.upgrade.FLAT_DATA_SETTINGS`), moved into their group with a
            ``DeprecationWarning`` that names the grouped spelling; any other name is a ``TypeError``.
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
        given = grouped_data_settings(given, flat, GROUPS)  # the earlier flat arguments moved in (lit_dllm.upgrade)
        self._groups = _settings_groups(given)
        if isinstance(max_seq_len, bool) or not isinstance(max_seq_len, numbers.Integral) or max_seq_len <= 0:
            raise ValueError(f"max_seq_len must be a positive int, got {max_seq_len!r}.")
        self._max_seq_len, self._seed = max_seq_len, seed
        saved = {name: group.saved() for name, group in self._groups.items()}
        self.save_hyperparameters({**compat.cli_records(), **saved, "max_seq_len": max_seq_len, "seed": seed})
        check_source(self.source, self.splits, self.task)
        self.mode = Mode.of(self.source, self.collation)
        self.mode.check(self.formatting, self.loader, self.collation, max_seq_len)
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
        self.packed_collator = PackedCollator(self.collator, max_seq_len) if self.mode.packs else None
        self.train_dataset: datasets.Dataset | None = None
        self.val_dataset: datasets.Dataset | None = None
        self.test_dataset: datasets.Dataset | None = None
        self._raw: dict[str, datasets.Dataset] = {}  # the raw rows behind each tokenised split (role -> rows)
        self._source_rows: dict[str, np.ndarray] = {}  # role -> each example's row in _raw[role] (not for text)
        self._encoded_with: Encoder | None = None  # the encoder of the built splits
        self._built = False
        self._train_loader: TrainLoader | None = None
        self._resume_state: dict | None = None

    @compat.lightning_classmethod  # as Lightning's own: refuses a call on an instance
    def load_from_checkpoint(cls, checkpoint_path, *args, **kwargs):
        """Lightning's ``load_from_checkpoint``, a checkpoint of an earlier layout brought to today's groups as read
        (:func:`~lit_dllm.upgrade.current_data_checkpoint`)."""
        with compat.converting_checkpoints(partial(current_data_checkpoint, groups=GROUPS)):
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

    # ------------------------------------------------------------------ the hand-off (lit_dllm.data.handoff)
    def connect(self, needs: DataNeeds) -> DataFacts:
        """Check what the module requires of the batches (its collation, whether it packs) against this data module's
        settings, and answer with what the module needs to know of the data. A ``ValueError`` names the setting to
        change and the module; this runs at the module's ``setup``, before its model is built."""
        problem = needs.packing_problem(self.collation.pad_block_size) if self.mode.packs else None
        if problem:
            raise ValueError(f"data.init_args.collation.pack: true, but {needs.module} cannot train on packed rows: "
                             f"{problem}.")
        unknown = sorted(set(needs.collation) - {field.name for field in dataclasses.fields(Collation)})
        if unknown:
            raise TypeError(f"{needs.module}.required_collation() names {unknown}, which are not settings of the data "
                            "module's collation group (lit_dllm.settings.Collation).")
        wrong = {name: value for name, value in needs.collation.items() if getattr(self.collation, name) != value}
        if wrong:
            have = ", ".join(f"collation.{name}={getattr(self.collation, name)!r}" for name in wrong)
            fix = " and ".join(f"data.init_args.collation.{name}: {_yaml(value)}" for name, value in wrong.items())
            raise ValueError(f"{needs.module} requires a collation the data module does not have ({have}): set {fix}.")
        rounded = None if self.mode.packs else self.collator.row_multiple  # packed rows: max_seq_len wide
        return DataFacts(self._tokenizer, self.max_seq_len, self.loader.batch_size, rounded)

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
        if not self._built:
            self._build()

    def _build(self) -> None:
        streamed = self.mode is Mode.STREAMED  # the training split is streamed by train_dataloader
        raw, encoder = raw_splits(self.source, self.splits, self.task, self.seed, streamed=streamed,
                                  all_columns=self.mode is Mode.PROMPTS, encoder_for=self._encoder,
                                  stream=self._stream_source)
        encoding = Encoding(encoder, self.source.path, self.max_seq_len, self.formatting.overlong,
                            split_long_documents=self.mode.packs and self.collation.long_documents == "split")
        tokenized = {split: encoding(dataset, split) for split, dataset in raw.items()}
        numbered = {split: examples for split, examples in tokenized.items() if "source_row" in examples.column_names}
        self._source_rows = {split: examples.with_format("numpy")["source_row"] for split, examples in numbered.items()}
        tokenized |= {split: examples.remove_columns("source_row") for split, examples in numbered.items()}
        self.train_dataset, self.val_dataset, self.test_dataset = map(tokenized.get, ("train", "val", "test"))
        self._raw, self._encoded_with, self._built = raw, encoder, True

    def _encoder(self, columns: list[str]) -> Encoder:
        return encoder_for(columns, self.source, self.formatting, self._tokenizer, self.tokenizer_settings.name,
                           self.max_seq_len, self.mode)

    # ------------------------------------------------------------------ loaders
    def _data_parallel(self) -> tuple[int, int]:
        """(num_replicas, rank) of the data-parallel group; (1, 0) without a distributed trainer."""
        kwargs = self.trainer.distributed_sampler_kwargs if self.trainer is not None else None
        return (kwargs["num_replicas"], kwargs["rank"]) if kwargs else (1, 0)

    def train_dataloader(self) -> TrainLoader:
        """This rank's training batches, resumable mid-epoch, as the :attr:`mode` says: examples padded per batch,
        packed rows, a stream of packed rows, or prompts."""
        self.setup()
        self._train_loader = self._stream_loader() if self.mode is Mode.STREAMED else self._map_loader()
        if self._resume_state is not None:
            self._train_loader.load_state_dict(self._resume_state)
            self._resume_state = None
        return self._train_loader

    def _map_loader(self) -> TrainLoader:
        num_replicas, rank = self._data_parallel()
        lengths = self.train_dataset.with_format("numpy")["length"]
        examples = self.train_dataset.select_columns(BATCH_COLUMNS)
        if self.mode is not Mode.PACKED:
            dataset, collate = self._served(examples, "train")
            return map_loader(dataset, collate, lengths, self.loader, self.seed, num_replicas, rank)
        block_size = self.collation.pad_block_size
        rows = packed_rows(lengths, block_size, self.max_seq_len, self.collation.pack_window, self.seed)
        tokens = [sum(span_length(int(lengths[i]), block_size) for i in row) for row in rows]
        return map_loader(PackedRows(examples), self.packed_collator, tokens, self.loader, self.seed, num_replicas,
                          rank, rows=rows)

    def _stream_source(self) -> StreamingSource:
        """This rank's share of the training shards."""
        num_replicas, rank = self._data_parallel()
        return stream_source(self.source, self.splits, rank, num_replicas)

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

    def _served(self, examples: datasets.Dataset, role: str) -> tuple[datasets.Dataset | PromptRows, Callable]:
        """(dataset, collate) that serve ``examples`` of the split ``role`` one example a row: prompts with their raw
        rows (``Mode.PROMPTS``), else the collator's padded rows."""
        if self.mode is not Mode.PROMPTS:
            return examples, self.collator
        encoder = self._encoded_with
        rows = PromptRows(examples, self._raw[role], self._source_rows[role], encoder.columns, self._tokenizer,
                          encoder.mask_history)
        return rows, collate_prompts

    def _eval_loader(self, examples: datasets.Dataset, stage: str) -> DataLoader:
        dataset, collate = self._served(examples.select_columns(BATCH_COLUMNS), self._role(stage))
        return eval_loader(dataset, collate, self.loader)

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
        return self._eval_loader(self._predictable(self._examples("predict")), "predict")

    # ------------------------------------------------------------------ splits
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


def _settings_groups(given: dict[str, Any]) -> dict[str, Settings]:
    """The data module's groups (:data:`GROUPS`), checked: ``given`` (each a group, a dict of its fields, or None: the
    defaults)."""
    groups = {}
    for name, kind in GROUPS.items():
        value = given[name]
        if dataclasses.is_dataclass(value) and not isinstance(value, kind):
            raise TypeError(f"DLLMDataModule's {name} must be a {kind.__name__} (lit_dllm.settings), got "
                            f"{type(value).__name__}.")
        values = ({field.name: getattr(value, field.name) for field in dataclasses.fields(value)}
                  if dataclasses.is_dataclass(value) else dict(value or {}))
        groups[name] = settings_group(name, kind, values)
    return groups


def _yaml(value: Any) -> str:
    """``value`` as YAML writes it (``true``, ``null``, ``8``)."""
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
