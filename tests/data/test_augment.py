import json
import random
import re

import pytest

from lit_dllm.data.augment import main, vary_numbers, vary_rows

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


def test_bad_input_names_the_value_and_the_fix(tmp_path):
    with pytest.raises(ValueError, match="variants=0"):
        vary_rows([{"question": "1"}], "question", variants=0)
    with pytest.raises(ValueError, match=r"Row 0 has no text field 'prompt'.*--field"):
        vary_rows([{"question": "1"}], "prompt", variants=1)
    out = tmp_path / "out.jsonl"
    out.write_text("")
    with pytest.raises(SystemExit, match="exists"):
        main([str(tmp_path / "in.jsonl"), str(out)])


def test_command_writes_every_variant(tmp_path, capsys):
    source = tmp_path / "train.jsonl"
    source.write_text("".join(json.dumps({"question": f"What is {n} + {n}?", "answer": str(2 * n)}) + "\n"
                              for n in range(10, 13)))
    out = tmp_path / "varied" / "train.jsonl"
    main([str(source), str(out), "--variants", "3"])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 9 and [row["source_index"] for row in rows] == [0, 1, 2, 0, 1, 2, 0, 1, 2]
    assert [row["variant"] for row in rows] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert "9 rows (3 variants of 3 rows); 0 rows without a number" in capsys.readouterr().out
