"""The RL settings group (:class:`Reinforcement`, ``rl``), beside the RL step (:mod:`.step`), its objectives
(:mod:`.objectives`) and rewards (:mod:`.rewards`) that read it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lit_dllm.rl.objectives import OBJECTIVES
from lit_dllm.settings import Settings, check_positive_or_none

__all__ = ["RL_ESTIMATORS", "Reinforcement"]


@dataclass(frozen=True)
class Reinforcement(Settings):
    """RL post-training with verifiable rewards (:mod:`lit_dllm.rl`; ``DiffuGRPOModule``, ``CausalGRPOModule``).

    Attributes:
        rewards: the reward functions, each an import path or a built-in's name, or a dict
            ``{function, weight, kwargs, name}`` (:class:`~lit_dllm.rl.rewards.RewardSpec`); the total is their
            weighted sum.
        objective: ``clipped`` (GRPO's clipped per-token policy ratio; for a dLLM d1's diffu-GRPO), ``sequence``
            (ESPO's clipped sequence ratio: the exponential of the mean token log-ratio of a completion) or
            ``weighted`` (wd1's ratio-free weighted likelihood: completions weighted by the softmax of their group
            advantages) (:data:`~lit_dllm.rl.objectives.OBJECTIVES`).
        estimator: how a dLLM policy's token log-probabilities are estimated: ``one_pass`` (d1: the completion fully
            masked, the prompt masked at ``p_mask_prompt``), ``exact`` (each token scored as a left-to-right rollout
            commits it: the clean prefix, masks from it on; needs ``generation.gen_block_length: 1``) or ``elbo``
            (the masked-diffusion ELBO: ``mc_samples`` masking rates, ``t_sampling``, ``coupled``); None: the
            family's default (``exact`` for a dLLM, JustGRPO's recipe: left-to-right rollouts; the AR policy is always
            ``exact``).
        mc_samples: the ELBO's Monte-Carlo samples (masking rates) per completion (``elbo``).
        t_sampling: the ELBO's masking rates: ``stratified`` (one per stratum of ``mc_samples`` equal parts of
            (eps, 1 - eps), offset by a keyed uniform) or ``quadrature`` (Gauss-Legendre nodes and weights).
        coupled: the ELBO also scores each sample's complementary mask (rate ``1 - t``), so every completion token is
            scored once per sample (coupled-GRPO).
        group_size: completions sampled per prompt (G); advantages are normalised within each group.
        update_groups: the groups an update trains on, of the batch's prompts: those whose rewards differ first,
            then tied ones (DAPO's dynamic sampling as a filter: roll out more prompts than an update takes, e.g.
            ``data.init_args.loader.batch_size: 48`` for ``update_groups: 16``, so that tied groups, which carry no
            advantage, stop diluting the update); fewer than the batch's prompts per rank. None: every group.
        inner_updates: optimizer steps per batch of rollouts (mu); each sees its own masks (a dLLM);
            ``trainer.max_steps`` must be a multiple of it.
        clip_eps: the ratio's clip range (``clipped``, ``sequence``).
        kl_beta: weight of the KL term to the reference policy (the start: with LoRA the base with its adapters off,
            else a frozen copy); 0 builds no reference.
        weight_temperature: ``weighted``'s psi: the advantages' softmax temperature.
        p_mask_prompt: d1's estimate masks each prompt token with this probability (``one_pass``).
        scale_rewards: divide each group's centred rewards by its standard deviation.
        rollout_temperature: the sampler's temperature for rollouts: > 0 for training (at 0 the G completions of a
            prompt are one, every advantage 0: refused by ``fit``).
        rollout_length: new tokens per completion (None: the generation group's ``gen_length``).
        micro_batch_size: completions per forward/backward of an update (None: all at once); any size gives the
            loss and gradients of all at once.
        micro_batch_rows: the most forward rows a micro-batch takes (None: no bound): consecutive completions are
            grouped up to it (at most ``micro_batch_size``; a completion with more rows goes alone). A completion's
            rows: one per scored token with the ``exact`` estimator of a dLLM, ``mc_samples`` (twice that
            ``coupled``) with ``elbo``, one otherwise. Bounds an update's memory whatever the completions' lengths;
            any bound gives the loss and gradients of all at once.
        max_grad_norm: gradient norm clipping of each update (None: none); the trainer's ``gradient_clip_val`` does
            not apply (the RL step steps its optimizer itself).
        diagnostic_rows: completions per step measured against the exact left-to-right log-probability and under a
            second mask key (``train/exact_correlation``, ``train/key_logratio_rms``; 0: none).
        log_completions: completions written to TensorBoard's text per validation (0: none).
    """

    rewards: tuple[Any, ...] = ()
    objective: str = "clipped"
    estimator: str | None = None
    mc_samples: int = 1
    t_sampling: str = "stratified"
    coupled: bool = True
    group_size: int = 8
    update_groups: int | None = None
    inner_updates: int = 1
    clip_eps: float = 0.2
    kl_beta: float = 0.0
    weight_temperature: float = 1.0
    p_mask_prompt: float = 0.15
    scale_rewards: bool = True
    rollout_temperature: float = 1.0
    rollout_length: int | None = None
    micro_batch_size: int | None = None
    micro_batch_rows: int | None = None
    max_grad_norm: float | None = 1.0
    diagnostic_rows: int = 8
    log_completions: int = 4

    def check(self) -> None:
        if not self.rewards:
            raise ValueError("rl.rewards is empty: name at least one reward, e.g. rewards: [exact_answer] "
                             "(lit_dllm.rl.rewards lists the built-ins; any module.function works).")
        if self.objective not in OBJECTIVES:
            raise ValueError(f"objective={self.objective!r}; use 'clipped' (GRPO / diffu-GRPO), 'sequence' (ESPO) or "
                             "'weighted' (wd1).")
        if self.estimator not in (None, *RL_ESTIMATORS):
            raise ValueError(f"estimator={self.estimator!r}; use 'one_pass' (d1), 'exact' (left to right) or 'elbo', "
                             "or None (the family's default).")
        if isinstance(self.mc_samples, bool) or not isinstance(self.mc_samples, int) or self.mc_samples < 1:
            raise ValueError(f"mc_samples={self.mc_samples!r} must be an int >= 1 (Monte-Carlo samples of the ELBO).")
        if self.t_sampling not in ("stratified", "quadrature"):
            raise ValueError(f"t_sampling={self.t_sampling!r}; use 'stratified' or 'quadrature'.")
        if isinstance(self.group_size, bool) or not isinstance(self.group_size, int) or self.group_size < 2:
            raise ValueError(f"group_size={self.group_size!r} must be an int >= 2 (advantages compare a group).")
        check_positive_or_none(self, {"inner_updates": "", "rollout_length": "the generation group's gen_length",
                                      "update_groups": "every group", "micro_batch_size": "all completions at once",
                                      "micro_batch_rows": "no bound on a micro-batch's rows"})
        if self.inner_updates is None:
            raise ValueError("inner_updates=None: give a positive int (1: one update per batch of rollouts).")
        for name, low, high in (("clip_eps", 0.0, 1.0), ("p_mask_prompt", 0.0, 1.0)):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and low <= value < high) or (name == "clip_eps" and value == 0):
                raise ValueError(f"{name}={value!r} must lie in ({low}, {high}) for clip_eps, [{low}, {high}) else.")
        for name in ("kl_beta", "rollout_temperature"):
            if not (isinstance(getattr(self, name), (int, float)) and getattr(self, name) >= 0):
                raise ValueError(f"{name}={getattr(self, name)!r} must be a number >= 0.")
        if not (isinstance(self.weight_temperature, (int, float)) and self.weight_temperature > 0):
            raise ValueError(f"weight_temperature={self.weight_temperature!r} must be a number > 0.")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ValueError(f"max_grad_norm={self.max_grad_norm!r} must be > 0, or None (no clipping).")
        for name in ("diagnostic_rows", "log_completions"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 0 (0: none).")


RL_ESTIMATORS = ("one_pass", "exact", "elbo")
"""A dLLM policy's log-probability estimators (:class:`~lit_dllm.families.mdlm.grpo.DiffuGRPOModule`)."""
