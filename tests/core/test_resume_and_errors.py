"""Resume reproduces an uninterrupted run bit for bit; bad input fails early and clearly."""

import lightning as L
import pytest
import torch

from lit_dllm import DLLMDataModule, MDLMModule
from lit_dllm.callbacks import RunSummary
from lit_dllm.testing import TINY_LLAMA
from tests.data.test_datamodule import data_module


def data(**settings) -> DLLMDataModule:
    """The reverse task, small; ``settings`` as :func:`~tests.data.test_datamodule.data_module` takes them."""
    defaults = {"source": {"path": "task:reverse"}, "loader": {"batch_size": 16}, "max_seq_len": 32,
                "task": {"num_train": 64, "num_val": 16}}
    return data_module(defaults, **settings)


def module(dm, **kwargs):
    torch.manual_seed(0)
    return MDLMModule(
        vocab_size=dm.vocab_size, mask_token_id=dm.mask_token_id, pad_token_id=dm.pad_token_id,
        eos_token_id=dm.eos_token_id, backbone={"model_config": TINY_LLAMA}, generation={"val_generate_batches": 0},
        **kwargs,
    )


class RecordLosses(L.Callback):
    def __init__(self, stop_at=None):
        self.losses, self.stop_at = [], stop_at

    def on_train_batch_end(self, trainer, *args):
        self.losses.append(float(trainer.callback_metrics["train/loss"]))
        if trainer.global_step == self.stop_at:
            trainer.should_stop = True


def fit(tmp_path, callback, ckpt_path=None):
    trainer = L.Trainer(
        max_steps=7, accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=0, default_root_dir=tmp_path, callbacks=[callback, RunSummary(),
        L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path, save_last=True, every_n_train_steps=1)],
    )
    dm = data()
    trainer.fit(module(dm), dm, ckpt_path=ckpt_path)
    return trainer


def test_resume_continues_bit_for_bit(tmp_path):
    whole = RecordLosses()
    fit(tmp_path / "whole", whole)  # 7 steps: 4 batches an epoch, so the run crosses an epoch boundary
    first = RecordLosses(stop_at=3)
    fit(tmp_path / "parts", first)
    rest = RecordLosses()
    fit(tmp_path / "parts", rest, ckpt_path=str(tmp_path / "parts" / "last.ckpt"))
    assert len(first.losses) == 3 and len(rest.losses) == 4
    assert first.losses + rest.losses == whole.losses


def test_vocabulary_mismatch_is_reported_before_training():
    dm = data()
    m = MDLMModule(vocab_size=dm.vocab_size, mask_token_id=dm.mask_token_id, pad_token_id=dm.pad_token_id,
                   backbone={"model_config": dict(TINY_LLAMA, vocab_size=dm.vocab_size - 5)})
    with pytest.raises(ValueError, match=r"vocab_size=\d+ is smaller than the tokenizer.s"):
        m.configure_model()


@pytest.mark.parametrize("role", ["pad", "eos"])
def test_mask_id_errors(role):
    ids = {"pad_token_id": 0, "eos_token_id": 1}
    with pytest.raises(ValueError, match=rf"mask_token_id={ids[role + '_token_id']} is also the {role} token's id"):
        MDLMModule(vocab_size=10, mask_token_id=ids[role + "_token_id"], **ids, backbone={"model_config": TINY_LLAMA})
    with pytest.raises(ValueError, match="outside the vocabulary"):
        MDLMModule(vocab_size=10, mask_token_id=12, backbone={"model_config": TINY_LLAMA})


def test_unreachable_model_id_names_it_and_suggests_a_local_path():
    with pytest.raises(OSError, match="no-such-org/no-such-model.*local directory"):
        MDLMModule(vocab_size=10, mask_token_id=3, backbone={"model": "no-such-org/no-such-model"}).configure_model()


def test_batch_without_example_index_is_a_clear_error():
    dm = data()
    m = module(dm)
    with pytest.raises(KeyError, match="example_index"):
        m.noise_keys({"input_ids": torch.zeros(1, 4, dtype=torch.long)}, 0)
