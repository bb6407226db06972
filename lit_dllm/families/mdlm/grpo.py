"""RL for a masked-diffusion policy (MDLM / LLaDA): :class:`DiffuGRPOModule`, the shared RL step
(:class:`~lit_dllm.rl.step.GRPOMixin`) over :class:`~lit_dllm.families.mdlm.module.MDLMModule`, with three estimators
of a completion's token log-probabilities (``rl.estimator``):

- ``one_pass`` (d1): one forward with the whole canvas masked and each prompt token masked with probability
  ``p_mask_prompt``: cheap, biased, a state block-wise rollouts never visit.
- ``exact`` (JustGRPO): the rollouts are left to right (blocks of one token), so a completion's likelihood is the
  product of its tokens' probabilities each given the clean prefix and masks from it on; token ``k`` of every
  completion is one row ``[prompt][tokens < k][masks][pad]`` laid out exactly as the sampler saw it, all the rows of a
  micro-batch in one forward.
- ``elbo``: the masked-diffusion ELBO, ``E_t[(1/t) Σ_masked log p(x_i | x_t)]`` per token, over ``mc_samples``
  masking rates ``t`` in (eps, 1 - eps) (stratified, or Gauss-Legendre quadrature) and, ``coupled``, each sample's
  complementary mask at ``1 - t`` weighted ``1 / (1 - t)`` (every token scored once per sample).

Every draw is keyed by (example, completion, inner update): the old-policy pass and the update of one inner update
see the same masks, so for an unchanged policy the ratio is exactly 1.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence

from lit_dllm.core.trace import DenoisingTrace
from lit_dllm.noise.keys import Stream, keyed_rand
from lit_dllm.families.mdlm.module import LLaDAGeneration, MDLMModule
from lit_dllm.families.mdlm.sampler import canvas_width
from lit_dllm.rl.step import GRPOMixin, Rollouts

__all__ = ["DiffuGRPOModule"]


class DiffuGRPOModule(GRPOMixin, MDLMModule):
    """RL for a masked-diffusion policy (MDLM / LLaDA): an objective (``rl.objective``: ``clipped``, GRPO's, with
    ``one_pass`` d1's diffu-GRPO; ``sequence``, ESPO's; ``weighted``, wd1) over an estimator (``rl.estimator``: see the
    module docstring; by default ``exact``, with left-to-right rollouts). Rollouts come from the module's sampler
    (``generation.sampler``: ``llada`` or ``fast``, its block length, steps and threshold; here ``fast`` in blocks of
    one token unless set) at ``rl.rollout_temperature``; the completion is the whole canvas of ``rollout_length``
    tokens, scored up to its first eos.

    Args:
        rl: the RL settings (:class:`~lit_dllm.rl.settings.Reinforcement`).
        Other arguments: see :class:`~lit_dllm.families.mdlm.module.MDLMModule` (``backbone.model``: the SFT export
            to start from).
    """

    policy_family = "mdlm"
    tiny_config = "configs/grpo_tiny.yaml"
    default_estimator = "exact"
    """JustGRPO's exact left-to-right likelihood: of the estimators the one that lifted the real model most
    (docs/benchmarks/rl.md); block-wise rollouts take ``one_pass`` or ``elbo``."""

    def __init__(self, *args: Any, generation: LLaDAGeneration = LLaDAGeneration(sampler="fast", gen_block_length=1),
                 **kwargs: Any):
        super().__init__(*args, generation=generation, **kwargs)
        if self.estimator == "exact" and self.generation.gen_block_length != 1:
            raise ValueError(
                f"rl.estimator='exact' scores each token as a left-to-right rollout commits it, but "
                f"generation.gen_block_length={self.generation.gen_block_length} rolls out blocks of several tokens: set "
                "--model.init_args.generation.gen_block_length=1, or estimate otherwise: --model.init_args.rl.estimator="
                "one_pass (d1) or elbo."
            )

    @property
    def completion_length(self) -> int:
        """The canvas: :attr:`rollout_length` rounded up to whole blocks."""
        return self.sampler_settings(self.rollout_length)["gen_length"]

    def sample(self, prompts: list[Tensor], keys: Tensor) -> tuple[list[Tensor], list[Tensor]]:
        """Completions (cut before eos), each row's noise keyed by ``keys``, and the log-probability the sampler gave
        each committed token."""
        trace = DenoisingTrace()
        completions = self.generate_ids(prompts, self.rollout_length, trace=trace,
                                        temperature=self.rl.rollout_temperature, keys=keys)
        confidence = trace.confidence.to(self.device)
        return completions, list(confidence.clamp_min(1e-30).log())

    def layout(self, prompts: list[Tensor], completions: list[Tensor], sampled_logp: list[Tensor]) -> dict:
        """Rows ``[prompt][canvas][pad]`` as the sampler laid them out: the canvas is the completion, its eos and
        the eos fill after it (``rollout_length`` tokens), scored up to and including the first eos."""
        length = self.completion_length
        eos = self.eos_token_id if self.eos_token_id is not None else self.pad_token_id
        canvases = torch.full((len(prompts), length), eos, dtype=torch.long, device=self.device)
        ends = torch.tensor([len(c) for c in completions], device=self.device)
        for row, completion in enumerate(completions):
            canvases[row, : len(completion)] = completion
        prompt_lengths = torch.tensor([len(p) for p in prompts], device=self.device)
        rows = [torch.cat([p, c]) for p, c in zip(prompts, canvases)]
        ids = pad_sequence(rows, batch_first=True, padding_value=self.pad_token_id)
        width = canvas_width(int(prompt_lengths.max()), length, self.generation.gen_canvas_multiple)
        ids = torch.nn.functional.pad(ids, (0, width - ids.shape[1]), value=self.pad_token_id)
        offsets = torch.arange(length, device=self.device)
        rollout_logp = torch.full((len(prompts), length), float("nan"), device=self.device)
        for row, logp in enumerate(sampled_logp):
            width = min(length, len(logp))
            rollout_logp[row, :width] = logp[:width]
        return {"ids": ids, "prompt_lengths": prompt_lengths, "positions": prompt_lengths[:, None] + offsets,
                "targets": canvases, "scored": offsets[None, :] <= ends[:, None], "rollout_logp": rollout_logp}

    # ------------------------------------------------------------------ estimators
    def forward_rows(self, rollouts: Rollouts) -> Tensor:
        """``[N]``: a completion's rows in a scoring forward: its scored tokens (``exact``), its ELBO passes
        (``elbo``: ``mc_samples``, twice that ``coupled``) or one (``one_pass``)."""
        if self.estimator == "exact":
            return rollouts.scored.sum(1).cpu()
        passes = self.rl.mc_samples * (2 if self.rl.coupled else 1) if self.estimator == "elbo" else 1
        return torch.full((len(rollouts.rewards),), passes, dtype=torch.long)

    def token_logps(self, rollouts: Rollouts, rows: slice | Tensor, iteration: int, model: torch.nn.Module | None = None,
                    draw: int = 0) -> tuple[Tensor, Tensor]:
        """The estimator's log-probability of each canvas token and its prediction's entropy, ``[n, C]`` each
        (0 at tokens the estimate does not score)."""
        model = model or self.model
        if self.estimator == "exact":
            return self.exact_token_logps(rollouts, rows, model)
        if self.estimator == "elbo":
            return self.elbo_token_logps(rollouts, rows, iteration, model, draw)
        return self.one_pass_token_logps(rollouts, rows, iteration, model, draw)

    def one_pass_token_logps(self, rollouts: Rollouts, rows: slice | Tensor, iteration: int, model: torch.nn.Module,
                             draw: int) -> tuple[Tensor, Tensor]:
        """d1's estimate: every canvas token masked, each prompt token masked with probability ``p_mask_prompt``."""
        ids, positions = rollouts.ids[rows], rollouts.positions[rows]
        keys = self.estimator_keys(rollouts, rows, iteration, draw)
        columns = torch.arange(ids.shape[1], device=ids.device)
        in_prompt = columns[None, :] < rollouts.prompt_lengths[rows][:, None]
        masked = in_prompt & (keyed_rand(keys, Stream.RL_PROMPT_MASK, tuple(ids.shape)) < self.rl.p_mask_prompt)
        masked = masked.scatter(1, positions, True)
        out = model(ids.masked_fill(masked, self.mask_token_id), targets=rollouts.targets[rows], gather_at=positions)
        return out.logp, out.entropy

    def exact_token_logps(self, rollouts: Rollouts, rows: slice | Tensor, model: torch.nn.Module) -> tuple[Tensor, Tensor]:
        """Exact left to right: one row per scored token ``k``, ``[prompt][tokens < k][masks to the canvas's
        end][pad]`` (the sampler's own layout at that step), all in one forward."""
        scored = rollouts.scored[rows]
        row, k = scored.nonzero(as_tuple=True)
        ids, positions = rollouts.ids[rows][row], rollouts.positions[rows]
        start = positions[row, k]  # the scored token's column; masks from it to the canvas's end
        end = positions[row, -1]
        columns = torch.arange(ids.shape[1], device=ids.device)[None, :]
        hidden = (columns >= start[:, None]) & (columns <= end[:, None])
        out = model(ids.masked_fill(hidden, self.mask_token_id), targets=rollouts.targets[rows][row, k][:, None],
                    gather_at=start[:, None])
        logp = torch.zeros(scored.shape, dtype=out.logp.dtype, device=ids.device).index_put((row, k), out.logp[:, 0])
        entropy = torch.zeros_like(logp).index_put((row, k), out.entropy[:, 0])
        return logp, entropy

    @torch.no_grad()
    def exact_logps(self, rollouts: Rollouts, rows: slice | Tensor) -> Tensor:
        """The exact left-to-right log-probabilities (the measurements' yardstick), without grad."""
        return self.exact_token_logps(rollouts, rows, self.model)[0]

    def elbo_times(self, keys: Tensor) -> tuple[Tensor, Tensor]:
        """``(t, weight)`` ``[n, M]``: each row's ``mc_samples`` masking rates in (eps, 1 - eps) and their weights
        (summing to 1): stratified (one per equal stratum, offset by a keyed uniform; weights 1 / M) or the
        Gauss-Legendre quadrature (nodes and weights; the masks stay random)."""
        M, eps = self.rl.mc_samples, self.eps
        if self.rl.t_sampling == "quadrature":
            nodes, weights = (torch.tensor(v, dtype=torch.float32, device=keys.device) for v in
                              np.polynomial.legendre.leggauss(M))
            t, weight = (nodes + 1) / 2, weights / 2
            return (eps + (1 - 2 * eps) * t).expand(len(keys), M), weight.expand(len(keys), M)
        offset = keyed_rand(keys, Stream.RL_ELBO_TIME, (len(keys), 1))
        t = (torch.arange(M, device=keys.device)[None, :] + offset) / M
        return eps + (1 - 2 * eps) * t, torch.full_like(t, 1 / M)

    def elbo_token_logps(self, rollouts: Rollouts, rows: slice | Tensor, iteration: int, model: torch.nn.Module,
                         draw: int) -> tuple[Tensor, Tensor]:
        """The ELBO per token: ``Σ_m weight_m · 1[masked] log p / t_m`` over the samples (``coupled``: half that plus
        half its complement's ``1[unmasked] log p' / (1 - t_m)``), the prompt clean; every pass in one forward."""
        ids, positions, targets = rollouts.ids[rows], rollouts.positions[rows], rollouts.targets[rows]
        n, C = targets.shape
        keys = self.estimator_keys(rollouts, rows, iteration, draw)
        t, weight = self.elbo_times(keys)
        masked = keyed_rand(keys, Stream.RL_ELBO_MASK, (n, t.shape[1], C)) < t[..., None]  # [n, M, C]
        passes = [(masked, weight / t)]
        if self.rl.coupled:
            passes = [(masked, weight / (2 * t)), (~masked, weight / (2 * (1 - t)))]
        canvas_masks = torch.cat([m for m, _ in passes], 1)  # [n, P, C], P = M or 2M
        P = canvas_masks.shape[1]
        noisy = ids[:, None].expand(-1, P, -1).clone()
        noisy.scatter_(2, positions[:, None].expand(-1, P, -1),
                       torch.where(canvas_masks, self.mask_token_id, targets[:, None].expand(-1, P, -1)))
        out = model(noisy.flatten(0, 1), targets=targets.repeat_interleave(P, 0),
                    gather_at=positions.repeat_interleave(P, 0))
        scale = torch.cat([s for _, s in passes], 1)[..., None] * canvas_masks  # [n, P, C]
        logp = (out.logp.view(n, P, C) * scale).sum(1)
        entropy = (out.entropy.view(n, P, C) * canvas_masks).sum(1) / canvas_masks.sum(1).clamp_min(1)
        return logp, entropy
