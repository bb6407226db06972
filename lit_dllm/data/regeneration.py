"""What :class:`~lit_dllm.callbacks.RegeneratedDataWriter` asks of a data module to write a model's own answers as
data: the raw row behind each tokenised example, that row with another answer, and examples left out of predict."""

from __future__ import annotations

import reprlib
from typing import Any, Iterable

import datasets
import numpy as np

from lit_dllm.data.formats import supervised_turns


class SourceRowsMixin:
    """The regeneration side of :class:`~lit_dllm.data.datamodule.DLLMDataModule`, over its built splits (``_raw``:
    the raw rows of each split role, ``_source_rows``: each example's row there, ``_encoded_with``: the encoder) and
    its ``_role`` / ``_examples`` of a stage."""

    _predict_exclude: frozenset[int] = frozenset()

    def num_examples(self, stage: str = "predict") -> tuple[int, int]:
        """(tokenised examples, raw rows) of ``stage``'s split: the difference is what the logged drops removed."""
        return len(self._examples(stage)), len(self._raw[self._role(stage)])

    def source_row(self, example_index: int, stage: str = "predict") -> dict[str, Any]:
        """The raw row (the columns the format reads, as read) behind tokenised example ``example_index`` of
        ``stage``'s split. Chat and prompt/response data only: packed or chunked text has no row per example."""
        role = self._role(stage)
        if role not in self._source_rows:
            raise ValueError("Text examples have no source row: packing and chunking change the row count.")
        rows = self._source_rows[role]
        if not 0 <= example_index < len(rows):
            raise ValueError(f"example_index={example_index} is outside the {len(rows)} {stage} examples.")
        return self._raw[role][int(rows[int(example_index)])]

    def replace_response(self, row: dict[str, Any], response: str) -> dict[str, Any]:
        """A copy of the source row ``row`` with its response replaced: the response field (prompt/response), or
        the content of the one supervised assistant turn (chat; multi-turn chats need ``mask_history=True``, so
        the prompt is the whole conversation before the last assistant turn)."""
        self.setup()
        encoder = self._encoded_with
        if encoder.format == "prompt_response":
            return {**row, encoder.fields["response"]: response}
        if encoder.format != "chat":
            raise ValueError(f"format={encoder.format!r} data has no response to replace.")
        messages = [dict(message) for message in row[encoder.fields["messages"]]]
        turns = supervised_turns(messages, encoder.mask_history)
        if len(turns) != 1:
            raise ValueError(
                f"The conversation {reprlib.repr(messages)} has {len(turns)} supervised assistant turns, and its "
                "prompt ends before the first: set data.init_args.formatting.mask_history=true to make it everything "
                "before the last."
            )
        messages[turns[0]]["content"] = response
        return {**row, encoder.fields["messages"]: messages}

    def exclude_from_predict(self, example_indices: Iterable[int]) -> None:
        """Leave these ``example_index`` values out of ``predict_dataloader`` (e.g. answers already written)."""
        self._predict_exclude = frozenset(int(index) for index in example_indices)

    def _predictable(self, examples: datasets.Dataset) -> datasets.Dataset:
        """``examples`` less those :meth:`exclude_from_predict` named."""
        if not self._predict_exclude:
            return examples
        indices = examples.with_format("numpy")["example_index"]
        return examples.select(np.flatnonzero(~np.isin(indices, list(self._predict_exclude))))
