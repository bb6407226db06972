"""RL for an autoregressive policy: :class:`CausalGRPOModule`, the shared RL step
(:class:`~lit_dllm.rl.step.GRPOMixin`) over :class:`~lit_dllm.families.causal_lm.module.CausalLMModule`, with exact
(teacher-forced) log-probabilities."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence

from lit_dllm.families.causal_lm.module import CausalLMModule
from lit_dllm.rl.step import GRPOMixin, Rollouts

__all__ = ["CausalGRPOModule"]


class CausalGRPOModule(GRPOMixin, CausalLMModule):
    """RL for an autoregressive policy: GRPO (``rl.objective: clipped``), ESPO's sequence ratio (``sequence``) or wd1
    (``weighted``) with exact log-probabilities; the same rewards and data as ``DiffuGRPOModule``, so a dLLM and its
    AR teacher share one table. Rollouts: ``hf.generate`` sampling at ``rl.rollout_temperature``, keyed per completion
    (:class:`~lit_dllm.families.causal_lm.module.KeyedSampling`: the policy's own distribution, the model's
    ``top_k`` / ``top_p`` left out, as the exact log-probabilities of the update score it).

    Args:
        rl: the RL settings (:class:`~lit_dllm.rl.settings.Reinforcement`; ``estimator`` None or ``exact``;
            ``p_mask_prompt`` and the ELBO's settings unused).
        Other arguments: see :class:`~lit_dllm.families.causal_lm.module.CausalLMModule`.
    """

    policy_family = "causal_lm"
    tiny_config = "configs/grpo_ar_tiny.yaml"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.estimator != "exact":
            raise ValueError(f"rl.estimator={self.rl.estimator!r}: an autoregressive policy's log-probabilities are "
                             "exact (teacher forcing); drop rl.estimator or set it to 'exact'.")

    def sample(self, prompts: list[Tensor], keys: Tensor) -> tuple[list[Tensor], list[Tensor]]:
        """Completions (cut before eos), each row's noise keyed by ``keys``; the sampler's log-probabilities are left
        unknown (NaN): HF's cached decoding and the teacher-forced pass are the same computation."""
        completions = self.generate_ids(prompts, self.rollout_length, temperature=self.rl.rollout_temperature,
                                        keys=keys)
        return completions, [torch.empty(0, device=self.device) for _ in completions]

    def layout(self, prompts: list[Tensor], completions: list[Tensor], sampled_logp: list[Tensor]) -> dict:
        """Rows ``[prompt][completion][eos]`` (eos where the completion ended before ``rollout_length``), every
        completion token and that eos scored."""
        eos = self.eos_token_id if self.eos_token_id is not None else self.pad_token_id
        ended = [torch.cat([c, c.new_tensor([eos])]) if len(c) < self.rollout_length else c for c in completions]
        width = max(len(c) for c in ended)
        targets = pad_sequence(ended, batch_first=True, padding_value=self.pad_token_id)
        scored = torch.arange(width, device=self.device)[None, :] < torch.tensor(
            [len(c) for c in ended], device=self.device)[:, None]
        prompt_lengths = torch.tensor([len(p) for p in prompts], device=self.device)
        ids = pad_sequence([torch.cat([p, c]) for p, c in zip(prompts, ended)], batch_first=True,
                           padding_value=self.pad_token_id)
        positions = (prompt_lengths[:, None] + torch.arange(width, device=self.device)).clamp_max(ids.shape[1] - 1)
        return {"ids": ids, "prompt_lengths": prompt_lengths, "positions": positions, "targets": targets,
                "scored": scored, "rollout_logp": torch.full(targets.shape, float("nan"), device=self.device)}

    def token_logps(self, rollouts: Rollouts, rows: slice | Tensor, iteration: int, model: torch.nn.Module | None = None,
                    draw: int = 0) -> tuple[Tensor, Tensor]:
        """Exact: teacher forcing, the hidden state at each position predicting the next token, through the chunked
        LM head."""
        ids = rollouts.ids[rows]
        attention_mask = torch.arange(ids.shape[1], device=ids.device)[None, :] < (
            rollouts.prompt_lengths[rows] + rollouts.scored[rows].sum(1))[:, None]
        out = (model or self.model)(ids, targets=rollouts.targets[rows], attention_mask=attention_mask.long(),
                                    gather_at=rollouts.positions[rows] - 1)
        return out.logp, out.entropy

    def exact_logps(self, rollouts: Rollouts, rows: slice | Tensor) -> Tensor:
        with torch.no_grad():
            return self.token_logps(rollouts, rows, 0)[0]
