"""The denoising trace of transformers' DiffusionGemma ``generate`` (:class:`DraftRecorder`, a streamer)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers.generation.streamers import BaseStreamer

from lit_dllm.core.trace import DenoisingTrace


class DraftRecorder(BaseStreamer):
    """Streams one ``generate`` call's denoising into a :class:`~lit_dllm.core.trace.DenoisingTrace`.

    ``generate`` hands a streamer the prompt (``put``), then every denoising step's logits of the canvas
    (``put_draft``, as this streamer takes logits), and each finished canvas (``put``). A canvas's answer is its last
    step's argmax, so a position counts as committed at the first step from which its argmax no longer changes, with
    that step's probability of it (under the logits handed over: after the temperature, in the embeddings' dtype).
    ``rows`` are the trace rows of this call's prompts (a module answers prompts of each length in a call of their
    own).
    """

    _takes_logits = True

    def __init__(self, trace: DenoisingTrace, rows: Sequence[int]) -> None:
        self.trace, self.rows = trace, list(rows)
        self.drafts: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.puts = 0
        self.written = 0  # canvas positions already in the trace

    def put_draft(self, logits: torch.Tensor) -> None:
        confidence, tokens = torch.softmax(logits.float(), -1).max(-1)
        self.drafts.append((tokens, confidence))

    def put(self, value: torch.Tensor) -> None:
        self.puts += 1
        if self.puts > 1:  # the first is the prompt
            self._commit_canvas()

    def end(self) -> None:
        pass

    def _commit_canvas(self) -> None:
        tokens, confidence = (torch.stack(column) for column in zip(*self.drafts))  # [steps, B, C]
        settled = (tokens == tokens[-1]).flip(0).cumprod(0).flip(0).bool()  # unchanged from this step to the last
        first = settled & ~torch.cat([torch.zeros_like(settled[:1]), settled[:-1]])
        width = tokens.shape[2]
        positions = torch.arange(self.written, self.written + width).expand(len(self.rows), -1)
        for step in range(len(tokens)):
            self.trace.record(positions, first[step], tokens[step], confidence[step], rows=self.rows)
        self.written += width
        self.drafts.clear()
