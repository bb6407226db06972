"""Load: examples -> batches. Training batches resume mid-epoch: every training loader is a :class:`TrainLoader`
(``state_dict`` / ``load_state_dict``, which Lightning checkpoints so a resumed fit continues with the next unseen
batch): :class:`ResumableLoader` over a split read whole (``EpochBatchSampler``: seeded per epoch, sharded by
data-parallel rank, optionally length-grouped), or :class:`~lit_dllm.data.packed_stream.StreamLoader` over a stream.
Evaluation batches come in order (:func:`eval_loader`)."""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterator, Protocol, Sequence, runtime_checkable

import datasets
import numpy as np
from torch.utils.data import DataLoader, Dataset

from lit_dllm.settings import Loader

log = logging.getLogger(__name__)


@runtime_checkable
class TrainLoader(Protocol):
    """What the data module hands Lightning for training, whatever the mode: batches, and a position that a checkpoint
    saves and a resume sets (never adds to: restoring one state twice is harmless)."""

    def __iter__(self) -> Iterator[dict[str, Any]]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


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

    ``rows`` (packed training): the units are these rows of example indices (:func:`~lit_dllm.data.packing.
    pack_windows`) instead of the examples, ``lengths`` being each row's tokens; a batch is then a list of
    ``batch_size`` rows, each a list of example indices.
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
        rows: list[list[int]] | None = None,
    ) -> None:
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank must be in [0, num_replicas={num_replicas}), got {rank}.")
        if rows is not None and len(rows) != len(lengths):
            raise ValueError(f"{len(rows)} packed rows but {len(lengths)} lengths: give one length per row.")
        self.lengths, self.rows = np.asarray(lengths), rows
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
        batches = [batch[self.rank :: self.num_replicas].tolist() for batch in global_batches]
        return batches if self.rows is None else [[self.rows[unit] for unit in batch] for batch in batches]

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
    ``batches`` already shards by data-parallel rank. Lightning saves ``state_dict()`` in checkpoints. The cursor
    advances when a batch is handed to the consumer (not when workers prefetch it).

    The loader keeps its own epoch count instead of following Lightning's epochs: the batches are one sequence of
    epochs, whatever Lightning's loops cut from it. Each pass continues after the last batch handed out, and moves
    to the next epoch where this one is used up. Lightning's epochs do not always line up with the data's: a
    checkpoint written when ``max_steps`` stops a run mid-epoch already counts that epoch as done, and a run
    resumed from a checkpoint written at an epoch's last batch takes one batch more in that epoch before it starts
    the next (Lightning 2.6), so a pass left before its end (that, or ``limit_train_batches``) is continued, never
    skipped. Every batch carries its data ``epoch``, which keys its noise.
    """

    def __init__(
        self, dataset: datasets.Dataset, batches: EpochBatchSampler, collate_fn: Callable, num_workers: int = 0
    ) -> None:
        self.dataset, self.batches, self.collate_fn, self.num_workers = dataset, batches, collate_fn, num_workers

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[dict]:
        # A generator: nothing happens until the first ``next`` (Lightning also calls ``iter`` just to check).
        if self.batches.cursor >= len(self.batches):  # a pass left right after the epoch's last batch
            self.batches.set_epoch(self.batches.epoch + 1)
        loader = DataLoader(
            self.dataset, batch_sampler=list(self.batches), collate_fn=self.collate_fn, num_workers=self.num_workers
        )
        for batch in loader:
            self.batches.cursor += 1
            yield {**batch, "epoch": self.batches.epoch}
        self.batches.set_epoch(self.batches.epoch + 1)

    def state_dict(self) -> dict[str, int]:
        return self.batches.state_dict()

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.batches.load_state_dict(state)


def map_loader(dataset: Dataset, collate: Callable, lengths: Sequence[int], settings: Loader, seed: int,
               num_replicas: int = 1, rank: int = 0, rows: list[list[int]] | None = None) -> ResumableLoader:
    """This rank's resumable training batches of ``dataset``: its examples, of these ``lengths``, or with ``rows``
    its packed rows (``dataset`` then read a row at a time), ``lengths`` then each row's tokens. A ``ValueError``
    names the fix when no batch fits."""
    sampler = EpochBatchSampler(lengths, settings.batch_size, seed, num_replicas, rank, settings.drop_last,
                                settings.group_by_length, rows=rows)
    if len(sampler) == 0:
        what = f"{len(lengths)} training examples" if rows is None else f"{len(rows)} packed rows"
        raise ValueError(
            f"The {what} make no batch of loader.batch_size={settings.batch_size} x {num_replicas} data-parallel "
            "ranks with loader.drop_last=True; lower loader.batch_size, add data or set loader.drop_last=False."
        )
    return ResumableLoader(dataset, sampler, collate, settings.num_workers)


def eval_loader(dataset: Dataset, collate: Callable, settings: Loader) -> DataLoader:
    """``dataset``'s batches in order, of ``val_batch_size`` (else ``batch_size``), the last one short."""
    return DataLoader(dataset, batch_size=settings.val_batch_size or settings.batch_size, shuffle=False,
                      drop_last=False, collate_fn=collate, num_workers=settings.num_workers)
