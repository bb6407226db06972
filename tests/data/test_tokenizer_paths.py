"""A tokenizer folder without tokenizer files is named with what was expected and what it holds (issue 49)."""

import pytest

from lit_dllm.data.tokenizer import build_default_tokenizer, load_tokenizer


@pytest.mark.parametrize("files", [[], ["config.json"], ["config.json", "model.gguf"]])
def test_a_folder_without_tokenizer_files_is_named_with_what_it_holds(tmp_path, files):
    for name in files:
        (tmp_path / name).write_text("{}")
    with pytest.raises(ValueError, match="is a folder without tokenizer files: expected tokenizer.json") as error:
        load_tokenizer(str(tmp_path))
    assert str(files or "nothing") in str(error.value)
    assert ("gguf_file='model.gguf'" in str(error.value)) == ("model.gguf" in files)


def test_a_saved_tokenizer_folder_still_loads(tmp_path):
    build_default_tokenizer(tmp_path / "tok")
    assert load_tokenizer(str(tmp_path / "tok")).mask_token is not None
