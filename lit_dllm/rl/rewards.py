"""Reward functions for RL post-training, in TRL's ``GRPOTrainer`` convention: a plain callable
``(prompts: list[str], completions: list[str], **columns) -> list[float | None]``, ``columns`` being the data's other
columns (``response``: the reference answer) and None meaning "does not apply to this completion".

Built-ins: :func:`exact_answer`, :func:`format_reward` and the verifiers of the built-in tasks (:func:`sudoku_valid`,
:func:`countdown_valid`; :func:`task_reward` names each task's). A config names rewards by import path with weights
(:class:`RewardSpec`), :func:`resolve_rewards` loads them and :func:`score_rewards` scores a batch of completions.
"""

from __future__ import annotations

import importlib
import inspect
import math
import numbers
import re
from collections import Counter
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Sequence

import torch

from lit_dllm.core.generation import extract_answer
from lit_dllm.data.tasks import TASK_PREFIX, TASKS, countdown_numbers, evaluate_expression, sudoku_puzzle

RewardFunction = Callable[..., Sequence[Any]]


def exact_answer(prompts: list[str], completions: list[str], response: list[str], answer_pattern: str = "",
                 **columns: Any) -> list[float]:
    """1.0 where the answer extracted from the completion by ``answer_pattern`` equals the one extracted from the
    reference ``response``, else 0.0 (:func:`~lit_dllm.core.generation.extract_answer`; no pattern: the whole texts;
    a reference without a match scores 0): the per-completion form of validation's ``exact_match``."""
    scores = []
    for completion, reference in zip(completions, response):
        answer, expected = extract_answer(completion, answer_pattern), extract_answer(reference, answer_pattern)
        scores.append(float(answer is not None and answer == expected))
    return scores


def format_reward(prompts: list[str], completions: list[str], pattern: str = r"\S+", **columns: Any) -> list[float]:
    """1.0 where the whole completion matches the regular expression ``pattern`` (``re.fullmatch``), else 0.0. The
    default, one run of non-space characters, rewards an answer that ends cleanly (at eos, no trailing text)."""
    compiled = re.compile(pattern)
    return [float(compiled.fullmatch(completion) is not None) for completion in completions]


def sudoku_valid(prompts: list[str], completions: list[str], answer_pattern: str = "", **columns: Any) -> list[float]:
    """1.0 where the answer (:func:`~lit_dllm.core.generation.extract_answer` of the completion) is 16 digits 1-4
    that solve the prompt's 4x4 Sudoku (:func:`~lit_dllm.data.tasks.sudoku`): its givens kept, each row, column and
    2x2 box holding 1-4 once. Any valid solution counts, not only the reference."""
    return [float(_solves(sudoku_puzzle(prompt), extract_answer(completion, answer_pattern)))
            for prompt, completion in zip(prompts, completions)]


def _solves(puzzle: str, grid: str | None) -> bool:
    if grid is None or len(grid) != 16 or set(grid) - set("1234"):
        return False
    rows = [grid[4 * r : 4 * r + 4] for r in range(4)]
    columns = [grid[c::4] for c in range(4)]
    boxes = [grid[r + c : r + c + 2] + grid[r + c + 4 : r + c + 6] for r in (0, 8) for c in (0, 2)]
    kept = all(given in (".", cell) for given, cell in zip(puzzle, grid))
    return kept and all(set(group) == set("1234") for group in rows + columns + boxes)


def countdown_valid(prompts: list[str], completions: list[str], answer_pattern: str = "",
                    **columns: Any) -> list[float]:
    """1.0 where the answer (:func:`~lit_dllm.core.generation.extract_answer` of the completion) is an expression of
    the prompt's numbers, each at most once, and + - * / (read with ``ast``, never ``eval``:
    :func:`~lit_dllm.data.tasks.evaluate_expression`) whose value is the prompt's target; else 0.0 (a division by zero,
    another number or operator, or a syntax error included)."""
    scores = []
    for prompt, completion in zip(prompts, completions):
        allowed, target = countdown_numbers(prompt)
        answer = extract_answer(completion, answer_pattern)
        try:
            value, used = evaluate_expression(answer or "")
        except ValueError:
            scores.append(0.0)
            continue
        scores.append(float(value == target and not Counter(used) - Counter(allowed)))
    return scores


BUILTIN_REWARDS: dict[str, RewardFunction] = {
    function.__name__: function for function in (exact_answer, format_reward, sudoku_valid, countdown_valid)}
"""The rewards a :class:`RewardSpec` may name without a module."""

TASK_REWARDS: dict[str, RewardFunction] = {"reverse": exact_answer, "sort": exact_answer, "add": exact_answer,
                                           "arith": exact_answer, "sudoku": sudoku_valid, "countdown": countdown_valid}
"""The verifier of each built-in task (:data:`lit_dllm.data.tasks.TASKS`)."""


def task_reward(task: str) -> RewardFunction:
    """The verifier of built-in task ``task`` (``"sort"`` or the data's ``"task:sort"``)."""
    name = task.removeprefix(TASK_PREFIX)
    if name not in TASK_REWARDS:
        raise ValueError(f"No reward for task {task!r}: the built-in tasks are {sorted(TASK_REWARDS)}; name a reward "
                         "function for other data (e.g. lit_dllm.rl.rewards.exact_answer).")
    return TASK_REWARDS[name]


@dataclass(frozen=True)
class RewardSpec:
    """One reward of a config: ``function`` (an import path ``module.function``, or a built-in's name:
    :data:`BUILTIN_REWARDS`), its ``weight`` in the total (0: logged only), ``kwargs`` bound to it (e.g.
    ``{"answer_pattern": "#### (\\\\S+)"}``) and the ``name`` it is logged under (None: the function's name)."""

    function: str
    weight: float = 1.0
    kwargs: dict[str, Any] = field(default_factory=dict)
    name: str | None = None


Reward = tuple[str, RewardFunction, float]
"""A resolved reward: (name, function with its kwargs bound, weight)."""


def _load(path: str) -> Callable:
    if "." not in path:
        if path not in BUILTIN_REWARDS:
            raise ValueError(f"Unknown reward {path!r}: the built-ins are {sorted(BUILTIN_REWARDS)}; name any other "
                             "function by its import path, 'package.module.function'.")
        return BUILTIN_REWARDS[path]
    module_name, _, attribute = path.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"Cannot import the module {module_name!r} of reward {path!r} ({err}); give an importable "
                         "'package.module.function'.") from err
    if not hasattr(module, attribute):
        raise ValueError(f"Module {module_name!r} has no {attribute!r} (reward {path!r}); check the function's name.")
    function = getattr(module, attribute)
    if not callable(function):
        raise TypeError(f"Reward {path!r} is a {type(function).__name__}, not a function; name a callable "
                        "(prompts, completions, **columns) -> list[float].")
    return function


def resolve_rewards(specs: Sequence[RewardSpec | dict | str]) -> list[Reward]:
    """Each spec (a :class:`RewardSpec`, a dict of its fields, or just the function's path) loaded and checked:
    (name, function with ``kwargs`` bound, weight). Errors name the spec and the fix."""
    rewards: list[Reward] = []
    for spec in specs:
        spec = RewardSpec(spec) if isinstance(spec, str) else RewardSpec(**spec) if isinstance(spec, dict) else spec
        function = _load(spec.function)
        weight = spec.weight
        if isinstance(weight, bool) or not isinstance(weight, numbers.Real) or not math.isfinite(weight):
            raise ValueError(f"Reward {spec.function!r} has weight={weight!r}; give a finite number (0: logged only).")
        kwargs = dict(spec.kwargs or {})
        parameters = inspect.signature(function).parameters
        named = [name for name, p in parameters.items() if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)]
        knobs = [name for name in named if name not in ("prompts", "completions")]
        unknown = sorted(set(kwargs) - set(knobs))
        if unknown:
            raise TypeError(f"Reward {spec.function!r} takes no kwargs {unknown}; its keyword parameters are {knobs}.")
        name = spec.name or spec.function.rpartition(".")[2]
        if name in [known for known, _, _ in rewards]:
            raise ValueError(f"Two rewards are named {name!r}; give each a distinct RewardSpec name.")
        rewards.append((name, partial(function, **kwargs) if kwargs else function, float(weight)))
    return rewards


def _scores(name: str, values: Any, completions: list[str]) -> torch.Tensor:
    """``values`` (one reward function's output) as a float32 tensor of one entry per completion, None as NaN; NaN,
    infinities and non-numbers are errors naming the reward and the completion."""
    count = len(completions)
    if isinstance(values, (str, bytes)) or not hasattr(values, "__len__") or len(values) != count:
        size = len(values) if hasattr(values, "__len__") and not isinstance(values, (str, bytes)) else type(values)
        raise ValueError(f"Reward {name!r} returned {size!r} for {count} completions; return a list of one float "
                         "(or None: does not apply) per completion.")
    scores = []
    for index, value in enumerate(values.tolist() if isinstance(values, torch.Tensor) else values):
        if value is not None and not (isinstance(value, numbers.Real) and math.isfinite(value)):
            raise ValueError(f"Reward {name!r} returned {value!r} for completion {index} ({completions[index]!r}); "
                             "return a finite float per completion, or None where the reward does not apply.")
        scores.append(math.nan if value is None else float(value))
    return torch.tensor(scores, dtype=torch.float32)


def score_rewards(rewards: Sequence[Reward], prompts: list[str], completions: list[str],
                  columns: dict[str, list]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Each reward on the ``completions`` of ``prompts`` (``columns``: the data's other columns, one value per
    completion, passed as keyword arguments): (the weighted sum ``[N]``, each reward's own scores ``[N]`` by name).
    A None score (NaN in the per-reward tensor) leaves that reward out of the completion's sum; a completion that no
    reward scores is an error."""
    if not rewards:
        raise ValueError("No rewards to score with: give at least one (resolve_rewards of RewardSpecs).")
    count = len(completions)
    lengths = {"prompts": len(prompts), **{key: len(values) for key, values in columns.items()}}
    wrong = {key: length for key, length in lengths.items() if length != count}
    if wrong:
        raise ValueError(f"{count} completions but {wrong} values: give one prompt and one value of each column per "
                         "completion (repeat a prompt's columns for each of its completions).")
    clash = sorted({"prompts", "completions"} & set(columns))
    if clash:
        raise ValueError(f"Columns named {clash} would hide the reward functions' own arguments; rename them.")
    per_reward: dict[str, torch.Tensor] = {}
    total = torch.zeros(count)
    for name, function, weight in rewards:
        try:
            inspect.signature(function).bind(prompts=prompts, completions=completions, **columns)
        except TypeError as err:
            raise TypeError(f"Reward {name!r} cannot take (prompts, completions) and the columns {sorted(columns)} "
                            f"({err}); give it those parameters and **columns for the rest.") from err
        try:
            values = function(prompts=prompts, completions=completions, **columns)
        except Exception as err:
            err.add_note(f"(in reward {name!r})")
            raise
        per_reward[name] = scores = _scores(name, values, completions)
        total += torch.nan_to_num(scores * weight, nan=0.0)
    unscored = torch.stack(list(per_reward.values())).isnan().all(0).nonzero().flatten().tolist()
    if unscored:
        raise ValueError(f"Completions {unscored} were scored by no reward (each returned None); add a reward that "
                         "applies to them.")
    return total, per_reward
