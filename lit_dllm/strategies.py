"""``ExpertParallelStrategy``: Lightning's ``ModelParallelStrategy`` with an expert mesh, FSDP2 + EP.

Both meshes cover every rank (tensor parallelism is fixed to 1):

- dense  ``("data_parallel", "tensor_parallel") = (world, 1)``: every rank holds a different batch; attention,
  dense MLPs, embedding and head are FSDP-sharded over all ranks;
- expert ``("expert_data_parallel", "expert_parallel") = (world / ep, ep)``: each expert lives on one rank of
  every group of ``ep`` consecutive ranks (tokens reach it by all-to-all, inside a node when ``ep`` divides the
  GPUs per node) and is FSDP-sharded over its ``world / ep`` copies.

:func:`lit_dllm.parallel.parallelize`, called from ``configure_model``, applies them.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Literal

from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from lit_dllm import compat
from lit_dllm.parallel import DATA_PARALLEL, EXPERT_DATA_PARALLEL, EXPERT_PARALLEL, TENSOR_PARALLEL


def mesh_sizes(
    world_size: int,
    num_nodes: int = 1,
    data_parallel_size: int | Literal["auto"] = "auto",
    expert_parallel_size: int = 1,
) -> dict[str, int]:
    """Sizes of every mesh dimension, e.g. ``mesh_sizes(8, 1, "auto", 2) == {"data_parallel": 8,
    "tensor_parallel": 1, "expert_parallel": 2, "expert_data_parallel": 4}``.

    ``"auto"`` means every rank (world size / tensor-parallel size 1), not Lightning's number of nodes.
    """
    if world_size < 1 or num_nodes < 1 or world_size % num_nodes:
        raise ValueError(f"world_size={world_size} must be a positive multiple of num_nodes={num_nodes}.")
    dp = world_size if data_parallel_size == "auto" else data_parallel_size
    if not isinstance(dp, int) or dp != world_size:
        raise ValueError(
            f"data_parallel_size={data_parallel_size!r} x tensor_parallel_size=1 != world size {world_size} "
            f"({num_nodes} node(s) x {world_size // num_nodes} devices): use 'auto' (or {world_size})."
        )
    ep = expert_parallel_size
    if not isinstance(ep, int) or ep < 1 or world_size % ep:
        divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise ValueError(
            f"expert_parallel_size={ep!r} must divide the world size {world_size} (experts are split over groups of "
            f"{ep} ranks and copied over world / ep): use one of {divisors}."
        )
    return {DATA_PARALLEL: dp, TENSOR_PARALLEL: 1, EXPERT_PARALLEL: ep, EXPERT_DATA_PARALLEL: world_size // ep}


def init_expert_mesh(sizes: dict[str, int], device_type: str) -> DeviceMesh:
    """The expert mesh ``(expert_data_parallel, expert_parallel)``: consecutive ranks share experts by all-to-all."""
    shape = (sizes[EXPERT_DATA_PARALLEL], sizes[EXPERT_PARALLEL])
    return init_device_mesh(device_type, shape, mesh_dim_names=(EXPERT_DATA_PARALLEL, EXPERT_PARALLEL))


@dataclass
class Meshes:
    """What :class:`ExpertParallelStrategy` holds once set up, for plain PyTorch loops (benchmarks, tests):
    :func:`lit_dllm.parallel.parallelize` takes it in place of the strategy."""

    device_mesh: DeviceMesh
    expert_mesh: DeviceMesh | None
    world_size: int


def init_meshes(world_size: int, expert_parallel_size: int = 1, device_type: str = "cuda") -> Meshes:
    """The dense and (with EP) expert meshes of an initialised process group, without Lightning."""
    sizes = mesh_sizes(world_size, 1, "auto", expert_parallel_size)
    dense = init_device_mesh(device_type, (world_size, 1), mesh_dim_names=(DATA_PARALLEL, TENSOR_PARALLEL))
    experts = init_expert_mesh(sizes, device_type) if expert_parallel_size > 1 else None
    return Meshes(dense, experts, world_size)


class ExpertParallelStrategy(ModelParallelStrategy):
    """FSDP2 over all ranks, plus expert parallelism over groups of ``expert_parallel_size`` ranks.

    Args:
        data_parallel_size: ``"auto"`` (every rank, the only valid value with tensor parallel size 1) or the world
            size. Lightning's ``ModelParallelStrategy`` reads ``"auto"`` as the number of nodes.
        expert_parallel_size: ranks the experts are split over (1: experts are FSDP-sharded like dense weights).
        save_distributed_checkpoint, process_group_backend, timeout: as in ``ModelParallelStrategy``.
    """

    def __init__(
        self,
        data_parallel_size: int | Literal["auto"] = "auto",
        expert_parallel_size: int = 1,
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
    ) -> None:
        super().__init__(data_parallel_size, 1, save_distributed_checkpoint, process_group_backend, timeout)
        self.requested_data_parallel_size = data_parallel_size
        self.expert_parallel_size = expert_parallel_size
        self.sizes: dict[str, int] | None = None
        self._expert_mesh: DeviceMesh | None = None

    @property
    def expert_mesh(self) -> DeviceMesh | None:
        """``(expert_data_parallel, expert_parallel)`` mesh; None without EP."""
        return self._expert_mesh

    def setup_environment(self) -> None:
        self.sizes = mesh_sizes(
            self.num_nodes * self.num_processes, self.num_nodes, self.requested_data_parallel_size,
            self.expert_parallel_size,
        )
        compat.set_data_parallel_size(self, self.sizes[DATA_PARALLEL])
        super().setup_environment()  # the process group and the dense (data_parallel, tensor_parallel) mesh
        if self.expert_parallel_size > 1:
            self._expert_mesh = init_expert_mesh(self.sizes, self.root_device.type)
