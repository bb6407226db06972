"""The RL step shared by every policy family (:class:`GRPOMixin`): a family's RL module (``DiffuGRPOModule`` beside
MDLM, ``CausalGRPOModule`` beside the causal LM) is this mixin over the family's module.

A training step takes a batch of prompts (``DLLMDataModule`` with ``collation.prompts: true``, which the modules
require), samples ``group_size`` completions of each with the family's sampler (no grad; each completion's noise keyed
by (example, completion, step), so a resume reproduces them and no row's noise depends on the batch or the rank),
scores them with the reward functions, normalises the rewards within each group into advantages and takes
``inner_updates`` optimizer steps on them (manual optimisation: the step owns its updates, so a checkpoint always
falls between batches of rollouts). Each update goes through the base's one road after the backward: the finite check
(a non-finite loss or gradient stops the run before the update, :class:`~lit_dllm.core.finite.FiniteCheck`) and the
converters' after-step. The family supplies the token log-probabilities (its estimator, keyed by (example,
completion, inner update), so the old-policy pass and the update of one inner update see the same masks).
"""

from __future__ import annotations

import math
import time
from contextlib import contextmanager
from dataclasses import dataclass, fields, replace
from typing import Any, Iterator

import torch
from torch import Tensor

from lit_dllm.core.generation import FAMILY_KEY
from lit_dllm.noise.keys import example_keys
from lit_dllm.lora import adapters_off
from lit_dllm.rl.objectives import (OBJECTIVES, completion_mean, group_advantages, kl_penalty, tied_groups,
                                    update_rows)
from lit_dllm.rl.rewards import resolve_rewards, score_rewards
from lit_dllm.rl.settings import Reinforcement
from lit_dllm.settings import settings_group

__all__ = ["GRPOMixin", "PhaseMeter", "Rollouts"]


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

    def take(self, rows: Tensor) -> Rollouts:
        """The completions of ``rows`` (whole groups), in that order."""
        tensors = {f.name: value[rows] for f in fields(self) if isinstance(value := getattr(self, f.name), Tensor)}
        return replace(self, **tensors, per_reward={name: values[rows] for name, values in self.per_reward.items()},
                       texts=[self.texts[row] for row in rows.tolist()])


class PhaseMeter:
    """Seconds and, on CUDA, peak allocated GiB of each named phase of a step (``with meter("rollout"): ...``)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.values: dict[str, Tensor] = {}

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        yield
        if self.cuda:
            torch.cuda.synchronize()
            self.values[f"peak_gib_{phase}"] = torch.tensor(torch.cuda.max_memory_allocated() / 2**30)
        self.values[f"seconds_{phase}"] = torch.tensor(time.perf_counter() - start)


class GRPOMixin:
    """The RL step over a policy family: the family supplies :meth:`sample` (completions and the sampler's own
    log-probabilities), :meth:`layout` (rows for scoring), :meth:`token_logps` (its estimator) and
    :meth:`exact_logps` (the exact left-to-right log-probabilities the measurements compare with); the settings are
    :class:`~lit_dllm.rl.settings.Reinforcement` (``rl``)."""

    rl: Reinforcement

    default_estimator = "exact"
    """The family's estimator where ``rl.estimator`` is None."""

    takes_context_parallel = False
    """Rollouts and their scoring run on whole sequences: no context parallelism."""

    def __init__(self, *args: Any, rl: Reinforcement | dict = Reinforcement(), **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.rl = settings_group("rl", Reinforcement, rl)
        self.rewards = resolve_rewards(self.rl.rewards)
        if getattr(self.generation, "val_trace", False):
            raise ValueError("generation.val_trace=True: the RL modules validate by rewards and draw no denoising "
                             "trace; set --model.init_args.generation.val_trace=false (a trace of a checkpoint: "
                             "load it as its family's module, e.g. MDLMModule).")
        self.save_settings(rl=self.rl)
        self.automatic_optimization = False
        self._reference: list[torch.nn.Module] = []  # a list: kept out of the module tree (checkpoints, optimizer)
        self._step_loss: Tensor | None = None

    policy_family = ""
    """The family a start exported by lit_dllm must record (``lit_dllm_family`` in its config)."""

    def build_model(self):
        """The family's model, refused when its ``backbone.model`` is an export of another family (its config's
        ``lit_dllm_family``; an MDLM export of before that key by its ``dllm_sampler``)."""
        model = super().build_model()
        config = model.hf.config
        recorded = getattr(config, FAMILY_KEY, None) or ("mdlm" if getattr(config, "dllm_sampler", None) else None)
        if recorded and recorded != self.policy_family:
            raise ValueError(
                f"backbone.model={self.backbone.model!r} is a {recorded} export, but {type(self).__name__} trains a "
                f"{self.policy_family} policy: start from that family's export, or use "
                f"{'DiffuGRPOModule' if recorded == 'mdlm' else 'CausalGRPOModule'} for this one.")
        return model

    @property
    def estimator(self) -> str:
        return self.rl.estimator or self.default_estimator

    def required_collation(self) -> dict[str, Any]:
        """Batches of prompts with their reference columns (:mod:`lit_dllm.data.prompts`)."""
        return {**super().required_collation(), "prompts": True}

    # ------------------------------------------------------------------ checks and the reference policy
    def on_fit_start(self) -> None:
        super().on_fit_start()
        if not self.rl.rollout_temperature:
            raise ValueError("rl.rollout_temperature=0: the G completions of a prompt would be one, every advantage 0 "
                             "and the loss 0 at every step. Sample (e.g. --model.init_args.rl.rollout_temperature=1).")
        prompts, kept = self.data_batch_size, self.rl.update_groups
        if kept is not None and prompts is not None and kept >= prompts:
            raise ValueError(f"rl.update_groups={kept} is not below the prompts of a batch (data.init_args.loader."
                             f"batch_size={prompts}): every group would be updated. Roll out more prompts than an update "
                             f"takes (e.g. --data.init_args.loader.batch_size={3 * kept}), or set update_groups: null.")
        max_steps = self.trainer.max_steps
        if max_steps > 0 and max_steps % self.rl.inner_updates:
            fit = max_steps // self.rl.inner_updates * self.rl.inner_updates
            raise ValueError(f"trainer.max_steps={max_steps} is not a multiple of rl.inner_updates="
                             f"{self.rl.inner_updates} (each batch of rollouts takes them all): set --trainer.max_steps="
                             f"{fit or self.rl.inner_updates}.")
        if self.rl.kl_beta and self.lora is None and not self._reference:
            if self.backbone is None or self.backbone.model is None:
                raise ValueError("rl.kl_beta > 0 compares the policy with where it started: start from a pretrained "
                                 "backbone.model (e.g. an SFT export), or set kl_beta: 0.")
            reference = self.build_model().to(self.device).eval().requires_grad_(False)
            self._reference.append(reference)

    def estimator_keys(self, rollouts: Rollouts, rows: slice | Tensor, iteration: int, draw: int = 0) -> Tensor:
        """The keys of the estimator's masks: (example and completion, inner update), ``draw`` 1 for the
        measurements' second draw."""
        return example_keys(self.noise_seed, rollouts.keys[rows] * self.rl.inner_updates + iteration, draw)

    @torch.no_grad()
    def reference_logps(self, rollouts: Rollouts, rows: slice | Tensor, iteration: int) -> Tensor:
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
        phases = PhaseMeter(self.device)
        rl = self.rl
        with phases("rollout"):
            sampled = self.rollout(batch)
        rollouts = sampled if rl.update_groups is None else sampled.take(update_rows(sampled.rewards, rl.group_size,
                                                                                     rl.update_groups))
        N = len(rollouts.rewards)
        objective = OBJECTIVES[rl.objective]
        chunks = self.micro_batches(rollouts)
        coefficients = objective.coefficients(rollouts.advantages, rl)
        with phases("old_policy"):  # one pass per inner update (its own masks); the exact estimator draws none
            passes = range(1 if self.estimator == "exact" else rl.inner_updates) if objective.needs_old else ()
            scored = [torch.cat([self.policy_logps(rollouts, rows, i) for rows in chunks]) for i in passes]
            old = {i: scored[min(i, len(scored) - 1)] for i in range(rl.inner_updates)} if scored else {}
        logs: dict[str, list[Tensor]] = {}
        with phases("update"):
            for iteration in range(rl.inner_updates):
                optimizer.zero_grad()
                total = torch.zeros((), device=self.device)
                for rows in chunks:
                    logp, entropy = self.token_logps(rollouts, rows, iteration)
                    scored = rollouts.scored[rows]
                    losses, stats = objective.loss(logp, old[iteration][rows] if old else None, coefficients[rows],
                                                   scored, rl)
                    if rl.kl_beta:
                        kl = kl_penalty(logp, self.reference_logps(rollouts, rows, iteration))
                        losses = losses + rl.kl_beta * completion_mean(kl, scored)
                        stats["kl"] = _scored_mean(kl, scored)
                    loss = losses.sum() / N  # the micro-batch's completions' share of the mean over all N
                    self.manual_backward(loss)
                    total = total + loss.detach()
                    for name, value in {"entropy": _scored_mean(entropy, scored), **stats}.items():
                        logs.setdefault(name, []).append(value.detach().float())
                logs.setdefault("loss", []).append(total)
                self._step_loss = total
                self.run_optimizer_step(optimizer.step, optimizer)  # on_before_optimizer_step: clip, check
                logs.setdefault("grad_norm", []).append(self._rl_grad_norm)
                if scheduler is not None:
                    scheduler.step()
        with phases("measure"):
            measured = self.measure(sampled, rollouts)
        self.log_rollouts(sampled, rollouts, old.get(0), logs, {**measured, **phases.values})

    def forward_rows(self, rollouts: Rollouts) -> Tensor:
        """``[N]``: the rows each completion takes in a scoring forward (here one; a dLLM's estimators say more)."""
        return torch.ones(len(rollouts.rewards), dtype=torch.long)

    def micro_batches(self, rollouts: Rollouts) -> list[slice]:
        """Consecutive completions, at most ``rl.micro_batch_size`` each and at most ``rl.micro_batch_rows`` forward
        rows (:meth:`forward_rows`) unless one completion alone has more."""
        N = len(rollouts.rewards)
        size, budget = self.rl.micro_batch_size or N, self.rl.micro_batch_rows or math.inf
        chunks, start, taken = [], 0, 0
        for end, count in enumerate(self.forward_rows(rollouts).tolist()):
            if end > start and (end - start == size or taken + count > budget):
                chunks.append(slice(start, end))
                start, taken = end, 0
            taken += count
        return [*chunks, slice(start, N)]

    def on_before_optimizer_step(self, optimizer) -> None:
        """Each RL update (called by the optimizer's step): the gradient norm, its clipping and the finite check
        of the update's loss and norm (:class:`~lit_dllm.core.finite.FiniteCheck`)."""
        self._rl_grad_norm = self._grad_norm()
        if self.rl.max_grad_norm:
            self.configure_gradient_clipping(optimizer, self.rl.max_grad_norm, "norm")
        self._finite.check(self.trainer, getattr(optimizer, "optimizer", optimizer), self._step_loss,
                           self._rl_grad_norm, self.optimization.lr)

    def policy_logps(self, rollouts: Rollouts, rows: slice | Tensor, iteration: int) -> Tensor:
        """The policy's log-probabilities before the updates (the ratio's old policy), without grad."""
        with torch.no_grad():
            return self.token_logps(rollouts, rows, iteration)[0]

    # ------------------------------------------------------------------ measurements
    @torch.no_grad()
    def measure(self, rollouts: Rollouts, updated: Rollouts) -> dict[str, Tensor]:
        """What tells the estimators and recipes apart (docs/rl.md): the share of groups whose rewards all tie (no
        advantage) among those sampled and among those ``updated`` (``rl.update_groups``), the distinct completions
        per group and, on ``rl.diagnostic_rows`` completions spread over the batch, the Pearson correlation of the
        estimator's completion log-probability with the exact left-to-right one and the root mean square of the
        length-normalised log-ratio between two mask keys at the unchanged policy (taken after the batch's updates,
        at the policy the next batch starts from)."""
        G = self.rl.group_size
        groups = [rollouts.texts[start : start + G] for start in range(0, len(rollouts.texts), G)]
        values = {"tied_groups": tied_groups(rollouts.rewards, G).float().mean(),
                  "update_tied_groups": tied_groups(updated.rewards, G).float().mean(),
                  "distinct_completions": torch.tensor(sum(len(set(g)) for g in groups) / len(groups))}
        N, k = len(rollouts.texts), min(self.rl.diagnostic_rows, len(rollouts.texts))
        if k < 2 or self.estimator == "exact":
            return values
        rows = torch.linspace(0, N - 1, k, device=self.device).long()  # spread over the groups: different prompts
        scored = rollouts.scored[rows]
        estimate = self.token_logps(rollouts, rows, 0)[0]
        other = self.token_logps(rollouts, rows, 0, draw=1)[0]
        exact = self.exact_logps(rollouts, rows)
        sums = torch.stack([(estimate * scored).sum(1), (exact * scored).sum(1)]).double()
        if (sums.std(1) > 0).all():  # else undefined (e.g. identical completions): not logged this step
            values["exact_correlation"] = torch.corrcoef(sums)[0, 1].float()
        values["key_logratio_rms"] = completion_mean(estimate - other, scored).pow(2).mean().sqrt()
        return values

    def log_rollouts(self, rollouts: Rollouts, updated: Rollouts, old_logp: Tensor | None,
                     logs: dict[str, list[Tensor]], measured: dict[str, Tensor]) -> None:
        """The step's logs: the sampled ``rollouts``' rewards and lengths, the update's statistics (``logs``) and
        ``measured``; the gap of the sampler's log-probabilities to ``old_logp`` on the ``updated`` rows."""
        scored, solved = rollouts.scored, self.solved(rollouts)
        values = {f"train/{name}": torch.stack(parts).mean() for name, parts in logs.items()}
        values.update({f"train/{name}": value for name, value in measured.items()})
        values.update({
            "train/reward": rollouts.rewards.mean(),
            "train/reward_std": rollouts.rewards.view(-1, self.rl.group_size).std(1).mean(),
            "train/accuracy": solved.float().mean(),
            "train/solved_groups": solved.view(-1, self.rl.group_size).any(1).float().mean(),
            "train/completion_length": scored.sum(1).float().mean(),
            "train/lr": torch.tensor(self.optimizers().param_groups[0]["lr"]),
            "train/rollout_tokens_per_s": torch.tensor(rollouts.tokens_per_second),
        })
        values.update({f"train/reward/{name}": torch.nanmean(v) for name, v in rollouts.per_reward.items()})
        if old_logp is not None:
            known = updated.scored & updated.rollout_logp.isfinite()
            if known.any():  # the sampler's own log-probabilities against the update's estimate of them
                values["train/rollout_logp_gap"] = (updated.rollout_logp - old_logp)[known].abs().mean()
        self.log_dict({k: v.float().to(self.device) for k, v in values.items()}, on_step=True, on_epoch=False,
                      rank_zero_only=True, batch_size=len(rollouts.rewards))
        self.log("reward", values["train/reward"].float(), prog_bar=True, logger=False, rank_zero_only=True,
                 batch_size=len(rollouts.rewards))

    def solved(self, rollouts: Rollouts) -> Tensor:
        """``[N]``: whether the first reward (the verifier) scores each completion 1 (right). Its mean is
        ``train/accuracy`` (pass@1 at the rollout temperature); its share of groups with any right completion,
        ``train/solved_groups`` (pass@G), the ceiling the updates can sharpen greedy answers toward."""
        return next(iter(rollouts.per_reward.values())) >= 1

    # ------------------------------------------------------------------ evaluation
    def validation_step(self, batch: dict, batch_idx: int) -> None:
        self.evaluate_prompts(batch, batch_idx, "val")

    def test_step(self, batch: dict, batch_idx: int) -> None:
        self.evaluate_prompts(batch, batch_idx, "test")

    def predict_step(self, batch: dict, batch_idx: int) -> list[dict]:
        """One answer per prompt (the generation settings; greedy by default) with its rewards: rows of
        ``example_index``, ``prompt``, ``generated``, ``reward`` and each reward's score (None: does not apply)."""
        answers = self.generate_ids([p.to(self.device) for p in batch["prompt_ids"]], self.rollout_length)
        texts = self.tokenizer.batch_decode([a.tolist() for a in answers], skip_special_tokens=True)
        total, per_reward = score_rewards(self.rewards, batch["prompt_text"], texts, batch["columns"])
        scores = {name: [None if v != v else v for v in values.tolist()] for name, values in per_reward.items()}
        return [{"example_index": int(index), "prompt": prompt, "generated": text, "reward": float(reward),
                 **{name: values[row] for name, values in scores.items()}}
                for row, (index, prompt, text, reward) in enumerate(zip(batch["example_index"].tolist(),
                                                                        batch["prompt_text"], texts, total.tolist()))]

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
