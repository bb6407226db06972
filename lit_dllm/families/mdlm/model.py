"""A Hugging Face causal-LM stack used as a dLLM denoiser: bidirectional, with a fused LM head.

:class:`DiffusionLM` is :class:`~lit_dllm.core.backbone.CausalLM` (the fused, chunked scoring) with the
stack's attention switched to bidirectional; a causal pass (hybrid training) is still available.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from lit_dllm.core.backbone import CausalLM, TokenNLL

__all__ = ["DiffusionLM", "TokenNLL", "causal_additive_mask"]


def causal_additive_mask(batch: int, length: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``[B, 1, L, L]`` additive mask (0 keep / finfo.min drop) for a causal pass of a bidirectional stack."""
    keep = torch.ones(length, length, dtype=torch.bool, device=device).tril()
    mask = torch.zeros(length, length, dtype=dtype, device=device).masked_fill(~keep, torch.finfo(dtype).min)
    return mask[None, None].expand(batch, 1, length, length)


class DiffusionLM(CausalLM):
    """Wraps a transformers ``*ForCausalLM`` and runs it bidirectionally (diffusion) or causally (AR).

    Bidirectional attention is switched on through ``config.is_causal = False``, which transformers
    honours for its decoder stacks (SDPA keeps its fused kernels: no mask tensor is built). The
    causal pass, used by hybrid training, asks SDPA for causal attention (``is_causal=True``, no mask
    tensor: its flash and cuDNN kernels stay available) when every layer is full attention under
    ``sdpa``; otherwise (eager, flex, sliding-window layers, which would get a bidirectional window
    mask) it passes an explicit additive causal mask. ``fused``: see :class:`CausalLM`.
    """

    def __init__(self, hf_model: PreTrainedModel, chunk_size: int = 2048, fused: bool = True) -> None:
        super().__init__(hf_model, chunk_size, fused)
        self.hf.config.is_causal = False
        self.hf.config.use_cache = False

    @property
    def causal_without_mask(self) -> bool:
        """The causal pass can pass the ``is_causal`` flag: sdpa attention with every layer full attention, or context
        parallelism (its schemes build the whole sequence's causal rows from the flag; a mask built here would be a
        shard's)."""
        types = getattr(self.hf.config, "layer_types", None) or ["full_attention"]
        full = all(kind == "full_attention" for kind in types)
        return full and (self.attention_implementation == "sdpa" or self.context_parallel is not None)

    def _attention_mask(self, input_ids: torch.Tensor, causal: bool, document_ids: torch.Tensor | None):
        if document_ids is not None:
            return self.document_mask(document_ids, causal)
        if not causal:
            return None
        return causal_additive_mask(*input_ids.shape, self.mask_dtype(input_ids), input_ids.device)

    def forward(
        self,
        input_ids: torch.Tensor,
        targets: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        causal: bool = False,
        weights: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        **model_kwargs,
    ) -> torch.Tensor | TokenNLL:
        """Logits ``[B, L, V]`` when ``targets`` is None, else :class:`TokenNLL` at ``positions``.

        ``positions`` is a bool ``[B, L]`` selecting where the output at position ``i`` is scored
        against ``targets[:, i]`` (``causal=True`` scores position ``i`` against the next token's
        target by passing already-shifted targets and positions). ``weights``: see :class:`CausalLM`.
        ``document_ids`` (packed rows, ``[B, L]``): attend within each document only, bidirectionally or
        ``causal``; pass the documents' ``position_ids`` too.
        ``model_kwargs`` go to the transformers model: the KV-cached sampler
        (:mod:`lit_dllm.families.mdlm.fast_sampler`) passes ``cache``, ``use_cache=True`` and ``position_ids`` here, so that its passes run this module's hooks
        (FSDP2's gather the embedding and LM head it holds as the root).
        """
        if causal and self.causal_without_mask and document_ids is None:
            return super().forward(input_ids, targets, positions, None, weights, is_causal=True, **model_kwargs)
        mask = self._attention_mask(input_ids, causal, document_ids)
        return super().forward(input_ids, targets, positions, mask, weights, **model_kwargs)
