"""Prompt batches for RL post-training (``collation.prompts``): each tokenised prompt/response or chat example served
as its prompt's ids with the raw columns that reward functions read (:mod:`lit_dllm.rl.rewards`).

The prompt is the example's unsupervised prefix, exactly as supervised training sees it (the chat template's
generation prompt included); the columns are its raw row, the prompt, response and messages fields under those
names, so that a reward reads ``response`` whatever the data calls it.
"""

from __future__ import annotations

from typing import Any

import datasets
import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from lit_dllm.data.formats import supervised_turns

CANONICAL = ("prompt", "response", "messages")
"""The column names that the fields read take in a batch's ``columns``."""


class PromptRows(torch.utils.data.Dataset):
    """Tokenised examples (``input_ids``, ``loss_mask``, ``example_index``) read as prompts with their raw rows.

    Args:
        examples: the tokenised split.
        rows: the raw rows behind it; ``source_rows[example_index]`` is an example's row.
        fields: the raw column of each field that the format reads (``{"question": "prompt", "answer": "response"}``).
        tokenizer: decodes a chat prompt's ids into ``prompt_text``.
        mask_history: the chat formatting's (which assistant turn is the response).
    """

    def __init__(self, examples: datasets.Dataset, rows: datasets.Dataset, source_rows: np.ndarray,
                 fields: dict[str, str], tokenizer: PreTrainedTokenizerBase, mask_history: bool) -> None:
        clash = sorted((set(rows.column_names) - set(fields)) & set(CANONICAL))
        if clash:
            raise ValueError(f"The data's column(s) {clash} would be hidden by the fields renamed in prompt batches "
                             f"({fields}); rename them.")
        self.examples, self.rows, self.source_rows = examples, rows, source_rows
        self.fields, self.tokenizer, self.mask_history = fields, tokenizer, mask_history

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, index: int) -> dict[str, Any]:
        example = self.examples[int(index)]
        prompt_ids = example["input_ids"][: example["loss_mask"].index(1)]  # kept examples have a supervised token
        row = self.rows[int(self.source_rows[example["example_index"]])]
        columns = {self.fields.get(name, name): value for name, value in row.items()}
        if "messages" in columns:  # the response is the first supervised turn, which the prompt ends before
            turn = supervised_turns(columns["messages"], self.mask_history)[0]
            columns["response"] = columns["messages"][turn]["content"]
            prompt_text = self.tokenizer.decode(prompt_ids)
        else:
            prompt_text = columns["prompt"]
        return {"example_index": example["example_index"], "prompt_ids": prompt_ids, "prompt_text": prompt_text,
                "columns": columns}


def collate_prompts(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """:class:`PromptRows` items as a batch: ``example_index`` (long ``[B]``; first, so Lightning infers the batch
    size from it), ``prompt_ids`` (a list of ``B`` 1-D long tensors, unpadded), ``prompt_lengths`` (long ``[B]``),
    ``prompt_text`` (``B`` strings) and ``columns`` (each raw column as a list of ``B`` values)."""
    prompt_ids = [torch.tensor(sample["prompt_ids"], dtype=torch.long) for sample in samples]
    return {
        "example_index": torch.tensor([sample["example_index"] for sample in samples], dtype=torch.long),
        "prompt_ids": prompt_ids,
        "prompt_lengths": torch.tensor([len(ids) for ids in prompt_ids], dtype=torch.long),
        "prompt_text": [sample["prompt_text"] for sample in samples],
        "columns": {key: [sample["columns"][key] for sample in samples] for key in samples[0]["columns"]},
    }
