"""The meshes a run spans: their dimension names, the process groups a step reduces over, and gradient norms across
them.

A strategy holds at most two meshes (:mod:`lit_dllm.strategies`): the dense one, ``(data_parallel, tensor_parallel)``
or ``(data_parallel, context_parallel, tensor_parallel)`` under context parallelism, and the expert one,
``(expert_data_parallel, expert_parallel)``. Single-device and DDP runs have none; every query here answers for them
too (the default group, the world size).
"""

from __future__ import annotations

import torch
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from lit_dllm import compat

DATA_PARALLEL = "data_parallel"
TENSOR_PARALLEL = "tensor_parallel"
EXPERT_PARALLEL = "expert_parallel"
EXPERT_DATA_PARALLEL = "expert_data_parallel"
CONTEXT_PARALLEL = "context_parallel"
DATA_CONTEXT_PARALLEL = "data_context_parallel"
"""The data and context dimensions taken together: what FSDP2 shards over and a step's loss sums over."""


# ---------------------------------------------------------------------------------------------- meshes and groups
def device_meshes(strategy) -> tuple[DeviceMesh | None, DeviceMesh | None]:
    """The strategy's dense mesh (``data_parallel`` × ``tensor_parallel``) and expert mesh
    (``expert_data_parallel`` × ``expert_parallel``); None where it has none (single device, DDP, no EP)."""
    return getattr(strategy, "device_mesh", None), getattr(strategy, "expert_mesh", None)


def data_parallel_group(strategy) -> ProcessGroup | None:
    """The ranks that see different data; None means the default group (all ranks: DDP, or a single process)."""
    mesh, _ = device_meshes(strategy)
    return None if mesh is None else _data_parallel_mesh(mesh).get_group()


def data_parallel_size(strategy) -> int:
    """How many ranks see different data (without context parallelism, token counts and gradients are reduced over
    them: :func:`loss_group_size`)."""
    mesh, _ = device_meshes(strategy)
    return getattr(strategy, "world_size", 1) if mesh is None else _data_parallel_mesh(mesh).size()


def loss_group(strategy) -> ProcessGroup | None:
    """The ranks whose tokens one step's loss sums: data x context (each context rank holds a shard of the same
    rows), the ranks FSDP2 averages the gradients over; None means the default group."""
    mesh, _ = device_meshes(strategy)
    return None if mesh is None else loss_mesh(mesh).get_group()


def loss_group_size(strategy) -> int:
    """How many ranks :func:`loss_group` holds: the data-parallel size times the context-parallel size."""
    mesh, _ = device_meshes(strategy)
    return getattr(strategy, "world_size", 1) if mesh is None else loss_mesh(mesh).size()


def context_parallel_mesh(strategy) -> DeviceMesh | None:
    """The strategy's ``context_parallel`` mesh dimension; None without context parallelism."""
    mesh, _ = device_meshes(strategy)
    return mesh[CONTEXT_PARALLEL] if mesh is not None and CONTEXT_PARALLEL in (mesh.mesh_dim_names or ()) else None


def expert_gradient_divide_factor(strategy) -> float:
    """What FSDP divides reduced expert gradients by under EP: the number of loss shares an expert's reduced gradient
    sums (its ``ep`` group's, times its ``expert_data_parallel`` copies), i.e. every rank of :func:`loss_group`."""
    return float(loss_group_size(strategy))


def _data_parallel_mesh(mesh: DeviceMesh) -> DeviceMesh:
    return mesh[DATA_PARALLEL] if DATA_PARALLEL in (mesh.mesh_dim_names or ()) else mesh


def loss_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """Data x context as one dimension (:data:`DATA_CONTEXT_PARALLEL`), or the data-parallel one without context."""
    if CONTEXT_PARALLEL in (mesh.mesh_dim_names or ()):
        return compat.flatten_mesh(mesh, (DATA_PARALLEL, CONTEXT_PARALLEL), DATA_CONTEXT_PARALLEL)
    return _data_parallel_mesh(mesh)


# ---------------------------------------------------------------------------------------------------- gradients
def grad_norm(parameters) -> torch.Tensor:
    """L2 norm of all gradients, whole across shards and meshes (dense and expert DTensors mix here, which
    ``torch.nn.utils.get_total_norm`` cannot stack)."""
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.zeros(())
    by_mesh: dict[object, list[torch.Tensor]] = {}
    for grad in grads:
        by_mesh.setdefault(getattr(grad, "device_mesh", None), []).append(grad)
    squares = []
    for group in by_mesh.values():
        norm = torch.nn.utils.get_total_norm(group)
        squares.append((norm.full_tensor() if hasattr(norm, "full_tensor") else norm).float() ** 2)
    return torch.stack(squares).sum().sqrt()


def clip_grad_norm_(parameters, max_norm: float) -> torch.Tensor:
    """Clip all gradients to a total L2 norm of ``max_norm`` (across meshes, see :func:`grad_norm`); returns the
    norm before clipping. Gradients on one mesh (or none) take torch's own ``clip_grad_norm_``, bit for bit."""
    parameters = list(parameters)
    if len({getattr(p.grad, "device_mesh", None) for p in parameters if p.grad is not None}) <= 1:
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm)
    total = grad_norm(parameters)
    scale_gradients_(parameters, (max_norm / (total + 1e-6)).clamp(max=1.0))
    return total


def scale_gradients_(parameters, scale: torch.Tensor) -> None:
    """Multiply every gradient in place by the 0-dim tensor ``scale``, which the host never reads (no device sync):
    one :func:`~lit_dllm.compat.foreach_mul_` per device over the gradients' local shards (a DTensor's own dispatch
    costs the host about 0.1 ms a tensor, a few ms a step in which the device would idle)."""
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for p in parameters:
        if p.grad is not None:
            local = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            by_device.setdefault(local.device, []).append(local)
    for device, grads in by_device.items():
        compat.foreach_mul_(grads, scale.to(device))
