"""The tokenizer travels inside every checkpoint; a run's checkpoint folder and newest checkpoint."""

import builtins
import errno
import io
import os
import re
import shutil
import time
from functools import partial
from pathlib import Path

import lightning as L
import pytest
import torch

from lit_dllm import BuiltinTask, DataSource, DLLMDataModule, Loader, MDLMModule, Tokenizer
from lit_dllm.checkpointing import find_last_checkpoint, merge_hparams, run_checkpoint_dir
from lit_dllm.cli import main
from lit_dllm.testing import TINY_LLAMA

from .data.test_datamodule import gpt2_tokenizer
from .test_cli import TINY_OVERRIDES


@pytest.fixture(scope="module")
def gpt2_without_mask(tmp_path_factory) -> str:
    """GPT-2's real BPE as shipped: no pad and no mask token."""
    path = tmp_path_factory.mktemp("gpt2_plain")
    gpt2_tokenizer(with_extras=False).save_pretrained(path)
    return str(path)


def test_a_checkpoint_generates_with_its_own_tokenizer_and_added_mask_token(tmp_path, gpt2_without_mask):
    data = DLLMDataModule(DataSource(path="task:reverse"), Tokenizer(name=gpt2_without_mask, mask_token="<|mask|>"),
                          loader=Loader(batch_size=8), max_seq_len=32, task=BuiltinTask(num_train=32, num_val=8))
    assert data.mask_token_id == 50257  # added on top of GPT-2's 50257 tokens
    model = MDLMModule(vocab_size=data.vocab_size, mask_token_id=data.mask_token_id, pad_token_id=data.pad_token_id,
                       eos_token_id=data.eos_token_id,
                       tokenizer_settings={"name": gpt2_without_mask, "mask_token": "<|mask|>"},
                       backbone={"model_config": TINY_LLAMA}, generation={"gen_length": 4})
    trainer = L.Trainer(max_steps=2, accelerator="cpu", logger=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=1, default_root_dir=tmp_path)
    trainer.fit(model, data)  # no `model.tokenizer = ...`: the module takes the data module's tokenizer
    assert model.tokenizer is data.tokenizer
    path = tmp_path / "model.ckpt"
    trainer.save_checkpoint(path)

    os.rename(gpt2_without_mask, gpt2_without_mask + "_moved")  # the checkpoint must not need the original folder
    try:
        reloaded = MDLMModule.load_from_checkpoint(path)
        tokenizer = reloaded.tokenizer
        assert type(tokenizer).__name__.startswith("GPT2") and tokenizer.mask_token == "<|mask|>"
        assert tokenizer.mask_token_id == reloaded.hparams.mask_token_id == 50257
        answers = reloaded.generate(["rev 4821="])
        assert answers == model.generate(["rev 4821="])
        assert isinstance(answers[0], str)
    finally:
        os.rename(gpt2_without_mask + "_moved", gpt2_without_mask)


def test_run_checkpoint_dir_is_stable_and_last_is_the_newest(tmp_path):
    folder = run_checkpoint_dir(tmp_path, "run")
    assert folder == (tmp_path / "run" / "checkpoints").resolve()
    assert find_last_checkpoint([folder]) is None
    folder.mkdir(parents=True)
    old, new = folder / "last.ckpt", folder / "last-v1.ckpt"
    old.write_text("a")
    new.write_text("b")
    os.utime(old, (time.time() - 60, time.time() - 60))
    assert find_last_checkpoint([folder, tmp_path / "missing"]) == new


def test_merge_hparams_keeps_explicit_choices_and_takes_the_rest_from_the_checkpoint():
    saved = {"gen_length": 10, "temperature": 0.7, "lr": 1e-3, "vocab_size": 99, "_class_path": "x.Y"}
    given = {"gen_length": 3, "temperature": 0.0, "lr": 3e-4, "vocab_size": 50}
    defaults = {"gen_length": None, "temperature": 0.0, "lr": 3e-4}
    merged, overrides = merge_hparams(saved, given, defaults, explicit={"temperature"}, skip={"vocab_size"})
    assert merged == {"gen_length": 3, "temperature": 0.0, "lr": 1e-3, "vocab_size": 50}
    assert overrides == ["gen_length=3 (checkpoint: 10)", "temperature=0.0 (checkpoint: 0.7)"]


class FaultyDisk:
    """``folder`` as its own disk, full after ``free`` more bytes or read-only (``free=None``): writes to files there
    fail with ENOSPC past the quota, or opening or renaming one for writing there fails with EACCES (a folder
    made read-only); a rename between it and another
    folder is a copy across devices (EXDEV). Works as root, where ``chmod`` would not stop a write."""

    def __init__(self, folder: Path, free: int | None):
        self.folder, self.free = folder.resolve(), free

    def inside(self, path) -> bool:
        return self.folder in Path(os.fsdecode(path)).resolve().parents

    def open(self, file, mode="r", *args, **kwargs):
        if isinstance(file, int) or not any(flag in mode for flag in "wax+") or not self.inside(file):
            return REAL_OPEN(file, mode, *args, **kwargs)
        if self.free is None:
            raise OSError(errno.EACCES, os.strerror(errno.EACCES), str(file))
        return QuotaFile(REAL_OPEN(file, mode, *args, **kwargs), self)

    def rename(self, real, source, target, *args, **kwargs):
        if self.inside(source) != self.inside(target):
            raise OSError(errno.EXDEV, os.strerror(errno.EXDEV), str(source), str(target))
        if self.free is None and self.inside(target):
            raise OSError(errno.EACCES, os.strerror(errno.EACCES), str(target))
        return real(source, target, *args, **kwargs)


class QuotaFile:
    def __init__(self, file, disk: FaultyDisk):
        self.file, self.disk = file, disk

    def write(self, data) -> int:
        size = len(memoryview(data).cast("B"))
        if size > self.disk.free:
            self.file.write(memoryview(data).cast("B")[: self.disk.free])  # a disk fills up mid-write
            self.disk.free = 0
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.disk.free -= size
        return self.file.write(data)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.file.close()

    def __getattr__(self, name):
        return getattr(self.file, name)


REAL_OPEN = builtins.open


@pytest.fixture
def faulty_disk(monkeypatch):
    def make(folder: Path, free: int | None) -> FaultyDisk:
        disk = FaultyDisk(folder, free)
        for module in (builtins, io):
            monkeypatch.setattr(module, "open", disk.open)
        for name in ("rename", "replace"):
            monkeypatch.setattr(os, name, partial(disk.rename, getattr(os, name)))
        monkeypatch.setattr(shutil, "_USE_CP_SENDFILE", False)  # copies write through Python, like any other write
        return disk

    return make


@pytest.mark.parametrize("free", [4096, None], ids=["disk-full", "read-only"])
def test_a_failed_save_is_an_error_naming_the_path_and_keeps_the_previous_checkpoint(tmp_path, faulty_disk, free):
    """The run's checkpoint folder fills up (or turns read-only) between two saves: the second save is an error that
    names the file, and last.ckpt still holds the first save, whole; no temporary file is left behind."""
    args = ["fit", "--config", "configs/mdlm_tiny.yaml", *TINY_OVERRIDES,
            f"--trainer.logger.init_args.save_dir={tmp_path}"]
    main([*args, "--trainer.max_steps=2"])
    folder = tmp_path / "mdlm_tiny" / "checkpoints"
    last = folder / "last.ckpt"
    before = last.read_bytes()

    faulty_disk(folder, free)
    with pytest.raises(OSError, match=re.escape(str(last))):
        main([*args, "--trainer.max_steps=4", "--ckpt_path", "last"])
    assert last.read_bytes() == before
    assert torch.load(last, weights_only=False)["global_step"] == 2
    assert sorted(path.name for path in folder.iterdir()) == ["last.ckpt"]
