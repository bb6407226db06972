"""lit_dllm's Lightning strategies: they own how a run executes (:class:`~lit_dllm.settings.Parallelism`), so the
modules hold only what is learned and checkpoints hold no machine layout.

- :class:`SingleDeviceStrategy`: one device (CPU or one GPU) with the run settings: compile, activation
  checkpointing, fp8, the experts kernel; :class:`DDPStrategy`: Lightning's DDP (a whole model on every GPU) with them.
- :class:`ExpertParallelStrategy`: Lightning's ``ModelParallelStrategy`` with an expert mesh, FSDP2 + EP. Both meshes
  cover every rank (tensor parallelism is fixed to 1):

  - dense  ``("data_parallel", "tensor_parallel") = (world, 1)``: every rank holds a different batch; attention,
    dense MLPs, embedding and head are FSDP-sharded over all ranks. Under context parallelism
    ``("data_parallel", "context_parallel", "tensor_parallel") = (world / C, C, 1)``: each group of ``C`` consecutive
    ranks shares a batch, each rank a shard of every row's positions, and FSDP2 shards over data x context;
  - expert ``("expert_data_parallel", "expert_parallel") = (world / ep, ep)``: each expert lives on one rank of
    every group of ``ep`` consecutive ranks (tokens reach it by all-to-all, inside a node when ``ep`` divides the
    GPUs per node) and is FSDP-sharded over its ``world / ep`` copies.

A module's ``configure_model`` builds the model, applies the converters (its own, such as LoRA, then the strategy's:
:func:`strategy_converters`), then :func:`parallelize_model`: the strategy's plan in
:func:`lit_dllm.parallel.parallelize`'s order. What a step needs from the strategy rides in its hooks: FSDP2's
deferred gradient sync (``on_train_batch_start``), the next step's prefetch (a converter's ``after_optimizer_step``,
after fp8's scales) and its release (``on_train_end``). Any other Lightning strategy runs the defaults of
:class:`~lit_dllm.settings.Parallelism`.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Literal

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch import strategies
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule

from lit_dllm import compat
from lit_dllm.converters import ModelConverter
from lit_dllm.experts import experts_kernels, set_experts_implementation
from lit_dllm.fp8 import Float8Converter
from lit_dllm.meshes import (
    CONTEXT_PARALLEL,
    DATA_PARALLEL,
    EXPERT_DATA_PARALLEL,
    EXPERT_PARALLEL,
    TENSOR_PARALLEL,
    device_meshes,
)
from lit_dllm.parallel import first_units, parallelize, sync_gradients_in_backward
from lit_dllm.settings import Parallelism, settings_group


def plan(strategy) -> Parallelism:
    """The run settings of ``strategy``: a lit_dllm strategy's ``parallelism``, any other's defaults."""
    return getattr(strategy, "parallelism", None) or Parallelism()


def shards(strategy) -> bool:
    """Whether ``strategy`` shards the model (FSDP2: it has a device mesh)."""
    return device_meshes(strategy)[0] is not None


def param_dtype(trainer) -> torch.dtype | None:
    """The dtype FSDP2 computes with the parameters in: bf16 under a bf16 precision, else theirs (None)."""
    return torch.bfloat16 if "bf16" in str(trainer.precision) else None


def strategy_converters(strategy) -> list[ModelConverter]:
    """What the strategy converts the model with (fp8's float8 linears) and runs after each optimizer step (fp8's
    scales, then the next step's prefetch), in that order."""
    settings, sharded = plan(strategy), shards(strategy)
    converters: list[ModelConverter] = []
    if settings.fp8 is not None:
        converters.append(Float8Converter(settings.fp8, strategy.root_device, sharded))
    if settings.fsdp_prefetch_next_step and sharded:
        converters.append(NextStepPrefetch())
    return converters


def parallelize_model(model: nn.Module, trainer) -> nn.Module:
    """``model`` with the strategy's plan applied: the experts kernel, expert parallelism, activation checkpointing,
    compile (None: on CUDA), FSDP2 (bf16 parameters under a bf16 precision); FSDP2 settings without FSDP2 warn."""
    strategy = trainer.strategy
    settings = plan(strategy)
    if settings.experts_implementation is not None:
        set_experts_implementation(model, settings.experts_implementation)
    if settings.fsdp_only() and not shards(strategy):
        rank_zero_warn(f"{', '.join(settings.fsdp_only())} does nothing under {type(strategy).__name__}: it tunes "
                       "FSDP2, and this run does not shard the model (use lit_dllm.ExpertParallelStrategy to shard, or "
                       "drop the setting).")
    compile = settings.compile if settings.compile is not None else strategy.root_device.type == "cuda"
    return parallelize(model, strategy, param_dtype=param_dtype(trainer), compile=compile,
                       activation_checkpointing=settings.activation_checkpointing,
                       reshard_after_forward=settings.fsdp_reshard_after_forward,
                       reduce_dtype=getattr(torch, settings.fsdp_reduce_dtype),
                       context_parallel_attention=settings.context_parallel_attention)


class NextStepPrefetch:
    """``fsdp_prefetch_next_step``: once the optimizer stepped, the next step's first FSDP2 units (the root's and the
    first block's) start their all-gather, while the host logs and loads the next batch; the forward waits for it.
    FSDP2 prefetches within a step, not across steps."""

    def convert(self, model: nn.Module) -> None:
        pass

    def after_optimizer_step(self, model: nn.Module) -> None:
        if isinstance(model, FSDPModule):
            for unit in first_units(model):
                unit.unshard(async_op=True)


class _RunSettings:
    """What lit_dllm's strategies add to Lightning's: the run settings and the per-step FSDP2 hooks."""

    parallelism: Parallelism

    def _take(self, parallelism: Parallelism | dict | None, context_parallel: bool = False) -> None:
        self.parallelism = settings_group("parallelism", Parallelism, parallelism)
        size = self.parallelism.context_parallel_size
        if size > 1 and not context_parallel:
            raise ValueError(f"context_parallel_size={size} under {type(self).__name__}: context parallelism splits "
                             "sequences over the ranks of an FSDP2 mesh; use lit_dllm.ExpertParallelStrategy, or "
                             "context_parallel_size: 1.")

    def on_train_start(self) -> None:
        """Log what runs each MoE model's experts, and warn where, on CUDA, it is a loop over the experts."""
        super().on_train_start()
        model = self.lightning_module.model
        for line, loop in experts_kernels(model, self, param_dtype(self.lightning_module.trainer)):
            if loop is None:
                rank_zero_info(line)
            else:
                rank_zero_warn(f"{line} loops over the experts on this GPU: {loop}")

    def on_train_batch_start(self, batch, batch_idx: int) -> None:
        """Under ``fsdp_defer_gradient_sync``: every FSDP2 unit reduce-scatters its gradients and frees its gathered
        parameters after the backward of the window's last micro-batch only (Lightning's own decision:
        ``compat.should_accumulate``, so an epoch's short last window syncs too)."""
        super().on_train_batch_start(batch, batch_idx)
        trainer, model = self.lightning_module.trainer, self.lightning_module.model
        if self.parallelism.fsdp_defer_gradient_sync and trainer.accumulate_grad_batches > 1 and isinstance(
                model, FSDPModule):
            sync_gradients_in_backward(model, not compat.should_accumulate(trainer))

    def on_train_end(self) -> None:
        """Free what the prefetch after the last step gathered."""
        super().on_train_end()
        model = self.lightning_module.model
        if self.parallelism.fsdp_prefetch_next_step and isinstance(model, FSDPModule):
            for unit in first_units(model):
                unit.reshard()


class SingleDeviceStrategy(_RunSettings, strategies.SingleDeviceStrategy):
    """One device (the trainer's ``accelerator`` and ``devices``), with the run settings ``parallelism``
    (:class:`~lit_dllm.settings.Parallelism`: compile, activation checkpointing, fp8, the experts kernel)."""

    def __init__(self, parallelism: Parallelism = Parallelism()) -> None:
        super().__init__()
        self._take(parallelism)
        self._root_device = None  # from the trainer's devices (Lightning's connector fills parallel_devices)
        self.parallel_devices: list[torch.device] | None = None

    @property
    def root_device(self) -> torch.device:
        if self._root_device is None:
            devices = self.parallel_devices or [torch.device("cpu")]
            if len(devices) != 1:
                raise ValueError(f"SingleDeviceStrategy runs on one device, but the trainer asks for {len(devices)} "
                                 f"({devices}): set trainer.devices: 1, or use lit_dllm.ExpertParallelStrategy.")
            self._root_device = devices[0]
        return self._root_device


def mesh_sizes(
    world_size: int,
    num_nodes: int = 1,
    data_parallel_size: int | Literal["auto"] = "auto",
    expert_parallel_size: int = 1,
    context_parallel_size: int = 1,
) -> dict[str, int]:
    """Sizes of every mesh dimension, e.g. ``mesh_sizes(8, 1, "auto", 2) == {"data_parallel": 8,
    "context_parallel": 1, "tensor_parallel": 1, "expert_parallel": 2, "expert_data_parallel": 4}``.

    ``"auto"`` means every rank over the context-parallel size (tensor-parallel size 1), not Lightning's number of
    nodes.
    """
    if world_size < 1 or num_nodes < 1 or world_size % num_nodes:
        raise ValueError(f"world_size={world_size} must be a positive multiple of num_nodes={num_nodes}.")
    divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
    cp = context_parallel_size
    if isinstance(cp, bool) or not isinstance(cp, int) or cp < 1 or world_size % cp:
        raise ValueError(
            f"context_parallel_size={cp!r} must divide the world size {world_size} (each sequence is split over "
            f"{cp} ranks, the data over world / context_parallel_size): use one of {divisors}."
        )
    dp = world_size // cp if data_parallel_size == "auto" else data_parallel_size
    if not isinstance(dp, int) or dp * cp != world_size:
        raise ValueError(
            f"data_parallel_size={data_parallel_size!r} x context_parallel_size={cp} x tensor_parallel_size=1 != "
            f"world size {world_size} ({num_nodes} node(s) x {world_size // num_nodes} devices): use 'auto' (or "
            f"{world_size // cp})."
        )
    ep = expert_parallel_size
    if not isinstance(ep, int) or ep < 1 or world_size % ep:
        raise ValueError(
            f"expert_parallel_size={ep!r} must divide the world size {world_size} (experts are split over groups of "
            f"{ep} ranks and copied over world / ep): use one of {divisors}."
        )
    return {DATA_PARALLEL: dp, CONTEXT_PARALLEL: cp, TENSOR_PARALLEL: 1, EXPERT_PARALLEL: ep,
            EXPERT_DATA_PARALLEL: world_size // ep}


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


def init_dense_mesh(sizes: dict[str, int], device_type: str) -> DeviceMesh:
    """The dense mesh ``(data_parallel, tensor_parallel)``, or ``(data_parallel, context_parallel, tensor_parallel)``
    under context parallelism: consecutive ranks share the rows of one batch, each holding a shard of the positions."""
    names = (DATA_PARALLEL, CONTEXT_PARALLEL, TENSOR_PARALLEL) if sizes[CONTEXT_PARALLEL] > 1 else (
        DATA_PARALLEL, TENSOR_PARALLEL)
    return init_device_mesh(device_type, tuple(sizes[name] for name in names), mesh_dim_names=names)


def init_meshes(world_size: int, expert_parallel_size: int = 1, device_type: str = "cuda",
                context_parallel_size: int = 1) -> Meshes:
    """The dense and (with EP) expert meshes of an initialised process group, without Lightning."""
    sizes = mesh_sizes(world_size, 1, "auto", expert_parallel_size, context_parallel_size)
    experts = init_expert_mesh(sizes, device_type) if expert_parallel_size > 1 else None
    return Meshes(init_dense_mesh(sizes, device_type), experts, world_size)


class DDPStrategy(_RunSettings, strategies.DDPStrategy):
    """Lightning's ``DDPStrategy`` (its arguments pass through) with the run settings ``parallelism``
    (:class:`~lit_dllm.settings.Parallelism`; the ``fsdp_*`` ones do nothing here)."""

    def __init__(self, parallelism: Parallelism = Parallelism(), **kwargs) -> None:
        super().__init__(**kwargs)
        self._take(parallelism)


class ExpertParallelStrategy(_RunSettings, strategies.ModelParallelStrategy):
    """FSDP2 over all ranks, plus expert parallelism over groups of ``expert_parallel_size`` ranks.

    Args:
        parallelism: the run settings (:class:`~lit_dllm.settings.Parallelism`).
        data_parallel_size: ``"auto"`` (every rank over ``parallelism.context_parallel_size``, the only valid value
            with tensor parallel size 1) or that number. Lightning's ``ModelParallelStrategy`` reads ``"auto"`` as the
            number of nodes.
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
        parallelism: Parallelism = Parallelism(),
    ) -> None:
        super().__init__(data_parallel_size, 1, save_distributed_checkpoint, process_group_backend, timeout)
        self._take(parallelism, context_parallel=True)
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
            self.expert_parallel_size, self.parallelism.context_parallel_size,
        )
        compat.set_data_parallel_size(self, self.sizes[DATA_PARALLEL] * self.sizes[CONTEXT_PARALLEL])
        super().setup_environment()  # the process group and the dense (data_parallel, tensor_parallel) mesh
        if self.sizes[CONTEXT_PARALLEL] > 1:
            compat.set_device_mesh(self, init_dense_mesh(self.sizes, self.root_device.type))
        if self.expert_parallel_size > 1:
            self._expert_mesh = init_expert_mesh(self.sizes, self.root_device.type)
