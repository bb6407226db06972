"""The mark of a folder that an export of lit_dllm wrote (``save_pretrained``, ``export_zlab``, ``python -m
lit_dllm.hub.gguf``): a later export may replace what such a folder holds. A folder that holds files but no mark is
someone else's (another model, your own files): an export refuses it unless told to overwrite."""

from __future__ import annotations

import json
import os
from pathlib import Path

EXPORT_MARKER = "lit_dllm_export.json"
"""The file an export writes into its folder, recording what wrote it."""
MARKERS = (EXPORT_MARKER, "lit_dllm_gguf_export.json")
"""The files that mark an earlier export: :data:`EXPORT_MARKER`, and the GGUF export's own before it (issue 60)."""


def check_export_folder(path: str | os.PathLike, overwrite: bool = False, label: str = "The export folder",
                        fix: str = "overwrite=True") -> Path:
    """``path`` as a Path, when it is missing, an empty folder, an earlier export (it holds one of :data:`MARKERS`) or
    ``overwrite``; else a ValueError, naming ``label`` (how the caller spells the path) with its files and the ``fix``
    to write there anyway. A file is always refused."""
    folder = Path(path)
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"{label} {str(folder)!r} is a file, not a folder: pass the path of a folder (a new one, or "
                         "an earlier export's, whose files are replaced).")
    if overwrite or not folder.is_dir() or any((folder / marker).is_file() for marker in MARKERS):
        return folder
    found = sorted(entry.name for entry in folder.iterdir())
    if found:
        shown = ", ".join(found[:5]) + (f" and {len(found) - 5} more" if len(found) > 5 else "")
        raise ValueError(
            f"{label} {str(folder)!r} holds files that no lit_dllm export wrote ({shown}; no {EXPORT_MARKER}), which "
            f"an export would replace: name a new or empty folder, or pass {fix} to write the export into it."
        )
    return folder


def mark_export(folder: str | os.PathLike, **record) -> None:
    """Mark ``folder`` as an export's (:data:`EXPORT_MARKER`, holding ``record``: what wrote it)."""
    Path(folder, EXPORT_MARKER).write_text(json.dumps(record))
