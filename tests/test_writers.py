"""Writers of user-named output files never overwrite a file they did not create (issue 49): the prediction writers
and ``augment``'s commands refuse a file already there, naming it and the fix, unless told to overwrite; a
regeneration still resumes its own file."""

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from lit_dllm.callbacks import JsonlPredictionWriter, RegeneratedDataWriter
from lit_dllm.data.augment import main as augment
from lit_dllm.data.datamodule import DLLMDataModule
from lit_dllm.settings import DataSource, Splits

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
