"""Context parallelism: every sequence of a batch split along its positions over the ``context_parallel`` ranks, with
Ulysses attention (DeepSpeed-Ulysses: an all-to-all over heads).

Each rank of a context-parallel group holds the same batch and trains on one contiguous shard of every row
(:meth:`ContextParallel.take`). Everything outside attention is per position, so it runs on the shard as it would on
the whole row. Attention needs every position: before it, one all-to-all trades the split by positions for a split by
heads, so each rank holds whole sequences for ``heads / C`` of the heads and runs the model's own attention (SDPA)
with the mask of the whole sequence (bidirectional, causal, or per document for packed rows: any mask the backbone
builds); a second all-to-all trades back. The result is the attention a single process computes, head by head.

Queries, keys and values cross in one stacked all-to-all. Two autograd collectives (one for K, one for V) gave wrong
gradients of K and V in a probe: their backwards ran in different orders on different ranks, and collectives are
matched by order. Gloo runs ``all_to_all_single`` in torch 2.13, so the CPU tests take the same road as NCCL.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh
from transformers import AttentionInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from lit_dllm import compat
from lit_dllm.hub.blocks import hf_backbone, transformer_blocks

ULYSSES = "lit_dllm_ulysses"
"""The name Ulysses attention is registered under in transformers' attention functions. transformers builds no mask
for it (no mask function has this name): the backbone passes the whole sequence's mask, or none (SDPA's flags)."""
INNER_ATTENTION = ("sdpa",)
"""What runs the attention of whole sequences inside Ulysses."""


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` over equal chunks of dim 0; its backward is the same exchange of the gradients."""

    @staticmethod
    def forward(ctx, tensor: Tensor, group: ProcessGroup) -> Tensor:
        ctx.group = group
        return _exchange(tensor, group)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        return _exchange(grad, ctx.group), None


def _exchange(tensor: Tensor, group: ProcessGroup) -> Tensor:
    tensor = tensor.contiguous()
    out = torch.empty_like(tensor)
    dist.all_to_all_single(out, tensor, group=group)
    return out


@dataclass(frozen=True)
class ContextParallel:
    """This rank's place in its context-parallel group: ``size`` ranks, shard ``rank`` of every sequence; the
    ``attention`` that runs on whole sequences (:data:`INNER_ATTENTION`)."""

    group: ProcessGroup
    rank: int
    size: int
    attention: str = "sdpa"

    @classmethod
    def of(cls, mesh: DeviceMesh, attention: str = "sdpa") -> ContextParallel:
        return cls(mesh.get_group(), mesh.get_local_rank(), mesh.size(), attention)

    def shard_length(self, length: int) -> int:
        """Positions per shard of a sequence of ``length``; a ValueError naming the multiple if it does not split."""
        if length % self.size:
            multiple = -(-length // self.size) * self.size
            raise ValueError(
                f"a sequence of {length} positions does not split into context_parallel_size={self.size} equal "
                f"shards: pad the rows to a multiple of {self.size} (data.init_args.collation.pad_seq_len_divisible: "
                f"{self.size}, here {multiple} positions; packed rows: a max_seq_len that is a multiple of {self.size})."
            )
        return length // self.size

    def take(self, tensor: Tensor) -> Tensor:
        """This rank's shard of ``tensor`` ``[B, L, ...]`` along its positions (dim 1)."""
        width = self.shard_length(tensor.shape[1])
        return tensor[:, self.rank * width : (self.rank + 1) * width]

    def gather(self, tensor: Tensor) -> Tensor:
        """The whole sequences of the shards ``tensor`` ``[B, L / C, ...]`` (no gradient: ids, masks)."""
        shards = [torch.empty_like(tensor) for _ in range(self.size)]
        dist.all_gather(shards, tensor.contiguous(), group=self.group)
        return torch.cat(shards, dim=1)

    def positions(self, input_ids: Tensor) -> Tensor:
        """``[1, L / C]`` position ids of this rank's shard of unpacked rows (``input_ids`` is the shard)."""
        width = input_ids.shape[1]
        return torch.arange(self.rank * width, (self.rank + 1) * width, device=input_ids.device)[None]

    def to_heads(self, query: Tensor, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``[B, H, L / C, D]`` shards (keys and values with their own head count) -> whole sequences of this rank's
        ``H / C`` heads, ``[B, H / C, L, D]``: one all-to-all of the three stacked."""
        batch, _, width, dim = query.shape
        split = [t.shape[1] // self.size for t in (query, key, value)]
        stacked = torch.cat([t.reshape(batch, self.size, -1, width, dim) for t in (query, key, value)], dim=2)
        received = _AllToAll.apply(stacked.transpose(0, 1), self.group)  # [C (sequence shard), B, heads, L/C, D]
        whole = received.permute(1, 2, 0, 3, 4).reshape(batch, sum(split), self.size * width, dim)
        return tuple(whole.split(split, dim=1))

    def to_positions(self, output: Tensor) -> Tensor:
        """Attention output of whole sequences, ``[B, L, H / C, D]`` -> this rank's shard of every head,
        ``[B, L / C, H, D]``."""
        batch, length, heads, dim = output.shape
        width = length // self.size
        chunks = output.reshape(batch, self.size, width, heads, dim).transpose(0, 1)  # [C (sequence shard), ...]
        received = _AllToAll.apply(chunks, self.group)  # [C (head group), B, L/C, H/C, D]
        return received.permute(1, 2, 0, 3, 4).reshape(batch, width, self.size * heads, dim)


def ulysses_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask, **kwargs):
    """transformers' attention function of every layer under context parallelism: ``attention_mask`` is the whole
    sequence's (or None, with the model's causal flag)."""
    context: ContextParallel = module.context_parallel
    query, key, value = context.to_heads(query, key, value)
    inner = ALL_ATTENTION_FUNCTIONS[context.attention]
    output, weights = inner(module, query, key, value, attention_mask, **kwargs)
    return context.to_positions(output), weights


def apply_context_parallel(model: nn.Module, mesh: DeviceMesh) -> ContextParallel:
    """Run every attention layer of the transformers stack in ``model`` (a :class:`~lit_dllm.core.backbone.CausalLM`,
    which takes shards: its ``context_parallel``) with Ulysses over ``mesh``; a ValueError naming the fix, before any
    compute, where the model cannot take it."""
    size = mesh.size()
    if not hasattr(model, "context_parallel"):
        raise ValueError(f"context_parallel_size={size}, but {type(model).__name__} does not take sequence shards "
                         "(MDLM, hybrid and CausalLM do): set context_parallel_size: 1.")
    _, backbone = hf_backbone(model)
    config = backbone.config.get_text_config()
    check_context_parallel(config, size)
    context = ContextParallel.of(mesh, compat.attn_implementation(config))
    # the modules transformers' attention functions are called with: every attention layer holds its GQA ratio
    layers = [m for block in transformer_blocks(model, "context parallelism", "set context_parallel_size: 1")
              for m in block.modules() if hasattr(m, "num_key_value_groups")]
    if not layers:
        raise ValueError(f"context_parallel_size={size}, but no attention layer of {type(backbone).__name__} runs "
                         "through transformers' attention functions: set context_parallel_size: 1.")
    for layer in layers:
        layer.context_parallel = context
    AttentionInterface.register(ULYSSES, ulysses_attention)
    backbone.set_attn_implementation(ULYSSES)
    model.context_parallel = context
    return context


def check_context_parallel(config, size: int) -> None:
    """A ValueError naming the value and the fix unless Ulysses over ``size`` ranks runs this transformers config."""
    attention = compat.attn_implementation(config)
    if attention not in INNER_ATTENTION:
        raise ValueError(f"attn_implementation={attention!r} cannot run under context parallelism (Ulysses runs "
                         f"{', '.join(INNER_ATTENTION)} on whole sequences): set backbone.attn_implementation: sdpa.")
    for name in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(config, name, None) or config.num_attention_heads
        if heads % size:
            divisors = [d for d in range(1, heads + 1) if heads % d == 0]
            raise ValueError(f"{name}={heads} is not divisible by context_parallel_size={size} (Ulysses gives each "
                             f"rank a share of the heads): use a context_parallel_size in {divisors}.")
    windowed = sorted({kind for kind in getattr(config, "layer_types", None) or () if kind != "full_attention"})
    if windowed:
        raise ValueError(f"layer_types {windowed} cannot run under context parallelism (transformers builds their "
                         "masks for the shard, not the whole sequence): set context_parallel_size: 1.")
