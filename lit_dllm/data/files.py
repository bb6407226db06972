"""Local data files and folders, and the values of their field columns: what ``datasets`` would fail on (or accept
silently), diagnosed with the file, the line and the fix, for :class:`~lit_dllm.data.datamodule.DLLMDataModule`."""

from __future__ import annotations

import csv
import dataclasses
import itertools
import json
import logging
import os
import reprlib
from pathlib import Path
from typing import Any

import datasets
import pyarrow.compute as pc

log = logging.getLogger(__name__)

FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv", ".txt": "text"}
"""The ``datasets`` builder of each data file suffix."""
EXPECTED = {"messages": "a list of {'role': str, 'content': str} messages"}  # the other fields: a string
STRINGS = (datasets.Value("string"), datasets.Value("large_string"))
JSON_TYPES = {bool: "boolean", int: "number", float: "number", str: "string", list: "list", dict: "object"}


@dataclasses.dataclass(frozen=True)
class Part:
    """The raw rows of one local file or one hub split, named for error messages."""

    rows: datasets.Dataset
    name: str
    path: Path | None = None

    def where(self, row: int) -> str:
        """Row ``row`` (0-based) for people (:func:`record_place`)."""
        return record_place(self.path, self.name, row)


def record_place(path: Path | None, name: str, row: int) -> str:
    """Record ``row`` (0-based) of the file ``path`` (or the data named ``name``) for people: the 1-based line of a
    JSON Lines file, else the 1-based row."""
    lines = _json_lines(path) if path is not None and path.suffix in (".json", ".jsonl") else None
    return f"{path} line {lines[row]}" if lines else f"{name} row {row + 1}"


# ---------------------------------------------------------------------------- files


def list_folder(folder: Path) -> list[Path]:
    """The files of ``folder`` and its subfolders, sorted, hidden ones (a name starting with ".") skipped. A folder
    that cannot be read, or a symbolic link to nothing, is a ValueError naming it (rather than left out)."""

    def unreadable(err: OSError):
        raise ValueError(f"Data folder {err.filename} cannot be read ({err.strerror}): fix its permissions or point "
                         "the data elsewhere.") from err

    files = []
    for root, folders, names in os.walk(folder, onerror=unreadable, followlinks=True):
        folders[:] = sorted(name for name in folders if not name.startswith("."))
        files += [Path(root, name) for name in names if not name.startswith(".")]
    for file in files:
        if not file.exists():
            raise ValueError(f"Data file {file} is a symbolic link to {os.readlink(file)}, which does not exist: "
                             "restore it or remove the link.")
    return sorted(files)


def folder_files(folder: Path) -> dict[str, list[Path]]:
    """The data files of each split of ``folder`` (split names from file names, as in ``datasets``).

    Raises if the folder mixes data file types or has none; warns about the files it skips.
    """
    files = list_folder(folder)
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


def check_utf8(path: Path) -> None:
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


def csv_text_features(path: Path) -> datasets.Features:
    """Every column of the csv file ``path`` as a string column."""
    with path.open(newline="", encoding="utf-8", errors="replace") as lines:
        header = next((row for row in csv.reader(lines) if row), [])
    return datasets.Features({name: datasets.Value("string") for name in header})


def file_problem(path: Path, builder: str, err: Exception, columns: dict[str, str]) -> str:
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
            if column in columns and not valid_value(value, columns[column]):
                return bad_value(f"{path} line {number}", column, columns[column], value)
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


# ---------------------------------------------------------------------------- values


def valid_value(value: Any, key: str) -> bool:
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


def check_values(part: Part, column: str, key: str) -> None:
    """Raise, naming the file and line, at the first value of ``column`` that does not fit field ``key``."""
    if _typed(part.rows, column, key):
        return
    rows = part.rows.select_columns([column])
    for start in range(0, len(rows), 1000):
        for offset, value in enumerate(rows[start : start + 1000][column]):
            if not valid_value(value, key):
                raise ValueError(bad_value(part.where(start + offset), column, key, value))


def bad_value(where: str, column: str, key: str, value: Any) -> str:
    expected = EXPECTED.get(key, "a string")
    return f"{where}: column {column!r} ({key}_field) must be {expected}, got {reprlib.repr(value)}; fix or remove it."
