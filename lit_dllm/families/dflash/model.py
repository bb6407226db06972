"""DFlash draft training (docs/DESIGN.md §10): a frozen target causal LM and transformers' own DFlash draft class.

The draft is ``MuseGlimmerAssistantModel`` (transformers' DFlash drafter): a small non-causal stack whose attention
keys and values are ``[projected target features ; block]``. It has no embeddings and no LM head of its own: a block
``[x_a, MASK, ..., MASK]`` is embedded by the target's input embeddings, and its outputs at offsets ``1..bs-1`` are
scored by the target's LM head against tokens ``a+1 .. a+bs-1``. In training, ``N`` blocks per row are denoised in
one forward against the target's features of the whole row, each block seeing only the features strictly before its
anchor (:func:`~lit_dllm.families.dflash.masks.create_dflash_attention_mask`), at positions ``a .. a+bs-1``: exactly
what transformers' ``generate(assistant_model=draft, speculation_type="dflash")`` feeds the draft when ``a`` is the last
committed token.

This file is plain PyTorch (no Lightning): the draft config built from the target's, and :class:`DFlashDraft`, the
single-device ``nn.Module`` whose ``forward`` runs the frozen target, the draft and the fused loss (everything inside
``forward`` so FSDP's hooks on it gather the root-owned parameters: the target's embeddings, norm and LM head). The
blocks it trains on (anchors keyed per example, block inputs, targets and weights) come from
:mod:`~lit_dllm.families.dflash.blocks`; loading, z-lab export and the target's identity are in
:mod:`~lit_dllm.families.dflash.checkpoints`.

Packed rows (:class:`~lit_dllm.data.packing.PackedCollator`'s, several documents side by side) train as their documents
would alone: the target attends causally within each document at the document's own positions, and a block sees only
its own document's features before its anchor, at the document's positions (its anchors, inputs and targets:
:mod:`~lit_dllm.families.dflash.blocks`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor, nn
from transformers import MuseGlimmerAssistantConfig, MuseGlimmerAssistantModel, PreTrainedModel

from lit_dllm import compat
from lit_dllm.attention import document_mask
from lit_dllm.context_parallel import ContextParallel
from lit_dllm.families.dflash.blocks import BlockBatch, Blocks
from lit_dllm.families.dflash.loss import DFlashDecayLoss
from lit_dllm.families.dflash.masks import create_dflash_attention_mask, create_dflash_block_mask

ATTENTION = ("sdpa", "eager", "flex_attention")


# ---------------------------------------------------------------------------------------------------- settings
def default_target_layer_ids(num_target_layers: int, num_features: int) -> list[int]:
    """docs/DESIGN.md §10.1: one id for one feature (``Lt // 2``), else ``round(1 + i (Lt - 4) / (n - 1))`` (half to
    even)."""
    if num_features == 1:
        return [num_target_layers // 2]
    return [round(1 + i * (num_target_layers - 4) / (num_features - 1)) for i in range(num_features)]


def check_target_layer_ids(layer_ids: list[int], num_target_layers: int, defaulted: bool = False) -> list[int]:
    """``layer_ids`` as ints, each a decoder layer of the target (0 .. Lt-1), or a ValueError naming the fix."""
    ids = [int(i) for i in layer_ids]
    bad = [i for i in ids if not 0 <= i < num_target_layers]
    if not ids or bad:
        how = (
            f"the default formula (docs/DESIGN.md §10.1) gives {ids} for a {num_target_layers}-layer target; "
            if defaulted else ""
        )
        raise ValueError(
            f"target_layer_ids {ids} must be a non-empty list of the target's decoder layers 0..{num_target_layers - 1}"
            f" (out of range: {bad}); {how}set model.init_args.target_layer_ids explicitly, e.g. "
            f"{sorted({0, num_target_layers // 2, num_target_layers - 1})}."
        )
    return ids


# ------------------------------------------------------------------------------------------- draft construction
def _first(value):
    return value[0] if isinstance(value, (list, tuple)) else value


def target_rope_parameters(text) -> dict:
    """The target's RoPE parameters from its text config ``text`` (the full-attention ones when they are given per
    layer type)."""
    rope = getattr(text, "rope_parameters", None)
    if isinstance(rope, dict) and "full_attention" in rope:
        rope = rope["full_attention"]
    if not rope:
        rope = {"rope_type": "default", "rope_theta": float(getattr(text, "rope_theta", 10000.0))}
    return dict(rope)


def draft_config(
    target: PreTrainedModel,
    *,
    block_size: int,
    mask_token_id: int,
    target_layer_ids: list[int],
    overrides: dict[str, Any] | None = None,
) -> MuseGlimmerAssistantConfig:
    """A ``MuseGlimmerAssistantConfig`` shaped after the target: its hidden size (required), heads, MLP width,
    activation, RoPE parameters and norm eps (so the draft's positions mean what the target's do), 5 layers, all
    full attention; ``overrides`` (e.g. ``num_hidden_layers``, ``num_attention_heads``, ``intermediate_size``)
    replace any of these except ``hidden_size``, which must stay the target's."""
    text = target.config.get_text_config()
    overrides = dict(overrides or {})
    hidden = text.hidden_size
    if overrides.get("hidden_size", hidden) != hidden:
        raise ValueError(
            f"draft_config hidden_size={overrides['hidden_size']} differs from the target's hidden size {hidden}: "
            "the draft reads the target's embeddings and LM head, so its hidden size must be the target's."
        )
    heads = text.num_attention_heads
    settings: dict[str, Any] = {
        "hidden_size": hidden,
        "intermediate_size": getattr(text, "intermediate_size", 4 * hidden),
        "num_hidden_layers": 5,
        "num_attention_heads": heads,
        "num_key_value_heads": getattr(text, "num_key_value_heads", None) or heads,
        "head_dim": getattr(text, "head_dim", None) or hidden // heads,
        "rms_norm_eps": float(getattr(text, "rms_norm_eps", None) or getattr(text, "layer_norm_eps", None) or 1e-6),
        "rope_parameters": target_rope_parameters(text),
        "max_position_embeddings": getattr(text, "max_position_embeddings", 131072),
        "hidden_act": getattr(text, "hidden_act", "silu"),
        "bos_token_id": _first(getattr(text, "bos_token_id", None)),
        "eos_token_id": _first(getattr(text, "eos_token_id", None)),
        "pad_token_id": _first(getattr(text, "pad_token_id", None)),
        "attention_dropout": 0.0,
    }
    settings.update(overrides)
    settings.update(block_size=block_size, mask_token_id=mask_token_id, target_layer_ids=list(target_layer_ids))
    settings["layer_types"] = overrides.get("layer_types") or ["full_attention"] * settings["num_hidden_layers"]
    known = set(MuseGlimmerAssistantConfig().to_dict()) | set(MuseGlimmerAssistantConfig.__dataclass_fields__)
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ValueError(f"draft_config has unknown key(s) {unknown}: MuseGlimmerAssistantConfig does not define them.")
    return MuseGlimmerAssistantConfig(**settings)



# ------------------------------------------------------------------------------------------------------ the model
class DraftScores(NamedTuple):
    """One micro-batch's loss (weighted NLL sum over ``num_tokens``) and each target's argmax hit ``[B, N*(bs-1)]``
    (False where not scored)."""

    loss: Tensor
    hits: Tensor


class DFlashDraft(nn.Module):
    """The frozen target (``self.target``, a transformers causal LM) and the draft (``self.draft``, a
    ``MuseGlimmerAssistantModel``); ``forward`` trains the draft on a micro-batch of blocks.

    Under context parallelism (``context_parallel``, set by :func:`~lit_dllm.context_parallel.apply_context_parallel`,
    which takes the target: the first transformers model inside) the target runs on this rank's shard of each row's
    positions and its features are gathered to whole rows; the draft runs its share of the blocks
    (:func:`~lit_dllm.families.dflash.blocks.shard_blocks`) against the whole rows' features.

    Args:
        target: the target causal LM (frozen by the caller).
        draft: the draft; ``draft.config`` holds ``block_size``, ``mask_token_id`` and ``target_layer_ids``.
        loss_gamma: the position decay's γ (None: uniform weights).
        variable_prefix: weights come with each batch (:func:`~lit_dllm.families.dflash.blocks.build_blocks`)
            instead of the loss's own decay.
        chunk_size: rows per chunk of the fused LM head + cross-entropy.
        attn_implementation: ``sdpa`` / ``eager`` (dense mask) or ``flex_attention`` (a ``BlockMask``; GPU).
    """

    def __init__(
        self,
        target: PreTrainedModel,
        draft: MuseGlimmerAssistantModel,
        loss_gamma: float | None = 7.0,
        variable_prefix: bool = False,
        chunk_size: int = 1024,
        attn_implementation: str = "sdpa",
    ) -> None:
        super().__init__()
        if attn_implementation not in ATTENTION:
            raise ValueError(f"attn_implementation={attn_implementation!r}; use one of {ATTENTION}.")
        self.target = target
        self.draft = draft
        self.loss_gamma, self.variable_prefix = loss_gamma, variable_prefix
        # variable prefix: the batch's block_mask carries the weights, so the loss adds no decay of its own
        self.loss = DFlashDecayLoss(None if variable_prefix else loss_gamma, True, chunk_size, "tokens")
        self.attn_implementation = attn_implementation
        self.context_parallel: ContextParallel | None = None
        check_draft_fits(target, draft)
        self.train(draft.training)

    def train(self, mode: bool = True) -> "DFlashDraft":
        """As ``nn.Module.train``. A flex draft attends with flex only while training: evaluation and decoding run it
        with sdpa (on a GPU, evaluating through flex gave wrong drafts while training through it was right:
        docs/benchmarks/dflash.md)."""
        super().train(mode)
        if self.attn_implementation == "flex_attention":
            self.draft.set_attn_implementation("flex_attention" if mode else "sdpa")
        return self

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        compat.register_output_recording(self.target)  # unpickled in a fresh process (e.g. ddp_spawn)

    @property
    def config(self) -> MuseGlimmerAssistantConfig:
        return self.draft.config

    @property
    def block_size(self) -> int:
        return self.draft.config.block_size

    def features(self, input_ids: Tensor, document_ids: Tensor | None = None,
                 position_ids: Tensor | None = None) -> Tensor:
        """``[B, S, n·H]``: the target's ``hidden_states[i+1]`` for each ``i`` of ``target_layer_ids`` (decoder
        layer ``i``'s output), concatenated, without grad, as transformers' DFlash generator reads them. Packed rows
        (``document_ids``, ``position_ids``): each document attends causally to itself only, at its own positions.
        Under context parallelism ``input_ids`` is this rank's shard (``document_ids`` and ``position_ids`` the whole
        rows'): the target runs on the shard and the features of the whole rows come back."""
        layer_ids = list(self.config.target_layer_ids)
        context = self.context_parallel
        kwargs = {}
        if context is not None:
            kwargs["position_ids"] = (context.positions(input_ids) if position_ids is None
                                      else context.take(position_ids))
        if document_ids is not None:
            text = self.target.config.get_text_config()
            dtype = _compute_dtype(self.target.get_input_embeddings().weight.dtype, input_ids.device)
            rows = None if context is None else context.query_slice(input_ids.shape[1])
            kwargs["attention_mask"] = document_mask(document_ids, True, compat.attn_implementation(text), dtype, rows)
            kwargs.setdefault("position_ids", position_ids)
        with torch.no_grad():
            outputs = self.target.base_model(
                input_ids=input_ids, output_hidden_states=[i + 1 for i in layer_ids], use_cache=False, **kwargs
            )
            states, layers = outputs.hidden_states, self.target.config.get_text_config().num_hidden_layers
            if len(states) != layers + 1:
                raise RuntimeError(
                    f"The target returned {len(states)} hidden states for {layers}"
                    " layers (expected one per layer plus the embeddings): it cannot provide DFlash features."
                )
            features = torch.cat([states[i + 1] for i in layer_ids], dim=-1)
            return features if context is None else context.gather(features)

    def embed(self, block_ids: Tensor) -> Tensor:
        """Block embeddings from the target's input embeddings, bypassing an optional ``embed_norm`` as
        transformers' DFlash generator does."""
        embeddings = self.target.get_input_embeddings()
        norm = getattr(embeddings, "embed_norm", None)
        if norm is None:
            return embeddings(block_ids)
        embeddings.embed_norm = nn.Identity()
        try:
            return embeddings(block_ids)
        finally:
            embeddings.embed_norm = norm

    def attention_mask(self, blocks: Blocks, context_length: int, dtype: torch.dtype,
                       document_ids: Tensor | None = None):
        """The DFlash mask in the form the draft's attention takes: a bool mask for sdpa, additive for eager, a
        ``BlockMask`` for flex (as the dict Muse's layers read per layer type); within documents for packed rows."""
        anchors, keep, _ = blocks
        attention = compat.attn_implementation(self.draft.config)
        if attention == "flex_attention":
            mask = create_dflash_block_mask(anchors, keep, context_length, self.block_size, document_ids=document_ids)
        else:
            additive = dtype if attention == "eager" else None
            mask = create_dflash_attention_mask(anchors, keep, context_length, self.block_size, dtype=additive,
                                                document_ids=document_ids)
        return {"full_attention": mask, "sliding_attention": mask}

    def hidden(self, input_ids: Tensor, batch: BlockBatch) -> Tensor:
        """The draft's final hidden states ``[B, N*bs, H]`` for every block of ``batch`` (``input_ids``: this rank's
        shard of the rows under context parallelism)."""
        dtype = next(self.draft.parameters()).dtype
        length = batch.context_length
        context = self.features(input_ids, batch.document_ids, batch.positions[:, :length]).to(dtype)
        noise = self.embed(batch.block_ids).to(dtype)
        mask = self.attention_mask(batch.blocks, length, _compute_dtype(dtype, noise.device), batch.document_ids)
        return self.draft(
            noise_embeds=noise, context_hidden_states=context, attention_mask=mask, position_ids=batch.positions,
        ).last_hidden_state

    def logits(self, hidden: Tensor) -> Tensor:
        """The target LM head on draft outputs (as transformers' DFlash generator computes candidate logits)."""
        head = self.target.get_output_embeddings()
        return head(hidden.to(head.weight.dtype))

    def forward(self, input_ids: Tensor, batch: BlockBatch, num_tokens: Tensor) -> DraftScores:
        """The draft's weighted NLL over ``batch``'s scored targets divided by ``num_tokens`` (the global sum of
        the weights: a true weighted mean), and its argmax hits. With nothing scored, the loss is zero but keeps
        the graph through every draft parameter, so every rank runs the same forward and backward."""
        hidden = self.hidden(input_ids, batch)
        rows, width, size = hidden.shape
        bs = self.block_size
        predictions = hidden.view(rows, width // bs, bs, size)[:, :, 1:].reshape(rows, -1, size)
        if not bool(batch.scored.any()):
            return DraftScores(hidden.sum() * 0.0, torch.zeros_like(batch.scored))
        head = self.target.get_output_embeddings()
        weighted, hits, selected = self.loss.score_fused(
            predictions.to(head.weight.dtype), head.weight, batch.targets, batch.block_mask, bs, head.bias
        )
        output = self.loss.reduce(weighted, hits, selected, batch.block_mask, num_tokens, bs)
        return DraftScores(output.total_loss, torch.zeros_like(selected).masked_scatter(selected, hits))


def _compute_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The attention's compute dtype: autocast's when it is on, else the parameters'."""
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return dtype


def check_draft_fits(target: PreTrainedModel, draft: MuseGlimmerAssistantModel) -> None:
    """Raise a ValueError when ``draft`` cannot run on ``target``: hidden sizes, mask id, layer ids, block size."""
    text, config = target.config.get_text_config(), draft.config
    if config.hidden_size != text.hidden_size:
        raise ValueError(
            f"The draft's hidden size ({config.hidden_size}) differs from the target's ({text.hidden_size}): the draft "
            "embeds with the target's embeddings and scores with its LM head, so they must match. Use a draft trained "
            "for this target, or a new one (draft_config)."
        )
    rows = target.get_input_embeddings().weight.shape[0]
    if not 0 <= config.mask_token_id < rows:
        raise ValueError(
            f"mask_token_id={config.mask_token_id} is outside the target's vocabulary (0..{rows - 1}): the mask "
            "token is embedded by the target, so use a token id it has (e.g. add a mask token to a tokenizer whose "
            "vocabulary is smaller than the model's embedding table, or pick an unused id)."
        )
    check_target_layer_ids(config.target_layer_ids, text.num_hidden_layers)
    if config.block_size < 2:
        raise ValueError(f"block_size={config.block_size} must be >= 2 (the anchor plus at least one prediction).")
