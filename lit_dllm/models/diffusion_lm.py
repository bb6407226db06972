"""A Hugging Face causal-LM stack used as a dLLM denoiser: bidirectional, with a fused LM head.

Plain single-device ``nn.Module``; parallelism is applied from outside. The loss-bearing forward
computes the per-token NLL only at the requested positions, chunk by chunk (``fused`` mode), so
the ``[B, L, V]`` logits are never materialised; everything happens inside ``forward`` so that
FSDP's hooks on this module gather the root-owned parameters (embedding, final norm, LM head).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn
from transformers import PreTrainedModel

from lit_dllm.losses import fused_linear_cross_entropy, selected_nll


class TokenNLL(NamedTuple):
    """Per-token NLL (fp32) and argmax hits at the selected positions, in row-major order."""

    nll: torch.Tensor
    correct: torch.Tensor


def causal_additive_mask(batch: int, length: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``[B, 1, L, L]`` additive mask (0 keep / finfo.min drop) for a causal pass of a bidirectional stack."""
    keep = torch.ones(length, length, dtype=torch.bool, device=device).tril()
    mask = torch.zeros(length, length, dtype=dtype, device=device).masked_fill(~keep, torch.finfo(dtype).min)
    return mask[None, None].expand(batch, 1, length, length)


class DiffusionLM(nn.Module):
    """Wraps a transformers ``*ForCausalLM`` and runs it bidirectionally (diffusion) or causally (AR).

    ``fused=True`` needs the standard layout (``base_model`` returning ``last_hidden_state`` and
    ``get_output_embeddings()``; a ``final_logit_softcapping`` in the config is applied). Remote-code
    models with another layout (e.g. LLaDA) use ``fused=False``: their own logits, scored chunk by
    chunk at the selected positions only.

    Bidirectional attention is switched on through ``config.is_causal = False``, which transformers
    honours for its decoder stacks (SDPA keeps its fused kernels: no mask tensor is built). The
    causal pass, used by hybrid training, passes an explicit additive causal mask.
    """

    def __init__(self, hf_model: PreTrainedModel, chunk_size: int = 2048, fused: bool = True) -> None:
        super().__init__()
        self.hf = hf_model
        self.hf.config.is_causal = False
        self.hf.config.use_cache = False
        self.chunk_size = chunk_size
        self.fused = fused
        self.softcap = getattr(hf_model.config, "final_logit_softcapping", None)

    @property
    def vocab_size(self) -> int:
        return self.hf.get_output_embeddings().weight.shape[0]

    def _attention_mask(self, input_ids: torch.Tensor, causal: bool) -> torch.Tensor | None:
        if not causal:
            return None
        dtype = self.hf.get_input_embeddings().weight.dtype
        if torch.is_autocast_enabled(input_ids.device.type):
            dtype = torch.get_autocast_dtype(input_ids.device.type)
        return causal_additive_mask(*input_ids.shape, dtype, input_ids.device)

    def logits(self, input_ids: torch.Tensor, causal: bool = False) -> torch.Tensor:
        """Full ``[B, L, V]`` logits (generation, and the unfused loss path)."""
        return self.hf(input_ids=input_ids, attention_mask=self._attention_mask(input_ids, causal), use_cache=False).logits

    def token_nll(self, input_ids: torch.Tensor, targets: torch.Tensor, positions: torch.Tensor, causal: bool) -> TokenNLL:
        """NLL of ``targets`` at ``positions``; fused with the LM head when ``self.fused``."""
        if not self.fused:
            logits = self.logits(input_ids, causal)
            nll = selected_nll(logits, targets, positions, chunk_size=self.chunk_size)
            with torch.no_grad():
                correct = logits[positions].argmax(-1) == targets[positions]
            return TokenNLL(nll, correct)
        mask = self._attention_mask(input_ids, causal)
        hidden = self.hf.base_model(input_ids=input_ids, attention_mask=mask, use_cache=False).last_hidden_state
        head = self.hf.get_output_embeddings()
        nll, correct = fused_linear_cross_entropy(
            hidden[positions], head.weight, targets[positions], head.bias, self.chunk_size, self.softcap
        )
        return TokenNLL(nll, correct)

    def forward(
        self,
        input_ids: torch.Tensor,
        targets: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        causal: bool = False,
    ) -> torch.Tensor | TokenNLL:
        """Logits ``[B, L, V]`` when ``targets`` is None, else :class:`TokenNLL` at ``positions``.

        ``positions`` is a bool ``[B, L]`` selecting where the output at position ``i`` is scored
        against ``targets[:, i]`` (``causal=True`` scores position ``i`` against the next token's
        target by passing already-shifted targets and positions).
        """
        if targets is None:
            return self.logits(input_ids, causal)
        if positions is None:
            positions = torch.ones_like(targets, dtype=torch.bool)
        return self.token_nll(input_ids, targets, positions, causal)
