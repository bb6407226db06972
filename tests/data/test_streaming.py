"""Streaming corpora (lit_dllm.data.streaming, lit_dllm.data.packed_stream): every document once per epoch over ranks
and workers, a global example_index, bit-exact resume (plain loop and Lightning), bad shards named, long documents
counted."""

import json
import logging
import os
from pathlib import Path

import lightning as L
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lit_dllm.data.collate import DLLMCollator
from lit_dllm.data.packing import PackedCollator
from lit_dllm.data.packed_stream import PackedStream, StreamLoader
from lit_dllm.data.streaming import StreamingSource, example_index
from lit_dllm.families.mdlm.module import MDLMModule
from lit_dllm.testing import TINY_LLAMA

VOCAB, MASK, PAD, EOS = 40, 39, 0, 1
CHARS = "0123456789abcdefghijklmnopqrstuvwxyz-"  # token id = 2 + position: ids 2..38, below the mask id
PACK = 24


def encode(batch):
    """A character tokenizer: every character one supervised token."""
    ids = [[2 + CHARS.index(c) for c in text] for text in batch["text"]]
    return {"input_ids": ids, "loss_mask": [[1] * len(x) for x in ids], "attention_mask": [[1] * len(x) for x in ids]}


def text(shard, row, length=None):
    """Document ``row`` of ``shard``: its name, then filler to ``length`` characters (lengths 4 to 40 by default)."""
    head = f"{shard}-{row}-"
    length = length if length is not None else 4 + (11 * row + 7 * shard) % 37
    return (head + "x" * length)[: max(length, len(head))]


def write_shards(folder, shards, rows=12, suffix=".jsonl", lengths=None):
    """``shards`` files of ``rows`` documents; returns each shard's texts."""
    folder.mkdir(parents=True, exist_ok=True)
    texts = []
    for shard in range(shards):
        texts.append([text(shard, row, lengths[row] if lengths else None) for row in range(rows)])
        path = folder / f"part-{shard:03d}{suffix}"
        if suffix == ".parquet":
            pq.write_table(pa.table({"text": texts[-1]}), path)
        elif suffix == ".txt":
            path.write_text("".join(line + "\n" for line in texts[-1]))
        else:
            path.write_text("".join(json.dumps({"text": line, "other": 1}) + "\n" for line in texts[-1]))
    return texts


def collator(block_size=None, pack=PACK):
    return PackedCollator(DLLMCollator(pad_token_id=PAD, eos_token_id=EOS, block_size=block_size), pack)


def stream(path, rank=0, world_size=1, batch_size=3, block_size=None, **kwargs):
    source = StreamingSource.open(path, rank=rank, world_size=world_size)
    kwargs = {"window": 7, **kwargs}
    return PackedStream(source, encode, collator(block_size, kwargs.pop("pack", PACK)), batch_size, **kwargs)


def documents(batch):
    """Each document of a packed batch as (example_index, its text)."""
    flat = batch["input_ids"].flatten().tolist()
    return [
        (int(index), "".join(CHARS[token - 2] for token in flat[offset : offset + length]))
        for index, offset, length in zip(
            batch["example_index"].tolist(), batch["document_offsets"].tolist(), batch["input_lengths"].tolist()
        )
    ]


def one_epoch(path, world_size, num_workers, **kwargs):
    """(example_index, text) of every document every rank delivers in epoch 0, checking each batch's rows."""
    delivered = []
    for rank in range(world_size):
        loader = StreamLoader(stream(path, rank, world_size, epochs=1, **kwargs), num_workers=num_workers)
        for batch in loader:
            assert batch["epoch"] == 0 and batch["input_ids"].shape[1] == PACK
            rows = batch["document_offsets"] // PACK
            used = torch.zeros(len(batch["input_ids"]), dtype=torch.long).index_add_(0, rows, batch["document_spans"])
            assert int(used.max()) <= PACK
            assert (batch["document_offsets"] % PACK + batch["document_spans"] <= PACK).all()
            delivered += documents(batch)
    return delivered


def joined(delivered):
    """The documents put back together from their pieces, by (shard, row)."""
    pieces = {}
    for index, piece in sorted(delivered):
        pieces.setdefault(index >> 15, []).append(piece)
    return {key: "".join(parts) for key, parts in pieces.items()}


# ---------------------------------------------------------------------------- every document once, stable index


@pytest.mark.parametrize("shards", [4, 3], ids=["whole-shards-per-rank", "every-other-example"])
def test_every_document_once_per_epoch_over_ranks_and_workers(tmp_path, shards):
    texts = write_shards(tmp_path / "data", shards)
    expected = {example_index(shard, row) >> 15: line for shard, lines in enumerate(texts)
                for row, line in enumerate(lines)}
    source = StreamingSource.open(tmp_path / "data", rank=0, world_size=2)
    assert source.split_by == ("shards" if shards == 4 else "examples")
    for world_size, num_workers in [(1, 0), (2, 0), (2, 2)]:
        delivered = one_epoch(tmp_path / "data", world_size, num_workers, seed=3)
        indices = [index for index, _ in delivered]
        assert len(indices) == len(set(indices)), (world_size, num_workers)  # no document (or piece) twice
        assert joined(delivered) == expected, (world_size, num_workers)  # all of them, split pieces in order


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet", ".txt"])
def test_example_index_is_shard_row_piece_whatever_the_topology(tmp_path, suffix):
    texts = write_shards(tmp_path / "data", 4, rows=6, suffix=suffix)
    row_of = {line: (shard, row) for shard, lines in enumerate(texts) for row, line in enumerate(lines)}
    seen = []
    for world_size, num_workers in [(1, 0), (2, 2), (4, 0)]:
        delivered = sorted(one_epoch(tmp_path / "data", world_size, num_workers))
        for index, piece_text in delivered:
            shard, row = index >> 47, (index >> 15) & (2**32 - 1)
            assert texts[shard][row][(index & 0x7FFF) * PACK :].startswith(piece_text)
        seen.append(delivered)
        assert sorted(row_of[line] for line in joined(delivered).values()) == sorted(row_of.values())
    assert seen[0] == seen[1] == seen[2]


# ---------------------------------------------------------------------------- resume


def run(path, num_workers, steps, state=None, lookahead=0, **kwargs):
    loader = StreamLoader(stream(path, seed=7, **kwargs), num_workers=num_workers, lookahead=lookahead)
    if state is not None:
        loader.load_state_dict(state)
    batches = []
    for batch in loader:
        batches.append(batch)
        if len(batches) == steps:
            break
    return batches, loader.state_dict()


def assert_same(batches, expected):
    assert len(batches) == len(expected)
    for got, want in zip(batches, expected):
        assert got.keys() == want.keys()
        for key in want:
            assert torch.equal(got[key], want[key]) if torch.is_tensor(want[key]) else got[key] == want[key], key


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_gives_the_same_batches_bit_for_bit_across_epochs(tmp_path, num_workers):
    write_shards(tmp_path / "data", 2, rows=10)
    reference, _ = run(tmp_path / "data", num_workers, 36, block_size=4)
    epochs = [batch["epoch"] for batch in reference]
    assert epochs[0] == 0 and max(epochs) >= 2  # the run crosses epoch boundaries
    first_of_epoch_1 = epochs.index(1)
    for cut in (1, 5, first_of_epoch_1, first_of_epoch_1 + 3, 29):
        head, state = run(tmp_path / "data", num_workers, cut, block_size=4)
        assert_same(head, reference[:cut])
        tail, _ = run(tmp_path / "data", num_workers, 36 - cut, state, block_size=4)
        assert_same(tail, reference[cut:])


def test_lookahead_leaves_the_fetched_unused_batch_out_of_the_position(tmp_path):
    write_shards(tmp_path / "data", 2, rows=10)
    reference, _ = run(tmp_path / "data", 0, 12)
    _, state = run(tmp_path / "data", 0, 6, lookahead=1)  # 6 fetched, the 6th not yet used
    tail, _ = run(tmp_path / "data", 0, 7, state)
    assert_same(tail, reference[5:])


class Recorder(Callback):
    def __init__(self):
        self.batches = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.batches.append({"input_ids": batch["input_ids"].clone(), "example_index": batch["example_index"].clone(),
                             "epoch": batch["epoch"]})


class StreamData(L.LightningDataModule):
    """The data module's part: the train loader is built lazily, its position saved and restored through the data
    module's own state (Lightning restores it before ``configure_optimizers`` builds the loader early)."""

    def __init__(self, path):
        super().__init__()
        self.path, self.loader, self.resume = path, None, None

    def train_dataloader(self):
        self.loader = StreamLoader(stream(self.path, batch_size=2, seed=1), num_workers=2, lookahead=1)
        if self.resume is not None:
            self.loader.load_state_dict(self.resume)
        return self.loader

    def state_dict(self):
        return self.loader.state_dict() if self.loader is not None else {}

    def load_state_dict(self, state):
        self.resume = state


def fit(path, folder, max_steps, ckpt_path=None, **trainer_kwargs):
    torch.manual_seed(0)
    module = MDLMModule(
        vocab_size=VOCAB, mask_token_id=MASK, pad_token_id=PAD, eos_token_id=EOS,
        backbone={"model_config": dict(TINY_LLAMA), "attn_implementation": "eager"},
        optimization={"warmup": 0, "weight_decay": 0.0}, generation={"val_generate_batches": 0},
    )
    recorder = Recorder()
    checkpoints = ModelCheckpoint(dirpath=folder, every_n_train_steps=3, save_top_k=-1)
    trainer = L.Trainer(
        max_steps=max_steps, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0, callbacks=[recorder, checkpoints], **trainer_kwargs,
    )
    trainer.fit(module, datamodule=StreamData(path), ckpt_path=ckpt_path)
    return recorder.batches


def test_lightning_resume_from_a_checkpoint_sees_the_uninterrupted_batches(tmp_path):
    """Resumed at step 3 of 6 (2 loader workers). With max_epochs set, configure_optimizers' estimated_stepping_batches
    builds the train loader before Lightning loads the loop state, and Lightning then skips restoring the loader's
    own state: the data module's copy restores it."""
    write_shards(tmp_path / "data", 2, rows=8)
    uninterrupted = fit(tmp_path / "data", tmp_path / "a", 6)
    fit(tmp_path / "data", tmp_path / "b", 3)
    checkpoint = tmp_path / "b" / "epoch=0-step=3.ckpt"
    for name, kwargs in {"c": {}, "d": {"max_epochs": 5}}.items():
        resumed = fit(tmp_path / "data", tmp_path / name, 6, ckpt_path=checkpoint, **kwargs)
        assert len(uninterrupted) == 6 and len(resumed) == 3
        assert_same(resumed, uninterrupted[3:])


# ---------------------------------------------------------------------------- bad input, long documents


def test_bad_paths_and_shards_are_named(tmp_path):
    write_shards(tmp_path / "good", 1)
    cases = {
        "missing.jsonl": "does not exist",
        "./missing_folder": "does not exist",
    }
    for path, message in cases.items():
        with pytest.raises(ValueError, match=message):
            StreamingSource.open(str(tmp_path / path) if path.endswith("jsonl") else path)
    with pytest.raises(ValueError, match="hub is unreachable"):
        StreamingSource.open("no-such-org/no-such-dataset")

    def bad(name, content, message):
        folder = tmp_path / name
        write_shards(folder, 1, suffix=Path(name).suffix)
        file = folder / name
        file.write_bytes(content) if isinstance(content, bytes) else pq.write_table(content, file)
        with pytest.raises(ValueError, match=message) as raised:
            StreamingSource.open(folder)
        assert str(file) in str(raised.value)

    bad("empty.jsonl", b"", r"empty \(0 bytes\)")
    bad("blank.jsonl", b"\n  \n", "no JSON records")
    bad("array.json", b"[\n]\n", "no JSON records")
    bad("text.jsonl", b"plain text, not JSON\n", "line 1 is not valid JSON")
    bad("list.jsonl", b"[1, 2]\n", "array of something other than objects")
    bad("number.jsonl", b"3\n", "not a JSON object")
    bad("fake.parquet", b"not parquet", "not a Parquet file")
    bad("none.parquet", pa.table({"text": pa.array([], pa.string())}), "holds no rows")

    mixed = tmp_path / "mixed"
    write_shards(mixed, 1)
    write_shards(mixed, 1, suffix=".parquet")
    with pytest.raises(ValueError, match="mix types"):
        StreamingSource.open(mixed)
    (tmp_path / "nodata").mkdir()
    (tmp_path / "nodata" / "notes.md").write_text("hi")
    with pytest.raises(ValueError, match="holds no data file"):
        StreamingSource.open(tmp_path / "nodata")
    with pytest.raises(ValueError, match="not a data file"):
        StreamingSource.open([tmp_path / "nodata" / "notes.md"])


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_shard_that_breaks_mid_way_is_named_with_the_fix(tmp_path, num_workers):
    folder = tmp_path / "data"
    write_shards(folder, 2)
    broken = folder / "part-001.jsonl"
    broken.write_text(broken.read_text() + "{not json\n")
    with pytest.raises(ValueError, match=f"Could not read data file {broken} .*row 12.*JSON Lines"):
        list(StreamLoader(stream(folder, epochs=1), num_workers=num_workers))


def test_an_encoder_must_return_one_example_a_record(tmp_path):
    write_shards(tmp_path / "data", 1)
    source = StreamingSource.open(tmp_path / "data")
    doubled = PackedStream(source, lambda batch: encode({"text": batch["text"] * 2}), collator(), 2, epochs=1)
    with pytest.raises(ValueError, match="one per record"):
        next(iter(doubled))


@pytest.mark.parametrize("mode", ["split", "drop"])
def test_long_documents_are_split_or_dropped_and_counted(tmp_path, mode, caplog):
    # block_size 4, rows of 18: pieces of 16 tokens; 17 tokens take 20 with block fill, more than a row
    lengths = [5, 16, 17, 40, 0]
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "a.jsonl").write_text("".join(json.dumps({"text": "a" * n}) + "\n" for n in lengths))
    packed = stream(folder, batch_size=8, block_size=4, pack=18, long_documents=mode, epochs=1)
    with caplog.at_level(logging.WARNING, logger="lit_dllm.data.packed_stream"):
        (batch,) = list(StreamLoader(packed))
    lengths_out = sorted(batch["input_lengths"].tolist())
    if mode == "split":
        assert lengths_out == sorted([5, 16, 16, 1, 16, 16, 8])
        assert sorted(batch["example_index"].tolist()) == [0, 1 << 15, 2 << 15, (2 << 15) + 1, 3 << 15,
                                                          (3 << 15) + 1, (3 << 15) + 2]
        expected = {"documents": 7, "tokens": 78, "long_split": 2, "long_dropped": 0, "empty_dropped": 1}
    else:
        assert lengths_out == [5, 16]
        expected = {"documents": 2, "tokens": 21, "long_split": 0, "long_dropped": 2, "empty_dropped": 1}
    assert packed.counts == expected
    assert "2 document(s) longer than pack_length=18" in caplog.text and "1 of no token dropped" in caplog.text


def test_counts_are_summed_over_workers_at_the_saved_position(tmp_path):
    write_shards(tmp_path / "data", 2, rows=10)
    loader = StreamLoader(stream(tmp_path / "data", epochs=1), num_workers=2)
    batches = list(loader)
    counts = loader.counts
    assert counts["documents"] == sum(len(batch["example_index"]) for batch in batches)
    assert counts["tokens"] == sum(int(batch["input_lengths"].sum()) for batch in batches)


def test_a_position_resumes_only_under_its_layout(tmp_path):
    write_shards(tmp_path / "data", 2, rows=10)
    _, state = run(tmp_path / "data", 2, 3)
    for num_workers, seed, message in [(0, 7, "num_workers 2 -> 0"), (2, 8, "seed 7 -> 8")]:
        loader = StreamLoader(stream(tmp_path / "data", seed=seed), num_workers=num_workers)
        with pytest.raises(ValueError, match=message):
            loader.load_state_dict(state)


def test_a_seed_shuffles_the_shard_order_per_epoch(tmp_path):
    write_shards(tmp_path / "data", 8, rows=2)
    source = StreamingSource.open(tmp_path / "data")

    def shard_order(epoch, seed):
        return [int(doc["example_index"]) >> 47 for doc in source.dataset(encode, epoch, seed)][::2]

    assert shard_order(0, None) == shard_order(1, None) == list(range(8))
    orders = [shard_order(epoch, seed=5) for epoch in range(3)]
    assert all(sorted(order) == list(range(8)) for order in orders) and len({tuple(o) for o in orders}) == 3
    assert shard_order(1, seed=5) == orders[1]  # a function of (seed, epoch)


def test_a_worker_without_a_shard_stops_and_the_others_go_on(tmp_path):
    texts = write_shards(tmp_path / "data", 1)
    batches = list(StreamLoader(stream(tmp_path / "data", epochs=2), num_workers=2))
    for epoch in (0, 1):
        delivered = [doc for batch in batches if batch["epoch"] == epoch for doc in documents(batch)]
        assert sorted(joined(delivered).values()) == sorted(texts[0])


def test_an_epoch_that_leaves_no_document_is_an_error(tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "a.jsonl").write_text("".join(json.dumps({"text": "a" * 30}) + "\n" for _ in range(3)))
    with pytest.raises(ValueError, match="left no document to train on.*long_dropped': 3"):
        next(iter(stream(folder, long_documents="drop")))


# ---------------------------------------------------------------------------- a corpus changed or unreadable (issue 60)

def test_a_shard_changed_since_the_position_was_saved_is_named(tmp_path):
    """Rewritten with the same record count (other content), or only touched: the resume names the shard and what
    changed, instead of continuing at the old offsets into the new content."""
    folder = tmp_path / "data"
    write_shards(folder, 2, rows=10)
    _, state = run(folder, 2, 3)
    run(folder, 2, 1, state=state)  # unchanged: resumes
    shard = folder / "part-001.jsonl"
    original, saved = shard.read_text(), shard.stat()
    shard.write_text(original.replace("1-0-", "1-9-", 1))  # the same size and record count, another content
    with pytest.raises(ValueError, match=f"Data file {shard} is not the shard .*head_sha256 '.*Restore the shard"):
        run(folder, 2, 1, state=state)
    shard.write_text(original)
    os.utime(shard, ns=(saved.st_atime_ns, saved.st_mtime_ns + 10**9))  # the same content, touched
    with pytest.raises(ValueError, match=rf"{shard} is not the shard .*\(mtime_ns {saved.st_mtime_ns} -> \d+\)"):
        run(folder, 2, 1, state=state)


@pytest.mark.parametrize("listed", [False, True])
def test_a_shard_that_is_a_dangling_link_is_named(tmp_path, listed):
    folder = tmp_path / "data"
    write_shards(folder, 2)
    link = folder / "part-002.jsonl"
    link.symlink_to(tmp_path / "moved.jsonl")
    with pytest.raises(ValueError, match=f"{link} .*symbolic link to {tmp_path / 'moved.jsonl'}, which does not exist"):
        StreamingSource.open(sorted(folder.iterdir()) if listed else folder)  # before: left out without a word


@pytest.mark.parametrize("reader", ["stream", "files"])
def test_a_folder_that_cannot_be_listed_says_so(tmp_path, monkeypatch, reader):
    from lit_dllm.data.files import folder_files

    folder = tmp_path / "data"
    write_shards(folder, 5)
    scandir = os.scandir

    def refused(path="."):
        if Path(path) == folder:
            raise PermissionError(13, "Permission denied", str(path))
        return scandir(path)

    monkeypatch.setattr(os, "scandir", refused)  # as for a folder without read permission (tests may run as root)
    with pytest.raises(ValueError, match=f"Data folder {folder} cannot be read \\(Permission denied\\)"):
        StreamingSource.open(folder) if reader == "stream" else folder_files(folder)  # before: "holds no data file"


@pytest.mark.parametrize("value", [None, 7])
def test_a_record_whose_text_is_not_a_string_is_named(tmp_path, value):
    """An encoder with ``columns`` (the data module's) gets its fields checked: file, line and field, rather than a
    TypeError from a loader worker."""
    folder = tmp_path / "data"
    write_shards(folder, 1, rows=4)
    shard = folder / "part-000.jsonl"
    lines = shard.read_text().splitlines()
    lines[2] = json.dumps({"text": value, "other": 1})
    shard.write_text("\n".join(lines) + "\n")

    class Fields:
        columns = {"text": "text"}

        def __call__(self, batch):
            return encode(batch)

    source = StreamingSource.open(folder)
    expected = f"{shard} line 3: column 'text' \\(text_field\\) must be a string, got {value}"
    with pytest.raises(ValueError, match=expected):
        list(PackedStream(source, Fields(), collator(), 2, epochs=1))
