"""Context parallelism (``lit_dllm.context_parallel``) on CPU gloo processes: Ulysses attention and the sharded step
against one process, within 1e-6 in float64 and 1e-5 in float32.

Each multi-process test starts its ranks once (``tests.test_parallel._spawn``); every rank compares its own shard
with the single-process result and the largest difference over the ranks comes back.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from lit_dllm.attention import document_mask
from lit_dllm.context_parallel import ContextParallel, ulysses_attention

from .test_parallel import _gloo_group, _spawn

TOLERANCES = {torch.float64: 1e-6, torch.float32: 1e-5}
MASKS = ("bidirectional", "causal", "documents")


# ------------------------------------------------------------------------------------------------ the primitive
class Heads(nn.Module):
    """What transformers' attention functions read of an attention layer (GQA: 4 query heads over 2 KV heads)."""

    num_key_value_groups = 2
    is_causal = True


def attention_inputs(dtype: torch.dtype, length: int = 8) -> dict:
    """Queries, keys, values and the output's weights of two rows; the rows' documents (lengths 3 + 5, 6 + 2)."""
    g = torch.Generator().manual_seed(0)
    shapes = {"query": (2, 4, length, 8), "key": (2, 2, length, 8), "value": (2, 2, length, 8),
              "weights": (2, length, 4, 8)}
    inputs = {name: torch.randn(shape, generator=g, dtype=dtype) for name, shape in shapes.items()}
    inputs["documents"] = torch.tensor([[0] * 3 + [1] * 5, [0] * 6 + [1] * 2])
    return inputs


def attend(inputs: dict, mask: str, context: ContextParallel | None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The attention output (this rank's shard of the positions under ``context``) and the gradients of the queries,
    keys and values (their shards) of ``Σ weights · output``."""
    module = Heads()
    tensors = [inputs[name].clone() for name in ("query", "key", "value")]
    weights = inputs["weights"]
    kwargs = {"is_causal": mask == "causal", "scaling": 8**-0.5, "dropout": 0.0}
    additive = document_mask(inputs["documents"], False, "sdpa", weights.dtype) if mask == "documents" else None
    if context is None:
        function = ALL_ATTENTION_FUNCTIONS["sdpa"]
    else:
        module.context_parallel, function = context, ulysses_attention
        tensors = [context.take(t.transpose(1, 2)).transpose(1, 2) for t in tensors]
        weights = context.take(weights)
    tensors = [t.requires_grad_() for t in tensors]
    output, _ = function(module, *tensors, additive, **kwargs)
    (output * weights).sum().backward()
    return output.detach(), [t.grad for t in tensors]


def _attention_worker(rank: int, world: int, port: int, out: str) -> None:
    """Every mask and dtype: the largest difference of this rank's shard from one process's attention."""
    with _gloo_group(rank, world, port):
        context = ContextParallel.of(init_device_mesh("cpu", (world,), mesh_dim_names=("context_parallel",)))
        worst = {}
        for dtype in TOLERANCES:
            inputs = attention_inputs(dtype)
            for mask in MASKS:
                output, grads = attend(inputs, mask, context)
                whole, whole_grads = attend(inputs, mask, None)
                pairs = [(output, context.take(whole))]
                pairs += [(g, context.take(w.transpose(1, 2)).transpose(1, 2)) for g, w in zip(grads, whole_grads)]
                difference = torch.stack([(got - expected).abs().max() for got, expected in pairs]).max()
                dist.all_reduce(difference, op=dist.ReduceOp.MAX)
                worst[mask, dtype] = float(difference)
        if rank == 0:
            torch.save(worst, Path(out) / "results.pt")


@pytest.fixture(scope="module")
def attention_differences(tmp_path_factory):
    return _spawn(_attention_worker, 2, tmp_path_factory.mktemp("ulysses"))


@pytest.mark.parametrize("dtype", list(TOLERANCES), ids=str)
@pytest.mark.parametrize("mask", MASKS)
def test_ulysses_attention_over_two_processes_equals_one_process(attention_differences, mask, dtype):
    """Outputs and the gradients of queries, keys and values (GQA), bidirectional, causal and per document."""
    assert attention_differences[mask, dtype] < TOLERANCES[dtype], attention_differences
