"""Raw examples -> unshifted ``{input_ids, loss_mask, attention_mask}`` lists (``loss_mask[i]=1``: token i is
supervised; ``attention_mask`` is all ones over content).

* chat: the tokenizer's chat template; assistant turns (content + the end-of-turn token) supervised.
* prompt/response: an unsupervised prompt prefix, then the supervised response and eos; ``truncate_prompt``
  shortens the prefix of an example that is too long.
* text: every token supervised; documents end with eos and are packed or chunked to ``max_seq_len``.
"""

from __future__ import annotations

from typing import Iterator, Sequence

from transformers import PreTrainedTokenizerBase

Example = dict[str, list[int]]
Message = dict[str, str]

ENCODING_VERSION = 2
"""Part of every tokenized cache's fingerprint: raise it whenever an encoding here changes (2: a chat's suffix after
its last answer dropped), so no cache written before is read back."""


def _example(input_ids: list[int], loss_mask: list[int]) -> Example:
    return {"input_ids": input_ids, "loss_mask": loss_mask, "attention_mask": [1] * len(input_ids)}


def _render(tokenizer: PreTrainedTokenizerBase, messages: Sequence[Message], add_generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=add_generation_prompt)


def supervised_turns(messages: Sequence[Message], mask_history: bool = False) -> list[int]:
    """Indices of the supervised assistant turns: all of them, or only the last with ``mask_history``."""
    turns = [i for i, message in enumerate(messages) if message["role"] == "assistant"]
    return turns[-1:] if mask_history else turns


def _assistant_spans(
    tokenizer: PreTrainedTokenizerBase, messages: Sequence[Message], text: str, mask_history: bool
) -> Iterator[tuple[int, int]]:
    """Character spans of ``text`` (the rendered chat) holding the supervised assistant turns.

    A turn's span runs from the end of the conversation rendered up to it with the generation prompt,
    to the end of the conversation rendered through it. Both renders must be prefixes of ``text``.
    """
    for i in supervised_turns(messages, mask_history):
        start = _render(tokenizer, messages[:i], add_generation_prompt=True)
        end = _render(tokenizer, messages[: i + 1], add_generation_prompt=False)
        if not (text.startswith(start) and text.startswith(end)):
            raise ValueError(
                f"The chat template of {tokenizer.name_or_path!r} does not render conversations prefix-stably "
                f"(turn {i} renders differently inside the full conversation), so assistant spans can't be located. "
                "Use a template that renders earlier turns unchanged."
            )
        yield len(start), len(end)


def encode_chat(tokenizer: PreTrainedTokenizerBase, messages: Sequence[Message], mask_history: bool = False) -> Example:
    """Tokenize a conversation with the chat template; supervise the assistant turns.

    Each assistant turn's supervised tokens are those overlapping its content, through its closing special token
    (e.g. eos); anything the template appends after that token (such as a newline) is not supervised, and after the
    conversation's last supervised turn it is dropped: a diffusion model would see it unmasked right after the answer
    (so learn where the answer ends from it), which generation never shows. ``mask_history`` supervises only the last
    assistant turn.
    """
    text = _render(tokenizer, messages, add_generation_prompt=False)
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    input_ids, offsets = encoding["input_ids"], encoding["offset_mapping"]
    special_ids = set(tokenizer.all_special_ids)
    loss_mask = [0] * len(input_ids)
    for span_start, span_end in _assistant_spans(tokenizer, messages, text, mask_history):
        turn = [i for i, (start, end) in enumerate(offsets) if start < span_end and end > span_start]
        closing = [i for i in turn if input_ids[i] in special_ids]
        for i in turn:
            if not closing or i <= closing[-1]:
                loss_mask[i] = 1
    if messages and messages[-1]["role"] == "assistant" and any(loss_mask):
        end = max(i for i, supervised in enumerate(loss_mask) if supervised) + 1
        input_ids, loss_mask = input_ids[:end], loss_mask[:end]
    return _example(input_ids, loss_mask)


def encode_prompt(tokenizer: PreTrainedTokenizerBase, prompt: str) -> list[int]:
    """Prompt ids as training sees them: the tokenizer's own specials (e.g. bos) added, while special-token
    strings inside the text (a literal "<mask>") stay plain text and never become the mask id."""
    return tokenizer(prompt, split_special_tokens=True)["input_ids"]


def encode_prompt_response(
    tokenizer: PreTrainedTokenizerBase, prompt: str, response: str, use_chat_template: bool = False
) -> Example:
    """Unsupervised prompt tokens, then supervised response tokens and eos.

    With ``use_chat_template`` the pair becomes a user turn and an assistant turn of the chat template.
    """
    if use_chat_template:
        return encode_chat(tokenizer, [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}])
    prompt_ids = encode_prompt(tokenizer, prompt)
    response_ids = tokenizer(response, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    response_ids = response_ids + [tokenizer.eos_token_id]
    return _example(prompt_ids + response_ids, [0] * len(prompt_ids) + [1] * len(response_ids))


def encode_texts(
    tokenizer: PreTrainedTokenizerBase, texts: Sequence[str], max_seq_len: int, pack: bool = True
) -> list[Example]:
    """Fully supervised chunks of at most ``max_seq_len`` tokens; each document ends with eos.

    ``pack`` concatenates the documents and cuts the stream into chunks (only the last chunk may be
    shorter); otherwise each document is chunked on its own.
    """
    encoded = tokenizer(list(texts), add_special_tokens=False, split_special_tokens=True)["input_ids"]
    documents = [ids + [tokenizer.eos_token_id] for ids in encoded]
    streams = [[token for document in documents for token in document]] if pack else documents
    return [
        _example(stream[start : start + max_seq_len], [1] * len(stream[start : start + max_seq_len]))
        for stream in streams
        for start in range(0, len(stream), max_seq_len)
    ]


def truncate_prompt(example: Example, max_seq_len: int, special_ids: set[int]) -> Example | None:
    """``example`` cut to ``max_seq_len`` tokens by dropping the oldest tokens of its unsupervised prefix, after
    the prefix's leading special tokens (e.g. bos); None when the part from the first supervised token on (plus
    those special tokens) does not fit."""
    ids, loss_mask = example["input_ids"], example["loss_mask"]
    cut = len(ids) - max_seq_len
    if cut <= 0:
        return example
    start = loss_mask.index(1) if 1 in loss_mask else 0
    head = next((i for i in range(start) if ids[i] not in special_ids), start)
    if cut > start - head:
        return None
    return {key: values[:head] + values[head + cut :] for key, values in example.items()}
