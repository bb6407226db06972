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
divided by ``c``, the first micro-batch's count summed over the data-parallel ranks, times
``accumulate_grad_batches`` (identical on every rank); once the window closes, :meth:`on_before_optimizer_step`
all-reduces the true count ``N`` and multiplies the gradients by ``c / N``. With one micro-batch per step
``c == N`` and nothing is rescaled. Losses with a second denominator (the hybrid AR term) are exact whenever
``accumulate_grad_batches == 1``; with accumulation, that term's denominator is the first micro-batch's estimate.

Context parallelism (:mod:`lit_dllm.context_parallel`): :meth:`prepare_batch` draws on the whole rows, then
:meth:`shard_sequences` gives each rank its shard of the positions; the counts and sums above then run over data x
context (:func:`~lit_dllm.meshes.loss_group`), so the normalisation is the same.

Settings. What is learned is the module's: each class records its own arguments (:meth:`save_settings`). How to run
is the strategy's: ``configure_model`` applies the converters (LoRA, then fp8) and the strategy's plan.

Frozen modules (``frozen_modules``: dotted names of submodules, e.g. a DFlash target) are kept out of the
optimizer, in ``eval()`` mode and without gradients, and out of checkpoints unless ``save_frozen``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

from lit_dllm import compat
from lit_dllm.checkpointing import load_sharded_checkpoint
from lit_dllm.converters import ModelConverter
from lit_dllm.core.evaluation import EVAL_STAGES, EvaluationMixin
from lit_dllm.core.export import ExportMixin
from lit_dllm.core.finite import FiniteCheck
from lit_dllm.core.frozen import FrozenWeightsMixin
from lit_dllm.core.optim import build_optimization
from lit_dllm.core.tokenizers import TokenizerMixin
from lit_dllm.upgrade import current_checkpoint, group_flat_settings
from lit_dllm.data.batch import is_packed, real_tokens
from lit_dllm.noise.keys import example_keys
from lit_dllm.data.tokenizer import check_mask_token_id
from lit_dllm.hub.hf import check_flex_training
from lit_dllm.lora import LoRAConverter, lora_config
from lit_dllm.losses import DLLMLossOutput
from lit_dllm.meshes import clip_grad_norm_, grad_norm, loss_group, loss_group_size, scale_gradients_
from lit_dllm.settings import Backbone, Optimization, Settings, Tokenizer, settings_group
from lit_dllm.strategies import parallelize_model, plan, strategy_converters
from lit_dllm.throughput import packed_transformer_flops, transformer_flops


@dataclass
class StepLoss:
    """What :meth:`TokenLossModule.compute_loss` returns: the loss, optional accuracy counts, named extra loss
    terms (already normalised, logged as ``train/<name>``) and, in evaluation, the ``(correct, scored)`` counts of
    the named parts of the scored tokens that the family's ``accuracy_by`` lists."""

    output: DLLMLossOutput
    num_correct: torch.Tensor | None = None
    num_scored: torch.Tensor | None = None
    extra: dict[str, torch.Tensor] = field(default_factory=dict)
    accuracy_by: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


class TokenLossModule(EvaluationMixin, FrozenWeightsMixin, TokenizerMixin, ExportMixin, L.LightningModule):
    """Base LightningModule of every family; see the module docstring for the hooks.

    Args:
        vocab_size, mask_token_id, pad_token_id, eos_token_id: linked from the data module (``mask_token_id`` is
            only used by families that mask, and must differ from the pad and eos ids).
        tokenizer_settings: the tokenizer (:class:`~lit_dllm.settings.Tokenizer`), linked from the data module.
        noise_seed: base of every random key; an example's draws are a function of (noise_seed, index, epoch).
        optimization: the optimiser and its schedule (:class:`~lit_dllm.settings.Optimization`).
        frozen_modules: dotted names of submodules (e.g. ``"model.hf.model.embed_tokens"``) to freeze.
        save_frozen: keep frozen modules' weights in checkpoints (off: they are rebuilt by ``build_model``).
        lora: LoRA fine-tuning through PEFT (:mod:`lit_dllm.lora`): ``peft.LoraConfig`` settings (``r``,
            ``lora_alpha``, ``lora_dropout``, ``target_modules``, ...) over the family's :attr:`lora_defaults`; ``{}``
            takes the defaults. Only the adapters train; on a pretrained ``backbone.model`` checkpoints hold the
            adapters alone (the base is rebuilt from it). None: full fine-tuning.
        **flat: settings of the earlier flat layout, this class's and its family's (``lr=...``, ``gen_length=...``,
            ``tokenizer="gpt2"``), moved into their group with a ``DeprecationWarning``; run settings (``compile``,
            ``fp8``, ``fsdp_*``...) are refused with their place on the strategy
            (:func:`lit_dllm.upgrade.group_flat_settings`; removed in 0.3).
    """

    lora_defaults: dict = {"r": 16, "lora_alpha": 32, "lora_dropout": 0.0, "target_modules": "all-linear"}
    """LoRA settings a family starts from (every linear layer of the blocks; PEFT leaves the LM head out)."""

    backbone: Backbone | None = None
    """A family's transformers stack, where it has one group for it (``build_model`` reads it)."""

    trained_attention: str | None = None
    """The attention the trained model runs where its config does not say (DFlash's draft switches it by mode)."""

    takes_context_parallel: bool = False
    """Whether the family's step runs on shards of the rows' positions (context parallelism): its model is a
    :class:`~lit_dllm.core.backbone.CausalLM` and what its loss reads of a row is drawn whole in :meth:`prepare_batch`
    (noise, shifted targets), so cutting it along the positions gives each rank its share (:meth:`shard_sequences`)."""

    def __init__(
        self,
        vocab_size: int,
        mask_token_id: int | None = None,
        pad_token_id: int = 0,
        eos_token_id: int | None = None,
        tokenizer_settings: Tokenizer = Tokenizer(),
        noise_seed: int = 42,
        optimization: Optimization = Optimization(),
        frozen_modules: list[str] | None = None,
        save_frozen: bool = False,
        lora: dict[str, Any] | None = None,
        **flat: Any,
    ) -> None:
        super().__init__()
        check_mask_token_id(mask_token_id, vocab_size, self.mask_needed_for, pad=pad_token_id, eos=eos_token_id)
        self.tokenizer_settings = settings_group("tokenizer_settings", Tokenizer, tokenizer_settings)
        self.optimization = settings_group("optimization", Optimization, optimization)
        group_flat_settings(self, flat)  # the earlier flat settings, into their groups (lit_dllm.upgrade)
        if lora is not None:
            lora_config(lora, self.lora_defaults)  # unknown or bad settings fail here, before any model is built
        self.vocab_size, self.mask_token_id, self.pad_token_id, self.eos_token_id = (vocab_size, mask_token_id,
                                                                                     pad_token_id, eos_token_id)
        self.noise_seed, self.frozen_modules, self.save_frozen, self.lora = (noise_seed, list(frozen_modules or ()),
                                                                             save_frozen, lora)
        self.save_settings(vocab_size=vocab_size, mask_token_id=mask_token_id, pad_token_id=pad_token_id,
                           eos_token_id=eos_token_id, tokenizer_settings=self.tokenizer_settings, noise_seed=noise_seed,
                           optimization=self.optimization, frozen_modules=self.frozen_modules, save_frozen=save_frozen,
                           lora=lora)
        self.model: nn.Module | None = None
        self.converters: list[ModelConverter] = []
        self._window: dict[str, torch.Tensor] | None = None
        self._estimate: dict[str, torch.Tensor] = {}
        self._loss_names: set[str] = set()
        self._parallelized = False
        self._finite = FiniteCheck()
        self.eval_metrics = nn.ModuleDict({stage: self.stage_metrics() for stage in EVAL_STAGES})

    def save_settings(self, **settings: Any) -> None:
        """Record ``settings`` (groups as dicts) in the hyper-parameters, beside those recorded before: what checkpoints
        hold, ``load_from_checkpoint`` passes back and the logger shows. Each class of a family records its own
        arguments, explicitly."""
        saved = {name: value.saved() if isinstance(value, Settings) else value for name, value in settings.items()}
        self.save_hyperparameters({**compat.cli_records(), **self.hparams, **saved})

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
        """Named local token counts logged per optimizer step as ``train/<name>`` (summed, not normalised): the supervised
        tokens, and the real ones (the examples' own, no padding or block fill)."""
        return {"supervised_tokens": batch["loss_mask"].sum(), "real_tokens": real_tokens(batch).sum()}

    def generate_ids(self, prompts: list[torch.Tensor], max_new_tokens: int | None = None) -> list[torch.Tensor]:
        """Generated answer ids (without the prompt) for each 1-D prompt tensor."""
        raise NotImplementedError

    def packing_problem(self, fill_block_size: int | None) -> str | None:
        """Why this module cannot train on packed rows (:mod:`lit_dllm.data.packing`) whose documents are filled to
        multiples of ``fill_block_size`` (the data's ``pad_block_size``), or None when it can. A family that packs
        attends within documents (:func:`~lit_dllm.data.batch.document_inputs`) and draws its noise per document;
        the data module refuses ``pack`` with this reason."""
        return None

    # ------------------------------------------------------------ model setup
    def configure_model(self) -> None:
        """Build the model once, convert it (LoRA), freeze ``frozen_modules``; under a trainer, once: the strategy's
        converters (fp8) and plan (:func:`~lit_dllm.strategies.parallelize_model`)."""
        if self.model is None:
            self.model = self.build_model()
            self.converters = [LoRAConverter(self.lora_config(), self.frozen_modules)] if self.lora is not None else []
            for converter in self.converters:
                converter.convert(self.model)
            for module in self.frozen():
                module.requires_grad_(False).eval()
        trainer = self.attached_trainer
        if not self._parallelized and trainer is not None:
            self.check_context_parallel(plan(trainer.strategy).context_parallel_size)
            converters = strategy_converters(trainer.strategy)
            for converter in converters:
                converter.convert(self.model)
            self.model = parallelize_model(self.model, trainer)
            self.converters += converters
            self._parallelized = True

    def check_context_parallel(self, size: int) -> None:
        """A ValueError naming the fix, before any compute, where this module cannot run on ``size`` shards of each
        row."""
        if size > 1 and not self.takes_context_parallel:
            raise ValueError(f"context_parallel_size={size}, but {type(self).__name__} does not take shards of the "
                             "rows (MDLM, hybrid, CausalLM and DFlash do; docs/scale-out.md says why the others do "
                             "not): set context_parallel_size: 1.")

    def shard_sequences(self, batch: dict, prepared: dict) -> tuple[dict, dict]:
        """Under context parallelism, this rank's shard of every row: each ``[B, L, ...]`` tensor of the batch and of
        what :meth:`prepare_batch` drew for the whole rows (noise, shifted targets) cut along the positions, and the
        ``input_lengths`` of unpacked rows as lengths within the shard. Unchanged otherwise."""
        context = getattr(self.model, "context_parallel", None)
        if context is None:
            return batch, prepared
        shape = batch["input_ids"].shape
        width = context.shard_length(shape[1])
        context.check_rows(is_packed(batch))

        def cut(values: dict) -> dict:
            return {key: context.take(value) if torch.is_tensor(value) and value.shape[:2] == shape else value
                    for key, value in values.items()}

        sharded = cut(batch)
        if not is_packed(batch) and "input_lengths" in batch:
            sharded["input_lengths"] = (batch["input_lengths"] - context.span(width).start).clamp(0, width)
        return sharded, cut(prepared)

    def on_fit_start(self) -> None:
        """Refuse FlexAttention where it cannot train (:func:`check_flex_training`)."""
        check_flex_training(self.model, self.trained_attention, self.trainer.strategy.root_device)

    def lora_config(self):
        """The ``peft.LoraConfig`` of ``lora`` over :attr:`lora_defaults` (None without LoRA)."""
        return None if self.lora is None else lora_config(self.lora, self.lora_defaults)

    @compat.lightning_classmethod  # as Lightning's own: refuses a call on an instance
    def load_from_checkpoint(cls, checkpoint_path, *args, **kwargs):
        """Lightning's ``load_from_checkpoint``, the checkpoint brought to today's layout as read
        (:func:`~lit_dllm.upgrade.current_checkpoint`): a module class recorded by a path of the package's
        earlier layout is rebuilt as the class now at that place, unless ``_class_path`` is given, and its settings go
        into today's groups. A sharded (FSDP2) checkpoint folder is gathered whole in this process
        (:func:`~lit_dllm.checkpointing.load_sharded_checkpoint`)."""

        convert = partial(current_checkpoint, cls=cls, class_path=kwargs.get(compat.CLASS_PATH_KEY))
        with compat.reading_folders(load_sharded_checkpoint), compat.converting_checkpoints(convert):
            return super().load_from_checkpoint(checkpoint_path, *args, **kwargs)  # super(TokenLossModule, cls)

    def check_whole_model(self, what: str) -> None:
        """Refuse ``what`` (transformers' ``generate``, an export ...) on a model that FSDP2 has sharded: each rank
        holds a slice of every weight there."""
        if isinstance(self.model, FSDPModule):
            raise RuntimeError(
                f"{what} needs the whole model, but it is sharded (FSDP): set model.init_args.generation.val_generate_batches: 0 "
                "for sharded runs, and generate or export from a checkpoint loaded in one process."
            )

    def setup(self, stage: str) -> None:
        """Check the trainer's accumulation, then take the data module's tokenizer."""
        accumulate = self.trainer.accumulate_grad_batches
        if stage == "fit" and accumulate < 1:
            raise ValueError(f"trainer.accumulate_grad_batches={accumulate} must be a positive number of micro-batches "
                             "per optimizer step (1: no accumulation).")
        super().setup(stage)

    def configure_optimizers(self):
        settings = self.optimization
        return build_optimization(
            self.model, int(self.trainer.estimated_stepping_batches), lr=settings.lr,
            weight_decay=settings.weight_decay, betas=tuple(settings.betas), warmup=settings.warmup,
            min_lr_ratio=settings.min_lr_ratio, optimizer=settings.optimizer,
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
        return example_keys(self.noise_seed, batch["example_index"], epoch)

    # -------------------------------------------------------------- training
    @property
    def loss_ranks(self) -> int:
        """Ranks whose tokens a step's loss sums: data x context (:func:`~lit_dllm.meshes.loss_group`); the
        strategy averages the gradients over them."""
        return loss_group_size(self.trainer.strategy)

    def _group_sum(self, value: torch.Tensor) -> torch.Tensor:
        """``value`` summed over the ranks of the step's loss (data x context; tensor- or expert-parallel peers share
        data)."""
        value = value.detach().float().clone()
        if dist.is_available() and dist.is_initialized() and self.loss_ranks > 1:
            dist.all_reduce(value, group=loss_group(self.trainer.strategy))
        return value

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        prepared = self.prepare_batch(batch, self.noise_keys(batch, batch.get("epoch", self.current_epoch)))
        batch, prepared = self.shard_sequences(batch, prepared)
        counts = self.token_counts(batch, prepared)
        accumulate = self.trainer.accumulate_grad_batches
        if self._window is None:  # first micro-batch of this optimizer step
            estimates = (self._group_sum(torch.stack([v.float() for v in counts.values()])) * accumulate).clamp_min(1.0)
            self._estimate = dict(zip(counts, estimates))
        step = self.compute_loss(batch, prepared, self._estimate)
        losses = {"loss": step.output.total_loss, "dllm_loss": step.output.dllm_loss, **step.extra}
        sums = {"count": next(iter(counts.values())), **losses, **self.token_sums(batch, prepared)}
        self._loss_names = set(losses)
        sums = {name: value.detach().float() for name, value in sums.items()}
        self._window = sums if self._window is None else {k: self._window[k] + v for k, v in sums.items()}
        # Lightning divides by `accumulate` and DDP/FSDP average over ranks: undo both.
        return step.output.total_loss * (accumulate * self.loss_ranks)

    def on_before_optimizer_step(self, optimizer) -> None:
        if self._window is None:
            return
        names = list(self._window)
        sums = dict(zip(names, self._group_sum(torch.stack([self._window[k] for k in names]))))  # one all-reduce
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
        self._finite.check(self.trainer, getattr(optimizer, "optimizer", optimizer), logs["train/loss"],
                           logs["train/grad_norm"], self.optimization.lr)

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None) -> None:
        """Lightning's step through :meth:`run_optimizer_step`; an override must call this one."""
        self.run_optimizer_step(lambda: super(TokenLossModule, self).optimizer_step(epoch, batch_idx, optimizer,
                                                                                  optimizer_closure), optimizer)

    def run_optimizer_step(self, step, optimizer) -> None:
        """The one road of every optimizer step (automatic, and the RL modules' manual ones): ``step()`` (whose
        ``on_before_optimizer_step`` ran the finite check), then the converters'
        :meth:`~lit_dllm.converters.ModelConverter.after_optimizer_step`, then the host reads the finite check that the
        device ran before the step (:class:`~lit_dllm.core.finite.FiniteCheck`)."""
        try:
            step()
        finally:
            compat.set_found_inf(getattr(optimizer, "optimizer", optimizer), None)
        for converter in self.converters:
            converter.after_optimizer_step(self.model)
        self._finite.settle(self.trainer)

    def _grad_norm(self) -> torch.Tensor:
        """L2 norm of all gradients before clipping, whole across shards and the dense and expert meshes."""
        return grad_norm(self.parameters()).to(self.device)

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None) -> None:
        """Norm clipping across the dense and expert meshes (torch's own cannot mix them); value clipping as usual."""
        if gradient_clip_val and gradient_clip_algorithm in (None, "norm"):
            clip_grad_norm_([p for group in optimizer.param_groups for p in group["params"]], gradient_clip_val)
        else:
            super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)

    # ------------------------------------------------------------ throughput
    def training_flops(self, batch: dict) -> float:
        """Model FLOPs of one training micro-batch, forward and backward (the MFU of
        :class:`~lit_dllm.callbacks.ThroughputMonitor`): :func:`lit_dllm.throughput.transformer_flops` of the model
        over every position of the padded batch (6 per trained matmul parameter per token, 2 per frozen one, 4 under
        ``lora``, whose backward passes through the frozen base, plus attention). Families whose step runs other passes
        override it. Packed rows count their documents only (:func:`~lit_dllm.throughput.packed_transformer_flops`)."""
        frozen_flops = 2 if self.lora is None else 4
        config = self.model.hf.config.get_text_config()
        if is_packed(batch):
            return packed_transformer_flops(self.model, config, batch["document_spans"], frozen_flops=frozen_flops)
        return transformer_flops(self.model, config, *batch["input_ids"].shape, frozen_flops=frozen_flops)

    tiny_config: str | None = None
    """The family's offline CPU demo config (``configs/<name>_tiny.yaml``) that trains this class: the CLI's help lists
    every class ``lit_dllm`` exports that declares its own (:func:`lit_dllm.cli.models`)."""
