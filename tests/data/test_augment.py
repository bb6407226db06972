import json
import random
import re

import pytest

from lit_dllm.data.augment import (
    UNANSWERED,
    few_shot_prompts,
    first_question,
    harvest_questions,
    main,
    vary_numbers,
    vary_rows,
)

QUESTION = "Tom has 3 apples and buys 12 more for $1,250.50 in 2023. How many apples does he have?"


def shape(text: str) -> str:
    """The text with every digit written as 9: what a variant must keep."""
    return re.sub(r"\d", "9", text)


def test_a_variant_keeps_every_word_and_each_numbers_shape():
    for seed in range(50):
        varied = vary_numbers(QUESTION, random.Random(seed))
        assert shape(varied) == shape(QUESTION)
        first = int(varied.split()[2])
        assert 2 <= first <= 9  # one digit: never 0 or 1
        assert not varied.split()[6].startswith("0")  # "12" -> 10..99


def test_variants_differ_and_repeat_with_the_seed():
    rows = [{"question": QUESTION, "answer": "15"}, {"question": "How are you?", "answer": "fine"}]
    varied, without_numbers = vary_rows(rows, "question", variants=4, seed=7)
    assert without_numbers == 1 and len(varied) == 4
    assert [row["variant"] for row in varied] == [0, 1, 2, 3]
    assert all(row["source_index"] == 0 and row["answer"] == "15" for row in varied)
    assert len({row["question"] for row in varied}) == 4
    assert vary_rows(rows, "question", variants=4, seed=7)[0] == varied
    assert vary_rows(rows, "question", variants=4, seed=8)[0] != varied


def test_numbers_inside_words_stay():
    assert vary_numbers("a B52 bomber at 3pm, item x2", random.Random(0)) == "a B52 bomber at 3pm, item x2"


def refused(argv: list[str], capsys) -> str:
    """The usage error ``main(argv)`` exits with (status 2, as argparse's own): its message."""
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    return capsys.readouterr().err


def test_bad_input_names_the_value_and_the_fix(tmp_path, capsys):
    with pytest.raises(ValueError, match="variants=0"):
        vary_rows([{"question": "1"}], "question", variants=0)
    with pytest.raises(ValueError, match=r"Row 0 has no text field 'prompt'.*--field"):
        vary_rows([{"question": "1"}], "prompt", variants=1)
    out = tmp_path / "out.jsonl"
    out.write_text("kept")
    assert "exists: choose another path" in refused(["vary", str(tmp_path / "in.jsonl"), str(out)], capsys)
    assert out.read_text() == "kept"
    assert re.search(r"No file .*in.jsonl: name an existing jsonl file",
                     refused(["few-shot", str(tmp_path / "in.jsonl"), str(tmp_path / "new.jsonl"), "--count", "1"],
                             capsys))
    out.write_text("{}\n")
    assert re.search(r"No file .*held_out.jsonl", refused(
        ["harvest", str(out), str(tmp_path / "new.jsonl"), "--exclude", str(tmp_path / "held_out.jsonl")], capsys))


def test_command_writes_every_variant(tmp_path, capsys):
    source = tmp_path / "train.jsonl"
    source.write_text("".join(json.dumps({"question": f"What is {n} + {n}?", "answer": str(2 * n)}) + "\n"
                              for n in range(10, 13)))
    out = tmp_path / "varied" / "train.jsonl"
    main(["vary", str(source), str(out), "--variants", "3"])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 9 and [row["source_index"] for row in rows] == [0, 1, 2, 0, 1, 2, 0, 1, 2]
    assert [row["variant"] for row in rows] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert "9 rows (3 variants of 3 rows; 0 rows without a number" in capsys.readouterr().out


ROWS = [{"question": f"Ann has {n} pens and buys {n + 1} more. How many pens does she have?", "answer": str(2 * n + 1)}
        for n in range(2, 8)]


def test_a_few_shot_prompt_is_distinct_questions_then_an_open_question():
    prompts = few_shot_prompts(ROWS, "question", shots=3, count=5, seed=1)
    assert len(prompts) == 5 and all(row["answer"] == UNANSWERED for row in prompts)
    for row in prompts:
        blocks = row["question"].split("\n\n")
        assert blocks[-1] == "Question:" and len(blocks) == 4
        assert blocks[:3] == [f"Question: {ROWS[index]['question']}" for index in row["shots"]]
        assert len(set(row["shots"])) == 3
    assert few_shot_prompts(ROWS, "question", shots=3, count=5, seed=1) == prompts
    assert few_shot_prompts(ROWS, "question", shots=3, count=5, seed=2) != prompts


def test_the_first_question_of_a_continuation_is_kept_only_if_it_looks_like_one():
    question = "A farmer has 12 cows and sells 5 of them at the market. How many cows are left?"
    assert first_question(f" {question}\n\nQuestion: Another one with 3 apples?") == question
    wrapped = " A farmer has 12 cows\nand sells 5 of them at the market. How many cows are left?"
    assert first_question(wrapped) == question
    assert first_question(f" {question} Question: more") == question
    assert first_question(" What is 2 + 2?") is None  # too short
    no_number = " A farmer has many cows and sells some of them. How many cows are left?"
    assert first_question(no_number) is None
    assert first_question(" A farmer has 12 cows and sells 5 of them at the market on Monday morning") is None  # no "?"


def test_harvest_keeps_each_new_question_once(tmp_path):
    new = "Bob reads 14 pages a day for 9 days. How many pages has he read in all?"
    continuations = [{"question": "prompt", "answer": text} for text in
                     [f" {new}\n\nQuestion: x", f"  {new}", " not a question", f" {ROWS[0]['question']}"]]
    kept, counts = harvest_questions(continuations, "question", "answer", {row["question"] for row in ROWS})
    assert kept == [{"question": new, "answer": UNANSWERED}]
    assert counts == {"kept": 1, "not a question": 1, "repeated": 2}


def test_few_shot_and_harvest_commands(tmp_path, capsys):
    source = tmp_path / "train.jsonl"
    source.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    prompts = tmp_path / "new" / "prompts.jsonl"
    main(["few-shot", str(source), str(prompts), "--count", "4", "--shots", "2"])
    assert len(prompts.read_text().splitlines()) == 4
    continued = tmp_path / "continued.jsonl"
    new = "Bob reads 14 pages a day for 9 days. How many pages has he read in all?"
    continued.write_text(json.dumps({"question": "p", "answer": f" {new}\n\nQuestion: x"}) + "\n"
                         + json.dumps({"question": "p", "answer": f" {ROWS[1]['question']}"}) + "\n")
    out = tmp_path / "new" / "train.jsonl"
    main(["harvest", str(continued), str(out), "--exclude", str(source)])
    assert [json.loads(line)["question"] for line in out.read_text().splitlines()] == [new]
    assert "1 kept, 0 not a question, 1 repeated of 2 continuations" in capsys.readouterr().out


def test_few_shot_bad_input_names_the_value():
    with pytest.raises(ValueError, match="shots=7"):
        few_shot_prompts(ROWS, "question", shots=7, count=1)
    with pytest.raises(ValueError, match="count=0"):
        few_shot_prompts(ROWS, "question", shots=2, count=0)
    with pytest.raises(ValueError, match="no text field 'answer'"):
        harvest_questions([{"question": "q"}], "question", "answer", set())
