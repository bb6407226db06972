"""Context parallelism: every sequence of a batch split along its positions over the ``context_parallel`` ranks, with
attention over the whole sequences by one of three :data:`SCHEMES`.

Each rank of a context-parallel group holds the same batch and trains on one contiguous shard of every row
(:meth:`ContextParallel.take`). Everything outside attention is per position, so it runs on the shard as it would on
the whole row. Attention needs every position:

- ``ulysses`` (DeepSpeed-Ulysses): before attention one all-to-all trades the split by positions for a split by heads,
  so each rank holds whole sequences for ``heads / C`` of the heads and runs the model's own attention (SDPA, or
  FlexAttention with the whole sequence's block mask) with the mask of the whole sequence; a second all-to-all trades
  back. Query and KV heads must divide by ``C``.
- ``all_gather`` (the ring of torch's ``context_parallel`` with its default all-gather rotation, as one collective):
  each rank keeps its queries and gathers the keys and values of the whole sequence (one all-gather; its backward one
  reduce-scatter), then runs SDPA with its queries' rows of the whole sequence's mask. Any head count (GQA and MQA
  models whose KV heads do not divide by ``C``); it moves only keys and values, fewer bytes than Ulysses' four
  tensors where KV heads are few. Causal rows are not load-balanced (the last shard sees the most keys).

- ``ring`` (torch's ring attention, :func:`~lit_dllm.compat.templated_ring_attention`): each rank keeps its queries
  while the keys and values go round the ring shard by shard, each step's output merged by its log-sum-exp; the
  device's own SDPA kernel runs each step (the flash kernel on CUDA, in bf16 or fp16). Any head count; it holds one
  shard of keys and values at a time (``L / C`` a layer, where ``all_gather`` holds the whole row's ``L``), and takes
  no mask: bidirectional and causal rows only (no packed rows). Causal rows are not load-balanced.

``ulysses`` and ``all_gather`` take any mask the backbone builds (bidirectional, causal, per document for packed rows).
Every scheme computes the attention a single process computes, head by head. Stacked tensors cross in one
collective: two autograd collectives (one for K, one for V) gave wrong gradients of K and V in a probe, because their
backwards ran in different orders on different ranks and collectives are matched by order. Gloo runs these collectives
in torch 2.13, and the ring runs the CPU's own SDPA kernel there, so the CPU tests take the same road as NCCL.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import repeat_kv
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from lit_dllm import compat
from lit_dllm.attention import build_block_mask
from lit_dllm.hub.blocks import hf_backbone
from lit_dllm.settings import CONTEXT_PARALLEL_ATTENTION, check_context_parallel_attention

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask

SCHEMES = CONTEXT_PARALLEL_ATTENTION
"""How attention spans the shards (``Parallelism.context_parallel_attention``); see the module docstring."""
INNER_ATTENTION = ("sdpa", "flex_attention")
"""What runs the attention of whole sequences inside the schemes: SDPA under any (``ring`` runs the SDPA kernels
itself); FlexAttention (CUDA) under ``ulysses`` only, whose ranks hold whole rows (a block mask covers every query row
of the whole sequence)."""
MASKED_SCHEMES = ("ulysses", "all_gather")
"""The schemes that take an attention mask (packed rows' document masks); ``ring`` takes the causal flag alone."""


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


class _AllGather(torch.autograd.Function):
    """``all_gather_into_tensor`` along dim 0 (rank order); its backward sums each rank's share of the gradients
    (``reduce_scatter_tensor``)."""

    @staticmethod
    def forward(ctx, tensor: Tensor, group: ProcessGroup) -> Tensor:
        ctx.group, size = group, dist.get_world_size(group)
        out = tensor.new_empty((size * tensor.shape[0], *tensor.shape[1:]))
        dist.all_gather_into_tensor(out, tensor.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        out = grad.new_empty((grad.shape[0] // dist.get_world_size(ctx.group), *grad.shape[1:]))
        dist.reduce_scatter_tensor(out, grad.contiguous(), group=ctx.group)
        return out, None


@dataclass(frozen=True)
class ContextParallel:
    """This rank's place in its context-parallel group: ``size`` ranks, shard ``rank`` of every sequence; the
    ``attention`` that runs on whole sequences (:data:`INNER_ATTENTION`) and the ``scheme`` (:data:`SCHEMES`)."""

    group: ProcessGroup
    rank: int
    size: int
    attention: str = "sdpa"
    scheme: str = "ulysses"

    @classmethod
    def of(cls, mesh: DeviceMesh, attention: str = "sdpa", scheme: str = "ulysses") -> ContextParallel:
        return cls(mesh.get_group(), mesh.get_local_rank(), mesh.size(), attention, scheme)

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

    def check_rows(self, packed: bool) -> None:
        """A ValueError naming the fix where the rows need a mask that the scheme cannot take (packed rows)."""
        if packed and self.scheme not in MASKED_SCHEMES:
            raise ValueError(f"context_parallel_attention={self.scheme!r} takes no attention mask, and packed rows "
                             f"attend per document: set context_parallel_attention to one of "
                             f"{', '.join(MASKED_SCHEMES)}, or collation.pack: false.")

    @property
    def implementation(self) -> str:
        """The name the scheme's attention function is registered under in transformers' (:data:`ATTENTION_FUNCTIONS`
        holds the functions)."""
        return f"lit_dllm_{self.scheme}"

    def span(self, width: int) -> slice:
        """This rank's positions of a whole sequence whose shards are ``width`` long."""
        return slice(self.rank * width, (self.rank + 1) * width)

    def take(self, tensor: Tensor) -> Tensor:
        """This rank's shard of ``tensor`` ``[B, L, ...]`` along its positions (dim 1)."""
        return tensor[:, self.span(self.shard_length(tensor.shape[1]))]

    def gather(self, tensor: Tensor) -> Tensor:
        """The whole sequences of the shards ``tensor`` ``[B, L / C, ...]`` (no gradient: ids, masks)."""
        shards = [torch.empty_like(tensor) for _ in range(self.size)]
        dist.all_gather(shards, tensor.contiguous(), group=self.group)
        return torch.cat(shards, dim=1)

    def positions(self, input_ids: Tensor) -> Tensor:
        """``[1, L / C]`` position ids of this rank's shard of unpacked rows (``input_ids`` is the shard)."""
        span = self.span(input_ids.shape[1])
        return torch.arange(span.start, span.stop, device=input_ids.device)[None]

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

    def whole_keys_values(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        """``[B, H_kv, L / C, D]`` shards of keys and values -> their whole sequences ``[B, H_kv, L, D]``: one
        all-gather of the two stacked."""
        gathered = _AllGather.apply(torch.stack((key, value)), self.group)  # [C * 2, B, H_kv, L/C, D]
        whole = gathered.unflatten(0, (self.size, 2)).permute(1, 2, 3, 0, 4, 5).flatten(3, 4)
        return whole[0], whole[1]

    def query_slice(self, width: int) -> slice | None:
        """The rows of an attention mask this rank reads, as positions of the whole sequence (``width`` a shard's):
        its own queries under ``all_gather``, every row (None) under Ulysses."""
        return self.span(width) if self.scheme == "all_gather" else None

    def query_rows(self, mask: Tensor | None, width: int, length: int, causal: bool, device) -> Tensor | None:
        """This shard's ``width`` query rows of ``mask`` (``[B | 1, 1, L | L / C | 1, L]``: the whole sequence's, or
        already its rows: :meth:`query_slice`); without a mask, the causal rows (boolean, ``[1, 1, L / C, L]``) where
        ``causal``, else None."""
        if mask is not None:
            return mask if mask.shape[-2] in (1, width) else mask[..., self.span(width), :]
        if not causal:
            return None
        columns = torch.arange(length, device=device)
        return (columns[self.span(width), None] >= columns)[None, None]


def _is_causal(module: nn.Module, kwargs: dict) -> bool:
    """Whether rows passed without a mask attend causally: the call's ``is_causal`` (taken out of ``kwargs``), else the
    layer's, as transformers' SDPA reads them."""
    causal = kwargs.pop("is_causal", None)
    return getattr(module, "is_causal", True) if causal is None else causal


def _causal(batch: Tensor, head: Tensor, query: Tensor, key: Tensor) -> Tensor:
    """FlexAttention's mask function of causal rows."""
    return key <= query


@functools.lru_cache(maxsize=8)
def causal_block_mask(length: int, device: torch.device) -> BlockMask:
    """FlexAttention's causal block mask of a whole sequence of ``length`` (every row and head), built once a
    length: transformers builds none for the schemes' names."""
    return build_block_mask(_causal, None, length, length, device)


def ulysses_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask, **kwargs):
    """transformers' attention function of every layer under the ``ulysses`` scheme: ``attention_mask`` is the whole
    sequence's (or None, with the model's causal flag: SDPA takes the flag, FlexAttention a causal block mask)."""
    context: ContextParallel = module.context_parallel
    query, key, value = context.to_heads(query, key, value)
    if context.attention == "flex_attention" and attention_mask is None:  # the flag is SDPA's alone
        attention_mask = causal_block_mask(query.shape[2], query.device) if _is_causal(module, kwargs) else None
    inner = ALL_ATTENTION_FUNCTIONS[context.attention]
    output, weights = inner(module, query, key, value, attention_mask, **kwargs)
    return context.to_positions(output), weights


def all_gather_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask, **kwargs):
    """transformers' attention function of every layer under the ``all_gather`` scheme: this shard's queries against
    the whole sequence's keys and values; ``attention_mask`` is the whole sequence's (or None, with the model's causal
    flag, which becomes this shard's rows of the causal mask)."""
    context: ContextParallel = module.context_parallel
    causal = _is_causal(module, kwargs)
    key, value = context.whole_keys_values(key, value)
    mask = context.query_rows(attention_mask, query.shape[2], key.shape[2], causal, query.device)
    inner = ALL_ATTENTION_FUNCTIONS[context.attention]
    return inner(module, query, key, value, mask, is_causal=False, **kwargs)


def _sum_heads(gradient: Tensor, groups: int) -> Tensor:
    """The gradient of ``repeat_kv``'s input: each head's ``groups`` copies summed (in at least float32)."""
    if groups == 1:
        return gradient
    return gradient.unflatten(1, (-1, groups)).sum(2, dtype=torch.promote_types(gradient.dtype, torch.float32))


@dataclass(frozen=True)
class _RingKernel:
    """The SDPA kernel each ring step runs: the CPU's flash kernel, or CUDA's (``cuda``; bf16 or fp16), with keys and
    values repeated ``groups`` times to the query heads inside the step, so the ring passes only the KV heads."""

    groups: int
    cuda: bool

    @classmethod
    def of(cls, query: Tensor, key: Tensor) -> _RingKernel:
        cuda = query.is_cuda
        if cuda and query.dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"context_parallel_attention='ring' runs CUDA's flash kernel, which takes bf16 or fp16, "
                             f"and the attention inputs are {query.dtype}: set trainer.precision: bf16-mixed, or "
                             "context_parallel_attention: all_gather.")
        return cls(query.shape[1] // key.shape[1], cuda)

    def forward(self, query: Tensor, key: Tensor, value: Tensor, **kwargs) -> tuple:
        forward, _ = compat.flash_attention_ops(self.cuda)
        return forward(query, repeat_kv(key, self.groups), repeat_kv(value, self.groups), **kwargs)

    def backward(self, *, key: Tensor, value: Tensor, **kwargs) -> tuple:
        _, backward = compat.flash_attention_ops(self.cuda)
        grad_query, grad_key, grad_value, *rest = backward(
            key=repeat_kv(key, self.groups), value=repeat_kv(value, self.groups), **kwargs)
        return grad_query, _sum_heads(grad_key, self.groups), _sum_heads(grad_value, self.groups), *rest

    def forward_kwargs(self, scale: float | None) -> dict:
        return {"dropout_p": 0.0, "scale": scale, **({"return_debug_mask": False} if self.cuda else {})}

    def backward_kwargs(self, scale: float | None, rest: Sequence) -> dict:
        """The backward kernel's arguments beyond the tensors; ``rest``: what the forward kernel returned after
        ``(out, logsumexp)`` (CUDA: the sequence offsets and lengths and the dropout seed)."""
        if not self.cuda:
            return {"dropout_p": 0.0, "scale": scale}
        cum_seq_q, cum_seq_k, max_q, max_k, philox_seed, philox_offset = rest[:6]
        return {"cum_seq_q": cum_seq_q, "cum_seq_k": cum_seq_k, "max_q": max_q, "max_k": max_k, "dropout_p": 0.0,
                "philox_seed": philox_seed, "philox_offset": philox_offset, "scale": scale}


class _Ring(torch.autograd.Function):
    """Ring attention of this rank's shards ``[B, H, L / C, D]`` (:func:`~lit_dllm.compat.templated_ring_attention`)."""

    @staticmethod
    def forward(ctx, query: Tensor, key: Tensor, value: Tensor, group: ProcessGroup, causal: bool,
                scale: float | None) -> Tensor:
        kernel = _RingKernel.of(query, key)
        out, logsumexp, *rest = compat.templated_ring_attention(group, kernel.forward, query, key, value, causal,
                                                                **kernel.forward_kwargs(scale))
        ctx.save_for_backward(query, key, value, out, logsumexp)
        ctx.group, ctx.causal, ctx.kernel, ctx.kwargs = group, causal, kernel, kernel.backward_kwargs(scale, rest)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        query, key, value, out, logsumexp = ctx.saved_tensors
        grad_query, grad_key, grad_value, *_ = compat.templated_ring_attention_backward(
            ctx.group, ctx.kernel.backward, grad.contiguous(), query, key, value, out, logsumexp, ctx.causal,
            **ctx.kwargs)
        return grad_query, grad_key, grad_value, None, None, None


@torch.compiler.disable  # compiled blocks run it eagerly: dynamo cannot capture the ring's merge of partial outputs
def ring_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask, **kwargs):
    """transformers' attention function of every layer under the ``ring`` scheme: this shard's queries against every
    shard's keys and values in turn; rows attend bidirectionally or causally (the model's flag), never by a mask."""
    context: ContextParallel = module.context_parallel
    if attention_mask is not None:
        raise ValueError(f"context_parallel_attention='ring' takes no attention mask, and {type(module).__name__} "
                         f"was given one of shape {tuple(attention_mask.shape)}: set context_parallel_attention to "
                         f"one of {', '.join(MASKED_SCHEMES)}.")
    if kwargs.get("dropout"):
        raise ValueError(f"context_parallel_attention='ring' runs no attention dropout (dropout={kwargs['dropout']}): "
                         "set the model's attention_dropout: 0.0, or another context_parallel_attention.")
    output = _Ring.apply(query, key, value, context.group, _is_causal(module, kwargs), kwargs.get("scaling"))
    return output.transpose(1, 2).contiguous(), None


ATTENTION_FUNCTIONS = {"ulysses": ulysses_attention, "all_gather": all_gather_attention, "ring": ring_attention}
"""Each scheme's attention function, registered in transformers' as ``lit_dllm_<scheme>``: transformers builds no mask
for these names (no mask function has them), so the backbone passes the whole sequence's mask, or none (the flags)."""


def apply_context_parallel(model: nn.Module, mesh: DeviceMesh, scheme: str = "ulysses") -> ContextParallel:
    """Run every attention layer of the first transformers stack in ``model`` over ``mesh`` by ``scheme``
    (:data:`SCHEMES`): a :class:`~lit_dllm.core.backbone.CausalLM`'s, or DFlash's target (models that take shards
    have a ``context_parallel``); a ValueError naming the fix, before any compute, where the model cannot take it."""
    size = mesh.size()
    if not hasattr(model, "context_parallel"):
        raise ValueError(f"context_parallel_size={size}, but {type(model).__name__} does not take sequence shards "
                         "(MDLM, hybrid, CausalLM and DFlash do): set context_parallel_size: 1.")
    _, backbone = hf_backbone(model)
    config = backbone.config.get_text_config()
    check_context_parallel(config, size, scheme)
    context = ContextParallel.of(mesh, compat.attn_implementation(config), scheme)
    # the modules transformers' attention functions are called with: every attention layer holds its GQA ratio
    layers = [m for m in backbone.modules() if hasattr(m, "num_key_value_groups")]
    if not layers:
        raise ValueError(f"context_parallel_size={size}, but no attention layer of {type(backbone).__name__} runs "
                         "through transformers' attention functions: set context_parallel_size: 1.")
    for layer in layers:
        layer.context_parallel = context
    AttentionInterface.register(context.implementation, ATTENTION_FUNCTIONS[scheme])
    backbone.set_attn_implementation(context.implementation)
    model.context_parallel = context
    return context


@contextmanager
def whole_sequences(model: nn.Module):
    """Within the block, ``model`` runs whole sequences in each process with its own attention, as without context
    parallelism (generation: the samplers grow their sequences token by token, and every rank of a context group
    answers its batch's prompts); nothing changes for a model without it."""
    context = getattr(model, "context_parallel", None)
    if context is None:
        yield
        return
    _, backbone = hf_backbone(model)
    model.context_parallel = None
    backbone.set_attn_implementation(context.attention)
    try:
        yield
    finally:
        backbone.set_attn_implementation(context.implementation)
        model.context_parallel = context


def check_context_parallel(config, size: int, scheme: str = "ulysses") -> None:
    """A ValueError naming the value and the fix unless ``scheme`` over ``size`` ranks runs this transformers config."""
    check_context_parallel_attention(scheme)
    attention = compat.attn_implementation(config)
    if attention not in INNER_ATTENTION:
        raise ValueError(f"attn_implementation={attention!r} cannot run under context parallelism (it runs "
                         f"{', '.join(INNER_ATTENTION)} on whole sequences): set backbone.attn_implementation: sdpa.")
    if attention == "flex_attention" and scheme != "ulysses":
        raise ValueError(f"attn_implementation='flex_attention' runs under context_parallel_attention: ulysses only "
                         f"(a block mask covers every query row of the whole sequence, and {scheme!r} keeps a shard's "
                         "rows): set context_parallel_attention: ulysses, or backbone.attn_implementation: sdpa.")
    for name in ("num_attention_heads", "num_key_value_heads") if scheme == "ulysses" else ():
        heads = getattr(config, name, None) or config.num_attention_heads
        if heads % size:
            divisors = [d for d in range(1, heads + 1) if heads % d == 0]
            raise ValueError(f"{name}={heads} is not divisible by context_parallel_size={size} (Ulysses gives each "
                             f"rank a share of the heads): use a context_parallel_size in {divisors}, or "
                             "context_parallel_attention: all_gather (any head count).")
    windowed = sorted({kind for kind in getattr(config, "layer_types", None) or () if kind != "full_attention"})
    if windowed:
        raise ValueError(f"layer_types {windowed} cannot run under context parallelism (transformers builds their "
                         "masks for the shard, not the whole sequence): set context_parallel_size: 1.")
