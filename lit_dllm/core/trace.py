"""Pictures of what a model does: the denoising trace of a sampler (:class:`DenoisingTrace`) and a run's curves read
back from its own TensorBoard logs (:func:`run_scalars`, :func:`curves_figure`).

Recording needs nothing beyond torch; drawing needs matplotlib, the ``notebooks`` extra
(``pip install 'lit_dllm[notebooks]'``), imported only when a figure is drawn.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator


def new_figure(width: float, height: float, rows: int = 1, columns: int = 1):
    """A matplotlib ``Figure`` (not pyplot's: no global state, so drawing in a training run is safe) and its axes."""
    try:
        from matplotlib.figure import Figure
    except ImportError as err:
        raise ImportError("Drawing a trace or a run's curves needs matplotlib: pip install 'lit_dllm[notebooks]'.") from err
    figure = Figure(figsize=(width, height), layout="constrained")
    return figure, figure.subplots(rows, columns, squeeze=False)


class DenoisingTrace:
    """What a sampler did, step by step: which canvas positions each step committed, the tokens and their confidence.

    Pass one as ``trace=`` to :func:`~lit_dllm.families.mdlm.sampler.llada_generate`,
    :func:`~lit_dllm.families.mdlm.fast_sampler.fast_generate` or a diffusion module's ``generate`` / ``generate_ids``
    (MDLM, hybrid, DiffusionGemma); without one a sampler records nothing and its cost is unchanged. Positions are
    canvas offsets (0 is the first new token) and steps count model calls over the whole answer, block after block,
    per row of the prompts. After the call:

    * :attr:`step_of` ``[B, G]``: the step that committed each position (-1: none, e.g. past the row's EOS, whose
      blocks the sampler fills without a step);
    * :attr:`tokens` ``[B, G]`` and :attr:`confidence` ``[B, G]``: the committed token and its probability under the
      denoiser at that step (-1 and NaN where none);
    * :meth:`answer`: the committed tokens up to the first EOS, i.e. the sampler's answer for that row;
    * :meth:`image` ``[steps, G]`` and :meth:`figure`: the step × position picture.
    """

    def __init__(self) -> None:
        self._events: list[tuple[torch.Tensor, ...]] = []
        self._steps: dict[int, int] = {}  # steps recorded so far, per row
        self._table: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def record(self, positions: torch.Tensor, committed: torch.Tensor, tokens: torch.Tensor, confidence: torch.Tensor,
               rows: Sequence[int] | None = None) -> None:
        """One step of the sampler over ``rows`` (default: all, 0..B-1): at canvas ``positions`` ``[B, C]``, which
        positions it ``committed`` (bool) and the ``tokens`` / ``confidence`` it chose there (all ``[B, C]``). The
        tensors are kept as given (the samplers hand fresh ones) and moved to the CPU when read."""
        rows = list(range(len(committed))) if rows is None else list(rows)
        steps = torch.tensor([self._steps.get(row, 0) for row in rows])
        for row in rows:
            self._steps[row] = self._steps.get(row, 0) + 1
        self._events.append((torch.tensor(rows), steps, positions, committed, tokens, confidence))
        self._table = None

    def _read(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self._table is None:
            events = [[t.detach().cpu() for t in event] for event in self._events]
            shape = (max(self._steps, default=-1) + 1,
                     max((int(e[2].max()) + 1 for e in events if e[2].numel()), default=0))
            step_of = torch.full(shape, -1, dtype=torch.long)
            tokens = torch.full(shape, -1, dtype=torch.long)
            confidence = torch.full(shape, math.nan)
            for rows, steps, positions, committed, chosen, score in events:
                r, c = committed.nonzero(as_tuple=True)
                where = (rows[r], positions[r, c])
                step_of[where], tokens[where], confidence[where] = steps[r], chosen[r, c], score[r, c].float()
            self._table = step_of, tokens, confidence
        return self._table

    @property
    def step_of(self) -> torch.Tensor:
        return self._read()[0]

    @property
    def tokens(self) -> torch.Tensor:
        return self._read()[1]

    @property
    def confidence(self) -> torch.Tensor:
        return self._read()[2]

    def num_steps(self, row: int = 0) -> int:
        """Steps the sampler took for ``row``."""
        return self._steps.get(row, 0)

    def answer(self, row: int = 0, eos_token_id: int | None = None) -> torch.Tensor:
        """The committed tokens of ``row`` from position 0 up to (without) the first EOS or the first position no step
        committed: what the sampler answered, rebuilt from the trace alone."""
        tokens = self.tokens[row]
        stop = (tokens < 0) | (tokens == eos_token_id) if eos_token_id is not None else tokens < 0
        end = int(stop.nonzero()[0, 0]) if stop.any() else len(tokens)
        return tokens[:end]

    def image(self, row: int = 0) -> torch.Tensor:
        """``[steps, G]``: the confidence of each position at the step that committed it, NaN elsewhere."""
        step_of, _, confidence = self._read()
        image = torch.full((self.num_steps(row), step_of.shape[1]), math.nan)
        committed = (step_of[row] >= 0).nonzero()[:, 0]
        image[step_of[row, committed], committed] = confidence[row, committed]
        return image

    def figure(self, row: int = 0, tokenizer=None, title: str | None = None):
        """The step × position picture of ``row``: each position lit at its step by its confidence, grey once
        committed; the positions labelled with their tokens (decoded with ``tokenizer``, else ids), and the
        decoded answer as the title. A matplotlib ``Figure``."""
        image = self.image(row)
        steps, width = image.shape
        done = torch.zeros(steps, width)
        step_of = self.step_of[row]
        for position in (step_of >= 0).nonzero()[:, 0].tolist():
            done[step_of[position] + 1 :, position] = 1.0
        figure, ((ax,),) = new_figure(max(4.0, 0.35 * width + 2), max(2.5, 0.22 * steps + 1.5))
        ax.imshow(done.masked_fill(done == 0, math.nan).numpy(), cmap="Greys", vmin=0, vmax=4, aspect="auto",
                  interpolation="nearest")
        shown = ax.imshow(image.numpy(), cmap="viridis", vmin=0, vmax=1, aspect="auto", interpolation="nearest")
        figure.colorbar(shown, ax=ax, label="confidence when committed")
        tokens = self.tokens[row].tolist()
        labels = [("" if t < 0 else tokenizer.decode([t]) if tokenizer is not None else str(t)) for t in tokens]
        ax.set_xticks(range(width), labels, fontsize=8)
        ax.set_xlabel("canvas position (committed token)")
        ax.set_ylabel("step")
        if title is None and tokenizer is not None:
            title = repr(tokenizer.decode(self.answer(row, getattr(tokenizer, "eos_token_id", None)).tolist()))
        ax.set_title(title or "")
        return figure


def run_scalars(log_dir: str) -> dict[str, tuple[list[int], list[float]]]:
    """Every scalar a TensorBoard log folder holds (e.g. ``trainer.logger.log_dir``): tag -> (steps, values)."""
    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: ([e.step for e in events.Scalars(tag)], [e.value for e in events.Scalars(tag)])
            for tag in events.Tags()["scalars"]}


def curves_figure(scalars: dict[str, tuple[list[int], list[float]]], panels: Sequence[str | Sequence[str]],
                  xlabel: str = "optimizer step"):
    """One panel per entry of ``panels``: a tag of ``scalars`` (:func:`run_scalars`) or several drawn together,
    over the logged steps (``xlabel``: the RL modules log one step per batch of rollouts). A tag the run did not log is
    a ``KeyError`` naming the ones it did."""
    panels = [[panel] if isinstance(panel, str) else list(panel) for panel in panels]
    missing = [tag for panel in panels for tag in panel if tag not in scalars]
    if missing:
        raise KeyError(f"The run logged no {missing}; it logged {sorted(scalars)}.")
    figure, axes = new_figure(4.0 * len(panels), 3.0, 1, len(panels))
    for ax, panel in zip(axes[0], panels):
        for tag in panel:
            ax.plot(*scalars[tag], marker="o" if len(scalars[tag][0]) < 10 else None, label=tag)
        ax.set_xlabel(xlabel)
        ax.set_title(os.path.commonprefix(panel).rstrip("_/") if len(panel) > 1 else panel[0])
        if len(panel) > 1:
            ax.legend(fontsize=7)
    return figure
