"""DFlash draft training (docs/DESIGN.md §10): a frozen target causal LM and transformers' own DFlash draft class.

The draft is ``MuseGlimmerAssistantModel`` (transformers' DFlash drafter): a small non-causal stack whose attention
keys and values are ``[projected target features ; block]``. It has no embeddings and no LM head of its own: a block
``[x_a, MASK, ..., MASK]`` is embedded by the target's input embeddings, and its outputs at offsets ``1..bs-1`` are
scored by the target's LM head against tokens ``a+1 .. a+bs-1``. In training, ``N`` blocks per row are denoised in
one forward against the target's features of the whole row, each block seeing only the features strictly before its
anchor (:func:`~lit_dllm.families.dflash.masks.create_dflash_attention_mask`), at positions ``a .. a+bs-1``: exactly
what transformers' ``generate(assistant_model=draft, speculation_type="dflash")`` feeds the draft when ``a`` is the last
committed token.

This file is plain PyTorch (no Lightning): anchor sampling keyed per example, block inputs, targets and weights, the
draft config built from the target's, loading and z-lab export, and :class:`DFlashDraft`, the single-device
``nn.Module`` whose ``forward`` runs the frozen target, the draft and the fused loss (everything inside ``forward`` so
FSDP's hooks on it gather the root-owned parameters: the target's embeddings, norm and LM head).

Packed rows (:class:`~lit_dllm.data.packing.PackedCollator`'s, several documents side by side) train as their documents
would alone: the target attends causally within each document at the document's own positions; anchors are drawn on
each document as a row of its own (:class:`~lit_dllm.data.packing.DocumentView`, keyed by the document), ``num_anchors``
per document, and placed in the packed row that holds it (:func:`place_blocks`); a block's inputs and targets stop at
its document's end (as they stop at a row's end), and it sees only its own document's features before its anchor, at
the document's positions.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import AutoModel, MuseGlimmerAssistantConfig, MuseGlimmerAssistantModel, PreTrainedModel

from lit_dllm import compat
from lit_dllm.attention import document_mask
from lit_dllm.context_parallel import ContextParallel
from lit_dllm.noise.keys import Stream, keyed_uniform
from lit_dllm.families.dflash.loss import DFlashDecayLoss
from lit_dllm.families.dflash.masks import create_dflash_attention_mask, create_dflash_block_mask
from lit_dllm.hub.hf import saved_model_type

DEFAULT_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}
"""Decay γ of the DFlash loss per block size (docs/DESIGN.md §10.5); other sizes get ``max(2, bs / 2)``."""

LOSS_TYPES = ("dflash", "variable_prefix")
ATTENTION = ("sdpa", "eager", "flex_attention")

ZLAB_KEYS = {"encoder.fc.weight": "fc.weight", "encoder.output_norm_enc.weight": "hidden_norm.weight"}
"""Muse key -> z-lab ``DFlashDraftModel`` key; every other key (``layers.*``, ``norm.weight``) is the same."""


# ---------------------------------------------------------------------------------------------------- settings
def default_loss_gamma(block_size: int) -> float:
    """γ of the position decay ``exp(-(k-1)/γ)``: 7 / 5 / 4 at block sizes 16 / 10 / 8, else ``max(2, bs/2)``."""
    return DEFAULT_GAMMA.get(block_size, max(2.0, block_size / 2))


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


# ----------------------------------------------------------------------------------------------- anchors, blocks
class Blocks(NamedTuple):
    """The blocks of one micro-batch: ``anchors`` ``[B, N]`` (0 where not kept), ``keep`` ``[B, N]`` bool and
    ``prefix`` ``[B, N]`` (real tokens at the start of each block: 1 for plain DFlash, ``ℓ`` in variable-prefix)."""

    anchors: Tensor
    keep: Tensor
    prefix: Tensor


def anchor_candidates(scored: Tensor, block_size: int) -> Tensor:
    """``[B, S]`` bool: the positions a block can start at, i.e. where serving puts one.

    Serving anchors each block on the last committed token, a response token ``a >= 1`` (the prompt's last token
    is never one: the target's prefill commits the first response token). So a candidate is a scored token
    (``scored``: supervised and the example's own, not padding) at ``a >= 1`` with at least one scored token among
    ``a+1 .. a+bs-1``; blocks running past the row's end keep their in-bounds targets (short answers are mostly
    partial blocks)."""
    rows, length = scored.shape
    ahead = F.pad(scored.int(), (1, block_size)).cumsum(1)  # ahead[:, j] = scored tokens before position j
    index = torch.arange(length, device=scored.device)
    following = ahead[:, index + block_size] - ahead[:, index + 1]  # scored tokens in a+1 .. a+bs-1
    candidates = scored & (following > 0)
    candidates[:, 0] = False
    return candidates


def sample_anchors(candidates: Tensor, keys: Tensor, num_anchors: int, block_size: int, overlap: bool = True) -> Blocks:
    """``num_anchors`` blocks per row, keyed by example (never by batch, rank or accumulation split).

    ``overlap=True`` (default; docs/DESIGN.md §10.2's overlapping draw): each block's anchor is uniform over the row's
    candidates, independently, with replacement, so blocks may overlap or repeat. A row without candidates keeps no
    block.

    ``overlap=False``: disjoint blocks per row in the span ``[lo, hi]`` of its candidates: ``n = min(num_anchors,
    (hi - lo) // bs + 1)`` blocks (always >= 1), slack ``s = hi - lo - (n - 1) bs >= 0``, sorted offsets
    ``g_1 <= .. <= g_n`` drawn uniformly from ``0..s``, anchors ``lo + g_k + (k - 1) bs``; blocks ``n+1..N`` are not
    kept. Valid for every length (the reference draws distinct offsets with ``randperm(avail)[:n]`` and crashes when
    ``1 < avail < n``, docs/DESIGN.md §14 (b)); an anchor between two supervised regions only scores its supervised
    targets.
    """
    rows, length = candidates.shape
    device = candidates.device
    counts = candidates.sum(1)
    uniforms = keyed_uniform(keys, Stream.DFLASH_ANCHOR, num_anchors)
    slots = torch.arange(num_anchors, device=device)
    ones = torch.ones(rows, num_anchors, dtype=torch.long, device=device)
    if overlap:
        positions = torch.where(candidates, torch.arange(length, device=device), length).sort(1).values
        picks = (uniforms * counts[:, None]).long().clamp(min=0)
        picks = torch.minimum(picks, (counts[:, None] - 1).clamp(min=0))
        anchors = positions.gather(1, picks).sort(1).values  # in position order
        keep = (counts > 0)[:, None].expand(rows, num_anchors)
    else:
        index = torch.arange(length, device=device).expand(rows, length)
        lo = torch.where(candidates, index, length).min(1).values
        hi = torch.where(candidates, index, -1).max(1).values
        span = (hi - lo).clamp(min=0)
        blocks = torch.clamp(span // block_size + 1, max=num_anchors)
        slack = span - (blocks - 1) * block_size
        offsets = (uniforms * (slack + 1)[:, None]).long()
        keep = (slots[None] < blocks[:, None]) & (counts > 0)[:, None]
        offsets = torch.where(keep, offsets, slack[:, None]).sort(1).values  # kept offsets first, ascending
        anchors = lo[:, None] + offsets + slots[None] * block_size
    return Blocks(torch.where(keep, anchors, 0), keep, ones)


def sample_prefix_lengths(keys: Tensor, num_anchors: int, block_size: int, base: float) -> Tensor:
    """Variable-prefix mode (docs/DESIGN.md §10.3): ``[B, N]`` prefix lengths ``ℓ`` in ``[min(2, bs-1), bs-1]``,
    drawn with probability proportional to ``base ** ℓ``, keyed by example."""
    lengths = torch.arange(min(2, block_size - 1), block_size, device=keys.device)
    weights = torch.tensor(base, dtype=torch.float64, device=keys.device) ** lengths
    cdf = (weights.cumsum(0) / weights.sum()).float()
    uniforms = keyed_uniform(keys, Stream.DFLASH_PREFIX, num_anchors)
    return lengths[torch.searchsorted(cdf, uniforms.contiguous(), right=True).clamp(max=len(lengths) - 1)]


def place_blocks(blocks: Blocks, document_offsets: Tensor, rows: int, length: int) -> Blocks:
    """Packed rows: the blocks of each document (``[D, N]``, drawn on the document as a row of its own), placed in the
    packed row that holds it, ``[R, M * N]`` with ``M`` the most documents of a row: slots ``k N .. (k + 1) N - 1`` of
    row ``r`` hold the blocks of its ``k``-th document, anchors moved by the document's start in the row; the spare
    slots of rows with fewer documents keep no block. ``document_offsets`` (``[D]``, starts in the flattened ``[R *
    length]`` batch) number the documents row after row, as :class:`~lit_dllm.data.packing.PackedCollator` does. One
    device-to-host read (``M``)."""
    anchors, keep, prefix = blocks
    documents, num = anchors.shape
    row, start = document_offsets // length, document_offsets % length
    per_row = torch.bincount(row, minlength=rows)
    rank = torch.arange(documents, device=anchors.device) - (per_row.cumsum(0) - per_row)[row]  # k in its row
    most = int(per_row.max())
    slots = row * most + rank

    def place(values: Tensor, fill: int | bool) -> Tensor:
        return values.new_full((rows * most, num), fill).index_copy_(0, slots, values).view(rows, most * num)

    return Blocks(place(torch.where(keep, anchors + start[:, None], 0), 0), place(keep, False), place(prefix, 1))


class BlockBatch(NamedTuple):
    """Everything the draft forward needs for one micro-batch of ``N`` blocks of ``bs`` per row."""

    block_ids: Tensor  # [B, N*bs] block inputs: the prefix's real tokens, then MASK
    positions: Tensor  # [B, S + N*bs] positions: context 0..S-1, block n offset k -> a_n + k
    targets: Tensor  # [B, N*(bs-1)] token a+k for offsets k = 1..bs-1
    scored: Tensor  # [B, N*(bs-1)] bool: kept, in the row, supervised, and past the prefix
    weights: Tensor  # [B, N*(bs-1)] float: each target's loss weight (0 where not scored)
    block_mask: Tensor  # what the loss takes as block_mask: `scored` (DFlash), `weights` (variable prefix)
    blocks: Blocks
    document_ids: Tensor | None = None  # [B, S] packed rows' document of each position; None: one example per row

    @property
    def context_length(self) -> int:
        """``S``: the positions of the whole rows' context (before the blocks' positions)."""
        return self.positions.shape[1] - self.block_ids.shape[1]


def build_blocks(
    input_ids: Tensor,
    scored_tokens: Tensor,
    blocks: Blocks,
    block_size: int,
    mask_token_id: int,
    loss_gamma: float | None,
    variable_prefix: bool = False,
    *,
    document_ids: Tensor | None = None,
    position_ids: Tensor | None = None,
) -> BlockBatch:
    """Block inputs, positions, targets and loss weights of ``blocks`` (docs/DESIGN.md §10.3).

    Targets: block offset ``k`` <-> token ``a+k``, offset 0 (the anchor) dropped; scored where the block is kept,
    ``a+k`` lies in the row and ``scored_tokens[a+k]``. Weights: :class:`DFlashDecayLoss`'s decay ``exp(-(k-1)/γ)``
    (plain DFlash), or ``exp(-(k-ℓ)/γ)`` for ``k >= ℓ`` in variable-prefix mode, whose first ``ℓ`` block tokens are
    real (``loss_gamma=None``: weight 1).

    Packed rows (the batch's ``document_ids`` and ``position_ids``): a block ends where its anchor's document ends, as
    it ends at a row's end (past it no real input, no target), and its positions are its document's."""
    rows, length = input_ids.shape
    anchors, keep, prefix = blocks
    num = anchors.shape[1]
    offsets = torch.arange(block_size, device=input_ids.device)
    where = anchors[:, :, None] + offsets  # [B, N, bs] absolute positions
    inside = where < length
    flat = where.clamp(max=length - 1).flatten(1)
    if document_ids is not None:
        inside &= document_ids.gather(1, flat).view_as(where) == document_ids.gather(1, anchors)[:, :, None]
    tokens = input_ids.gather(1, flat).view(rows, num, block_size)
    real = (offsets < prefix[:, :, None]) & keep[:, :, None] & inside
    block_ids = torch.where(real, tokens, mask_token_id).flatten(1)
    if position_ids is None:
        position_ids = torch.arange(length, device=input_ids.device).expand(rows, length)
    positions = torch.cat([position_ids, (position_ids.gather(1, anchors)[:, :, None] + offsets).flatten(1)], dim=1)
    scored = scored_tokens.gather(1, flat).view(rows, num, block_size) & inside & keep[:, :, None]
    scored = (scored & (offsets >= prefix[:, :, None]))[:, :, 1:].flatten(1)
    if variable_prefix:
        distance = (offsets[1:] - prefix[:, :, None]).float().flatten(1)
        weights = torch.ones_like(distance) if loss_gamma is None else torch.exp(-distance / loss_gamma)
    else:
        decay = DFlashDecayLoss(loss_gamma).decay_weights(num * (block_size - 1), block_size, input_ids.device)
        weights = decay.expand(rows, -1)
    weights = torch.where(scored, weights, 0.0)
    block_mask = weights if variable_prefix else scored
    return BlockBatch(block_ids, positions, tokens[:, :, 1:].flatten(1), scored, weights, block_mask, blocks,
                      document_ids)


def shard_blocks(batch: BlockBatch, rank: int, size: int, block_size: int) -> BlockBatch:
    """Context-parallel rank ``rank`` of ``size``: its share of the ``N`` blocks of every row, blocks
    ``[rank N / size, (rank + 1) N / size)`` (``N`` divisible by ``size``), with the whole rows' context positions and
    documents (blocks attend to the context and to themselves only, so a share is scored as in the whole)."""
    anchors, keep, prefix = batch.blocks
    count = anchors.shape[1] // size

    def share(per_block: int) -> slice:  # this rank's entries of a row holding ``per_block`` entries a block
        return slice(rank * count * per_block, (rank + 1) * count * per_block)

    blocks, tokens, targets = share(1), share(block_size), share(block_size - 1)
    context = batch.context_length
    positions = torch.cat([batch.positions[:, :context], batch.positions[:, context:][:, tokens]], dim=1)
    return BlockBatch(batch.block_ids[:, tokens], positions, batch.targets[:, targets], batch.scored[:, targets],
                      batch.weights[:, targets], batch.block_mask[:, targets],
                      Blocks(anchors[:, blocks], keep[:, blocks], prefix[:, blocks]), batch.document_ids)


# ------------------------------------------------------------------------------------------- target identity
UNTRACKED_CONFIG = ("transformers_version", "torch_dtype", "dtype", "name_or_path", "architectures", "use_cache")
"""Target config keys that say how it was loaded or saved, not what it computes (the dtype is in the weights)."""


def target_identity(target: PreTrainedModel) -> dict[str, Any]:
    """What a draft is trained against: the target's text config, its vocabulary (embedding rows) and a fingerprint of
    its weights (each tensor's name, shape, dtype, float64 sum and 1024 evenly spaced values, hashed: cheap for an 8B
    target, and any retraining moves them)."""
    config = {key: value for key, value in _text_config(target).to_dict().items()
              if not key.startswith("_") and key not in UNTRACKED_CONFIG}
    digest = hashlib.sha256()
    with torch.no_grad():
        for name, tensor in sorted(target.state_dict().items()):
            flat = tensor.detach().reshape(-1)
            digest.update(f"{name} {tuple(tensor.shape)} {tensor.dtype} {flat.double().sum().item()!r}".encode())
            digest.update(flat[:: max(1, flat.numel() // 1024)][:1024].float().cpu().numpy().tobytes())
    rows = target.get_input_embeddings().weight.shape[0]
    config = json.loads(json.dumps(config, default=str))
    return {"config": config, "vocabulary": rows, "weights": digest.hexdigest()[:16]}


def identity_differences(recorded: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """How ``current`` (a :func:`target_identity`) differs from ``recorded``, one phrase per difference."""
    then, now = recorded["config"], current["config"]
    changed = [f"config {key} {now.get(key)!r} (checkpoint: {then.get(key)!r})"
               for key in sorted(set(then) | set(now)) if then.get(key) != now.get(key)]
    for name in ("vocabulary", "weights"):
        if recorded[name] != current[name]:
            what = "weights fingerprint" if name == "weights" else "vocabulary rows"
            changed.append(f"{what} {current[name]} (checkpoint: {recorded[name]})")
    return changed


# ------------------------------------------------------------------------------------------- draft construction
def _text_config(target: PreTrainedModel):
    config = target.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _first(value):
    return value[0] if isinstance(value, (list, tuple)) else value


def target_rope_parameters(text_config) -> dict:
    """The target's RoPE parameters (the full-attention ones when they are given per layer type)."""
    rope = getattr(text_config, "rope_parameters", None)
    if isinstance(rope, dict) and "full_attention" in rope:
        rope = rope["full_attention"]
    if not rope:
        rope = {"rope_type": "default", "rope_theta": float(getattr(text_config, "rope_theta", 10000.0))}
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
    text = _text_config(target)
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


def is_zlab_checkpoint(path: str | os.PathLike) -> bool:
    """Whether ``path`` holds a z-lab ``DFlashDraftModel`` checkpoint (a qwen3 config with ``dflash_config``)."""
    config = Path(path) / "config.json"
    if not config.is_file():
        return False
    settings = json.loads(config.read_text())
    return "dflash_config" in settings and "DFlashDraftModel" in settings.get("architectures", [])


def load_draft(path: str | os.PathLike, attn_implementation: str | None = None) -> MuseGlimmerAssistantModel:
    """A trained draft from ``path``: a ``MuseGlimmerAssistantModel`` folder (``save_pretrained``) or a z-lab
    ``DFlashDraftModel`` one (:func:`export_zlab`'s layout; its keys are renamed back)."""
    kwargs = {"attn_implementation": attn_implementation} if attn_implementation else {}
    if is_zlab_checkpoint(path):
        settings = json.loads((Path(path) / "config.json").read_text())
        config = muse_config_from_zlab(settings)
        model = AutoModel.from_config(config, **kwargs)
        state = _read_safetensors(Path(path))
        renamed = {key: state[zlab] for key, zlab in ((k, ZLAB_KEYS.get(k, k)) for k in model.state_dict())
                   if zlab in state}
        missing = sorted(set(model.state_dict()) - set(renamed))
        if missing:
            raise ValueError(f"{path} is a z-lab DFlash checkpoint without the tensors {missing[:4]}...")
        model.load_state_dict(renamed, strict=True)
        return model
    saved_model_type(path, MuseGlimmerAssistantConfig.model_type, "a DFlash draft",
                     "pass a folder written by DFlashModule.save_pretrained or export_zlab (z-lab's DFlashDraftModel), "
                     "or draft_config for a new draft.")
    return MuseGlimmerAssistantModel.from_pretrained(path, **kwargs)


def muse_config_from_zlab(settings: dict[str, Any]) -> MuseGlimmerAssistantConfig:
    """The ``MuseGlimmerAssistantConfig`` of a z-lab ``config.json`` dict (qwen3 keys + ``dflash_config``)."""
    dflash = settings["dflash_config"]
    keys = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "head_dim", "rms_norm_eps", "rope_parameters", "max_position_embeddings", "hidden_act", "bos_token_id",
            "eos_token_id", "pad_token_id", "attention_dropout")
    config = {key: settings[key] for key in keys if key in settings}
    config["layer_types"] = ["full_attention"] * settings["num_hidden_layers"]
    config.update(block_size=dflash.get("block_size", settings.get("block_size")),
                  mask_token_id=dflash["mask_token_id"], target_layer_ids=dflash["target_layer_ids"])
    return MuseGlimmerAssistantConfig(**config)


def _read_safetensors(folder: Path) -> dict[str, Tensor]:
    from safetensors.torch import load_file

    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    state: dict[str, Tensor] = {}
    for name in files:
        state.update(load_file(folder / name))
    return state


def export_zlab(draft: MuseGlimmerAssistantModel, path: str | os.PathLike, *, vocab_size: int,
                num_target_layers: int) -> None:
    """Write ``draft`` in z-lab's ``DFlashDraftModel`` layout (what SGLang / vLLM DFlash backends and z-lab's
    ``AutoModel(trust_remote_code)`` code read): ``config.json`` with ``model_type: qwen3``, ``architectures:
    [DFlashDraftModel]``, ``is_causal: false``, full-attention ``layer_types``, ``block_size`` and ``dflash_config``
    (``block_size``, ``mask_token_id``, ``target_layer_ids``), and ``model.safetensors`` whose keys are Muse's
    with ``encoder.fc`` -> ``fc`` and ``encoder.output_norm_enc`` -> ``hidden_norm`` (:data:`ZLAB_KEYS`)."""
    from safetensors.torch import save_file

    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    config = draft.config
    layers = config.num_hidden_layers
    settings = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "attention_bias": False,
        "attention_dropout": float(config.attention_dropout),
        "hidden_act": config.hidden_act,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_parameters": dict(config.rope_parameters),
        "rope_theta": config.rope_parameters.get("rope_theta"),
        "max_position_embeddings": config.max_position_embeddings,
        "layer_types": ["full_attention"] * layers,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": layers,
        "is_causal": False,
        "tie_word_embeddings": False,
        "use_cache": False,
        "vocab_size": vocab_size,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_id,
        "pad_token_id": config.pad_token_id,
        "num_target_layers": num_target_layers,
        "block_size": config.block_size,
        "dflash_config": {
            "block_size": config.block_size,
            "mask_token_id": config.mask_token_id,
            "target_layer_ids": list(config.target_layer_ids),
        },
        "dtype": str(next(draft.parameters()).dtype).removeprefix("torch."),
    }
    (folder / "config.json").write_text(json.dumps(settings, indent=2) + "\n")
    state = {ZLAB_KEYS.get(key, key): value.detach().contiguous().cpu() for key, value in draft.state_dict().items()}
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})


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
    (:func:`shard_blocks`) against the whole rows' features.

    Args:
        target: the target causal LM (frozen by the caller).
        draft: the draft; ``draft.config`` holds ``block_size``, ``mask_token_id`` and ``target_layer_ids``.
        loss_gamma: the position decay's γ (None: uniform weights).
        variable_prefix: weights come with each batch (:func:`build_blocks`) instead of the loss's own decay.
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
            text = _text_config(self.target)
            dtype = _compute_dtype(self.target.get_input_embeddings().weight.dtype, input_ids.device)
            rows = None if context is None else context.query_slice(input_ids.shape[1])
            kwargs["attention_mask"] = document_mask(document_ids, True, compat.attn_implementation(text), dtype, rows)
            kwargs.setdefault("position_ids", position_ids)
        with torch.no_grad():
            outputs = self.target.base_model(
                input_ids=input_ids, output_hidden_states=[i + 1 for i in layer_ids], use_cache=False, **kwargs
            )
            states = outputs.hidden_states
            if len(states) != _text_config(self.target).num_hidden_layers + 1:
                raise RuntimeError(
                    f"The target returned {len(states)} hidden states for {_text_config(self.target).num_hidden_layers}"
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
    text, config = _text_config(target), draft.config
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
