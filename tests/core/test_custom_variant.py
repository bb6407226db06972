"""A new dLLM variant is one small subclass of DLLMModule: here a uniform-noise (D3PM-style) denoiser
with its own tiny backbone, in under 50 lines, that learns."""

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader

from lit_dllm import DLLMModule, StepLoss, corrupt_uniform_random
from lit_dllm.reference.losses import BlockDiffusionCrossEntropyLoss

VOCAB = 12


# --- the whole variant -----------------------------------------------------------------------------
class UniformNoiseDenoiser(DLLMModule):
    """Replace tokens by random ones; learn to restore every supervised token (flat CE)."""

    def build_model(self) -> nn.Module:
        layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
        return nn.Sequential(nn.Embedding(self.hparams.vocab_size, 32), nn.TransformerEncoder(layer, 2),
                             nn.Linear(32, self.hparams.vocab_size))

    def corrupt(self, batch, keys):
        noisy, noise, p = corrupt_uniform_random(batch["input_ids"], batch["loss_mask"], self.hparams.vocab_size, keys=keys)
        return {"noisy_ids": noisy, "noise_mask": noise, "p_mask": p}

    def compute_loss(self, batch, noisy, denominators):
        logits = self.model(noisy["noisy_ids"])
        out = BlockDiffusionCrossEntropyLoss()(logits, batch["input_ids"], noisy["noise_mask"], noisy["p_mask"],
                                               batch["loss_mask"], num_diffusion_tokens=denominators["diffusion"])
        return StepLoss(out)
# ----------------------------------------------------------------------------------------------------


def test_a_new_variant_in_a_few_lines_trains():
    g = torch.Generator().manual_seed(0)
    rows = []
    for i in range(256):  # constant rows: every clean token tells the model what the noised ones were
        ids = torch.full((8,), int(torch.randint(2, VOCAB, (1,), generator=g)))
        rows.append({"input_ids": ids, "loss_mask": torch.ones(8), "example_index": torch.tensor(i)})
    collate = lambda b: {k: torch.stack([r[k] for r in b]) for k in b[0]}  # noqa: E731
    module = UniformNoiseDenoiser(vocab_size=VOCAB, mask_token_id=1, pad_token_id=0,
                                  optimization={"lr": 3e-3, "warmup": 0.0})
    losses = []

    class Record(L.Callback):
        def on_train_batch_end(self, trainer, *args):
            losses.append(float(trainer.callback_metrics["train/loss"]))

    L.Trainer(max_steps=120, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
              enable_model_summary=False, callbacks=[Record()]).fit(module, DataLoader(rows, batch_size=32, shuffle=True, collate_fn=collate))
    first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
    assert last < 0.5 * first, (first, last)
