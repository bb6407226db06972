"""Hand-derived encodings with the default tokenizer: ids 0-6 are <pad> <eos> <mask> <unk> <|system|> <|user|>
<|assistant|>; digit d is 7 + d; '+' is 70, '=' is 74; a-e are 17-21."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lit_dllm.data.formats import encode_chat, encode_prompt_response, encode_texts, truncate_prompt
from lit_dllm.data.tokenizer import CHARACTERS, build_default_tokenizer

EOS, USER, ASSISTANT, PLUS, EQUALS = 1, 5, 6, 70, 74
ONE, TWO, THREE, FOUR, FIVE = 8, 9, 10, 11, 12

TOKENIZER = build_default_tokenizer()
TWO_TURNS = [
    {"role": "user", "content": "1+2="},
    {"role": "assistant", "content": "3"},
    {"role": "user", "content": "2+2="},
    {"role": "assistant", "content": "4"},
]
TWO_TURN_IDS = [USER, ONE, PLUS, TWO, EQUALS, ASSISTANT, THREE, EOS, USER, TWO, PLUS, TWO, EQUALS, ASSISTANT, FOUR, EOS]


def test_prompt_response():
    example = encode_prompt_response(TOKENIZER, "12+3=", "15")
    assert example == {
        "input_ids": [ONE, TWO, PLUS, THREE, EQUALS, ONE, FIVE, EOS],
        "loss_mask": [0, 0, 0, 0, 0, 1, 1, 1],
        "attention_mask": [1] * 8,
    }


def test_prompt_response_with_chat_template():
    example = encode_prompt_response(TOKENIZER, "1+2=", "3", use_chat_template=True)
    assert example["input_ids"] == TWO_TURN_IDS[:8]
    assert example["loss_mask"] == [0, 0, 0, 0, 0, 0, 1, 1]


@pytest.mark.parametrize(
    ("mask_history", "loss_mask"),
    [
        (False, [0, 0, 0, 0, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0, 1, 1]),
        (True, [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1]),
    ],
)
def test_two_turn_chat(mask_history, loss_mask):
    example = encode_chat(TOKENIZER, TWO_TURNS, mask_history=mask_history)
    assert example["input_ids"] == TWO_TURN_IDS
    assert example["loss_mask"] == loss_mask
    assert example["attention_mask"] == [1] * len(TWO_TURN_IDS)


def test_what_a_template_appends_after_the_last_answer_is_dropped():
    """ChatML (SmolLM2, Qwen) ends every turn with "<eos>\n": the newline between turns stays, unsupervised; the one
    after the last answer would show a diffusion model where that answer ends, so the example stops at its eos."""
    tokenizer = build_default_tokenizer()
    tokenizer.chat_template = ("{% for m in messages %}{{ '<|' + m['role'] + '|>' + m['content'] }}"
                               "{% if m['role'] == 'assistant' %}{{ '<eos>' }}{% endif %}{{ '\\n' }}{% endfor %}"
                               "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}")
    NEWLINE = tokenizer.convert_tokens_to_ids("\n")
    example = encode_chat(tokenizer, TWO_TURNS)
    assert example["input_ids"] == [USER, ONE, PLUS, TWO, EQUALS, NEWLINE, ASSISTANT, THREE, EOS, NEWLINE,
                                    USER, TWO, PLUS, TWO, EQUALS, NEWLINE, ASSISTANT, FOUR, EOS]
    assert example["loss_mask"] == [0] * 7 + [1, 1, 0] + [0] * 7 + [1, 1]
    assert encode_chat(tokenizer, TWO_TURNS[:1])["input_ids"][-1] == NEWLINE  # no answer: nothing dropped


def test_chat_without_assistant_turn_is_unsupervised():
    assert not any(encode_chat(TOKENIZER, TWO_TURNS[:1])["loss_mask"])


def test_chat_template_that_rewrites_history_is_rejected():
    tokenizer = build_default_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% if loop.last %}!{% endif %}{% endfor %}"
    with pytest.raises(ValueError, match="does not render conversations prefix-stably"):
        encode_chat(tokenizer, TWO_TURNS)


def test_text_packing_with_eos_separators():
    a, b, c, d, e = 17, 18, 19, 20, 21
    packed = encode_texts(TOKENIZER, ["ab", "cde"], max_seq_len=4)
    assert [x["input_ids"] for x in packed] == [[a, b, EOS, c], [d, e, EOS]]
    chunked = encode_texts(TOKENIZER, ["ab", "cde"], max_seq_len=3, pack=False)
    assert [x["input_ids"] for x in chunked] == [[a, b, EOS], [c, d, e], [EOS]]
    for example in packed + chunked:
        assert example["loss_mask"] == example["attention_mask"] == [1] * len(example["input_ids"])


@settings(max_examples=50, deadline=None)
@given(prompt=st.text(CHARACTERS, max_size=20), response=st.text(CHARACTERS, min_size=1, max_size=20))
def test_prompt_is_unsupervised_prefix_and_response_decodes_back(prompt, response):
    example = encode_prompt_response(TOKENIZER, prompt, response)
    assert example["loss_mask"] == [0] * len(prompt) + [1] * (len(response) + 1)
    supervised = [i for i, m in zip(example["input_ids"], example["loss_mask"]) if m]
    assert supervised[-1] == EOS
    assert TOKENIZER.decode(supervised[:-1]) == response


def test_special_token_strings_in_data_stay_plain_text():
    example = encode_prompt_response(TOKENIZER, "rev <mask>=", "<eos>x")
    assert TOKENIZER.mask_token_id not in example["input_ids"]
    assert example["input_ids"].count(EOS) == 1  # only the real end of the response


@pytest.mark.parametrize(
    ("max_seq_len", "input_ids", "loss_mask"),
    [
        (8, TWO_TURN_IDS[:8], [0] * 6 + [1, 1]),  # fits: unchanged
        (6, [USER, TWO, EQUALS, ASSISTANT, THREE, EOS], [0, 0, 0, 0, 1, 1]),  # leading <|user|> kept, "1+" cut
        (3, [USER, THREE, EOS], [0, 1, 1]),  # everything between <|user|> and the response cut
        (2, None, None),  # the response does not fit next to <|user|>
    ],
)
def test_truncate_prompt_cuts_the_oldest_prompt_tokens(max_seq_len, input_ids, loss_mask):
    example = {"input_ids": TWO_TURN_IDS[:8], "loss_mask": [0] * 6 + [1, 1], "attention_mask": [1] * 8}  # 1+2= -> 3
    truncated = truncate_prompt(example, max_seq_len, set(TOKENIZER.all_special_ids))
    if input_ids is None:
        assert truncated is None
    else:
        assert truncated == {"input_ids": input_ids, "loss_mask": loss_mask, "attention_mask": [1] * len(input_ids)}


def test_truncate_prompt_without_supervision_is_none():
    example = {"input_ids": [ONE, TWO, THREE], "loss_mask": [0, 0, 0], "attention_mask": [1, 1, 1]}
    assert truncate_prompt(example, 2, set()) is None
