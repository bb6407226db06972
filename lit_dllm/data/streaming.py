"""Streaming corpora: shards read lazily, tokenised in the loader's workers, packed into rows on the fly and resumable
bit-exactly; this module is the source side, and the corpus writer (``python -m lit_dllm.data.streaming``).

The pipeline, on each data-parallel rank:

* :class:`StreamingSource` -- local shards (json / jsonl, parquet or txt files: a list or a folder, one type) or a
  hub dataset, read with ``datasets.load_dataset(..., streaming=True)`` shard by shard; ``datasets`` splits the shards
  over the ranks (``split_dataset_by_node``) and over each rank's loader workers, and tokenises them with the
  ``encode`` function (a batched ``datasets`` map, run lazily in the workers).
* :class:`~lit_dllm.data.packed_stream.PackedStream` -- a ``torch`` ``IterableDataset``: windows of documents packed
  into rows of ``pack_length`` tokens (:func:`~lit_dllm.data.packing.pack_documents`) and collated into batches of
  ``batch_size`` rows (:class:`~lit_dllm.data.packing.PackedCollator`), each with its data ``epoch``.
* :class:`~lit_dllm.data.packed_stream.StreamLoader` -- the batches through torchdata's ``StatefulDataLoader``, whose
  state Lightning checkpoints.

Every document has a global ``example_index`` (:func:`example_index`: its shard, its row in the shard and its piece),
the same whatever the rank count, the worker count or the resume point: it keys the document's noise.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import datasets
import numpy as np
import pyarrow.parquet as pq
from datasets.distributed import split_dataset_by_node

from lit_dllm.data.files import bad_value, check_utf8, list_folder, record_place, valid_value

log = logging.getLogger(__name__)

__all__ = ["STREAM_BUILDERS", "StreamingSource", "example_index"]

STREAM_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".txt": "text"}
"""The ``datasets`` builder of each streamable file suffix (a .txt line is one record)."""
SEQUENCE_DTYPES = {"input_ids": np.int32, "loss_mask": np.float32, "attention_mask": np.int8}
"""A document's sequences, kept as numpy arrays of these types (Python int lists take 9 times the memory and are
slower to collate)."""
SEQUENCE_KEYS = tuple(SEQUENCE_DTYPES)
SHARD_BITS, ROW_BITS, PIECE_BITS = 16, 32, 15
ENCODE_BATCH = 100
"""Records an ``encode`` call gets: the tokenizer's peak memory, which a worker keeps, grows with it (a loader worker
held 1.3 GB resident at 1000 records of ~3000 characters, 0.7 GB at 100; bench/bench_loader.py)."""


def example_index(shard: int, row: int, piece: int = 0) -> int:
    """The global index of piece ``piece`` of record ``row`` of shard ``shard``: ``shard << 47 | row << 15 | piece``
    (16, 32 and 15 bits; a document that is not split is its piece 0)."""
    if not (0 <= shard < 1 << SHARD_BITS and 0 <= row < 1 << ROW_BITS and 0 <= piece < 1 << PIECE_BITS):
        raise ValueError(f"Shard {shard}, record {row}, piece {piece} is outside the example index (at most "
                         f"{1 << SHARD_BITS} shards of {1 << ROW_BITS} records, {1 << PIECE_BITS} pieces a record).")
    return shard << (ROW_BITS + PIECE_BITS) | row << PIECE_BITS | piece


# ---------------------------------------------------------------------------- source


@dataclasses.dataclass(frozen=True)
class StreamingSource:
    """This data-parallel rank's share of a corpus of shards, read as a stream (build it with :meth:`open`).

    Ranks: ``datasets.distributed.split_dataset_by_node``. When ``num_shards`` is a multiple of ``world_size``
    (:attr:`split_by` ``"shards"``) each rank reads whole shards (rank ``r``: every ``world_size``-th shard of the
    epoch's shard order, from the ``r``-th); otherwise (``"examples"``) every rank reads and tokenises every shard
    and keeps every ``world_size``-th example. Within a rank, ``datasets`` gives each loader worker whole shards
    (workers beyond them idle), so every rank must run the same number of workers.

    Attributes:
        name: the folder, file or hub id, for messages.
        builder: the ``datasets`` builder of the local files (json, parquet, text), or the hub id.
        files: the local shards (shard ``i`` is ``files[i]``); empty for a hub dataset.
        num_shards: the shard count (the files, or the hub dataset's ``num_shards``).
        rank, world_size: this rank and the data-parallel size.
        identities: each local shard's :func:`shard_identity` when opened, which a saved position records.
    """

    name: str
    builder: str
    files: tuple[str, ...]
    num_shards: int
    rank: int = 0
    world_size: int = 1
    identities: tuple[dict[str, Any], ...] = ()

    @classmethod
    def open(cls, path: str | Path | Sequence[str | Path], rank: int = 0, world_size: int = 1) -> StreamingSource:
        """The shards of ``path``: a folder (its data files, recursively; hidden ones skipped), a file, a list of
        files, or a hub dataset id (its ``train`` split). Every local file is checked cheaply here (it exists, is not
        empty, opens as its type); a ValueError names the file and the fix."""
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}.")
        if isinstance(path, (str, Path)) and not Path(path).exists():
            _check_hub_id(str(path))
            return cls(str(path), str(path), (), _open(str(path), ()).num_shards, rank, world_size)._announce()
        files = _shard_files([path] if isinstance(path, (str, Path)) else list(path))
        builder = STREAM_BUILDERS[files[0].suffix]
        for file in files:
            _check_shard(file, builder)
        if len(files) > 1 << SHARD_BITS:
            raise ValueError(f"{len(files)} shards is more than the {1 << SHARD_BITS} the example index holds; "
                             "merge files.")
        name = str(path) if isinstance(path, (str, Path)) else f"{len(files)} files from {files[0]}"
        identities = tuple(shard_identity(file) for file in files)
        return cls(name, builder, tuple(str(file) for file in files), len(files), rank, world_size,
                   identities)._announce()

    def _announce(self) -> StreamingSource:
        if self.split_by == "examples":
            log.warning("%d shards of %s do not split evenly over %d data-parallel ranks: every rank reads and "
                        "tokenises all of them and keeps every %d-th example. Give the corpus a multiple of %d shards "
                        "to read 1/%d each.", self.num_shards, self.name, self.world_size, self.world_size,
                        self.world_size, self.world_size)
        return self

    @property
    def split_by(self) -> str:
        """How ``datasets`` splits the shards over the ranks: ``"shards"`` (whole shards) or ``"examples"``."""
        return "shards" if self.num_shards % self.world_size == 0 else "examples"

    def columns(self) -> list[str]:
        """The columns of the first record of the first shard (to infer the data's format)."""
        first = next(_read_shards([0], self), None)
        if first is None:
            raise ValueError(f"{self.shard_name(0)} holds no record; fill it or remove it.")
        return list(first["row"])

    def shard_name(self, shard: int) -> str:
        return f"data file {self.files[shard]}" if self.files else f"shard {shard} of hub dataset {self.name!r}"

    def where(self, index: int) -> str:
        """The record of a document's ``example_index`` for people: its file and line (JSON Lines), else its row."""
        shard, row = index >> (ROW_BITS + PIECE_BITS), (index >> PIECE_BITS) & ((1 << ROW_BITS) - 1)
        return record_place(Path(self.files[shard]) if self.files else None, self.shard_name(shard), row)

    def locate(self, index: int) -> tuple[str, int, int]:
        """(shard name, record in the shard, piece) of a document's ``example_index``."""
        shard, row = index >> (ROW_BITS + PIECE_BITS), (index >> PIECE_BITS) & ((1 << ROW_BITS) - 1)
        return self.shard_name(shard), row, index & ((1 << PIECE_BITS) - 1)

    def dataset(self, encode: Callable[[dict], dict], epoch: int = 0, seed: int | None = None
                ) -> datasets.IterableDataset:
        """This rank's documents of ``epoch``: ``{input_ids, loss_mask, attention_mask, example_index}`` each.

        ``encode`` (a batched map: raw columns -> ``input_ids``, ``loss_mask``, ``attention_mask`` lists, one example
        per record) runs lazily, in the loader's workers. An ``encode`` with a ``columns`` mapping (column -> field
        key, as the data module's) has each record's values there checked first: a value of the wrong type (a null,
        a number) is a ValueError naming the file, line and field. With a ``seed`` the shard order is shuffled per epoch
        (``datasets``' ``set_epoch``, seeded by ``(seed, epoch)``); without, the shards keep their order.
        """
        shards = datasets.IterableDataset.from_generator(
            _read_shards, gen_kwargs={"shards": list(range(self.num_shards)), "source": self}
        )
        documents = split_dataset_by_node(shards, rank=self.rank, world_size=self.world_size)
        documents = documents.map(_Encode(encode, self), batched=True, batch_size=ENCODE_BATCH, remove_columns=["row"])
        if seed is not None:  # datasets shuffles the shards for any epoch but 0, with default_rng(epoch)
            documents.set_epoch(1 + int(np.random.SeedSequence([seed, epoch]).generate_state(1)[0]))
        return documents


def _check_hub_id(path: str) -> None:
    """Raise if ``path``, which does not exist, names a local file or folder rather than a hub id."""
    if Path(path).suffix in STREAM_BUILDERS or path.startswith(("/", ".", "~")) or "\\" in path:
        raise ValueError(f"Data path {path} does not exist (resolved: {Path(path).expanduser().resolve()}).")


HEAD_BYTES = 1 << 16
"""How much of a shard's start :func:`shard_identity` hashes."""


def shard_identity(path: str | Path) -> dict[str, Any]:
    """What tells a local shard from a changed one: its resolved path (the same from any working folder), size,
    modification time (ns) and the SHA-256 of its first :data:`HEAD_BYTES` bytes."""
    with open(path, "rb") as file:
        head = hashlib.sha256(file.read(HEAD_BYTES)).hexdigest()
    stat = os.stat(path)
    return {"path": str(Path(path).resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "head_sha256": head}


@functools.lru_cache(maxsize=4)
def _open(builder: str, files: tuple[str, ...]) -> datasets.IterableDataset:
    """All shards as one stream (once a process): the local ``files`` with ``builder``, or the hub id ``builder``."""
    if files:
        return datasets.load_dataset(builder, data_files=list(files), split="train", streaming=True)
    try:
        return datasets.load_dataset(builder, split="train", streaming=True)
    except Exception as err:  # offline, unknown name, no train split...
        raise ValueError(
            f"Could not open dataset {builder!r}: there is no local file or folder {Path(builder).resolve()}, and the "
            f"hub is unreachable or has no such dataset with a train split ({type(err).__name__}: {err}). Pass a "
            "folder or list of local jsonl / parquet / txt shards."
        ) from err


def _shard_files(paths: list[str | Path]) -> list[Path]:
    """The data files of ``paths`` (folders expanded), all of one type."""
    files: list[Path] = []
    for path in map(Path, paths):
        if path.is_dir():
            found = list_folder(path)
            kept = [p for p in found if p.suffix in STREAM_BUILDERS]
            if len(kept) < len(found):
                log.warning("Ignoring %d file(s) of %s that are not data files (%s): %s.", len(found) - len(kept), path,
                            ", ".join(STREAM_BUILDERS), ", ".join(str(p) for p in found if p not in kept))
            if not kept:
                raise ValueError(f"Data folder {path} holds no data file ({', '.join(STREAM_BUILDERS)}); found "
                                 f"{[str(p) for p in found] or 'nothing'}.")
            files += kept
        elif not path.exists():
            link = f" (a symbolic link to {os.readlink(path)}, which does not exist)" if path.is_symlink() else ""
            raise ValueError(f"Data path {path} does not exist{link} (resolved: {path.resolve()}).")
        elif path.suffix not in STREAM_BUILDERS:
            raise ValueError(f"Data file {path} is not a data file: use {', '.join(STREAM_BUILDERS)} files.")
        else:
            files.append(path)
    kinds = collections.defaultdict(list)
    for file in files:
        kinds[STREAM_BUILDERS[file.suffix]].append(str(file))
    if len(kinds) > 1:
        mixed = "; ".join(f"{kind}: {', '.join(names[:3])}{' ...' if len(names) > 3 else ''}"
                          for kind, names in sorted(kinds.items()))
        raise ValueError(f"The data files mix types ({mixed}); stream one type: convert them or split the folder.")
    if not files:
        raise ValueError("No data files given.")
    return files


def _check_shard(path: Path, builder: str) -> None:
    """Raise, naming ``path``, if it cannot be opened, is empty or does not open as ``builder`` (reads its first
    record only)."""
    try:
        path.open("rb").close()
    except OSError as err:
        raise ValueError(f"Data file {path} cannot be opened ({err.strerror}); fix its permissions or remove it."
                         ) from err
    if path.stat().st_size == 0:
        raise ValueError(f"Data file {path} is empty (0 bytes); fill it or remove it.")
    if builder == "parquet":
        try:
            rows = pq.ParquetFile(path).metadata.num_rows
        except Exception as err:
            raise ValueError(f"Data file {path} is not a Parquet file ({err}); convert it or rename it.") from err
        if rows == 0:
            raise ValueError(f"Data file {path} holds no rows; fill it or remove it.")
    elif builder == "json":
        with path.open("rb") as lines:
            numbered = ((number, line.strip()) for number, line in enumerate(lines, 1))
            number, first = next(((n, line) for n, line in numbered if line), (0, b""))
            following = next((line for _, line in numbered if line), b"")
        rest = (first[1:].strip() or following) if first.startswith(b"[") else b"{"  # a JSON array: its first item
        if not first or rest.startswith(b"]"):
            raise ValueError(f"Data file {path} holds no JSON records; fill it or remove it.")
        if not rest.startswith(b"{"):
            raise ValueError(f"Data file {path} line {number} starts a JSON array of something other than objects "
                             f"({first[:80]!r}); each record must be a JSON object.")
        if first.startswith(b"["):
            return  # datasets parses a JSON array whole
        try:
            record = json.loads(first)
        except ValueError as err:
            raise ValueError(f"Data file {path} line {number} is not valid JSON ({err}); a {path.suffix} shard holds "
                             "one JSON object a line (JSON Lines) or a JSON array of objects: fix or convert it."
                             ) from err
        if not isinstance(record, dict):
            raise ValueError(f"Data file {path} line {number} is not a JSON object: {first[:80]!r}.")


def _read_shards(shards: list[int], source: StreamingSource) -> Iterator[dict[str, Any]]:
    """The records of ``shards`` (``datasets`` hands each worker its shards), each as ``{example_index, row}``; an
    error reading a shard names it. (``iter``, not ``__iter__``: in a loader worker ``__iter__`` would give this
    worker only its part of the one shard.)"""
    stream = _open(source.builder, source.files)
    for shard in shards:
        row = -1
        try:
            for batch in stream.shard(source.num_shards, shard).iter(batch_size=1000):
                for values in zip(*batch.values()):
                    row += 1
                    yield {"example_index": example_index(shard, row), "row": dict(zip(batch, values))}
        except Exception as err:
            kind = "JSON Lines" if source.builder == "json" else source.builder
            raise ValueError(f"Could not read {source.shard_name(shard)} ({type(err).__name__}: {err}); fix it (is it "
                             f"valid {kind}?) or remove it.") from err


@dataclasses.dataclass(frozen=True)
class _Encode:
    """The batched map around ``encode``: records -> the sequences (numpy arrays) plus each record's
    ``example_index``."""

    encode: Callable[[dict], dict]
    source: StreamingSource

    def __call__(self, batch: dict[str, list]) -> dict[str, list]:
        records = batch["row"]
        for column, key in getattr(self.encode, "columns", {}).items():
            for record, index in zip(records, batch["example_index"]):
                if not valid_value(record.get(column), key):
                    raise ValueError(bad_value(self.source.where(index), column, key, record.get(column)))
        columns = {key: [record.get(key) for record in records] for key in dict.fromkeys(k for r in records for k in r)}
        encoded = self.encode(columns)
        missing = [key for key in SEQUENCE_KEYS if key not in encoded]
        if missing:
            raise ValueError(f"encode returned no {missing}; it must return {list(SEQUENCE_KEYS)} for each record.")
        if len(encoded["input_ids"]) != len(records):
            raise ValueError(f"encode returned {len(encoded['input_ids'])} examples for {len(records)} records; it "
                             "must return one per record (PackedStream packs, and splits long documents).")
        arrays = {key: [np.asarray(values, dtype) for values in encoded[key]] for key, dtype in SEQUENCE_DTYPES.items()}
        return {**arrays, "example_index": batch["example_index"]}


# ---------------------------------------------------------------------------- a corpus from text files


VALIDATION_SHARD = "validation-00000.jsonl"


def write_corpus(out: str | Path, texts: Sequence[str | Path], shards: int = 4, val_every: int = 20) -> None:
    """The paragraphs (blank-line separated) of the UTF-8 text files ``texts`` (files, or folders of ``*.md`` /
    ``*.txt``) as a corpus folder of JSON Lines shards ``{"text": ...}``: ``train-0000i.jsonl`` round robin, every
    ``val_every``-th paragraph in ``validation-00000.jsonl``. Refuses an ``out`` that exists (nothing is overwritten)
    and bad input (a ValueError naming it). The shards are written into a temporary folder beside ``out``, renamed to
    ``out`` at the end: a write that fails (a full disk, a file-size limit) is an OSError naming the file, and leaves
    nothing behind."""
    out = Path(out)
    for name, value in (("shards", shards), ("val_every", val_every)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}.")
    if out.exists() or out.is_symlink():
        raise ValueError(f"{out} exists; name a new folder for the corpus (nothing is overwritten).")
    files = [f for t in map(Path, texts) for f in (sorted(t.rglob("*.md")) + sorted(t.rglob("*.txt")) if t.is_dir() else [t])]
    paragraphs = [" ".join(p.split()) for f in files for p in _read_text(f).split("\n\n") if p.strip()]
    if not paragraphs:
        raise ValueError(f"No text in {[str(t) for t in texts]}.")
    names = [f"train-{i:05d}.jsonl" for i in range(shards)]
    lines: dict[str, list[str]] = {name: [] for name in [*names, VALIDATION_SHARD]}
    for number, paragraph in enumerate(paragraphs):
        name = VALIDATION_SHARD if number % val_every == val_every - 1 else names[number % shards]
        lines[name].append(json.dumps({"text": paragraph}) + "\n")
    out.parent.mkdir(parents=True, exist_ok=True)
    temporary, where = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent)), out
    try:
        for name, rows in lines.items():
            where = out / name
            (temporary / name).write_text("".join(rows), encoding="utf-8")
        where = out
        temporary.rename(out)
    except OSError as err:
        raise OSError(f"Writing the corpus failed at {where} ({err.strerror or err}); nothing of it was kept. Fix the "
                      "cause (free space, the file-size limit) and run it again.") from err
    finally:
        shutil.rmtree(temporary, ignore_errors=True)
    log.info("Wrote %d paragraphs of %d files to %s (%d train shards and a validation file).", len(paragraphs),
             len(files), out, shards)


def _read_text(path: Path) -> str:
    """The text of ``path``; a ValueError naming it when it is missing or not UTF-8 (the line and column)."""
    if not path.is_file():
        raise ValueError(f"Text file {path} does not exist (resolved: {path.resolve()}).")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        check_utf8(path)  # raises, naming the line and column
        raise


def main(argv: list[str] | None = None) -> None:
    """``python -m lit_dllm.data.streaming OUT TEXTS...``: :func:`write_corpus`; bad input exits 2, a failed write 1."""
    import argparse

    parser = argparse.ArgumentParser(description="Write text files' paragraphs as a corpus of JSON Lines shards.")
    parser.add_argument("out", help="the corpus folder to create")
    parser.add_argument("texts", nargs="+", help="text files or folders of *.md / *.txt")
    parser.add_argument("--shards", type=int, default=4, help="train shards (default 4)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        write_corpus(args.out, args.texts, args.shards)
    except ValueError as err:
        parser.error(str(err))
    except OSError as err:
        parser.exit(1, f"{parser.prog}: error: {err}\n")


if __name__ == "__main__":
    main()
