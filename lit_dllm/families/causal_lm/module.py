"""Plain autoregressive (next-token) SFT and pre-training of any transformers causal LM.

Same data as the diffusion families (``DLLMDataModule``: prompt/response, chat, text): position ``i`` predicts
token ``i+1`` wherever ``loss_mask[i+1]``, the NLL summed and divided by the global count of those targets.
The model keeps its own causal attention (rows are right-padded, so padding never precedes a scored token),
and the LM head runs only at the target positions (no ``[B, L, V]`` logits). Answers come from
transformers' own ``generate`` (sampled, with ``keys``, by keyed draws: :class:`KeyedSampling`);
:meth:`CausalLMModule.save_pretrained` exports a plain Hugging Face folder.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any

import torch
from torch.distributed.fsdp import FSDPModule
from transformers import LogitsProcessor

from lit_dllm.core.backbone import CausalLM
from lit_dllm.core.build_backbone import build_backbone
from lit_dllm.core.generation import DEFAULT_GEN_LENGTH, FAMILY_KEY, GenerationMixin
from lit_dllm.hub.hf import HUB_OR_PATH, RANDOM_INIT, require_exactly_one
from lit_dllm.settings import CausalBackbone, Generation, settings_group
from lit_dllm.core.token_loss import StepLoss, TokenLossModule
from lit_dllm.data.batch import cut_rows_at_eos, document_inputs, real_tokens, shifted_targets
from lit_dllm.noise.keys import Stream, check_keys, keyed_categorical
from lit_dllm.losses import DLLMLossOutput


class KeyedSampling(LogitsProcessor):
    """``generate``'s sampling keyed per row: new token ``t`` of row ``b`` is drawn from softmax(scores / temperature)
    by :func:`~lit_dllm.noise.keys.keyed_categorical` at ``(keys[b], t)`` and every other score set to -inf, so
    ``generate``'s own sampling takes it. A row's tokens thus depend on its key and its own logits, not on the other
    rows, the batch size or the rank. It runs after ``generate``'s processors (a repetition penalty, ...) and before
    its warpers, so the model's ``top_k`` / ``top_p`` do not apply: the draw is from the model's distribution at
    ``temperature``.

    Args:
        keys: ``[B]`` int64, one per row.
        temperature: > 0.
        prompt_width: the (left-padded) prompts' width: the count of new tokens is the length past it.
    """

    def __init__(self, keys: torch.Tensor, temperature: float, prompt_width: int) -> None:
        self.keys, self.temperature, self.prompt_width = keys, temperature, prompt_width

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        probs = torch.softmax(scores.float() / self.temperature, -1)
        tokens = keyed_categorical(probs, self.keys, Stream.RL_ROLLOUT, input_ids.shape[1] - self.prompt_width)
        return torch.full_like(scores, -torch.inf).scatter_(1, tokens[:, None], 0.0)


class CausalLMModule(GenerationMixin, TokenLossModule):
    """Next-token training of a transformers causal LM, with exact-match validation and ``save_pretrained`` export.

    Logs ``train/loss`` (mean next-token NLL), ``val/loss`` (the same, over the validation set),
    ``val/next_token_accuracy`` (argmax hits over supervised targets that are real tokens) and
    ``val/exact_match`` (greedy answers to the validation prompts, see :class:`GenerationMixin`).

    Args:
        vocab_size: linked from the data module, like the keyword arguments ``pad_token_id`` (left-pads generation
            batches), ``eos_token_id`` (ends answers), ``tokenizer`` (saved by :meth:`save_pretrained`) and
            ``mask_token_id`` (accepted and unused; may be None).
        backbone: the transformers causal LM (:class:`~lit_dllm.settings.CausalBackbone`): exactly one of
            ``model`` (pretrained) or ``model_config`` (random init; ``vocab_size``, ``pad_token_id`` and
            ``eos_token_id`` default to the data module's, so an exported model's ``generate`` stops at the
            tokenizer's eos).
        fused_loss: apply the LM head only at the target positions, chunk by chunk (never ``[B, L, V]`` logits);
            False scores the model's own full logits (for remote-code models without the standard layout).
        loss_chunk_size: target positions per LM-head chunk.
        generation: answers and their scoring (:class:`~lit_dllm.settings.Generation`); ``temperature`` > 0
            samples (other sampling settings, e.g. ``top_p``, come from the model's ``generation_config``).
        Other arguments: see :class:`TokenLossModule`.
    """

    accuracy_name = "next_token_accuracy"

    def __init__(
        self,
        vocab_size: int,
        backbone: CausalBackbone = CausalBackbone(),
        fused_loss: bool = True,
        loss_chunk_size: int = 2048,
        generation: Generation = Generation(),
        **kwargs: Any,
    ) -> None:
        self.backbone = settings_group("backbone", CausalBackbone, backbone)
        self.generation = settings_group("generation", Generation, generation)
        super().__init__(vocab_size, **kwargs)
        require_exactly_one(("model", self.backbone.model, HUB_OR_PATH),
                            ("model_config", self.backbone.model_config, RANDOM_INIT))
        if loss_chunk_size <= 0:
            raise ValueError(f"loss_chunk_size={loss_chunk_size} must be a positive number of positions.")
        self.fused_loss, self.loss_chunk_size = fused_loss, loss_chunk_size
        self.save_settings(backbone=self.backbone, fused_loss=fused_loss, loss_chunk_size=loss_chunk_size,
                           generation=self.generation)

    def export_config(self) -> dict[str, Any]:
        """The family (``lit_dllm_family: causal_lm``), which an RL module checks its start by."""
        return {FAMILY_KEY: "causal_lm"}

    # ------------------------------------------------------------------ hooks
    def build_model(self) -> CausalLM:
        return build_backbone(self, CausalLM, self.loss_chunk_size, self.fused_loss, pad_token_id=self.pad_token_id,
                              eos_token_id=self.eos_token_id)

    def prepare_batch(self, batch: dict, keys: torch.Tensor) -> dict:
        """Next-token targets and positions of the whole rows, and which targets are real tokens (not padding)."""
        documents = batch.get("document_ids")
        targets, positions = shifted_targets(batch["input_ids"], batch["loss_mask"], documents)
        real = shifted_targets(batch["input_ids"], real_tokens(batch), documents)[1]
        return {"targets": targets, "positions": positions, "real_targets": real}

    def token_counts(self, batch: dict, shifted: dict) -> dict[str, torch.Tensor]:
        return {"ar": shifted["positions"].sum()}

    def compute_loss(self, batch: dict, shifted: dict, denominators: dict[str, torch.Tensor]) -> StepLoss:
        positions = shifted["positions"]
        ones = torch.ones_like(positions, dtype=torch.float32)
        scored = self.model(batch["input_ids"], targets=shifted["targets"], positions=positions, weights=ones,
                            **document_inputs(batch))
        loss = scored.total / denominators["ar"]
        real = shifted["real_targets"][positions]
        return StepLoss(DLLMLossOutput(loss, loss.detach()), (scored.correct & real).sum(), real.sum())

    # ------------------------------------------------------------------ generation
    @contextmanager
    def gathered(self):
        """Root-owned parameters (embedding, final norm, head) unsharded under FSDP2 for the block: ``generate``
        calls the transformers model directly, past the root's hooks."""
        sharded = isinstance(self.model, FSDPModule)
        if sharded:
            self.model.unshard()
        try:
            yield
        finally:
            if sharded:
                self.model.reshard()

    def generate_ids(self, prompts: list[torch.Tensor], max_new_tokens: int | None = None,
                     temperature: float | None = None, keys: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Answers (cut before the first eos) from ``hf.generate`` on the left-padded prompts, at ``temperature``
        (None: the generation group's; 0: greedy); sampled with ``keys`` (``[B]`` int64, one per prompt) by keyed
        draws (:class:`KeyedSampling`), else by ``generate``'s own."""
        length = max_new_tokens or self.generation.gen_length or DEFAULT_GEN_LENGTH
        self.check_fits(prompts, length)
        if not prompts:
            return []
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long, device=self.device)
        attention_mask = torch.zeros_like(ids)
        for row, prompt in enumerate(prompts):
            ids[row, width - len(prompt) :] = prompt
            attention_mask[row, width - len(prompt) :] = 1
        temperature = self.generation.temperature if temperature is None else temperature
        sampling = {"do_sample": True, "temperature": temperature} if temperature > 0 else {"do_sample": False}
        if keys is not None and temperature > 0:
            keys = check_keys(keys, len(prompts), self.device)
            sampling["logits_processor"] = [KeyedSampling(keys, temperature, width)]
        with self.generating(), self.gathered():
            out = self.model.hf.generate(
                ids,
                attention_mask=attention_mask,
                max_new_tokens=length,
                eos_token_id=self.eos_token_id,
                pad_token_id=self.pad_token_id,
                synced_gpus=isinstance(self.model, FSDPModule),  # every shard holder runs every forward
                **sampling,
            )
        return cut_rows_at_eos(out[:, width:], self.eos_token_id)

    # ------------------------------------------------------------------ evaluation
    exact_scoring = True

    @torch.no_grad()
    def exact_scores(self, pairs: list[tuple[list[int], list[int]]], batch_size: int) -> list[tuple[float, bool]]:
        """Exact ``(Σ log p(continuation | context), greedy)`` per pair of token ids: right-padded batches of
        ``batch_size`` (causal attention never sees the padding), the context cut from the left to the model's
        positions."""
        results: list[tuple[float, bool] | None] = [None] * len(pairs)
        limit = self.max_positions
        inputs = [(ctx + cont)[-(limit + 1) :][:-1] if limit else (ctx + cont)[:-1] for ctx, cont in pairs]
        order = sorted(range(len(pairs)), key=lambda i: -len(inputs[i]))
        for start in range(0, len(order), batch_size):
            chunk = order[start : start + batch_size]
            ids = torch.full((len(chunk), len(inputs[chunk[0]])), self.pad_token_id, dtype=torch.long)
            for row, i in enumerate(chunk):
                ids[row, : len(inputs[i])] = torch.tensor(inputs[i])
            logits = self.model(ids.to(self.device)).float().log_softmax(-1).cpu()
            for row, i in enumerate(chunk):
                cont = torch.tensor(pairs[i][1])
                end = len(inputs[i])
                logprobs = logits[row, end - len(cont) : end]
                score = float(logprobs.gather(-1, cont[:, None]).sum())
                results[i] = (score, bool((logprobs.argmax(-1) == cont).all()))
        return results

    tiny_config = "configs/ar_tiny.yaml"
    takes_context_parallel = True
