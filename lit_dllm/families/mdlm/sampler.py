"""LLaDA-style masked-diffusion sampler: semi-autoregressive blocks, low-confidence remasking.

Each row is laid out as the training data is, ``[prompt][MASK × gen_length][pad]`` (right padding, attended, as in
training), the width rounded up to a multiple of ``canvas_multiple`` as the collator rounds training rows
(``collation.pad_seq_len_divisible``): a bidirectional denoiser sees where its row ends, and one trained on rows of a
few widths can answer differently on a width it never saw. The canvas is decoded block by block; within a block, each
of ``steps_per_block`` steps commits the most confident (or random) still-masked positions, so that every block is
fully decoded after its steps. Rows stop at EOS: once a row has committed an EOS, later blocks are filled with EOS,
and generation ends when every row is done.

Sampling noise (temperature > 0, random remasking) comes from ``generator``, or, given ``keys`` (one int64 per row,
:func:`~lit_dllm.noise.keys.example_keys`), from keyed draws (:class:`StepDraws`): row ``b``'s choices are then a
function of ``keys[b]``, the step and its own logits alone, not of the other rows' noise, the batch size or the rank
(the logits themselves see the row's right padding, up to the batch's longest prompt).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.nn.utils.rnn import pad_sequence
from transformers import PreTrainedModel

from lit_dllm.core.trace import DenoisingTrace
from lit_dllm.data.batch import cut_rows_at_eos
from lit_dllm.data.packing import span_length
from lit_dllm.noise.keys import Stream, check_keys, keyed_categorical, keyed_rand
from lit_dllm.settings import check_positive_int_or_none

LogitsFn = Callable[[torch.Tensor], torch.Tensor]
"""A denoiser: ``[B, L]`` ids -> ``[B, L, V]`` logits, or a transformers model (its output's ``.logits``)."""
REMASKING = ("low_confidence", "random")
"""Remasking strategies: commit the most probable tokens first, or random ones."""
CONFIDENCE_ROWS = 64
"""Rows whose tokens and scores a step draws at a time (:func:`_confidence`): its float32 copies of the logits are
``[rows, block, V]``, where all 384 rollouts of a batch in blocks of 32 over a 49k vocabulary took 2.3 GiB a copy."""


def logits_of(model: LogitsFn, x: torch.Tensor, **kwargs) -> torch.Tensor:
    """``model(x, **kwargs)``'s logits: the tensor a function returns, or a transformers model output's ``.logits``."""
    out = model(x, **kwargs)
    return getattr(out, "logits", out)


def transformers_model(model: LogitsFn) -> PreTrainedModel | None:
    """The transformers model a denoiser runs: ``model`` itself or its ``model.hf`` (None for a plain function)."""
    return model if isinstance(model, PreTrainedModel) else getattr(model, "hf", None)


def keeps_columns(model: LogitsFn) -> bool:
    """Whether the denoiser's transformers model is one of transformers' own classes taking ``logits_to_keep``: its LM
    head can then run on each row's block columns only, not the whole canvas."""
    own = next((cls for cls in type(transformers_model(model)).__mro__
                if cls.__module__.startswith("transformers.models.")), None)
    return own is not None and "logits_to_keep" in inspect.signature(own.forward).parameters


def column_logits(model: LogitsFn, x: torch.Tensor, cols: torch.Tensor, keep: bool, **kwargs) -> torch.Tensor:
    """Logits ``[B, C, V]`` of ``model`` over ``x`` at each row's columns ``cols`` ``[B, C]``. With ``keep``
    (:func:`keeps_columns`) the LM head runs at those columns only (``logits_to_keep``); else over every column of
    ``x``, gathered after."""
    if keep:
        return logits_of(model, x, logits_to_keep=cols, **kwargs)
    return torch.take_along_dim(logits_of(model, x, **kwargs), cols[..., None], dim=1)


def transfer_schedule(num_masked: torch.Tensor, steps: int) -> torch.Tensor:
    """``[B, steps]`` tokens to commit per step: ``num_masked`` split as evenly as possible, extras first."""
    base = num_masked[:, None] // steps
    extra = (torch.arange(steps, device=num_masked.device)[None, :] < (num_masked % steps)[:, None]).long()
    return base + extra


@dataclass(frozen=True)
class StepDraws:
    """The keyed draws of one denoising step: row ``b``'s draw at block column ``j`` hashes ``(keys[b], stream,
    start + j)``, ``start`` numbering the (block, step) pairs of a row (:func:`step_draws`), so no two steps share
    draws."""

    keys: torch.Tensor
    start: int

    def tokens(self, logits: torch.Tensor, temperature: float) -> torch.Tensor:
        """One token per position of ``logits`` ``[B, C, V]`` from softmax(logits / temperature)."""
        return keyed_categorical(torch.softmax(logits / temperature, -1), self.keys, Stream.RL_ROLLOUT, self.start)

    def scores(self, shape: torch.Size) -> torch.Tensor:
        """``random`` remasking's scores ``[B, C]``."""
        return keyed_rand(self.keys, Stream.RANDOM_REMASK, tuple(shape), start=self.start)

    def rows(self, start: int, stop: int) -> StepDraws:
        """The draws of rows ``start:stop`` (each row's draws hash its own key: the same as in the whole batch)."""
        return StepDraws(self.keys[start:stop], self.start)


def step_draws(keys: torch.Tensor | None, block: int, step: int, steps_per_block: int, block_length: int
               ) -> StepDraws | None:
    """The keyed draws of ``step`` of ``block`` (None without keys: the generator's noise)."""
    return None if keys is None else StepDraws(keys, (block * steps_per_block + step) * block_length)


def _confidence(logits: torch.Tensor, temperature: float, remasking: str, generator,
                draws: StepDraws | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Chosen tokens and their scores (higher = commit first); the noise from ``draws`` when given, else
    ``generator``, whose stream is drawn over the whole batch at once. Without a generator's noise every row's choice
    is its own, so the rows go :data:`CONFIDENCE_ROWS` at a time."""
    if draws is None and (temperature > 0 or remasking != "low_confidence"):
        return _draw_rows(logits, temperature, remasking, generator, None)
    parts = [_draw_rows(logits[start : start + CONFIDENCE_ROWS], temperature, remasking, generator,
                        None if draws is None else draws.rows(start, start + CONFIDENCE_ROWS))
             for start in range(0, len(logits), CONFIDENCE_ROWS)]
    return torch.cat([tokens for tokens, _ in parts]), torch.cat([score for _, score in parts])


def _draw_rows(logits: torch.Tensor, temperature: float, remasking: str, generator,
               draws: StepDraws | None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_confidence` of the rows of ``logits`` at once."""
    logits = logits.float()
    if temperature > 0 and draws is not None:
        tokens = draws.tokens(logits, temperature)
    elif temperature > 0:
        u = torch.rand(logits.shape, device=logits.device, generator=generator).clamp_(1e-10, 1.0)
        tokens = (logits / temperature - torch.log(-torch.log(u))).argmax(-1)
    else:
        tokens = logits.argmax(-1)
    if remasking == "low_confidence":
        score = torch.softmax(logits, -1).gather(-1, tokens[..., None]).squeeze(-1)
    elif draws is not None:
        score = draws.scores(tokens.shape)
    else:
        score = torch.rand(tokens.shape, device=logits.device, generator=generator)
    return tokens, score


def chosen_probability(logits: torch.Tensor, tokens: torch.Tensor, score: torch.Tensor, remasking: str) -> torch.Tensor:
    """The denoiser's probability of each chosen token: ``low_confidence``'s score already is it (one softmax over the
    vocabulary), ``random``'s is computed."""
    if remasking == "low_confidence":
        return score
    return torch.softmax(logits.float(), -1).gather(-1, tokens[..., None]).squeeze(-1)


def block_positions(block: int, block_length: int, cols: torch.Tensor) -> torch.Tensor:
    """The canvas offsets ``[B, block_length]`` of block ``block`` (a trace's positions)."""
    return torch.arange(block * block_length, (block + 1) * block_length, device=cols.device).expand_as(cols)


def check_schedule(remasking: str, temperature: float, gen_length: int, block_length: int, steps: int) -> int:
    """Raise a ``ValueError`` naming the first bad sampling setting; return the number of blocks."""
    if remasking not in REMASKING:
        raise ValueError(f"remasking={remasking!r}; use 'low_confidence' or 'random'.")
    if temperature < 0:
        raise ValueError(f"temperature={temperature} must be >= 0 (0: greedy).")
    if gen_length <= 0 or block_length <= 0 or gen_length % block_length:
        raise ValueError(
            f"gen_length={gen_length} must be a positive multiple of block_length={block_length}."
        )
    num_blocks = gen_length // block_length
    if steps < num_blocks or steps % num_blocks:
        raise ValueError(f"steps={steps} must be a positive multiple of the number of blocks ({num_blocks}).")
    return num_blocks


def canvas_width(longest_prompt: int, gen_length: int, canvas_multiple: int | None) -> int:
    """The rows' width: the longest prompt and ``gen_length``, rounded up to a multiple of ``canvas_multiple``."""
    check_positive_int_or_none("canvas_multiple", canvas_multiple,
                               "no rounding; give the training collation's pad_seq_len_divisible")
    return span_length(longest_prompt + gen_length, canvas_multiple)


def masked_canvas(prompts: list[torch.Tensor], gen_length: int, pad_token_id: int, mask_token_id: int,
                  canvas_multiple: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x, rows, canvas)``: each prompt followed by ``gen_length`` masks, right-padded (``x`` ``[B, W]``,
    :func:`canvas_width`), the row indices ``[B, 1]`` and the canvas's absolute positions ``[B, G]``."""
    device = prompts[0].device
    x = pad_sequence(prompts, batch_first=True, padding_value=pad_token_id).long()
    x = torch.nn.functional.pad(x, (0, canvas_width(x.shape[1], gen_length, canvas_multiple) - x.shape[1]),
                                value=pad_token_id)
    rows = torch.arange(len(prompts), device=device)[:, None]
    lengths = torch.tensor([len(p) for p in prompts], device=device)
    canvas = lengths[:, None] + torch.arange(gen_length, device=device)[None, :]
    x[rows, canvas] = mask_token_id
    return x, rows, canvas


@torch.no_grad()
def llada_generate(
    logits_fn: LogitsFn,
    prompts: list[torch.Tensor],
    *,
    mask_token_id: int,
    pad_token_id: int,
    eos_token_id: int | None = None,
    gen_length: int = 64,
    steps: int = 64,
    block_length: int = 32,
    remasking: str = "low_confidence",
    temperature: float = 0.0,
    canvas_multiple: int | None = None,
    generator: torch.Generator | None = None,
    keys: torch.Tensor | None = None,
    everywhere: Callable[[bool], bool] = bool,
    trace: DenoisingTrace | None = None,
) -> list[torch.Tensor]:
    """Generate ``gen_length`` tokens after each prompt; returns each answer cut at its first EOS.

    Args:
        logits_fn: ``[B, L]`` ids -> ``[B, L, V]`` logits of a bidirectional denoiser, or a bidirectional
            transformers model, e.g. an MDLM export: ``llada_generate(hf, prompts, **hf.config.dllm_sampling)``.
        prompts: 1-D id tensors (any lengths).
        steps: total denoising steps, split evenly over the ``gen_length / block_length`` blocks.
        remasking: ``"low_confidence"`` (commit the most probable first) or ``"random"``.
        temperature: 0 = greedy; > 0 samples at that temperature (Gumbel noise from ``generator``, or with
            ``keys`` one keyed uniform per position, by inverse CDF).
        canvas_multiple: round the rows' width (the longest prompt + ``gen_length``) up to a multiple of this, with
            padding after the canvas, as training rows were (None: no rounding).
        keys: ``[B]`` int64, one per prompt: every random choice of a row keyed by its key (:class:`StepDraws`),
            so that a row's answer does not depend on the rest of the batch's noise (None: ``generator``).
        everywhere: ``flag -> whether it holds on every rank``. Sharded models (FSDP2, expert parallelism) need
            every rank in every forward, so a rank may skip work (all rows done, block decoded) only when all can.
        trace: a :class:`~lit_dllm.core.trace.DenoisingTrace` that records each step's committed positions, tokens and
            their probabilities (None: nothing recorded, nothing computed).
    """
    num_blocks = check_schedule(remasking, temperature, gen_length, block_length, steps)
    if not prompts:
        return []
    steps_per_block = steps // num_blocks
    x, rows, canvas = masked_canvas(prompts, gen_length, pad_token_id, mask_token_id, canvas_multiple)
    keys = None if keys is None else check_keys(keys, len(prompts), x.device)
    done = torch.zeros(len(prompts), dtype=torch.bool, device=x.device)
    keep = keeps_columns(logits_fn)

    for block in range(num_blocks):
        cols = canvas[:, block * block_length : (block + 1) * block_length]
        if eos_token_id is not None and everywhere(bool(done.all())):
            x[rows, cols] = eos_token_id
            continue
        if eos_token_id is not None:
            x[rows, cols] = torch.where(done[:, None], torch.full_like(cols, eos_token_id), x[rows, cols])
        schedule = transfer_schedule((x[rows, cols] == mask_token_id).sum(1), steps_per_block)
        for step in range(steps_per_block):
            still_masked = x[rows, cols] == mask_token_id
            if everywhere(not still_masked.any()):
                break
            logits = column_logits(logits_fn, x, cols, keep)
            draws = step_draws(keys, block, step, steps_per_block, block_length)
            tokens, score = _confidence(logits, temperature, remasking, generator, draws)
            score = score.masked_fill(~still_masked, -torch.inf)
            rank = score.argsort(dim=1, descending=True).argsort(dim=1)
            commit = (rank < schedule[:, step : step + 1]) & still_masked
            x[rows, cols] = torch.where(commit, tokens, x[rows, cols])
            if trace is not None:
                trace.record(block_positions(block, block_length, cols), commit, tokens,
                             chosen_probability(logits, tokens, score, remasking))
        if eos_token_id is not None:
            done |= (x[rows, cols] == eos_token_id).any(1)

    return cut_rows_at_eos(x[rows, canvas], eos_token_id)
