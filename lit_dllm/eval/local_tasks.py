"""Offline task definitions shipped with lit_dllm, for the harness's ``--include_path``."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import yaml

TASKS_DIR = Path(__file__).with_name("tasks")
"""The shipped task yamls (``gsm8k_local`` reads ``gsm8k_test.jsonl`` in the working directory)."""


def gsm8k_task_dir(data_file: str | os.PathLike, folder: str | os.PathLike | None = None) -> Path:
    """A folder holding ``gsm8k_local.yaml`` that reads ``data_file`` (a jsonl of GSM8K rows: ``question``,
    ``answer`` with its ``#### <number>`` line) as the test split; pass it as ``--include_path`` (or
    ``TaskManager(include_path=...)``) and run the task ``gsm8k_local``. ``folder``: where (default: a new temp dir)."""
    data_file = Path(data_file).resolve()
    if not data_file.is_file():
        raise FileNotFoundError(f"data_file={str(data_file)!r} does not exist: give a jsonl of GSM8K rows.")
    config = yaml.safe_load((TASKS_DIR / "gsm8k_local.yaml").read_text())
    config["dataset_kwargs"]["data_files"]["test"] = str(data_file)
    folder = Path(folder or tempfile.mkdtemp(prefix="lit_dllm_tasks_"))
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "gsm8k_local.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    return folder
