"""Writers of user-named output files never overwrite a file they did not create (issues 49 and 60): the prediction
writers and ``augment``'s commands refuse a file already there, naming it and the fix, unless told to overwrite; a
regeneration still resumes its own file; the corpus writer refuses an ``out`` that exists and leaves nothing behind
when it fails; the run's log and checkpoint folders (TensorBoard, checkpoints, the config record, traces, which are
logged to TensorBoard) never touch a user's file or folder. Exports: tests/core/test_export.py and
tests/hub/test_gguf_out.py; the config record: tests/test_cli.py."""

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from lit_dllm.callbacks import JsonlPredictionWriter, RegeneratedDataWriter
from lit_dllm.checkpointing import NotAFolder, check_writable
from lit_dllm.cli import main as train_py
from lit_dllm.data.augment import main as augment
from lit_dllm.data.datamodule import DLLMDataModule
from lit_dllm.data.streaming import main as write_corpus
from lit_dllm.settings import DataSource, Splits
from tests.test_cli import REPO, TINY_OVERRIDES

TRAINER = SimpleNamespace(logger=None, default_root_dir=".", world_size=1, global_rank=0)


def predict_rows(writer: JsonlPredictionWriter, rows: list[dict]) -> None:
    writer.on_predict_start(TRAINER, None)
    writer.write_on_batch_end(TRAINER, None, rows, None, None, 0, 0)


def test_the_prediction_writer_refuses_a_file_it_did_not_create(tmp_path):
    path = tmp_path / "mine.jsonl"
    path.write_text("my notes\n")
    with pytest.raises(ValueError, match=f"{path} already exists.*another path.*overwrite=true"):
        predict_rows(JsonlPredictionWriter(str(path)), [{"generated": "x"}])
    assert path.read_text() == "my notes\n"  # untouched
    folder = tmp_path / "folder.jsonl"
    folder.mkdir()
    with pytest.raises(ValueError, match="already exists \\(not a file\\)"):
        predict_rows(JsonlPredictionWriter(str(folder), overwrite=True), [])


def test_the_prediction_writer_overwrites_when_told_and_restarts_its_own_file(tmp_path):
    path = tmp_path / "mine.jsonl"
    path.write_text("my notes\n")
    predict_rows(JsonlPredictionWriter(str(path), overwrite=True), [{"generated": "x"}])
    assert path.read_text() == '{"generated": "x"}\n'
    fresh = tmp_path / "new" / "predictions.jsonl"
    writer = JsonlPredictionWriter(str(fresh))
    predict_rows(writer, [{"generated": "a"}])
    writer.write_on_batch_end(TRAINER, None, [{"generated": "b"}], None, None, 1, 0)  # appends across batches
    predict_rows(writer, [{"generated": "c"}])  # a second predict call of this run starts its own file again
    assert fresh.read_text() == '{"generated": "c"}\n'


@pytest.fixture
def data(tmp_path):
    source = tmp_path / "train.jsonl"
    source.write_text("".join(json.dumps({"question": f"Q{i}?", "answer": f"A{i}."}) + "\n" for i in range(3)))
    return DLLMDataModule(DataSource(path=str(source), prompt_field="question", response_field="answer",
                                     cache_dir=str(tmp_path / "cache")), splits=Splits(test="train"))


def row(index: int) -> str:
    return json.dumps({"question": f"Q{index}?", "answer": "mine", "example_index": index})


def test_the_regeneration_writer_never_cuts_a_file_it_did_not_write(tmp_path, data):
    out = tmp_path / "notes.txt"
    out.write_text("notes without a newline")
    with pytest.raises(ValueError, match=f"{out} line 1 is not a row of this data.*Choose another path"):
        RegeneratedDataWriter(str(out))._existing_rows(data)
    assert out.read_text() == "notes without a newline"  # before: cut to an empty file, with only a warning
    out.write_text("first line\nsecond")
    with pytest.raises(ValueError, match="line 1 is not a row of this data"):
        RegeneratedDataWriter(str(out))._existing_rows(data)
    assert out.read_text() == "first line\nsecond"


def test_the_regeneration_writer_continues_its_own_file(tmp_path, data):
    out = tmp_path / "regenerated.jsonl"
    out.write_text(row(0) + "\n" + row(2))  # a whole last row without its newline: kept
    assert RegeneratedDataWriter(str(out))._existing_rows(data) == {0, 2}
    assert out.read_text() == row(0) + "\n" + row(2) + "\n"
    out.write_text(row(0) + "\n" + row(2)[:12])  # an interrupted write: the cut line is removed
    with pytest.warns(UserWarning, match="incomplete last line"):
        assert RegeneratedDataWriter(str(out))._existing_rows(data) == {0}
    assert out.read_text() == row(0) + "\n"


def test_augment_refuses_an_existing_file_unless_told_to_overwrite(tmp_path, capsys):
    source, out = tmp_path / "train.jsonl", tmp_path / "varied.jsonl"
    source.write_text(json.dumps({"question": "What is 2 + 3?"}) + "\n")
    out.write_text("keep me\n")
    with pytest.raises(SystemExit) as refused:  # a usage error: exit status 2, the message on stderr
        augment(["vary", str(source), str(out)])
    assert refused.value.code == 2
    assert re.search(f"{re.escape(str(out))} exists: choose another path.*--overwrite", capsys.readouterr().err)
    assert out.read_text() == "keep me\n"
    augment(["vary", str(source), str(out), "--variants", "2", "--overwrite"])
    assert [json.loads(line)["variant"] for line in out.read_text().splitlines()] == [0, 1]
    assert sorted(path.name for path in tmp_path.iterdir()) == ["train.jsonl", "varied.jsonl"]  # no temporary left
    with pytest.raises(SystemExit):
        augment(["vary", str(source), str(tmp_path), "--overwrite"])
    assert "is not a file" in capsys.readouterr().err


def users_things(tmp_path) -> tuple[Path, Path, dict]:
    """A file and a folder of the user's, and what they hold (to check that they stay as they are)."""
    file, folder = tmp_path / "mine.txt", tmp_path / "my_folder"
    file.write_text("mine")
    folder.mkdir()
    (folder / "notes.md").write_text("my notes")
    return file, folder, snapshot(tmp_path)


def snapshot(folder: Path) -> dict:
    return {str(path.relative_to(folder)): path.read_bytes() for path in sorted(folder.rglob("*")) if path.is_file()}


@pytest.fixture
def text(tmp_path) -> Path:
    path = tmp_path / "input" / "book.txt"
    path.parent.mkdir()
    path.write_text("".join(f"Paragraph {number}.\n\n" for number in range(30)))
    return path


def test_the_corpus_writer_refuses_a_users_file_or_folder(tmp_path, text, capsys):
    file, folder, before = users_things(tmp_path)
    for out in (file, folder):
        with pytest.raises(SystemExit) as refused:
            write_corpus([str(out), str(text)])
        assert refused.value.code == 2 and f"{out} exists; name a new folder" in capsys.readouterr().err
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("argv, message", [(["--shards", "0"], "shards must be a positive int, got 0"),
                                           (["--shards", "-2"], "shards must be a positive int, got -2")])
def test_the_corpus_writer_refuses_a_shard_count_below_one(tmp_path, text, capsys, argv, message):
    with pytest.raises(SystemExit) as refused:  # before: ZeroDivisionError / IndexError, a partial folder left
        write_corpus([str(tmp_path / "corpus"), str(text), *argv])
    assert refused.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "corpus").exists()


def test_the_corpus_writer_names_a_binary_input(tmp_path, text, capsys):
    binary = text.parent / "image.txt"
    binary.write_bytes(b"first line\n\x89PNG\x00\xff")
    with pytest.raises(SystemExit) as refused:  # before: a UnicodeDecodeError naming no file
        write_corpus([str(tmp_path / "corpus"), str(text.parent)])
    assert refused.value.code == 2
    assert f"Data file {binary} line 2 is not UTF-8 (byte 0x89 at column 1" in capsys.readouterr().err
    assert sorted(path.name for path in tmp_path.iterdir()) == ["input"]


def test_a_failed_corpus_write_names_the_file_and_leaves_nothing(tmp_path, text, capsys, monkeypatch):
    """A file-size limit (or a full disk) mid-write: the error names the shard and no cut corpus blocks the rerun."""
    write_text, written = Path.write_text, []

    def limited(path, *args, **kwargs):
        if written:
            raise OSError(27, "File too large")
        written.append(path)
        return write_text(path, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", limited)
    out = tmp_path / "corpus"
    with pytest.raises(SystemExit) as failed:
        write_corpus([str(out), str(text)])
    assert failed.value.code == 1
    assert f"Writing the corpus failed at {out / 'train-00001.jsonl'} (File too large); nothing" in capsys.readouterr().err
    assert sorted(path.name for path in tmp_path.iterdir()) == ["input"]
    monkeypatch.undo()
    write_corpus([str(out), str(text), "--shards", "2"])  # the rerun
    assert sorted(path.name for path in out.iterdir()) == ["train-00000.jsonl", "train-00001.jsonl",
                                                         "validation-00000.jsonl"]


def test_an_output_folder_that_is_a_users_file_is_named_and_a_users_folder_keeps_its_files(tmp_path):
    """check_writable, which a fit runs on its checkpoint and log folders before the first step."""
    file, folder, before = users_things(tmp_path)
    for where in (file, file / "checkpoints"):
        with pytest.raises(NotAFolder, match=f"folder '{where}' is not writable: '{file}' is a file"):
            check_writable(where, "checkpoint")
    check_writable(folder, "checkpoint")  # its probe file is gone again
    assert snapshot(tmp_path) == before


def test_a_fit_never_touches_a_users_file_or_folder(tmp_path, capsys):
    """TensorBoard's folders, the checkpoints, the config record and the traces (logged to TensorBoard) go into
    <save_dir>/<name>/ only; a user's file as the save_dir is refused before anything is written."""
    file, folder, before = users_things(tmp_path)
    (folder / "mdlm_tiny").mkdir()
    (folder / "mdlm_tiny" / "config.yaml").write_text("my config")
    before = snapshot(tmp_path)
    fit = ["fit", "--config", str(REPO / "configs/mdlm_tiny.yaml"), *TINY_OVERRIDES, "--trainer.max_steps=1",
           "--trainer.num_sanity_val_steps=0", "--trainer.val_check_interval=1", "--model.init_args.generation.val_trace=true"]
    with pytest.raises(SystemExit) as refused:
        train_py([*fit, f"--trainer.logger.init_args.save_dir={file}"])
    assert refused.value.code == 2 and f"'{file}' is a file (left as it is)" in capsys.readouterr().err
    train_py([*fit, f"--trainer.logger.init_args.save_dir={folder}"])
    written = set(snapshot(tmp_path)) - set(before)
    assert snapshot(tmp_path).items() >= before.items()
    assert written and all(name.startswith("my_folder/mdlm_tiny/") for name in written), written
    assert {"my_folder/mdlm_tiny/checkpoints/last.ckpt", "my_folder/mdlm_tiny/version_0/config.yaml"} <= written
    assert any(name.startswith("my_folder/mdlm_tiny/version_0/events.out.tfevents") for name in written)
