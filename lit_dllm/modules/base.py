"""``DLLMModule``: the corruption-plus-loss training step as a template with small hooks.

A dLLM variant is a subclass that overrides a few hooks:

- :meth:`build_model` -> the backbone (called once, from ``configure_model``, so strategies can shard it);
- :meth:`corrupt` -> the noised batch (every draw keyed by example, see :meth:`noise_keys`);
- :meth:`token_counts` -> local token counts that normalise the loss (``primary`` first);
- :meth:`compute_loss` -> a :class:`StepLoss` given the global denominators;
- :meth:`generate_ids` -> answers for prompts (for exact-match validation and ``predict``).

Global token normalisation (SPEC §4, §7.3). Each optimizer step's loss and gradient equal the
per-token mean over all its micro-batches and data-parallel ranks, whatever the split. Lightning
feeds micro-batches one at a time, so the step's global count is known only after the last one.
The loss of each micro-batch is therefore divided by ``c``, the first micro-batch's DP-summed count
times ``accumulate_grad_batches`` (identical on every rank); once the window closes,
:meth:`on_before_optimizer_step` all-reduces the true count ``N`` and multiplies the gradients by
``c / N``. With one micro-batch per step ``c == N`` and nothing is rescaled. Losses with a second
denominator (the hybrid AR term) are exact whenever ``accumulate_grad_batches == 1``; with
accumulation, that term's denominator is the first micro-batch's estimate (documented per module).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import lightning as L
import torch
import torch.distributed as dist
from torch import nn
from torchmetrics import MeanMetric

from lit_dllm.checkpointing import TOKENIZER_KEY, tokenizer_files, tokenizer_from_files
from lit_dllm.data.corruption import example_keys
from lit_dllm.losses import DLLMLossOutput
from lit_dllm.modules.optim import OptimizerCallable, build_optimization

EVAL_STAGES = ("val", "test")


COUNT_SUMS = ("supervised_tokens", "corrupted_tokens")
"""Window sums logged as they are; every other one (``loss``, ``dllm_loss`` and each named extra term of
:class:`StepLoss`, e.g. the hybrid's ``ar_loss``) is a loss normalised by the estimate, rescaled by ``c / N``."""

VALIDATION_EPOCH = -1
"""Epoch used in the noise keys of validation: fixed, so every validation pass sees the same noise."""


@dataclass
class StepLoss:
    """What :meth:`DLLMModule.compute_loss` returns: the loss plus counts for metrics."""

    output: DLLMLossOutput
    num_correct: torch.Tensor | None = None
    num_scored: torch.Tensor | None = None
    extra: dict[str, torch.Tensor] = field(default_factory=dict)


class DLLMModule(L.LightningModule):
    """Base LightningModule for diffusion LMs; see the module docstring for the hooks.

    Args:
        vocab_size, mask_token_id, pad_token_id, eos_token_id: linked from the data module.
        tokenizer, mask_token: the tokenizer name or path (None = embedded default) and the mask token added to it
            (both linked from the data module). Training takes the data module's tokenizer itself, and every
            checkpoint stores it, so ``load_from_checkpoint(path).generate(...)`` decodes with the right one.
        noise_seed: base of every noise key; an example's noise is a function of (noise_seed, index, epoch).
        lr, weight_decay, betas, warmup, min_lr_ratio: AdamW with linear warm-up (``warmup`` < 1 is a
            fraction of the run's optimizer steps) then cosine decay to ``min_lr_ratio``·lr.
        optimizer: optional optimizer class/callable taking param groups, replacing AdamW.
    """

    def __init__(
        self,
        vocab_size: int,
        mask_token_id: int,
        pad_token_id: int = 0,
        eos_token_id: int | None = None,
        tokenizer: str | None = None,
        mask_token: str | None = None,
        noise_seed: int = 42,
        lr: float = 3e-4,
        weight_decay: float = 0.01,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup: float = 0.05,
        min_lr_ratio: float = 0.1,
        optimizer: OptimizerCallable | None = None,
    ) -> None:
        super().__init__()
        if mask_token_id is None:
            raise ValueError("mask_token_id is None: configure a tokenizer with a mask token (data.mask_token).")
        if mask_token_id == pad_token_id:
            raise ValueError(f"mask_token_id == pad_token_id == {mask_token_id}: give the mask its own token id.")
        if not 0 <= mask_token_id < vocab_size:
            raise ValueError(f"mask_token_id={mask_token_id} is outside the vocabulary [0, {vocab_size}).")
        _check_optimization(lr, weight_decay, warmup, min_lr_ratio)
        self.save_hyperparameters(ignore=["optimizer"])
        self.optimizer_factory = optimizer
        self.model: nn.Module | None = None
        self._tokenizer = None
        self._window: dict[str, torch.Tensor] | None = None
        self._estimate: dict[str, torch.Tensor] = {}
        self._parallelized = False
        self.eval_metrics = nn.ModuleDict({stage: self.stage_metrics() for stage in EVAL_STAGES})

    # ------------------------------------------------------------------ hooks
    def build_model(self) -> nn.Module:
        """Return the backbone. Called once, from ``configure_model``."""
        raise NotImplementedError

    def parallelize(self, model: nn.Module) -> nn.Module:
        """Shard ``model`` with FSDP2 when run under Lightning's ``ModelParallelStrategy``.

        Without a device mesh (single device, DDP) the model is returned as it is.
        """
        if self.device_mesh is None:
            return model
        from lit_dllm.parallel import apply_fsdp

        bf16 = "bf16" in str(self.trainer.precision)
        return apply_fsdp(model, self.device_mesh, param_dtype=torch.bfloat16 if bf16 else None)

    def corrupt(self, batch: dict, keys: torch.Tensor) -> dict:
        """Noise the batch; return at least ``noisy_ids``, ``noise_mask``, ``p_mask``."""
        raise NotImplementedError

    def token_counts(self, batch: dict, noisy: dict) -> dict[str, torch.Tensor]:
        """Local token counts that normalise the loss terms; the first entry is the primary one."""
        return {"diffusion": batch["loss_mask"].sum()}

    def compute_loss(self, batch: dict, noisy: dict, denominators: dict[str, torch.Tensor]) -> StepLoss:
        """Loss of one micro-batch, each term divided by its (global) denominator."""
        raise NotImplementedError

    def generate_ids(self, prompts: list[torch.Tensor], max_new_tokens: int) -> list[torch.Tensor]:
        """Generated answer ids (without the prompt) for each 1-D prompt tensor."""
        raise NotImplementedError

    # ------------------------------------------------------------ model setup
    def configure_model(self) -> None:
        """Build the backbone once, then shard it once (both steps are idempotent)."""
        if self.model is None:
            self.model = self.build_model()
        if not self._parallelized and self._trainer is not None:
            self.model = self.parallelize(self.model)
            self._parallelized = True

    @property
    def tokenizer(self):
        """The tokenizer named by ``hparams.tokenizer`` (loaded on first use)."""
        if self._tokenizer is None:
            from lit_dllm.data.tokenizer import load_tokenizer

            hp = self.hparams
            self._tokenizer = load_tokenizer(hp.tokenizer, hp.get("mask_token"), hp.get("trust_remote_code", False))
        return self._tokenizer

    @tokenizer.setter
    def tokenizer(self, value) -> None:
        self._tokenizer = value

    def setup(self, stage: str) -> None:
        """Take the data module's tokenizer (the one that made the batches) unless one was set explicitly."""
        datamodule = getattr(self.trainer, "datamodule", None)
        if self._tokenizer is None and getattr(datamodule, "tokenizer", None) is not None:
            self._tokenizer = datamodule.tokenizer
        if self._tokenizer is not None and self._tokenizer.mask_token_id != self.hparams.mask_token_id:
            raise ValueError(
                f"The tokenizer's mask id ({self._tokenizer.mask_token_id}) differs from the model's mask_token_id="
                f"{self.hparams.mask_token_id}: build the module from the data module's ids (data.mask_token_id)."
            )

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint[TOKENIZER_KEY] = tokenizer_files(self.tokenizer)

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        if self._tokenizer is None and TOKENIZER_KEY in checkpoint:
            self._tokenizer = tokenizer_from_files(checkpoint[TOKENIZER_KEY], self.hparams.get("trust_remote_code", False))

    def configure_optimizers(self):
        return build_optimization(
            self.model,
            int(self.trainer.estimated_stepping_batches),
            lr=self.hparams.lr,
            weight_decay=self.hparams.weight_decay,
            betas=tuple(self.hparams.betas),
            warmup=self.hparams.warmup,
            min_lr_ratio=self.hparams.min_lr_ratio,
            optimizer=self.optimizer_factory,
        )

    # ----------------------------------------------------------------- noise
    def noise_keys(self, batch: dict, epoch: int) -> torch.Tensor:
        """Per-example noise keys from (seed, global example index, epoch); training uses the batch's data epoch
        (``DLLMDataModule`` batches carry it), else Lightning's."""
        if "example_index" not in batch:
            raise KeyError(
                "The batch has no 'example_index' (each example's stable global index, used to key its noise). "
                "Use DLLMDataModule, or add an 'example_index' long tensor [B] to your batches."
            )
        return example_keys(self.hparams.noise_seed, batch["example_index"], epoch)

    # -------------------------------------------------------------- training
    @property
    def data_parallel_size(self) -> int:
        """Ranks that see different data (gradients are averaged over them)."""
        mesh = self.device_mesh
        if mesh is not None and "data_parallel" in (mesh.mesh_dim_names or ()):
            return mesh["data_parallel"].size()
        return self.trainer.world_size

    def _dp_sum(self, value: torch.Tensor) -> torch.Tensor:
        value = value.detach().float().clone()
        if dist.is_available() and dist.is_initialized() and self.trainer.world_size > 1:
            dist.all_reduce(value)
        return value

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        noisy = self.corrupt(batch, self.noise_keys(batch, batch.get("epoch", self.current_epoch)))
        counts = self.token_counts(batch, noisy)
        accumulate = self.trainer.accumulate_grad_batches
        if self._window is None:  # first micro-batch of this optimizer step
            estimates = (self._dp_sum(torch.stack([v.float() for v in counts.values()])) * accumulate).clamp_min(1.0)
            self._estimate = dict(zip(counts, estimates))
        step = self.compute_loss(batch, noisy, self._estimate)
        sums = {
            "count": next(iter(counts.values())),
            "loss": step.output.total_loss,
            "dllm_loss": step.output.dllm_loss,
            **step.extra,
            "supervised_tokens": batch["loss_mask"].sum(),
            "corrupted_tokens": noisy["noise_mask"].sum(),
        }
        sums = {name: value.detach().float() for name, value in sums.items()}
        self._window = sums if self._window is None else {k: self._window[k] + v for k, v in sums.items()}
        # Lightning divides by `accumulate` and DDP/FSDP average over ranks: undo both.
        return step.output.total_loss * (accumulate * self.data_parallel_size)

    def on_before_optimizer_step(self, optimizer) -> None:
        if self._window is None:
            return
        names = list(self._window)
        sums = dict(zip(names, self._dp_sum(torch.stack([self._window[k] for k in names]))))  # one all-reduce
        self._window = None
        scale = next(iter(self._estimate.values())) / sums.pop("count").clamp_min(1.0)
        if not torch.equal(scale, torch.ones_like(scale)):
            for param in self.parameters():
                if param.grad is not None:
                    param.grad.mul_(float(scale))
        logs = {f"train/{k}": v if k in COUNT_SUMS else v * scale for k, v in sums.items()}
        logs["train/grad_norm"] = self._grad_norm()
        self._check_finite(logs["train/loss"], logs["train/grad_norm"])
        logs["train/lr"] = torch.tensor(optimizer.param_groups[0]["lr"])
        self.log_dict(logs, on_step=True, on_epoch=False, rank_zero_only=True)
        self.log("loss", logs["train/loss"], prog_bar=True, logger=False, rank_zero_only=True)

    def _grad_norm(self) -> torch.Tensor:
        """L2 norm of all gradients before clipping (full norm across shards under FSDP)."""
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        if not grads:
            return torch.zeros((), device=self.device)
        norm = torch.nn.utils.get_total_norm(grads)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm

    def _check_finite(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
        """Stop before a non-finite loss or gradient reaches the weights (fp16's loss scaler handles its own)."""
        scaler = getattr(self.trainer.precision_plugin, "scaler", None)
        if torch.isfinite(loss) and (torch.isfinite(grad_norm) or scaler is not None):
            return
        callback = self.trainer.checkpoint_callback
        last = getattr(callback, "last_model_path", "") or "none saved yet"
        raise FloatingPointError(
            f"Non-finite training {'loss' if not torch.isfinite(loss) else 'gradient norm'} (loss {float(loss)}, "
            f"gradient norm {float(grad_norm)}) at optimizer step {self.global_step + 1} (epoch {self.current_epoch}). "
            f"Stopped before this update, so the weights and the last checkpoint ({last}) are from before it. "
            f"Lower the learning rate (lr={self.hparams.lr}), keep gradient clipping on, or check the data."
        )

    # ------------------------------------------------------------ validation
    def stage_metrics(self) -> nn.ModuleDict:
        """Metrics of one evaluation stage (val or test); subclasses may add entries."""
        return nn.ModuleDict({"loss": MeanMetric(), "masked_accuracy": MeanMetric()})

    def evaluate(self, batch: dict, batch_idx: int, stage: str) -> None:
        """ELBO-weighted loss and masked-token accuracy under fixed (validation-keyed) noise."""
        metrics = self.eval_metrics[stage]
        noisy = self.corrupt(batch, self.noise_keys(batch, VALIDATION_EPOCH))
        counts = {k: v.float().clamp_min(1.0) for k, v in self.token_counts(batch, noisy).items()}
        step = self.compute_loss(batch, noisy, counts)
        metrics["loss"].update(step.output.dllm_loss, weight=next(iter(counts.values())))
        if step.num_scored is not None and step.num_scored > 0:
            metrics["masked_accuracy"].update(step.num_correct / step.num_scored, weight=step.num_scored)
        self.log(f"{stage}/loss", metrics["loss"], prog_bar=stage == "val")
        self.log(f"{stage}/masked_accuracy", metrics["masked_accuracy"])

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        self.evaluate(batch, batch_idx, "val")

    def test_step(self, batch: dict, batch_idx: int) -> None:
        self.evaluate(batch, batch_idx, "test")


def _check_optimization(lr: float, weight_decay: float, warmup: float, min_lr_ratio: float) -> None:
    """Reject optimisation settings that would fail (or silently misbehave) only once training starts."""
    if not lr > 0:
        raise ValueError(f"lr={lr!r} must be a positive learning rate, e.g. 3e-4.")
    if weight_decay < 0:
        raise ValueError(f"weight_decay={weight_decay!r} must be >= 0.")
    if warmup < 0:
        raise ValueError(f"warmup={warmup!r} must be >= 0: a fraction of the run (< 1) or a number of steps (>= 1).")
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise ValueError(f"min_lr_ratio={min_lr_ratio!r} must lie in [0, 1] (the final lr is min_lr_ratio * lr).")
