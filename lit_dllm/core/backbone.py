"""The backbone every Hugging Face causal-LM stack is trained as: a transformers ``*ForCausalLM`` scored with a fused
LM head (:class:`CausalLM`). The causal-LM family trains it as it is; the MDLM family's
:class:`~lit_dllm.families.mdlm.model.DiffusionLM` runs the same wrapper bidirectionally.

Plain single-device ``nn.Module``; parallelism is applied from outside. The loss-bearing forward computes
the per-token NLL only at the requested positions, chunk by chunk (``fused`` mode), so the ``[B, L, V]``
logits are never materialised; everything happens inside ``forward`` so that FSDP's hooks on this module
gather the root-owned parameters (embedding, final norm, LM head).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn
from transformers import PreTrainedModel

from lit_dllm.attention import document_mask
from lit_dllm.compat import attn_implementation
from lit_dllm.context_parallel import ContextParallel
from lit_dllm.losses import fused_linear_cross_entropy, linear_log_probs, selected_nll, weighted_linear_cross_entropy

__all__ = ["CausalLM", "TokenLogProbs", "TokenNLL"]


class TokenNLL(NamedTuple):
    """Per-token NLL (fp32) and argmax hits at the selected positions, in row-major order; with ``weights``, also
    their weighted sum ``total`` (differentiable; the fused head then returns ``nll`` detached)."""

    nll: torch.Tensor
    correct: torch.Tensor
    total: torch.Tensor | None = None


class TokenLogProbs(NamedTuple):
    """Log-probabilities of the targets (fp32, differentiable) and the predictions' entropies (fp32, detached) at
    gathered positions, ``[B, K]`` each."""

    logp: torch.Tensor
    entropy: torch.Tensor


class CausalLM(nn.Module):
    """Wraps a transformers ``*ForCausalLM``; its forward scores targets at selected positions.

    ``attention_mask`` is passed to the transformers model as it is: None (the default) runs the model's own
    causal attention, which suits right-padded rows (padding comes after every token that is scored).

    ``fused=True`` needs the standard layout (``base_model`` returning ``last_hidden_state`` and
    ``get_output_embeddings()``; a ``final_logit_softcapping`` in the config is applied). Remote-code
    models with another layout use ``fused=False``: their own logits, scored chunk by chunk at the
    selected positions only.

    Args:
        hf_model: the transformers causal LM (``self.hf``; export it with ``hf.save_pretrained``).
        chunk_size: positions per chunk of the LM head + cross-entropy.
        fused: apply the LM head only at the selected positions (else score the model's full logits).
    """

    context_parallel: ContextParallel | None = None
    """Under context parallelism (:func:`~lit_dllm.context_parallel.apply_context_parallel`): the inputs are this rank's
    shard of every row, the attention masks are built for the whole rows."""

    def __init__(self, hf_model: PreTrainedModel, chunk_size: int = 2048, fused: bool = True) -> None:
        super().__init__()
        self.hf = hf_model
        self.chunk_size = chunk_size
        self.fused = fused
        self.softcap = getattr(hf_model.config, "final_logit_softcapping", None)

    @property
    def vocab_size(self) -> int:
        return self.hf.get_output_embeddings().weight.shape[0]

    def mask_dtype(self, input_ids: torch.Tensor) -> torch.dtype:
        """The dtype of an additive attention mask: the autocast dtype under autocast, else the weights'."""
        if torch.is_autocast_enabled(input_ids.device.type):
            return torch.get_autocast_dtype(input_ids.device.type)
        return self.hf.get_input_embeddings().weight.dtype

    @property
    def attention_implementation(self) -> str:
        """The attention that runs on whole sequences (``sdpa``, ``flex_attention``...; inside Ulysses under context
        parallelism)."""
        context = self.context_parallel
        return attn_implementation(self.hf.config) if context is None else context.attention

    def document_mask(self, document_ids: torch.Tensor, causal: bool):
        """Attention within the documents of packed rows (:func:`~lit_dllm.attention.document_mask`) for this
        model's attention implementation; under context parallelism, of the whole rows (Ulysses) or of this shard's
        query rows against the whole rows (``all_gather``)."""
        rows = None
        if self.context_parallel is not None:
            rows = self.context_parallel.query_slice(document_ids.shape[1])
            document_ids = self.context_parallel.gather(document_ids)
        return document_mask(document_ids, causal, self.attention_implementation, self.mask_dtype(document_ids), rows)

    def logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **model_kwargs
               ) -> torch.Tensor:
        """Full ``[B, L, V]`` logits (generation, and the unfused loss path); ``model_kwargs`` go to the model (no KV
        cache unless they pass one with ``use_cache=True``, as :mod:`lit_dllm.families.mdlm.fast_sampler` does)."""
        model_kwargs.setdefault("use_cache", False)
        return self.hf(input_ids=input_ids, attention_mask=attention_mask, **model_kwargs).logits

    def token_nll(
        self, input_ids: torch.Tensor, targets: torch.Tensor, positions: torch.Tensor, attention_mask=None,
        weights: torch.Tensor | None = None, **model_kwargs,
    ) -> TokenNLL:
        """NLL of ``targets`` at ``positions``; fused with the LM head when ``self.fused``; with ``weights``
        (``[B, L]``), also ``Σ weights · nll`` over the positions (fused: gradients formed in the forward pass,
        :func:`~lit_dllm.losses.weighted_linear_cross_entropy`)."""
        if not self.fused:
            logits = self.logits(input_ids, attention_mask, **model_kwargs)
            nll = selected_nll(logits, targets, positions, chunk_size=self.chunk_size)
            with torch.no_grad():
                correct = logits[positions].argmax(-1) == targets[positions]
            total = None if weights is None else (nll * weights[positions]).sum()
            return TokenNLL(nll, correct, total)
        outputs = self.hf.base_model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False,
                                     **model_kwargs)
        # integer indices, found once the stack's forward is queued: counting the positions syncs with the device,
        # which meanwhile runs that forward (counted first, the device would idle while the host queues it), and no
        # boolean index (nor its backward) syncs again
        rows = positions.nonzero(as_tuple=True)
        hidden, targets, head = outputs.last_hidden_state[rows], targets[rows], self.hf.get_output_embeddings()
        if weights is None:
            return TokenNLL(*fused_linear_cross_entropy(
                hidden, head.weight, targets, head.bias, self.chunk_size, self.softcap
            ))
        total, nll, correct = weighted_linear_cross_entropy(
            hidden, head.weight, targets, weights[rows], head.bias, self.chunk_size, self.softcap
        )
        return TokenNLL(nll, correct, total)

    def token_log_probs(self, input_ids: torch.Tensor, targets: torch.Tensor, gather_at: torch.Tensor,
                        attention_mask=None, **model_kwargs) -> TokenLogProbs:
        """:class:`TokenLogProbs` of ``targets`` ``[B, K]`` predicted at the positions ``gather_at`` ``[B, K]``
        (column indices, repeats allowed): the LM head applied there only, chunk by chunk
        (:func:`~lit_dllm.losses.linear_log_probs`; unfused: the model's logits, gathered)."""
        shape, flat = targets.shape, targets.reshape(-1)
        if self.fused:
            hidden = self.hf.base_model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False,
                                        **model_kwargs).last_hidden_state
            head = self.hf.get_output_embeddings()
            picked = hidden.gather(1, gather_at[..., None].expand(-1, -1, hidden.shape[-1])).flatten(0, 1)
            logp, entropy = linear_log_probs(picked, head.weight, flat, head.bias, self.chunk_size, self.softcap)
        else:
            logits = self.logits(input_ids, attention_mask, **model_kwargs)
            picked = logits.gather(1, gather_at[..., None].expand(-1, -1, logits.shape[-1])).flatten(0, 1)
            logp = torch.log_softmax(picked.float(), -1)
            entropy = -(logp.exp() * logp).sum(-1).detach()
            logp = logp.gather(-1, flat[:, None]).squeeze(-1)
        return TokenLogProbs(logp.view(shape), entropy.view(shape))

    def forward(
        self,
        input_ids: torch.Tensor,
        targets: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        weights: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        gather_at: torch.Tensor | None = None,
        **model_kwargs,
    ) -> torch.Tensor | TokenNLL | TokenLogProbs:
        """Logits ``[B, L, V]`` when ``targets`` is None, else :class:`TokenNLL` at ``positions``.

        ``positions`` is a bool ``[B, L]`` selecting where the output at position ``i`` is scored against
        ``targets[:, i]`` (for next-token training, pass :func:`~lit_dllm.data.batch.shifted_targets`); None scores every position.
        ``weights`` (``[B, L]``): also return ``Σ weights · nll`` over the positions as ``total``, the cheaper
        way to train on a weighted sum. ``document_ids`` (packed rows, ``[B, L]``): attend causally within each
        document only (pass the documents' ``position_ids`` too). ``gather_at`` (``[B, K]`` column indices, with
        ``targets`` ``[B, K]``): :meth:`token_log_probs` instead. ``model_kwargs`` (e.g. ``is_causal``,
        ``position_ids``) go to the transformers model.
        """
        if self.context_parallel is not None and "position_ids" not in model_kwargs:
            model_kwargs["position_ids"] = self.context_parallel.positions(input_ids)
        if document_ids is not None:
            attention_mask = self.document_mask(document_ids, causal=True)
        if gather_at is not None:
            return self.token_log_probs(input_ids, targets, gather_at, attention_mask, **model_kwargs)
        if targets is None:
            return self.logits(input_ids, attention_mask, **model_kwargs)
        if positions is None:
            positions = torch.ones_like(targets, dtype=torch.bool)
        return self.token_nll(input_ids, targets, positions, attention_mask, weights, **model_kwargs)
