"""Sources: where raw rows come from. A built-in task (``task:<name>``), a local json / jsonl / parquet / csv file or a
folder of them, a hub data set, or, for a streamed training split, a corpus of shards
(:class:`~lit_dllm.data.streaming.StreamingSource`). What is wrong with a local file or folder is named by
:mod:`lit_dllm.data.files`."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import datasets

from lit_dllm.data.encode import Encoder, fields
from lit_dllm.data.files import (
    FILE_BUILDERS,
    Part,
    check_utf8,
    check_values,
    csv_text_features,
    file_problem,
    folder_files,
)
from lit_dllm.data.streaming import StreamingSource
from lit_dllm.data.tasks import TASK_PREFIX, get_task, make_task_splits
from lit_dllm.settings import BuiltinTask, DataSource, Splits


def check_source(source: DataSource, splits: Splits, task: BuiltinTask) -> None:
    """The source against the task and splits groups: a known task without a test split, or a data file that exists."""
    path = source.path
    if path.startswith(TASK_PREFIX):
        get_task(path[len(TASK_PREFIX) :], **(task.kwargs or {}))
        if splits.test is not None:
            raise ValueError(
                f"Built-in tasks have no test split: leave splits.test=None (got {splits.test!r}); test and "
                "predict then use the task's validation set."
            )
    elif Path(path).suffix in FILE_BUILDERS and not Path(path).exists():
        raise ValueError(f"Data file {path!r} does not exist (resolved: {Path(path).resolve()}).")


def raw_splits(source: DataSource, splits: Splits, task: BuiltinTask, seed: int, *, streamed: bool,
               all_columns: bool, encoder_for: Callable[[list[str]], Encoder],
               stream: Callable[[], StreamingSource]) -> tuple[dict[str, datasets.Dataset], Encoder]:
    """The raw rows of each split role (train, val, test), their needed columns checked, and the encoder for them
    (``encoder_for`` the training columns). ``streamed``: the training split is left to ``stream`` (only its columns
    are read here); ``all_columns``: every column is kept (prompt batches hand them to rewards), else the needed."""
    if source.path.startswith(TASK_PREFIX):
        task_splits = make_task_splits(source.path[len(TASK_PREFIX) :], task.num_train, task.num_val, seed,
                                       **(task.kwargs or {}))
        raw = dict(zip(("train", "val"), task_splits))
        encoder = encoder_for(raw["train"].column_names)
    else:
        names = {"train": None if streamed else splits.train, "val": splits.val, "test": splits.test}
        parts = _split_parts(source, list(dict.fromkeys(name for name in names.values() if name is not None)))
        encoder = encoder_for(stream().columns() if streamed else parts[splits.train][0].rows.column_names)
        joined = {name: _join(split_parts, encoder.columns, all_columns) for name, split_parts in parts.items()}
        raw = {role: joined[name] for role, name in names.items() if name is not None}
        if splits.val is None and not streamed:
            held_out = raw["train"].train_test_split(test_size=splits.val_fraction, seed=seed)
            raw["train"], raw["val"] = held_out["train"], held_out["test"]
    limits = splits.limits()
    return {role: _first(dataset, limits[role]) for role, dataset in raw.items()}, encoder


def stream_source(source: DataSource, splits: Splits, rank: int, num_replicas: int) -> StreamingSource:
    """This rank's share of the training shards: the ``splits.train`` files of a folder, a file, or a hub id."""
    path = Path(source.path)
    if path.is_dir():
        files = folder_files(path.resolve())
        check_splits(source.path, [splits.train], files)
        return StreamingSource.open(files[splits.train], rank, num_replicas)
    return StreamingSource.open(source.path, rank, num_replicas)


def check_splits(path: str, names: list[str], available: dict) -> None:
    for name in names:
        if name not in available:
            raise ValueError(f"Dataset {path!r} has no split {name!r}; its splits are {list(available)}.")


def _split_parts(source: DataSource, names: list[str]) -> dict[str, list[Part]]:
    """The parts of each named split: each local file loaded on its own, or the hub split."""
    path = Path(source.path)
    if path.is_file() or path.is_dir():
        if path.is_file() and path.suffix not in FILE_BUILDERS:
            raise ValueError(f"Unsupported data file {source.path!r}; use one of {sorted(FILE_BUILDERS)}.")
        files = {"train": [path]} if path.is_file() else folder_files(path.resolve())
        check_splits(source.path, names, files)
        return {name: [_load_file(file, source) for file in files[name]] for name in names}
    try:
        hub = datasets.load_dataset(source.path, name=source.config, cache_dir=source.cache_dir)
    except (ConnectionError, FileNotFoundError, OSError) as err:
        raise ValueError(
            f"Could not load dataset {source.path!r}: it is not a local file or folder, and the hub is unreachable "
            f"or has no such dataset ({err}). Pass a local json/jsonl/parquet/csv path or 'task:<name>'."
        ) from err
    check_splits(source.path, names, hub)
    return {name: [Part(hub[name], f"split {name!r} of {source.path!r}")] for name in names}


def _load_file(path: Path, source: DataSource) -> Part:
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
        rows = datasets.load_dataset(builder, data_files=str(path), split="train", cache_dir=source.cache_dir, **kwargs)
    except Exception as err:  # datasets / pyarrow / pandas errors, diagnosed for the user
        columns = {column: key for key, column in fields(source).items()}
        raise ValueError(file_problem(path, builder, err, columns)) from err
    return Part(rows, f"data file {path}", path)


def _join(parts: list[Part], columns: dict[str, str], all_columns: bool) -> datasets.Dataset:
    """The parts' needed ``columns`` (each with its field key; every column with ``all_columns``), type-checked
    (errors name the file and line), as one dataset."""
    for part in parts:
        for column, key in columns.items():
            if column not in part.rows.column_names:
                raise ValueError(
                    f"{part.name} has no column {column!r} ({key}_field); its columns are "
                    f"{part.rows.column_names}. Give every file of a split the same columns."
                )
            check_values(part, column, key)
    rows = [part.rows if all_columns else part.rows.select_columns(list(columns)) for part in parts]
    try:
        return datasets.concatenate_datasets(rows)
    except ValueError as err:
        features = "; ".join(f"{part.name}: {part_rows.features}" for part, part_rows in zip(parts, rows))
        raise ValueError(f"Files of one split have different column types ({features}); align them.") from err


def _first(dataset: datasets.Dataset, limit: int | None) -> datasets.Dataset:
    return dataset if limit is None or limit >= len(dataset) else dataset.select(range(limit))
