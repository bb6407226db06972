"""Generation and export that need every weight refuse a model FSDP2 has sharded, with one message."""

import pytest
import torch
from torch import nn

from lit_dllm import BlockDiffusionGemmaModule
from lit_dllm.core import token_loss
from lit_dllm.testing import TINY_DIFFUSION_GEMMA


def test_generation_refuses_a_sharded_model(monkeypatch):
    module = BlockDiffusionGemmaModule(vocab_size=100, pad_token_id=0, eos_token_id=1,
                                       backbone={"model_config": TINY_DIFFUSION_GEMMA},
                                       generation={"val_generate_batches": 0})
    module.configure_model()
    module.check_whole_model("Generation")  # a plain model passes
    monkeypatch.setattr(token_loss, "FSDPModule", nn.Module)  # every model now counts as sharded
    with pytest.raises(RuntimeError, match=r"DiffusionGemma generate needs the whole model, but it is sharded "
                                           r"\(FSDP\): set model.init_args.generation.val_generate_batches: 0"):
        module.generate_ids([torch.tensor([5, 6, 7])])
