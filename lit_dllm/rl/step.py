"""RL post-training with verifiable rewards as LightningModules: :class:`DiffuGRPOModule` (a masked-diffusion policy,
the MDLM / hybrid family: d1's diffu-GRPO or wd1) and :class:`CausalGRPOModule` (an autoregressive policy: GRPO or
wd1), sharing one step (:class:`GRPOMixin`).

A training step takes a batch of prompts (``DLLMDataModule`` with ``collation.prompts: true``, which the modules
require), samples ``group_size`` completions of each with the family's sampler (no grad; each completion's noise keyed
by (example, completion, step), so a resume reproduces them and no row's noise depends on the batch or the rank),
scores them with the reward functions, normalises the rewards within each group into advantages and takes
``inner_updates`` optimizer steps on them (manual optimisation: the step owns its updates, so a checkpoint always
falls between batches of rollouts). The per-token log-probabilities are exact for the AR policy (teacher forcing)
and, for the dLLM, d1's one-pass estimate: the completion fully masked, each prompt token masked with probability
``p_mask_prompt`` by a draw keyed by (example, completion, inner update), so the old-policy pass and the update of
the same inner update see the same masks.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence

from lit_dllm.core.trace import DenoisingTrace
from lit_dllm.data.keys import Stream, example_keys, keyed_rand
from lit_dllm.families.causal_lm.module import CausalLMModule
from lit_dllm.families.mdlm.module import LLaDAGeneration, MDLMModule
from lit_dllm.lora import adapters_off
from lit_dllm.rl.objectives import clipped_objective, group_advantages, kl_penalty, weighted_objective
from lit_dllm.rl.rewards import resolve_rewards, score_rewards
from lit_dllm.settings import Reinforcement, settings_group

__all__ = ["CausalGRPOModule", "DiffuGRPOModule", "GRPOMixin", "Rollouts"]


@dataclass
class Rollouts:
    """A batch of completions laid out for scoring: ``G`` consecutive rows per prompt.

    Attributes:
        ids: ``[N, W]`` prompt + completion rows (right-padded).
        prompt_lengths: ``[N]``.
        positions: ``[N, C]`` the row positions of each completion token (clamped inside the row past its end).
        targets: ``[N, C]`` the completion tokens at ``positions``.
        scored: ``[N, C]`` bool: the completion's tokens up to and including its eos.
        keys: ``[N]`` the rows' keys (example, completion) for keyed draws.
        rewards: ``[N]`` total; ``per_reward``: each function's ``[N]`` (NaN where it does not apply).
        advantages: ``[N]``.
        texts: the decoded completions.
        rollout_logp: ``[N, C]`` the sampler's log-probability of each token it committed (NaN where unknown).
        tokens_per_second: new tokens the sampler made per second of the rollout (decoding included).
    """

    ids: Tensor
    prompt_lengths: Tensor
    positions: Tensor
    targets: Tensor
    scored: Tensor
    keys: Tensor
    rewards: Tensor
    per_reward: dict[str, Tensor]
    advantages: Tensor
    texts: list[str]
    rollout_logp: Tensor
    tokens_per_second: float


class GRPOMixin:
    """The RL step over a policy family: the family supplies :meth:`sample` (completions and the sampler's own
    log-probabilities), :meth:`layout` (rows for scoring) and :meth:`token_logps`; the settings are
    :class:`~lit_dllm.settings.Reinforcement` (``rl``)."""

    rl: Reinforcement

    def __init__(self, *args: Any, rl: Reinforcement | dict = Reinforcement(), **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.rl = settings_group("rl", Reinforcement, rl, {})
        self.rewards = resolve_rewards(self.rl.rewards)
        self.save_settings(rl=self.rl)
        self.automatic_optimization = False
        self._reference: list[torch.nn.Module] = []  # a list: kept out of the module tree (checkpoints, optimizer)

    def required_collation(self) -> dict[str, Any]:
        """Batches of prompts with their reference columns (:mod:`lit_dllm.data.prompts`)."""
        return {**super().required_collation(), "prompts": True}

    # ------------------------------------------------------------------ the reference policy
    def on_fit_start(self) -> None:
        super().on_fit_start()
        if self.rl.kl_beta and self.lora is None and not self._reference:
            if self.backbone is None or self.backbone.model is None:
                raise ValueError("rl.kl_beta > 0 compares the policy with where it started: start from a pretrained "
                                 "backbone.model (e.g. an SFT export), or set kl_beta: 0.")
            reference = self.build_model().to(self.device).eval().requires_grad_(False)
            self._reference.append(reference)

    @torch.no_grad()
    def reference_logps(self, rollouts: Rollouts, rows: slice, iteration: int) -> Tensor:
        """The reference policy's log-probabilities: LoRA's base (its adapters off), else the frozen start."""
        if self.lora is not None:
            with adapters_off(self.model):
                return self.token_logps(rollouts, rows, iteration)[0]
        return self.token_logps(rollouts, rows, iteration, model=self._reference[0])[0]

    # ------------------------------------------------------------------ rollouts
    @torch.no_grad()
    def rollout(self, batch: dict) -> Rollouts:
        """``group_size`` completions of each prompt of ``batch``, scored and laid out. Completion ``g`` of example
        ``i`` (key ``i * G + g``) samples with the noise keyed by (noise seed, that key, the optimizer step): the same
        completion in a resumed run, in any batch and on any rank."""
        G = self.rl.group_size
        prompts = [p.to(self.device) for p in batch["prompt_ids"] for _ in range(G)]
        index = batch["example_index"].to(self.device)
        keys = index.repeat_interleave(G) * G + torch.arange(G, device=self.device).repeat(len(index))
        self.check_fits(prompts, self.completion_length, "rl.rollout_length")
        start = time.perf_counter()
        completions, sampled_logp = self.sample(prompts, example_keys(self.noise_seed, keys, self.global_step))
        texts = self.tokenizer.batch_decode([c.tolist() for c in completions], skip_special_tokens=True)  # syncs
        tokens_per_second = sum(len(c) for c in completions) / max(time.perf_counter() - start, 1e-9)
        columns = {name: [v for v in values for _ in range(G)] for name, values in batch["columns"].items()}
        prompt_text = [t for t in batch["prompt_text"] for _ in range(G)]
        total, per_reward = score_rewards(self.rewards, prompt_text, texts, columns)
        total = total.to(self.device)
        completions = [c.to(self.device) for c in completions]  # the samplers cut them at eos on the host
        return Rollouts(**self.layout(prompts, completions, sampled_logp), keys=keys, rewards=total,
                        per_reward={k: v.to(self.device) for k, v in per_reward.items()},
                        advantages=group_advantages(total, G, self.rl.scale_rewards), texts=texts,
                        tokens_per_second=tokens_per_second)

    # ------------------------------------------------------------------ the step
    def training_step(self, batch: dict, batch_idx: int) -> None:
        optimizer, scheduler = self.optimizers(), self.lr_schedulers()
        rollouts = self.rollout(batch)
        N, rl = len(rollouts.rewards), self.rl
        chunks = [slice(start, min(start + (rl.micro_batch_size or N), N))
                  for start in range(0, N, rl.micro_batch_size or N)]
        clipped = rl.objective == "clipped"
        old = ({i: torch.cat([self.policy_logps(rollouts, rows, i) for rows in chunks]) for i in range(rl.inner_updates)}
               if clipped else {})
        logs: dict[str, list[Tensor]] = {}
        for iteration in range(rl.inner_updates):
            optimizer.zero_grad()
            for rows in chunks:
                logp, entropy = self.token_logps(rollouts, rows, iteration)
                scored = rollouts.scored[rows]
                kl = kl_penalty(logp, self.reference_logps(rollouts, rows, iteration)) if rl.kl_beta else None
                if clipped:
                    loss, stats = clipped_objective(logp, old[iteration][rows], rollouts.advantages[rows], scored,
                                                    rl.clip_eps, kl, rl.kl_beta)
                else:
                    loss, stats = weighted_objective(logp, rollouts.advantages[rows], scored, rl.group_size,
                                                     rl.weight_temperature, kl, rl.kl_beta)
                self.manual_backward(loss * ((rows.stop - rows.start) / N))
                stats = {"loss": loss.detach(), "entropy": _scored_mean(entropy, scored), **stats}
                if kl is not None:
                    stats["kl"] = _scored_mean(kl.detach(), scored)
                for name, value in stats.items():
                    logs.setdefault(name, []).append(value.detach().float())
            logs.setdefault("grad_norm", []).append(self._grad_norm())
            if rl.max_grad_norm:
                self.configure_gradient_clipping(optimizer, rl.max_grad_norm, "norm")
            optimizer.step()
            if scheduler is not None:
                scheduler.step()
            for converter in self.converters:
                converter.after_optimizer_step(self.model)
        self.log_rollouts(rollouts, old.get(0), logs)

    def policy_logps(self, rollouts: Rollouts, rows: slice, iteration: int) -> Tensor:
        """The policy's log-probabilities before the updates (the clipped ratio's old policy), without grad."""
        with torch.no_grad():
            return self.token_logps(rollouts, rows, iteration)[0]

    def log_rollouts(self, rollouts: Rollouts, old_logp: Tensor | None, logs: dict[str, list[Tensor]]) -> None:
        scored = rollouts.scored
        values = {f"train/{name}": torch.stack(parts).mean() for name, parts in logs.items()}
        values.update({
            "train/reward": rollouts.rewards.mean(),
            "train/reward_std": rollouts.rewards.view(-1, self.rl.group_size).std(1).mean(),
            "train/accuracy": self.accuracy(rollouts),
            "train/completion_length": scored.sum(1).float().mean(),
            "train/lr": torch.tensor(self.optimizers().param_groups[0]["lr"]),
            "train/rollout_tokens_per_s": torch.tensor(rollouts.tokens_per_second),
        })
        values.update({f"train/reward/{name}": torch.nanmean(v) for name, v in rollouts.per_reward.items()})
        if old_logp is not None:
            known = scored & rollouts.rollout_logp.isfinite()
            if known.any():  # the sampler's own log-probabilities against the update's estimate of them
                values["train/rollout_logp_gap"] = (rollouts.rollout_logp - old_logp)[known].abs().mean()
        self.log_dict({k: v.float() for k, v in values.items()}, on_step=True, on_epoch=False, rank_zero_only=True,
                      batch_size=len(rollouts.rewards))
        self.log("reward", values["train/reward"].float(), prog_bar=True, logger=False, rank_zero_only=True,
                 batch_size=len(rollouts.rewards))

    def accuracy(self, rollouts: Rollouts) -> Tensor:
        """The fraction of completions the first reward (the verifier) scores 1."""
        first = next(iter(rollouts.per_reward.values()))
        return (first >= 1).float().mean()

    # ------------------------------------------------------------------ evaluation
    def validation_step(self, batch: dict, batch_idx: int) -> None:
        self.evaluate_prompts(batch, batch_idx, "val")

    def test_step(self, batch: dict, batch_idx: int) -> None:
        self.evaluate_prompts(batch, batch_idx, "test")

    @torch.no_grad()
    def evaluate_prompts(self, batch: dict, batch_idx: int, stage: str) -> None:
        """Answer each prompt once with the generation settings (greedy by default) and score the rewards:
        ``<stage>/accuracy`` (the first reward's verifier), ``<stage>/reward`` and each reward's mean."""
        answers = self.generate_ids([p.to(self.device) for p in batch["prompt_ids"]], self.rollout_length)
        texts = self.tokenizer.batch_decode([a.tolist() for a in answers], skip_special_tokens=True)
        total, per_reward = score_rewards(self.rewards, batch["prompt_text"], texts, batch["columns"])
        first = next(iter(per_reward.values()))
        size = len(texts)
        self.log(f"{stage}/accuracy", (first >= 1).float().mean(), batch_size=size, sync_dist=True)
        self.log(f"{stage}/reward", total.mean(), batch_size=size, sync_dist=True)
        for name, value in per_reward.items():
            self.log(f"{stage}/reward/{name}", torch.nanmean(value), batch_size=size, sync_dist=True)
        if batch_idx == 0 and self.rl.log_completions and stage == "val":
            self.log_completions(batch["prompt_text"], texts, first)

    def log_completions(self, prompts: list[str], texts: list[str], scores: Tensor) -> None:
        experiment = getattr(self.logger, "experiment", None)
        if experiment is None or not hasattr(experiment, "add_text") or self.global_rank != 0:
            return
        rows = ["| prompt | completion | verifier |", "|---|---|---|"]
        rows += [f"| {p!r} | {t!r} | {s:.0f} |" for p, t, s in
                 list(zip(prompts, texts, scores.tolist()))[: self.rl.log_completions]]
        experiment.add_text("val/completions", "\n".join(rows), self.global_step)

    @property
    def rollout_length(self) -> int:
        return self.rl.rollout_length or self.generation.gen_length or 64

    @property
    def completion_length(self) -> int:
        """The positions a completion takes after its prompt: :attr:`rollout_length`."""
        return self.rollout_length


def _scored_mean(values: Tensor, scored: Tensor) -> Tensor:
    return values.detach()[scored].float().mean() if scored.any() else values.new_zeros(()).float()


class DiffuGRPOModule(GRPOMixin, MDLMModule):
    """RL for a masked-diffusion policy (MDLM / LLaDA): d1's diffu-GRPO (``rl.objective: clipped``) or wd1
    (``weighted``). Rollouts come from the module's sampler (``generation.sampler``: ``llada`` or ``fast``, its block
    length, steps and threshold; here ``fast`` unless set) at ``rl.rollout_temperature``; the completion is the whole canvas of
    ``rollout_length`` tokens, scored up to its first eos.

    Args:
        rl: the RL settings (:class:`~lit_dllm.settings.Reinforcement`).
        Other arguments: see :class:`~lit_dllm.families.mdlm.module.MDLMModule` (``backbone.model``: the SFT export
            to start from).
    """

    tiny_config = "configs/grpo_tiny.yaml"

    def __init__(self, *args: Any, generation: LLaDAGeneration = LLaDAGeneration(sampler="fast"), **kwargs: Any):
        super().__init__(*args, generation=generation, **kwargs)

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
        offsets = torch.arange(length, device=self.device)
        rollout_logp = torch.full((len(prompts), length), float("nan"), device=self.device)
        for row, logp in enumerate(sampled_logp):
            width = min(length, len(logp))
            rollout_logp[row, :width] = logp[:width]
        return {"ids": ids, "prompt_lengths": prompt_lengths, "positions": prompt_lengths[:, None] + offsets,
                "targets": canvases, "scored": offsets[None, :] <= ends[:, None], "rollout_logp": rollout_logp}

    def token_logps(self, rollouts: Rollouts, rows: slice, iteration: int,
                    model: torch.nn.Module | None = None) -> tuple[Tensor, Tensor]:
        """d1's estimate: one forward with every canvas token masked and each prompt token masked with probability
        ``p_mask_prompt`` (keyed by the row and ``iteration``); the log-probability of each canvas token and the
        entropy of its prediction, ``[n, C]`` each."""
        ids, positions = rollouts.ids[rows], rollouts.positions[rows]
        keys = example_keys(self.noise_seed, rollouts.keys[rows] * self.rl.inner_updates + iteration, 0)
        columns = torch.arange(ids.shape[1], device=ids.device)
        in_prompt = columns[None, :] < rollouts.prompt_lengths[rows][:, None]
        masked = in_prompt & (keyed_rand(keys, Stream.RL_PROMPT_MASK, tuple(ids.shape)) < self.rl.p_mask_prompt)
        masked = masked.scatter(1, positions, True)
        noisy = ids.masked_fill(masked, self.mask_token_id)
        logits = (model or self.model)(noisy)
        return _logps_at(logits, positions, rollouts.targets[rows])


class CausalGRPOModule(GRPOMixin, CausalLMModule):
    """RL for an autoregressive policy: GRPO (``rl.objective: clipped``) or wd1 (``weighted``) with exact
    log-probabilities; the same rewards and data as :class:`DiffuGRPOModule`, so a dLLM and its AR teacher share one
    table. Rollouts: ``hf.generate`` sampling at ``rl.rollout_temperature``, keyed per completion
    (:class:`~lit_dllm.families.causal_lm.module.KeyedSampling`: the policy's own distribution, the model's
    ``top_k`` / ``top_p`` left out, as the exact log-probabilities of the update score it).

    Args:
        rl: the RL settings (:class:`~lit_dllm.settings.Reinforcement`; ``p_mask_prompt`` unused).
        Other arguments: see :class:`~lit_dllm.families.causal_lm.module.CausalLMModule`.
    """

    tiny_config = "configs/grpo_ar_tiny.yaml"

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

    def token_logps(self, rollouts: Rollouts, rows: slice, iteration: int,
                    model: torch.nn.Module | None = None) -> tuple[Tensor, Tensor]:
        """Exact: teacher forcing, the logits at each position predicting the next token."""
        ids = rollouts.ids[rows]
        attention_mask = torch.arange(ids.shape[1], device=ids.device)[None, :] < (
            rollouts.prompt_lengths[rows] + rollouts.scored[rows].sum(1))[:, None]
        logits = (model or self.model).logits(ids, attention_mask=attention_mask.long())
        return _logps_at(logits, rollouts.positions[rows] - 1, rollouts.targets[rows])


def _logps_at(logits: Tensor, positions: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
    """Log-probability of ``targets`` and the prediction's entropy at ``positions`` of ``logits`` ``[n, W, V]``."""
    chosen = torch.take_along_dim(logits, positions[..., None], dim=1).float()
    logp = torch.log_softmax(chosen, -1)
    entropy = -(logp.exp() * logp).sum(-1)
    return logp.gather(-1, targets[..., None]).squeeze(-1), entropy
