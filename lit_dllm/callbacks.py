"""Callbacks used by the default configs."""

from __future__ import annotations

import lightning as L
from lightning.pytorch.utilities import rank_zero_only


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
