"""The data module's mode (issue 58): chosen once from the four flags by ``Mode.of``, and what each mode serves; every
training loader is a ``TrainLoader`` whose saved position a fresh data module resumes from, on the map and the stream
paths alike."""

import json

import pytest
import torch

from lit_dllm import DLLMDataModule
from lit_dllm.data.loader import TrainLoader
from lit_dllm.data.mode import Mode
from lit_dllm.settings import Collation, DataSource, Formatting, Loader


@pytest.mark.parametrize(("streaming", "pack", "prompts", "mode"), [
    (False, False, False, Mode.PADDED),
    (False, True, False, Mode.PACKED),
    (True, True, False, Mode.STREAMED),
    (False, False, True, Mode.PROMPTS),
])
def test_the_flags_choose_one_mode(streaming, pack, prompts, mode):
    chosen = Mode.of(DataSource(path="corpus", streaming=streaming), Collation(pack=pack, prompts=prompts))
    assert chosen is mode
    assert chosen.packs == (mode in (Mode.PACKED, Mode.STREAMED))
    assert chosen.pack_text(Formatting()) == (not chosen.packs)  # unset: text is concatenated unless packed
    assert chosen.pack_text(Formatting(pack_text=False)) is False


@pytest.mark.parametrize(("streaming", "pack", "prompts", "message"), [
    (True, False, False, "source.streaming packs its documents into rows on the fly: set collation.pack: true"),
    (True, False, True, "collation.prompts serves the prompts of a split read whole: set source.streaming: false"),
])
def test_flags_that_name_no_mode_are_refused_with_the_fix(streaming, pack, prompts, message):
    with pytest.raises(ValueError, match=message):
        Mode.of(DataSource(path="corpus", streaming=streaming), Collation(pack=pack, prompts=prompts))


def test_a_packed_mode_refuses_what_packed_rows_cannot_do():
    for settings, message in (({"loader": Loader(group_by_length=True)}, "set loader.group_by_length: false"),
                              ({"formatting": Formatting(pack_text=True)}, "leave formatting.pack_text unset"),
                              ({"collation": Collation(pack=True, pad_block_size=5)}, "make max_seq_len a multiple")):
        groups = {"formatting": Formatting(), "loader": Loader(), "collation": Collation(pack=True), **settings}
        with pytest.raises(ValueError, match=message):
            Mode.PACKED.check(max_seq_len=32, **groups)
    Mode.PADDED.check(Formatting(pack_text=True), Loader(group_by_length=True), Collation(pad_block_size=5), 32)


def test_the_data_module_reads_its_mode_from_the_flags_once(tmp_path):
    dm = DLLMDataModule(source={"path": "task:add"}, collation={"pack": True}, max_seq_len=32)
    assert dm.mode is Mode.PACKED and dm.packed_collator is not None
    assert DLLMDataModule(source={"path": "task:add"}).mode is Mode.PADDED


def write_corpus(folder):
    folder.mkdir()
    for shard in range(2):
        lines = [json.dumps({"text": "ab" * (3 + 5 * ((shard + row) % 4))}) for row in range(6)]
        (folder / f"train-{shard:05d}.jsonl").write_text("\n".join(lines) + "\n")
    return str(folder)


def data_module(corpus: str, streamed: bool) -> DLLMDataModule:
    source = {"path": corpus, "streaming": True} if streamed else {"path": "task:add"}
    return DLLMDataModule(source=source, collation={"pack": streamed}, task={"num_train": 40, "num_val": 4},
                          loader={"batch_size": 2}, max_seq_len=32)


@pytest.mark.parametrize("streamed", [False, True], ids=["map", "stream"])
def test_both_training_loaders_resume_from_their_saved_position(tmp_path, streamed):
    """A ``TrainLoader`` saves its position; a new data module given it (as Lightning restores it, before the loader
    is built) continues with the batch after it. The stream's position leaves out the batch Lightning fetched ahead
    (``lookahead=1``)."""
    corpus = write_corpus(tmp_path / "corpus")
    dm = data_module(corpus, streamed)
    loader = dm.train_dataloader()
    assert isinstance(loader, TrainLoader)
    batches, iterator = [], iter(loader)
    for _ in range(3):
        batches.append(next(iterator))
    state = dm.state_dict()
    batches.append(next(iterator))
    fresh = data_module(corpus, streamed)
    fresh.load_state_dict(state)
    resumed = next(iter(fresh.train_dataloader()))
    expected = batches[3 - (1 if streamed else 0)]
    assert torch.equal(resumed["input_ids"], expected["input_ids"])
    assert torch.equal(resumed["example_index"], expected["example_index"])
