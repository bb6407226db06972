"""FSDP2 and expert parallelism (``lit_dllm.parallel``, ``lit_dllm.strategies``) on CPU, without a GPU.

Mesh arithmetic and the expert-gradient scale are checked without processes (pure functions, and one process
standing for a "fake" world of 4 to 16 ranks). Gloo processes then train a tiny Qwen3-MoE MDLM: two with FSDP2, with
FSDP2 + EP=2 (also with activation checkpointing), four with experts split over 2 ranks and sharded over their 2
copies. Each must follow the single-process run step by step; the EP run also resumes from a distributed checkpoint
and exports one Hugging Face directory. The last test runs the same through ``lightning.Trainer`` with
``ExpertParallelStrategy`` (``tests/multigpu/check_moe_parallel.py``, the GPU check, on its CPU path).
"""

from __future__ import annotations

import importlib
import os
import re
import socket
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

from torch.overrides import TorchFunctionMode

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.fsdp import FSDPModule
import yaml
from transformers import AutoConfig

from lit_dllm import (
    Backbone,
    BlockDiffusionGemmaModule,
    CausalBackbone,
    DenoisingGeneration,
    LLaDAGeneration,
    Optimization,
    Parallelism,
)
from lit_dllm.core.optim import build_optimization
from lit_dllm.families.mdlm.module import MDLMModule
from lit_dllm.hub.hf import check_config_keys
from lit_dllm.experts import experts_implementation, experts_kernels, experts_loop_reason
from lit_dllm.meshes import (
    DATA_PARALLEL,
    clip_grad_norm_,
    data_parallel_group,
    data_parallel_size,
    expert_gradient_divide_factor,
    grad_norm,
    scale_gradients_,
)
from lit_dllm.parallel import AutocastSafeAllToAllEP, export_hf, first_units, parallelize
from lit_dllm.strategies import (
    ExpertParallelStrategy,
    SingleDeviceStrategy,
    init_meshes,
    mesh_sizes,
    parallelize_model,
)
from lit_dllm.testing import TINY_DIFFUSION_GEMMA, TINY_LLAMA, TINY_MOE

from .core.test_training_step import EOS, MASK, PAD, VOCAB, collate, make_examples
from .processes import START_METHOD

ROOT = Path(__file__).resolve().parents[1]
GLOBAL_BATCH, STEPS, LR = 8, 4, 0.1
TOLERANCE = 1e-5


# ------------------------------------------------------------------------------ a tiny MoE MDLM and its reference



def momentum_sgd(groups, lr: float = LR) -> torch.optim.Optimizer:
    """SGD with momentum carries rounding differences forward linearly. AdamW divides each gradient by its running
    RMS, so the rounding of a near-zero component can flip its whole step: with a router choosing experts, runs that
    split the batch differently (DDP included) then leave each other's trajectory after some 10-20 steps."""
    return torch.optim.SGD(groups, lr=lr, momentum=0.9)


OPTIMIZATION = Optimization(lr=LR, weight_decay=0.0, warmup=0, min_lr_ratio=1.0, optimizer=momentum_sgd)
"""SGD with momentum at a constant LR (no warm-up, no decay)."""


def make_module(**kwargs) -> MDLMModule:
    """The tiny MoE MDLM, built (not sharded) with the same weights on every rank; :data:`OPTIMIZATION` unless
    ``kwargs`` say otherwise."""
    torch.manual_seed(0)
    settings = {
        "backbone": CausalBackbone(model_config=TINY_MOE), "optimization": OPTIMIZATION,
        "generation": LLaDAGeneration(val_generate_batches=0), **kwargs,
    }
    module = MDLMModule(vocab_size=VOCAB, mask_token_id=MASK, pad_token_id=PAD, eos_token_id=EOS, **settings)
    module.configure_model()
    return module


def make_optimizer(module: MDLMModule) -> torch.optim.Optimizer:
    """The optimizer ``configure_optimizers`` gives the module (its LR is constant: no warm-up, no decay)."""
    settings = module.optimization
    return build_optimization(
        module.model, STEPS, lr=settings.lr, weight_decay=settings.weight_decay, betas=tuple(settings.betas),
        warmup=settings.warmup, min_lr_ratio=settings.min_lr_ratio, optimizer=settings.optimizer,
    )["optimizer"]


def fake_strategy(world: int | None = None, ep: int = 1, **settings) -> SimpleNamespace:
    """What :func:`parallelize_model` reads of a strategy: the CPU meshes of ``world`` ranks with experts split over
    ``ep`` (none for ``world=None``: one device) and the run settings ``settings`` (``Parallelism``'s fields)."""
    meshes = vars(init_meshes(world, ep, "cpu")) if world else {}
    return SimpleNamespace(root_device=torch.device("cpu"), parallelism=Parallelism(**settings), **meshes)


def train(module, optimizer, steps, strategy=None, rank=0, clip=None) -> list[tuple[float, float]]:
    """(loss, gradient norm) of each step; step ``s`` is the whole example set under epoch-``s`` noise, split over
    the data-parallel ranks, each backward loss ``local sum / global count * data-parallel size``."""
    world = data_parallel_size(strategy)
    rows = make_examples(n=GLOBAL_BATCH)[rank::world]
    history = []
    for step in steps:
        batch = {key: value.to(module.device) for key, value in collate(rows).items()}
        noisy = module.prepare_batch(batch, module.noise_keys(batch, step))
        total = module.token_counts(batch, noisy)["diffusion"].float()
        if world > 1:
            dist.all_reduce(total, group=data_parallel_group(strategy))
        loss = module.compute_loss(batch, noisy, {"diffusion": total}).output.total_loss
        (loss * world).backward()
        loss = loss.detach()
        if world > 1:
            dist.all_reduce(loss, group=data_parallel_group(strategy))
        norm = clip_grad_norm_(module.model.parameters(), clip) if clip else grad_norm(module.model.parameters())
        optimizer.step()
        optimizer.zero_grad()
        history.append((float(loss), float(norm)))
    return history


def relative_differences(history, reference) -> list[float]:
    """Per step, the larger relative difference of the loss and of the gradient norm."""
    pairs = zip(history, reference, strict=True)
    return [max(abs(g - e) / abs(e) for g, e in zip(got, expected)) for got, expected in pairs]


def fsdp_param_groups(module: torch.nn.Module) -> list:
    """The FSDP2 parameter groups of a sharded module (torch >= 2.12 keeps a list, earlier versions one or None)."""
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        groups = [group] if (group := state._fsdp_param_group) is not None else []
    return list(groups)


def report_differences(history, reference, tolerance: float, marks: dict[int, str] | None = None) -> int:
    """Print each step's loss and gradient norm with their relative differences to ``reference`` and the verdict
    (the multi-GPU checks' output); 0 when every difference is within ``tolerance``, else 1."""
    marks = marks or {}
    print("step  loss          rel.diff   grad_norm     rel.diff")
    for step, ((loss, norm), (ref_loss, ref_norm)) in enumerate(zip(history, reference, strict=True)):
        loss_diff, norm_diff = abs(loss - ref_loss) / abs(ref_loss), abs(norm - ref_norm) / abs(ref_norm)
        print(f"{step:4d}  {loss:.8f}  {loss_diff:.2e}   {norm:.8f}  {norm_diff:.2e}{marks.get(step, '')}")
    worst = max(relative_differences(history, reference))
    passed = worst <= tolerance
    print(f"max relative difference {worst:.2e} (tolerance {tolerance:.0e}): {'PASS' if passed else 'FAIL'}")
    return 0 if passed else 1


@contextmanager
def one_thread():
    """Tiny matmuls on one thread: with more, a busy CI machine makes each of them wait for the others (100x)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def reference():
    with one_thread():
        module = make_module()
        history = train(module, make_optimizer(module), range(STEPS))
    return history, {name: value.detach().clone() for name, value in module.model.hf.state_dict().items()}


# ------------------------------------------------------------------------------------------------ mesh arithmetic
@pytest.mark.parametrize(
    ("world", "nodes", "dp", "ep", "expected"),
    [
        (8, 1, "auto", 1, (8, 1, 8)),
        (8, 1, "auto", 2, (8, 2, 4)),
        (8, 1, 8, 8, (8, 8, 1)),
        (16, 2, "auto", 8, (16, 8, 2)),
    ],
)
def test_mesh_sizes(world, nodes, dp, ep, expected):
    names = ("data_parallel", "expert_parallel", "expert_data_parallel")
    assert mesh_sizes(world, nodes, dp, ep) == {"tensor_parallel": 1, "context_parallel": 1,
                                                **dict(zip(names, expected))}


def test_context_parallelism_takes_the_data_parallel_size_down():
    sizes = mesh_sizes(8, 1, "auto", 2, context_parallel_size=4)
    assert (sizes["data_parallel"], sizes["context_parallel"], sizes["expert_data_parallel"]) == (2, 4, 4)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((8, 1, 1, 1), r"data_parallel_size=1 x context_parallel_size=1 x tensor_parallel_size=1 != world size 8"),
        ((8, 1, 8, 1, 2), r"data_parallel_size=8 x context_parallel_size=2 .* use 'auto' \(or 4\)"),
        ((8, 1, "auto", 1, 3), r"context_parallel_size=3 must divide the world size 8 .*\[1, 2, 4, 8\]"),
        ((2, 1, "auto", 1, 4), r"context_parallel_size=4 must divide the world size 2"),
        ((16, 2, 2, 1), r"world size 16 \(2 node\(s\) x 8 devices\): use 'auto'"),
        ((8, 1, "auto", 3), r"expert_parallel_size=3 must divide the world size 8.*\[1, 2, 4, 8\]"),
        ((8, 1, "auto", 0), r"expert_parallel_size=0"),
        ((8, 3, "auto", 1), r"world_size=8 must be a positive multiple of num_nodes=3"),
    ],
)
def test_mesh_sizes_reject_what_does_not_fit(args, message):
    with pytest.raises(ValueError, match=message):
        mesh_sizes(*args)


def strategy_configs() -> list[Path]:
    """The shipped configs whose strategy shards, ``ExpertParallelStrategy`` (mesh sizes to check)."""
    configs = {path: yaml.safe_load(path.read_text())["trainer"] for path in (ROOT / "configs").glob("*.yaml")}
    return sorted(path for path, trainer in configs.items() if isinstance(strategy := trainer.get("strategy"), dict)
                  and strategy["class_path"].rpartition(".")[2] == "ExpertParallelStrategy")


@pytest.mark.parametrize("config", strategy_configs(), ids=lambda path: path.name)
@pytest.mark.parametrize("nodes", [1, 2])
def test_every_shipped_strategy_fits_one_and_two_nodes_of_8_gpus(config, nodes):
    trainer = yaml.safe_load(config.read_text())["trainer"]
    module_name, _, name = trainer["strategy"]["class_path"].rpartition(".")
    assert getattr(importlib.import_module(module_name), name) is ExpertParallelStrategy
    strategy = ExpertParallelStrategy(**trainer["strategy"].get("init_args", {}))
    sizes = mesh_sizes(8 * nodes, nodes, strategy.requested_data_parallel_size, strategy.expert_parallel_size)
    assert sizes["data_parallel"] == 8 * nodes  # every GPU holds its own batch
    assert sizes["expert_parallel"] * sizes["expert_data_parallel"] == 8 * nodes
    backbone = yaml.safe_load(config.read_text())["model"]["init_args"].get("backbone") or {}
    model_config = dict(backbone.get("model_config") or {})
    assert model_config.get("num_experts", sizes["expert_parallel"]) % sizes["expert_parallel"] == 0
    if model_config:  # keys transformers' config class defines (typos would be silently ignored)
        check_config_keys(AutoConfig.for_model(model_config.pop("model_type"), **model_config), model_config)


def test_shipped_configs_with_a_strategy_are_found():
    assert {path.name for path in strategy_configs()} >= {"llada_8b_sft.yaml", "mdlm_moe_ep.yaml"}


# ------------------------------------------------------------------------------------ fake meshes (one process)
@pytest.fixture
def fake_world(request):
    """One process standing for rank 0 of a world of ``request.param`` ranks (no communication)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=request.param)
    yield request.param
    dist.destroy_process_group()


@pytest.mark.parametrize(("fake_world", "ep"), [(4, 2), (8, 2), (8, 8), (16, 2), (16, 8)], indirect=["fake_world"])
def test_expert_gradients_reduce_to_the_global_token_mean(fake_world, ep):
    """Simulate what reaches one expert: every rank's loss is ``local sum / N * D``; the all-to-all brings an EP
    group's tokens to the rank holding the expert, FSDP sums the expert's copies and divides by the factor."""
    strategy = init_meshes(fake_world, ep, "cpu")
    layout = strategy.expert_mesh.mesh  # [expert_data_parallel, expert_parallel] -> global rank
    assert sorted(layout.flatten().tolist()) == list(range(fake_world))  # the copies' EP groups partition the world
    d = data_parallel_size(strategy)
    local_sums = torch.rand(fake_world, dtype=torch.float64)  # d(local token-loss sum)/d(expert weight) per rank
    tokens = 1234.0
    per_copy = (local_sums * d / tokens)[layout.long()].sum(dim=1)  # all-to-all: one copy's gradient per EP group
    reduced = per_copy.sum() / expert_gradient_divide_factor(strategy)  # FSDP over the copies
    assert torch.isclose(reduced, local_sums.sum() / tokens)
    assert expert_gradient_divide_factor(strategy) == d == fake_world  # FSDP's default, D / ep, is ep x too small


@pytest.mark.parametrize(("fake_world", "ep"), [(8, 2), (8, 8)], indirect=["fake_world"])
def test_parallelize_shards_experts_over_their_own_mesh(fake_world, ep):
    module = make_module()
    strategy = init_meshes(fake_world, ep, "cpu")
    model = parallelize(module.model, strategy)
    experts = model.hf.model.layers[0].mlp.experts
    assert experts.gate_up_proj.device_mesh.mesh_dim_names == ("expert_data_parallel", "expert_parallel")
    local_experts = TINY_MOE["num_experts"] // fake_world  # split over ep, then FSDP over world / ep copies
    assert experts.gate_up_proj.to_local().shape[0] == local_experts and experts.num_experts == 8 // ep
    (group,) = fsdp_param_groups(experts)
    assert group.gradient_divide_factor == fake_world
    assert group.force_sum_reduction_for_comms == (fake_world // ep > 1)
    attention = model.hf.model.layers[0].self_attn.q_proj.weight
    assert attention.device_mesh.mesh_dim_names == (DATA_PARALLEL,)
    (dense,) = fsdp_param_groups(model.hf.model.layers[0])
    assert dense.gradient_divide_factor is None  # FSDP's own average over the data-parallel ranks
    assert data_parallel_group(strategy) is strategy.device_mesh[DATA_PARALLEL].get_group()


@pytest.mark.parametrize("fake_world", [2], indirect=True)
@pytest.mark.parametrize("precision", ["bf16-true", "bf16-mixed", "32-true"])
def test_fsdp_units_reduce_in_fp32_and_only_the_last_block_stays_gathered_after_forward(fake_world, precision):
    """Gradients are reduced in fp32 under every precision; only the last block skips the reshard after forward
    (its backward comes next)."""
    module = make_module()
    trainer = SimpleNamespace(precision=precision, strategy=fake_strategy(fake_world, compile=False))
    layers = parallelize_model(module.model, trainer).hf.model.layers
    for index, layer in enumerate(layers):
        (group,) = fsdp_param_groups(layer)
        assert group.mp_policy.reduce_dtype == torch.float32
        assert group.mp_policy.param_dtype == (None if precision == "32-true" else torch.bfloat16)
        assert (group.post_forward_mesh_info is None) == (index == len(layers) - 1)


@pytest.mark.parametrize("fake_world", [2], indirect=True)
def test_fsdp_reduce_dtype_bfloat16_reduces_every_unit_in_bf16(fake_world):
    """The root, every block and (under EP) the experts' own units."""
    module = make_module()
    strategy = fake_strategy(fake_world, 2, compile=False, fsdp_reduce_dtype="bfloat16")
    model = parallelize_model(module.model, SimpleNamespace(precision="bf16-true", strategy=strategy))
    units = [unit for unit in model.modules() if isinstance(unit, FSDPModule)]
    assert len(units) == 1 + 2 * len(model.hf.model.layers)  # the root, each block and its experts
    for unit in units:
        (group,) = fsdp_param_groups(unit)
        assert group.mp_policy.reduce_dtype == torch.bfloat16


def test_fsdp_reduce_dtype_names_the_choices():
    with pytest.raises(ValueError, match="fsdp_reduce_dtype='float16' is not a dtype .* use one of float32, bfloat16"):
        ExpertParallelStrategy(parallelism=Parallelism(fsdp_reduce_dtype="float16"))


@pytest.mark.parametrize("fake_world", [2], indirect=True)
def test_fsdp_reshard_after_forward_false_keeps_every_block_gathered(fake_world):
    module = make_module()
    strategy = fake_strategy(fake_world, compile=False, fsdp_reshard_after_forward=False)
    model = parallelize_model(module.model, SimpleNamespace(precision="bf16-mixed", strategy=strategy))
    for layer in model.hf.model.layers:
        (group,) = fsdp_param_groups(layer)
        assert group.post_forward_mesh_info is None


@pytest.mark.parametrize("fake_world", [2], indirect=True)
def test_first_units_are_the_root_and_the_first_block(fake_world):
    """What ``fsdp_prefetch_next_step`` gathers: the root (embedding, norm, head) and layer 0, not layer 0's experts
    (their own unit, inside it) or a later layer."""
    module = make_module()
    strategy = fake_strategy(fake_world, 2, compile=False)
    model = parallelize_model(module.model, SimpleNamespace(precision="bf16-mixed", strategy=strategy))
    layers = model.hf.model.layers
    assert isinstance(layers[0].mlp.experts, FSDPModule)  # expert parallelism: the experts are a unit of their own
    assert first_units(model) == [model, layers[0]]


@pytest.mark.parametrize("fake_world", [2], indirect=True)
def test_scale_gradients_multiplies_every_local_shard_in_place(fake_world):
    """Dense and expert DTensor gradients (two meshes) and a plain one, each scaled in place by the 0-dim tensor: the
    same DTensors, their local shards multiplied (the update reads these)."""
    module = make_module()
    model = parallelize(module.model, init_meshes(fake_world, 2, "cpu"))
    plain = torch.nn.Parameter(torch.ones(3))
    params = [*model.parameters(), plain]
    for index, param in enumerate(params):
        param.grad = torch.full_like(param, float(index + 1))
    grads = [param.grad for param in params]
    meshes = {getattr(grad, "device_mesh", None) for grad in grads}
    assert len(meshes) == 3  # the dense mesh, the experts' mesh, none
    scale_gradients_(params, torch.tensor(0.25))
    for index, (param, grad) in enumerate(zip(params, grads)):
        assert param.grad is grad
        local = grad.to_local() if hasattr(grad, "to_local") else grad
        assert torch.equal(local, torch.full_like(local, 0.25 * (index + 1))), index


@pytest.mark.parametrize(("setting", "value"), [("fsdp_reshard_after_forward", False),
                                              ("fsdp_defer_gradient_sync", True), ("fsdp_prefetch_next_step", True),
                                              ("fsdp_reduce_dtype", "bfloat16")])
def test_fsdp_settings_without_fsdp_warn(setting, value):
    module = make_module()
    trainer = SimpleNamespace(precision="bf16-mixed", strategy=fake_strategy(compile=False, **{setting: value}))
    with pytest.warns(UserWarning, match=re.escape(f"{setting}={value!r} does nothing under SimpleNamespace")):
        assert parallelize_model(module.model, trainer) is module.model


@pytest.mark.parametrize("fake_world", [8], indirect=True)
def test_parallelize_explains_experts_that_do_not_split(fake_world):
    module = make_module()
    module.model.hf.model.layers[0].mlp.experts.num_experts = 6  # as if the config had 6 experts
    with pytest.raises(ValueError, match="6 experts cannot be split evenly over expert_parallel_size=4"):
        parallelize(module.model, init_meshes(fake_world, 4, "cpu"))


def test_without_a_mesh_the_model_is_returned_unsharded():
    module = make_module()
    ddp = SimpleNamespace(world_size=4)  # DDP: no device mesh, every rank its own data
    assert parallelize(module.model, ddp) is module.model
    assert data_parallel_size(ddp) == 4 and data_parallel_group(ddp) is None
    assert not any(hasattr(p, "device_mesh") for p in module.model.parameters())
    parallelize(module.model, None, activation_checkpointing=True)
    assert all(layer.gradient_checkpointing for layer in module.model.hf.model.layers)


@pytest.mark.parametrize("fake_world", [2], indirect=True)
def test_a_dense_model_cannot_use_expert_parallelism(fake_world):
    module = MDLMModule(vocab_size=VOCAB, mask_token_id=MASK, backbone={"model_config": TINY_LLAMA})
    module.configure_model()
    with pytest.raises(ValueError, match="no transformers MoE experts.*set expert_parallel_size=1"):
        parallelize(module.model, init_meshes(fake_world, 2, "cpu"))


class SumInFloat32(TorchFunctionMode):
    """Runs ``sum`` in fp32, as CUDA autocast does (CPU autocast keeps bf16, so it cannot show this)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        return out.float() if func in (torch.sum, torch.Tensor.sum) else out


def test_a_rank_that_receives_no_tokens_returns_expert_outputs_in_the_tokens_dtype():
    """Its peers send bf16, so an fp32 (empty) output would make the combine all-to-all expect other byte counts
    (it hung NCCL on 2 x H100 under bf16-mixed); the empty rows still reach the backward graph."""
    dispatch = AutocastSafeAllToAllEP.__new__(AutocastSafeAllToAllEP)
    tokens = torch.zeros(0, 8, dtype=torch.bfloat16, requires_grad=True)
    dispatch._dispatch_tokens = lambda *inputs: (tokens, torch.zeros(0, 1, dtype=torch.long), tokens[:, :1], "state")
    dispatch.experts_forward = lambda rows, ids, weights: rows * weights
    dispatch._combine_tokens = lambda output, state: output
    with SumInFloat32():
        assert torch.ones(2, dtype=torch.bfloat16).sum().dtype == torch.float32  # the mode does what autocast does
        output = dispatch(None, None, None)
    assert output.shape == (0, 8) and output.dtype == torch.bfloat16 and output.requires_grad


# ------------------------------------------------------------------------------------------------ experts kernels
CPU, CUDA = SimpleNamespace(root_device=torch.device("cpu")), SimpleNamespace(root_device=torch.device("cuda", 0))


def train_start(module, device: torch.device, precision="32-true") -> None:
    """``SingleDeviceStrategy.on_train_start`` on ``device`` (not touched), ``module`` its model."""
    strategy = SingleDeviceStrategy()
    strategy.parallel_devices = [device]
    strategy.connect(module)
    module._trainer = SimpleNamespace(strategy=strategy, precision=precision)
    strategy.on_train_start()


def test_train_start_logs_what_runs_the_experts(caplog):
    module = make_module()
    with caplog.at_level("INFO"):
        train_start(module, CPU.root_device)
    assert "MoE experts (Qwen3MoeExperts): grouped_mm (8 experts, top-2)" in caplog.messages


def test_the_experts_of_block_diffusion_gemma_are_one_line_and_on_a_cpu_never_a_warning():
    """Encoder and decoder layers share their experts' config: one line. A CPU names the implementation, eager too."""
    module = BlockDiffusionGemmaModule(vocab_size=VOCAB, backbone=Backbone(model_config=TINY_DIFFUSION_GEMMA),
                                       generation=DenoisingGeneration(val_generate_batches=0))
    module.configure_model()
    strategy = fake_strategy(experts_implementation="eager")
    parallelize_model(module.model, SimpleNamespace(precision="32-true", strategy=strategy))
    stack = module.model.hf.model
    layers = [*stack.encoder.language_model.layers, *stack.decoder.layers]
    assert {experts_implementation(layer.experts) for layer in layers} == {"eager"}
    line = "MoE experts (DiffusionGemmaTextExperts): eager (4 experts, top-2)"
    assert experts_kernels(module.model, CPU) == [(line, None)]


def test_on_cuda_experts_in_float32_are_a_warning_that_names_the_reason_and_the_fix(monkeypatch):
    """An H100 (simulated), bf16-mixed: one device keeps fp32 weights (a loop over the experts); FSDP2 gathers them in
    bf16 (torch's grouped GEMM kernel)."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    module = make_module()
    with pytest.warns(UserWarning, match=r"grouped_mm \(8 experts, top-2\) loops over the experts on this GPU: "
                                         r"the expert weights are float32 .* precision bf16-true"):
        train_start(module, CUDA.root_device, "bf16-mixed")
    sharded = SimpleNamespace(root_device=CUDA.root_device, device_mesh=object())
    assert experts_kernels(module.model, sharded, torch.bfloat16) == [
        ("MoE experts (Qwen3MoeExperts): grouped_mm (8 experts, top-2)", None)
    ]


@pytest.mark.parametrize(("implementation", "dtype", "capability", "expected"), [
    ("grouped_mm", torch.bfloat16, (9, 0), None),  # H100, H200: torch's CUTLASS kernel
    ("grouped_mm", torch.bfloat16, (10, 0), None),  # B200
    ("batched_mm", torch.float32, (8, 0), None),  # one bmm, not a loop
    ("eager", torch.bfloat16, (9, 0), r"experts_implementation='eager' is a Python loop; set "
                                     r"experts_implementation='grouped_mm'"),
    ("grouped_mm", torch.float32, (9, 0), r"weights are float32 .* takes bfloat16 only .* bf16-true"),
    ("grouped_mm", torch.float16, (9, 0), r"weights are float16"),
    ("grouped_mm", torch.bfloat16, (8, 0), r"compute capability 9.x or 10.x .* this one is 8.0"),
])
def test_experts_loop_reason(implementation, dtype, capability, expected):
    reason = experts_loop_reason(implementation, dtype, capability)
    assert reason is None if expected is None else re.search(expected, reason), reason


def test_experts_implementation_is_a_strategy_setting_checked_by_transformers():
    def run(module, implementation: str) -> None:
        strategy = fake_strategy(experts_implementation=implementation)
        parallelize_model(module.model, SimpleNamespace(precision="32-true", strategy=strategy))

    module = make_module()
    run(module, "batched_mm")
    assert module.model.hf.get_experts_implementation() == {"": "batched_mm"}
    with pytest.raises(ValueError, match='experts_implementation="fastest"` is not supported'):
        run(make_module(), "fastest")
    dense = MDLMModule(vocab_size=VOCAB, mask_token_id=MASK, backbone=CausalBackbone(model_config=TINY_LLAMA))
    dense.configure_model()
    with pytest.raises(ValueError, match="experts_implementation='eager', but DiffusionLM has no transformers MoE"):
        run(dense, "eager")


# ------------------------------------------------------------------------------------------ two gloo processes
def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _distributed_checkpoint(module, optimizer, path: Path, save: bool) -> None:
    """Save or restore the sharded model and optimizer state with torch.distributed.checkpoint (as Lightning does)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optimizer_state = get_state_dict(module.model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    if save:
        dcp.save(state, checkpoint_id=path)
        return
    dcp.load(state, checkpoint_id=path)
    set_state_dict(module.model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def _sharded(strategy, **options) -> tuple[MDLMModule, torch.optim.Optimizer]:
    module = make_module()
    parallelize(module.model, strategy, **options)
    return module, make_optimizer(module)


@contextmanager
def _gloo_group(rank: int, world: int, port: int):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        with one_thread():
            yield
    finally:
        dist.destroy_process_group()


def _two_rank_worker(rank: int, world: int, port: int, out: str) -> None:
    """FSDP2 and FSDP2 + EP=2 runs (and EP with activation checkpointing, and kept gathered); the EP run saves a
    distributed checkpoint halfway, a fresh model resumes from it, and the finished EP model is exported. Rank 0 saves
    the histories."""
    out, half, results = Path(out), STEPS // 2, {}
    with _gloo_group(rank, world, port):
        fsdp, ep2 = init_meshes(world, 1, "cpu"), init_meshes(world, 2, "cpu")
        module, optimizer = _sharded(fsdp)
        results["fsdp2"] = train(module, optimizer, range(STEPS), fsdp, rank)
        module, optimizer = _sharded(ep2, activation_checkpointing=True)
        results["fsdp2+ep2+checkpointing"] = train(module, optimizer, range(half), ep2, rank)
        module, optimizer = _sharded(ep2, reshard_after_forward=False)
        results["fsdp2+ep2, kept gathered"] = train(module, optimizer, range(half), ep2, rank)
        module, optimizer = _sharded(ep2)
        results["fsdp2+ep2"] = train(module, optimizer, range(half), ep2, rank)
        _distributed_checkpoint(module, optimizer, out / "checkpoint", save=True)
        results["fsdp2+ep2"] += train(module, optimizer, range(half, STEPS), ep2, rank)
        export_hf(module.model, ep2, out / "hf")
        module, optimizer = _sharded(ep2)
        _distributed_checkpoint(module, optimizer, out / "checkpoint", save=False)
        results["resumed"] = train(module, optimizer, range(half, STEPS), ep2, rank)
        weights = {dtype: _bf16_weights_after_two_steps(fsdp, rank, dtype) for dtype in (torch.float32, torch.bfloat16)}
        results["bf16 reduce"] = [torch.equal(*pair) for pair in zip(weights[torch.float32], weights[torch.bfloat16])]
        if rank == 0:
            torch.save(results, out / "results.pt")


def _bf16_weights_after_two_steps(strategy, rank: int, reduce_dtype: torch.dtype) -> list[torch.Tensor]:
    """The whole weights after two steps of the model in bf16 (bf16-true) under FSDP2, reducing in ``reduce_dtype``."""
    module = make_module()
    module.model.to(torch.bfloat16)
    parallelize(module.model, strategy, param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)
    train(module, make_optimizer(module), range(2), strategy, rank)
    return [param.full_tensor() for param in module.model.parameters()]


def _four_rank_worker(rank: int, world: int, port: int, out: str) -> None:
    """FSDP2 over 4 ranks with experts split over 2 and FSDP-sharded over their 2 copies (a summed reduce-scatter
    divided by 4): two steps."""
    with _gloo_group(rank, world, port):
        meshes = init_meshes(world, 2, "cpu")
        module, optimizer = _sharded(meshes)
        history = train(module, optimizer, range(STEPS // 2), meshes, rank)
        if rank == 0:
            torch.save({"dp4+ep2": history}, Path(out) / "results.pt")


def _spawn(worker, world: int, out: Path, *args) -> dict:
    """``worker(rank, world, port, out, *args)`` on ``world`` ranks; what rank 0 saved to ``out/results.pt``."""
    mp.start_processes(worker, args=(world, _free_port(), str(out), *args), nprocs=world, start_method=START_METHOD)
    return torch.load(out / "results.pt")


@pytest.fixture(scope="module")
def gloo_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("gloo")
    return _spawn(_two_rank_worker, 2, out), out


def test_four_processes_with_two_expert_copies_follow_the_single_process_run(tmp_path, reference):
    history = _spawn(_four_rank_worker, 4, tmp_path)["dp4+ep2"]
    differences = relative_differences(history, reference[0][: len(history)])
    assert max(differences) < TOLERANCE, differences


@pytest.mark.parametrize("run", ["fsdp2", "fsdp2+ep2", "fsdp2+ep2+checkpointing", "fsdp2+ep2, kept gathered"])
def test_two_processes_follow_the_single_process_run(gloo_runs, reference, run):
    history, _ = gloo_runs
    differences = relative_differences(history[run], reference[0][: len(history[run])])
    assert max(differences) < TOLERANCE, differences


def test_bf16_true_over_two_ranks_reduces_the_same_in_bf16_as_in_fp32(gloo_runs):
    """``fsdp_reduce_dtype: bfloat16`` under bf16 weights: over two ranks each gradient sum rounds to bf16 once either
    way, so two steps leave every weight bit for bit where the fp32 reduction leaves it."""
    history, _ = gloo_runs
    assert history["bf16 reduce"] and all(history["bf16 reduce"])


def test_expert_parallel_run_resumes_from_its_distributed_checkpoint(gloo_runs):
    history, _ = gloo_runs
    assert max(relative_differences(history["resumed"], history["fsdp2+ep2"][STEPS // 2 :])) < 1e-6


def test_expert_parallel_model_exports_one_hugging_face_directory(gloo_runs, reference):
    from transformers import AutoModelForCausalLM

    _, out = gloo_runs
    exported = AutoModelForCausalLM.from_pretrained(out / "hf")
    assert not exported.config.is_causal  # the bidirectional denoiser, as trained
    state = exported.state_dict()
    assert state.keys() == reference[1].keys()
    for name, expected in reference[1].items():
        torch.testing.assert_close(state[name], expected, rtol=0, atol=1e-5, msg=name)  # full experts, not shards


@pytest.mark.parametrize("defer_sync", [False, True], ids=["synced", "deferred+prefetch"])
def test_lightning_trainer_with_expert_parallel_strategy(tmp_path, defer_sync):
    """Two CPU processes under torchrun: ExpertParallelStrategy(expert_parallel_size=2), accumulate_grad_batches=2,
    stop halfway and resume from the sharded checkpoint; every step's logged loss and gradient norm must equal the
    single-process reference, and each optimizer step must run one reduce-scatter per sharded FSDP2 unit and
    micro-batch, or per unit alone with ``fsdp_defer_gradient_sync``. The second case also sets
    ``fsdp_prefetch_next_step``: two all-gathers (the root's, the first block's) start between optimizer steps, where
    the first has none (the script exits non-zero otherwise)."""
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
        "tests/multigpu/check_moe_parallel.py", "--accelerator=cpu", "--mode=ep", "--steps=4", "--resume-at=2",
        "--accumulate=2", f"--workdir={tmp_path}", *(["--defer-sync", "--prefetch"] if defer_sync else []),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    per_group = 1 if defer_sync else 2  # 3 sharded units: 2 blocks and the root (the experts' mesh is 1 rank)
    assert f"all-gathers between optimizer steps ({2 if defer_sync else 0} expected): [{2 if defer_sync else 0}]: PASS" in (
        result.stdout)
    assert f"(FSDP2 parameter groups x {per_group}): [({3 * per_group}, 3)] as (counted, groups): PASS" in result.stdout
    assert "(tolerance 1e-05): PASS" in result.stdout
