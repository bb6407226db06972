"""DLLMDataModule input checks: nothing is silently lost or changed, and bad input names the file, line and fix.

Default tokenizer ids (see test_formats): one id per character, <|user|> = 5, <|assistant|> = 6, eos = 1.
"""

import json
import logging
from pathlib import Path

import pytest

from lit_dllm.settings import Formatting, Splits
from tests.data.test_datamodule import (  # noqa: F401  (make_dm and gpt2_dir are fixtures)
    EOS,
    GSM8K,
    gpt2_dir,
    make_dm,
    rows,
    split_supervised,
    write_jsonl,
)

OK = {"prompt": "1+1=", "response": "2"}


def write(folder: Path, files: dict[str, str]) -> str:
    folder.mkdir()
    for name, text in files.items():
        (folder / name).write_text(text)
    return str(folder)


def jsonl(*records) -> str:
    return "".join(json.dumps(record) + "\n" for record in records)


def decoded(dm, dataset) -> list[str]:
    return [dm.tokenizer.decode(ids) for ids in dataset["input_ids"]]


# ---------------------------------------------------------------------------- folders


def test_folder_mixing_file_types_is_an_error(make_dm, tmp_path):
    folder = write(tmp_path / "mixed", {"a.jsonl": jsonl(OK), "b.csv": "prompt,response\nx,y\n", "c.csv": "p\nq\n"})
    with pytest.raises(ValueError, match=r"mixes file types \(csv: b.csv, c.csv; json: a.jsonl\).*one type per folder"):
        make_dm(folder)


def test_folder_ignores_unsupported_files_with_a_warning(make_dm, tmp_path, caplog):
    folder = write(tmp_path / "data", {"train.jsonl": jsonl(*[OK] * 4), "notes.md": "# notes", "LICENSE": "MIT"})
    with caplog.at_level(logging.WARNING):
        dm = make_dm(folder, splits={"val": "train"})
    assert f"Ignoring 2 file(s) in data folder {folder} of an unsupported type: LICENSE, notes.md." in caplog.text
    assert len(dm.train_dataset) == 4


def test_folder_files_of_no_split_are_named(make_dm, tmp_path, caplog):
    folder = write(tmp_path / "data", {"train.jsonl": jsonl(*[OK] * 4), "extra.jsonl": jsonl(OK)})
    with caplog.at_level(logging.WARNING):
        dm = make_dm(folder, splits={"val": "train"})
    assert f"Ignoring 1 file(s) in data folder {folder} whose names match no split" in caplog.text
    assert "extra.jsonl" in caplog.text and len(dm.train_dataset) == 4


def test_folder_without_supported_files_is_an_error(make_dm, tmp_path):
    folder = write(tmp_path / "docs", {"notes.md": "# notes"})
    with pytest.raises(ValueError, match=r"holds no data file of a supported type .*; found notes.md"):
        make_dm(folder)


def test_test_split_has_its_own_examples_and_index(make_dm, tmp_path):
    sizes = {"train": 8, "validation": 3, "test": 5}
    splits = {name: [{"prompt": f"{name} {i}=", "response": str(i)} for i in range(n)] for name, n in sizes.items()}
    folder = write(tmp_path / "data", {f"{name}.jsonl": jsonl(*records) for name, records in splits.items()})
    dm = make_dm(folder, splits=Splits(val="validation", test="test", max_test_examples=4), loader={"batch_size": 2})
    for loader in (dm.test_dataloader(), dm.predict_dataloader()):
        batches = list(loader)
        assert [b["example_index"].tolist() for b in batches] == [[0, 1], [2, 3]]
        prompts = [dm.tokenizer.decode(split_supervised(ids, mask)[0]) for b in batches for ids, mask in rows(b)]
        assert prompts == [f"test {i}=" for i in range(4)]
    without = make_dm(folder, splits={"val": "validation"}, loader={"batch_size": 2})
    assert without.test_dataset is None
    prompts = [dm.tokenizer.decode(ids[: len(ids) - 2]) for b in without.test_dataloader() for ids, _ in rows(b)]
    assert prompts == [f"validation {i}=" for i in range(3)]


# ---------------------------------------------------------------------------- unreadable or mistyped files

CHAT = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("empty.jsonl", "", r"Data file .*empty.jsonl is empty; fill it or remove it"),
        ("blank.jsonl", "\n  \n", r"Data file .*blank.jsonl is empty"),
        (
            "broken.jsonl",
            jsonl(OK) + "\n" + '{"prompt": "a", "response": }\n',
            r"broken.jsonl line 3 is not valid JSON \(Expecting value, column 29\)",
        ),
        ("list.jsonl", jsonl(OK, ["a", "b"]), r"list.jsonl line 2 is not a JSON object: \['a', 'b'\]"),
        ("header.csv", "prompt,response\n", r"header.csv has only a header row \['prompt', 'response'\] and no data"),
        (
            "ints.jsonl",
            jsonl({"prompt": 7, "response": "2"}),
            r"ints.jsonl line 1: column 'prompt' \(prompt_field\) must be a string, got 7; fix or remove it",
        ),
        ("mixed.jsonl", jsonl(OK) + "\n" + jsonl({"prompt": 7, "response": "2"}), r"mixed.jsonl line 3: .* got 7"),
        (
            "null.jsonl",
            jsonl(OK, OK) + "\n" + jsonl({"prompt": "2+2=", "response": None}),
            r"null.jsonl line 4: column 'response' \(response_field\) must be a string, got None",
        ),
        (
            "chat_int.jsonl",
            jsonl({"messages": CHAT}, {"messages": [CHAT[0], {"role": "assistant", "content": 3}]}),
            r"chat_int.jsonl line 2: column 'messages' \(messages_field\) must be a list of \{'role': str, 'content': "
            r"str\} messages, got \[.*'content': 3, 'role': 'assistant'\}\]",
        ),
        ("chat_missing.jsonl", jsonl({"messages": [CHAT[0], {"role": "assistant"}]}), r"line 1: column 'messages'"),
        ("chat_null.jsonl", jsonl({"messages": CHAT}, {"messages": None}), r"line 2: .* got None"),
        ("doc.json", '[{"prompt": "a", "response": "b"},\n {"prompt": }]', r"doc.json line 2 is not valid JSON"),
        ("null_doc.json", json.dumps([OK, {"prompt": None, "response": "b"}]), r"data file .*null_doc.json row 2: "),
        (
            "id_types.jsonl",
            jsonl({"id": 1, **OK}) + "\n" + jsonl({"id": "x", **OK}),
            r"id_types.jsonl line 3: column 'id' is a string, but a number on line 1",
        ),
    ],
)
def test_bad_files_name_the_file_line_column_and_type(make_dm, tmp_path, name, text, message):
    (tmp_path / name).write_text(text)
    with pytest.raises(ValueError, match=message):
        make_dm(str(tmp_path / name))


def test_bad_row_in_a_folder_names_its_file_and_line(make_dm, tmp_path):
    bad = jsonl(OK, {"prompt": "x", "response": None})
    folder = write(tmp_path / "data", {"train-1.jsonl": jsonl(OK, OK, OK), "train-2.jsonl": bad})
    with pytest.raises(ValueError, match=r"train-2.jsonl line 2: column 'response'"):
        make_dm(folder)


def test_files_with_other_columns_are_named(make_dm, tmp_path):
    other = jsonl({"question": "q", "answer": "a"})
    folder = write(tmp_path / "data", {"train-1.jsonl": jsonl(OK, OK), "train-2.jsonl": other})
    with pytest.raises(ValueError, match=r"train-2.jsonl has no column 'prompt' \(prompt_field\); its columns are"):
        make_dm(folder)


def test_csv_cells_stay_text_and_empty_responses_are_dropped(make_dm, tmp_path, caplog):
    path = tmp_path / "qa.csv"
    path.write_text('prompt,response\n1+6=,007\nN/A?,NA\n"two\nlines",null\nx,\n')
    with caplog.at_level(logging.WARNING):
        dm = make_dm(str(path), splits={"val": "train"})
    assert "Dropped 1 of 4 train examples with an empty response" in caplog.text
    assert decoded(dm, dm.train_dataset) == [f"1+6=007{EOS}", f"N/A?NA{EOS}", f"two\nlinesnull{EOS}"]


# ---------------------------------------------------------------------------- dropped, truncated, unknown


def test_empty_responses_are_dropped_with_a_count(make_dm, tmp_path, caplog):
    records = [OK, {"prompt": "2+2=", "response": ""}, {"prompt": "3+3=", "response": " \n"}, OK]
    with caplog.at_level(logging.WARNING):
        dm = make_dm(write_jsonl(tmp_path / "qa.jsonl", records), splits={"val": "train"})
    assert "Dropped 2 of 4 train examples with an empty response" in caplog.text
    assert decoded(dm, dm.train_dataset) == [f"1+1=2{EOS}"] * 2


@pytest.mark.parametrize(("mask_history", "dropped"), [(False, 2), (True, 1)])
def test_chats_with_an_empty_supervised_turn_are_dropped(make_dm, tmp_path, caplog, mask_history, dropped):
    user, answer, empty = CHAT[0], CHAT[1], {"role": "assistant", "content": " "}
    conversations = [[user, answer], [user, empty], [user, empty, user, answer]]
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": m} for m in conversations])
    with caplog.at_level(logging.WARNING):
        dm = make_dm(path, splits={"val": "train"}, formatting={"mask_history": mask_history})
    assert f"Dropped {dropped} of 3 train examples with an empty supervised assistant turn" in caplog.text
    assert len(dm.train_dataset) == 3 - dropped


def test_unknown_tokens_are_counted(make_dm, tmp_path, caplog):
    records = [OK, OK, {"prompt": "café?", "response": "ok"}, {"prompt": "1+1=", "response": "2 €€"}]
    with caplog.at_level(logging.WARNING):
        dm = make_dm(write_jsonl(tmp_path / "qa.jsonl", records), splits={"val": "train", "max_val_examples": 1})
    # 1+1= + 2 + eos = 6 tokens, twice; café? + ok + eos = 8 (é unknown); 1+1= + 2 €€ + eos = 9 (€ twice)
    assert "train: 3 unknown tokens ('<unk>') = 10.34% of 29 tokens, in 2 of 4 examples" in caplog.text
    assert "characters it stands for: 'é', '€'" in caplog.text
    assert "val:" not in caplog.text  # the first example alone has none
    assert len(dm.train_dataset) == 4  # counted, not dropped


def test_no_unknown_token_warning_when_unk_is_eos(make_dm, gpt2_dir, tmp_path, caplog):
    """GPT-2's unk is its eos, which ends every response: that is no unknown token."""
    with caplog.at_level(logging.WARNING):
        make_dm(write_jsonl(tmp_path / "qa.jsonl", [OK] * 4), tokenizer={"name": gpt2_dir}, splits={"val": "train"})
    assert "unknown" not in caplog.text


@pytest.mark.parametrize(
    ("use_chat_template", "max_seq_len", "expected"),
    [
        (False, 5, [f"+1=6{EOS}", f"+1=2{EOS}"]),
        (True, 6, [f"<|user|>1=<|assistant|>6{EOS}", f"<|user|>1=<|assistant|>2{EOS}"]),  # leading special kept
    ],
)
def test_truncate_prompt_cuts_from_the_left(make_dm, tmp_path, caplog, use_chat_template, max_seq_len, expected):
    records = [{"prompt": "12345+1=", "response": "6"}, OK, {"prompt": "9=", "response": "123456"}]
    path = write_jsonl(tmp_path / "qa.jsonl", records)
    with caplog.at_level(logging.WARNING):
        dm = make_dm(path, splits={"val": "train"}, max_seq_len=max_seq_len,
                     formatting=Formatting(overlong="truncate_prompt", use_chat_template=use_chat_template))
    assert "Truncated the prompt of 2 of 3 train examples longer than max_seq_len" in caplog.text
    assert f"Dropped 1 of 3 train examples whose response alone is longer than max_seq_len={max_seq_len}" in caplog.text
    assert decoded(dm, dm.train_dataset) == expected
    for ids, mask in zip(dm.train_dataset["input_ids"], dm.train_dataset["loss_mask"]):
        assert dm.tokenizer.decode(split_supervised(ids, mask)[1]) in (f"6{EOS}", f"2{EOS}")


@pytest.fixture(scope="module")
def gsm8k_lengths(gpt2_dir):
    """(question, answer, question tokens, answer tokens + eos) of every GSM8K test row, tokenised directly."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gpt2_dir)
    records = [json.loads(line) for line in GSM8K.read_text().splitlines()]
    questions, answers = [r["question"] for r in records], [r["answer"] for r in records]
    question_ids = tokenizer(questions)["input_ids"]
    answer_ids = [ids + [tokenizer.eos_token_id] for ids in tokenizer(answers, add_special_tokens=False)["input_ids"]]
    return list(zip(questions, answers, question_ids, answer_ids))


def gsm8k_dm(make_dm, gpt2_dir, **settings):
    return make_dm(str(GSM8K), tokenizer={"name": gpt2_dir},
                   source={"prompt_field": "question", "response_field": "answer"}, max_seq_len=192,
                   splits={"val": "train", "max_val_examples": 1}, **settings)


@pytest.mark.skipif(not GSM8K.exists(), reason=f"{GSM8K} is absent")
def test_gsm8k_overlong_examples_are_dropped_with_their_count(make_dm, gpt2_dir, gsm8k_lengths, caplog):
    too_long = sum(len(q) + len(a) > 192 for _, _, q, a in gsm8k_lengths)
    assert (len(gsm8k_lengths), too_long) == (1319, 293)  # 22%: the hardest problems
    with caplog.at_level(logging.WARNING):
        dm = gsm8k_dm(make_dm, gpt2_dir)
    assert f"Dropped {too_long} of 1319 train examples longer than max_seq_len=192" in caplog.text
    assert len(dm.train_dataset) == 1319 - too_long


@pytest.mark.skipif(not GSM8K.exists(), reason=f"{GSM8K} is absent")
def test_gsm8k_truncate_prompt_keeps_responses_whole(make_dm, gpt2_dir, gsm8k_lengths, caplog):
    fitting = [(q, a) for _, _, q, a in gsm8k_lengths if len(a) <= 192]
    truncated = sum(len(q) + len(a) > 192 for q, a in fitting)
    with caplog.at_level(logging.WARNING):
        dm = gsm8k_dm(make_dm, gpt2_dir, formatting={"overlong": "truncate_prompt"})
    assert f"Truncated the prompt of {truncated} of 1319 train examples" in caplog.text
    assert f"Dropped {1319 - len(fitting)} of 1319 train examples whose response alone" in caplog.text
    examples = dm.train_dataset
    assert (len(fitting), truncated) == (1275, 249)
    assert len(examples) == len(fitting)
    for (question, answer), ids, mask in zip(fitting, examples["input_ids"], examples["loss_mask"]):
        prompt, response, rest = split_supervised(ids, mask)
        assert response == answer and rest == []
        assert len(ids) == min(192, len(question) + len(answer))
        assert prompt == question[len(question) - len(prompt):]  # the question's last tokens


@pytest.mark.parametrize(("name", "text"), [
    ("latin.jsonl", b'{"prompt": "1+1=", "response": "2"}\n{"prompt": "caf\xe9", "response": "x"}\n'),
    ("latin.csv", b"prompt,response\ncaf\xe9,x\n1+1=,2\n"),
    ("latin.txt", b"one\ncaf\xe9\n"),
])
def test_a_file_that_is_not_utf8_names_the_file_line_and_encoding(make_dm, tmp_path, name, text):
    (tmp_path / name).write_bytes(text)
    with pytest.raises(ValueError, match=rf"{name} line 2 is not UTF-8 \(byte 0xe9 at column \d+.*read as UTF-8"):
        make_dm(str(tmp_path / name))
