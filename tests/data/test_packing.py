"""Packing: best-fit decreasing rows, the packed layout (hand-derived), and the per-document view."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lit_dllm.data.batch import real_tokens, shifted_targets
from lit_dllm.data.collate import DLLMCollator
from lit_dllm.data.packing import DocumentView, PackedCollator, pack_documents, pack_windows, span_length

PAD, EOS = 0, 1


def doc(ids, supervised_from, index):
    return {"input_ids": ids, "loss_mask": [0] * supervised_from + [1] * (len(ids) - supervised_from),
            "example_index": index}


def test_best_fit_decreasing_by_hand():
    # longest first (ties: the earlier first): 6 -> row 0 (free 2); 5 -> row 1 (free 3); 3 -> row 1 (free 0: the
    # tightest fit, not row 0); the 2 of index 0 -> row 0 (free 0); the 2 of index 4 -> a new row
    assert pack_documents([2, 6, 3, 5, 2], capacity=8) == [[1, 0], [3, 2], [4]]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 16), min_size=1, max_size=60), st.integers(16, 40), st.integers(1, 70))
def test_every_document_is_packed_once_within_capacity(spans, capacity, window):
    order = list(reversed(range(len(spans))))
    rows = pack_windows(order, spans, capacity, window)
    assert sorted(i for row in rows for i in row) == list(range(len(spans)))
    assert all(sum(spans[i] for i in row) <= capacity for row in rows)
    # best fit never opens a row while another row of the same window could take the document: at most one row
    # of a window is at most half full
    if window >= len(spans):
        assert sum(sum(spans[i] for i in row) <= capacity // 2 for row in rows) <= 1
    assert rows == pack_windows(order, spans, capacity, window)  # deterministic


def test_a_document_longer_than_a_row_is_refused():
    with pytest.raises(ValueError, match="Document 1 takes 9 tokens; a packed row holds 1 to 8"):
        pack_documents([3, 9], capacity=8)


def test_packed_layout_by_hand():
    """Two rows of 8: row 0 holds a 3-token and a 2-token document, block fill to multiples of 2 (eos, supervised);
    row 1 one 5-token document; the rest is padding, in no document."""
    collator = PackedCollator(DLLMCollator(pad_token_id=PAD, eos_token_id=EOS, block_size=2), pack_length=8)
    batch = collator([[doc([5, 6, 7], 1, 10), doc([8, 9], 1, 11)], [doc([2, 3, 4, 5, 6], 2, 12)]])
    assert batch["input_ids"].tolist() == [[5, 6, 7, 1, 8, 9, 0, 0], [2, 3, 4, 5, 6, 1, 0, 0]]
    assert batch["loss_mask"].tolist() == [[0, 1, 1, 1, 0, 1, 0, 0], [0, 0, 1, 1, 1, 1, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1, 0, 0]]
    assert batch["document_ids"].tolist() == [[0, 0, 0, 0, 1, 1, -1, -1], [2, 2, 2, 2, 2, 2, -1, -1]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1, 0, 1], [0, 1, 2, 3, 4, 5, 0, 1]]
    assert batch["example_index"].tolist() == [10, 11, 12]
    assert batch["input_lengths"].tolist() == [3, 2, 5]
    assert batch["document_offsets"].tolist() == [0, 4, 8]
    assert batch["document_spans"].tolist() == [4, 2, 6]
    assert real_tokens(batch).int().tolist() == [[1, 1, 1, 0, 1, 1, 0, 0], [1, 1, 1, 1, 1, 0, 0, 0]]
    # next-token targets never cross into the next document
    _, positions = shifted_targets(batch["input_ids"], batch["loss_mask"], batch["document_ids"])
    assert positions.int().tolist() == [[1, 1, 1, 0, 1, 0, 0, 0], [0, 1, 1, 1, 1, 0, 0, 0]]


def test_each_document_is_laid_out_as_the_collator_lays_it_out_alone():
    plain = DLLMCollator(pad_token_id=PAD, eos_token_id=EOS, block_size=4)
    packed = PackedCollator(plain, pack_length=16)
    documents = [doc(list(range(2, 2 + n)), 1, i) for i, n in enumerate([7, 3, 5, 1])]
    batch = packed([documents[:2], documents[2:]])
    for d, document in enumerate(documents):
        alone = plain([document])
        span = span_length(len(document["input_ids"]), 4)
        for key in ("input_ids", "loss_mask"):
            assert torch.equal(batch[key][batch["document_ids"] == d], alone[key][0, :span])


def test_the_document_view_round_trips():
    collator = PackedCollator(DLLMCollator(pad_token_id=PAD), pack_length=6)
    batch = collator([[doc([5, 6], 0, 0), doc([7, 8, 9], 0, 1)], [doc([2, 3, 4, 5], 0, 2)]])
    view = DocumentView(batch)
    documents = view.gather(batch["input_ids"], fill=-1)
    assert documents.tolist() == [[5, 6, -1, -1, -1, -1], [7, 8, 9, -1, -1, -1], [2, 3, 4, 5, -1, -1]]
    assert torch.equal(view.scatter(documents, batch["input_ids"]), batch["input_ids"])
    changed = view.scatter(documents * 10, torch.full_like(batch["input_ids"], 99))
    assert changed.tolist() == [[50, 60, 70, 80, 90, 99], [20, 30, 40, 50, 99, 99]]


@pytest.mark.parametrize("kwargs, message", [
    ({"supervise_padding": True}, "supervise_padding"),
    ({"response_window": True, "block_size": 2}, "response_window"),
    ({"max_seq_len": 4}, "max_seq_len=4 is below pack_length=8"),
])
def test_layouts_that_cannot_be_packed_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PackedCollator(DLLMCollator(pad_token_id=PAD, eos_token_id=EOS, **kwargs), pack_length=8)


def test_a_row_over_its_length_is_refused():
    collator = PackedCollator(DLLMCollator(pad_token_id=PAD, block_size=4), pack_length=8)
    with pytest.raises(ValueError, match="Document 0 takes 12 tokens"):
        collator([[doc(list(range(2, 12)), 0, 0)]])
    with pytest.raises(ValueError, match="Row 0 holds 12 tokens"):
        collator([[doc([2, 3, 4, 5, 6], 0, 0), doc([2, 3], 0, 1)]])
