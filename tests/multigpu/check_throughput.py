"""ThroughputMonitor on two GPUs (DDP, NCCL): the logged rates count both ranks' tokens and rows.

Not collected by pytest (needs 2 GPUs); run on a 2-GPU machine:
    torchrun --nproc_per_node=2 tests/multigpu/check_throughput.py
Rank 0 trains on 16-row batches, rank 1 on 5-row ones. An independent count (both ranks' real tokens and rows,
all-reduced, over the wall time of the logged steps) must match the logged rates: the tokens/rows ratio exactly,
the rates within 15 % (the monitor's clock excludes the first steps' set-up). Prints PASS and exits 0 on success.
"""

import os
import sys
import time

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from lit_dllm.callbacks import ThroughputMonitor  # noqa: E402
from lit_dllm.data.batch import real_tokens  # noqa: E402
from lit_dllm.settings import Parallelism  # noqa: E402
from tests.core.test_resume_and_errors import data, module  # noqa: E402

STEPS, LOG_EVERY = 60, 20


class PerRankBatches(L.LightningDataModule):
    """Rank r trains on ``batches[r]``, ``STEPS`` times (no distributed sampler)."""

    def __init__(self, *batches):
        super().__init__()
        self.batches = batches

    def train_dataloader(self):
        return torch.utils.data.DataLoader([self.batches[self.trainer.global_rank]] * STEPS, batch_size=None)


class Logged(L.Callback):
    """The monitor's logged rates at each log step, and an independent clock and count over the last window."""

    def __init__(self):
        self.rates, self.window = (), {}

    def on_train_end(self, trainer, pl_module):
        metrics = trainer.callback_metrics  # the last log's (step STEPS)
        self.rates = float(metrics["train/tokens_per_sec"]), float(metrics["train/samples_per_sec"])

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        step = trainer.global_step
        if step == STEPS - LOG_EVERY:
            torch.cuda.synchronize()
            self.window = {"start": time.perf_counter(), "tokens": 0, "rows": 0}
        elif step > STEPS - LOG_EVERY:
            counts = torch.tensor([real_tokens(batch).sum().item(), len(batch["input_ids"])], device="cuda")
            dist.all_reduce(counts)
            self.window["tokens"] += int(counts[0])
            self.window["rows"] += int(counts[1])
            torch.cuda.synchronize()
            self.window["end"] = time.perf_counter()


def main() -> None:
    dm = data(loader={"batch_size": 16})
    dm.setup("fit")
    full = next(iter(dm.train_dataloader()))
    small = {key: value[:5] if torch.is_tensor(value) and value.dim() > 0 else value for key, value in full.items()}
    logged = Logged()
    ddp = DDPStrategy()
    ddp.parallelism = Parallelism(compile=False)  # the run settings any strategy may carry (lit_dllm.strategies.plan)
    trainer = L.Trainer(max_steps=STEPS, accelerator="gpu", devices=2, strategy=ddp, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, log_every_n_steps=LOG_EVERY, callbacks=[ThroughputMonitor(), logged])
    trainer.fit(module(dm), datamodule=PerRankBatches(full, small))
    tokens, rows = logged.rates
    window = logged.window
    seconds = window["end"] - window["start"]
    both = int(real_tokens(full).sum() + real_tokens(small).sum())
    ratio_ok = abs(tokens / rows - both / 21) < 1e-6 * both
    rate_ok = abs(tokens / (window["tokens"] / seconds) - 1) < 0.15
    if trainer.global_rank == 0:
        print(f"logged (last window): {tokens:,.0f} tokens/s, {rows:,.1f} rows/s; independent count over "
              f"{window['rows']} rows: {window['tokens'] / seconds:,.0f} tokens/s, {window['rows'] / seconds:,.1f} rows/s; "
              f"tokens per row {tokens / rows:.3f} (both ranks' batches: {both / 21:.3f})")
        print("PASS" if ratio_ok and rate_ok else "FAIL")
    sys.exit(0 if ratio_ok and rate_ok else 1)


if __name__ == "__main__":
    main()
