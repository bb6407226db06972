"""``TokenLossModule``: the family-neutral training step (MDLM, block diffusion, DFlash and plain AR build on it).

A family is a subclass that overrides a few hooks:

- :meth:`build_model` -> the model (called once, from ``configure_model``, so strategies can shard it);
- :meth:`prepare_batch` -> what the loss needs besides the batch (corrupt it, shift it, run a frozen model),
  every random draw keyed by example (:meth:`noise_keys`);
- :meth:`token_counts` -> named local token counts that normalise the loss terms (the primary one first);
- :meth:`compute_loss` -> a :class:`StepLoss` given the global denominators; its ``extra`` names more loss terms;
- :meth:`token_sums` -> named token counts to log (e.g. supervised, corrupted);
- :meth:`generate_ids` -> answers for prompts (for exact-match validation and ``predict``).

Global token normalisation (docs/DESIGN.md §7). Each optimizer step's loss and gradient equal the per-token mean
over all its micro-batches and data-parallel ranks, whatever the split. Lightning feeds micro-batches one at a
time, so the step's global count is known only after the last one. The loss of each micro-batch is therefore
divided by ``c``, the first micro-batch's count summed over the data-parallel group, times
``accumulate_grad_batches`` (identical on every rank); once the window closes, :meth:`on_before_optimizer_step`
all-reduces the true count ``N`` and multiplies the gradients by ``c / N``. With one micro-batch per step
``c == N`` and nothing is rescaled. Losses with a second denominator (the hybrid AR term) are exact whenever
``accumulate_grad_batches == 1``; with accumulation, that term's denominator is the first micro-batch's estimate.

Frozen modules (``frozen_modules``: dotted names of submodules, e.g. a DFlash target) are kept out of the
optimizer, in ``eval()`` mode and without gradients, and out of checkpoints unless ``save_frozen``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torchmetrics import MeanMetric

from lit_dllm import compat
from lit_dllm.checkpointing import (
    TOKENIZER_KEY,
    current_checkpoint,
    tokenizer_files,
    tokenizer_from_files,
)
from lit_dllm.hub.hf import check_flex_training
from lit_dllm.core.optim import OptimizerCallable, build_optimization
from lit_dllm.settings import grouped_settings
from lit_dllm.data.keys import example_keys
from lit_dllm.data.tokenizer import check_mask_token_id, load_tokenizer
from lit_dllm.fp8 import check_fp8_device, check_recipe, precompute_fp8_scales, uses_fp8_all_gather
from lit_dllm.lora import apply_lora, lora_config, save_lora
from lit_dllm.losses import DLLMLossOutput
from lit_dllm.parallel import (
    clip_grad_norm_,
    data_parallel_group,
    data_parallel_size,
    device_meshes,
    experts_kernels,
    export_hf,
    first_units,
    grad_norm,
    hf_backbone,
    parallelize,
    scale_gradients_,
    set_experts_implementation,
    sync_gradients_in_backward,
)
from lit_dllm.throughput import transformer_flops

EVAL_STAGES = ("val", "test")

VALIDATION_EPOCH = -1
"""Epoch used in the noise keys of validation: fixed, so every validation pass sees the same noise."""

REDUCE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
"""``fsdp_reduce_dtype``'s values."""


@dataclass
class StepLoss:
    """What :meth:`TokenLossModule.compute_loss` returns: the loss, optional accuracy counts, and named extra loss
    terms (already normalised, logged as ``train/<name>``)."""

    output: DLLMLossOutput
    num_correct: torch.Tensor | None = None
    num_scored: torch.Tensor | None = None
    extra: dict[str, torch.Tensor] = field(default_factory=dict)


class TokenLossModule(L.LightningModule):
    """Base LightningModule of every family; see the module docstring for the hooks.

    Args:
        vocab_size, mask_token_id, pad_token_id, eos_token_id: linked from the data module (``mask_token_id`` is
            only used by families that mask, and must differ from the pad and eos ids).
        tokenizer, mask_token: the tokenizer name or path (None = embedded default) and the mask token added to it
            (both linked from the data module). Training takes the data module's tokenizer itself, and every
            checkpoint stores it, so ``load_from_checkpoint(path).generate(...)`` decodes with the right one.
        tokenizer_gguf_file: the GGUF file in ``tokenizer`` (a folder or hub id) that holds the tokenizer, or None
            (linked from the data module too).
        noise_seed: base of every random key; an example's draws are a function of (noise_seed, index, epoch).
        lr, weight_decay, betas, warmup, min_lr_ratio: AdamW with linear warm-up (``warmup`` < 1 is a
            fraction of the run's optimizer steps) then cosine decay to ``min_lr_ratio``·lr.
        optimizer: optional optimizer class/callable taking param groups, replacing AdamW.
        frozen_modules: dotted names of submodules (e.g. ``"model.hf.model.embed_tokens"``) to freeze.
        save_frozen: keep frozen modules' weights in checkpoints (off: they are rebuilt by ``build_model``).
        compile: ``torch.compile`` each transformer block in place (:func:`lit_dllm.parallel.apply_compile`); None
            (the default) compiles on CUDA and not on CPU. Checkpoints load with it on or off.
        lora: LoRA fine-tuning through PEFT (:mod:`lit_dllm.lora`): ``peft.LoraConfig`` settings (``r``,
            ``lora_alpha``, ``lora_dropout``, ``target_modules``, ...) over the family's :attr:`lora_defaults`; ``{}``
            takes the defaults. Only the adapters train; on a pretrained ``backbone.model`` checkpoints hold the
            adapters alone (the base is rebuilt from it). None: full fine-tuning.
        experts_implementation: what runs the experts of a transformers MoE model (``grouped_mm``, ``batched_mm``,
            ``eager``, ...; transformers' ``set_experts_implementation``); None keeps transformers' choice
            (``grouped_mm``). What runs them is logged when ``fit`` starts, with a warning where, on CUDA, it is a
            loop over the experts (:func:`lit_dllm.parallel.experts_loop_reason`: the reason and the fix).
        fp8: float8 training of the blocks' dense linear layers through torchao (:mod:`lit_dllm.fp8`, extra ``fp8``):
            ``"tensorwise"`` or ``"rowwise"`` scales (torchao's recipes), on a GPU of compute capability >= 8.9.
            Weights, gradients and checkpoints keep their dtype (checkpoints load with fp8 on or off). None: off.
        fsdp_reshard_after_forward: under FSDP2, free each block's gathered parameters after its forward (True, the
            default: the least memory) or keep them to its backward (False: no all-gather in the backward, and
            DiffusionGemma's shared layers gather once a step instead of five times; costs the unsharded parameters
            of every block on each GPU). The last block always keeps them. Without FSDP2 it does nothing (a warning).
        fsdp_defer_gradient_sync: under FSDP2 with ``accumulate_grad_batches > 1``, reduce-scatter the gradients once
            per optimizer step, at the window's last micro-batch, instead of after each micro-batch; until then each
            GPU accumulates them unsharded (in ``fsdp_reduce_dtype``) and keeps the blocks gathered between
            micro-batches. Per optimizer step this saves ``accumulate - 1`` reduce-scatters and all-gathers of every
            block, for an unsharded copy of the gradients and the parameters on each GPU (FSDP1's ``no_sync``;
            Lightning skips the sync under DDP, not under FSDP2). False (the default): sync each micro-batch. Without
            FSDP2 it does nothing (a warning).
        fsdp_prefetch_next_step: under FSDP2, all-gather the root's and the first block's parameters for the next
            step as soon as the optimizer stepped, so they arrive while the host logs and loads the next batch,
            instead of when the next forward starts (FSDP2 prefetches within a step, not across steps). No extra
            memory during training; after the last step they are freed. Without FSDP2 it does nothing (a warning).
        fsdp_reduce_dtype: under FSDP2, the dtype gradients are reduce-scattered in (and, with
            ``fsdp_defer_gradient_sync``, accumulated in between): ``"float32"`` (the default: sums in full precision)
            or ``"bfloat16"``: half the bytes to send, and no fp32 copy of the gradients. Under ``bf16-true`` over two
            ranks the gradients are the same bit for bit (each sum rounds to bf16 once either way); over more ranks
            each hop of the ring rounds, and under ``bf16-mixed`` the summed gradients round to bf16. Without FSDP2 it
            does nothing (a warning).
    """

    lora_defaults: dict = {"r": 16, "lora_alpha": 32, "lora_dropout": 0.0, "target_modules": "all-linear"}
    """LoRA settings a family starts from (every linear layer of the blocks; PEFT leaves the LM head out)."""

    def __init__(
        self,
        vocab_size: int,
        mask_token_id: int | None = None,
        pad_token_id: int = 0,
        eos_token_id: int | None = None,
        tokenizer: str | None = None,
        mask_token: str | None = None,
        tokenizer_gguf_file: str | None = None,
        noise_seed: int = 42,
        lr: float = 3e-4,
        weight_decay: float = 0.01,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup: float = 0.05,
        min_lr_ratio: float = 0.1,
        optimizer: OptimizerCallable | None = None,
        frozen_modules: list[str] | None = None,
        save_frozen: bool = False,
        compile: bool | None = None,
        lora: dict[str, Any] | None = None,
        experts_implementation: str | None = None,
        fp8: str | None = None,
        fsdp_reshard_after_forward: bool = True,
        fsdp_defer_gradient_sync: bool = False,
        fsdp_prefetch_next_step: bool = False,
        fsdp_reduce_dtype: str = "float32",
    ) -> None:
        super().__init__()
        check_mask_token_id(mask_token_id, pad=pad_token_id, eos=eos_token_id)
        _check_optimization(lr, weight_decay, warmup, min_lr_ratio)
        if lora is not None:
            lora_config(lora, self.lora_defaults)  # unknown or bad settings fail here, before any model is built
        check_recipe(fp8)
        if fsdp_reduce_dtype not in REDUCE_DTYPES:
            raise ValueError(f"fsdp_reduce_dtype={fsdp_reduce_dtype!r} is not a dtype FSDP2 reduces gradients in here: "
                             f"use one of {', '.join(REDUCE_DTYPES)}.")
        if fp8 is not None and lora is not None:
            raise ValueError(f"fp8={fp8!r} with lora is not supported: fp8 converts only trainable linear layers, which "
                             "under LoRA are the small rank-r adapters (no speed-up, coarser updates). Drop one of them.")
        self.save_hyperparameters(ignore=["optimizer"])
        grouped = grouped_settings(self.hparams, type(self))
        if grouped != dict(self.hparams):  # a subclass passed settings on in its **kwargs: flat, or a group object
            for name in set(self.hparams) - set(grouped):
                del self.hparams[name]
            self.save_hyperparameters(grouped)
        self.optimizer_factory = optimizer
        self.model: nn.Module | None = None
        self._tokenizer = None
        self._tokenizer_files: dict[str, bytes] | None = None
        self._window: dict[str, torch.Tensor] | None = None
        self._estimate: dict[str, torch.Tensor] = {}
        self._loss_names: set[str] = set()
        self._parallelized = False
        self._trained_keys: set[str] | None = None
        self._finite_verdict = None  # (host copy of the step's finite check, its arrival event), (loss, norm)
        self._steps_before_batch = 0
        self.eval_metrics = nn.ModuleDict({stage: self.stage_metrics() for stage in EVAL_STAGES})

    # ------------------------------------------------------------------ hooks
    def build_model(self) -> nn.Module:
        """Return the model. Called once, from ``configure_model``."""
        raise NotImplementedError

    @property
    def attached_trainer(self) -> L.Trainer | None:
        """The trainer running this module; None outside one (where Lightning's ``trainer`` raises)."""
        try:
            return self.trainer
        except RuntimeError:
            return None

    def parallelize(self, model: nn.Module) -> nn.Module:
        """Apply the strategy's plan from ``configure_model``: float8 linears (``fp8``), expert parallelism, compiled
        blocks (``compile``), then FSDP2 (bf16 parameters under a bf16 precision; ``fsdp_reshard_after_forward``), as
        :func:`lit_dllm.parallel.parallelize` does."""
        if self.hparams.get("fp8") is not None:
            check_fp8_device(self.trainer.strategy.root_device)
        strategy = self.trainer.strategy
        compile = self.hparams.get("compile")
        if compile is None:
            compile = strategy.root_device.type == "cuda"
        reshard = self.hparams.get("fsdp_reshard_after_forward", True)
        reduce_dtype = self.hparams.get("fsdp_reduce_dtype", "float32")
        fsdp_settings = {"fsdp_reshard_after_forward=False": not reshard,
                         "fsdp_defer_gradient_sync=True": self.hparams.get("fsdp_defer_gradient_sync", False),
                         "fsdp_prefetch_next_step=True": self.hparams.get("fsdp_prefetch_next_step", False),
                         f"fsdp_reduce_dtype={reduce_dtype}": reduce_dtype != "float32"}
        unsharded = device_meshes(strategy)[0] is None
        for setting in (name for name, chosen in fsdp_settings.items() if chosen and unsharded):
            rank_zero_warn(f"{setting} does nothing under {type(strategy).__name__}: it tunes FSDP2, and this run "
                           "does not shard the model (use ModelParallelStrategy or ExpertParallelStrategy to shard, or "
                           "drop the setting).")
        return parallelize(model, strategy, param_dtype=self._fsdp_param_dtype(), compile=compile,
                           fp8=self.hparams.get("fp8"), reshard_after_forward=reshard,
                           reduce_dtype=REDUCE_DTYPES[reduce_dtype])

    def _fsdp_param_dtype(self) -> torch.dtype | None:
        """The dtype FSDP2 computes with the parameters in (a sharded run): bf16 under a bf16 precision, else theirs."""
        return torch.bfloat16 if "bf16" in str(self.trainer.precision) else None

    def prepare_batch(self, batch: dict, keys: torch.Tensor) -> dict:
        """What the loss needs besides the batch (noised ids, shifted targets, frozen-model features...)."""
        return {}

    def token_counts(self, batch: dict, prepared: dict) -> dict[str, torch.Tensor]:
        """Named local token counts that normalise the loss terms; the first entry is the primary one."""
        raise NotImplementedError

    def compute_loss(self, batch: dict, prepared: dict, denominators: dict[str, torch.Tensor]) -> StepLoss:
        """Loss of one micro-batch, each term divided by its (global) denominator."""
        raise NotImplementedError

    def token_sums(self, batch: dict, prepared: dict) -> dict[str, torch.Tensor]:
        """Named local token counts logged per optimizer step as ``train/<name>`` (summed, not normalised)."""
        return {"supervised_tokens": batch["loss_mask"].sum()}

    def generate_ids(self, prompts: list[torch.Tensor], max_new_tokens: int | None = None) -> list[torch.Tensor]:
        """Generated answer ids (without the prompt) for each 1-D prompt tensor."""
        raise NotImplementedError

    # ------------------------------------------------------------ model setup
    def configure_model(self) -> None:
        """Build the model once, freeze ``frozen_modules``, then shard it once (each step is idempotent)."""
        if self.model is None:
            self.model = self.build_model()
            if self.hparams.get("experts_implementation") is not None:
                set_experts_implementation(self.model, self.hparams.experts_implementation)
            if self.hparams.get("lora") is not None:
                self._apply_lora()
            for module in self.frozen():
                module.requires_grad_(False).eval()
        if not self._parallelized and self.attached_trainer is not None:
            self.model = self.parallelize(self.model)
            self._parallelized = True

    def on_fit_start(self) -> None:
        """Refuse FlexAttention where it cannot train (:func:`check_flex_training`); log what runs each MoE model's
        experts, and warn where, on CUDA, that is a loop over the experts."""
        check_flex_training(self.model, self.hparams.get("attn_implementation"), self.trainer.strategy.root_device)
        for line, loop in experts_kernels(self.model, self.trainer.strategy, self._fsdp_param_dtype()):
            if loop is None:
                rank_zero_info(line)
            else:
                rank_zero_warn(f"{line} loops over the experts on this GPU: {loop}")

    def on_train_start(self) -> None:
        self._precompute_fp8_scales()

    def on_train_batch_start(self, batch: dict, batch_idx: int) -> None:
        """Under ``fsdp_defer_gradient_sync``: every FSDP2 unit reduce-scatters its gradients and frees its gathered
        parameters after the backward of the window's last micro-batch only."""
        deferring = self.hparams.get("fsdp_defer_gradient_sync") and self.trainer.accumulate_grad_batches > 1
        if deferring and isinstance(self.model, FSDPModule):
            sync_gradients_in_backward(self.model, not compat.should_accumulate(self.trainer))
        self._steps_before_batch = self.trainer.global_step

    def on_train_batch_end(self, outputs, batch: dict, batch_idx: int) -> None:
        """Under ``fsdp_prefetch_next_step``, once the optimizer stepped: the next step's first FSDP2 units start
        their all-gather (their forward waits for it)."""
        if self._prefetching() and self.trainer.global_step != self._steps_before_batch:
            for unit in first_units(self.model):
                unit.unshard(async_op=True)

    def on_train_end(self) -> None:
        if self._prefetching():  # the prefetch after the last step
            for unit in first_units(self.model):
                unit.reshard()

    def _prefetching(self) -> bool:
        return bool(self.hparams.get("fsdp_prefetch_next_step")) and isinstance(self.model, FSDPModule)

    def on_validation_start(self) -> None:
        self._precompute_fp8_scales()

    def on_test_start(self) -> None:
        self._precompute_fp8_scales()

    def on_predict_start(self) -> None:
        self._precompute_fp8_scales()

    def _precompute_fp8_scales(self) -> None:
        """Under FSDP2's float8 all-gather: the gathered weights' scales, from the current weights (at the start of
        each stage, once a checkpoint is restored, and after each optimizer step)."""
        if uses_fp8_all_gather(self.hparams.get("fp8"), isinstance(self.model, FSDPModule)):
            precompute_fp8_scales(self.model)

    def lora_config(self):
        """The ``peft.LoraConfig`` of ``lora`` over :attr:`lora_defaults`."""
        return lora_config(self.hparams.lora, self.lora_defaults)

    def _apply_lora(self) -> None:
        """PEFT's adapters in the model's transformers backbone (refused inside a frozen module)."""
        name, backbone = hf_backbone(self.model)
        dotted = f"model.{name}" if name else "model"
        for frozen in self.hparams.frozen_modules or ():
            if dotted == frozen or dotted.startswith(f"{frozen}."):
                raise ValueError(
                    f"lora would adapt {dotted}, which is frozen (frozen_modules={self.hparams.frozen_modules}): its "
                    "adapters would never train. Drop lora for this module, or unfreeze it."
                )
        apply_lora(backbone, self.lora_config())

    def rebuilt(self, key: str) -> bool:
        """Whether the state-dict ``key`` stays out of checkpoints because ``build_model`` rebuilds it: frozen modules
        (unless ``save_frozen``), and with ``lora`` on a pretrained ``backbone.model`` every base weight, except in
        sharded (FSDP2) checkpoints, which torch's distributed loader reads key for key (each rank holds 1/N of the
        base)."""
        hp = self.hparams
        if not hp.save_frozen and key.startswith(tuple(f"{name}." for name in hp.frozen_modules or ())):
            return True
        if hp.get("lora") is None or hp.get("backbone", {}).get("model") is None or not key.startswith("model."):
            return False
        if isinstance(self.model, FSDPModule):
            return False
        if self._trained_keys is None:
            self._trained_keys = {n for n, p in self.named_parameters(remove_duplicate=False) if p.requires_grad}
        return key not in self._trained_keys

    def check_whole_model(self, what: str) -> None:
        """Refuse ``what`` (transformers' ``generate``, an export ...) on a model that FSDP2 has sharded: each rank
        holds a slice of every weight there."""
        if isinstance(self.model, FSDPModule):
            raise RuntimeError(
                f"{what} needs the whole model, but it is sharded (FSDP): set model.generation.val_generate_batches: 0 "
                "for sharded runs, and generate or export from a checkpoint loaded in one process."
            )

    @property
    def tokenizer(self):
        """The tokenizer named by ``hparams.tokenizer`` (loaded on first use)."""
        if self._tokenizer is None:
            hp = self.hparams
            self._tokenizer = load_tokenizer(
                hp.tokenizer, hp.get("mask_token"), hp.get("trust_remote_code", False), require_mask=False,
                gguf_file=hp.get("tokenizer_gguf_file"),
            )
        return self._tokenizer

    @tokenizer.setter
    def tokenizer(self, value) -> None:
        self._tokenizer, self._tokenizer_files = value, None

    def setup(self, stage: str) -> None:
        """Check the trainer's accumulation; take the data module's tokenizer (the one that made the batches) unless
        one was set explicitly."""
        accumulate = self.trainer.accumulate_grad_batches
        if stage == "fit" and accumulate < 1:
            raise ValueError(f"trainer.accumulate_grad_batches={accumulate} must be a positive number of micro-batches "
                             "per optimizer step (1: no accumulation).")
        datamodule = getattr(self.trainer, "datamodule", None)
        if self._tokenizer is None and getattr(datamodule, "tokenizer", None) is not None:
            self._tokenizer = datamodule.tokenizer
        mask_id = self.hparams.mask_token_id
        if self._tokenizer is not None and mask_id is not None and self._tokenizer.mask_token_id != mask_id:
            raise ValueError(
                f"The tokenizer's mask id ({self._tokenizer.mask_token_id}) differs from the model's mask_token_id="
                f"{self.hparams.mask_token_id}: build the module from the data module's ids (data.mask_token_id)."
            )

    @compat.lightning_classmethod  # as Lightning's own: refuses a call on an instance
    def load_from_checkpoint(cls, checkpoint_path, *args, **kwargs):
        """Lightning's ``load_from_checkpoint``, the checkpoint brought to today's layout as read
        (:func:`~lit_dllm.checkpointing.current_checkpoint`): a module class recorded by a path of the package's
        earlier layout (``lit_dllm.modules.dflash.DFlashModule``) is rebuilt as the class now at that place, unless
        ``_class_path`` is given, and the settings it holds flat (``gen_length``, ``model_config``...) go into their
        groups."""
        convert = partial(current_checkpoint, cls=cls, class_path=kwargs.get(compat.CLASS_PATH_KEY))
        with compat.converting_checkpoints(convert):
            return super().load_from_checkpoint(checkpoint_path, *args, **kwargs)  # super(TokenLossModule, cls)

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        if self._tokenizer_files is None:  # written once per tokenizer, not at every checkpoint
            self._tokenizer_files = tokenizer_files(self.tokenizer)
        checkpoint[TOKENIZER_KEY] = self._tokenizer_files
        for key in [key for key in checkpoint["state_dict"] if self.rebuilt(key)]:
            del checkpoint["state_dict"][key]

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        if self._tokenizer is None and TOKENIZER_KEY in checkpoint:
            self._tokenizer = tokenizer_from_files(checkpoint[TOKENIZER_KEY], self.hparams.get("trust_remote_code", False))
        saved = checkpoint.get("state_dict")  # what a checkpoint leaves out comes from build_model
        if saved is None:  # a sharded checkpoint: the strategy loaded the weights into the model already
            return
        saved.update({k: v for k, v in self.state_dict().items() if k not in saved and self.rebuilt(k)})

    # ------------------------------------------------------------------ frozen modules
    def frozen(self) -> list[nn.Module]:
        """The ``frozen_modules``, resolved (a clear error names a wrong dotted name)."""
        modules = []
        for name in self.hparams.frozen_modules or ():
            try:
                modules.append(self.get_submodule(name))
            except AttributeError as err:
                raise ValueError(
                    f"frozen_modules: no submodule {name!r} ({err}); names are dotted paths from the module, e.g. "
                    "'model.hf.model.embed_tokens'."
                ) from err
        return modules

    def train(self, mode: bool = True):
        """Switch train/eval mode; frozen modules stay in eval mode."""
        super().train(mode)
        if self.model is not None:
            for module in self.frozen():
                module.eval()
        return self

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
        """Per-example keys from (seed, global example index, epoch); training uses the batch's data epoch
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
        """Ranks that see different data (the strategy averages gradients over them)."""
        return data_parallel_size(self.trainer.strategy)

    def _dp_sum(self, value: torch.Tensor) -> torch.Tensor:
        """``value`` summed over the data-parallel group only (tensor- or expert-parallel peers share data)."""
        value = value.detach().float().clone()
        if dist.is_available() and dist.is_initialized() and self.data_parallel_size > 1:
            dist.all_reduce(value, group=data_parallel_group(self.trainer.strategy))
        return value

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        prepared = self.prepare_batch(batch, self.noise_keys(batch, batch.get("epoch", self.current_epoch)))
        counts = self.token_counts(batch, prepared)
        accumulate = self.trainer.accumulate_grad_batches
        if self._window is None:  # first micro-batch of this optimizer step
            estimates = (self._dp_sum(torch.stack([v.float() for v in counts.values()])) * accumulate).clamp_min(1.0)
            self._estimate = dict(zip(counts, estimates))
        step = self.compute_loss(batch, prepared, self._estimate)
        losses = {"loss": step.output.total_loss, "dllm_loss": step.output.dllm_loss, **step.extra}
        sums = {"count": next(iter(counts.values())), **losses, **self.token_sums(batch, prepared)}
        self._loss_names = set(losses)
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
        # one micro-batch: the estimate is the count, so the scale is exactly 1; more: scaled on the device (checking
        # for an exact 1 on the host would sync it, and leave it idle while the host launches the update)
        if self.trainer.accumulate_grad_batches > 1:
            scale_gradients_(self.parameters(), scale)
        # loss terms were normalised by the estimate c: rescale them by c / N; token counts are logged as they are
        logs = {f"train/{k}": v * scale if k in self._loss_names else v for k, v in sums.items()}
        logs["train/grad_norm"] = self._grad_norm()
        logs["train/lr"] = torch.tensor(optimizer.param_groups[0]["lr"])
        # logged before the finite check: where that check syncs (optimizers that cannot skip a step on the device),
        # the device would otherwise idle during Lightning's logging too
        self.log_dict(logs, on_step=True, on_epoch=False, rank_zero_only=True)
        self.log("loss", logs["train/loss"], prog_bar=True, logger=False, rank_zero_only=True)
        self._guard_finite(getattr(optimizer, "optimizer", optimizer), logs["train/loss"], logs["train/grad_norm"])

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None) -> None:
        """Lightning's step, then the host reads the finite check that the device ran before it (see
        :meth:`_guard_finite`); an override must call this one."""
        try:
            super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)
        finally:
            compat.set_found_inf(getattr(optimizer, "optimizer", optimizer), None)
        self._precompute_fp8_scales()
        if self._finite_verdict is not None:
            (finite, arrived), (loss, grad_norm) = self._finite_verdict
            self._finite_verdict = None
            if arrived is not None:
                arrived.synchronize()  # waits for the backward only: the queued update keeps the device busy
            if not finite:
                self._raise_non_finite(loss, grad_norm)

    def _grad_norm(self) -> torch.Tensor:
        """L2 norm of all gradients before clipping, whole across shards and the dense and expert meshes."""
        return grad_norm(self.parameters()).to(self.device)

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None) -> None:
        """Norm clipping across the dense and expert meshes (torch's own cannot mix them); value clipping as usual."""
        if gradient_clip_val and gradient_clip_algorithm in (None, "norm"):
            clip_grad_norm_([p for group in optimizer.param_groups for p in group["params"]], gradient_clip_val)
        else:
            super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)

    def _guard_finite(self, optimizer, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
        """Stop before a non-finite loss or gradient reaches the weights (fp16's loss scaler handles the gradients).

        An optimizer that can skip its own step on the device (torch's fused Adam, AdamW and SGD:
        :func:`lit_dllm.compat.can_skip_step`) gets the verdict as ``found_inf``, as a loss scaler would give it, and
        the host reads the verdict once the step is queued (:meth:`optimizer_step`): the device runs on meanwhile, where
        checking here would leave it idle while the host launches the update. Other optimizers are checked here."""
        scaler = getattr(self.trainer.precision_plugin, "scaler", None)
        finite = torch.isfinite(loss) & (torch.isfinite(grad_norm) | (scaler is not None))
        if scaler is None and compat.can_skip_step(optimizer):
            compat.set_found_inf(optimizer, (~finite).float())
            self._finite_verdict = _copy_to_host(finite), (loss, grad_norm)
        elif not finite:
            self._raise_non_finite(loss, grad_norm)

    def _raise_non_finite(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
        callback = self.trainer.checkpoint_callback
        last = getattr(callback, "last_model_path", "") or "none saved yet"
        raise FloatingPointError(
            f"Non-finite training {'loss' if not torch.isfinite(loss) else 'gradient norm'} (loss {float(loss)}, "
            f"gradient norm {float(grad_norm)}) at optimizer step {self.global_step + 1} (epoch {self.current_epoch}). "
            f"Stopped before this update, so the weights and the last checkpoint ({last}) are from before it. "
            f"Lower the learning rate (lr={self.hparams.lr}), keep gradient clipping on, or check the data."
        )

    # ------------------------------------------------------------ export
    def export_config(self) -> dict[str, Any]:
        """Entries the exported transformers config records besides the backbone's own (a family's sampler, ids)."""
        return {}

    def save_pretrained(self, path: str | os.PathLike, merge: bool = True) -> None:
        """Write the transformers backbone and the tokenizer to ``path`` for the family's ``from_pretrained``
        (``AutoModelForCausalLM`` for MDLM, hybrid and CausalLM; ``DiffusionGemmaForBlockDiffusion`` for Gemma). With
        ``lora``: the adapters merged into the weights (``merge=True``, a plain transformers folder), or PEFT's
        adapter folder (``merge=False``, for ``peft.PeftModel.from_pretrained(base, path)``). Sharded (FSDP2, EP):
        call it on every rank; rank 0 writes the gathered weights. From a trained run:
        ``<Module>.load_from_checkpoint(ckpt).save_pretrained(path)``."""
        if self.model is None:
            self.configure_model()
        lora = self.hparams.get("lora")
        if not merge and lora is None:
            raise ValueError("merge=False writes LoRA adapters, but this module has no lora: use merge=True.")
        hf_backbone(self.model)[1].config.update(self.export_config())
        write = None if lora is None else partial(save_lora, config=self.lora_config(), merge=merge)
        strategy = getattr(self.attached_trainer, "strategy", None)
        export_hf(self.model, strategy, path, self.tokenizer, write)

    # ------------------------------------------------------------ validation
    accuracy_name = "accuracy"
    """Name of the evaluation token accuracy (``<stage>/<name>``)."""

    def stage_metrics(self) -> nn.ModuleDict:
        """Metrics of one evaluation stage (val or test); subclasses may add entries."""
        return nn.ModuleDict({"loss": MeanMetric(), self.accuracy_name: MeanMetric()})

    def evaluate(self, batch: dict, batch_idx: int, stage: str) -> None:
        """The family's evaluation loss (``dllm_loss``, per primary token) and token accuracy, under fixed
        (validation-keyed) randomness."""
        metrics, accuracy = self.eval_metrics[stage], self.accuracy_name
        prepared = self.prepare_batch(batch, self.noise_keys(batch, VALIDATION_EPOCH))
        counts = {k: v.float().clamp_min(1.0) for k, v in self.token_counts(batch, prepared).items()}
        step = self.compute_loss(batch, prepared, counts)
        metrics["loss"].update(step.output.dllm_loss, weight=next(iter(counts.values())))
        if step.num_scored is not None and step.num_scored > 0:
            metrics[accuracy].update(step.num_correct / step.num_scored, weight=step.num_scored)
        self.log(f"{stage}/loss", metrics["loss"], prog_bar=stage == "val")
        self.log(f"{stage}/{accuracy}", metrics[accuracy])

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        self.evaluate(batch, batch_idx, "val")

    def test_step(self, batch: dict, batch_idx: int) -> None:
        self.evaluate(batch, batch_idx, "test")

    # ------------------------------------------------------------ throughput
    def training_flops(self, batch: dict) -> float:
        """Model FLOPs of one training micro-batch, forward and backward (the MFU of
        :class:`~lit_dllm.callbacks.ThroughputMonitor`): :func:`lit_dllm.throughput.transformer_flops` of the model
        over every position of the padded batch (6 per trained matmul parameter per token, 2 per frozen one, 4 under
        ``lora``, whose backward passes through the frozen base, plus attention). Families whose step runs other passes
        override it."""
        frozen_flops = 2 if self.hparams.get("lora") is None else 4
        return transformer_flops(self.model, self.model.hf.config.get_text_config(), *batch["input_ids"].shape,
                                 frozen_flops=frozen_flops)


def _copy_to_host(flag: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """``flag`` copied to pinned host memory without waiting, and the event that marks its arrival (CPU: as is)."""
    if flag.device.type != "cuda":
        return flag, None
    host = torch.empty(flag.shape, dtype=flag.dtype, pin_memory=True).copy_(flag, non_blocking=True)
    arrived = torch.cuda.Event()
    arrived.record()
    return host, arrived


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
