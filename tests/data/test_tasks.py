import random
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lit_dllm.data.tasks import TASKS, get_task, make_task_dataset, make_task_splits


def check_answer(task: str, prompt: str, response: str) -> None:
    if task == "add":
        a, b = map(int, re.fullmatch(r"(\d+)\+(\d+)=", prompt).groups())
        assert int(response) == a + b and response == str(a + b)
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
    with pytest.raises(ValueError, match=r"Unknown task 'multiply'; available tasks: \['add', 'reverse', 'sort'\]"):
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
