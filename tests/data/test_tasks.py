import itertools
import random
import re
from collections import Counter
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lit_dllm.data.tasks import (
    TASKS,
    countdown_numbers,
    evaluate_expression,
    get_task,
    make_task_dataset,
    make_task_splits,
    sudoku_puzzle,
)


def all_sudoku_grids() -> list[str]:
    """Every 4x4 Sudoku grid (there are 288), by brute force over rows that are permutations of 1234."""
    rows = ["".join(row) for row in itertools.permutations("1234")]
    grids = []
    for grid in itertools.product(rows, repeat=4):
        columns = ["".join(row[c] for row in grid) for c in range(4)]
        boxes = [grid[r][c:c + 2] + grid[r + 1][c:c + 2] for r in (0, 2) for c in (0, 2)]
        if all(len(set(group)) == 4 for group in columns + boxes):
            grids.append("".join(grid))
    return grids


SUDOKU_GRIDS = all_sudoku_grids()


def fits(puzzle: str, grid: str) -> bool:
    return all(given in (".", cell) for given, cell in zip(puzzle, grid))


def check_answer(task: str, prompt: str, response: str) -> None:
    if task == "add":
        a, b = map(int, re.fullmatch(r"(\d+)\+(\d+)=", prompt).groups())
        assert int(response) == a + b and response == str(a + b)
    elif task == "arith":  # the default two terms
        a, op, b = re.fullmatch(r"(\d+)([-+*])(\d+)=", prompt).groups()
        assert response == str({"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op])
    elif task == "sudoku":  # the one grid that fits the givens
        puzzle = sudoku_puzzle(prompt)
        assert [grid for grid in SUDOKU_GRIDS if fits(puzzle, grid)] == [response]
    elif task == "countdown":  # all the numbers, each once, reach the target
        numbers, target = countdown_numbers(prompt)
        value, used = evaluate_expression(response)
        assert value == target and Counter(used) == Counter(numbers)
    else:
        digits = re.fullmatch(rf"{'rev' if task == 'reverse' else 'sort'} (\d+)=", prompt).group(1)
        assert response == (digits[::-1] if task == "reverse" else "".join(sorted(digits)))


@pytest.mark.parametrize("task", sorted(TASKS))
def test_deterministic_and_exact(task):
    first, again, other = (make_task_dataset(task, 200, seed) for seed in (0, 0, 1))
    assert first[:] == again[:]
    assert first[:] != other[:]
    for prompt, response in zip(first["prompt"], first["response"]):
        check_answer(task, prompt, response)


@pytest.mark.parametrize("task", sorted(TASKS))
def test_val_is_held_out_and_independent_of_train_size(task):
    train, val = make_task_splits(task, 2000, 100, seed=3)
    assert len(train) == 2000 and len(val) == 100
    assert len(set(val["prompt"])) == 100
    assert not set(val["prompt"]) & set(train["prompt"])
    assert make_task_splits(task, 50, 100, seed=3)[1][:] == val[:]


@settings(max_examples=25, deadline=None)
@given(low=st.integers(1, 9), span=st.integers(0, 5), seed=st.integers(0, 2**32))
def test_difficulty_knobs_bound_lengths(low, span, seed):
    high = low + span
    rng = random.Random(seed)
    for _ in range(20):
        for task in ("reverse", "sort"):
            example = get_task(task, min_len=low, max_len=high)(rng)
            assert low <= len(example["response"]) <= high
            check_answer(task, **example)
        example = get_task("add", min_digits=low, max_digits=high)(rng)
        operands = example["prompt"][:-1].split("+")
        assert all(low <= len(operand) <= high for operand in operands)
        check_answer("add", **example)


def test_unknown_task_lists_tasks():
    listed = r"\['add', 'arith', 'countdown', 'reverse', 'sort', 'sudoku'\]"
    with pytest.raises(ValueError, match=rf"Unknown task 'multiply'; available tasks: {listed}"):
        make_task_dataset("multiply", 10, 0)


def test_unknown_knob_lists_knobs():
    knobs = r"no difficulty knob\(s\) \['max_digits'\]; its knobs are \['min_len', 'max_len'\]"
    with pytest.raises(TypeError, match=knobs):
        get_task("reverse", max_digits=3)


def test_bad_knob_range():
    with pytest.raises(ValueError, match="Need 1 <= min_digits <= max_digits, got min_digits=4, max_digits=2"):
        get_task("add", min_digits=4, max_digits=2)


def test_too_few_distinct_prompts():
    with pytest.raises(ValueError, match="too few distinct prompts for 20 val examples"):
        make_task_splits("sort", 10, 20, seed=0, min_len=1, max_len=1)


def test_the_first_tasks_keep_their_examples():
    """Adding tasks changes none of the earlier ones' examples (each task draws from its own seed stream)."""
    assert make_task_dataset("reverse", 3, 7)[:] == {"prompt": ["rev 81056878=", "rev 84420=", "rev 32="],
                                                     "response": ["87865018", "02448", "23"]}
    assert make_task_dataset("sort", 3, 7)[:] == {"prompt": ["sort 5248858=", "sort 48984650=", "sort 542="],
                                                  "response": ["2455888", "04456889", "245"]}
    assert make_task_dataset("add", 3, 7)[:] == {"prompt": ["64+68=", "210+4=", "84+328="],
                                                 "response": ["132", "214", "412"]}


def test_the_verifiable_tasks_under_a_seed():
    assert make_task_dataset("arith", 2, 7)[:] == {"prompt": ["31+53=", "7+57="], "response": ["84", "64"]}
    # rows 3241 / 1432 / 4123 / 2314: each row, column and 2x2 box holds 1-4 once, and the givens are kept
    assert make_task_dataset("sudoku", 1, 7)[0] == {"prompt": "sud .24.1.3241.3..14=", "response": "3241143241232314"}
    assert make_task_dataset("countdown", 2, 7)[:] == {"prompt": ["cd 18,10,1 to 29=", "cd 9,5,20 to 80="],
                                                       "response": ["18+10+1", "(9-5)*20"]}


def test_there_are_288_sudoku_grids():
    assert len(SUDOKU_GRIDS) == 288


@pytest.mark.parametrize("text, value, numbers", [
    ("(3+7)*25", 250, [3, 7, 25]), ("3+7*25", 178, [3, 7, 25]), ("7/2", Fraction(7, 2), [7, 2]),
    ("20-(9-5)", 16, [20, 9, 5]), ("20-9-5", 6, [20, 9, 5]), (" 8 / 4 / 2 ", 1, [8, 4, 2]), ("0", 0, [0]),
])
def test_expressions_evaluate_exactly(text, value, numbers):
    assert evaluate_expression(text) == (value, numbers)


@pytest.mark.parametrize("text, message", [
    ("1/0", "divides by zero"), ("6/(3-3)", "divides by zero"), ("2**3", "holds '2 \\*\\* 3'"),
    ("-3+4", "holds '-3'"), ("7//2", "holds '7 // 2'"), ("__import__('os')", "not a short expression"),
    ("1e3", "not a short expression"), ("07+1", "not a valid expression"), ("3+", "not a valid expression"),
    ("", "not a short expression"), ("1+" * 150 + "1", "not a short expression"),
])
def test_other_expressions_are_refused(text, message):
    with pytest.raises(ValueError, match=message):
        evaluate_expression(text)


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**32), blanks=st.integers(0, 12))
def test_sudoku_blanks_set_the_givens_and_the_solution_is_unique(seed, blanks):
    example = get_task("sudoku", blanks=blanks)(random.Random(seed))
    assert sudoku_puzzle(example["prompt"]).count(".") == blanks
    check_answer("sudoku", **example)


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**32), count=st.integers(2, 5), max_number=st.integers(1, 30),
       ops=st.sampled_from(["+", "+-", "*+", "+-*/", "+/"]))
def test_countdown_knobs(seed, count, max_number, ops):
    example = get_task("countdown", count=count, max_number=max_number, ops=ops)(random.Random(seed))
    numbers, target = countdown_numbers(example["prompt"])
    assert len(numbers) == count and all(1 <= n <= max_number for n in numbers) and target >= 1
    assert set(re.sub(r"[0-9()]", "", example["response"])) <= set(ops)
    check_answer("countdown", **example)


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**32), terms=st.integers(2, 5), digits=st.integers(1, 4),
       ops=st.sampled_from(["+", "-", "*", "+-*"]))
def test_arith_knobs(seed, terms, digits, ops):
    example = get_task("arith", min_digits=digits, max_digits=digits, terms=terms, ops=ops)(random.Random(seed))
    numbers = re.split(r"[-+*]", example["prompt"][:-1])
    assert len(numbers) == terms and all(len(number) == digits for number in numbers)
    assert set(re.sub(r"[0-9]", "", example["prompt"][:-1])) <= set(ops)
    assert example["response"] == str(evaluate_expression(example["prompt"][:-1])[0])


def test_arith_follows_precedence():
    # 1 - (5 * 4), not (1 - 5) * 4 = -16
    assert get_task("arith", terms=3)(random.Random(2)) == {"prompt": "1-5*4=", "response": "-19"}


@pytest.mark.parametrize("task, knobs, message", [
    ("sudoku", {"blanks": 13}, r"0 <= blanks <= 12 \(a unique 4x4 solution needs 4 givens\), got 13"),
    ("arith", {"ops": "+/"}, r"ops='\+/' must be a non-empty string of the operators '\+-\*'"),
    ("arith", {"terms": 1}, "terms >= 2"),
    ("countdown", {"ops": ""}, "ops='' must be a non-empty string"),
    ("countdown", {"count": 1}, "count >= 2 and max_number >= 1, got count=1"),
    ("countdown", {"max_number": 1, "ops": "-"}, "no expression with positive integer steps .* raise max_number"),
])
def test_bad_knobs_name_the_value(task, knobs, message):
    with pytest.raises(ValueError, match=message):
        get_task(task, **knobs)


def test_prompt_readers_refuse_other_prompts():
    with pytest.raises(ValueError, match="holds no sudoku prompt"):
        sudoku_puzzle("sud 12=")
    with pytest.raises(ValueError, match="holds no countdown prompt"):
        countdown_numbers("rev 12=")
    assert countdown_numbers("cd 1,2 to 3= cd 4,5 to 9=") == ([4, 5], 9)
