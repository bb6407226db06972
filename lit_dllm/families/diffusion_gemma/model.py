"""transformers' ``DiffusionGemmaForBlockDiffusion`` with a block-diffusion training forward (docs/DESIGN.md §9.1,
§9.3).

One shared parameter stack runs twice: causally over the clean sequence (the "encoder", which fills a KV cache and
gives next-token logits for the AR loss), then bidirectionally over a noised canvas (the "decoder"), each canvas
block attending to the encoder KV of the clean tokens before it (the block-causal masks of
:mod:`~lit_dllm.families.diffusion_gemma.masks`). The encoder KV is not detached: the diffusion loss trains the encoder
pass too. The model stays transformers' own class, so a trained checkpoint is a plain Hugging Face one
(``save_pretrained``; ``generate`` serves it).

Plain single-device ``nn.Module``; parallelism is applied from outside. Everything happens inside ``forward`` so that
FSDP's hooks on this module gather the root-owned parameters (embeddings = LM head, norms, self-conditioning).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from transformers import (
    AutoConfig,
    AutoModelForImageTextToText,
    DiffusionGemmaConfig,
    DiffusionGemmaForBlockDiffusion,
    DynamicCache,
)

from lit_dllm import compat
from lit_dllm.hub.hf import check_config_keys, saved_model_type
from lit_dllm.losses import weighted_linear_cross_entropy

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask

MODEL_TYPE = "diffusion_gemma"
WIDE_HEAD_FORWARD_TILES = {"fwd_BLOCK_M": 32, "fwd_BLOCK_N": 32, "fwd_num_stages": 2}
"""FlexAttention's forward tiles for head dims over 256 (26B-A4B's global layers: 512). With torch's defaults such a
head needs 256 KiB of shared memory (an H200 has 227 KiB) and does not compile."""
HOPPER_BACKWARD_TILES = {256: (64, 64, 64, 64, 2, 8), 512: (32, 32, 32, 32, 2, 8)}
"""FlexAttention's backward ``(BLOCK_M1, BLOCK_N1, BLOCK_M2, BLOCK_N2, num_stages, num_warps)`` by head dim on sm90
(H100 / H200), the fastest of those timed at the Gemma bench's attention shapes (docs/benchmarks/gemma_moe.md)."""


def flex_kernel_options(head_dim: int, device: torch.device) -> dict[str, int]:
    """FlexAttention's ``kernel_options`` for a layer of ``head_dim`` on ``device``: the forward tiles heads over 256
    need, and on sm90 the backward tiles of :data:`HOPPER_BACKWARD_TILES`; torch's defaults for the rest."""
    options = dict(WIDE_HEAD_FORWARD_TILES) if head_dim > 256 else {}
    tiles = HOPPER_BACKWARD_TILES.get(head_dim)
    if tiles and device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0):
        names = ("BLOCK_M1", "BLOCK_N1", "BLOCK_M2", "BLOCK_N2", "num_stages", "num_warps")
        options.update({f"bwd_{name}": value for name, value in zip(names, tiles)})
    return options


def _layer_kernel_options(attention: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """Forward pre-hook of each attention: transformers hands the same keyword arguments to every layer, so
    :meth:`BlockDiffusionGemma.denoise` passes ``kernel_options_by_head_dim`` and each layer turns its own entry into
    the ``kernel_options`` of its attention. A caller's own ``kernel_options`` pass unchanged."""
    if "kernel_options_by_head_dim" not in kwargs:
        return None
    kwargs = dict(kwargs)
    kwargs["kernel_options"] = kwargs.pop("kernel_options_by_head_dim")[attention.head_dim]
    return args, kwargs


def unshard_before_cache_backward(hf: DiffusionGemmaForBlockDiffusion, cache: DynamicCache) -> None:
    """Under FSDP2, the keys and values each encoder layer left in ``cache`` unshard the layer's unit before their
    backward: they are its side output, which its unit's hooks do not cover (``lit_dllm.parallel._fully_shard``).
    Call it after the encoder pass of any training step that shards the model; it does nothing unsharded."""
    for layer in hf.model.encoder.language_model.layers:
        if isinstance(layer, FSDPModule):
            entry = cache.layers[layer.self_attn.layer_idx]
            compat.unshard_before_backward(layer, (entry.keys, entry.values))


class BlockDiffusionScores(NamedTuple):
    """The weighted NLL sum of the canvas and encoder rows (fp32, differentiable), and, detached, the fp32 NLL and the
    argmax hits at every canvas loss position (``[B·K]``, row-major, scored or not) and the encoder's next-token NLL
    (``[B·S]``; None when not asked for)."""

    loss: torch.Tensor
    nll: torch.Tensor
    correct: torch.Tensor
    ar_nll: torch.Tensor | None


def load_diffusion_gemma(
    pretrained: str | None = None,
    config: dict[str, Any] | None = None,
    *,
    torch_dtype: str | None = None,
    attn_implementation: str | None = None,
) -> DiffusionGemmaForBlockDiffusion:
    """transformers' DiffusionGemma from ``pretrained`` (hub id or local path, e.g. ``google/diffusiongemma-26B-A4B``)
    or from ``config`` (the keys of ``DiffusionGemmaConfig``: ``text_config``, ``vision_config``, ``canvas_length``)
    for random init. Anything but a DiffusionGemma checkpoint is refused."""
    if (pretrained is None) == (config is None):
        raise ValueError(
            f"Give exactly one of model={pretrained!r} (a hub id or local path) or model_config={config!r} "
            "(DiffusionGemmaConfig keys: text_config, vision_config, canvas_length)."
        )
    kwargs: dict[str, Any] = {"dtype": getattr(torch, torch_dtype)} if torch_dtype else {}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    if config is not None:
        config = {key: value for key, value in config.items() if key != "model_type"}
        hf_config = DiffusionGemmaConfig(**config)
        check_config_keys(hf_config, config)
        for name in ("text_config", "vision_config"):
            if isinstance(config.get(name), dict):
                check_config_keys(getattr(hf_config, name), {k: v for k, v in config[name].items() if k != "model_type"})
        return AutoModelForImageTextToText.from_config(hf_config, **kwargs)  # a DiffusionGemmaForBlockDiffusion
    saved_model_type(pretrained, MODEL_TYPE, "a DiffusionGemma model",
                     "pass a DiffusionGemmaForBlockDiffusion checkpoint (a hub id, or a local folder holding config.json "
                     "and the weights, e.g. one written by save_pretrained), or model_config for random init; use "
                     "MDLMModule for other backbones.")
    return DiffusionGemmaForBlockDiffusion.from_pretrained(pretrained, **kwargs)


def canvas_length_of(pretrained: str | None = None, config: dict[str, Any] | None = None) -> int | None:
    """The ``canvas_length`` of the model :func:`load_diffusion_gemma` builds from the same arguments, without building
    it: ``config``'s (else ``DiffusionGemmaConfig``'s default), or the one in ``pretrained``'s ``config.json``; None
    when neither is a DiffusionGemma config (loading it then fails with the reason)."""
    if config is not None:
        return config["canvas_length"] if "canvas_length" in config else DiffusionGemmaConfig().canvas_length
    if pretrained is None:
        return None
    return getattr(AutoConfig.from_pretrained(pretrained), "canvas_length", None)


class BlockDiffusionGemma(nn.Module):
    """Wraps ``DiffusionGemmaForBlockDiffusion`` (``self.hf``); its forward scores canvas tokens.

    Args:
        hf_model: the transformers model.
        chunk_size: positions per chunk of the fused LM head + cross-entropy (no ``[B, L, V]`` logits).
    """

    def __init__(self, hf_model: nn.Module, chunk_size: int = 2048) -> None:
        super().__init__()
        if not isinstance(hf_model, DiffusionGemmaForBlockDiffusion):
            raise ValueError(
                f"{type(hf_model).__name__} does not have the DiffusionGemma layout (a shared encoder/decoder stack "
                "with a self-conditioning block): pass a DiffusionGemmaForBlockDiffusion."
            )
        self.hf = hf_model
        self.chunk_size = chunk_size
        for layer in (*hf_model.model.encoder.language_model.layers, *hf_model.model.decoder.layers):
            layer.self_attn.register_forward_pre_hook(_layer_kernel_options, with_kwargs=True)

    @property
    def text_config(self):
        return self.hf.config.text_config

    @property
    def flex_attention(self) -> bool:
        """Whether attention runs FlexAttention: masks are then ``BlockMask``s, each layer's kernels
        tiled by :func:`flex_kernel_options`."""
        return compat.attn_implementation(self.text_config) == "flex_attention"

    @property
    def canvas_length(self) -> int:
        return self.hf.config.canvas_length

    @property
    def vocab_size(self) -> int:
        return self.text_config.vocab_size

    def freeze_router(self) -> None:
        """Router weights out of training (docs/DESIGN.md §9.1): routing indices are not differentiable anyway."""
        for layer in self.hf.model.decoder.layers:  # the encoder layers share these parameters
            layer.router.requires_grad_(False)

    def freeze_vision(self) -> None:
        """The vision tower and its projection are unused by text training."""
        self.hf.model.encoder.vision_tower.requires_grad_(False)
        self.hf.model.encoder.embed_vision.requires_grad_(False)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Soft-capped fp32 logits of ``hidden`` (as transformers' forward computes them)."""
        logits = self.hf.lm_head(hidden).float()
        cap = self.text_config.final_logit_softcapping
        return logits if cap is None else cap * torch.tanh(logits / cap)

    def _kernel_options_by_head_dim(self, device: torch.device) -> dict[int, dict[str, int]]:
        """:func:`flex_kernel_options` of every head dim in the stack, for :func:`_layer_kernel_options`."""
        head_dims = {layer.self_attn.head_dim for layer in self.hf.model.decoder.layers}
        return {head_dim: flex_kernel_options(head_dim, device) for head_dim in head_dims}

    def denoise(
        self,
        input_ids: torch.Tensor,
        encoder_masks: dict[str, torch.Tensor | BlockMask],
        canvas_ids: torch.Tensor,
        decoder_masks: dict[str, torch.Tensor | BlockMask],
        decoder_positions: torch.Tensor,
        self_conditioning_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Encode ``input_ids`` ``[B, S]`` causally (with grad), then denoise ``canvas_ids`` ``[B, R]`` at
        ``decoder_positions``; returns the canvas and encoder final hidden states. With ``self_conditioning_mask``
        (``[B]`` bool, training) a first decoder pass runs without grad and its logits condition the second for the
        examples whose coin is set (docs/DESIGN.md §9.3 step 5); without it, one pass with a zero signal
        (evaluation)."""
        cache = DynamicCache()  # no config: a config would trim the sliding layers' cache to the window
        positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        flex = {}
        if self.flex_attention:
            flex["kernel_options_by_head_dim"] = self._kernel_options_by_head_dim(input_ids.device)
        encoded = self.hf.model.encoder(
            input_ids=input_ids, attention_mask=encoder_masks, cache=cache, position_ids=positions, **flex
        )
        unshard_before_cache_backward(self.hf, cache)
        decode = dict(
            decoder_input_ids=canvas_ids, cache=encoded.cache, decoder_attention_mask=decoder_masks,
            decoder_position_ids=decoder_positions, **flex,
        )
        self_conditioning = None
        if self_conditioning_mask is not None:
            with torch.no_grad():  # always run, whatever the coins, so every rank issues the same collectives
                self_conditioning = self.logits(self.hf.model.decoder(**decode).last_hidden_state)
        hidden = self.hf.model.decoder(
            **decode, self_conditioning_logits=self_conditioning, self_conditioning_mask=self_conditioning_mask
        ).last_hidden_state
        return hidden, encoded.last_hidden_state

    def forward(
        self,
        input_ids: torch.Tensor,
        encoder_masks: dict[str, torch.Tensor | BlockMask],
        canvas_ids: torch.Tensor,
        decoder_masks: dict[str, torch.Tensor | BlockMask],
        decoder_positions: torch.Tensor,
        loss_index: torch.Tensor,
        targets: torch.Tensor,
        weights: torch.Tensor,
        self_conditioning_mask: torch.Tensor | None = None,
        ar_targets: torch.Tensor | None = None,
        ar_weights: torch.Tensor | None = None,
    ) -> BlockDiffusionScores:
        """:meth:`denoise`, then ``Σ weights · NLL`` of ``targets`` at the canvas offsets ``loss_index`` (all
        ``[B, K]``) plus, with ``ar_targets`` / ``ar_weights`` (``[B, S]``), ``Σ ar_weights · NLL`` of the encoder's
        next tokens. Fixed shapes, so no device sync: the LM head runs once, over both losses' rows (0-weight rows
        included), its gradients formed in the forward pass (:func:`~lit_dllm.losses.weighted_linear_cross_entropy`:
        one gradient of the tied head, not one per loss)."""
        hidden, encoded = self.denoise(
            input_ids, encoder_masks, canvas_ids, decoder_masks, decoder_positions, self_conditioning_mask
        )
        canvas_rows = hidden.take_along_dim(loss_index[..., None], dim=1).flatten(0, 1)
        parts = [(canvas_rows, targets.flatten(), weights.flatten())]
        if ar_weights is not None:
            parts.append((encoded.flatten(0, 1), ar_targets.flatten(), ar_weights.flatten()))
        rows, row_targets, row_weights = (torch.cat(column) for column in zip(*parts))
        loss, nll, correct = weighted_linear_cross_entropy(
            rows, self.hf.lm_head.weight, row_targets, row_weights=row_weights, chunk_size=self.chunk_size,
            softcap=self.text_config.final_logit_softcapping,
        )
        canvas = loss_index.numel()
        ar_nll = nll[canvas:] if ar_weights is not None else None
        return BlockDiffusionScores(loss, nll[:canvas], correct[:canvas], ar_nll)
