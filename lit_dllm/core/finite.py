"""The finite check of each optimizer step (docs/DESIGN.md §7): a non-finite loss or gradient norm stops the run
before the update reaches the weights."""

from __future__ import annotations

import torch

from lit_dllm import compat


class FiniteCheck:
    """Checks each step's loss and gradient norm before the update (fp16's loss scaler handles the gradients).

    An optimizer that can skip its own step on the device (torch's fused Adam, AdamW and SGD:
    :func:`lit_dllm.compat.can_skip_step`) gets the verdict as ``found_inf``, as a loss scaler would give it, and the
    host reads it once the step is queued (:meth:`settle`): the device runs on meanwhile, where checking at once would
    leave it idle while the host launches the update. Other optimizers are checked at once."""

    def __init__(self) -> None:
        self._pending = None  # (host copy of the verdict, its arrival event), (loss, norm)

    def check(self, trainer, optimizer, loss: torch.Tensor, grad_norm: torch.Tensor, lr: float) -> None:
        """Before the optimizer step: give ``optimizer`` the verdict, or raise now."""
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        finite = torch.isfinite(loss) & (torch.isfinite(grad_norm) | (scaler is not None))
        if scaler is None and compat.can_skip_step(optimizer):
            compat.set_found_inf(optimizer, (~finite).float())
            self._pending = _copy_to_host(finite), (loss, grad_norm, lr)
        elif not finite:
            raise non_finite_error(trainer, loss, grad_norm, lr)

    def settle(self, trainer) -> None:
        """After the optimizer step was queued (and ``found_inf`` taken back): raise if the verdict failed."""
        if self._pending is None:
            return
        (finite, arrived), (loss, grad_norm, lr) = self._pending
        self._pending = None
        if arrived is not None:
            arrived.synchronize()  # waits for the backward only: the queued update keeps the device busy
        if not finite:
            raise non_finite_error(trainer, loss, grad_norm, lr)


def non_finite_error(trainer, loss: torch.Tensor, grad_norm: torch.Tensor, lr: float) -> FloatingPointError:
    """The error that stops a run at a non-finite step, naming the step and the last checkpoint."""
    last = getattr(trainer.checkpoint_callback, "last_model_path", "") or "none saved yet"
    return FloatingPointError(
        f"Non-finite training {'loss' if not torch.isfinite(loss) else 'gradient norm'} (loss {float(loss)}, "
        f"gradient norm {float(grad_norm)}) at optimizer step {trainer.global_step + 1} (epoch {trainer.current_epoch}). "
        f"Stopped before this update, so the weights and the last checkpoint ({last}) are from before it. "
        f"Lower the learning rate (lr={lr}), keep gradient clipping on, or check the data."
    )


def _copy_to_host(flag: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """``flag`` copied to pinned host memory without waiting, and the event that marks its arrival (CPU: as is)."""
    if flag.device.type != "cuda":
        return flag, None
    host = torch.empty(flag.shape, dtype=flag.dtype, pin_memory=True).copy_(flag, non_blocking=True)
    arrived = torch.cuda.Event()
    arrived.record()
    return host, arrived
