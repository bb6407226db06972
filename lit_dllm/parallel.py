"""FSDP2 sharding applied from ``configure_model`` (Lightning ``ModelParallelStrategy``).

Model code stays single-device; this shards it from the outside, as torchtitan does: each
transformer block (the classes a transformers model lists in ``_no_split_modules``) becomes its
own FSDP unit, then the root takes the rest (embedding, final norm, LM head, tied or not).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

DATA_PARALLEL = "data_parallel"


def block_class_names(model: nn.Module) -> set[str]:
    """Names of the repeated blocks of every transformers model inside ``model``."""
    names: set[str] = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or [])
    return names


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    param_dtype: torch.dtype | None = torch.bfloat16,
    reduce_dtype: torch.dtype = torch.float32,
) -> nn.Module:
    """Shard ``model`` over the mesh's data-parallel dimension, one FSDP unit per block plus the root."""
    if DATA_PARALLEL in (mesh.mesh_dim_names or ()):
        mesh = mesh[DATA_PARALLEL]
    names = block_class_names(model)
    blocks = [m for m in model.modules() if type(m).__name__ in names]
    if not blocks:
        raise ValueError(
            f"No transformer blocks found to shard in {type(model).__name__} (looked for {sorted(names)}); "
            "override parallelize() for this model."
        )
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for block in blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model
