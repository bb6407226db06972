"""Evaluation of every family (:class:`EvaluationMixin`, docs/DESIGN.md §7.7): the family's own loss and token
accuracy under fixed, validation-keyed noise, with each batch's local counts as denominators; and what the
evaluation harness (:mod:`lit_dllm.eval`) asks a family: a likelihood (exact or a bound) and decoded answers."""

from __future__ import annotations

import torch
from torch import nn
from torchmetrics import MeanMetric

VALIDATION_EPOCH = -1
"""Epoch used in the noise keys of validation: fixed, so every validation pass sees the same noise."""

EVAL_STAGES = ("val", "test")


class EvaluationMixin:
    """``validation_step`` and ``test_step`` for a module with the family hooks (``prepare_batch``, ``token_counts``,
    ``compute_loss``), ``noise_keys`` and ``shard_sequences``."""

    accuracy_name = "accuracy"
    """Name of the evaluation token accuracy (``<stage>/<name>``)."""

    accuracy_by: tuple[str, ...] = ()
    """Parts of the scored tokens whose accuracy evaluation also logs, ``<stage>/<accuracy_name>_<part>``, from the
    counts in :class:`~lit_dllm.core.token_loss.StepLoss`'s ``accuracy_by`` (MDLM: by noise level)."""

    def stage_metrics(self) -> nn.ModuleDict:
        """Metrics of one evaluation stage (val or test); subclasses may add entries."""
        parts = {f"{self.accuracy_name}_{part}": MeanMetric() for part in self.accuracy_by}
        return nn.ModuleDict({"loss": MeanMetric(), self.accuracy_name: MeanMetric(), **parts})

    def evaluate(self, batch: dict, batch_idx: int, stage: str) -> None:
        """The family's evaluation loss (``dllm_loss``, per primary token) and token accuracy, under fixed
        (validation-keyed) randomness."""
        metrics, accuracy = self.eval_metrics[stage], self.accuracy_name
        prepared = self.prepare_batch(batch, self.noise_keys(batch, VALIDATION_EPOCH))
        batch, prepared = self.shard_sequences(batch, prepared)
        local = self.token_counts(batch, prepared)
        counts = {k: v.float().clamp_min(1.0) for k, v in local.items()}
        step = self.compute_loss(batch, prepared, counts)
        # weighted by the count itself: a shard (context parallelism) or batch with nothing scored adds nothing
        metrics["loss"].update(step.output.dllm_loss, weight=next(iter(local.values())).float())
        if step.num_scored is not None and step.num_scored > 0:
            metrics[accuracy].update(step.num_correct / step.num_scored, weight=step.num_scored)
        self.log(f"{stage}/loss", metrics["loss"], prog_bar=stage == "val")
        self.log(f"{stage}/{accuracy}", metrics[accuracy])
        for part, (correct, scored) in step.accuracy_by.items():
            # updated and logged on every rank, scored or not (weight 0), so that every rank syncs the same metrics at
            # the epoch's end: a rank whose batch (or shard of the rows) scored nothing in a part hung the others
            name = f"{accuracy}_{part}"
            metrics[name].update(correct / scored.clamp_min(1), weight=scored)
            self.log(f"{stage}/{name}", metrics[name])

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        self.evaluate(batch, batch_idx, "val")

    def test_step(self, batch: dict, batch_idx: int) -> None:
        self.evaluate(batch, batch_idx, "test")

    exact_scoring = False
    """True for a family that scores a continuation exactly, by ``exact_scores(pairs, batch_size)`` (a causal LM);
    the harness asks the others for :meth:`loglikelihood_bound`."""

    def loglikelihood_bound(self, context: list[int], continuation: list[int], seed: int, *, samples: int,
                            batch_size: int) -> float:
        """A Monte-Carlo lower bound on ``log p(continuation | context)`` (token ids) from ``samples`` draws seeded by
        ``seed``, ``batch_size`` sequences per forward (the draws do not depend on it). A family that has one
        overrides this."""
        raise NotImplementedError(
            f"{type(self).__name__} has no log-likelihood here, only generate_until (generation tasks such as gsm8k): "
            "its family defines neither loglikelihood_bound (a Monte-Carlo bound, as MDLMModule's) nor exact_scores "
            "with exact_scoring = True (as CausalLMModule's). Give its module one of them to score it."
        )

    def decode_answers(self, prompts: list[torch.Tensor],
                       max_new_tokens: int | None = None) -> list[tuple[torch.Tensor, list[int]]]:
        """``(answer ids, tokens committed per target verification)`` for each prompt: :meth:`generate_ids`, with no
        verifications; a speculative decoder (DFlash) gives its counts, whose mean τ the harness reports."""
        return [(answer, []) for answer in self.generate_ids(prompts, max_new_tokens)]
