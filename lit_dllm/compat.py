"""Every read or write of another library's private names, in one place.

Each function wraps one internal that has no public equivalent in the versions pyproject.toml allows; it says what
it touches and why. ``tests/test_compat.py`` checks each against the installed versions and fails, naming the
function here, when a release moves one: fix it here, then widen the bound in pyproject.toml.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import lightning as L
import torch
from lightning.pytorch.core import saving
from lightning.pytorch.core.mixins.hparams_mixin import _given_hyperparameters
from torch import nn
from torch.autograd.graph import _MultiHandle
from transformers import PreTrainedModel
from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY

# ----------------------------------------------------------------------------------------------------- Lightning
CLASS_PATH_KEY = "_class_path"
"""Where LightningCLI's instantiator records the module class among a checkpoint's ``hyper_parameters`` (beside
``INSTANTIATOR_KEY``); ``load_from_checkpoint`` rebuilds that class, and takes the key as a keyword to name another."""
INSTANTIATOR_KEY = "_instantiator"


def cli_records() -> dict:
    """What LightningCLI's instantiator records about the module it is building (``CLASS_PATH_KEY``,
    ``INSTANTIATOR_KEY``), for a module that saves its hyper-parameters as an explicit dict: Lightning puts them in
    the hyper-parameters only when they are read from the constructor's frame. The instantiator hands them over in
    the private context variable ``_given_hyperparameters`` (None outside the CLI)."""
    given = _given_hyperparameters.get() or {}
    return {key: given[key] for key in (CLASS_PATH_KEY, INSTANTIATOR_KEY) if key in given}


def lightning_classmethod(function: Callable) -> classmethod:
    """Decorator: ``function`` (taking the class first) as a class method the way Lightning wraps its own
    ``LightningModule.load_from_checkpoint``: a private ``_restricted_classmethod`` (``lightning.pytorch.utilities.
    model_helpers``) that raises ``TypeError`` when called on an instance, whose result (a new module) would be dropped
    while the instance stays as it was. For an override of ``load_from_checkpoint`` that keeps that behaviour; a plain
    ``classmethod`` would silently accept ``module.load_from_checkpoint(path)``. The descriptor's type is taken from
    Lightning's own attribute, so it follows whatever Lightning uses there."""
    return type(vars(L.LightningModule)["load_from_checkpoint"])(function)


@contextmanager
def converting_checkpoints(convert: Callable[[dict], dict]) -> Iterator[None]:
    """Within: each checkpoint that Lightning's ``load_from_checkpoint`` reads goes through ``convert`` before
    Lightning uses it. That API takes a path or a file-like only; this wraps the reader its ``_load_from_checkpoint``
    calls (the private ``pl_load`` of ``lightning.pytorch.core.saving``), so the checkpoint is read once, as
    Lightning reads it (``map_location``, ``weights_only``), and never written out again."""
    read = saving.pl_load
    saving.pl_load = lambda *args, **kwargs: convert(read(*args, **kwargs))
    try:
        yield
    finally:
        saving.pl_load = read


@contextmanager
def reading_folders(read_folder: Callable[[Any], dict]) -> Iterator[None]:
    """Within: a folder that Lightning's ``load_from_checkpoint`` is given (a sharded checkpoint) is read by
    ``read_folder`` instead of its private ``pl_load`` (which reads files only)."""
    read = saving.pl_load

    def load(path, *args, **kwargs):
        is_folder = isinstance(path, (str, os.PathLike)) and os.path.isdir(path)
        return read_folder(path) if is_folder else read(path, *args, **kwargs)

    saving.pl_load = load
    try:
        yield
    finally:
        saving.pl_load = read


def skip_checkpoint_hparams(cli_class: type) -> type:
    """Class decorator: no ``LightningCLI._parse_ckpt_path`` for ``cli_class``, which merges a ``--ckpt_path``
    checkpoint's hyper-parameters its own way. Lightning's private step, run between ``parse_arguments`` and
    ``before_instantiate_classes``, puts them over the user's settings; no argument turns it off."""
    cli_class._parse_ckpt_path = lambda self: None
    return cli_class


def save_last_checkpoint(callback, trainer) -> None:
    """Have a ``ModelCheckpoint(save_last=True)`` write its ``last`` checkpoint now, as at the end of training, unless
    it already saved this step. Its own naming, versioning, linking and clean-up are private
    (``_save_last_checkpoint``, ``_monitor_candidates``, ``_last_global_step_saved``) and its public hooks save only at
    their own moments (a stop raised from a signal handler reaches none of them)."""
    if callback._last_global_step_saved != trainer.global_step:
        callback._save_last_checkpoint(trainer, callback._monitor_candidates(trainer))


def should_accumulate(trainer) -> bool:
    """Whether Lightning will accumulate this micro-batch's gradients without an optimizer step (the fit loop's
    private decision: a window's last micro-batch steps, and so does an epoch's last, window full or not)."""
    return trainer.fit_loop._should_accumulate()


def set_data_parallel_size(strategy, size: int) -> None:
    """The data-parallel size ``ModelParallelStrategy.setup_environment`` builds its mesh with (private
    ``_data_parallel_size``: set from ``__init__``, where ``"auto"`` means the number of nodes, not every rank)."""
    strategy._data_parallel_size = size


def set_device_mesh(strategy, mesh) -> None:
    """Replace the mesh ``ModelParallelStrategy.setup_environment`` built (private ``_device_mesh``, which its
    ``device_mesh`` and ``distributed_sampler_kwargs`` read, and the module's ``_device_mesh``): the data x context
    mesh, whose ``data_parallel`` dimension the sampler splits the data over."""
    strategy._device_mesh = mesh
    strategy.lightning_module._device_mesh = mesh


# ---------------------------------------------------------------------------------------------------------- torch
def hook_fsdp_unit_per_module(unit: Sequence[nn.Module]) -> None:
    """Give each module of an FSDP2 unit of several modules (``fully_shard(list(unit))``) the forward hooks FSDP2
    gives a unit of one module (see ``lit_dllm.parallel._fully_shard`` for why). FSDP2's hooks are methods of its
    private state (``_get_fsdp_state``: ``_pre_forward``, ``_post_forward``), which keeps their handles in
    ``_pre_forward_hook_handle`` / ``_post_forward_hook_handle``; its public API sets a unit's hooks only at
    ``fully_shard``."""
    state = unit[0]._get_fsdp_state()
    state._pre_forward_hook_handle.remove()  # one handle of the group's pre- and post-forward hooks
    handles = []
    for module in unit:
        handles.append(module.register_forward_pre_hook(state._pre_forward, prepend=True, with_kwargs=True))
        handles.append(module.register_forward_hook(state._post_forward, prepend=False))
    state._pre_forward_hook_handle = state._post_forward_hook_handle = _MultiHandle(tuple(handles))


def unshard_before_backward(module: nn.Module, tensors: Sequence[torch.Tensor]) -> None:
    """Have FSDP2 unshard ``module``'s unit before the backward reaches any of ``tensors`` (a call's side outputs,
    which its own outputs' hooks do not cover): the unit's private pre-backward hook (``_pre_backward`` of
    ``_get_fsdp_state``), as FSDP2 registers it on a module's outputs. Does nothing without grad."""
    if not torch.is_grad_enabled():
        return
    state = module._get_fsdp_state()
    for tensor in tensors:
        if tensor.requires_grad:
            tensor.register_hook(state._pre_backward)


def after_backward(callback: Callable[[], None]) -> None:
    """Run ``callback`` once the running backward pass has finished; call it from a backward hook. The autograd
    engine's private ``queue_callback``, with which FSDP2 finishes its own backward (queued at the backward's start,
    its callback runs before one queued later)."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def can_skip_step(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step`` reads :func:`set_found_inf`'s flag and skips itself on the device (torch's fused
    Adam, AdamW, SGD): the private protocol of ``torch.amp.GradScaler`` (``_step_supports_amp_scaling``)."""
    return getattr(optimizer, "_step_supports_amp_scaling", False)


def set_found_inf(optimizer: torch.optim.Optimizer, found_inf: torch.Tensor | None) -> None:
    """Set the 0/1 float tensor the next ``step`` of a :func:`can_skip_step` optimizer reads as GradScaler's
    ``found_inf`` (1: skip the update), or remove it (None)."""
    if found_inf is None:
        vars(optimizer).pop("found_inf", None)
    else:
        optimizer.found_inf = found_inf


def foreach_mul_(tensors: Sequence[torch.Tensor], scale: torch.Tensor) -> None:
    """Multiply each of ``tensors`` (all on one device) in place by the 0-dim tensor ``scale`` in one multi-tensor
    launch: torch's private ``_foreach_mul_``, which its own optimizers and ``clip_grad_norm_`` use; no public function
    scales a list of tensors without one launch (and one host dispatch) per tensor."""
    torch._foreach_mul_(tensors, scale)


def maybe_mark_dynamic(tensor: torch.Tensor, dim: int) -> None:
    """Have ``torch.compile`` trace size ``dim`` of ``tensor`` as symbolic from its first compile, where a size seen
    once is otherwise a constant (one graph more before it goes dynamic): dynamo's ``torch._dynamo.
    maybe_mark_dynamic``, which ``torch.compiler`` does not export."""
    torch._dynamo.maybe_mark_dynamic(tensor, dim)


# --------------------------------------------------------------------------------------------------- transformers
def flatten_mesh(mesh, dims: tuple[str, ...], name: str):
    """The 1-D mesh of the dimensions ``dims`` of ``mesh`` taken together, named ``name`` (DeviceMesh's private
    ``_flatten``; a second call returns the same mesh)."""
    return mesh[dims]._flatten(name)


@contextmanager
def _ring_options(accumulate_in_float32: bool):
    """torch's ring attention module with its process-wide options set for one call and restored after: no load
    balancing (the shards are contiguous, as every scheme cuts them), keys and values passed shard by shard
    (``ALL_TO_ALL``: memory per layer ``L / C``, not the whole row's ``L``), merges in float32 unless told not to."""
    from torch.distributed.tensor.experimental._context_parallel import _attention as ring

    options, names = ring._cp_options, ("enable_load_balance", "rotate_method", "convert_to_f32")
    saved = [getattr(options, name) for name in names]
    for name, value in zip(names, (False, ring._RotateMethod.ALL_TO_ALL, accumulate_in_float32)):
        setattr(options, name, value)
    try:
        yield ring
    finally:
        for name, value in zip(names, saved):
            setattr(options, name, value)


def flash_attention_ops(cuda: bool) -> tuple[Callable, Callable]:
    """ATen's flash-attention kernels behind SDPA, forward and backward, CUDA's or the CPU's: the public SDPA returns no
    log-sum-exp, which the ring merges its steps by."""
    aten = torch.ops.aten
    if cuda:
        return aten._scaled_dot_product_flash_attention, aten._scaled_dot_product_flash_attention_backward
    return aten._scaled_dot_product_flash_attention_for_cpu, aten._scaled_dot_product_flash_attention_for_cpu_backward


def templated_ring_attention(group, forward_op: Callable, query, key, value, causal: bool, **kwargs) -> tuple:
    """torch's ring attention over ``group``'s contiguous shards (``[B, H, L / C, D]``, positions on dim 2):
    ``forward_op(query, key, value, is_causal=..., **kwargs)`` (an SDPA kernel returning ``(out, logsumexp, ...)``)
    runs against each rank's keys and values in turn, merged by their log-sum-exp; returns ``(out, logsumexp, ...)``.
    ``_templated_ring_attention`` is the prototype ``context_parallel``'s own (it has no public form that takes local
    tensors); float64 inputs merge in float64."""
    with _ring_options(query.dtype != torch.float64) as ring:
        return ring._templated_ring_attention(group, 2, forward_op, query=query, key=key, value=value,
                                              is_causal=causal, **kwargs)


def templated_ring_attention_backward(group, backward_op: Callable, grad, query, key, value, out, logsumexp,
                                      causal: bool, **kwargs) -> tuple:
    """The backward of :func:`templated_ring_attention`: ``(grad_query, grad_key, grad_value, ...)`` of this rank's
    shards, the gradients of keys and values passed back round the ring to their ranks
    (``_templated_ring_attention_backward``)."""
    with _ring_options(query.dtype != torch.float64) as ring:
        return ring._templated_ring_attention_backward(
            group, 2, backward_op, grad_out=grad, grad_out_name="grad_out", query=query, key=key, value=value,
            out=out, logsumexp=logsumexp, is_causal=causal, **kwargs)


def attn_implementation(config) -> str | None:
    """The attention a transformers model runs (``sdpa``, ``eager``, ...): its config's ``_attn_implementation``;
    transformers sets it publicly (``set_attn_implementation``) but has no getter."""
    return config._attn_implementation


def experts_implementation(config) -> str | None:
    """What runs a transformers MoE experts module (``grouped_mm``, ``eager``, ...): its config's
    ``_experts_implementation``, which the decorated ``forward`` dispatches on at every call. The public
    ``PreTrainedModel.get_experts_implementation`` needs the model and reports per sub-config, not per module."""
    return config._experts_implementation


def no_split_modules(model: nn.Module) -> set[str]:
    """Class names of a transformers model's repeated blocks (its ``_no_split_modules``, which ``device_map`` and
    accelerate also read; there is no public accessor). Empty for any other module."""
    return set(getattr(model, "_no_split_modules", None) or ())


def mark_expert_parallel(module: nn.Module) -> None:
    """Mark a module whose forward or parameters an EP style replaced, as transformers' ``apply_expert_parallelism``
    does (``_is_hooked``; its MXFP4 experts then take the EP forward)."""
    module._is_hooked = True


def dispatch_tokens(ep, hidden_states, top_k_index, top_k_weights):
    """The first half of transformers' ``AllToAllEP.__call__`` (private ``_dispatch_tokens``): the rows each expert
    of this rank runs on, their expert ids and weights, and the state :func:`combine_tokens` needs."""
    return ep._dispatch_tokens(hidden_states, top_k_index, top_k_weights)


def combine_tokens(ep, expert_output, state):
    """The second half (private ``_combine_tokens``): the expert outputs back to their tokens, weighted and summed."""
    return ep._combine_tokens(expert_output, state)


def register_output_recording(model: nn.Module) -> None:
    """Register each transformers model in ``model`` in the private registry its output-recording hooks read
    (``_CAN_RECORD_REGISTRY``, filled by the constructor from ``_can_record_outputs``), for a model that was unpickled
    rather than constructed in this process (else ``output_hidden_states`` silently returns None)."""
    for module in model.modules():
        if isinstance(module, PreTrainedModel) and not _CAN_RECORD_REGISTRY.get(module):
            _CAN_RECORD_REGISTRY[module] = module._can_record_outputs


# ------------------------------------------------------------------------------------------------------- datasets
def dataset_fingerprint(dataset) -> str:
    """A ``datasets.Dataset``'s fingerprint (private ``_fingerprint``; ``map`` derives its cache key from it), to
    build a ``map``'s ``new_fingerprint`` where the mapped function itself does not hash reproducibly."""
    return dataset._fingerprint
