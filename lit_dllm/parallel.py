"""Parallelism applied from ``configure_model``: expert parallelism, activation checkpointing, compile, FSDP2.

Model code stays single-device; the model converters (fp8's float8 linears, LoRA's adapters: :mod:`lit_dllm.converters`)
change it first, as torchtitan converts the model before parallelising it, so compile traces them and FSDP2 shards
their weights. Then :func:`parallelize` shards it from the outside in torchtitan's order:

0. **Context parallelism** (``Parallelism.context_parallel_size = C > 1``): every attention layer runs by Ulysses
   or all-gathered keys and values (``context_parallel_attention``) over the ``context_parallel`` mesh dimension
   (:mod:`lit_dllm.context_parallel`), and the model takes each row's shard of positions; FSDP2 (4.) then shards
   over data x context, the ranks a step's loss sums over.
1. **EP** (``ExpertParallelStrategy(expert_parallel_size=ep > 1)``): the expert weights of every transformers MoE
   model inside are split by expert (``Shard(0)``) over the ``expert_parallel`` mesh dimension, and tokens reach
   them through two autograd-aware all-to-alls. This reuses transformers' own pieces (the model's ``ep_plan`` and
   ``transformers.distributed.expert_parallel``: the same sharding and dispatch as
   ``from_pretrained(distributed_config=DistributedConfig(ep_size=...))``), with the dispatch fixed for CUDA autocast
   (:class:`AutocastSafeAllToAllEP`). The rest is ours because that loading
   path (a) shards only while loading a saved checkpoint, not a built model, and needs ``accelerate``; (b) makes the
   Hugging Face model the FSDP root and ``lm_head`` its own unit, while :class:`~lit_dllm.families.mdlm.model.
   DiffusionLM`'s fused loss calls ``hf.base_model`` and reads the head weight directly, outside those hooks.
2. **Activation checkpointing**: transformers' non-reentrant gradient checkpointing of every block.
3. **Compile** (:func:`apply_compile`): ``torch.compile`` of each transformer block's ``forward``, in place (the
   state-dict keys stay those of the eager model). Hooks stay eager around it: FSDP2's, the checkpointing wrapper's
   and EP's all-to-all dispatch (experts under EP run eagerly, as their dispatch has data-dependent sizes).
4. **FSDP2**: under EP the experts first, over ``expert_data_parallel``; then each transformer block (the classes
   a transformers model lists in ``_no_split_modules``) over ``data_parallel``, skipping the experts already
   sharded; then the root (the outermost module, e.g. ``DiffusionLM``) takes the rest: embedding, final norm and LM
   head, tied or not.

**Tied stacks** (transformers' ``DiffusionGemmaForBlockDiffusion``: encoder layer ``i`` and decoder layer ``i`` are
different modules holding the same Parameters, called once and twice per training step). Blocks, and experts, that
share parameters are one FSDP unit, found by parameter identity (:func:`tied_groups`), which FSDP2 runs like one
module called several times: each call gathers the parameters and frees them when it returns, and each call's
backward gathers them again and reduce-scatters that call's gradients (:func:`_fully_shard`). EP shards a tied
expert Parameter once and gives every module holding it the sharded Parameter and the all-to-all dispatch
(:func:`expert_plan`, :func:`_apply_expert_plan`). Every tie survives: the tied modules keep holding one
Parameter, now sharded.

**Experts kernels** (:func:`lit_dllm.experts.experts_kernels`): what runs each MoE model's experts under that setup
(transformers' ``grouped_mm``, or the per-expert loop it and torch fall back to without a word); the strategies log it
when ``fit`` starts, and warn on CUDA where it is the loop.

Gradient contract. Each rank's loss is ``local_token_loss_sum / global_token_count * D`` with ``D`` the
data-parallel size (:func:`~lit_dllm.meshes.data_parallel_size`; under context parallelism data x context,
:func:`~lit_dllm.meshes.loss_group_size`: each rank's local sum covers its shard of the positions). FSDP averages dense
gradients over the ``D`` ranks, which gives the gradient of the global per-token mean. An expert's gradient on one
rank already sums the contributions of the ``ep`` ranks whose tokens reached it, and FSDP's reduce-scatter then sums
the ``D / ep`` expert copies: every rank once in all, so the expert units divide by ``D``
(:func:`~lit_dllm.meshes.expert_gradient_divide_factor`), not by FSDP's default ``D / ep``, which would leave expert
gradients ``ep`` times too large.
"""

from __future__ import annotations

import itertools
import re
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from transformers import PreTrainedModel
from transformers.distributed.expert_parallel import (
    ALL_PARALLEL_STYLES,
    AllToAllEP,
    EPImplementationInterface,
    ExpertParallelLayer,
)

from lit_dllm import compat
from lit_dllm.context_parallel import apply_context_parallel
from lit_dllm.hub.blocks import hf_backbone, transformer_blocks
from lit_dllm.meshes import (
    EXPERT_DATA_PARALLEL,
    EXPERT_PARALLEL,
    TENSOR_PARALLEL,
    context_parallel_mesh,
    device_meshes,
    expert_gradient_divide_factor,
    loss_mesh,
)

AUTOCAST_SAFE_ALL_TO_ALL = "lit_dllm_all_to_all"
"""The name :class:`AutocastSafeAllToAllEP` is registered under in transformers' EP implementations."""
DISPATCH_STYLE = "ep_dispatch_experts"
"""transformers' EP-plan style of an experts module (its parameters get ``grouped_gemm``: ``Shard(0)``)."""


# ------------------------------------------------------------------------------------------------------- plans
def expert_plan(model: nn.Module) -> dict[str, str]:
    """transformers' EP plan of every MoE model inside ``model``, one entry per concrete parameter or module name
    (relative to ``model``); each module's parameters come before the module, as the dispatch hook reads the local
    expert count that sharding the parameters sets.

    Only the plan's expert-parallel styles are kept (``grouped_gemm``, ``ep_dispatch_experts``): some plans also
    split dense layers by tensor parallelism over the EP ranks (DiffusionGemma's ``mlp.*_proj``), which needs the
    EP group to share one batch, while here every rank holds its own. A tied stack (a module holding the same
    parameters as a planned one, e.g. DiffusionGemma's decoder layer ``i`` and its encoder layer ``i``, where only
    the encoder's names are in the plan) gets the planned module's entries under its own names too;
    :func:`apply_expert_parallel` shards each parameter once.
    """
    rules = {}
    for prefix, backbone in model.named_modules():
        if isinstance(backbone, PreTrainedModel):
            for rule, style in (getattr(backbone, "ep_plan", None) or {}).items():
                if isinstance(ALL_PARALLEL_STYLES.get(style), ExpertParallelLayer):
                    rules[f"{prefix}.{rule}" if prefix else rule] = style
    planned_params, planned_modules = {}, {}  # id -> style, by transformers' names
    for name, module in model.named_modules():
        for param_name, param in module.named_parameters(recurse=False):
            if (style := rules.get(_wildcard(f"{name}.{param_name}"))) is not None:
                planned_params[id(param)] = style
        if (style := rules.get(_wildcard(name))) is not None and (ids := _parameter_ids(module)):
            planned_modules[ids] = style
    plan = {}
    for name, module in model.named_modules():
        for param_name, param in module.named_parameters(recurse=False):
            if (style := planned_params.get(id(param))) is not None:
                plan[f"{name}.{param_name}"] = style
        style = rules.get(_wildcard(name)) or planned_modules.get(_parameter_ids(module) or None)
        if style is not None:
            plan[name] = style
    return plan


def _parameter_ids(module: nn.Module) -> tuple[int, ...]:
    return tuple(id(param) for param in module.parameters())


def _wildcard(name: str) -> str:
    """``model.layers.3.mlp`` -> ``model.layers.*.mlp`` (how transformers writes its plans)."""
    return re.sub(r"\.\d+(\.|$)", lambda m: ".*" + m.group(1), name)


# ---------------------------------------------------------------------------------------------------- parallelize
def parallelize(
    model: nn.Module,
    strategy,
    *,
    param_dtype: torch.dtype | None = None,
    activation_checkpointing: bool = False,
    compile: bool = False,
    reshard_after_forward: bool = True,
    reduce_dtype: torch.dtype = torch.float32,
    context_parallel_attention: str = "ulysses",
) -> nn.Module:
    """Apply EP, activation checkpointing, compile and FSDP2 as asked (see the module docstring).

    ``strategy`` is a Lightning strategy (or any object with ``device_mesh`` and, for EP, ``expert_mesh``). Without
    a mesh (single device, DDP) the model is returned as it is, apart from activation checkpointing and compile.
    ``param_dtype``: FSDP's compute dtype of the parameters (e.g. bf16; None keeps theirs); gradients are reduced
    in ``reduce_dtype`` (fp32 unless asked otherwise); ``context_parallel_attention``: the scheme of
    :mod:`lit_dllm.context_parallel` under a ``context_parallel`` mesh dimension.

    Contract for callers:

    - ``model`` becomes the FSDP root, which owns every parameter outside the blocks (embeddings, LM head, final
      norms; DiffusionGemma's self-conditioning MLP and vision tower too): it gathers them when its own ``forward``
      starts and keeps them gathered through the backward. So ``model`` must be the module whose ``forward`` runs
      the whole training (or evaluation) computation: for DiffusionGemma a wrapper ``nn.Module`` holding the
      Hugging Face model (e.g. as ``self.hf``) whose ``forward`` runs the encoder pass, both decoder passes and the
      LM head, as :class:`~lit_dllm.families.diffusion_gemma.model.BlockDiffusionGemma` and
      ``tests/families/diffusion_gemma/test_parallel_gemma.py``'s ``BlockDiffusionStep`` do. Calling
      ``hf.model.encoder(...)`` or ``hf.lm_head`` outside it (e.g. from ``training_step``) meets the root's parameters
      sharded: ``aten.embedding.default got mixed torch.Tensor and DTensor``. The loss may be computed outside, from its
      outputs.
    - Freeze parameters (``requires_grad_(False)``: DiffusionGemma's router ``proj.weight`` and ``scale``, the
      vision tower) before calling it; FSDP2 takes frozen and trained parameters in one unit.
    - Each rank's backward loss follows the gradient contract of the module docstring.
    - ``activation_checkpointing``: transformers checkpoints the layers it supports (DiffusionGemma: the decoder
      layers only; its encoder layers write the KV cache and are not recomputed).
    - ``compile``: :func:`apply_compile` (each block's ``forward``, in place).
    - ``reshard_after_forward``: False keeps every FSDP unit gathered from its forward to its backward
      (:func:`apply_fsdp`).
    """
    dense_mesh, expert_mesh = device_meshes(strategy)
    if (context_mesh := context_parallel_mesh(strategy)) is not None:
        apply_context_parallel(model, context_mesh, context_parallel_attention)
    experts = []
    if expert_mesh is not None and expert_mesh[EXPERT_PARALLEL].size() > 1:
        experts = apply_expert_parallel(model, expert_mesh[EXPERT_PARALLEL], dense_mesh[TENSOR_PARALLEL])
    if activation_checkpointing:
        apply_activation_checkpointing(model)
    if compile:
        apply_compile(model, experts)
    if dense_mesh is None:
        return model
    return apply_fsdp(
        model, dense_mesh, param_dtype, experts=experts, expert_mesh=expert_mesh,
        expert_divide_factor=expert_gradient_divide_factor(strategy), reshard_after_forward=reshard_after_forward,
        reduce_dtype=reduce_dtype,
    )


def apply_expert_parallel(model: nn.Module, ep_mesh: DeviceMesh, tp_mesh: DeviceMesh) -> list[nn.Module]:
    """Split the experts of every MoE model inside ``model`` over ``ep_mesh`` (transformers' plan and all-to-all
    dispatch); ``tp_mesh`` is the group of ranks holding the same batch (size 1 here). Returns the experts modules."""
    plan = expert_plan(model)
    experts = [model.get_submodule(name) for name, style in plan.items() if style == DISPATCH_STYLE]
    if not experts:
        raise ValueError(
            f"expert_parallel_size={ep_mesh.size()} but {type(model).__name__} has no transformers MoE experts with "
            "an EP plan (base_model_ep_plan, e.g. Qwen3-MoE, Mixtral, OLMoE): set expert_parallel_size=1."
        )
    for module in experts:
        if module.num_experts % ep_mesh.size():
            raise ValueError(
                f"{module.num_experts} experts cannot be split evenly over expert_parallel_size={ep_mesh.size()}: "
                "use an expert_parallel_size that divides the number of experts."
            )
    EPImplementationInterface.register(AUTOCAST_SAFE_ALL_TO_ALL, AutocastSafeAllToAllEP)
    _apply_expert_plan(model, ep_mesh, tp_mesh, plan, AUTOCAST_SAFE_ALL_TO_ALL)
    return experts


def _apply_expert_plan(
    model: nn.Module, ep_mesh: DeviceMesh, tp_mesh: DeviceMesh, plan: dict[str, str], implementation: str
) -> None:
    """transformers' ``apply_expert_parallelism`` (the same styles, in the plan's order), except that a parameter held
    by several modules (a tied stack) is sharded once: every module holding it gets the same sharded Parameter (and
    the style's bookkeeping, e.g. its local expert count). transformers' loop looks parameters up by their first
    name only and would take a tied twin's name for a module's."""
    modules = dict(model.named_modules())
    sharded: dict[int, tuple[nn.Parameter, nn.Parameter]] = {}  # id(original) -> (original, kept alive; sharded)
    for name, style_name in plan.items():
        style = ALL_PARALLEL_STYLES[style_name]
        if name in modules:
            module = modules[name]
            if style_name == DISPATCH_STYLE:
                style.install_forward(module, ep_mesh=ep_mesh, tp_mesh=tp_mesh, ep_implementation=implementation)
            else:
                style.install_forward(module, ep_mesh)
        else:
            module_name, _, param_name = name.rpartition(".")
            module = modules[module_name]
            original = module.get_parameter(param_name)
            style.validate_param(module, param_name, ep_mesh, parameter_name=name)
            style.shard_param(module, param_name, ep_mesh)  # a twin's local copy is dropped just below
            if id(original) in sharded:
                module.register_parameter(param_name, sharded[id(original)][1])
            else:
                sharded[id(original)] = (original, module.get_parameter(param_name))
        compat.mark_expert_parallel(module)


class AutocastSafeAllToAllEP(AllToAllEP):
    """transformers' all-to-all dispatch, with one fix: a rank that receives no tokens runs its experts on a dummy row
    (the sum of the empty rows, to keep the exchange in the backward graph), and CUDA autocast computes ``sum`` in
    fp32. That rank's (empty) expert output is then fp32 while its peers send bf16, so the combine all-to-all expects
    twice the bytes they send: NCCL waits forever or the next layer reads garbage split sizes (seen on 2 x H100,
    bf16-mixed, when routing sent every token of a batch to one rank's experts). Here the dummy row keeps the tokens'
    dtype, so every rank's experts produce what they would on real rows."""

    def __call__(self, hidden_states, top_k_index, top_k_weights):
        tokens, expert_ids, weights, state = compat.dispatch_tokens(self, hidden_states, top_k_index, top_k_weights)
        if tokens.shape[0] == 0:
            dummy = tokens.sum(dim=0, keepdim=True).to(tokens.dtype)
            expert_output = self.experts_forward(dummy, expert_ids.new_zeros((1, 1)), weights.new_ones((1, 1)))[:0]
        else:
            expert_output = self.experts_forward(tokens, expert_ids, weights)
        return compat.combine_tokens(self, expert_output, state)


def apply_activation_checkpointing(model: nn.Module) -> None:
    """Recompute each transformer block in backward (transformers' non-reentrant checkpointing, composes with FSDP2)."""
    backbones = [m for m in model.modules() if isinstance(m, PreTrainedModel) and m.supports_gradient_checkpointing]
    if not backbones:
        raise ValueError(f"{type(model).__name__} holds no transformers model that supports activation checkpointing.")
    covered: set[int] = set()  # modules of a model switched on here (its inner models included)
    for backbone in backbones:
        if id(backbone) in covered or any(getattr(m, "gradient_checkpointing", False) for m in backbone.modules()):
            continue  # already on (an outer model switched on its inner one too)
        covered.update(id(m) for m in backbone.modules())
        if hasattr(backbone, "activation_checkpointing_enable"):  # transformers >= 5.2x; the older name is deprecated
            backbone.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            backbone.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


COMPILE_BACKEND = "inductor"
"""``torch.compile`` backend of :func:`apply_compile` (tests set ``"eager"`` or ``"aot_eager"``: no C++ build)."""


def apply_compile(model: nn.Module, experts: Sequence[nn.Module] = ()) -> list[nn.Module]:
    """``torch.compile`` each transformer block's ``forward`` in place; returns the blocks.

    Compiling ``forward`` (not the module call) keeps every hook eager around the compiled code: FSDP2's unshard and
    reshard, transformers' checkpointing ``__call__``, and the gradient hooks of tied stacks. The module tree and the
    state-dict keys are unchanged (no ``_orig_mod.``), so checkpoints load with compile on or off. The blocks of one
    class share one code object and, since torch inlines built-in modules, one compiled graph. ``experts`` (split by EP:
    their all-to-all has data-dependent sizes) run eagerly inside the compiled blocks.

    Shapes: ``dynamic=None``, torch's automatic dynamic shapes. The first batch compiles with static sizes (the best
    kernels for the common case of one fixed length); the first batch of another size recompiles once with that
    dimension symbolic, and every later bucketed length (``pad_seq_len_divisible``) or batch size reuses it. A run
    with several lengths thus compiles each block class about twice for training and once more for evaluation
    (``eval()`` and ``no_grad`` are guarded): 3 for MDLM and CausalLM. ``mark_dynamic`` is no alternative here: the
    blocks' inputs (hidden states, rotary tables) are made inside the transformers model, out of reach, and marking
    the lengths symbolic from the start would cost a fixed-length run its static kernels.

    ``torch.compiler.config.recompile_limit`` (8 by default; past it a block runs eagerly) counts the entries of one
    code object, shared by all blocks of a class. Blocks that specialise per layer (DiffusionGemma indexes its KV
    cache by ``layer_idx``; sliding and full layers differ) need entries per layer, so the limit is raised to
    4 per block (training and evaluation, static and dynamic), never lowered.

    Under FlexAttention (``attn_implementation: flex_attention``) the blocks compile with static shapes only
    (``dynamic=False``), and each new length compiles anew: inductor's flex lowering fails on a symbolic head size
    (torch 2.11, "unsupported operand type(s) for &: 'floor' and 'Add'"), which automatic dynamic shapes make of
    DiffusionGemma's head sizes (256 in the sliding layers, 512 in the global ones, one code object).
    """
    blocks = transformer_blocks(model, "compile", "set compile=False or override parallelize() for this model")
    for module in experts:
        module.forward = torch.compiler.disable(module.forward, recursive=True)
    dynamic = False if _uses_flex_attention(model) else None
    for block in blocks:
        block.forward = torch.compile(block.forward, backend=COMPILE_BACKEND, dynamic=dynamic)
    config = torch.compiler.config
    config.recompile_limit = max(config.recompile_limit, 4 * len(blocks))
    return blocks


def _uses_flex_attention(model: nn.Module) -> bool:
    """Whether a transformers model inside ``model`` runs FlexAttention."""
    return any(compat.attn_implementation(module.config) == "flex_attention"
               for module in model.modules() if isinstance(module, PreTrainedModel))


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    param_dtype: torch.dtype | None = torch.bfloat16,
    reduce_dtype: torch.dtype = torch.float32,
    *,
    experts: Sequence[nn.Module] = (),
    expert_mesh: DeviceMesh | None = None,
    expert_divide_factor: float | None = None,
    reshard_after_forward: bool = True,
) -> nn.Module:
    """Shard ``model`` over the mesh's data-parallel dimension (data x context under context parallelism), one FSDP unit per block (per group of blocks that
    share parameters) plus the root; the ``experts`` (already split by EP; per group of tied experts modules) first,
    over ``expert_mesh``'s ``expert_data_parallel`` dimension, with their gradients divided by
    ``expert_divide_factor``. The last block (when it shares no parameters) keeps its parameters gathered from its
    forward to its backward, which comes next (as torchtitan does): one all-gather fewer per step.

    ``reshard_after_forward=False`` keeps every unit gathered from its first forward call to its backward, for the
    memory of the unsharded parameters of every block: no all-gather in the backward. A unit called several times
    (DiffusionGemma's shared layers: encoder, then both decoder passes) stays gathered to the end of the whole backward
    (:func:`_gathered_through_backward`): one all-gather a step (five when resharded after each forward)."""
    mesh = loss_mesh(mesh)
    blocks = transformer_blocks(model, "FSDP", "override parallelize() for this model")
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for unit in tied_groups(experts):
        copies = expert_mesh[EXPERT_DATA_PARALLEL]
        module = _fully_shard(unit, mesh=copies, mp_policy=policy, reshard_after_forward=reshard_after_forward)
        module.set_gradient_divide_factor(expert_divide_factor)
        if copies.size() > 1:
            # A factor other than the group size is a PREMUL_SUM reduction, which gloo rejects and NCCL zeroes in
            # bf16 (pytorch/pytorch#190747): sum, then divide locally. (Over one copy FSDP divides once itself.)
            module.set_force_sum_reduction_for_comms(True)
    units = tied_groups(blocks)
    for unit in units:
        last = unit is units[-1] and len(unit) == 1
        _fully_shard(unit, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward and not last)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def first_units(model: FSDPModule) -> list[FSDPModule]:
    """The FSDP2 units a sharded ``model``'s forward gathers first: the root (the embedding's unit) and the first
    unit below it in module order (the first block's)."""
    below = (module for module in model.modules() if isinstance(module, FSDPModule) and module is not model)
    return [model, *itertools.islice(below, 1)]


def sync_gradients_in_backward(model: nn.Module, sync: bool) -> None:
    """Under FSDP2 gradient accumulation: whether the next backward reduce-scatters the gradients and reshards (a
    step's last micro-batch) or keeps them unsharded and gathered, accumulating (the others). Units without a
    trainable parameter always sync: they have no gradient to keep, and FSDP2 fails on a unit that was never called
    (DiffusionGemma's vision tower in text training) when told not to sync (``'FSDPParam' object has no attribute
    '_unsharded_param'``, torch 2.13)."""
    for unit in model.modules():
        if isinstance(unit, FSDPModule) and any(param.requires_grad for param in unit.parameters()):
            unit.set_requires_gradient_sync(sync, recurse=False)
            if unit in _GATHERED_THROUGH_BACKWARD:  # resharded once the backward has run, if it synced
                _GATHERED_THROUGH_BACKWARD[unit]["sync"] = sync
            else:
                unit.set_reshard_after_backward(sync, recurse=False)


def _fully_shard(unit: Sequence[nn.Module], **options) -> nn.Module:
    """One FSDP unit of ``unit``'s modules: one module, or several that share parameters (a tied stack: FSDP2
    rejects a parameter in two units). Returns the first module (any of them sets the unit's options).

    FSDP2 runs a unit of several modules as one pass through all of them: it unshards at the first module's forward
    and reshards once each module ran, and a module that runs again (or alone) keeps the parameters unsharded to the
    end of the root's forward, which then hooks the backward's unshard to the root's outputs. The block-diffusion
    step calls encoder layer ``i`` once and decoder layer ``i`` twice, so every layer would stay unsharded through
    each pass, and the backward of one call (the decoder's) reshards the parameters before the other call's backward
    ran: a segfault (gloo) or ``setStorage ... out of bounds`` (NCCL) whenever the root's outputs are not both the
    encoder's and the decoder's logits (e.g. one loss tensor). So each module gets the hooks FSDP2 gives a unit of one
    module, and the unit behaves like one module called several times, which FSDP2 supports: every call unshards,
    reshards when it returns, reduce-scatters its own gradients once its inputs' gradients are computed (summed into
    the sharded gradient) and unshards again before its own backward. (torch's own ``fsdp2_mem_tracker`` replaces
    these hooks the same way.) The backward unshard is hooked to each call's outputs. A call that also leaves tensors
    elsewhere (the encoder's KV cache, which carries the only gradients of the last encoder layer when no loss reads
    its hidden states) must hook them too, with :func:`lit_dllm.compat.unshard_before_backward`, outside the call:
    a hook registered on a tensor inside a compiled block breaks its graph there.
    """
    if len(unit) == 1:
        return fully_shard(unit[0], **options)
    fully_shard(list(unit), **options)
    compat.hook_fsdp_unit_per_module(unit)
    if not options.get("reshard_after_forward", True):
        _gathered_through_backward(unit)
    return unit[0]


_GATHERED_THROUGH_BACKWARD: weakref.WeakKeyDictionary[nn.Module, dict] = weakref.WeakKeyDictionary()
"""The modules of :func:`_gathered_through_backward`'s units, each with its unit's ``{"sync": ...}``: whether the next
backward syncs the gradients (:func:`sync_gradients_in_backward`), and so reshards once it has run."""


def _gathered_through_backward(unit: Sequence[nn.Module]) -> None:
    """A unit of several modules kept gathered from its forward to its backward stays gathered through the backward
    of every call and reshards once that whole backward has run (if it synced the gradients: under a deferred sync it
    stays gathered to the window's last micro-batch, as every unit does). FSDP2 alone reshards after each call's
    backward: DiffusionGemma's shared layers were gathered again for the encoder's backward, and the last one
    prefetched once more (tests/families/diffusion_gemma/test_parallel_gemma.py counts them). The cost: the layers
    whose encoder backward has run stay gathered to the end, more memory at the peak for a faster step
    (docs/benchmarks/gemma_moe.md)."""
    module = unit[0]
    module.set_reshard_after_backward(False, recurse=False)
    settings = {"sync": True}
    _GATHERED_THROUGH_BACKWARD.update((member, settings) for member in unit)

    def reshard() -> None:  # once per call: after the first, a no-op
        if settings["sync"]:
            module.reshard()

    def hook_output(_, args, output) -> None:
        outputs = output if isinstance(output, (tuple, list)) else (output,)
        tensor = next((t for t in outputs if isinstance(t, torch.Tensor) and t.requires_grad), None)
        if tensor is not None:
            tensor.register_hook(lambda grad: compat.after_backward(reshard))

    for member in unit:
        member.register_forward_hook(hook_output)


def tied_groups(modules: Sequence[nn.Module]) -> list[list[nn.Module]]:
    """``modules`` grouped by the parameters they share (transitively), in the order of each group's first module."""
    groups: list[list[nn.Module]] = []
    params: list[set[int]] = []
    for module in modules:
        ids = {id(p) for p in module.parameters()}
        hits = [i for i, seen in enumerate(params) if seen & ids]
        if not hits:
            groups.append([module])
            params.append(ids)
            continue
        first = hits[0]
        for i in reversed(hits[1:]):
            groups[first] += groups.pop(i)
            params[first] |= params.pop(i)
        groups[first].append(module)
        params[first] |= ids
    return groups


# ------------------------------------------------------------------------------------------------------- export
def export_hf(model: nn.Module, strategy, path: str | Path, tokenizer=None, write=None) -> None:
    """Write ``model``'s transformers backbone as one Hugging Face directory (``save_pretrained``; and the
    ``tokenizer``, if given), reloadable with ``AutoModelForCausalLM.from_pretrained(path)``.

    Collective: call it on every rank. The full state dict is gathered (FSDP and expert shards alike) to the CPU of
    global rank 0, which writes it: ``write(backbone, state, path)`` when given (e.g. :func:`lit_dllm.lora.save_lora`),
    else ``backbone.save_pretrained(path, state_dict=state)``.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    prefix, backbone = hf_backbone(model)
    if device_meshes(strategy)[0] is None:  # every rank holds the whole model
        state = model.state_dict()
    else:
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def write_gathered() -> None:
        start = f"{prefix}." if prefix else ""
        whole = {key[len(start) :]: value.detach().cpu() for key, value in state.items() if key.startswith(start)}
        if write is None:
            backbone.save_pretrained(path, state_dict=whole)
        else:
            write(backbone, whole, path)
        if tokenizer is not None:
            tokenizer.save_pretrained(path)

    on_rank_zero(write_gathered)


def on_rank_zero(write: Callable[[], None]) -> None:
    """``write()`` on global rank 0 alone where a process group runs (every rank calls this and waits for rank 0: the
    files are whole when any rank goes on, and no two processes write one file), else just ``write()``."""
    distributed = dist.is_available() and dist.is_initialized()
    if not distributed or dist.get_rank() == 0:
        write()
    if distributed:
        dist.barrier()
