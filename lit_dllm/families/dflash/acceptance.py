"""What a DFlash draft's speculative decoding accepts: the tokens each target verification commits
(:class:`AcceptanceCounter`, a streamer of transformers' assisted decoding), by position in the block
(:func:`accepted_per_position`), and their picture (:func:`acceptance_figure`)."""

from __future__ import annotations

from typing import NamedTuple

import torch
from transformers.generation.streamers import BaseStreamer

from lit_dllm.core.trace import new_figure


class Decoded(NamedTuple):
    """One speculative decoding: the new tokens (prompt excluded) and the tokens committed by each target
    verification step (the prefill's first token excluded); τ is their mean. Before any cut at eos,
    ``1 + sum(accepted) == len(tokens)``."""

    tokens: torch.Tensor
    accepted: list[int]


class AcceptanceCounter(BaseStreamer):
    """Counts the tokens each step of transformers' assisted decoding commits: ``generate`` puts the prompt, then
    the prefill's token, then ``n_matches + 1`` tokens per verification (cut at eos)."""

    def __init__(self) -> None:
        self.puts: list[int] = []

    def put(self, value: torch.Tensor) -> None:
        self.puts.append(int(value.numel()))

    def end(self) -> None:
        pass

    @property
    def accepted(self) -> list[int]:
        return self.puts[2:]  # skip the prompt and the prefill's token


def accepted_per_position(accepted: list[int], block_size: int) -> torch.Tensor:
    """``[block_size]``: the fraction of verification steps that committed a token at each position of the block
    (position ``k``, from 1: the steps whose accepted length is at least ``k``; position 1, the target's own token,
    is always 1)."""
    lengths = torch.tensor(accepted, dtype=torch.float)
    positions = torch.arange(1, block_size + 1, dtype=torch.float)
    return (lengths[:, None] >= positions).float().mean(0) if len(accepted) else torch.zeros(block_size)


def acceptance_figure(accepted: list[int], block_size: int, title: str = ""):
    """A histogram of the accepted lengths of the verification steps ``accepted``, beside the acceptance at each
    position of the block (:func:`accepted_per_position`). A matplotlib ``Figure``."""
    figure, ((lengths, positions),) = new_figure(8.0, 3.0, 1, 2)
    bins = torch.arange(1, block_size + 2) - 0.5
    lengths.hist(accepted, bins=bins.tolist(), rwidth=0.85)
    mean = sum(accepted) / max(len(accepted), 1)
    lengths.set_xlabel("tokens committed per verification")
    lengths.set_ylabel("verification steps")
    lengths.set_title(f"{len(accepted)} steps, τ = {mean:.2f}")
    positions.bar(range(1, block_size + 1), accepted_per_position(accepted, block_size).tolist())
    positions.set_ylim(0, 1.05)
    positions.set_xlabel("position in the block")
    positions.set_ylabel("accepted")
    figure.suptitle(title)
    return figure
