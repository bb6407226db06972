"""Generation for every family: ``generate(prompts)``, ``predict_step`` and exact-match validation
(:class:`GenerationMixin`). A family supplies :meth:`generate_ids` (the masked-diffusion sampling lives with its
family: :class:`~lit_dllm.families.mdlm.module.LLaDAGenerationMixin`)."""

from __future__ import annotations

import re
from contextlib import contextmanager

import torch
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_warn
from torchmetrics import MeanMetric

from lit_dllm.context_parallel import whole_sequences
from lit_dllm.core.trace import DenoisingTrace
from lit_dllm.settings import DenoisingGeneration, Generation
from lit_dllm.data.batch import split_prompt_answer
from lit_dllm.data.formats import encode_prompt

FAMILY_KEY = "lit_dllm_family"
"""The exported config's record of the family that trained it (``mdlm``, ``causal_lm``): an RL module checks its
start by it."""

DEFAULT_GEN_LENGTH = 64
"""New tokens at most when neither the call nor ``gen_length`` says."""

MARKDOWN_SPECIAL = frozenset("&<>|\\`*_[]")
"""Characters that markdown or HTML would interpret; table cells show them as HTML entities."""


def markdown_cell(value) -> str:
    """``value`` as one markdown table cell that renders verbatim: specials as entities, newlines as ``<br>``."""
    escaped = "".join(f"&#{ord(c)};" if c in MARKDOWN_SPECIAL else c for c in str(value))
    return "<br>".join(escaped.splitlines())


def samples_table(rows: list[dict]) -> str:
    """A markdown table of ``rows`` (the first row's keys as columns) for TensorBoard's text panel."""
    lines = [list(rows[0]), *([row[key] for key in rows[0]] for row in rows)]
    cells = ["| " + " | ".join(markdown_cell(value) for value in line) + " |" for line in lines]
    return "\n".join([cells[0], "|" + "---|" * len(rows[0]), *cells[1:]])


def extract_answer(text: str, pattern: str | None) -> str | None:
    """The first group of ``pattern``'s first match in ``text`` (``re.search``), stripped; None if it does not match.
    Without a pattern (empty or None), the whole ``text``. No normalisation: ``1,000`` is not ``1000``."""
    if not pattern:
        return text
    match = re.search(pattern, text)
    return None if match is None or match.group(1) is None else match.group(1).strip()


class GenerationMixin:
    """Answers and their scoring for any family whose :meth:`generate_ids` answers prompts: ``generate(texts)``,
    ``predict_step`` rows and ``exact_match`` in validation / test.

    Reads the module's ``generation`` group (:class:`~lit_dllm.settings.Generation` or a family's subclass):
    ``gen_length``, ``temperature``, ``val_generate_batches`` (batches answered and scored by :meth:`score_answer` into
    ``exact_match``) and ``answer_pattern`` (see :meth:`extract_answer`).
    """

    generation: Generation
    """The family's ``generation`` group (e.g. ``LLaDAGeneration``), set by its constructor."""

    def stage_metrics(self):
        metrics = super().stage_metrics()
        metrics["exact_match"] = MeanMetric()
        return metrics

    @property
    def max_positions(self) -> int | None:
        """The backbone's text config's ``max_position_embeddings`` (None when it has none)."""
        config = getattr(getattr(self.model, "hf", None), "config", None)
        text_config = config.get_text_config() if config is not None else None  # DiffusionGemma nests its own
        return getattr(text_config, "max_position_embeddings", None)

    def check_fits(self, prompts: list[torch.Tensor], length: int, setting: str = "gen_length") -> None:
        """Raise when the longest prompt plus ``length`` new tokens (the value of ``setting``) exceeds the model's
        position table."""
        longest = max((len(p) for p in prompts), default=0)
        if self.max_positions is not None and longest + length > self.max_positions:
            raise ValueError(
                f"prompt ({longest} tokens) + {setting} {length} = {longest + length} positions > "
                f"max_position_embeddings={self.max_positions} of the model: raise max_position_embeddings, "
                f"or lower {setting} / shorten the prompts."
            )

    def check_positions(self, context: int, continuation: int) -> None:
        """Raise when a scored ``context`` + ``continuation`` (token counts) exceeds the model's position table."""
        limit = self.max_positions
        if limit is not None and context + continuation > limit:
            raise ValueError(
                f"context ({context} tokens) + continuation ({continuation}) > max_position_embeddings={limit}: "
                "shorten the task's prompts (e.g. fewer few-shot examples)."
            )

    def on_every_rank(self, flag: bool) -> bool:
        """Whether ``flag`` holds on every rank (just ``flag`` outside a distributed fit)."""
        trainer = self.attached_trainer
        if trainer is None or trainer.world_size == 1:
            return flag
        return trainer.strategy.reduce_boolean_decision(flag, all=True)

    @contextmanager
    def generating(self):
        """Eval mode (no dropout) for the block, then the previous mode back; under context parallelism the model runs
        whole sequences meanwhile (:func:`~lit_dllm.context_parallel.whole_sequences`)."""
        was_training = self.training
        self.eval()
        try:
            with whole_sequences(self.model):
                yield
        finally:
            self.train(was_training)

    def generate(self, prompts: list[str], max_new_tokens: int | None = None,
                 trace: DenoisingTrace | None = None) -> list[str]:
        """Answer each text prompt (the prompt is tokenised as the data module formats it); a diffusion family records
        its denoising into ``trace`` (:class:`~lit_dllm.core.trace.DenoisingTrace`) when one is given."""
        tok = self.tokenizer
        ids = [torch.tensor(encode_prompt(tok, p)) for p in prompts]
        return [tok.decode(a, skip_special_tokens=True) for a in self.traced_ids(ids, max_new_tokens, trace)]

    def traced_ids(self, prompts: list[torch.Tensor], max_new_tokens: int | None,
                   trace: DenoisingTrace | None) -> list[torch.Tensor]:
        """:meth:`generate_ids`, given ``trace`` when there is one: only the diffusion families' ``generate_ids``
        (those of :class:`~lit_dllm.settings.DenoisingGeneration`) take it."""
        if trace is None:
            return self.generate_ids(prompts, max_new_tokens)
        return self.generate_ids(prompts, max_new_tokens, trace=trace)

    def extract_answer(self, text: str) -> str | None:
        """:func:`extract_answer` of ``text`` with the ``answer_pattern`` of :attr:`generation`."""
        return extract_answer(text, self.generation.answer_pattern)

    def score_answer(self, generated: str, reference: str) -> float:
        """Score of a decoded generation against its decoded reference; ``exact_match`` is its mean.

        Default: 1.0 when both extracted answers exist and are equal, else 0.0. A reference without an answer
        scores 0 and is reported once (a warning). Override for another metric (e.g. numeric comparison).
        """
        answer, expected = self.extract_answer(generated), self.extract_answer(reference)
        if expected is None and not getattr(self, "_warned_unmatched_reference", False):
            self._warned_unmatched_reference = True
            rank_zero_warn(
                f"The reference {reference[:200]!r} has no match for "
                f"answer_pattern={self.generation.answer_pattern!r}; "
                "such references score 0 (reported once). Check the pattern against the data's answers."
            )
        return float(answer is not None and answer == expected)

    def answer_batch(self, batch: dict, trace: DenoisingTrace | None = None) -> list[dict]:
        """Answer the batch's prompt rows: one dict each with ``example_index``, ``prompt``, ``generated``
        and ``reference`` (EOS removed), ``hit_gen_length`` (the answer reached the length limit without eos)
        and, with ``answer_pattern``, ``extracted`` / ``reference_answer``; a diffusion family records its denoising
        into ``trace`` when one is given."""
        rows, prompts, answers = split_prompt_answer(batch, self.eos_token_id)
        if not prompts:
            return []
        generation = self.generation
        length = generation.gen_length or max(len(a) for a in answers) + 1
        outputs = self.traced_ids(prompts, length, trace)
        indices = batch["example_index"][rows].tolist() if "example_index" in batch else [None] * len(rows)
        decode = self.tokenizer.batch_decode  # of lists: a tensor per row costs a conversion each
        texts = zip(decode([p.tolist() for p in prompts]),
                    decode([o.tolist() for o in outputs], skip_special_tokens=True),
                    decode([a.tolist() for a in answers], skip_special_tokens=True))
        results = []
        for index, output, (prompt, generated, reference) in zip(indices, outputs, texts):
            row = {"example_index": index, "prompt": prompt, "generated": generated, "reference": reference,
                   "hit_gen_length": len(output) >= length}  # answers are cut before eos: full length = no eos
            if generation.answer_pattern:
                row.update(extracted=self.extract_answer(generated), reference_answer=self.extract_answer(reference))
            results.append(row)
        return results

    def predict_step(self, batch: dict, batch_idx: int) -> list[dict]:
        return self.answer_batch(batch)

    def evaluate(self, batch: dict, batch_idx: int, stage: str) -> None:
        super().evaluate(batch, batch_idx, stage)
        if batch_idx < self.generation.val_generate_batches:
            self.score_generation(batch, batch_idx, stage)

    def score_generation(self, batch: dict, batch_idx: int, stage: str) -> None:
        """Answer the batch's prompts and log ``exact_match`` (and, on the first batch, a table of samples); a family
        that scores its decoding otherwise overrides this."""
        draws = self.draws_pictures(batch_idx)
        traced = draws and isinstance(self.generation, DenoisingGeneration) and self.generation.val_trace
        trace = DenoisingTrace() if traced else None
        rows = self.answer_batch(batch, trace)
        if not rows:
            return
        scores = torch.tensor([self.score_answer(r["generated"], r["reference"]) for r in rows], dtype=torch.float)
        exact_match = self.eval_metrics[stage]["exact_match"]
        exact_match.update(scores.mean().to(self.device), weight=len(scores))
        self.log(f"{stage}/exact_match", exact_match, prog_bar=True)
        if draws:
            self.logger.experiment.add_text(f"{stage}/samples", samples_table(rows[:4]), global_step=self.global_step)
        if trace is not None:
            self.add_figure(f"{stage}/trace", trace.figure(0, self.tokenizer, f"{rows[0]['prompt']} -> "
                                                                              f"{rows[0]['generated']}"))

    def draws_pictures(self, batch_idx: int) -> bool:
        """Whether this evaluation batch's samples (and, when the generation group asks, pictures) go to TensorBoard:
        the first batch of a pass, with a TensorBoard logger, outside the sanity check."""
        return batch_idx == 0 and isinstance(self.logger, TensorBoardLogger) and not self.trainer.sanity_checking

    def add_figure(self, tag: str, figure) -> None:
        """A matplotlib figure into TensorBoard's images at the current step."""
        self.logger.experiment.add_figure(tag, figure, global_step=self.global_step, close=False)

