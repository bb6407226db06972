"""``--ckpt_path`` of the wrong kind, a run folder left by a failed first save, and two fits into one run folder
(issue 49): each is refused before any model is built, with one statement of what is there and what to pass."""

import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

from lit_dllm.checkpointing import LOCK_NAME, acquire_run_lock, release_run_lock

from .test_cli import REPO, TINY_OVERRIDES, run_readme

VALIDATE = ["validate", "--config", "configs/mdlm_tiny.yaml"]


def refused(capsys, command, save_dir, *extra) -> str:
    """The CLI's error for ``command`` (it must exit 2 before building a model)."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        run_readme(command, save_dir, *extra)
    assert exit_info.value.code == 2
    return capsys.readouterr().err


def test_a_folder_as_checkpoint_says_what_was_expected_and_what_is_there(tmp_path, capsys):
    folder = tmp_path / "exported"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"\0" * 8)
    err = refused(capsys, VALIDATE, tmp_path, f"--ckpt_path={folder}")
    assert f"--ckpt_path={folder} is not a checkpoint" in err
    assert "expected a Lightning .ckpt file written by fit" in err and "--ckpt_path last" in err
    assert "found a folder holding config.json, model.safetensors" in err


def test_a_text_file_as_checkpoint_quotes_its_start(tmp_path, capsys):
    notes = tmp_path / "notes.txt"
    notes.write_text("remember to resume the run\n")
    err = refused(capsys, VALIDATE, tmp_path, f"--ckpt_path={notes}")
    assert "expected a Lightning .ckpt file written by fit" in err
    assert "found a text file starting with 'remember to resume the run'" in err


def test_a_missing_checkpoint_path_is_named(tmp_path, capsys):
    err = refused(capsys, VALIDATE, tmp_path, f"--ckpt_path={tmp_path / 'nope.ckpt'}")
    assert f"--ckpt_path={tmp_path / 'nope.ckpt'} is not a checkpoint" in err and "found nothing" in err


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny run's checkpoint under a step checkpoint's name (``epoch=0-step=2.ckpt``, as ModelCheckpoint writes
    before ``last.ckpt``)."""
    save_dir = tmp_path_factory.mktemp("trained")
    run_readme(["fit", "--config", "configs/mdlm_tiny.yaml"], save_dir, "--trainer.max_steps=2")
    last = save_dir / "mdlm_tiny" / "checkpoints" / "last.ckpt"
    return last.rename(last.with_name("epoch=0-step=2.ckpt"))


@pytest.mark.parametrize("command", ["fit", "validate"])
def test_after_a_failed_first_save_last_names_the_checkpoints_there(tmp_path, trained, capsys, command):
    """The disk filled up while the first last.ckpt was written: the folder holds the top-k checkpoint and the
    interrupted save's temporary file. ``--ckpt_path last`` is one error naming both and the --ckpt_path to pass
    (no "starting a new run" warning followed by "the folder holds a run's checkpoints")."""
    folder = tmp_path / "mdlm_tiny" / "checkpoints"
    folder.mkdir(parents=True)
    shutil.copy(trained, folder / trained.name)
    (folder / ".last.ckpt.partial").write_bytes(b"PK\3\4 half written")
    err = refused(capsys, [command, "--config", "configs/mdlm_tiny.yaml"], tmp_path, "--ckpt_path", "last")
    assert f"no last*.ckpt in {folder}, but it holds {trained.name}" in err
    assert ".last.ckpt.partial is the unfinished file of an interrupted save" in err
    assert f"--ckpt_path={folder / trained.name}" in err
    assert "starting a new run" not in err and "fit without --ckpt_path" not in err


def test_an_interrupted_saves_partial_file_is_named_when_there_is_no_checkpoint(tmp_path, capsys):
    folder = tmp_path / "mdlm_tiny" / "checkpoints"
    folder.mkdir(parents=True)
    (folder / ".last.ckpt.partial").write_bytes(b"half written")
    err = refused(capsys, VALIDATE, tmp_path, "--ckpt_path", "last")
    assert f"no last*.ckpt in {folder}; .last.ckpt.partial is the unfinished file of an interrupted save" in err


def test_a_second_fit_into_a_run_folder_in_use_is_refused(tmp_path, capsys):
    """Two fits started together into one new run folder: the second stops (exit 2) naming the lock file and the
    first's pid; the first trains on and releases the lock when it ends."""
    args = ["fit", "--config", "configs/mdlm_tiny.yaml", *TINY_OVERRIDES, "--trainer.max_steps=100000",
            f"--trainer.logger.init_args.save_dir={tmp_path}"]
    first = subprocess.Popen([sys.executable, "train.py", *args], cwd=REPO, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    lock = tmp_path / "mdlm_tiny" / LOCK_NAME
    try:
        deadline = time.monotonic() + 240
        while not lock.exists() and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert lock.exists(), "the first fit never took the lock"
        err = refused(capsys, ["fit", "--config", "configs/mdlm_tiny.yaml"], tmp_path)
        assert str(lock) in err and f"fit process {first.pid} on {socket.gethostname()}" in err
        assert first.poll() is None  # the first run goes on
    finally:
        first.send_signal(signal.SIGTERM)
        first.wait(timeout=240)
    assert not lock.exists()


def test_a_stale_lock_is_taken_over_with_a_warning(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / LOCK_NAME).write_text(f"{dead.pid} {socket.gethostname()}\n")
    with pytest.warns(UserWarning, match=f"its process {dead.pid} .* is no longer running"):
        lock = acquire_run_lock(folder)
    assert lock.read_text() == f"{os.getpid()} {socket.gethostname()}\n"
    release_run_lock(lock)
    assert not lock.exists()


def test_a_fit_releases_its_lock_when_it_fails(tmp_path):
    with pytest.raises(ValueError, match="accumulate_grad_batches=0"):
        run_readme(["fit", "--config", "configs/mdlm_tiny.yaml"], tmp_path, "--trainer.accumulate_grad_batches=0")
    assert not (tmp_path / "mdlm_tiny" / LOCK_NAME).exists()


def test_a_sharded_checkpoint_loads_exports_and_validates_in_one_process(tmp_path):
    """An FSDP2 run over two gloo ranks writes its checkpoint as a torch-DCP folder: load_from_checkpoint,
    save_pretrained from it and ``validate --ckpt_path last`` run in one process, on the weights the ranks held (the
    same run saved whole, as save_distributed_checkpoint=false gathers it)."""
    import torch

    from lit_dllm import MDLMModule
    from lit_dllm.cli import main

    from .test_strategies import FSDP2, RUN, load, train_py

    runs = {}
    for distributed in ("true", "false"):
        save_dir = tmp_path / f"distributed-{distributed}"
        layout = [*FSDP2, f"--trainer.strategy.init_args.save_distributed_checkpoint={distributed}"]
        result = train_py(*RUN, f"--trainer.logger.init_args.save_dir={save_dir}", "--trainer.max_steps=2", *layout)
        assert result.returncode == 0, result.stderr[-3000:]
        runs[distributed] = save_dir
    sharded = runs["true"] / "mdlm_tiny" / "checkpoints" / "last.ckpt"
    assert sharded.is_dir() and (sharded / ".metadata").is_file()
    held = load(runs["false"] / "mdlm_tiny" / "checkpoints" / "last.ckpt")["state_dict"]

    module = MDLMModule.load_from_checkpoint(sharded)
    state = module.state_dict()
    assert held and all(torch.equal(state[name], tensor) for name, tensor in held.items())
    module.save_pretrained(tmp_path / "export")
    assert (tmp_path / "export" / "config.json").is_file()

    cli = main(["validate", *RUN, f"--trainer.logger.init_args.save_dir={runs['true']}", "--ckpt_path", "last",
                "--trainer.limit_val_batches=1", "--data.init_args.loader.batch_size=16"])
    state = cli.model.state_dict()
    assert all(torch.equal(state[name], tensor) for name, tensor in held.items())


def test_reading_folders_reads_a_folder_with_the_given_reader_and_files_as_lightning_does(tmp_path):
    """compat.reading_folders wraps the reader that tests/test_compat.py shows load_from_checkpoint calls."""
    import torch
    from lightning.pytorch.core import saving

    from lit_dllm import compat

    read = saving.pl_load
    torch.save({"file": 1}, tmp_path / "a.ckpt")
    with compat.reading_folders(lambda path: {"folder": str(path)}):
        assert saving.pl_load(tmp_path) == {"folder": str(tmp_path)}
        assert saving.pl_load(tmp_path / "a.ckpt", weights_only=True) == {"file": 1}
    assert saving.pl_load is read
