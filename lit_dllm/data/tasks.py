"""Built-in synthetic prompt -> response tasks: offline, seeded, with verifiable answers.

Each task is a function ``(rng, **difficulty) -> {"prompt", "response"}``. Strings stay short (the
default run uses the character tokenizer): ``reverse`` "rev 4821=" -> "1284", ``sort`` "sort 4821=" ->
"1248", ``add`` "482+97=" -> "579", ``arith`` "12*34-5=" -> "403", ``sudoku`` "sud 1.3.....2.4..1=" (a 4x4 grid
row by row, '.' blank) -> its 16-digit solution, ``countdown`` "cd 3,7,25 to 82=" -> "3*25+7" (any expression
reaching the target right, each number used at most once; :func:`sudoku_puzzle` and :func:`countdown_numbers` read
those prompts back for the verifiers of :mod:`lit_dllm.rl.rewards`).
"""

from __future__ import annotations

import ast
import inspect
import operator
import random
import re
from fractions import Fraction
from typing import Callable

import datasets

Example = dict[str, str]
TASK_PREFIX = "task:"
"""How a data source names a built-in task: ``task:<name>`` (``source.path: task:sort``)."""
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


def _check_ops(ops: str, allowed: str) -> None:
    if not ops or set(ops) - set(allowed):
        raise ValueError(f"ops={ops!r} must be a non-empty string of the operators {allowed!r}, e.g. ops={allowed!r}.")


def arith(rng: random.Random, min_digits: int = 1, max_digits: int = 2, terms: int = 2, ops: str = "+-*") -> Example:
    """``terms`` integers of ``min_digits``..``max_digits`` digits joined by operators drawn from ``ops`` (of
    "+-*"), answered with the usual precedence ("12*34-5=" -> "403"; answers may be negative)."""
    _check_ops(ops, "+-*")
    if terms < 2:
        raise ValueError(f"arith needs terms >= 2 numbers per expression, got terms={terms}.")
    numbers = [str(_number(rng, min_digits, max_digits)) for _ in range(terms)]
    expression = numbers[0] + "".join(rng.choice(ops) + number for number in numbers[1:])
    return {"prompt": f"{expression}=", "response": str(evaluate_expression(expression)[0])}


_ATTEMPTS = 1000
"""Draws a generator makes before it gives up on its difficulty knobs."""
_OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv}
_AST_OPS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}


def evaluate_expression(text: str) -> tuple[Fraction, list[int]]:
    """The exact value of ``text``, non-negative integers joined by + - * / and parentheses (read with ``ast``, never
    ``eval``), and its integers in order. Anything else (a unary minus, ``**``, names, a division by zero) is a
    ValueError."""
    if len(text) > 200 or not re.fullmatch(r"[0-9+\-*/() ]+", text):
        raise ValueError(f"{text[:50]!r} is not a short expression of digits, + - * / and parentheses.")
    try:
        tree = ast.parse(text.strip(), mode="eval").body
    except SyntaxError as err:
        raise ValueError(f"{text!r} is not a valid expression: {err.msg}.") from err
    numbers: list[int] = []

    def value(node: ast.AST) -> Fraction:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            numbers.append(node.value)
            return Fraction(node.value)
        if isinstance(node, ast.BinOp) and type(node.op) in _AST_OPS:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Div) and right == 0:
                raise ValueError(f"{text!r} divides by zero.")
            return _OPS[_AST_OPS[type(node.op)]](left, right)
        raise ValueError(f"{text!r} holds {ast.unparse(node)!r}: only integers, + - * / and parentheses are allowed.")

    return value(tree), numbers


def _sudoku_solutions(cells: list[int], limit: int = 2, rng: random.Random | None = None) -> list[list[int]]:
    """Up to ``limit`` solutions of a 4x4 grid (row by row, 0 blank), found by backtracking (trying the digits in
    ``rng``'s random order when given)."""
    if 0 not in cells:
        return [list(cells)]
    blank = cells.index(0)
    row, col = divmod(blank, 4)
    box = [4 * r + c for r in range(row // 2 * 2, row // 2 * 2 + 2) for c in range(col // 2 * 2, col // 2 * 2 + 2)]
    seen = {cells[i] for i in [4 * row + c for c in range(4)] + [4 * r + col for r in range(4)] + box}
    solutions = []
    candidates = sorted({1, 2, 3, 4} - seen)
    for digit in rng.sample(candidates, len(candidates)) if rng else candidates:
        cells[blank] = digit
        solutions += _sudoku_solutions(cells, limit - len(solutions), rng)
        if len(solutions) >= limit:
            break
    cells[blank] = 0
    return solutions


def sudoku(rng: random.Random, blanks: int = 6) -> Example:
    """A 4x4 Sudoku (digits 1-4; each row, column and 2x2 box holds each once) with ``blanks`` of its 16 cells
    blank ('.'), always with a unique solution, which is the response."""
    if not 0 <= blanks <= 12:
        raise ValueError(f"sudoku needs 0 <= blanks <= 12 (a unique 4x4 solution needs 4 givens), got {blanks}.")
    for _ in range(_ATTEMPTS):
        cells = _sudoku_solutions([0] * 16, 1, rng)[0]
        solution, blanked = "".join(map(str, cells)), 0
        for cell in rng.sample(range(16), 16):
            if blanked == blanks:
                break
            kept, cells[cell] = cells[cell], 0
            if len(_sudoku_solutions(cells)) == 1:
                blanked += 1
            else:
                cells[cell] = kept
        if blanked == blanks:
            puzzle = "".join(str(digit or ".") for digit in cells)
            return {"prompt": f"sud {puzzle}=", "response": solution}
    raise ValueError(f"Found no 4x4 sudoku with a unique solution and blanks={blanks} in {_ATTEMPTS} grids; lower "
                     "blanks.")


def sudoku_puzzle(prompt: str) -> str:
    """The 16 cells ('.' blank) of the last ``sudoku`` prompt in ``prompt``; a ValueError when it holds none."""
    found = re.findall(r"sud ([1-4.]{16})=", prompt)
    if not found:
        raise ValueError(f"{prompt[-60:]!r} holds no sudoku prompt ('sud <16 cells of 1-4 or .>=').")
    return found[-1]


_PRECEDENCE = {"+": 1, "-": 1, "*": 2, "/": 2}


def countdown(rng: random.Random, count: int = 3, max_number: int = 20, ops: str = "+-*") -> Example:
    """``count`` numbers of 1..``max_number`` and a target that an expression of all of them reaches with the
    operators ``ops`` (of "+-*/"), every step a positive integer; the response is one such expression, but any
    expression reaching the target with each number at most once is right."""
    _check_ops(ops, "+-*/")
    if count < 2 or max_number < 1:
        raise ValueError(f"countdown needs count >= 2 and max_number >= 1, got count={count}, max_number={max_number}.")
    for _ in range(_ATTEMPTS):
        numbers = [rng.randint(1, max_number) for _ in range(count)]
        parts = [(str(n), Fraction(n), 3) for n in numbers]  # (text, value, precedence)
        while len(parts) > 1:
            (left_text, left, left_prec), (right_text, right, right_prec) = [parts.pop(rng.randrange(len(parts)))
                                                                             for _ in range(2)]
            op = rng.choice(ops)
            prec = _PRECEDENCE[op]
            left_text = f"({left_text})" if left_prec < prec else left_text
            right_text = f"({right_text})" if right_prec < prec or (right_prec == prec and op in "-/") else right_text
            parts.append((left_text + op + right_text, _OPS[op](left, right), prec))  # values stay > 0: no 1/0
            if parts[-1][1] <= 0 or parts[-1][1].denominator != 1:
                break
        else:
            text, target, _ = parts[0]
            return {"prompt": f"cd {','.join(map(str, numbers))} to {target}=", "response": text}
    raise ValueError(f"countdown found no expression with positive integer steps in {_ATTEMPTS} draws of count={count} "
                     f"numbers up to max_number={max_number} with ops={ops!r}; raise max_number or add '+' to ops.")


def countdown_numbers(prompt: str) -> tuple[list[int], int]:
    """The numbers and target of the last ``countdown`` prompt in ``prompt``; a ValueError when it holds none."""
    found = re.findall(r"cd ([0-9]+(?:,[0-9]+)*) to ([0-9]+)=", prompt)
    if not found:
        raise ValueError(f"{prompt[-60:]!r} holds no countdown prompt ('cd <numbers, comma-separated> to <target>=').")
    numbers, target = found[-1]
    return [int(n) for n in numbers.split(",")], int(target)


TASKS: dict[str, Callable[..., Example]] = {"reverse": reverse, "sort": sort, "add": add, "arith": arith,
                                            "sudoku": sudoku, "countdown": countdown}


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

