"""The packing and loading side of a stream: :class:`PackedStream` packs a
:class:`~lit_dllm.data.streaming.StreamingSource`'s documents into batches on the fly, :class:`StreamLoader` hands
them out through torchdata's ``StatefulDataLoader``, resumable bit-exactly (its state Lightning checkpoints).
"""

from __future__ import annotations

import collections
import copy
import logging
from itertools import islice
from typing import Any, Callable, Iterator

import numpy as np
import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from lit_dllm.data.packing import PackedCollator, pack_documents, span_length
from lit_dllm.data.streaming import PIECE_BITS, SEQUENCE_KEYS, StreamingSource
from lit_dllm.settings import LONG_DOCUMENTS

log = logging.getLogger(__name__)

__all__ = ["COUNTS", "PackedStream", "StreamLoader"]

COUNTS = ("documents", "tokens", "long_split", "long_dropped", "empty_dropped")
"""The counters of a stream: documents and real tokens delivered (pieces count as documents; no block fill or
padding), documents longer than a row split or dropped, and documents of no token dropped."""


# ---------------------------------------------------------------------------- packing


class PackedStream(torch.utils.data.IterableDataset):
    """The source's documents packed on the fly into batches of ``batch_size`` rows of ``collator.pack_length``.

    Documents are read ``window`` at a time (a worker holds a window: 9 bytes a token); a window's documents are
    packed best-fit decreasing (with a ``seed`` its rows are then shuffled, seeded by ``(seed, epoch, the window's
    first example_index)``, and the shard order by ``(seed, epoch)``). Documents that take more than a row (block fill
    included) are cut into pieces of at most ``pack_length`` tokens (whole blocks) with ``long_documents="split"``,
    each piece its own document and ``example_index``, or dropped with ``"drop"``; documents of no token are dropped.
    Both are counted (:attr:`counts`, also in the state) and logged.

    Epochs: an epoch is one pass over the source; the stream then goes on to the next (forever, or for ``epochs``
    epochs), so each worker of each rank always has a next batch (a fit runs to ``max_steps``). An epoch's last batch
    may hold fewer rows; no batch mixes epochs. Each batch is :class:`PackedCollator`'s plus ``"epoch"`` (int): the
    data epoch of its documents, which keys their noise. Workers move through epochs each at its own pace.

    State (torchdata's ``Stateful``: ``StatefulDataLoader`` calls it in each worker after each batch): the epoch, the
    ``datasets`` stream's ``state_dict()`` at the start of the current window, how many of the window's rows were
    yielded, the counts and the layout (:meth:`layout`). A resume reloads the stream at the window's start, reads and
    packs the same window again (reading, splitting, packing and shuffling are deterministic) and skips the rows
    already yielded. It needs the same layout: another one is a ValueError naming the difference.
    """

    def __init__(
        self,
        source: StreamingSource,
        encode: Callable[[dict], dict],
        collator: PackedCollator,
        batch_size: int,
        window: int = 1000,
        long_documents: str = "split",
        seed: int | None = None,
        epochs: int | None = None,
    ) -> None:
        for name, value in (("batch_size", batch_size), ("window", window), ("epochs", epochs)):
            if value is not None and (not isinstance(value, int) or value <= 0):
                raise ValueError(f"{name} must be a positive int, got {value!r}.")
        if long_documents not in LONG_DOCUMENTS:
            raise ValueError(f"long_documents must be one of {LONG_DOCUMENTS}, got {long_documents!r}.")
        self.source, self.encode, self.collator, self.batch_size = source, encode, collator, batch_size
        self.window, self.long_documents, self.seed, self.epochs = window, long_documents, seed, epochs
        self.block_size = collator.collator.block_size
        self.piece = collator.pack_length - collator.pack_length % (self.block_size or 1)  # whole blocks
        if self.piece <= 0:
            raise ValueError(f"block_size={self.block_size} is larger than pack_length={collator.pack_length}.")
        self._state: dict[str, Any] = {"epoch": 0, "window": None, "rows": 0, "stream_counts": dict.fromkeys(COUNTS, 0)}
        self._warned = False

    @property
    def counts(self) -> dict[str, int]:
        """This stream's counters (:data:`COUNTS`); in a loader with workers, each worker keeps its own
        (:attr:`StreamLoader.counts` sums them)."""
        return dict(self._state["stream_counts"])

    def layout(self) -> dict[str, Any]:
        """What a saved position holds only for: the shards (their count and each one's
        :func:`~lit_dllm.data.streaming.shard_identity`), the data-parallel size and rank, the seed and the loader
        workers (as seen from here: in a worker, its loader's; else 0)."""
        worker = torch.utils.data.get_worker_info()
        return {"num_shards": self.source.num_shards, "world_size": self.source.world_size, "rank": self.source.rank,
                "seed": self.seed, "num_workers": worker.num_workers if worker else 0,
                "shards": list(self.source.identities)}

    def state_dict(self) -> dict[str, Any]:
        return {**copy.deepcopy(self._state), "layout": self.layout()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        _check_layout(state["layout"], self.layout())
        self._state = {key: copy.deepcopy(value) for key, value in state.items() if key != "layout"}

    def __iter__(self) -> Iterator[dict[str, Any]]:
        while self.epochs is None or self._state["epoch"] < self.epochs:
            if not (yield from self._epoch()):
                return  # this worker has no shard

    def _epoch(self) -> Iterator[dict[str, Any]]:
        """The rest of the current epoch's batches; returns whether the epoch held any document."""
        state = self._state
        epoch, start, skip = state["epoch"], state["window"], state["rows"]
        from_start = start is None and skip == 0
        documents = self.source.dataset(self.encode, epoch, self.seed)
        if start is not None:
            documents.load_state_dict(start)
        stream, pending, rows_made = iter(documents), [], 0
        window_start, count = start, skip == 0  # a window being resumed was counted before its state was saved
        while docs := list(islice(stream, self.window)):
            rows = self._pack(docs, epoch, count)
            rows_made += len(rows)
            for number in range(skip, len(rows)):
                pending.append(rows[number])
                if len(pending) == self.batch_size:
                    state.update(window=window_start, rows=number + 1)
                    yield self._batch(pending, epoch)
                    pending = []
            window_start, skip, count = documents.state_dict(), 0, True
        if from_start and window_start is None:
            return False  # nothing read from the epoch's start: no shard here
        if from_start and not rows_made:
            raise ValueError(f"Epoch {epoch} of {self.source.name} left no document to train on (counts: "
                             f"{self.counts}); see long_documents={self.long_documents!r} and the empty documents.")
        state.update(epoch=epoch + 1, window=None, rows=0)
        if pending:
            yield self._batch(pending, epoch)
        return True

    def _pack(self, docs: list[dict], epoch: int, count: bool) -> list[list[dict]]:
        """A window's documents as rows: long ones split or dropped, empty ones dropped (counted when ``count``)."""
        pack_length = self.collator.pack_length
        kept, found = [], dict.fromkeys(("long_split", "long_dropped", "empty_dropped"), 0)
        for doc in docs:
            length = len(doc["input_ids"])
            if length == 0:
                found["empty_dropped"] += 1
            elif span_length(length, self.block_size) <= pack_length:
                kept.append(doc)
            elif self.long_documents == "drop":
                found["long_dropped"] += 1
            else:
                found["long_split"] += 1
                starts = range(0, length, self.piece)
                if len(starts) > 1 << PIECE_BITS:
                    name, row, _ = self.source.locate(doc["example_index"])
                    raise ValueError(f"Record {row} of {name} ({length} tokens) makes more than {1 << PIECE_BITS} "
                                     f"pieces of {self.piece} tokens; raise pack_length or cut the record.")
                kept += [{**{key: doc[key][at : at + self.piece] for key in SEQUENCE_KEYS},
                          "example_index": doc["example_index"] + piece} for piece, at in enumerate(starts)]
        if count:
            self._count(found)
        if not kept:
            return []
        spans = [span_length(len(doc["input_ids"]), self.block_size) for doc in kept]
        rows = [[kept[i] for i in row] for row in pack_documents(spans, pack_length)]
        if self.seed is not None:
            order = np.random.default_rng([self.seed, epoch, docs[0]["example_index"]]).permutation(len(rows))
            rows = [rows[i] for i in order]
        return rows

    def _count(self, found: dict[str, int]) -> None:
        counts = self._state["stream_counts"]
        for key, number in found.items():
            counts[key] += number
        if found["long_split"] or found["long_dropped"] or found["empty_dropped"]:
            level = logging.DEBUG if self._warned else logging.WARNING
            self._warned = True
            log.log(level, "%s: %d document(s) longer than pack_length=%d %s and %d of no token dropped so far "
                    "(later counts at debug level; PackedStream.counts holds them).", self.source.name,
                    counts["long_split"] + counts["long_dropped"], self.collator.pack_length,
                    "split into pieces" if self.long_documents == "split" else "dropped", counts["empty_dropped"])

    def _batch(self, rows: list[list[dict]], epoch: int) -> dict[str, Any]:
        counts = self._state["stream_counts"]
        documents = [doc for row in rows for doc in row]
        counts["documents"] += len(documents)
        counts["tokens"] += sum(len(doc["input_ids"]) for doc in documents)
        return {**self.collator(rows), "epoch": epoch}


# ---------------------------------------------------------------------------- loader


class StreamLoader:
    """A :class:`PackedStream`'s batches through torchdata's ``StatefulDataLoader`` (``batch_size=None``: the stream
    batches, so that no batch mixes epochs), with the loader's ``state_dict`` / ``load_state_dict``, which Lightning
    saves in checkpoints.

    ``lookahead``: batches the consumer takes before it has used them, left out of the saved position. Lightning's
    training loop fetches one batch ahead of the step for a loader without a length, as here, so a training loader
    for Lightning takes ``lookahead=1``; a plain loop that saves after using each batch, 0.

    Not a ``DataLoader`` (Lightning leaves it as it is). ``loader_kwargs`` go to ``StatefulDataLoader``
    (``pin_memory``, ``prefetch_factor``...).
    """

    def __init__(self, stream: PackedStream, num_workers: int = 0, lookahead: int = 0, **loader_kwargs: Any) -> None:
        self.stream, self.lookahead = stream, lookahead
        self.loader = StatefulDataLoader(stream, batch_size=None, num_workers=num_workers, **loader_kwargs)
        self._states = collections.deque([{}], maxlen=lookahead + 1)  # the state after each batch handed out

    def __iter__(self) -> Iterator[dict[str, Any]]:
        try:
            for batch in self.loader:
                self._states.append(copy.deepcopy(self.loader.state_dict()))
                yield batch
        finally:  # done or dropped (Lightning's teardown): the next iteration goes on from the position; this one's
            self.loader.load_state_dict(self.state_dict())  # workers stop with it

    def state_dict(self) -> dict[str, Any]:
        """The position after the batches handed out, less the last ``lookahead``."""
        return self._states[0]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Set (never add to) the position: the next iteration continues after it."""
        for saved in _stream_states(state):
            _check_layout(saved["layout"], {**self.stream.layout(), "num_workers": self.loader.num_workers})
        self.loader.load_state_dict(state)
        self._states = collections.deque([state], maxlen=self.lookahead + 1)

    @property
    def counts(self) -> dict[str, int]:
        """The stream's counters (:data:`COUNTS`) at :meth:`state_dict`'s position, summed over the workers."""
        states = _stream_states(self.state_dict()) or [self.stream.state_dict()]
        return {key: sum(state["stream_counts"][key] for state in states) for key in COUNTS}


def _stream_states(state: Any) -> list[dict[str, Any]]:
    """The :class:`PackedStream` states inside a loader's state (one a worker), wherever torchdata keeps them."""
    if isinstance(state, dict) and "stream_counts" in state:
        return [state]
    values = state.values() if isinstance(state, dict) else state if isinstance(state, (list, tuple)) else ()
    return [found for value in values for found in _stream_states(value)]


def _check_layout(saved: dict[str, Any], current: dict[str, Any]) -> None:
    changed = {key: (saved.get(key), value) for key, value in current.items()
               if key != "shards" and saved.get(key) != value}
    if changed:
        diff = ", ".join(f"{key} {old!r} -> {new!r}" for key, (old, new) in changed.items())
        raise ValueError(f"The stream position was saved under another layout ({diff}): a stream resumes only with "
                         "the same shards, data-parallel size and rank, seed and loader workers. Restore them, or "
                         "start the data afresh (load no loader state).")
    # a position saved before shards were recorded has none
    for old, new in zip(saved.get("shards", ()), current["shards"]):
        diff = ", ".join(f"{key} {old.get(key)!r} -> {value!r}" for key, value in new.items() if old.get(key) != value)
        if diff:
            raise ValueError(f"Data file {new['path']} is not the shard the stream's position was saved with ({diff}): "
                             "a resume would continue at the old offsets into other content. Restore the shard as it "
                             "was, or start the data afresh (a new run, or load no loader state).")
