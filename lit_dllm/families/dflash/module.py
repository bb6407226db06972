"""DFlash draft training (docs/DESIGN.md §10): a block-diffusion draft learns to propose the next ``block_size - 1``
tokens of a frozen target, for lossless speculative decoding.

Per micro-batch: the frozen target runs once over each row (its features: the outputs of ``target_layer_ids``);
``num_anchors`` blocks per row are anchored on response tokens (keyed by example, so the same whatever the batch
size, accumulation or data-parallel split); each block ``[x_a, MASK, ...]`` is denoised by the draft against the
target's features strictly before its anchor, and its predictions of ``x_{a+1} .. x_{a+bs-1}`` are scored by the
target's LM head with the position decay ``exp(-(k-1)/γ)``. The loss is the decay-weighted mean over the optimizer
step's scored targets on every data-parallel rank: its denominator is the global sum of the weights
(docs/DESIGN.md §14 (f): the reference divides the weighted sum by an unweighted count).

Every step logs ``train/loss``, ``train/draft_accuracy``, the accuracy per block offset ``train/acc_k{k}`` and the
simulated accept length ``train/accept_len`` (leading correct predictions per block, plus one). Validation scores the
same loss on fixed anchors and, on its first ``val_generate_batches`` batches, decodes every prompt with the target
alone and with transformers' own speculative decoding (``target.generate(assistant_model=draft,
speculation_type="dflash")``, batch 1): ``val/accept_len`` is the real acceptance length τ (tokens committed per
target verification), ``val/greedy_identical`` the fraction of prompts whose greedy speculative output equals the
target's own greedy output (it must be 1: the decoding is lossless), ``val/accept_len_sampled`` τ when sampling at
``val_temperature``, and ``val/exact_match`` the speculative answers' exact match (the decodes:
:mod:`lit_dllm.families.dflash.decoding`).

Packed rows (:class:`~lit_dllm.data.packing.PackedCollator`) train as their documents would alone: the loss and
gradients are the sum over the documents, each run as a row of its own with the same key. The target attends within
each document; each document draws its own ``num_anchors`` blocks, whose context, inputs and targets stay inside it
(see :mod:`lit_dllm.families.dflash.blocks` and :mod:`lit_dllm.families.dflash.model`). Validation and generation see
unpacked rows.

Exports: :meth:`DFlashModule.save_pretrained` (a ``MuseGlimmerAssistantModel`` folder that ``AutoModel`` reloads and
transformers' ``generate`` serves as it is) and :meth:`DFlashModule.export_zlab` (z-lab's ``DFlashDraftModel``
layout, for SGLang / vLLM-style servers).
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torchmetrics import MeanMetric
from transformers import AutoModel, MuseGlimmerAssistantModel

from lit_dllm.core.export import check_export_path, export_folder
from lit_dllm.core.generation import GenerationMixin
from lit_dllm.hub.hf import RANDOM_INIT, load_causal_lm, require_exactly_one
from lit_dllm.upgrade import flat_target
from lit_dllm.settings import CausalBackbone, Generation, check_drawable, settings_group
from lit_dllm.core.token_loss import StepLoss, TokenLossModule
from lit_dllm.data.batch import document_inputs, is_packed, real_tokens
from lit_dllm.data.packing import DocumentView
from lit_dllm.data.tokenizer import load_tokenizer, unused_special_tokens
from lit_dllm.families.dflash.blocks import (
    LOSS_TYPES,
    BlockBatch,
    anchor_candidates,
    build_blocks,
    default_loss_gamma,
    place_blocks,
    sample_anchors,
    sample_prefix_lengths,
    shard_blocks,
)
from lit_dllm.families.dflash.checkpoints import export_zlab, identity_differences, load_draft, target_identity
from lit_dllm.families.dflash.decoding import SpeculativeDecoding
from lit_dllm.families.dflash.model import (
    ATTENTION,
    DFlashDraft,
    check_target_layer_ids,
    default_target_layer_ids,
    draft_config,
)
from lit_dllm.losses import DLLMLossOutput
from lit_dllm.parallel import on_rank_zero
from lit_dllm.throughput import attention_flops, matmul_params

TARGET = "model.target"
"""The frozen target's dotted name: always in ``frozen_modules`` (out of the optimizer and the checkpoints)."""

TARGET_IDENTITY_KEY = "lit_dllm_dflash_target"
"""Checkpoint key of the target's identity (:func:`~lit_dllm.families.dflash.checkpoints.target_identity`)."""


@dataclass(frozen=True)
class DFlashGeneration(Generation):
    """:class:`~lit_dllm.settings.Generation` of a DFlash draft, whose validation also samples.

    Attributes:
        val_temperature: temperature of the sampled acceptance length τ in validation (0: skip it).
        val_trace: each validation / test pass also draws the accepted lengths of its first batch's greedy
            verification steps into TensorBoard (``<stage>/acceptance``: a histogram and the acceptance per block
            position, :func:`~lit_dllm.families.dflash.acceptance.acceptance_figure`; ``<stage>/accepted_lengths``:
            the histogram panel); needs matplotlib (the ``notebooks`` extra).
    """

    val_temperature: float = 1.0
    val_trace: bool = False

    def check(self) -> None:
        super().check()
        check_drawable(self)
        if self.val_temperature < 0:
            raise ValueError(f"val_temperature={self.val_temperature} must be >= 0 (0: no sampled acceptance length).")


class DFlashModule(SpeculativeDecoding, GenerationMixin, TokenLossModule):
    """DFlash draft training against a frozen target; see the module docstring.

    Args:
        vocab_size, mask_token_id, pad_token_id, eos_token_id, tokenizer: linked from the data module; the mask id
            (required) is the draft's noise token and must lie inside the target's vocabulary.
        target: the frozen target causal LM (:class:`~lit_dllm.settings.CausalBackbone`): exactly one of ``model``,
            a hub id or local path (e.g. a folder written by ``CausalLMModule.save_pretrained``; ``gguf_file`` names a
            GGUF file in it), or ``model_config`` for a randomly initialised target (seeded by ``noise_seed``, so a
            resumed run rebuilds the same one; ``vocab_size``, ``pad_token_id`` and ``eos_token_id`` default to the
            data module's). ``torch_dtype`` (e.g. ``bfloat16``) is the frozen target's; the draft's weights stay fp32
            under the trainer's precision. The target attends with its ``attn_implementation`` (``sdpa`` where it is
            ``flex_attention``: it only runs forward).
        draft: local path of a trained draft to continue from: a ``save_pretrained`` folder or a z-lab export (never
            a GGUF: llama.cpp has no DFlash draft architecture).
        draft_config: for a new (random-init) draft, ``MuseGlimmerAssistantConfig`` overrides of the target-shaped
            default (5 layers, the target's heads / MLP width / RoPE / norm eps), e.g. ``num_hidden_layers: 1``.
        block_size: tokens per block (the anchor plus ``block_size - 1`` proposals).
        num_anchors: blocks per row; in packed rows, per document (a packed row of ``M`` documents holds ``M`` times
            as many), so that a document draws the same blocks packed or alone.
        overlap_anchors: anchors drawn independently with replacement (default), or disjoint blocks per row.
        target_layer_ids: target decoder layers whose outputs are the draft's context (default: docs/DESIGN.md §10.1's
            formula for as many layers as the draft has).
        loss_type: ``dflash`` (block input ``[x_a, MASK, ...]``) or ``variable_prefix`` (the first ``ℓ`` block tokens
            are real, ``ℓ`` drawn per block ∝ ``prefix_weight_base ** ℓ``; offsets ``>= ℓ`` are scored with weight
            ``exp(-(k - ℓ)/γ)``).
        loss_decay_gamma: γ of the position decay (None: 7 / 5 / 4 for block sizes 16 / 10 / 8, else
            ``max(2, block_size / 2)``).
        attn_implementation: the draft's attention: ``sdpa``, ``eager`` or ``flex_attention`` (GPU: a block-sparse
            mask that skips the masked tiles). Flex is for training only: in eval mode (validation, generation) the
            draft attends with ``sdpa``, as evaluating through flex on a GPU gave wrong drafts.
        loss_chunk_size: rows per chunk of the fused LM head + cross-entropy (no ``[B, T, V]`` logits).
        generation: answers and their scoring (:class:`DFlashGeneration`); ``temperature`` > 0 samples
            (speculative sampling stays lossless).
        Other arguments: see :class:`TokenLossModule`.
    """

    accuracy_name = "draft_accuracy"
    mask_needed_for = "DFlash blocks are [anchor, MASK, ...] (its id must be inside the target's vocabulary)"
    takes_context_parallel = True
    """Under context parallelism the target runs on shards of the positions, the draft on a share of the blocks."""

    def __init__(
        self,
        vocab_size: int,
        target: CausalBackbone = CausalBackbone(),
        draft: str | None = None,
        draft_config: dict[str, Any] | None = None,
        block_size: int = 16,
        num_anchors: int = 512,
        overlap_anchors: bool = True,
        target_layer_ids: list[int] | None = None,
        loss_type: str = "dflash",
        loss_decay_gamma: float | None = None,
        prefix_weight_base: float = 0.9,
        attn_implementation: str = "sdpa",
        loss_chunk_size: int = 1024,
        generation: DFlashGeneration = DFlashGeneration(),
        **kwargs: Any,
    ) -> None:
        self.target = settings_group("target", CausalBackbone, flat_target(target, kwargs))  # earlier: upgrade
        self.generation = settings_group("generation", DFlashGeneration, generation)
        frozen = list(kwargs.pop("frozen_modules", None) or [])
        frozen = frozen if TARGET in frozen else [TARGET, *frozen]  # the target stays frozen, whatever a config says
        super().__init__(vocab_size, frozen_modules=frozen, **kwargs)
        require_exactly_one(
            ("target.model", self.target.model, "a hub id or local path of the target causal LM, e.g. a "
             "CausalLMModule.save_pretrained folder"),
            ("target.model_config", self.target.model_config, RANDOM_INIT),
        )
        if draft is not None and draft_config is not None:
            raise ValueError("Give draft (a trained draft's folder) or draft_config (a new draft's settings), not both.")
        if block_size < 2:
            raise ValueError(f"block_size={block_size} must be >= 2 (the anchor plus at least one proposal).")
        if num_anchors < 1:
            raise ValueError(f"num_anchors={num_anchors} must be >= 1 (blocks per row).")
        if loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type={loss_type!r}; use one of {LOSS_TYPES}.")
        if prefix_weight_base <= 0:
            raise ValueError(f"prefix_weight_base={prefix_weight_base} must be > 0.")
        if loss_decay_gamma is not None and loss_decay_gamma <= 0:
            raise ValueError(f"loss_decay_gamma={loss_decay_gamma} must be > 0 (None: the default for the block size).")
        if attn_implementation not in ATTENTION:
            raise ValueError(f"attn_implementation={attn_implementation!r}; use one of {ATTENTION}.")
        if loss_chunk_size <= 0:
            raise ValueError(f"loss_chunk_size={loss_chunk_size} must be a positive number of rows.")
        self.draft, self.draft_config, self.block_size, self.num_anchors = draft, draft_config, block_size, num_anchors
        self.overlap_anchors, self.target_layer_ids, self.loss_type = overlap_anchors, target_layer_ids, loss_type
        self.loss_decay_gamma, self.prefix_weight_base = loss_decay_gamma, prefix_weight_base
        self.trained_attention = self.attn_implementation = attn_implementation
        self.loss_chunk_size = loss_chunk_size
        self.save_settings(target=self.target, draft=draft, draft_config=draft_config, block_size=block_size,
                           num_anchors=num_anchors, overlap_anchors=overlap_anchors, target_layer_ids=target_layer_ids,
                           loss_type=loss_type, loss_decay_gamma=loss_decay_gamma,
                           prefix_weight_base=prefix_weight_base, attn_implementation=attn_implementation,
                           loss_chunk_size=loss_chunk_size, generation=self.generation)
        self._stats: torch.Tensor | None = None
        self._last_stats: torch.Tensor | None = None
        self._target_identity: dict[str, Any] | None = None

    # ------------------------------------------------------------------ model
    @property
    def loss_gamma(self) -> float:
        return self.loss_decay_gamma if self.loss_decay_gamma is not None else default_loss_gamma(self.block_size)

    def build_model(self) -> DFlashDraft:
        target = self._load_target()
        text = target.config.get_text_config()
        rows = target.get_input_embeddings().weight.shape[0]
        if rows < self.vocab_size:
            raise ValueError(
                f"The target's vocabulary ({rows} rows) is smaller than the tokenizer's ({self.vocab_size} tokens): use "
                f"the tokenizer the target was trained with.{self._mask_hint(rows)}"
            )
        self._check_tokenizer()
        self._target_identity = target_identity(target)
        attention = self.attn_implementation
        if self.draft is not None:
            draft = load_draft(self.draft, attention)
            self._check_loaded_draft(draft)
        else:
            settings = copy.deepcopy(dict(self.draft_config or {}))
            layers = settings.get("num_hidden_layers", 5)
            defaulted = self.target_layer_ids is None
            ids = default_target_layer_ids(text.num_hidden_layers, layers) if defaulted else self.target_layer_ids
            ids = check_target_layer_ids(ids, text.num_hidden_layers, defaulted=defaulted)
            config = draft_config(target, block_size=self.block_size, mask_token_id=self.mask_token_id,
                                  target_layer_ids=ids, overrides=settings)
            draft = AutoModel.from_config(config, attn_implementation=attention)  # a MuseGlimmerAssistantModel
        variable = self.loss_type == "variable_prefix"
        return DFlashDraft(target, draft, self.loss_gamma, variable, self.loss_chunk_size, attention)

    def _mask_hint(self, rows: int) -> str:
        """When the mask token was added beyond the target's ``rows``: which of the target's own tokens to use."""
        if self.mask_token_id is None or self.mask_token_id < rows:
            return ""
        unused = unused_special_tokens(self.tokenizer, rows)
        return (f" The mask token {self.tokenizer.mask_token!r} (id {self.mask_token_id}) was added to the "
                "tokenizer, but DFlash embeds it with the frozen target's embeddings: set data.init_args.tokenizer.mask_token to one of the "
                f"target's own unused special tokens{f', e.g. {unused[0]!r} (unused: {unused})' if unused else ''}.")

    def _check_tokenizer(self) -> None:
        """The data tokenizer (when given: a checkpoint brings back its own later) must be the target's, when the
        target ships one: same vocabulary, same special ids."""
        if self.target.model is None or self._tokenizer is None:
            return
        try:
            own = load_tokenizer(self.target.model, trust_remote_code=self.tokenizer_settings.trust_remote_code, require_mask=False,
                                 gguf_file=self.target.gguf_file)
        except (OSError, ValueError):
            return  # no tokenizer (that loads) beside the target: nothing to compare with
        data, theirs = self._tokenizer.get_vocab(), own.get_vocab()
        differ = sorted((token for token in set(data) | set(theirs) if data.get(token) != theirs.get(token)),
                        key=lambda token: (data.get(token, -1), token))
        ids = {role: (getattr(self._tokenizer, f"{role}_token_id"), getattr(own, f"{role}_token_id"))
               for role in ("eos", "bos", "unk")}
        roles = [f"{role} {mine} (target's: {its})" for role, (mine, its) in ids.items() if mine != its]
        if differ or roles:
            raise ValueError(
                f"The data tokenizer {self.tokenizer_settings.name or 'the embedded default'!r} differs from the target's "
                f"({self.target.model}): {len(differ)} tokens have other ids (e.g. {differ[:5]}){'; ' if roles else ''}"
                f"{', '.join(roles)}. The draft predicts the target's tokens: set data.init_args.tokenizer.name to {self.target.model!r}."
            )

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        super().on_save_checkpoint(checkpoint)
        checkpoint[TARGET_IDENTITY_KEY] = self._target_identity

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        """Refuse a checkpoint trained against another target (other config, vocabulary or weights at that path)."""
        recorded, where = checkpoint.get(TARGET_IDENTITY_KEY), self.target.model or "target.model_config"
        if recorded is None:
            rank_zero_warn("This DFlash checkpoint records no target identity (written by an older lit_dllm): it "
                           f"cannot be checked against the target {where!r}.")
        changed = identity_differences(recorded, self._target_identity) if recorded and self._target_identity else []
        if changed:
            raise ValueError(
                f"This draft was trained against another target than {where!r}: {'; '.join(changed)}. Point "
                "model.init_args.target at the weights it was trained against, or train a new draft (fit without "
                "--ckpt_path)."
            )
        super().on_load_checkpoint(checkpoint)

    def _load_target(self):
        own = self.target.attn_implementation
        options = dict(trust_remote_code=self.tokenizer_settings.trust_remote_code, torch_dtype=self.target.torch_dtype,
                       attn_implementation="sdpa" if own == "flex_attention" else own)
        if self.target.model is not None:
            return load_causal_lm(self.target.model, None, gguf_file=self.target.gguf_file, **options)
        config = {"vocab_size": self.vocab_size, "pad_token_id": self.pad_token_id, "eos_token_id": self.eos_token_id,
                  **self.target.model_config}
        with torch.random.fork_rng(devices=[]):  # the same random target every time it is built (resume, reload)
            torch.manual_seed(self.noise_seed)
            return load_causal_lm(None, config, **options)

    def _check_loaded_draft(self, draft: MuseGlimmerAssistantModel) -> None:
        config = draft.config
        problems = []
        if config.block_size != self.block_size:
            problems.append(f"block_size {config.block_size} (model.init_args.block_size is {self.block_size})")
        if config.mask_token_id != self.mask_token_id:
            problems.append(f"mask_token_id {config.mask_token_id} (the tokenizer's is {self.mask_token_id})")
        if self.target_layer_ids is not None and list(config.target_layer_ids) != list(self.target_layer_ids):
            problems.append(f"target_layer_ids {list(config.target_layer_ids)} (model.init_args.target_layer_ids is "
                            f"{list(self.target_layer_ids)})")
        if problems:
            raise ValueError(
                f"The draft {self.draft!r} was trained with {'; '.join(problems)}: set the module's values to the "
                "draft's, or start a new draft (draft_config)."
            )

    # ------------------------------------------------------------------ training step
    def prepare_batch(self, batch: dict, keys: torch.Tensor) -> dict:
        """Anchors (keyed by example), block inputs, positions, targets and weights (see :func:`build_blocks`). Packed
        rows draw anchors document by document (``keys`` has one per document), each document as a row of its own
        (:class:`~lit_dllm.data.packing.DocumentView`), then place them in its packed row (:func:`place_blocks`)."""
        scored_tokens = batch["loss_mask"].bool() & real_tokens(batch)
        packed = is_packed(batch)
        drawn_on = DocumentView(batch).gather(scored_tokens, False) if packed else scored_tokens
        candidates = anchor_candidates(drawn_on, self.block_size)
        blocks = sample_anchors(candidates, keys, self.num_anchors, self.block_size, self.overlap_anchors)
        variable = self.loss_type == "variable_prefix"
        if variable:
            blocks = blocks._replace(prefix=sample_prefix_lengths(keys, self.num_anchors, self.block_size,
                                                                  self.prefix_weight_base))
        if packed:
            blocks = place_blocks(blocks, batch["document_offsets"], *batch["input_ids"].shape)
        built = build_blocks(batch["input_ids"], scored_tokens, blocks, self.block_size, self.mask_token_id,
                             self.loss_gamma, variable, **document_inputs(batch))
        return {"blocks": built}

    def check_context_parallel(self, size: int) -> None:
        """The blocks of every row split evenly over the context ranks: ``num_anchors`` a multiple of ``size``."""
        super().check_context_parallel(size)
        if self.num_anchors % size:
            multiple = -(-self.num_anchors // size) * size
            raise ValueError(f"num_anchors={self.num_anchors} does not split over context_parallel_size={size} (each "
                             f"rank trains the draft on an equal share of every row's blocks): set num_anchors to a "
                             f"multiple of {size}, e.g. {multiple}.")

    def shard_sequences(self, batch: dict, prepared: dict) -> tuple[dict, dict]:
        """The batch cut along the positions (the target's input); the blocks drawn on the whole rows shared out
        (:func:`~lit_dllm.families.dflash.blocks.shard_blocks`)."""
        batch, prepared = super().shard_sequences(batch, prepared)
        context = self.model.context_parallel
        if context is None:
            return batch, prepared
        return batch, {**prepared, "blocks": shard_blocks(prepared["blocks"], context.rank, context.size,
                                                          self.block_size)}

    def token_counts(self, batch: dict, prepared: dict) -> dict[str, torch.Tensor]:
        """The global sum of the targets' loss weights is the loss's denominator: a true weighted mean."""
        return {"weighted_targets": prepared["blocks"].weights.sum()}

    def token_sums(self, batch: dict, prepared: dict) -> dict[str, torch.Tensor]:
        built: BlockBatch = prepared["blocks"]
        return {**super().token_sums(batch, prepared), "draft_targets": built.scored.sum(),
                "blocks": built.blocks.keep.sum()}

    def compute_loss(self, batch: dict, prepared: dict, denominators: dict[str, torch.Tensor]) -> StepLoss:
        built: BlockBatch = prepared["blocks"]
        scores = self.model(batch["input_ids"], built, denominators["weighted_targets"])
        self._last_stats = self._block_stats(scores.hits, built)
        if self.training:
            self._stats = self._last_stats if self._stats is None else self._stats + self._last_stats
        scored = built.scored
        return StepLoss(DLLMLossOutput(scores.loss, scores.loss.detach()), (scores.hits & scored).sum(), scored.sum())

    def _block_stats(self, hits: torch.Tensor, built: BlockBatch) -> torch.Tensor:
        """One vector of local sums: per-offset hits and targets (``bs - 1`` each), then the simulated accept
        lengths' sum and their blocks, the weighted targets, and 1 if nothing was scored (an empty micro-batch)."""
        width = self.block_size - 1
        scored = built.scored.view(len(hits), -1, width)
        hits = hits.view_as(scored) & scored
        # accept length: leading correct predictions, an unscored offset counting as correct but adding 0
        run = (hits | ~scored).long().cumprod(-1)
        lengths = (run * scored).sum(-1)
        measured = scored.any(-1)
        accept = ((lengths + 1) * measured).sum()
        empty = (~scored.any()).long()
        parts = [hits.sum((0, 1)), scored.sum((0, 1)), accept[None], measured.sum()[None], built.weights.sum()[None],
                 empty[None]]
        return torch.cat([part.float() for part in parts])

    def on_before_optimizer_step(self, optimizer) -> None:
        stats, self._stats = self._stats, None
        empty_step = False
        if stats is not None:
            width = self.block_size - 1
            total = self._group_sum(stats)
            correct, count = total[:width], total[width : 2 * width]
            accept, measured, weighted, empty = total[2 * width :]
            logs = {f"train/acc_k{k + 1}": correct[k] / count[k].clamp_min(1) for k in range(width)}
            logs["train/draft_accuracy"] = correct.sum() / count.sum().clamp_min(1)
            logs["train/accept_len"] = accept / measured.clamp_min(1)
            logs["train/empty_microbatches"] = empty
            self.log_dict(logs, on_step=True, on_epoch=False, rank_zero_only=True)
            empty_step = bool(weighted == 0)
        super().on_before_optimizer_step(optimizer)
        if empty_step:
            # Nothing was scored in this optimizer step on any rank: the gradients are zero, and dropping them keeps
            # AdamW's momentum and weight decay from moving the weights anyway (a real skip, on every rank alike).
            rank_zero_warn(f"Optimizer step {self.global_step + 1}: no micro-batch had a valid DFlash anchor on any "
                           "rank; the step leaves the draft unchanged.")
            for param in self.parameters():
                param.grad = None

    # ------------------------------------------------------------------ evaluation
    def stage_metrics(self):
        metrics = super().stage_metrics()
        for name in ("accept_len", "accept_len_sampled", "greedy_identical", "accept_len_simulated"):
            metrics[name] = MeanMetric()
        return metrics

    def evaluate(self, batch: dict, batch_idx: int, stage: str) -> None:
        """The loss and draft accuracy on fixed anchors, the simulated accept length and, on the first
        ``val_generate_batches`` batches, real speculative decoding of each prompt (:meth:`score_generation`)."""
        super().evaluate(batch, batch_idx, stage)
        metrics = self.eval_metrics[stage]
        width = self.block_size - 1
        accept, measured = self._last_stats[2 * width], self._last_stats[2 * width + 1]
        if measured > 0:
            metrics["accept_len_simulated"].update(accept / measured, weight=measured)
            self.log(f"{stage}/accept_len_simulated", metrics["accept_len_simulated"])

    # ------------------------------------------------------------------ export
    def _export_draft(self, path: str | os.PathLike, overwrite: bool,
                      write: Callable[[MuseGlimmerAssistantModel, Path], None]) -> None:
        """``write(draft, folder)`` and the tokenizer into the export folder (:func:`~lit_dllm.core.export.
        export_folder`, checked before any build; ``overwrite``: write into a folder of files no export wrote). In a
        process group (DDP) every rank calls it and rank 0 writes (:func:`~lit_dllm.parallel.on_rank_zero`)."""
        check_export_path(path, overwrite)
        if self.model is None:
            self.configure_model()
        self.check_whole_model("Export")
        folder, tokenizer = export_folder(path, overwrite, collective=True), self.export_tokenizer()

        def write_all() -> None:
            write(self.model.draft, folder)
            if tokenizer is not None:
                tokenizer.save_pretrained(folder)

        on_rank_zero(write_all)

    def save_pretrained(self, path: str | os.PathLike, overwrite: bool = False) -> None:
        """Write the draft (``MuseGlimmerAssistantModel``) and the tokenizer to ``path``: ``AutoModel.from_pretrained
        (path)`` reloads it and ``target.generate(ids, assistant_model=draft, speculation_type="dflash")`` serves it.
        From a trained run: ``DFlashModule.load_from_checkpoint(ckpt).save_pretrained(path)``."""
        self._export_draft(path, overwrite, lambda draft, folder: draft.save_pretrained(folder))

    def export_zlab(self, path: str | os.PathLike, overwrite: bool = False) -> None:
        """Write the draft in z-lab's ``DFlashDraftModel`` layout (qwen3 ``config.json`` with ``dflash_config``,
        renamed keys; see :func:`lit_dllm.families.dflash.checkpoints.export_zlab`) and the tokenizer to ``path``."""

        def write(draft: MuseGlimmerAssistantModel, folder: Path) -> None:
            target = self.model.target  # built by now
            export_zlab(draft, folder, vocab_size=target.get_input_embeddings().weight.shape[0],
                        num_target_layers=target.config.get_text_config().num_hidden_layers)

        self._export_draft(path, overwrite, write)

    def training_flops(self, batch: dict) -> float | torch.Tensor:
        """Model FLOPs of one training micro-batch of ``B`` rows of ``S`` tokens: the frozen target's forward over the
        ``B·S`` tokens (no LM head); the draft's step over its ``B · num_anchors · block_size`` block tokens, each
        attending to the ``S`` context positions and every block (dense), plus its context projections (``fc``, each
        layer's K and V) over the ``B·S`` tokens; the target's LM head at the predicted positions (forward and input
        gradient, 4 per parameter). Packed rows count their documents, each as a row of its own ``document_spans``
        tokens (a tensor, no host sync; the rows' tail padding and spare block slots are not counted), as
        :func:`~lit_dllm.throughput.packed_transformer_flops` does."""
        if is_packed(batch):
            return self._row_flops(batch["document_spans"].double()).sum()
        rows, length = batch["input_ids"].shape
        return rows * self._row_flops(length)

    def _row_flops(self, length: int | torch.Tensor) -> float | torch.Tensor:
        """:meth:`training_flops` of one row of ``length`` tokens (or of each of a tensor of lengths)."""
        target, draft = self.model.target, self.model.draft
        blocks = self.num_anchors * self.block_size
        sizes = {name: p.numel() for name, p in draft.named_parameters()}
        fc = sum(size for name, size in sizes.items() if name.split(".")[-2] == "fc")
        kv = sum(size for name, size in sizes.items() if name.split(".")[-2] in ("k_proj", "v_proj"))
        block_params = matmul_params(draft)[0] - fc
        target_flops = length * (2 * sum(matmul_params(target.base_model)) +
                                 attention_flops(target.config.get_text_config(), length))
        draft_flops = blocks * (6 * block_params + 3 * attention_flops(draft.config, length + blocks))
        draft_flops += 6 * length * (fc + kv)
        head_flops = 4 * target.get_output_embeddings().weight.numel() * self.num_anchors * (self.block_size - 1)
        return target_flops + draft_flops + head_flops

    tiny_config = "configs/dflash_tiny.yaml"
