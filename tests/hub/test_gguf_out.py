"""``save_gguf_as_hf`` / ``python -m lit_dllm.hub.gguf --out``: a file, or a folder of other files, is refused before
any weight is read, naming it and the fix; an earlier export is replaced (issue 49)."""

import pytest
from transformers import AutoModelForCausalLM

from lit_dllm.hub import gguf as lit_gguf

from .test_gguf import NAME, write_gguf


def test_an_out_that_is_a_file_is_refused(tmp_path, capsys):
    out = tmp_path / "model.safetensors"
    out.write_text("mine")
    with pytest.raises(SystemExit) as exit_:
        lit_gguf.main(["--gguf", str(tmp_path / NAME), "--out", str(out), "--overwrite"])
    assert exit_.value.code == 2 and f"--out '{out}' is a file, not a folder" in capsys.readouterr().err
    assert out.read_text() == "mine"
    with pytest.raises(ValueError, match="is a file, not a folder"):
        lit_gguf.save_gguf_as_hf(tmp_path, NAME, out)


def test_a_folder_of_other_files_is_refused_unless_overwrite(tmp_path, capsys):
    write_gguf(tmp_path / NAME)
    out = tmp_path / "mine"
    out.mkdir()
    (out / "config.json").write_text("my config")
    with pytest.raises(SystemExit) as exit_:
        lit_gguf.main(["--gguf", str(tmp_path / NAME), "--out", str(out)])
    assert exit_.value.code == 2
    assert f"--out '{out}' holds files that no lit_dllm export wrote (config.json;" in capsys.readouterr().err
    assert (out / "config.json").read_text() == "my config"
    (out / "notes.txt").write_text("kept")
    lit_gguf.save_gguf_as_hf(tmp_path, NAME, out, "float32", overwrite=True)
    assert (out / "notes.txt").read_text() == "kept" and AutoModelForCausalLM.from_pretrained(out) is not None


def test_an_earlier_export_is_replaced_and_nothing_temporary_is_left(tmp_path):
    write_gguf(tmp_path / NAME)
    out = tmp_path / "export"
    lit_gguf.main(["--gguf", str(tmp_path / NAME), "--out", str(out), "--dtype", "float32"])
    lit_gguf.main(["--gguf", str(tmp_path / NAME), "--out", str(out), "--dtype", "bfloat16"])  # its own: replaced
    assert str(AutoModelForCausalLM.from_pretrained(out).dtype) == "torch.bfloat16"
    assert sorted(path.name for path in tmp_path.iterdir()) == ["export", NAME]
