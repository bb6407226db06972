"""Callbacks used by the default configs."""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
from lightning.pytorch.callbacks import BasePredictionWriter
from lightning.pytorch.utilities import rank_zero_info, rank_zero_only


class RunSummary(L.Callback):
    """At the end of ``fit``, print the final metrics and where the logs and checkpoints are."""

    @rank_zero_only
    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        metrics = {k: float(v) for k, v in sorted(trainer.callback_metrics.items()) if v.numel() == 1}
        lines = [f"Finished after {trainer.global_step} optimizer steps."]
        lines += [f"  {name:<28} {value:.4f}" for name, value in metrics.items()]
        if trainer.logger is not None and trainer.logger.log_dir:
            lines.append(f"Logs:        {trainer.logger.log_dir}  (tensorboard --logdir {trainer.logger.save_dir})")
        checkpoint = trainer.checkpoint_callback
        if checkpoint is not None:
            lines.append(f"Checkpoint:  {checkpoint.last_model_path or checkpoint.best_model_path}")
        print("\n".join(lines), flush=True)


class JsonlPredictionWriter(BasePredictionWriter):
    """Write ``predict`` outputs (lists of dicts, e.g. prompt / generated / reference) as JSON lines.

    ``path`` defaults to ``predictions.jsonl`` in the logger's directory (else the trainer's root dir);
    with several ranks each writes its own ``predictions.rank<r>.jsonl``.
    """

    def __init__(self, path: str | None = None) -> None:
        super().__init__(write_interval="batch")
        self.path = path

    def on_predict_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.path is None:
            folder = trainer.logger.log_dir if trainer.logger is not None else trainer.default_root_dir
            name = "predictions.jsonl" if trainer.world_size == 1 else f"predictions.rank{trainer.global_rank}.jsonl"
            self.path = str(Path(folder) / name)
        Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        Path(self.path).write_text("")

    def write_on_batch_end(self, trainer, pl_module, prediction, batch_indices, batch, batch_idx, dataloader_idx) -> None:
        with open(self.path, "a") as out:
            out.writelines(json.dumps(row) + "\n" for row in prediction)

    def on_predict_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        rank_zero_info(f"Predictions: {self.path}")
