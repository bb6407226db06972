"""Prompt batches for RL (``collation.prompts``): prompt ids as training sees them, with the raw columns."""

import pytest
import torch

from lit_dllm.data.batch import split_prompt_answer
from lit_dllm.data.datamodule import DLLMDataModule
from lit_dllm.rl.rewards import score_rewards, task_reward
from tests.data.test_datamodule import write_jsonl

PROMPT_KEYS = ["example_index", "prompt_ids", "prompt_lengths", "prompt_text", "columns"]


def make(tmp_path, path="task:countdown", setup=True, **groups) -> DLLMDataModule:
    settings = {"source": {"path": path, "cache_dir": str(tmp_path / "cache")}, "task": {"num_train": 24, "num_val": 10},
                "loader": {"batch_size": 4}, "collation": {"prompts": True}, "max_seq_len": 48}
    for name, value in groups.items():
        settings[name] = {**settings.get(name, {}), **value} if isinstance(value, dict) else value
    dm = DLLMDataModule(**settings)
    if setup:
        dm.setup("fit")
    return dm


def test_task_prompts_with_their_references(tmp_path):
    dm = make(tmp_path, task={"kwargs": {"count": 3, "max_number": 9}})
    batch = next(iter(dm.val_dataloader()))
    assert list(batch) == PROMPT_KEYS
    assert batch["example_index"].tolist() == [0, 1, 2, 3]
    assert set(batch["columns"]) == {"prompt", "response"}
    val_rows = dm.source_row(0, "validate")
    assert batch["prompt_text"][0] == batch["columns"]["prompt"][0] == val_rows["prompt"]
    assert batch["columns"]["response"][0] == val_rows["response"]
    for ids, length, text in zip(batch["prompt_ids"], batch["prompt_lengths"], batch["prompt_text"]):
        assert ids.dtype == torch.long and len(ids) == length
        assert ids.tolist() == dm.tokenizer(text)["input_ids"]  # the char tokenizer: one id a character
        assert dm.tokenizer.decode(ids) == text
    rewards = [("countdown_valid", task_reward("countdown"), 1.0)]
    total, _ = score_rewards(rewards, batch["prompt_text"], batch["columns"]["response"], batch["columns"])
    assert total.tolist() == [1.0] * 4


def test_prompts_are_the_prefix_that_supervised_batches_hold(tmp_path):
    prompts = make(tmp_path / "prompts", path="task:add")
    examples = make(tmp_path / "examples", path="task:add", collation={"prompts": False})
    for prompt_batch, batch in zip(prompts.val_dataloader(), examples.val_dataloader()):
        rows, prompt_ids, _ = split_prompt_answer(batch)
        assert rows == list(range(len(rows))) and torch.equal(prompt_batch["example_index"], batch["example_index"])
        assert all(torch.equal(a, b) for a, b in zip(prompt_batch["prompt_ids"], prompt_ids))


def test_training_prompt_batches_are_keyed_and_resumable(tmp_path):
    dm = make(tmp_path, path="task:sudoku", task={"kwargs": {"blanks": 4}})
    epoch = list(dm.train_dataloader())
    assert len(epoch) == 6 and all(batch["epoch"] == 0 for batch in epoch)
    assert sorted(torch.cat([batch["example_index"] for batch in epoch]).tolist()) == list(range(24))
    assert all(text.startswith("sud ") and text.count(".") == 4 for batch in epoch for text in batch["prompt_text"])
    stopped = make(tmp_path, path="task:sudoku", task={"kwargs": {"blanks": 4}})
    batches = iter(stopped.train_dataloader())
    next(batches), next(batches)
    resumed = make(tmp_path, path="task:sudoku", task={"kwargs": {"blanks": 4}})
    resumed.load_state_dict(stopped.state_dict())
    assert [b["example_index"].tolist() for b in resumed.train_dataloader()] == [
        b["example_index"].tolist() for b in epoch[2:]]


def test_file_columns_under_the_field_names_and_extra_columns(tmp_path):
    rows = [{"question": f"{a}+{a}=", "answer": str(2 * a), "level": a % 3} for a in range(12)]
    path = write_jsonl(tmp_path / "qa.jsonl", rows)
    dm = make(tmp_path, path=path, source={"prompt_field": "question", "response_field": "answer"},
              splits={"val_fraction": 0.25})
    batch = next(iter(dm.val_dataloader()))
    assert set(batch["columns"]) == {"prompt", "response", "level"}
    for text, response, level in zip(batch["prompt_text"], batch["columns"]["response"], batch["columns"]["level"]):
        a = int(text.split("+")[0])
        assert (text, response, level) == (f"{a}+{a}=", str(2 * a), a % 3)


@pytest.mark.parametrize("mask_history", [False, True])
def test_chat_prompts_end_at_the_supervised_turn(tmp_path, mask_history):
    conversations = [[{"role": "user", "content": f"{a}+1="}, {"role": "assistant", "content": str(a + 1)},
                      {"role": "user", "content": "and +2?"}, {"role": "assistant", "content": str(a + 2)}]
                     for a in range(10)]
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": m} for m in conversations])
    dm = make(tmp_path, path=path, formatting={"mask_history": mask_history}, splits={"val_fraction": 0.2},
              max_seq_len=64)
    batch = next(iter(dm.val_dataloader()))
    assert set(batch["columns"]) == {"messages", "response"}
    for text, messages, response in zip(batch["prompt_text"], batch["columns"]["messages"],
                                        batch["columns"]["response"]):
        a = int(messages[0]["content"].split("+")[0])
        if mask_history:  # the prompt is the conversation before the last answer
            assert text == f"<|user|>{a}+1=<|assistant|>{a + 1}<eos><|user|>and +2?<|assistant|>"
            assert response == str(a + 2)
        else:
            assert (text, response) == (f"<|user|>{a}+1=<|assistant|>", str(a + 1))


def test_prompts_need_prompts_with_answers(tmp_path):
    path = write_jsonl(tmp_path / "text.jsonl", [{"text": "hello world"}] * 8)
    with pytest.raises(ValueError, match=r"collation.prompts serves prompts with their reference answers, but .* is "
                                         "text data"):
        make(tmp_path, path=path)


def test_prompts_are_not_packed_or_streamed(tmp_path):
    with pytest.raises(ValueError, match="collation.prompts with collation.pack: .* set collation.pack: false"):
        make(tmp_path, setup=False, collation={"pack": True})
    with pytest.raises(ValueError, match="collation.prompts serves the prompts of a split read whole: set "
                                         "source.streaming: false"):
        DLLMDataModule(source={"path": "some/hub_id", "streaming": True}, collation={"prompts": True})


def test_a_column_named_like_a_field_is_refused(tmp_path):
    rows = [{"question": f"{a}+{a}=", "answer": str(2 * a), "response": "x"} for a in range(12)]
    path = write_jsonl(tmp_path / "qa.jsonl", rows)
    dm = make(tmp_path, path=path, source={"prompt_field": "question", "response_field": "answer"})
    with pytest.raises(ValueError, match=r"The data's column\(s\) \['response'\] would be hidden"):
        dm.val_dataloader()
