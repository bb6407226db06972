"""The data module's packed training rows (``collation.pack``) and streamed corpora (``source.streaming``): every
example once an epoch, exact mid-epoch resume (map-style and streamed, through a Lightning checkpoint), long documents
split or dropped with a count, and the settings that cannot go together refused with the fix."""

import json
import logging

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lit_dllm import BlockDiffusionGemmaModule, DLLMDataModule, MDLMModule
from lit_dllm.testing import TINY_DIFFUSION_GEMMA, TINY_LLAMA


def packed_dm(tmp_path, path="task:add", **settings):
    groups = {"source": {"path": path, "cache_dir": str(tmp_path / "cache")}, "task": {"num_train": 60, "num_val": 8},
              "loader": {"batch_size": 2, "drop_last": False}, "collation": {"pack": True}, "max_seq_len": 32}
    for name, value in settings.items():
        groups[name] = {**groups.get(name, {}), **value} if isinstance(value, dict) else value
    dm = DLLMDataModule(**groups)
    dm.prepare_data()
    dm.setup("fit")
    return dm


def epoch_batches(loader, count=None):
    batches = []
    for batch in loader:
        batches.append(batch)
        if count is not None and len(batches) == count:
            break
    return batches


def test_packed_rows_hold_every_training_example_once_an_epoch(tmp_path):
    dm = packed_dm(tmp_path)
    batches = epoch_batches(dm.train_dataloader())
    indices = torch.cat([b["example_index"] for b in batches]).tolist()
    assert sorted(indices) == list(range(len(dm.train_dataset)))
    for batch in batches:
        assert batch["input_ids"].shape[1] == 32 and {"document_ids", "position_ids"} <= set(batch)
        lengths = dm.train_dataset.select(batch["example_index"].tolist())["length"]
        assert batch["input_lengths"].tolist() == lengths
    assert len(batches) < -(-len(indices) // 2)  # fewer rows than examples: rows hold several
    assert all(batch["epoch"] == 0 for batch in batches)


def test_a_packed_epoch_resumes_mid_way_with_the_same_batches(tmp_path):
    reference = epoch_batches(packed_dm(tmp_path).train_dataloader())
    dm = packed_dm(tmp_path)
    epoch_batches(dm.train_dataloader(), count=3)
    state = dm.state_dict()
    resumed_dm = packed_dm(tmp_path)
    resumed_dm.load_state_dict(state)
    resumed = epoch_batches(resumed_dm.train_dataloader())
    assert len(resumed) == len(reference) - 3
    for got, expected in zip(resumed, reference[3:]):
        assert all(torch.equal(got[key], expected[key]) for key in ("input_ids", "example_index", "document_ids"))


def write_texts(path, lengths):
    path.write_text("".join(json.dumps({"text": "ab" * (n // 2)}) + "\n" for n in lengths))
    return str(path)


@pytest.mark.parametrize("mode", ["split", "drop"])
def test_long_text_documents_are_split_or_dropped_with_a_count(tmp_path, caplog, mode):
    data = write_texts(tmp_path / "train.jsonl", [10, 40, 12, 70, 8] * 4)
    caplog.set_level(logging.WARNING)
    dm = packed_dm(tmp_path, data, collation={"long_documents": mode}, splits={"val_fraction": 0.2})
    lengths = sorted(dm.train_dataset["length"])
    assert max(lengths) <= 32
    if mode == "split":
        assert "Split" in caplog.text and "longer than a packed row (max_seq_len=32)" in caplog.text
        assert lengths.count(32) >= 2  # the long documents' full pieces
    else:
        assert "Dropped" in caplog.text and "longer than max_seq_len=32" in caplog.text
        assert len(lengths) < 16


@pytest.mark.parametrize("settings, message", [
    ({"loader": {"group_by_length": True}}, "loader.group_by_length with collation.pack"),
    ({"formatting": {"pack_text": True}}, "formatting.pack_text: true concatenates"),
    ({"collation": {"supervise_padding": True}}, "collation.pack with collation.supervise_padding"),
    ({"collation": {"pad_block_size": 5}}, "make max_seq_len a multiple of it"),
    ({"collation": {"pack": False}, "source": {"streaming": True}}, "set collation.pack: true"),
    ({"collation": {"long_documents": "keep"}}, "Unknown collation.long_documents='keep'"),
])
def test_settings_that_cannot_be_packed_are_refused_with_the_fix(tmp_path, settings, message):
    if "source" in settings:  # streaming: a corpus file
        settings["source"]["path"] = write_texts(tmp_path / "train.jsonl", [8, 9])
    with pytest.raises(ValueError, match=message):
        packed_dm(tmp_path, **settings)


def test_a_family_that_cannot_pack_is_refused_before_any_batch(tmp_path):
    dm = packed_dm(tmp_path, collation={"pad_block_size": 4})
    gemma = BlockDiffusionGemmaModule(vocab_size=dm.vocab_size, mask_token_id=dm.mask_token_id,
                                      backbone={"model_config": TINY_DIFFUSION_GEMMA})
    blockwise = MDLMModule(vocab_size=dm.vocab_size, mask_token_id=dm.mask_token_id,
                           backbone={"model_config": dict(TINY_LLAMA)}, corruption="blockwise", block_size=8)
    for module, message in ((gemma, "BlockDiffusionGemmaModule cannot train on packed rows: its rows are one example"),
                            (blockwise, "set data.init_args.collation.pad_block_size to a multiple of 8 \\(got 4\\)")):
        with pytest.raises(ValueError, match=message):
            dm.connect(module.data_needs())


def test_packing_asked_of_block_diffusion_gemma_gives_the_real_reason_first():
    """Gemma's config asks for response windows: the first refusal says Gemma cannot pack (before: "set
    response_window: false", which only led to a second refusal)."""
    from lit_dllm.cli import main

    with pytest.raises(ValueError, match=r"BlockDiffusionGemmaModule\), which trains on response windows, cannot "
                                         "train on packed rows: set collation.pack: false"):
        main(["fit", "--config", "configs/gemma_tiny.yaml", "--data.init_args.collation.pack=true"])


# ---------------------------------------------------------------------------- streaming through the data module


class Recorder(Callback):
    def __init__(self):
        self.batches = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.batches.append({key: batch[key].clone() for key in ("input_ids", "example_index", "document_ids")})
        self.batches[-1]["epoch"] = torch.tensor(batch["epoch"])


def streamed_fit(folder, run, max_steps, ckpt_path=None):
    dm = DLLMDataModule(source={"path": str(folder), "streaming": True}, collation={"pack": True},
                        loader={"batch_size": 2, "num_workers": 2}, max_seq_len=32)
    torch.manual_seed(0)
    module = MDLMModule(vocab_size=dm.vocab_size, mask_token_id=dm.mask_token_id, pad_token_id=dm.pad_token_id,
                        eos_token_id=dm.eos_token_id,
                        backbone={"model_config": dict(TINY_LLAMA), "attn_implementation": "eager"},
                        generation={"val_generate_batches": 0})
    recorder = Recorder()
    trainer = L.Trainer(max_steps=max_steps, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, default_root_dir=str(run),
                        callbacks=[recorder, ModelCheckpoint(dirpath=run, every_n_train_steps=3, save_top_k=-1)])
    trainer.fit(module, datamodule=dm, ckpt_path=ckpt_path)
    return recorder.batches


def test_a_streamed_packed_fit_resumes_with_the_uninterrupted_batches(tmp_path):
    """Two workers, four shards of text documents of mixed lengths (some longer than a row: split): a fit stopped at
    step 3 and resumed from its checkpoint sees the batches of steps 4-7 that an uninterrupted fit sees, bit for
    bit, across the end of the first epoch."""
    folder = tmp_path / "corpus"
    folder.mkdir()
    for shard in range(4):
        write_texts(folder / f"train-{shard:05d}.jsonl", [6 + 7 * ((shard + row) % 9) for row in range(2)])
    uninterrupted = streamed_fit(folder, tmp_path / "a", 7)
    streamed_fit(folder, tmp_path / "b", 3)
    resumed = streamed_fit(folder, tmp_path / "c", 7, ckpt_path=tmp_path / "b" / "epoch=0-step=3.ckpt")
    assert len(resumed) == 4
    assert {int(b["epoch"]) for b in uninterrupted[3:]} == {0, 1}  # the first epoch ends within the resumed steps
    for got, expected in zip(resumed, uninterrupted[3:]):
        assert all(torch.equal(got[key], expected[key]) for key in got)
