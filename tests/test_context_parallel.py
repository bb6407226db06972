"""Context parallelism (``lit_dllm.context_parallel``) on CPU gloo processes: its two attention schemes (Ulysses,
all-gathered keys and values) and the sharded step against one process, within 1e-6 in float64 and 1e-5 in float32.

Each multi-process test starts its ranks once (``tests.test_parallel._spawn``); every rank compares its own shard
with the single-process result and the largest difference over the ranks comes back.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from transformers import AutoConfig
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from lit_dllm import (
    Backbone,
    BlockDiffusionGemmaModule,
    CausalBackbone,
    DDPStrategy,
    DenoisingGeneration,
    DFlashGeneration,
    DFlashModule,
    DiffuGRPOModule,
    ExpertParallelStrategy,
    LLaDAGeneration,
    Parallelism,
    SingleDeviceStrategy,
)
from lit_dllm.attention import document_mask
from lit_dllm.cli import main
from lit_dllm.core.trace import run_scalars
from lit_dllm.context_parallel import (
    ATTENTION_FUNCTIONS,
    MASKED_SCHEMES,
    SCHEMES,
    ContextParallel,
    apply_context_parallel,
    causal_block_mask,
    check_context_parallel,
)
from lit_dllm.data.batch import document_inputs
from lit_dllm.families.mdlm.module import HybridMDLMModule
from lit_dllm import parallel
from lit_dllm.parallel import parallelize
from lit_dllm.strategies import init_meshes
from lit_dllm.testing import TINY_DFLASH_DRAFT, TINY_DIFFUSION_GEMMA, TINY_LLAMA, TINY_MOE

from .families.dflash import test_packing as dflash_packing
from .families.test_packing import collators, documents
from .families.test_packing import make_module as make_packing_module
from .test_parallel import _gloo_group, _spawn
from .test_strategies import RUN, train_py

TOLERANCES = {torch.float64: 1e-6, torch.float32: 1e-5}
MASKS = ("bidirectional", "causal", "documents")
ATTENTION_CASES = [(scheme, mask) for scheme in SCHEMES for mask in MASKS
                   if scheme in MASKED_SCHEMES or mask != "documents"]
"""Every scheme with every mask it takes (``ring`` takes no mask: bidirectional and causal rows)."""


# ------------------------------------------------------------------------------------------------ the primitive
class Heads(nn.Module):
    """What transformers' attention functions read of an attention layer (GQA: 4 query heads over 2 KV heads)."""

    num_key_value_groups = 2
    is_causal = True


def attention_inputs(dtype: torch.dtype, length: int = 8, dim: int = 8, device: str = "cpu") -> dict:
    """Queries, keys, values and the output's weights of two rows of ``dim``-wide heads; the rows' documents (3 + 5
    and 6 + 2 eighths of the row)."""
    g = torch.Generator().manual_seed(0)
    shapes = {"query": (2, 4, length, dim), "key": (2, 2, length, dim), "value": (2, 2, length, dim),
              "weights": (2, length, 4, dim)}
    inputs = {name: torch.randn(shape, generator=g, dtype=dtype) for name, shape in shapes.items()}
    eighth = length // 8
    inputs["documents"] = torch.tensor([[0] * 3 * eighth + [1] * 5 * eighth, [0] * 6 * eighth + [1] * 2 * eighth])
    return {name: tensor.to(device) for name, tensor in inputs.items()}


def attend(inputs: dict, mask: str, context: ContextParallel | None, scheme: str = "ulysses",
           attention: str = "sdpa") -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The attention output (this rank's shard of the positions under ``context``, by ``scheme``, with the context's
    attention inside; else ``attention`` on the whole rows) and the gradients of the queries, keys and values (their
    shards) of ``Σ weights · output``. FlexAttention takes causal rows as a block mask, SDPA as a flag."""
    module = Heads()
    tensors = [inputs[name].clone() for name in ("query", "key", "value")]
    weights = inputs["weights"]
    attention = attention if context is None else context.attention
    kwargs = {"is_causal": mask == "causal", "scaling": tensors[0].shape[-1] ** -0.5, "dropout": 0.0}
    additive = document_mask(inputs["documents"], False, attention, weights.dtype) if mask == "documents" else None
    if context is None:
        function = ALL_ATTENTION_FUNCTIONS[attention]
        if attention == "flex_attention" and mask == "causal":
            additive = causal_block_mask(weights.shape[1], weights.device)
    else:
        module.context_parallel, function = context, ATTENTION_FUNCTIONS[scheme]
        tensors = [context.take(t.transpose(1, 2)).transpose(1, 2) for t in tensors]
        weights = context.take(weights)
    tensors = [t.requires_grad_() for t in tensors]
    output, _ = function(module, *tensors, additive, **kwargs)
    (output * weights).sum().backward()
    return output.detach(), [t.grad for t in tensors]


def shards(context: ContextParallel, output: torch.Tensor, grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """One process's attention output and gradients of queries, keys and values (:func:`attend` on whole rows) cut to
    this rank's shard of the positions."""
    return [context.take(output)] + [context.take(g.transpose(1, 2)).transpose(1, 2) for g in grads]


def attention_difference(inputs: dict, mask: str, context: ContextParallel, scheme: str) -> float:
    """The largest difference, over the ranks, of the output and gradients of this rank's shard under ``context`` from
    those of one process running the same attention on the whole rows."""
    output, grads = attend(inputs, mask, context, scheme)
    pairs = zip([output, *grads], shards(context, *attend(inputs, mask, None, attention=context.attention)))
    difference = torch.stack([(got - want).abs().max() for got, want in pairs]).max()
    dist.all_reduce(difference, op=dist.ReduceOp.MAX)
    return float(difference)


def _attention_worker(rank: int, world: int, port: int, out: str) -> None:
    """Every scheme, mask and dtype: the largest difference of this rank's shard from one process's attention."""
    with _gloo_group(rank, world, port):
        context = ContextParallel.of(init_device_mesh("cpu", (world,), mesh_dim_names=("context_parallel",)))
        worst = {}
        for dtype in TOLERANCES:
            inputs = attention_inputs(dtype)
            for scheme, mask in ATTENTION_CASES:
                worst[scheme, mask, dtype] = attention_difference(inputs, mask, context, scheme)
        if rank == 0:
            torch.save(worst, Path(out) / "results.pt")


@pytest.fixture(scope="module")
def attention_differences(tmp_path_factory):
    return _spawn(_attention_worker, 2, tmp_path_factory.mktemp("ulysses"))


@pytest.mark.parametrize("dtype", list(TOLERANCES), ids=str)
@pytest.mark.parametrize(("scheme", "mask"), ATTENTION_CASES)
def test_context_parallel_attention_over_two_processes_equals_one_process(attention_differences, scheme, mask, dtype):
    """Outputs and the gradients of queries, keys and values (GQA), bidirectional, causal and per document."""
    assert attention_differences[scheme, mask, dtype] < TOLERANCES[dtype], attention_differences


# ---------------------------------------------------------------------------------------------- the sharded step
FAMILIES = ("mdlm", "hybrid", "ar")
LAYOUTS = ("rows", "packed")
OPTIONS = {"plain": ({}, 1, {}), "checkpointing": ({}, 1, {"activation_checkpointing": True}),
           "experts": (TINY_MOE, 2, {}), "compiled": ({}, 1, {"compile": True}),
           "all_gather": ({}, 1, {"context_parallel_attention": "all_gather"}),
           "all_gather_checkpointing": ({}, 1, {"context_parallel_attention": "all_gather",
                                                "activation_checkpointing": True}),
           "all_gather_compiled": ({}, 1, {"context_parallel_attention": "all_gather", "compile": True}),
           "one_kv_head": ({"num_key_value_heads": 1}, 1, {"context_parallel_attention": "all_gather"}),
           "ring": ({}, 1, {"context_parallel_attention": "ring"}),
           "ring_checkpointing": ({}, 1, {"context_parallel_attention": "ring", "activation_checkpointing": True}),
           "ring_compiled": ({}, 1, {"context_parallel_attention": "ring", "compile": True}),
           "ring_one_kv_head": ({"num_key_value_heads": 1}, 1, {"context_parallel_attention": "ring"})}
"""Each case's model config (over the tiny Llama), expert-parallel size and :func:`~lit_dllm.parallel.parallelize`
options, besides context parallelism and FSDP2."""


def family_batch(name: str, layout: str, part: slice = slice(None)) -> dict:
    """The packing tests' documents, one a row (padded to 16) or packed (rows of 24); ``part`` of the rows."""
    plain, packed = collators(name)
    rows = documents()
    if layout == "packed":
        return packed(rows[part])
    plain.pad_seq_len_divisible = 16
    return plain([doc for row in rows for doc in row][part])


def family_module(name: str, dtype: torch.dtype, meshes=None, config: dict | None = None, attn: str = "sdpa",
                  **options):
    """The packing tests' module of family ``name`` (its model ``config`` over the tiny Llama) on ``attn`` in
    ``dtype``; parallelized over ``meshes`` (with :func:`~lit_dllm.parallel.parallelize`'s ``options``) when given."""
    module = make_packing_module(name, attn=attn, **(config or {}))
    module.model.to(dtype)
    if meshes is not None:
        parallelize(module.model, meshes, **options)
    return module


def run_step(module, batch: dict, strategy) -> tuple[dict[str, float], dict[str, torch.Tensor], torch.Tensor]:
    """One ``training_step`` (its sharding and normalisation) and backward: what the step logs, summed over all ranks
    (the loss, the token counts), the whole gradients, and the logits of this rank's positions (the family's
    attention: bidirectional, or causal for the hybrid's causal pass and CausalLM)."""
    module._trainer = SimpleNamespace(accumulate_grad_batches=1, strategy=strategy, current_epoch=3)
    module.training_step(batch, 0).backward()
    names = sorted(module._window)
    logged = dict(zip(names, module._group_sum(torch.stack([module._window[k] for k in names])).tolist()))
    grads = {name: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
             for name, p in module.model.named_parameters()}
    shard, _ = module.shard_sequences(batch, {})
    causal = {"causal": True} if isinstance(module, HybridMDLMModule) else {}
    with torch.no_grad():
        logits = module.model(shard["input_ids"], **document_inputs(shard), **causal)
    return logged, grads, logits


def compare(got: tuple, expected: tuple, context: ContextParallel, rows: slice) -> float:
    """The largest relative difference of the logged sums (loss, token counts), gradients and logits (this rank's
    ``rows`` and positions)."""
    (logged, grads, logits), (ref_logged, ref_grads, ref_logits) = got, expected
    scale = ref_logits.abs().max()
    differences = [abs(logged[k] - v) / max(abs(v), 1e-30) for k, v in ref_logged.items()]
    differences.append((logits - context.take(ref_logits[rows])).abs().max() / scale)
    differences += [(grads[name] - g).abs().max() / g.abs().max().clamp_min(1e-30) for name, g in ref_grads.items()]
    return float(max(differences))


def _step_worker(rank: int, world: int, port: int, out: str, context_parallel: int, dtypes: list) -> None:
    """Every family, layout and dtype: one step under data x context against one process on the whole batch."""
    parallel.COMPILE_BACKEND = "eager"  # dynamo's tracing without inductor's C++ build (as tests/test_compile.py)
    with _gloo_group(rank, world, port):
        meshes = {ep: init_meshes(world, ep, "cpu", context_parallel) for ep in (1, 2)}
        data = meshes[1].device_mesh["data_parallel"]
        worst, rows = {}, slice(data.get_local_rank(), None, data.size())
        cases = [(name, layout, dtype, "plain") for dtype in dtypes for name in FAMILIES for layout in LAYOUTS]
        cases += [("hybrid", "packed", dtypes[0], "checkpointing"), ("mdlm", "rows", torch.float32, "experts"),
                  ("hybrid", "rows", dtypes[0], "compiled"), ("mdlm", "rows", dtypes[0], "one_kv_head"),
                  ("hybrid", "packed", dtypes[0], "all_gather_checkpointing"),
                  ("hybrid", "rows", dtypes[0], "all_gather_compiled")]
        cases += [(name, layout, dtype, "all_gather") for dtype in dtypes for name in FAMILIES for layout in LAYOUTS]
        cases += [(name, "rows", dtype, "ring") for dtype in dtypes for name in FAMILIES]
        cases += [("hybrid", "rows", dtypes[0], "ring_checkpointing"), ("hybrid", "rows", dtypes[0], "ring_compiled"),
                  ("mdlm", "rows", dtypes[0], "ring_one_kv_head")]
        for name, layout, dtype, options in cases:
            config, ep, settings = OPTIONS[options]
            reference = run_step(family_module(name, dtype, config=config), family_batch(name, layout),
                                 SimpleNamespace(world_size=1))
            module = family_module(name, dtype, meshes[ep], config, **settings)
            got = run_step(module, family_batch(name, layout, rows), meshes[ep])
            difference = torch.tensor(compare(got, reference, module.model.context_parallel, rows))
            dist.all_reduce(difference, op=dist.ReduceOp.MAX)
            worst[name, layout, dtype, options] = float(difference)
        if rank == 0:
            torch.save(worst, Path(out) / "results.pt")


@pytest.fixture(scope="module")
def context_2(tmp_path_factory):
    return _spawn(_step_worker, 2, tmp_path_factory.mktemp("cp2"), 2, list(TOLERANCES))


@pytest.mark.parametrize("dtype", list(TOLERANCES), ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", FAMILIES)
def test_context_parallel_step_over_two_processes_equals_one_process(context_2, name, layout, dtype):
    """Loss, gradients and logits of MDLM (bidirectional), hybrid (its causal pass too) and CausalLM (causal), on
    padded rows and on packed rows (per-document attention), under FSDP2 over the context group."""
    assert context_2[name, layout, dtype, "plain"] < TOLERANCES[dtype], context_2


@pytest.mark.parametrize("dtype", list(TOLERANCES), ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", FAMILIES)
def test_all_gathered_keys_and_values_step_over_two_processes_equals_one_process(context_2, name, layout, dtype):
    """The same under ``context_parallel_attention: all_gather``: each rank's queries against the whole sequence's
    keys and values, its rows of the whole mask (the causal rows built where the model passes none)."""
    assert context_2[name, layout, dtype, "all_gather"] < TOLERANCES[dtype], context_2


@pytest.mark.parametrize("dtype", list(TOLERANCES), ids=str)
@pytest.mark.parametrize("name", FAMILIES)
def test_ring_attention_step_over_two_processes_equals_one_process(context_2, name, dtype):
    """The same under ``context_parallel_attention: ring`` (torch's ring attention: each rank's queries against every
    shard's keys and values in turn, the CPU's flash kernel each step) on padded rows: bidirectional (MDLM), causal
    (the hybrid's causal pass, CausalLM)."""
    assert context_2[name, "rows", dtype, "ring"] < TOLERANCES[dtype], context_2


@pytest.mark.parametrize("case", ["ring_checkpointing", "ring_compiled", "ring_one_kv_head"])
def test_ring_attention_composes_and_takes_any_head_count(context_2, case):
    """Ring attention under activation checkpointing, in compiled blocks, and over one KV head (multi-query)."""
    name = "mdlm" if case == "ring_one_kv_head" else "hybrid"
    assert context_2[name, "rows", torch.float64, case] < TOLERANCES[torch.float64], context_2


def test_ring_attention_refuses_a_mask_and_packed_rows_naming_the_schemes_that_take_them():
    context = ContextParallel(None, 0, 2, scheme="ring")
    module = Heads()
    module.context_parallel = context
    inputs = attention_inputs(torch.float32)
    mask = torch.zeros(2, 1, 4, 8)
    with pytest.raises(ValueError, match=r"context_parallel_attention='ring' takes no attention mask, and Heads was "
                                         r"given one of shape \(2, 1, 4, 8\): set context_parallel_attention to one "
                                         r"of ulysses, all_gather"):
        ring = ATTENTION_FUNCTIONS["ring"]
        ring(module, inputs["query"], inputs["key"], inputs["value"], mask)
    module = family_module("mdlm", torch.float32)
    module.model.context_parallel = context
    batch = family_batch("mdlm", "packed")
    with pytest.raises(ValueError, match=r"context_parallel_attention='ring' takes no attention mask, and packed rows "
                                         r"attend per document: set context_parallel_attention to one of ulysses, "
                                         r"all_gather, or collation.pack: false"):
        module.shard_sequences(batch, module.prepare_batch(batch, module.noise_keys(batch, 0)))


def test_all_gather_runs_a_model_whose_kv_heads_ulysses_cannot_split(context_2):
    """One KV head (multi-query attention) over 2 ranks: Ulysses refuses it, all-gathered keys and values are exact."""
    config = AutoConfig.for_model(**{**TINY_LLAMA, "num_key_value_heads": 1}, vocab_size=40)
    config._attn_implementation = "sdpa"
    with pytest.raises(ValueError, match=r"num_key_value_heads=1 is not divisible .* context_parallel_attention: "
                                         r"all_gather"):
        check_context_parallel(config, 2)
    check_context_parallel(config, 2, "all_gather")
    assert context_2["mdlm", "rows", torch.float64, "one_kv_head"] < TOLERANCES[torch.float64], context_2


@pytest.mark.parametrize("case", ["checkpointing", "all_gather_checkpointing"])
def test_activation_checkpointing_recomputes_context_parallel_attention_exactly(context_2, case):
    """The hybrid on packed rows with every block recomputed in the backward (its collectives run again there)."""
    assert context_2["hybrid", "packed", torch.float64, case] < TOLERANCES[torch.float64], context_2


@pytest.mark.parametrize("case", ["compiled", "all_gather_compiled"])
def test_compiled_blocks_run_context_parallel_attention_exactly(context_2, case):
    """Each block's forward compiled (dynamo; the collectives run between its graphs): the hybrid's two passes."""
    assert context_2["hybrid", "rows", torch.float64, case] < TOLERANCES[torch.float64], context_2


def test_context_parallelism_composes_with_expert_parallelism(context_2):
    """A tiny Qwen3-MoE MDLM with its experts split over the same 2 ranks (each rank's shard of the positions reaches
    the experts by all-to-all; expert gradients divided by data x context), in float32 (transformers' grouped GEMM
    takes no float64)."""
    assert context_2["mdlm", "rows", torch.float32, "experts"] < TOLERANCES[torch.float32], context_2


def test_data_2_x_context_2_over_four_processes_equals_one_process(tmp_path):
    """Every case above, each data-parallel pair of ranks on its own rows."""
    worst = _spawn(_step_worker, 4, tmp_path, 2, list(TOLERANCES))
    assert all(difference < TOLERANCES[case[2]] for case, difference in worst.items()), worst


# ------------------------------------------------------------------------------------------------------- DFlash
def dflash_module(dtype: torch.dtype, meshes=None, **options):
    """The DFlash packing tests' tiny module (target and draft on SDPA, 4 blocks a row or a document) in ``dtype``;
    parallelized over ``meshes`` when given."""
    module = dflash_packing.dflash(target=CausalBackbone(model_config=dict(TINY_LLAMA), attn_implementation="sdpa"),
                                   attn_implementation="sdpa", num_anchors=4)
    module.model.to(dtype)
    if meshes is not None:
        parallelize(module.model, meshes, **options)
    return module


def dflash_batch(layout: str, part: slice = slice(None)) -> dict:
    """The DFlash packing tests' documents, one a row (padded to 16) or packed (rows of 24); ``part`` of the rows."""
    plain, packed = dflash_packing.collators()
    rows = dflash_packing.documents()
    if layout == "packed":
        return packed(rows[part])
    plain.pad_seq_len_divisible = 16
    return plain([doc for row in rows for doc in row][part])


def dflash_step(module, batch: dict, strategy) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    """One ``training_step`` and backward: what it logs summed over the ranks, and the draft's whole gradients."""
    module._trainer = SimpleNamespace(accumulate_grad_batches=1, strategy=strategy, current_epoch=3)
    module.training_step(batch, 0).backward()
    names = sorted(module._window)
    logged = dict(zip(names, module._group_sum(torch.stack([module._window[k] for k in names])).tolist()))
    grads = {name: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
             for name, p in module.model.named_parameters() if p.grad is not None}
    return logged, grads


DFLASH_CASES = [(scheme, layout, dtype) for scheme in SCHEMES for layout in LAYOUTS for dtype in TOLERANCES
                if scheme in MASKED_SCHEMES or layout == "rows"]
"""Every scheme with each layout it takes (``ring``: padded rows), in each dtype."""


def _dflash_worker(rank: int, world: int, port: int, out: str) -> None:
    """Every scheme, layout and dtype it takes: a DFlash step over data x context against one process."""
    with _gloo_group(rank, world, port):
        meshes = init_meshes(world, 1, "cpu", 2)
        data = meshes.device_mesh["data_parallel"]
        rows, worst = slice(data.get_local_rank(), None, data.size()), {}
        for scheme, layout, dtype in DFLASH_CASES:
            reference = dflash_module(dtype), dflash_batch(layout), SimpleNamespace(world_size=1)
            ref_logged, ref_grads = dflash_step(*reference)
            module = dflash_module(dtype, meshes, context_parallel_attention=scheme)
            logged, grads = dflash_step(module, dflash_batch(layout, rows), meshes)
            differences = [abs(logged[k] - v) / max(abs(v), 1e-30) for k, v in ref_logged.items()]
            differences += [(grads[k] - g).abs().max() / g.abs().max().clamp_min(1e-30) for k, g in ref_grads.items()]
            difference = torch.tensor(float(max(differences)))
            dist.all_reduce(difference, op=dist.ReduceOp.MAX)
            worst[scheme, layout, dtype] = float(difference)
            worst["grads", scheme, layout, dtype] = (len(grads), len(ref_grads))
        if rank == 0:
            torch.save(worst, Path(out) / "results.pt")


@pytest.fixture(scope="module")
def dflash_context_2(tmp_path_factory):
    return _spawn(_dflash_worker, 2, tmp_path_factory.mktemp("dflash_cp2"))


@pytest.mark.parametrize(("scheme", "layout", "dtype"), DFLASH_CASES)
def test_dflash_target_on_shards_and_draft_on_a_share_of_the_blocks_equals_one_process(dflash_context_2, scheme,
                                                                                        layout, dtype):
    """The target's features from shards of the positions, gathered; each rank's draft on half of every row's blocks
    (drawn on the whole rows): the logged sums (loss, targets, blocks) and every draft gradient of one process."""
    got, expected = dflash_context_2["grads", scheme, layout, dtype]
    assert got == expected > 0
    assert dflash_context_2[scheme, layout, dtype] < TOLERANCES[dtype], dflash_context_2


def test_dflash_blocks_that_do_not_split_over_the_context_ranks_are_refused():
    module = dflash_packing.dflash(build=False, num_anchors=3)
    with pytest.raises(ValueError, match=r"num_anchors=3 does not split over context_parallel_size=2 .* multiple of "
                                         r"2, e.g. 4"):
        module.check_context_parallel(2)
    dflash_packing.dflash(build=False, num_anchors=4).check_context_parallel(2)


# ------------------------------------------------------------------------------------------- fit and resume (CLI)
SAME_RUN = ["--model.init_args.optimization.warmup=0", "--model.init_args.optimization.min_lr_ratio=1.0",
            "--data.init_args.task.num_train=128", "--trainer.limit_val_batches=1", "--trainer.val_check_interval=2",
            "--trainer.num_sanity_val_steps=0", "--data.init_args.task.num_val=16",
            "--data.init_args.loader.val_batch_size=16", "--model.init_args.generation.val_generate_batches=1"]
"""A schedule that does not depend on ``max_steps``, which each resumed call sets anew; 6 steps within one epoch (a run
stopped at an epoch's end, 4 steps of 64 examples, and resumed left the uninterrupted run at the second step after the
resume, in one process too: not context parallelism's); validation every 2 steps."""
CONTEXT_2 = ["--trainer.devices=2", "--trainer.strategy=lit_dllm.ExpertParallelStrategy",
             "--trainer.strategy.init_args.save_distributed_checkpoint=false",
             "--trainer.strategy.init_args.parallelism.context_parallel_size=2"]


def test_a_context_parallel_fit_follows_one_process_and_resumes_across_context_sizes(tmp_path):
    """``train.py fit`` of the tiny MDLM config (rows of 8 to 24 positions, batch 16): one process for 6 steps; then
    context parallelism over 2 gloo ranks for 2 steps (the same batch on both, each a half of every row), resumed in one
    process to step 4, resumed over 2 ranks (attention by all-gathered keys and values) to step 6. Every step's loss
    and gradient norm, and the validation loss and exact match every 2 steps (each rank scoring its shards; answers
    from whole sequences), follow the single run's."""
    def fit(save_dir: Path, *args: str, context: list[str] = ()) -> None:
        """One process in this one (no import to wait for), two through ``train.py`` (whose ranks Lightning starts)."""
        args = [*RUN, f"--trainer.logger.init_args.save_dir={save_dir}", "--trainer.log_every_n_steps=1",
                "--data.init_args.loader.batch_size=16", *SAME_RUN, *args, *context]
        if not context:
            main(["fit", *args])
            return
        result = train_py(*args)
        assert result.returncode == 0, result.stderr[-3000:]

    def curves(save_dir: Path) -> dict[tuple[str, int], float]:
        found = {}
        for version in sorted((save_dir / "mdlm_tiny").glob("version_*")):
            scalars = run_scalars(str(version))
            for tag in ("train/loss", "train/grad_norm", "val/loss", "val/exact_match"):
                found.update(((tag, step), value) for step, value in zip(*scalars.get(tag, ((), ()))))
        return found

    fit(tmp_path / "one", "--trainer.max_steps=6")
    all_gather = [*CONTEXT_2, "--trainer.strategy.init_args.parallelism.context_parallel_attention=all_gather"]
    for steps, context in ((2, CONTEXT_2), (4, []), (6, all_gather)):
        fit(tmp_path / "cp", f"--trainer.max_steps={steps}", *(["--ckpt_path", "last"] if steps > 2 else []),
            context=context)
    expected, got = curves(tmp_path / "one"), curves(tmp_path / "cp")
    assert len(expected) == 2 * 6 + 2 * 3 and got == pytest.approx(expected, rel=1e-5), (got, expected)


# ------------------------------------------------------------------------------------- keyed noise, bad input
def test_keyed_noise_is_drawn_for_whole_rows_then_cut():
    """Under context parallelism every shard holds its cut of the noise one process draws for the row: the same masks
    and rates whatever the context size, and whatever the other rows of the batch (the keys are the examples')."""
    module = family_module("mdlm", torch.float32)
    batch = family_batch("mdlm", "rows")
    whole = module.prepare_batch(batch, module.noise_keys(batch, 1))
    alone = family_batch("mdlm", "rows", slice(2, 3))
    assert torch.equal(module.prepare_batch(alone, module.noise_keys(alone, 1))["noise_mask"], whole["noise_mask"][2:3])
    for size in (1, 2, 4):
        shards = []
        for rank in range(size):
            module.model.context_parallel = ContextParallel(None, rank, size)
            shards.append(module.shard_sequences(batch, whole)[1])
        for name in ("noise_mask", "p_mask", "noisy_ids"):
            assert torch.equal(torch.cat([shard[name] for shard in shards], dim=1), whole[name])


def test_rows_that_do_not_split_into_equal_shards_are_refused_naming_the_multiple():
    module = family_module("ar", torch.float32)
    module.model.context_parallel = ContextParallel(None, 0, 4)
    batch = family_batch("ar", "rows")
    batch = {k: v[:, :14] if torch.is_tensor(v) and v.dim() == 2 else v for k, v in batch.items()}
    with pytest.raises(ValueError, match=r"14 positions does not split into context_parallel_size=4 equal shards: pad "
                                         r"the rows to a multiple of 4 .*pad_seq_len_divisible: 4, here 16"):
        module.shard_sequences(batch, module.prepare_batch(batch, module.noise_keys(batch, 0)))


@pytest.mark.parametrize(("settings", "size", "message"), [
    ({}, 8, r"num_attention_heads=4 is not divisible by context_parallel_size=8 .* \[1, 2, 4\]"),
    ({"attn_implementation": "flex_attention", "scheme": "all_gather"}, 2,
     r"attn_implementation='flex_attention' runs under context_parallel_attention: ulysses only .* 'all_gather'"),
    ({"attn_implementation": "flex_attention", "scheme": "ring"}, 2,
     r"attn_implementation='flex_attention' runs under context_parallel_attention: ulysses only .* 'ring'"),
    ({"num_attention_heads": 8, "num_key_value_heads": 2}, 4, r"num_key_value_heads=2 is not divisible by "
                                                               r"context_parallel_size=4"),
    ({"attn_implementation": "eager"}, 2, r"attn_implementation='eager' cannot run under context parallelism.*sdpa"),
    ({"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 4}, 2,
     r"layer_types \['sliding_attention'\] cannot run under context parallelism"),
])
def test_attention_that_context_parallelism_cannot_split_is_refused(settings, size, message):
    settings = dict(settings)
    attention, scheme = settings.pop("attn_implementation", "sdpa"), settings.pop("scheme", "ulysses")
    config = AutoConfig.for_model(**{**TINY_LLAMA, **settings}, vocab_size=40)
    config._attn_implementation = attention
    with pytest.raises(ValueError, match=message):
        check_context_parallel(config, size, scheme)


# ----------------------------------------------------------------------- FlexAttention under Ulysses (one GPU)
FLEX_CONFIG = {"hidden_size": 64}
"""The tiny Llama with heads of 16 dimensions, FlexAttention's smallest on CUDA."""


def flex_model_difference(name: str, layout: str, mesh) -> float:
    """The largest relative difference, over the ranks, of family ``name``'s logits (this rank's positions) and
    gradients (summed over the ranks) under Ulysses over FlexAttention from one process's FlexAttention on the whole
    rows (float32; the hybrid's causal pass)."""
    batch = {k: v.cuda() if torch.is_tensor(v) else v for k, v in family_batch(name, layout).items()}
    causal = {"causal": True} if name == "hybrid" else {}
    reference, module = (family_module(name, torch.float32, config=FLEX_CONFIG, attn="flex_attention").cuda()
                         for _ in range(2))
    context = apply_context_parallel(module.model, mesh)
    logits = reference.model(batch["input_ids"], **document_inputs(batch), **causal)
    weights = torch.randn(logits.shape, generator=torch.Generator().manual_seed(1)).cuda()
    (logits * weights).sum().backward()
    shard, _ = module.shard_sequences(batch, {})
    got = module.model(shard["input_ids"], **document_inputs(shard), **causal)
    (got * context.take(weights)).sum().backward()
    differences = [(got - context.take(logits)).abs().max() / logits.abs().max()]
    for mine, theirs in zip(module.model.parameters(), reference.model.parameters()):
        dist.all_reduce(mine.grad)
        differences.append((mine.grad - theirs.grad).abs().max() / theirs.grad.abs().max().clamp_min(1e-30))
    difference = torch.stack(differences).max()
    dist.all_reduce(difference, op=dist.ReduceOp.MAX)
    return float(difference)


def _flex_worker(rank: int, world: int, port: int, out: str) -> None:
    """Ulysses over FlexAttention, two ranks sharing the one GPU over gloo (NCCL takes a GPU a rank): the attention
    (rows of 256, every mask) and each family's model on padded and packed rows, against one process's FlexAttention."""
    torch.cuda.set_device(0)
    with _gloo_group(rank, world, port):
        mesh = init_device_mesh("cuda", (world,), mesh_dim_names=("context_parallel",))
        context = ContextParallel.of(mesh, "flex_attention")
        inputs = attention_inputs(torch.float32, length=256, dim=16, device="cuda")
        worst = {("attention", mask): attention_difference(inputs, mask, context, "ulysses") for mask in MASKS}
        worst |= {(name, layout): flex_model_difference(name, layout, mesh) for name in FAMILIES for layout in LAYOUTS}
        if rank == 0:
            torch.save(worst, Path(out) / "results.pt")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlexAttention trains on CUDA only")
def test_ulysses_runs_flex_attention_as_one_process_does(tmp_path):
    """Outputs and gradients of the attention (bidirectional, causal, per document: the whole rows' block masks) and of
    MDLM, hybrid (its causal pass) and CausalLM on padded and packed rows, within 1e-5 (float32)."""
    worst = _spawn(_flex_worker, 2, tmp_path)
    assert max(worst.values()) < TOLERANCES[torch.float32], worst


def _ring_cuda_worker(rank: int, world: int, port: int, out: str) -> None:
    """Ring attention on CUDA's flash kernel in bf16, two ranks sharing the one GPU over gloo, and one process's SDPA
    on the whole rows in bf16: each one's largest difference from float64 on the same inputs (output and gradients,
    relative to the largest of each)."""
    torch.cuda.set_device(0)
    with _gloo_group(rank, world, port):
        context = ContextParallel.of(init_device_mesh("cuda", (world,), mesh_dim_names=("context_parallel",)),
                                     scheme="ring")
        inputs = attention_inputs(torch.bfloat16, length=256, dim=64, device="cuda")
        exact = {name: t.double() if t.is_floating_point() else t for name, t in inputs.items()}
        worst = {}
        for mask in MASKS[:2]:
            output, grads = attend(inputs, mask, context, "ring")
            one_output, one_grads = attend(inputs, mask, None)
            expected, expected_grads = attend(exact, mask, None)
            ring = _largest_difference([output, *grads], shards(context, expected, expected_grads))
            dist.all_reduce(ring, op=dist.ReduceOp.MAX)
            worst[mask] = (float(ring), float(_largest_difference([one_output, *one_grads],
                                                                  [expected, *expected_grads])))
        with pytest.raises(ValueError, match=r"runs CUDA's flash kernel, which takes bf16 or fp16, and the attention "
                                             r"inputs are torch.float32: set trainer.precision: bf16-mixed"):
            attend(attention_inputs(torch.float32, length=256, dim=64, device="cuda"), "causal", context, "ring")
        if rank == 0:
            torch.save(worst, Path(out) / "results.pt")


def _largest_difference(found: list[torch.Tensor], expected: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack([(a.double() - b).abs().max() / b.abs().max() for a, b in zip(found, expected)]).max()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the ring's CUDA kernel runs on a GPU")
def test_ring_attention_runs_cuda_flash_kernel_as_one_process_does(tmp_path):
    """Bidirectional and causal rows (GQA), bf16: the ring's output and the gradients of queries, keys and values are
    as close to float64 as one process's bf16 SDPA (within twice its difference: on one H100, 4.9e-3 against 3.6e-3
    bidirectional, 5.0e-3 against 5.0e-3 causal; a lost or misplaced shard moves them by far more); float32 inputs are
    refused, naming the fix."""
    for mask, (ring, one_process) in _spawn(_ring_cuda_worker, 2, tmp_path).items():
        assert ring <= 2 * one_process, (mask, ring, one_process)


def test_families_that_do_not_take_shards_are_refused_before_any_compute():
    generation = DenoisingGeneration(val_generate_batches=0)
    modules = [
        BlockDiffusionGemmaModule(vocab_size=40, backbone=Backbone(model_config=TINY_DIFFUSION_GEMMA),
                                  generation=generation),
        DiffuGRPOModule(vocab_size=40, mask_token_id=39, backbone=CausalBackbone(model_config=TINY_LLAMA),
                        rl={"rewards": ["exact_answer"], "estimator": "one_pass"}, generation=generation),
    ]
    for module in modules:
        with pytest.raises(ValueError, match=rf"context_parallel_size=2, but {type(module).__name__} does not take "
                                             "shards .* set context_parallel_size: 1"):
            module.check_context_parallel(2)
        module.check_context_parallel(1)
    with pytest.raises(ValueError, match="Linear does not take sequence shards"):
        apply_context_parallel(nn.Linear(2, 2), SimpleNamespace(size=lambda: 2))


def _generation_worker(rank: int, world: int, port: int, out: str) -> None:
    """Each family's answers (greedy) from a model under context parallelism (FSDP2 over the context group), and
    whether the model runs on shards again after: the same answers on every rank as one process gives."""
    with _gloo_group(rank, world, port):
        meshes = init_meshes(world, 1, "cpu", 2)
        prompts = [torch.tensor([5, 6, 7]), torch.tensor([8, 9, 10, 11, 12])]
        found = {}
        for name, scheme in ((n, s) for n in FAMILIES for s in SCHEMES):
            expected = family_module(name, torch.float32).generate_ids(prompts, 8)
            module = family_module(name, torch.float32, meshes, context_parallel_attention=scheme)
            got = module.generate_ids(prompts, 8)
            backbone = module.model.hf.config._attn_implementation
            same = torch.tensor(float(all(torch.equal(a, b) for a, b in zip(got, expected))))
            dist.all_reduce(same, op=dist.ReduceOp.MIN)
            found[name, scheme] = (bool(same), module.model.context_parallel is not None, backbone,
                                   [len(a) for a in got])
        if rank == 0:
            torch.save(found, Path(out) / "results.pt")


def test_generation_under_context_parallelism_runs_whole_sequences_and_answers_as_one_process(tmp_path):
    """The samplers (answers at validation, ``generate``) run whole sequences on every rank of a context group with the
    model's own attention, then the model runs on shards again."""
    for (name, scheme), (same, sharded, attention, lengths) in _spawn(_generation_worker, 2, tmp_path).items():
        assert same and sharded and attention == f"lit_dllm_{scheme}" and sum(lengths) > 0, (name, scheme, lengths)


def test_an_unknown_context_parallel_attention_is_refused_naming_the_schemes():
    with pytest.raises(ValueError, match=r"context_parallel_attention='striped' is not a context-parallel attention: "
                                         r"use one of ulysses, all_gather, ring"):
        ExpertParallelStrategy(parallelism={"context_parallel_size": 2, "context_parallel_attention": "striped"})


@pytest.mark.parametrize("strategy", [SingleDeviceStrategy, DDPStrategy])
def test_context_parallelism_needs_the_fsdp2_strategy(strategy):
    with pytest.raises(ValueError, match=rf"context_parallel_size=2 under {strategy.__name__}.*ExpertParallelStrategy"):
        strategy(parallelism=Parallelism(context_parallel_size=2))
    with pytest.raises(ValueError, match=r"parallelism.context_parallel_size must be a positive int, got 0"):
        strategy(parallelism={"context_parallel_size": 0})
