"""Issue 49: a truncated or corrupt GGUF, as a model or as a tokenizer, is one ValueError naming the file and what is
wrong with it, before transformers reads (and reshapes) any tensor."""

import os
import re

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.integrations.gguf import GgufHeader

from lit_dllm.data.tokenizer import load_tokenizer
from lit_dllm.hub.hf import load_causal_lm
from tests.hub.test_gguf import NAME, write_gguf


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    """The bytes of the tiny GGUF and where its tensor data starts."""
    path = tmp_path_factory.mktemp("whole") / NAME
    write_gguf(path)
    return path.read_bytes(), GgufHeader.from_file(str(path)).data_start


CASES = {  # name: (the file's bytes from the whole one's and its data start, what the error says)
    "cut in its metadata": (lambda data, start: data[:300], "truncated: it ends at byte 300, inside its header"),
    "cut in its tensor table": (lambda data, start: data[:start - 40], "truncated: it ends at byte .*, inside its header"),
    "cut in its tensor data": (lambda data, start: data[:-1000], "truncated at byte {cut} of {size}: its tensor table"),
    "garbage": (lambda data, start: bytes(range(256)) * 8, r"not a GGUF file: it starts with b'\\x00\\x01\\x02\\x03'"),
    "empty": (lambda data, start: b"", r"not a GGUF file: .*\(0 bytes\)"),
    "garbage after the magic": (lambda data, start: b"GGUF" + bytes(range(256)) * 8, "corrupt or unsupported GGUF"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_broken_gguf_is_named_before_any_tensor_is_read(case, whole, tmp_path, monkeypatch):
    data, start = whole
    cut, message = CASES[case]
    (tmp_path / NAME).write_bytes(cut(data, start))
    message = message.format(cut=len(data) - 1000, size=len(data))
    expected = rf"^'{re.escape(str(tmp_path / NAME))}' .*{message}"
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", None)  # never reached
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", None)
    with pytest.raises(ValueError, match=expected):
        load_causal_lm(str(tmp_path), gguf_file=NAME)
    with pytest.raises(ValueError, match=expected):
        load_tokenizer(str(tmp_path), gguf_file=NAME)


def test_a_whole_gguf_passes(whole, tmp_path):
    from lit_dllm.hub.gguf import read_gguf_header

    data, start = whole
    (tmp_path / NAME).write_bytes(data)
    header = read_gguf_header(tmp_path / NAME)
    assert header.architecture == "llama" and header.data_start == start
    assert os.path.getsize(tmp_path / NAME) == max(start + t.offset + t.nbytes for t in header.tensors)
