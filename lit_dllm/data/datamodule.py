"""``DLLMDataModule``: data (hub, local files or built-in tasks) -> tokenised unshifted examples -> dLLM batches.

Training batches come from ``EpochBatchSampler`` (seeded per epoch, sharded by data-parallel rank, optionally
length-grouped) through ``ResumableLoader``, which Lightning checkpoints so a resumed fit continues with the
next unseen batch.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any, Callable, Iterator

import datasets
import lightning as L
import numpy as np
from torch.utils.data import DataLoader
from transformers import PreTrainedTokenizerBase

from lit_dllm.data.collate import DLLMCollator
from lit_dllm.data.formats import encode_chat, encode_prompt_response, encode_texts
from lit_dllm.data.tasks import get_task, make_task_splits
from lit_dllm.data.tokenizer import load_tokenizer

log = logging.getLogger(__name__)

TASK_PREFIX = "task:"
FORMATS = ("auto", "chat", "prompt_response", "text")
FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv", ".txt": "text"}
BATCH_COLUMNS = ["input_ids", "loss_mask", "attention_mask", "example_index"]


class EpochBatchSampler:
    """This data-parallel rank's batches of each epoch, with a cursor so an epoch can resume mid-way.

    Each epoch shuffles all examples with ``seed`` and the epoch number and cuts the order into global batches of
    ``batch_size * num_replicas`` examples; rank ``r`` takes every ``num_replicas``-th example of each, starting at
    ``r`` (strided like ``DistributedSampler``). With ``group_by_length`` the shuffled order is sorted by length
    within mega-batches of ``mega_batch_size`` global batches and the global batches are shuffled again, so a
    batch holds examples of similar length. ``drop_last`` drops the incomplete last global batch; otherwise the
    order is padded by wrapping around to a multiple of ``num_replicas``.

    ``epoch`` and ``cursor`` (batches of the epoch already consumed) form the resumable state; ``set_epoch``
    moves to a new epoch's start and keeps the cursor when the epoch is unchanged (a resumed epoch).
    """

    def __init__(
        self,
        lengths: list[int],
        batch_size: int,
        seed: int,
        num_replicas: int = 1,
        rank: int = 0,
        drop_last: bool = True,
        group_by_length: bool = False,
        mega_batch_size: int = 50,
    ) -> None:
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank must be in [0, num_replicas={num_replicas}), got {rank}.")
        self.lengths = np.asarray(lengths)
        self.batch_size, self.seed, self.num_replicas, self.rank = batch_size, seed, num_replicas, rank
        self.drop_last, self.group_by_length, self.mega_batch_size = drop_last, group_by_length, mega_batch_size
        self.epoch = 0
        self.cursor = 0

    @property
    def global_batch_size(self) -> int:
        return self.batch_size * self.num_replicas

    def __len__(self) -> int:
        num_examples = len(self.lengths)
        if self.drop_last:
            return num_examples // self.global_batch_size
        return -(-num_examples // self.global_batch_size)

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.epoch, self.cursor = epoch, 0

    def epoch_batches(self, epoch: int) -> list[list[int]]:
        """This rank's batches of ``epoch``: a pure function of the seed, epoch and batch layout."""
        rng = np.random.default_rng([self.seed, epoch])
        order = rng.permutation(len(self.lengths))
        if self.group_by_length:
            mega = self.mega_batch_size * self.global_batch_size
            chunks = [order[start : start + mega] for start in range(0, len(order), mega)]
            order = np.concatenate([chunk[np.argsort(-self.lengths[chunk], kind="stable")] for chunk in chunks])
        if self.drop_last:
            order = order[: len(self) * self.global_batch_size]
        else:
            order = np.resize(order, -(-len(order) // self.num_replicas) * self.num_replicas)  # wraps around
        size = self.global_batch_size
        global_batches = [order[start : start + size] for start in range(0, len(order), size)]
        if self.group_by_length:
            global_batches = [global_batches[i] for i in rng.permutation(len(global_batches))]
        return [batch[self.rank :: self.num_replicas].tolist() for batch in global_batches]

    def __iter__(self) -> Iterator[list[int]]:
        """The current epoch's batches from the cursor on (the caller advances the cursor as it consumes them)."""
        return iter(self.epoch_batches(self.epoch)[self.cursor :])

    def state_dict(self) -> dict[str, int]:
        """Position as global samples consumed, so a resume with another data-parallel size finds it too."""
        return {
            "epoch": self.epoch,
            "samples_consumed": self.cursor * self.global_batch_size,
            "num_examples": len(self.lengths),
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Set (never add to) the position, so restoring the same state twice is harmless."""
        if state["num_examples"] != len(self.lengths):
            log.warning(
                "Resuming on %d training examples, but the checkpoint was taken on %d: the data changed, so the "
                "resumed epoch may repeat or skip examples.",
                len(self.lengths),
                state["num_examples"],
            )
        self.epoch, self.cursor = state["epoch"], state["samples_consumed"] // self.global_batch_size
        if state["samples_consumed"] % self.global_batch_size:
            log.warning(
                "The checkpoint's position (%d samples into epoch %d) is not a whole number of global batches of %d; "
                "resuming at the batch before it.",
                state["samples_consumed"],
                self.epoch,
                self.global_batch_size,
            )
        if self.cursor >= len(self):
            self.set_epoch(self.epoch + 1)


class ResumableLoader:
    """The training loader: this rank's collated batches, resumable mid-epoch through Lightning checkpoints.

    Not a ``DataLoader`` subclass on purpose: Lightning would swap in a ``DistributedSampler`` under DDP, while
    ``sampler`` already shards by data-parallel rank. Lightning finds ``sampler.set_epoch`` and calls it each epoch,
    and saves ``state_dict()`` in checkpoints. The cursor advances when a batch is handed to the consumer (not
    when workers prefetch it), and a finished epoch moves the sampler to the next one.
    """

    def __init__(
        self, dataset: datasets.Dataset, sampler: EpochBatchSampler, collate_fn: Callable, num_workers: int = 0
    ) -> None:
        self.dataset, self.sampler, self.collate_fn, self.num_workers = dataset, sampler, collate_fn, num_workers

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self) -> Iterator[dict]:
        # A generator: the batches are drawn at the first ``next``, after Lightning has set the epoch.
        batches = list(self.sampler)
        loader = DataLoader(
            self.dataset, batch_sampler=batches, collate_fn=self.collate_fn, num_workers=self.num_workers
        )
        for batch in loader:
            self.sampler.cursor += 1
            yield batch
        self.sampler.set_epoch(self.sampler.epoch + 1)

    def state_dict(self) -> dict[str, int]:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.sampler.load_state_dict(state)


@dataclasses.dataclass(frozen=True)
class _Encoder:
    """Batched ``datasets.map`` function: raw columns -> unshifted examples plus their ``length``."""

    tokenizer: PreTrainedTokenizerBase
    format: str
    fields: dict[str, str]
    mask_history: bool
    use_chat_template: bool
    max_seq_len: int
    pack_text: bool

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
        return columns


class DLLMDataModule(L.LightningDataModule):
    """Tokenised dLLM data in the unshifted format, batched by ``DLLMCollator`` with each example's ``example_index``.

    Batches: ``input_ids`` / ``attention_mask`` (long ``[B, T]``), ``loss_mask`` (float32 ``[B, T]``),
    ``input_lengths`` (long ``[B]``) and ``example_index`` (long ``[B]``, the example's stable index in its
    tokenised split, to key its noise).

    Args:
        data: ``task:<name>`` (a built-in task: reverse, sort, add), a local json/jsonl/parquet/csv/txt file or a
            folder of them, or a hub dataset id.
        data_config: hub dataset configuration name.
        format: ``auto`` (by columns: messages -> chat, prompt and response -> prompt_response, text -> text),
            ``chat``, ``prompt_response`` or ``text``.
        prompt_field, response_field, messages_field, text_field: column names (e.g. GSM8K: question/answer).
        mask_history: chat: supervise only the last assistant turn.
        use_chat_template: prompt_response: wrap the pair in the tokenizer's chat template as a user and an
            assistant turn.
        pack_text: text: pack documents (eos-separated) into ``max_seq_len`` chunks, else chunk each document.
        tokenizer: hub id or local path of a ``transformers`` tokenizer; None for the embedded default.
        mask_token: mask token to add when the tokenizer has none (the model's embedding must cover
            ``vocab_size``).
        trust_remote_code: for ``AutoTokenizer.from_pretrained``.
        max_seq_len: chat and prompt/response examples longer than this are dropped (logged count); text is
            cut to it; the collator caps batches at it.
        pad_block_size: the collator's ``block_size`` (EOS block fill; named as the reference's
            ``dllm.pad_block_size``, apart from the module's corruption ``block_size``).
        pad_seq_len_divisible, response_window, supervise_padding: ``DLLMCollator`` options.
        batch_size: per-device training batch size.
        val_batch_size: per-device validation batch size (default ``batch_size``).
        train_split: dataset split for training (built-in tasks generate their own train and val sets).
        val_split: dataset split for validation; None holds out ``val_fraction`` of ``train_split``.
        val_fraction: held-out fraction (deterministic given ``seed``), in (0, 1).
        max_train_examples, max_val_examples: keep the first N raw examples of each split.
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
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self._check_args()
        self._tokenizer = load_tokenizer(tokenizer, mask_token, trust_remote_code)
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
        self._train_loader: ResumableLoader | None = None
        self._resume_state: dict | None = None

    def _check_args(self) -> None:
        hp = self.hparams
        for name in ("batch_size", "val_batch_size", "max_seq_len", "task_num_train", "task_num_val"):
            if hp[name] is not None and hp[name] <= 0:
                raise ValueError(f"{name} must be a positive int, got {hp[name]!r}.")
        if not 0 < hp.val_fraction < 1:
            raise ValueError(f"val_fraction must be in (0, 1), got {hp.val_fraction!r}; or name a val_split.")
        if hp.format not in FORMATS:
            raise ValueError(f"Unknown data format {hp.format!r}; choose one of {list(FORMATS)}.")
        if hp.data.startswith(TASK_PREFIX):
            get_task(hp.data[len(TASK_PREFIX) :], **(hp.task_kwargs or {}))
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
        """Load and tokenise both splits; ``datasets`` caches the work for file and hub data."""
        self._build()

    def setup(self, stage: str | None = None) -> None:
        """Load the tokenised splits (from ``datasets``' cache when ``prepare_data`` ran in another process).

        The loaders call it too, so ``train_dataloader()`` works without an explicit setup.
        """
        if self.train_dataset is None:
            self._build()

    def _build(self) -> None:
        train, val = self._load_raw()
        encoder = self._encoder(train.column_names)
        self.train_dataset = self._tokenize(train, encoder, "train")
        self.val_dataset = self._tokenize(val, encoder, "val")

    def _load_raw(self) -> tuple[datasets.Dataset, datasets.Dataset]:
        hp = self.hparams
        if hp.data.startswith(TASK_PREFIX):
            train, val = make_task_splits(
                hp.data[len(TASK_PREFIX) :], hp.task_num_train, hp.task_num_val, hp.seed, **(hp.task_kwargs or {})
            )
        else:
            splits = self._load_dataset_dict()
            train = self._split(splits, hp.train_split)
            if hp.val_split is not None:
                val = self._split(splits, hp.val_split)
            else:
                held_out = train.train_test_split(test_size=hp.val_fraction, seed=hp.seed)
                train, val = held_out["train"], held_out["test"]
        return _first(train, hp.max_train_examples), _first(val, hp.max_val_examples)

    def _load_dataset_dict(self) -> datasets.DatasetDict:
        hp = self.hparams
        path = Path(hp.data)
        if path.is_file():
            builder = FILE_BUILDERS.get(path.suffix)
            if builder is None:
                raise ValueError(f"Unsupported data file {hp.data!r}; use one of {sorted(FILE_BUILDERS)}.")
            return datasets.load_dataset(builder, data_files={"train": str(path)}, cache_dir=hp.cache_dir)
        if path.is_dir():  # datasets infers the file format and the splits from the file names
            return datasets.load_dataset(str(path), cache_dir=hp.cache_dir)
        try:
            return datasets.load_dataset(hp.data, name=hp.data_config, cache_dir=hp.cache_dir)
        except (ConnectionError, FileNotFoundError, OSError) as err:
            raise ValueError(
                f"Could not load dataset {hp.data!r}: it is not a local file or folder, and the hub is unreachable "
                f"or has no such dataset ({err}). Pass a local json/jsonl/parquet/csv path or 'task:<name>'."
            ) from err

    def _split(self, splits: datasets.DatasetDict, name: str) -> datasets.Dataset:
        if name not in splits:
            raise ValueError(f"Dataset {self.hparams.data!r} has no split {name!r}; its splits are {list(splits)}.")
        return splits[name]

    def _encoder(self, columns: list[str]) -> _Encoder:
        """The encoder for these columns; raises before any tokenisation if the format or a field is missing."""
        hp = self.hparams
        fields = {
            "messages": hp.messages_field,
            "prompt": hp.prompt_field,
            "response": hp.response_field,
            "text": hp.text_field,
        }
        needs = {"chat": ["messages"], "prompt_response": ["prompt", "response"], "text": ["text"]}
        data_format = hp.format
        if data_format == "auto":
            found = [fmt for fmt, keys in needs.items() if all(fields[key] in columns for key in keys)]
            if not found:
                raise ValueError(
                    f"Cannot infer the format of {hp.data!r} from its columns {columns}: expected "
                    f"{hp.messages_field!r} (chat), {hp.prompt_field!r} and {hp.response_field!r} (prompt_response) "
                    f"or {hp.text_field!r} (text). Set format= and the matching *_field arguments."
                )
            data_format = found[0]
        for key in needs[data_format]:
            if fields[key] not in columns:
                raise ValueError(
                    f"format={data_format!r} needs the column {fields[key]!r} ({key}_field) but {hp.data!r} has "
                    f"columns {columns}; set {key}_field= to one of them."
                )
        if data_format == "chat" or (data_format == "prompt_response" and hp.use_chat_template):
            self._check_chat_support(data_format)
        return _Encoder(
            self._tokenizer, data_format, fields, hp.mask_history, hp.use_chat_template, hp.max_seq_len, hp.pack_text
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

    def _tokenize(self, raw: datasets.Dataset, encoder: _Encoder, split: str) -> datasets.Dataset:
        """Encode, drop examples that are too long or unsupervised (logged counts), and number the rest."""
        hp = self.hparams
        encoded = raw.map(encoder, batched=True, remove_columns=raw.column_names, desc=f"Tokenizing {split}")
        too_long = f"longer than max_seq_len={hp.max_seq_len}"
        fitting = _drop(encoded, _fits, "length", {"max_seq_len": hp.max_seq_len}, too_long, split)
        kept = _drop(fitting, _supervised, "loss_mask", {}, "with no supervised token", split)
        if len(kept) == 0 and len(encoded) > 0:
            raise ValueError(
                f"All {len(encoded)} {split} examples of {hp.data!r} were dropped ({len(encoded) - len(fitting)} "
                f"longer than max_seq_len={hp.max_seq_len}, the rest with no supervised token; format "
                f"{encoder.format!r}, fields {encoder.fields}). Raise max_seq_len, or check the response / messages "
                "fields."
            )
        return kept.add_column("example_index", list(range(len(kept))))

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

    def val_dataloader(self) -> DataLoader:
        self.setup()
        hp = self.hparams
        return DataLoader(
            self.val_dataset.select_columns(BATCH_COLUMNS),
            batch_size=hp.val_batch_size or hp.batch_size,
            shuffle=False,
            drop_last=False,
            collate_fn=self.collator,
            num_workers=hp.num_workers,
        )

    def test_dataloader(self) -> DataLoader:
        """The held-out examples, in order (the validation set: name another split with ``val_split``)."""
        return self.val_dataloader()

    def predict_dataloader(self) -> DataLoader:
        """The validation examples, in order."""
        return self.val_dataloader()

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
