"""Built-in synthetic prompt -> response tasks: offline, seeded, with exact answers.

Each task is a function ``(rng, **difficulty) -> {"prompt", "response"}``. Strings stay short (the
default run uses the character tokenizer): ``reverse`` "rev 4821=" -> "1284", ``sort`` "sort 4821=" ->
"1248", ``add`` "482+97=" -> "579".
"""

from __future__ import annotations

import inspect
import random
from typing import Callable

import datasets

Example = dict[str, str]
_FEATURES = datasets.Features({"prompt": datasets.Value("string"), "response": datasets.Value("string")})


def _check_range(low_name: str, low: int, high_name: str, high: int) -> None:
    if not 1 <= low <= high:
        raise ValueError(f"Need 1 <= {low_name} <= {high_name}, got {low_name}={low}, {high_name}={high}.")


def _digits(rng: random.Random, min_len: int, max_len: int) -> str:
    _check_range("min_len", min_len, "max_len", max_len)
    return "".join(rng.choice("0123456789") for _ in range(rng.randint(min_len, max_len)))


def _number(rng: random.Random, min_digits: int, max_digits: int) -> int:
    _check_range("min_digits", min_digits, "max_digits", max_digits)
    num_digits = rng.randint(min_digits, max_digits)
    return rng.randint(10 ** (num_digits - 1) if num_digits > 1 else 0, 10**num_digits - 1)


def reverse(rng: random.Random, min_len: int = 2, max_len: int = 8) -> Example:
    """Reverse a string of ``min_len``..``max_len`` digits."""
    digits = _digits(rng, min_len, max_len)
    return {"prompt": f"rev {digits}=", "response": digits[::-1]}


def sort(rng: random.Random, min_len: int = 2, max_len: int = 8) -> Example:
    """Sort a string of ``min_len``..``max_len`` digits ascending."""
    digits = _digits(rng, min_len, max_len)
    return {"prompt": f"sort {digits}=", "response": "".join(sorted(digits))}


def add(rng: random.Random, min_digits: int = 1, max_digits: int = 3) -> Example:
    """Add two integers of ``min_digits``..``max_digits`` digits each."""
    a, b = _number(rng, min_digits, max_digits), _number(rng, min_digits, max_digits)
    return {"prompt": f"{a}+{b}=", "response": str(a + b)}


TASKS: dict[str, Callable[..., Example]] = {"reverse": reverse, "sort": sort, "add": add}


def get_task(name: str, **difficulty) -> Callable[[random.Random], Example]:
    """The task ``name`` bound to its difficulty knobs, validated by generating one example."""
    if name not in TASKS:
        raise ValueError(f"Unknown task {name!r}; available tasks: {sorted(TASKS)} (data='task:<name>').")
    task = TASKS[name]
    knobs = list(inspect.signature(task).parameters)[1:]
    unknown = sorted(set(difficulty) - set(knobs))
    if unknown:
        raise TypeError(f"Task {name!r} has no difficulty knob(s) {unknown}; its knobs are {knobs}.")

    def generate(rng: random.Random) -> Example:
        return task(rng, **difficulty)

    generate(random.Random(0))
    return generate


def _generate(
    name: str, split: str, num_examples: int, seed: int, exclude: set[str], unique: bool, difficulty: dict
) -> list[Example]:
    """``num_examples`` examples whose prompts are not in ``exclude`` (and distinct if ``unique``)."""
    if num_examples < 0:
        raise ValueError(f"num_examples must be >= 0, got {num_examples}.")
    generate = get_task(name, **difficulty)
    rng = random.Random(f"{name}/{split}/{seed}")  # str seeds hash with sha512: stable across processes
    examples, seen, attempts = [], set(exclude), 0
    while len(examples) < num_examples:
        attempts += 1
        if attempts > 100 * num_examples + 1000:
            raise ValueError(
                f"Task {name!r} with difficulty {difficulty} has too few distinct prompts for {num_examples} {split} "
                "examples outside the held-out set; raise the difficulty (e.g. max_len / max_digits) or ask for fewer."
            )
        example = generate(rng)
        if example["prompt"] in seen:
            continue
        if unique:
            seen.add(example["prompt"])
        examples.append(example)
    return examples


def make_task_dataset(name: str, num_examples: int, seed: int, **difficulty) -> datasets.Dataset:
    """``num_examples`` examples of task ``name`` (columns prompt/response), deterministic given ``seed``."""
    examples = _generate(name, "train", num_examples, seed, set(), unique=False, difficulty=difficulty)
    return datasets.Dataset.from_list(examples, features=_FEATURES)


def make_task_splits(
    name: str, num_train: int, num_val: int, seed: int, **difficulty
) -> tuple[datasets.Dataset, datasets.Dataset]:
    """Train and held-out val sets: val prompts are distinct and never occur in train.

    Val is drawn first from its own seed stream, so it stays the same whatever ``num_train`` is.
    """
    val = _generate(name, "val", num_val, seed, set(), unique=True, difficulty=difficulty)
    held_out = {example["prompt"] for example in val}
    train = _generate(name, "train", num_train, seed, held_out, unique=False, difficulty=difficulty)
    return (
        datasets.Dataset.from_list(train, features=_FEATURES),
        datasets.Dataset.from_list(val, features=_FEATURES),
    )

