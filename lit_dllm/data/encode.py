"""Encode: raw rows -> unshifted examples. The format (chat, prompt/response, text) and its template, tokenising,
then what nothing may change silently: empty responses and examples without a supervised token dropped, overlong
ones dropped or their prompt cut (``formatting.overlong``), long packed text documents split or dropped
(``collation.long_documents``), unknown tokens counted; each with a logged count. The kept examples are numbered
(``example_index``, which keys their noise)."""

from __future__ import annotations

import dataclasses
import functools
import logging
import sys
from typing import Callable

import datasets
import numpy as np
from datasets.fingerprint import Hasher
from transformers import PreTrainedTokenizerBase

from lit_dllm import compat
from lit_dllm.data.formats import (
    ENCODING_VERSION,
    encode_chat,
    encode_prompt_response,
    encode_texts,
    supervised_turns,
    truncate_prompt,
)
from lit_dllm.data.mode import Mode
from lit_dllm.settings import DataSource, Formatting

log = logging.getLogger(__name__)

NEEDS = {"chat": ("messages",), "prompt_response": ("prompt", "response"), "text": ("text",)}
"""The field keys each format reads."""


def fields(source: DataSource) -> dict[str, str]:
    """The column of each field key (``{"prompt": "question", ...}``)."""
    return {key: getattr(source, f"{key}_field") for key in ("messages", "prompt", "response", "text")}


@dataclasses.dataclass(frozen=True)
class Encoder:
    """Batched ``datasets.map`` function: raw columns -> unshifted examples plus their ``length`` and ``num_unk``
    (how many tokens are ``unk_token_id``; 0 when that is None)."""

    tokenizer: PreTrainedTokenizerBase
    format: str
    fields: dict[str, str]
    mask_history: bool
    use_chat_template: bool
    max_seq_len: int
    pack_text: bool
    unk_token_id: int | None

    @property
    def columns(self) -> dict[str, str]:
        """The columns this format reads, each with its field key, e.g. ``{"question": "prompt", ...}``."""
        return {self.fields[key]: key for key in NEEDS[self.format]}

    def __call__(self, batch: dict[str, list]) -> dict[str, list]:
        if self.format == "text":
            examples = encode_texts(self.tokenizer, batch[self.fields["text"]], self.max_seq_len, self.pack_text)
        elif self.format == "chat":
            examples = [encode_chat(self.tokenizer, m, self.mask_history) for m in batch[self.fields["messages"]]]
        else:
            pairs = zip(batch[self.fields["prompt"]], batch[self.fields["response"]])
            examples = [encode_prompt_response(self.tokenizer, p, r, self.use_chat_template) for p, r in pairs]
        columns = {key: [example[key] for example in examples] for key in ("input_ids", "loss_mask", "attention_mask")}
        columns["length"] = [len(ids) for ids in columns["input_ids"]]
        columns["num_unk"] = [ids.count(self.unk_token_id) for ids in columns["input_ids"]]
        return columns


def encoder_for(columns: list[str], source: DataSource, formatting: Formatting, tokenizer: PreTrainedTokenizerBase,
                tokenizer_name: str | None, max_seq_len: int, mode: Mode) -> Encoder:
    """The encoder for data with these columns; raises before any tokenisation if the format or a field is missing."""
    known = fields(source)
    data_format = source.format
    if data_format == "auto":
        found = [fmt for fmt, keys in NEEDS.items() if all(known[key] in columns for key in keys)]
        if not found:
            raise ValueError(
                f"Cannot infer the format of {source.path!r} from its columns {columns}: expected "
                f"{source.messages_field!r} (chat), {source.prompt_field!r} and {source.response_field!r} "
                f"(prompt_response) or {source.text_field!r} (text). Set source.format and the matching "
                "source.*_field settings."
            )
        data_format = found[0]
    for key in NEEDS[data_format]:
        if known[key] not in columns:
            raise ValueError(
                f"format={data_format!r} needs the column {known[key]!r} ({key}_field) but {source.path!r} has "
                f"columns {columns}; set source.{key}_field to one of them."
            )
    if data_format == "text" and mode is Mode.PROMPTS:
        raise ValueError(f"collation.prompts serves prompts with their reference answers, but {source.path!r} is "
                         "text data: use prompt/response or chat data (source.format), or collation.prompts: false.")
    if data_format == "chat" or (data_format == "prompt_response" and formatting.use_chat_template):
        _check_chat_support(tokenizer, tokenizer_name, data_format)
    # Some tokenizers reuse a structural token as unk (GPT-2: <|endoftext|>); unk can't be counted there.
    structural = {tokenizer.eos_token_id, tokenizer.bos_token_id, tokenizer.pad_token_id, tokenizer.mask_token_id}
    unk_token_id = tokenizer.unk_token_id if tokenizer.unk_token_id not in structural else None
    # packed text documents stay whole here: split (or dropped) when longer than a row, with a logged count
    cut_at = sys.maxsize if mode.packs and data_format == "text" else max_seq_len
    return Encoder(tokenizer, data_format, known, formatting.mask_history, formatting.use_chat_template, cut_at,
                   mode.pack_text(formatting), unk_token_id)


def _check_chat_support(tokenizer: PreTrainedTokenizerBase, name: str | None, data_format: str) -> None:
    name = name or "the embedded default"
    if not tokenizer.chat_template:
        raise ValueError(
            f"format={data_format!r} uses the chat template, but tokenizer {name!r} has none. Set "
            "tokenizer.chat_template and save it with save_pretrained (or, for prompt/response data, set "
            "formatting.use_chat_template=False)."
        )
    if not tokenizer.is_fast:
        raise ValueError(
            f"format={data_format!r} with the chat template needs a fast tokenizer (its token offsets locate the "
            f"assistant turns), but tokenizer {name!r} is a slow one."
        )


@dataclasses.dataclass(frozen=True)
class Encoding:
    """How one data module encodes every split: the encoder and what is done with what does not fit."""

    encoder: Encoder
    path: str
    max_seq_len: int
    overlong: str
    split_long_documents: bool

    @functools.cached_property
    def fingerprint(self) -> str:
        """The encoder's hash: a large tokenizer takes seconds to hash, so once for every split."""
        return Hasher.hash([self.encoder, ENCODING_VERSION])

    def __call__(self, raw: datasets.Dataset, split: str) -> datasets.Dataset:
        """Encode; drop empty-response, overlong (or truncate them) and unsupervised examples, warn about unknown
        tokens (logged counts); number the rest. Chat and prompt/response examples keep their ``source_row`` (the
        row of ``raw`` they come from); text has none (packing and chunking change the row count)."""
        encoder, max_seq_len = self.encoder, self.max_seq_len
        answered, chat = raw, encoder.format == "chat"
        if encoder.format != "text":
            key, what = ("messages", "supervised assistant turn") if chat else ("response", "response")
            kwargs = {"chat": chat, "mask_history": encoder.mask_history}
            numbered = raw.add_column("source_row", np.arange(len(raw)))
            answered = _drop(numbered, _answered, encoder.fields[key], kwargs, f"with an empty {what}", split)
            if len(answered) == 0 and len(raw) > 0:
                raise ValueError(
                    f"All {len(raw)} {split} examples of {self.path!r} have an empty {what}: check the column "
                    f"{encoder.fields[key]!r} ({key}_field)."
                )
        encoded = answered.map(
            encoder,
            batched=True,
            remove_columns=raw.column_names,
            new_fingerprint=Hasher.hash([compat.dataset_fingerprint(answered), self.fingerprint]),
            desc=f"Tokenizing {split}",
        )
        _warn_unknown(answered, encoded, encoder, split)
        encoded = encoded.remove_columns("num_unk")
        if encoder.format == "text" and self.split_long_documents:
            encoded = _split_documents(encoded, max_seq_len, split)
        too_long = f"longer than max_seq_len={max_seq_len}"
        if self.overlong == "truncate_prompt" and encoder.format != "text":
            encoded, too_long = _truncate_prompts(encoded, encoder.tokenizer, max_seq_len, split), \
                f"whose response alone is {too_long}"
        fitting = _drop(encoded, _fits, "length", {"max_seq_len": max_seq_len}, too_long, split)
        kept = _drop(fitting, _supervised, "loss_mask", {}, "with no supervised token", split)
        if len(kept) == 0 and len(raw) > 0:
            raise ValueError(
                f"All {len(raw)} {split} examples of {self.path!r} were dropped (empty responses, {too_long}, or no "
                f"supervised token: see the warnings; format {encoder.format!r}, fields {encoder.fields}). Raise "
                "max_seq_len or set formatting.overlong='truncate_prompt', or check the response / messages fields."
            )
        return kept.add_column("example_index", list(range(len(kept))))


def _split_documents(encoded: datasets.Dataset, max_seq_len: int, split: str) -> datasets.Dataset:
    """Text documents longer than a packed row cut into rows' worth of tokens, each piece a document of its own;
    logs the count."""
    long = _count_longer(encoded, max_seq_len)
    if not long:
        return encoded
    pieces = encoded.map(_split_batch, batched=True, fn_kwargs={"piece": max_seq_len},
                         desc=f"Splitting long {split} documents")
    log.warning("Split %d of %d %s documents longer than a packed row (max_seq_len=%d) into %d pieces "
                "(collation.long_documents='split'; 'drop' drops them).", long, len(encoded), split,
                max_seq_len, len(pieces) - len(encoded) + long)
    return pieces


def _truncate_prompts(encoded: datasets.Dataset, tokenizer: PreTrainedTokenizerBase, max_seq_len: int,
                      split: str) -> datasets.Dataset:
    """``encoded`` with overlong examples' prompts cut from the left to fit (those that can); logs the count."""
    overlong = _count_longer(encoded, max_seq_len)
    if not overlong:
        return encoded
    kwargs = {"max_seq_len": max_seq_len, "special_ids": tuple(sorted(tokenizer.all_special_ids))}
    truncated = encoded.map(_truncate_batch, batched=True, fn_kwargs=kwargs, desc=f"Truncating {split}")
    count = overlong - _count_longer(truncated, max_seq_len)
    if count:
        log.warning("Truncated the prompt of %d of %d %s examples longer than max_seq_len=%d (cut from the left).",
                    count, len(encoded), split, max_seq_len)
    return truncated


def _warn_unknown(raw: datasets.Dataset, encoded: datasets.Dataset, encoder: Encoder, split: str) -> None:
    """Warn with counts, and the characters behind them, when ``split`` holds the tokenizer's unknown token."""
    counts = encoded.select_columns(["num_unk", "length"]).with_format("numpy")[:]
    num_unk, total = int(counts["num_unk"].sum()), int(counts["length"].sum())
    if not num_unk:
        return
    chars = _unknown_characters(raw, encoder)
    shown = ", ".join(map(repr, chars[:10])) + (f" and {len(chars) - 10} more" if len(chars) > 10 else "")
    log.warning(
        "%s: %d unknown tokens (%r) = %.2f%% of %d tokens, in %d of %d examples%s. The tokenizer cannot "
        "represent that text: use one that covers it, or clean the data.",
        split, num_unk, encoder.tokenizer.unk_token, 100 * num_unk / total, total,
        np.count_nonzero(counts["num_unk"]), len(encoded), f"; characters it stands for: {shown}" if chars else "",
    )


def _unknown_characters(raw: datasets.Dataset, encoder: Encoder) -> list[str]:
    """The distinct characters of ``raw``'s text that the tokenizer encodes as its unknown token."""
    chars: set[str] = set()
    for batch in raw.select_columns(list(encoder.columns)).iter(batch_size=1000):
        for column, values in batch.items():
            if encoder.columns[column] == "messages":
                values = [message["content"] for messages in values for message in messages]
            chars.update(*values)
    candidates = sorted(chars)
    encoded = encoder.tokenizer(candidates, add_special_tokens=False)["input_ids"] if candidates else []
    return [char for char, ids in zip(candidates, encoded) if encoder.unk_token_id in ids]


def _answered(values: list, chat: bool, mask_history: bool) -> list[bool]:
    """Batched ``filter`` predicate on the response (chat: messages) column: False where the response, or a
    supervised assistant turn, is empty or whitespace."""
    if not chat:
        return [bool(response.strip()) for response in values]
    return [all(m[i]["content"].strip() for i in supervised_turns(m, mask_history)) for m in values]


def _truncate_batch(batch: dict[str, list], max_seq_len: int, special_ids: tuple[int, ...]) -> dict[str, list]:
    """Batched ``map``: ``truncate_prompt`` on each example; those it can't fit stay as they are (dropped later)."""
    keys, special = ("input_ids", "loss_mask", "attention_mask"), set(special_ids)
    examples = [dict(zip(keys, values)) for values in zip(*(batch[key] for key in keys))]
    examples = [truncate_prompt(example, max_seq_len, special) or example for example in examples]
    columns = {key: [example[key] for example in examples] for key in keys}
    columns["length"] = [len(ids) for ids in columns["input_ids"]]
    return columns


def _count_longer(dataset: datasets.Dataset, max_seq_len: int) -> int:
    return int(np.count_nonzero(dataset.select_columns(["length"]).with_format("numpy")[:]["length"] > max_seq_len))


def _split_batch(batch: dict[str, list], piece: int) -> dict[str, list]:
    """Batched ``map``: each example cut into pieces of at most ``piece`` tokens."""
    keys = ("input_ids", "loss_mask", "attention_mask")
    columns = {key: [values[start : start + piece] for values in batch[key] for start in range(0, len(values), piece)]
               for key in keys}
    columns["length"] = [len(ids) for ids in columns["input_ids"]]
    return columns


def _fits(lengths: list[int], max_seq_len: int) -> list[bool]:
    return [length <= max_seq_len for length in lengths]


def _supervised(loss_masks: list[list[int]]) -> list[bool]:
    return [any(mask) for mask in loss_masks]


def _drop(dataset: datasets.Dataset, keep: Callable, column: str, kwargs: dict, reason: str, split: str):
    """``dataset`` filtered by the batched predicate ``keep`` on ``column``; logs how many were dropped."""
    kept = dataset.filter(keep, input_columns=column, batched=True, fn_kwargs=kwargs, desc=f"Filtering {split}")
    if len(kept) < len(dataset):
        log.warning("Dropped %d of %d %s examples %s.", len(dataset) - len(kept), len(dataset), split, reason)
    return kept
