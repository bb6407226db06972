import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from lit_dllm.data.collate import DLLMCollator, MultiTurnLossMaskError

PAD, EOS = 0, 9


def sample(ids, loss_mask, attention_mask=None, **extra):
    attention_mask = [1] * len(ids) if attention_mask is None else attention_mask
    return {"input_ids": ids, "loss_mask": loss_mask, "attention_mask": attention_mask, **extra}


# Two rows: a 1-token prompt + 2-token response, and a 2-token prompt + 4-token response.
SHORT = sample([1, 2, 3], [0, 1, 1])
LONG = sample([5, 6, 7, 8, 9, 1], [0, 0, 1, 1, 1, 1])


def assert_batch(out, input_ids, loss_mask, attention_mask, input_lengths):
    assert out["input_ids"].dtype == torch.long and out["attention_mask"].dtype == torch.long
    assert out["loss_mask"].dtype == torch.float32 and out["input_lengths"].dtype == torch.long
    assert out["input_ids"].tolist() == input_ids
    assert out["loss_mask"].tolist() == loss_mask
    assert out["attention_mask"].tolist() == attention_mask
    assert out["input_lengths"].tolist() == input_lengths


def test_absolute_fill_is_supervised_and_not_attended():
    out = DLLMCollator(pad_token_id=PAD, eos_token_id=EOS, block_size=4)([SHORT, LONG])
    # fill ends: 3 -> 4, 6 -> 8; T = 8
    assert_batch(
        out,
        input_ids=[[1, 2, 3, 9, 0, 0, 0, 0], [5, 6, 7, 8, 9, 1, 9, 9]],
        loss_mask=[[0, 1, 1, 1, 0, 0, 0, 0], [0, 0, 1, 1, 1, 1, 1, 1]],
        attention_mask=[[1, 1, 1, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1, 0, 0]],
        input_lengths=[3, 6],
    )
    assert set(out) == {"input_ids", "loss_mask", "attention_mask", "input_lengths"}


def test_response_window_fill_is_relative_to_the_response_and_attended():
    out = DLLMCollator(pad_token_id=PAD, eos_token_id=EOS, block_size=4, response_window=True)([SHORT, LONG])
    # prefixes 1 and 2; responses of 2 and 4 tokens round to 4 -> fill ends 5 and 6; T = 6
    assert_batch(
        out,
        input_ids=[[1, 2, 3, 9, 9, 0], [5, 6, 7, 8, 9, 1]],
        loss_mask=[[0, 1, 1, 1, 1, 0], [0, 0, 1, 1, 1, 1]],
        attention_mask=[[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]],
        input_lengths=[3, 6],
    )


def test_supervise_padding_and_pad_as_fill_token():
    out = DLLMCollator(pad_token_id=7, block_size=4, supervise_padding=True)([SHORT, LONG])
    assert_batch(
        out,
        input_ids=[[1, 2, 3, 7, 7, 7, 7, 7], [5, 6, 7, 8, 9, 1, 7, 7]],
        loss_mask=[[0, 1, 1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1, 1, 1]],
        attention_mask=[[1, 1, 1, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1, 0, 0]],
        input_lengths=[3, 6],
    )


def test_pad_seq_len_divisible_rounds_to_lcm_with_block_size():
    out = DLLMCollator(eos_token_id=EOS, block_size=4, pad_seq_len_divisible=6)([SHORT, LONG])
    # max fill end 8, lcm(4, 6) = 12
    assert_batch(
        out,
        input_ids=[[1, 2, 3, 9] + [0] * 8, [5, 6, 7, 8, 9, 1, 9, 9] + [0] * 4],
        loss_mask=[[0, 1, 1, 1] + [0] * 8, [0, 0, 1, 1, 1, 1, 1, 1] + [0] * 4],
        attention_mask=[[1, 1, 1] + [0] * 9, [1] * 6 + [0] * 6],
        input_lengths=[3, 6],
    )


def test_pad_seq_len_divisible_without_block_size():
    out = DLLMCollator(pad_seq_len_divisible=4)([SHORT, sample([4, 5], [1, 1])])
    assert_batch(
        out,
        input_ids=[[1, 2, 3, 0], [4, 5, 0, 0]],
        loss_mask=[[0, 1, 1, 0], [1, 1, 0, 0]],
        attention_mask=[[1, 1, 1, 0], [1, 1, 0, 0]],
        input_lengths=[3, 2],
    )


def test_max_seq_len_truncates_long_rows_and_caps_the_length():
    long7 = sample([5, 6, 7, 8, 9, 1, 2], [0, 0, 1, 1, 1, 1, 1])
    out = DLLMCollator(eos_token_id=EOS, block_size=4, max_seq_len=5)([SHORT, long7])
    # fill ends 4 and 8 (content clamped to 5, rounded to 8); T = 8 capped at 5
    assert_batch(
        out,
        input_ids=[[1, 2, 3, 9, 0], [5, 6, 7, 8, 9]],
        loss_mask=[[0, 1, 1, 1, 0], [0, 0, 1, 1, 1]],
        attention_mask=[[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]],
        input_lengths=[3, 7],
    )


def test_max_seq_len_caps_after_divisible_rounding():
    out = DLLMCollator(eos_token_id=EOS, block_size=2, pad_seq_len_divisible=8, max_seq_len=6)([SHORT])
    # fill end 4 -> rounded to 8 -> capped at 6
    assert_batch(
        out,
        input_ids=[[1, 2, 3, 9, 0, 0]],
        loss_mask=[[0, 1, 1, 1, 0, 0]],
        attention_mask=[[1, 1, 1, 0, 0, 0]],
        input_lengths=[3],
    )


def test_without_block_size_pads_to_the_longest_row():
    out = DLLMCollator(pad_token_id=PAD, eos_token_id=EOS)([SHORT, LONG])
    assert_batch(
        out,
        input_ids=[[1, 2, 3, 0, 0, 0], [5, 6, 7, 8, 9, 1]],
        loss_mask=[[0, 1, 1, 0, 0, 0], [0, 0, 1, 1, 1, 1]],
        attention_mask=[[1, 1, 1, 0, 0, 0], [1] * 6],
        input_lengths=[3, 6],
    )


def test_response_window_row_without_supervision_gets_no_fill():
    prompt_only = sample([1, 2, 3], [0, 0, 0])
    out = DLLMCollator(eos_token_id=EOS, block_size=4, response_window=True)([prompt_only, sample([4, 5], [0, 1])])
    # row 0: prefix = length 3 -> fill end 3; row 1: prefix 1 + 4 -> 5
    assert_batch(
        out,
        input_ids=[[1, 2, 3, 0, 0], [4, 5, 9, 9, 9]],
        loss_mask=[[0, 0, 0, 0, 0], [0, 1, 1, 1, 1]],
        attention_mask=[[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]],
        input_lengths=[3, 2],
    )


def test_empty_rows_give_length_one():
    out = DLLMCollator(eos_token_id=EOS, block_size=4)([sample([], []), sample([], [])])
    assert_batch(out, [[0], [0]], [[0], [0]], [[0], [0]], [0, 0])
    empty_batch = DLLMCollator()([])
    assert empty_batch["input_ids"].shape == (0, 1) and empty_batch["input_lengths"].shape == (0,)


def test_tensor_inputs_example_index_and_dropped_pad_key():
    batch = [
        {"input_ids": torch.tensor([1, 2]), "loss_mask": torch.tensor([0, 1]), "example_index": 11,
         "___PAD_TOKEN_IDS___": [0]},
        {"input_ids": [3], "loss_mask": [True], "example_index": torch.tensor(4), "___PAD_TOKEN_IDS___": [0]},
    ]
    out = DLLMCollator(block_size=2)(batch)
    assert_batch(out, [[1, 2], [3, 0]], [[0, 1], [1, 1]], [[1, 1], [1, 0]], [2, 1])
    assert out["example_index"].dtype == torch.long and out["example_index"].tolist() == [11, 4]
    assert "___PAD_TOKEN_IDS___" not in out


def test_single_turn_guard_runs_on_every_call_and_names_the_row():
    collate = DLLMCollator(block_size=4, response_window=True)
    multi_turn = sample([1, 2, 3, 4, 5], [0, 1, 0, 1, 1])
    for _ in range(2):
        with pytest.raises(MultiTurnLossMaskError, match=r"row\(s\) \[1\].*mask_history=True"):
            collate([SHORT, multi_turn])
    with pytest.raises(AssertionError):
        collate([multi_turn])
    # One supervised run followed by unsupervised tokens is single-turn (the fill adds a 2nd run later).
    trailing = collate([sample([1, 2, 3, 4], [0, 1, 0, 0])])
    assert trailing["loss_mask"].tolist() == [[0, 1, 0, 0, 1]]
    # Without response_window, multi-turn masks pass through untouched.
    assert DLLMCollator()([multi_turn])["loss_mask"].tolist() == [[0, 1, 0, 1, 1]]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"block_size": 0}, "block_size"),
        ({"block_size": -2}, "block_size"),
        ({"pad_seq_len_divisible": 0}, "pad_seq_len_divisible"),
        ({"max_seq_len": 0}, "max_seq_len"),
        ({"pad_token_id": -1}, "pad_token_id"),
        ({"pad_token_id": None}, "pad_token_id"),
        ({"eos_token_id": -100}, "eos_token_id"),
        ({"block_size": 64, "max_seq_len": 32}, r"block_size=64 is larger than max_seq_len=32"),
    ],
)
def test_invalid_settings_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DLLMCollator(**kwargs)


@pytest.mark.parametrize(
    "bad_sample, match",
    [
        (sample([1, 2], [1]), "different lengths"),
        (sample([1, 2], [1, 1], [1]), "different lengths"),
        ({"loss_mask": [1]}, "'input_ids'"),
        ({"input_ids": [1]}, "'loss_mask'"),
        ({**SHORT, "labels": [1, 2, 3]}, r"\['labels'\]"),
        ({"input_ids": [[1, 2]], "loss_mask": [[1, 1]]}, "1-D"),
        ({**SHORT, "example_index": 3}, "example_index"),
    ],
)
def test_invalid_samples_raise(bad_sample, match):
    with pytest.raises(ValueError, match=match):
        DLLMCollator()([SHORT, bad_sample])


# --- property test against a per-row reference -------------------------------------------------


def count_runs(mask):
    return sum(1 for i, v in enumerate(mask) if v and (i == 0 or not mask[i - 1]))


def reference_collate(batch, pad, eos, block_size, divisible, max_len, supervise_padding, response_window):
    """Per-row, per-token transcription of the layout rules (slow but obvious)."""
    fill_ends = []
    for s in batch:
        n = len(s["input_ids"])
        prefix = next((i for i, v in enumerate(s["loss_mask"]) if v), n) if response_window else 0
        content = n if max_len is None else min(n, max_len)
        if block_size is None or block_size <= 1:
            fill_ends.append(content)
        else:
            start = min(prefix, content)
            fill_ends.append(start + math.ceil((content - start) / block_size) * block_size)
    target = max(fill_ends, default=0)
    if divisible is not None and divisible > 1:
        multiple = math.lcm(block_size or 1, divisible)
        target = math.ceil(target / multiple) * multiple
    if max_len is not None:
        target = min(target, max_len)
    target = max(target, 1)
    fill_token = pad if eos is None else eos
    ids, loss, attn = [], [], []
    for s, fill_end in zip(batch, fill_ends):
        n = len(s["input_ids"])
        ids.append([s["input_ids"][t] if t < n else fill_token if t < fill_end else pad for t in range(target)])
        loss.append(
            [float(s["loss_mask"][t]) if t < n else 1.0 if t < fill_end else float(supervise_padding)
             for t in range(target)]
        )
        attn.append(
            [s["attention_mask"][t] if t < n else int(response_window) if t < fill_end else 0 for t in range(target)]
        )
    return ids, loss, attn, fill_ends, target


single_turn_mask = st.tuples(st.integers(0, 6), st.integers(0, 6), st.integers(0, 3)).map(
    lambda sizes: [0] * sizes[0] + [1] * sizes[1] + [0] * sizes[2]
)
any_mask = st.lists(st.integers(0, 1), max_size=12)


@st.composite
def samples(draw):
    loss_mask = draw(st.one_of(single_turn_mask, any_mask))
    n = len(loss_mask)
    ids = draw(st.lists(st.integers(1, 50), min_size=n, max_size=n))
    attn = draw(st.lists(st.integers(0, 1), min_size=n, max_size=n))
    return sample(ids, loss_mask, attn)


@settings(max_examples=300, deadline=None)
@given(
    batch=st.lists(samples(), max_size=4),
    eos=st.sampled_from([None, EOS]),
    block_size=st.sampled_from([None, 1, 2, 3, 4]),
    divisible=st.sampled_from([None, 1, 3, 4]),
    max_len=st.sampled_from([None, 1, 5, 9]),
    supervise_padding=st.booleans(),
    response_window=st.booleans(),
)
def test_matches_per_row_reference(batch, eos, block_size, divisible, max_len, supervise_padding, response_window):
    assume(block_size is None or max_len is None or block_size <= max_len)  # larger blocks are refused (tested above)
    collate = DLLMCollator(PAD, eos, block_size, divisible, max_len, supervise_padding, response_window)
    if response_window and any(count_runs(s["loss_mask"]) > 1 for s in batch):
        with pytest.raises(MultiTurnLossMaskError):
            collate(batch)
        return
    out = collate(batch)
    ids, loss, attn, fill_ends, target = reference_collate(
        batch, PAD, eos, block_size, divisible, max_len, supervise_padding, response_window
    )
    assert_batch(out, ids, loss, attn, [len(s["input_ids"]) for s in batch])
    assert out["input_ids"].shape == (len(batch), target)
    capped = max_len is not None and target == max_len
    if block_size and not capped and max(fill_ends, default=0) > 0:
        if not response_window:
            assert target % block_size == 0
        prefixes = [next((i for i, v in enumerate(s["loss_mask"]) if v), len(s["loss_mask"])) for s in batch]
        for s, fill_end, prefix in zip(batch, fill_ends, prefixes):
            start = min(prefix, len(s["input_ids"])) if response_window else 0
            assert (fill_end - start) % block_size == 0 and fill_end - len(s["input_ids"]) < block_size


@pytest.mark.parametrize(
    ("ids", "message"),
    [
        ([5, 6, 3.7], r"Sample 1: input_ids must be integer token ids, got 3.7"),
        ([5.0, 6.0], r"Sample 1: input_ids must be integer token ids, got 5.0"),
        (torch.tensor([5.0, 6.5]), r"Sample 1: input_ids must be integer token ids, got 6.5"),
        ([5, -1], r"Sample 1: input_ids holds the negative id -1"),
        (["5", "6"], r"Sample 1: input_ids must be integer token ids, got '5' \(str\); tokenize"),
        ("56", r"Sample 1: input_ids must be integer token ids, got '56' \(str\); tokenize"),
    ],
)
def test_float_and_negative_ids_are_rejected(ids, message):
    bad = sample(ids, [0] + [1] * (len(ids) - 1))
    with pytest.raises(ValueError, match=message):
        DLLMCollator(pad_token_id=PAD, eos_token_id=EOS)([SHORT, bad])
