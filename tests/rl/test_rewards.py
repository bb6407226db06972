import math

import pytest
import torch

from lit_dllm.data.tasks import TASKS, make_task_dataset
from lit_dllm.rl.rewards import (
    RewardSpec,
    countdown_valid,
    exact_answer,
    format_reward,
    resolve_rewards,
    score_rewards,
    sudoku_valid,
    task_reward,
)

# rows 3241 / 1432 / 4123 / 2314: each row, column and 2x2 box holds 1-4 once; the puzzle's givens are kept
PUZZLE, SOLUTION = "sud .24.1.3241.3..14=", "3241143241232314"


def short(prompts, completions, **columns):
    return [1.0]


@pytest.mark.parametrize("grid, score", [
    (SOLUTION, 1.0),
    ("4231143241232314", 0.0),  # rows 4231 / 1432: column 0 holds 4 twice, the given 4 of cell 2 is lost
    ("3241143241232341", 0.0),  # last row 2341: column 2 holds 4 twice
    ("324114324123231", 0.0),   # 15 cells
    ("3241143241232314\n", 0.0),
    ("32411432412323x4", 0.0),
    ("", 0.0),
])
def test_sudoku_valid_checks_the_grid_against_the_puzzle(grid, score):
    assert sudoku_valid([PUZZLE], [grid]) == [score]


def test_sudoku_valid_takes_any_solution_and_checks_the_boxes():
    empty = "sud ................="
    # 1234 / 3412 / 2143 / 4321 is a sudoku; 1234 / 2143 / 3412 / 4321 a latin square whose top-left box is 1,2,2,1
    assert sudoku_valid([empty, empty], ["1234341221434321", "1234214334124321"]) == [1.0, 0.0]


def test_sudoku_valid_reads_the_answer_by_pattern():
    assert sudoku_valid([PUZZLE] * 2, [f"grid: {SOLUTION}", SOLUTION], answer_pattern=r"grid: (\d+)") == [1.0, 0.0]


@pytest.mark.parametrize("prompt, expression, score", [
    ("cd 3,7,25 to 82=", "3*25+7", 1.0),
    ("cd 3,7,25 to 82=", "7+25*3", 1.0),      # another right answer
    ("cd 3,7,25 to 82=", "(25+7)*3", 0.0),    # 96
    ("cd 3,7,25 to 28=", "3+25", 1.0),        # each number at most once: 7 unused is fine
    ("cd 3,7,25 to 50=", "25+25", 0.0),       # 25 used twice
    ("cd 25,25,3 to 50=", "25+25", 1.0),      # ... unless the prompt gives it twice
    ("cd 3,7,25 to 82=", "3*25+7*1", 0.0),    # 1 is not among the numbers
    ("cd 7,2,4 to 14=", "7/2*4", 1.0),        # exact fractions on the way
    ("cd 6,4,4,2 to 3=", "6/(4-4)", 0.0),     # division by zero
    ("cd 3,2 to 9=", "3**2", 0.0),            # no powers
    ("cd 3,2 to 1=", "-2+3", 0.0),            # no unary minus
    ("cd 3,2 to 5=", "__import__('os').system('true')", 0.0),
    ("cd 3,2 to 5=", "3+2 and more", 0.0),
    ("cd 3,2 to 5=", "", 0.0),
])
def test_countdown_valid(prompt, expression, score):
    assert countdown_valid([prompt], [expression]) == [score]


def test_countdown_valid_reads_the_answer_by_pattern():
    prompts = ["cd 3,7,25 to 82="] * 2
    assert countdown_valid(prompts, ["so: 3*25+7", "3*25+7"], answer_pattern="so: (.*)") == [1.0, 0.0]


def test_exact_answer_with_and_without_a_pattern():
    assert exact_answer(["rev 4821="] * 3, ["1284", "1284 ", "1248"], response=["1284"] * 3) == [1.0, 0.0, 0.0]
    pattern = r"#### (\S+)"
    completions = ["so #### 42", "so #### 41", "42", "#### 42"]
    references = ["6*7 #### 42", "6*7 #### 42", "42", "42"]  # the last two references have no answer: 0
    assert exact_answer([""] * 4, completions, response=references, answer_pattern=pattern) == [1.0, 0.0, 0.0, 0.0]


def test_format_reward():
    assert format_reward([""] * 4, ["1284", "1284 5", "", "1284\n"]) == [1.0, 0.0, 0.0, 0.0]
    assert format_reward([""] * 2, [SOLUTION, "1234"], pattern="[1-4]{16}") == [1.0, 0.0]


@pytest.mark.parametrize("task, reward", [
    ("reverse", exact_answer), ("sort", exact_answer), ("add", exact_answer), ("arith", exact_answer),
    ("sudoku", sudoku_valid), ("countdown", countdown_valid), ("task:countdown", countdown_valid),
])
def test_task_reward(task, reward):
    assert task_reward(task) is reward


@pytest.mark.parametrize("task", sorted(TASKS))
def test_each_task_reference_scores_full_marks_and_a_wrong_answer_none(task):
    examples = make_task_dataset(task, 50, seed=1)
    rewards = [(task, task_reward(task), 1.0)]
    prompts, responses = examples["prompt"], examples["response"]
    total, _ = score_rewards(rewards, prompts, responses, {"response": responses})
    assert total.tolist() == [1.0] * 50
    wrong, _ = score_rewards(rewards, prompts, ["9" * 20] * 50, {"response": responses})
    assert wrong.tolist() == [0.0] * 50


def test_unknown_task_reward():
    with pytest.raises(ValueError, match=r"No reward for task 'task:multiply': the built-in tasks are \['add'"):
        task_reward("task:multiply")


def test_resolve_and_score_weighted_rewards():
    rewards = resolve_rewards([
        RewardSpec("lit_dllm.rl.rewards.exact_answer", kwargs={"answer_pattern": r"= (\d+)"}),
        {"function": "format_reward", "weight": 0.5, "kwargs": {"pattern": r"= \d+"}},
    ])
    assert [(name, weight) for name, _, weight in rewards] == [("exact_answer", 1.0), ("format_reward", 0.5)]
    total, per_reward = score_rewards(rewards, ["1+1=", "2+2=", "3+3="], ["= 2", "= 5", "6"],
                                      {"response": ["= 2", "= 4", "= 6"]})
    assert per_reward["exact_answer"].tolist() == [1.0, 0.0, 0.0]  # "6" has no "= <digits>"
    assert per_reward["format_reward"].tolist() == [1.0, 1.0, 0.0]
    assert total.tolist() == [1.5, 0.5, 0.0] and total.dtype == torch.float32


def test_a_function_by_its_import_path_and_a_distinct_name():
    rewards = resolve_rewards(["tests.rl.test_rewards.short", RewardSpec("exact_answer", name="exact", weight=0)])
    assert [(name, function, weight) for name, function, weight in rewards] == [
        ("short", short, 1.0), ("exact", exact_answer, 0.0)]


def test_none_leaves_a_reward_out_of_the_sum():
    def sometimes(prompts, completions, **columns):
        return [0.5, None]

    rewards = [("always", lambda prompts, completions, **c: [1.0, 2.0], 1.0), ("sometimes", sometimes, 2.0)]
    total, per_reward = score_rewards(rewards, ["a", "b"], ["x", "y"], {})
    assert total.tolist() == [2.0, 2.0]
    assert per_reward["sometimes"][0] == 0.5 and math.isnan(per_reward["sometimes"][1])
    with pytest.raises(ValueError, match=r"Completions \[1\] were scored by no reward"):
        score_rewards([("sometimes", sometimes, 1.0)], ["a", "b"], ["x", "y"], {})


def test_a_tensor_of_scores_is_taken():
    rewards = [("tensor", lambda prompts, completions, **c: torch.tensor([1.0, 0.0]), 1.0)]
    assert score_rewards(rewards, ["a", "b"], ["x", "y"], {})[0].tolist() == [1.0, 0.0]


@pytest.mark.parametrize("spec, error, message", [
    ("no_such_module.reward", ValueError, r"Cannot import the module 'no_such_module' of reward 'no_such_module\.reward'"),
    ("lit_dllm.rl.rewards.nope", ValueError, r"Module 'lit_dllm\.rl\.rewards' has no 'nope'"),
    ("lit_dllm.rl.rewards.TASK_REWARDS", TypeError, "is a dict, not a function"),
    ("exact", ValueError, r"Unknown reward 'exact': the built-ins are \['countdown_valid', 'exact_answer'"),
    ({"function": "exact_answer", "kwargs": {"answer_patern": "x"}}, TypeError,
     r"takes no kwargs \['answer_patern'\]; its keyword parameters are \['response', 'answer_pattern'\]"),
    ({"function": "exact_answer", "weight": math.nan}, ValueError, "weight=nan; give a finite number"),
    ({"function": "exact_answer", "weight": "high"}, ValueError, "weight='high'"),
    ({"function": "exact_answer", "wieght": 1}, TypeError, "wieght"),
])
def test_bad_specs_name_the_value_and_the_fix(spec, error, message):
    with pytest.raises(error, match=message):
        resolve_rewards([spec])


def test_two_rewards_of_one_name():
    with pytest.raises(ValueError, match="Two rewards are named 'exact_answer'; give each a distinct RewardSpec name"):
        resolve_rewards(["exact_answer", {"function": "exact_answer", "kwargs": {"answer_pattern": "(x)"}}])


@pytest.mark.parametrize("output, message", [
    ([1.0], r"Reward 'bad' returned 1 for 2 completions; return a list of one float"),
    ("ab", r"Reward 'bad' returned <class 'str'> for 2 completions"),
    (1.0, r"returned <class 'float'> for 2 completions"),
    ([1.0, "yes"], r"Reward 'bad' returned 'yes' for completion 1 \('y'\); return a finite float"),
    ([1.0, math.inf], r"returned inf for completion 1"),
    ([math.nan, 1.0], r"Reward 'bad' returned nan for completion 0 \('x'\).* None where the reward does not apply"),
    (torch.tensor([1.0, math.nan]), r"returned nan for completion 1"),
])
def test_bad_outputs_name_the_reward(output, message):
    with pytest.raises(ValueError, match=message):
        score_rewards([("bad", lambda prompts, completions, **c: output, 1.0)], ["a", "b"], ["x", "y"], {})


def test_bad_batches():
    rewards = resolve_rewards(["exact_answer"])
    with pytest.raises(TypeError, match=r"Reward 'exact_answer' cannot take \(prompts, completions\) and the columns "
                                        r"\[\] .*missing a required argument: 'response'"):
        score_rewards(rewards, ["a"], ["x"], {})
    with pytest.raises(ValueError, match=r"2 completions but \{'response': 1\} values"):
        score_rewards(rewards, ["a", "b"], ["x", "y"], {"response": ["x"]})
    with pytest.raises(ValueError, match=r"Columns named \['completions'\] would hide"):
        score_rewards(rewards, ["a"], ["x"], {"response": ["x"], "completions": ["x"]})
    with pytest.raises(ValueError, match="No rewards to score with"):
        score_rewards([], ["a"], ["x"], {})
    with pytest.raises(TypeError, match=r"Reward 'short' cannot take .* give it those parameters and \*\*columns"):
        score_rewards([("short", lambda prompts, completions: [1.0], 1.0)], ["a"], ["x"], {"response": ["x"]})


def test_an_error_inside_a_reward_names_it():
    rewards = resolve_rewards(["sudoku_valid"])
    with pytest.raises(ValueError, match="holds no sudoku prompt") as raised:
        score_rewards(rewards, ["rev 12="], ["21"], {})
    assert raised.value.__notes__ == ["(in reward 'sudoku_valid')"]
