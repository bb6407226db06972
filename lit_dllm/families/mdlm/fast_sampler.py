"""Fast-dLLM-style sampling: confidence-threshold parallel decoding and a block-wise approximate KV cache.

The canvas, blocks, schedule and EOS handling are those of :func:`~lit_dllm.families.mdlm.sampler.llada_generate`. Two
additions (Wu et al., 2025, "Fast-dLLM"):

* ``threshold``: besides its share of the LLaDA schedule, a step commits every masked position of the block whose
  chosen token has probability ``>= threshold``, so a block may finish in fewer steps (> 1: the LLaDA schedule only).
* ``cache``: the first step of a block runs the whole canvas and keeps every layer's keys / values
  (:class:`CanvasCache`); the block's later steps run only a window of columns, which rewrites its own entries and
  attends to all. ``"prefix"`` runs the block and everything after it (with prompts of different lengths, from
  the first row's block start); ``"dual"`` runs each row's block alone, and on a CUDA device as one CUDA graph
  (:class:`GraphedWindow`). Entries outside the window are not refreshed while the block is
  decoded, so with more than one layer they are stale (they attended to the block's old tokens): approximate, and
  exact for a one-layer model.

Every pass, cached or not, is a call of the model given (``model(ids, cache=..., use_cache=True, position_ids=...)``
for the cached ones), never of a module inside it: under FSDP2 the root's hooks gather the parameters it holds
(embedding, final norm, LM head). With ``everywhere``, ranks that answer different prompts take every step together.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.distributed.tensor import DTensor
from transformers import DynamicCache

from lit_dllm.core.trace import DenoisingTrace
from lit_dllm.data.batch import cut_rows_at_eos
from lit_dllm.noise.keys import check_keys
from lit_dllm.families.mdlm.sampler import (
    _confidence, block_positions, check_schedule, chosen_probability, column_logits, keeps_columns, masked_canvas,
    step_draws, transfer_schedule, transformers_model
)

CACHES = ("none", "prefix", "dual")
"""``none``: every step runs the whole canvas; ``prefix`` / ``dual``: see the module docstring."""


class CanvasCache(DynamicCache):
    """Every layer's keys / values at every column of the ``width``-column canvas, kept at one address: the first
    pass covers the whole canvas, and each later pass writes the entries of its own columns (each row's
    :attr:`columns`) in place and attends to all of them (attention is order-free: each key already carries its
    position). A window pass therefore sees the other columns as they were at the last full pass and its own as
    they are now."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.width = width
        self.columns: torch.Tensor | None = None
        """``[B, w]``: the columns of each row that the next pass writes, in the order of its inputs."""

    def update(self, keys: torch.Tensor, values: torch.Tensor, layer_idx: int, *args, **kwargs):
        if layer_idx >= len(self.layers) or not self.layers[layer_idx].is_initialized:
            if keys.shape[2] != self.width:
                raise ValueError(f"The first pass over a CanvasCache covers all {self.width} columns, "
                                 f"not {keys.shape[2]}.")
            return super().update(keys, values, layer_idx, *args, **kwargs)
        layer, where = self.layers[layer_idx], self.columns[:, None, :, None].expand_as(keys)
        layer.keys.scatter_(2, where, keys)
        layer.values.scatter_(2, where, values)
        return layer.keys, layer.values

    def get_mask_sizes(self, query_length: int, *args, **kwargs) -> tuple[int, int]:
        return self.width, 0

    def get_seq_length(self, *args, **kwargs) -> int:
        return self.width


def cached_pass(model: Callable, x: torch.Tensor, cache: CanvasCache, columns: torch.Tensor, at: torch.Tensor,
                keep: bool) -> torch.Tensor:
    """Logits ``[B, C, V]`` at inputs ``at`` ``[B, C]`` of a pass over each row's ``columns`` ``[B, w]`` of ``x``
    that writes their keys / values into ``cache`` and attends to every column's (see :class:`CanvasCache`); all
    ``width`` columns: a full pass, which refreshes the whole cache."""
    cache.columns = columns
    return column_logits(model, torch.take_along_dim(x, columns, 1), at, keep, position_ids=columns, cache=cache,
                         use_cache=True)


class GraphedWindow:
    """The dual cache's window pass (each row's block) over the canvas ``x``, captured once as a CUDA graph and
    replayed for every later step of every block: one launch per step instead of one per kernel. The graph reads
    ``x`` at replay time (the sampler writes it in place) and each row's columns from a static buffer; its logits
    are a static buffer, overwritten by the next replay."""

    def __init__(self, model: Callable, x: torch.Tensor, cache: CanvasCache, cols: torch.Tensor, keep: bool) -> None:
        self.columns, self.graph = cols.clone(), torch.cuda.CUDAGraph()
        at = torch.arange(cols.shape[1], device=cols.device).expand_as(cols)
        run = lambda: cached_pass(model, x, cache, self.columns, at, keep)  # noqa: E731
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up (a window pass is idempotent: it rewrites its own columns)
            for _ in range(2):
                run()
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(self.graph):
            self.logits = run()

    def __call__(self, cols: torch.Tensor) -> torch.Tensor:
        self.columns.copy_(cols)
        self.graph.replay()
        return self.logits


def graphs_apply(model: Callable, x: torch.Tensor) -> bool:
    """Whether a window pass may be a CUDA graph: on a CUDA device, with no parameter sharded (FSDP2 and expert
    parallelism gather parameters with collectives in the pass)."""
    return x.is_cuda and not any(isinstance(p, DTensor) for p in transformers_model(model).parameters())


@torch.no_grad()
def fast_generate(
    model: Callable[[torch.Tensor], torch.Tensor],
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
    threshold: float = 0.9,
    cache: str = "none",
    generator: torch.Generator | None = None,
    keys: torch.Tensor | None = None,
    everywhere: Callable[[bool], bool] = bool,
    graphs: bool = True,
    trace: DenoisingTrace | None = None,
) -> list[torch.Tensor]:
    """:func:`~lit_dllm.families.mdlm.sampler.llada_generate` with threshold decoding and an optional KV cache.

    Args:
        model: ``[B, L]`` ids -> ``[B, L, V]`` logits of a bidirectional denoiser; a cache also needs ``model.hf``,
            the transformers model it runs, and ``model`` to pass ``cache``, ``use_cache`` and ``position_ids`` on
            to it (as :class:`~lit_dllm.families.mdlm.model.DiffusionLM` does, sharded or not). Or the
            bidirectional transformers model itself (an MDLM export: ``**hf.config.dllm_sampling``).
        threshold: each step also commits the masked positions of the block whose token probability is at least
            this (> 0; above 1: none, which reproduces ``llada_generate`` exactly with ``cache="none"``).
        cache: ``"none"``, ``"prefix"`` or ``"dual"`` (see the module docstring).
        graphs: on a CUDA device and unsharded, the dual cache's window pass runs as one CUDA graph
            (:class:`GraphedWindow`): the same computation, without a kernel launch from Python per operation.
        trace: a :class:`~lit_dllm.core.trace.DenoisingTrace` that records each step's committed positions, tokens and
            their probabilities (None: nothing recorded).
        Other arguments: see ``llada_generate``; ``steps`` is the most steps a block takes.
    """
    num_blocks = check_schedule(remasking, temperature, gen_length, block_length, steps)
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or threshold <= 0:
        raise ValueError(f"threshold={threshold!r} must be a number > 0 (above 1: the LLaDA schedule only).")
    if cache not in CACHES:
        raise ValueError(f"cache={cache!r}; use 'none', 'prefix' or 'dual'.")
    hf = transformers_model(model)
    if cache != "none" and hf is None:
        raise ValueError(f"cache={cache!r} needs model.hf, the transformers model the denoiser runs; use cache='none'.")
    if cache != "none" and set(getattr(hf.config, "layer_types", None) or []) - {"full_attention"}:
        raise ValueError(f"cache={cache!r} needs full-attention layers only (it drops columns); use cache='none'.")
    if not prompts:
        return []
    steps_per_block = steps // num_blocks
    x, rows, canvas = masked_canvas(prompts, gen_length, pad_token_id, mask_token_id, canvas_multiple)
    keys = None if keys is None else check_keys(keys, len(prompts), x.device)
    width = x.shape[1]
    done = torch.zeros(len(prompts), dtype=torch.bool, device=x.device)
    keep = keeps_columns(model)
    kv = CanvasCache(width) if cache != "none" else None
    full = torch.arange(width, device=x.device).expand(len(prompts), -1)
    use_graph = cache == "dual" and graphs and graphs_apply(model, x)
    graphed: GraphedWindow | None = None  # captured at the second window pass: a call with one pays no capture
    eager_window_passes = 0

    for block in range(num_blocks):
        cols = canvas[:, block * block_length : (block + 1) * block_length]
        if eos_token_id is not None and everywhere(bool(done.all())):
            x[rows, cols] = eos_token_id
            continue
        if eos_token_id is not None:
            x[rows, cols] = torch.where(done[:, None], torch.full_like(cols, eos_token_id), x[rows, cols])
        schedule = transfer_schedule((x[rows, cols] == mask_token_id).sum(1), steps_per_block)
        start = int(cols[:, 0].min())  # the prefix cache's window: every row's block and everything after it
        window, at = (cols, torch.arange(block_length, device=x.device).expand_as(cols)) if cache == "dual" else (
            torch.arange(start, width, device=x.device).expand(len(prompts), -1), cols - start)
        for step in range(steps_per_block):
            still_masked = x[rows, cols] == mask_token_id
            if everywhere(not still_masked.any()):
                break
            if cache == "none":
                logits = column_logits(model, x, cols, keep)
            elif step == 0:
                logits = cached_pass(model, x, kv, full, cols, keep)
            elif use_graph and eager_window_passes:
                graphed = graphed or GraphedWindow(model, x, kv, cols, keep)
                logits = graphed(cols)
            else:
                logits = cached_pass(model, x, kv, window, at, keep)
                eager_window_passes += 1
            draws = step_draws(keys, block, step, steps_per_block, block_length)
            tokens, score = _confidence(logits, temperature, remasking, generator, draws)
            probability = chosen_probability(logits, tokens, score, remasking)
            score = score.masked_fill(~still_masked, -torch.inf)
            rank = score.argsort(dim=1, descending=True).argsort(dim=1)
            commit = ((rank < schedule[:, step : step + 1]) | (probability >= threshold)) & still_masked
            x[rows, cols] = torch.where(commit, tokens, x[rows, cols])
            if trace is not None:
                trace.record(block_positions(block, block_length, cols), commit, tokens, probability)
        if eos_token_id is not None:
            done |= (x[rows, cols] == eos_token_id).any(1)

    return cut_rows_at_eos(x[rows, canvas], eos_token_id)
