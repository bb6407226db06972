"""FSDP2 and expert parallelism of a tied encoder/decoder stack (``lit_dllm.parallel`` on transformers'
``DiffusionGemmaForBlockDiffusion``) on CPU, without a GPU.

DiffusionGemma runs one parameter stack twice: encoder layer ``i`` (causal, writes the KV cache) and decoder layer
``i`` (bidirectional over a canvas, reads it) are different modules holding the same Parameters, and embeddings,
LM head and final norm are tied too. The training step below calls every layer three times: the encoder with
gradients, the decoder without (self-conditioning logits), the decoder again with gradients. A fake world checks
that :func:`~lit_dllm.parallel.parallelize` keeps every tie (one sharded Parameter per tied pair) and splits the
experts over the expert mesh; gloo processes then train with FSDP2 and FSDP2 + EP=2 (and with activation
checkpointing and a decoder-only loss, whose gradients reach the last encoder layer through the KV cache alone),
and each must follow the single-process run step by step. ``tests/multigpu/check_gemma_parallel.py`` runs the
same comparison on GPUs (NCCL), from the pieces defined here.
"""

from __future__ import annotations

import collections
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion, DynamicCache

import lit_dllm.parallel
from lit_dllm.families.diffusion_gemma.model import unshard_before_cache_backward
from lit_dllm.meshes import DATA_PARALLEL, data_parallel_group, data_parallel_size, grad_norm
from lit_dllm.parallel import DISPATCH_STYLE, expert_plan, parallelize, sync_gradients_in_backward, tied_groups
from lit_dllm.strategies import init_meshes

from tests.test_parallel import _gloo_group, _spawn, fsdp_param_groups, momentum_sgd, one_thread, relative_differences
from tests.test_parallel import fake_world  # noqa: F401  (the fixture)

TEXT = {
    "vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
    "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32, "global_head_dim": 32,
    "num_global_key_value_heads": 1, "sliding_window": 4, "num_experts": 4, "top_k_experts": 2,
    "moe_intermediate_size": 32, "max_position_embeddings": 256, "enable_moe_block": True,
    "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
}
VISION = {
    "model_type": "gemma4_vision", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
    "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
}
PROMPT, CANVAS, GLOBAL_BATCH, STEPS = 12, 8, 4, 4
LR = 0.02
TOLERANCE = 1e-5
IGNORE = -100


# ------------------------------------------------------------------- the tiny model, its step and its reference
def make_model() -> DiffusionGemmaForBlockDiffusion:
    """The tiny DiffusionGemma in fp32 (eager attention), the same weights on every rank, router and vision tower
    frozen (as the module freezes them).

    Two changes to the random init keep fp32 rounding from growing along the trajectory, so that runs which split
    the batch differently can be compared at 1e-5: the frozen router gets weights of std 1 (decisive top-k: no
    choice within rounding of a tie), and the query and key norms are scaled by 0.3. Gemma's attention does not
    divide by sqrt(head_dim) (its q/k norms bring q and k to unit RMS), so at init its logits have std ~6: the
    softmax is so sharp that one process alone, fp32 against fp64, differs by 1e-3 after 3 SGD steps at LR 0.1
    (2e-4 after 5 at LR 0.002). Scaled, fp32 stays within 1.1e-6 of fp64 over 20 steps at this LR, with the whole
    batch or half of it (within 2e-7 over 5 steps even at LR 0.1).
    """
    torch.manual_seed(0)
    config = DiffusionGemmaConfig(text_config=dict(TEXT), vision_config=dict(VISION), canvas_length=CANVAS)
    config._attn_implementation = config.text_config._attn_implementation = "eager"
    model = DiffusionGemmaForBlockDiffusion(config)
    with torch.no_grad():
        for layer in model.model.encoder.language_model.layers:  # the decoder's are the same Parameters
            nn.init.normal_(layer.router.proj.weight, std=1.0)
            layer.self_attn.q_norm.weight.mul_(0.3)
            layer.self_attn.k_norm.weight.mul_(0.3)
            layer.router.proj.weight.requires_grad_(False)
            layer.router.scale.requires_grad_(False)
    model.model.encoder.vision_tower.requires_grad_(False)
    model.model.encoder.embed_vision.requires_grad_(False)
    return model


def encoder_masks(batch: int, length: int, window: int, device="cpu") -> dict[str, torch.Tensor]:
    """Additive causal masks ``[B, 1, S, S]`` of the encoder: full, and sliding (``0 <= q - k < window``)."""
    positions = torch.arange(length, device=device)
    distance = positions[:, None] - positions[None]
    masked = torch.finfo(torch.float32).min
    full = torch.zeros(length, length, device=device).masked_fill(distance < 0, masked)
    sliding = full.masked_fill(distance >= window, masked)
    return {"full_attention": full.expand(batch, 1, -1, -1), "sliding_attention": sliding.expand(batch, 1, -1, -1)}


def decoder_masks(batch: int, length: int, canvas: int, device="cpu") -> dict[str, torch.Tensor]:
    """Additive masks ``[B, 1, R, S + R]`` of the decoder: every canvas row sees the prompt and the canvas (the
    module's block-causal mask is its masks.py's; any fixed mask serves the comparison)."""
    keep = torch.zeros(batch, 1, canvas, length + canvas, device=device)
    return {"full_attention": keep, "sliding_attention": keep}


def make_batch(step: int, size: int = GLOBAL_BATCH) -> dict[str, torch.Tensor]:
    """The global batch of step ``step`` (on the CPU): prompt ids, canvas, canvas targets (some ignored),
    self-conditioning coins."""
    generator = torch.Generator().manual_seed(1000 + step)
    vocab = TEXT["vocab_size"]
    ids = torch.randint(0, vocab, (size, PROMPT), generator=generator)
    canvas = torch.randint(0, vocab, (size, CANVAS), generator=generator)
    targets = torch.randint(0, vocab, (size, CANVAS), generator=generator)
    targets[torch.rand(size, CANVAS, generator=generator) < 0.3] = IGNORE
    coins = torch.rand(size, generator=generator) < 0.5
    return {"input_ids": ids, "canvas": canvas, "targets": targets, "self_conditioning": coins}


class BlockDiffusionStep(nn.Module):
    """The training forward, as the FSDP root (:func:`~lit_dllm.parallel.parallelize`'s contract): its ``forward``
    runs everything that uses the root's parameters (embeddings, LM head, final norm, self-conditioning), i.e. the
    encoder pass, both decoder passes and the head, so FSDP gathers them once around it."""

    def __init__(self, hf: DiffusionGemmaForBlockDiffusion) -> None:
        super().__init__()
        self.hf = hf

    def forward(self, input_ids, canvas, self_conditioning) -> tuple[torch.Tensor, torch.Tensor]:
        """(encoder next-token logits ``[B, S, V]``, decoder logits ``[B, R, V]``), both softcapped."""
        hf, (batch, length), width, device = self.hf, input_ids.shape, canvas.shape[1], input_ids.device
        cache = DynamicCache()  # no config: with one, the sliding layers would keep only their window
        window = hf.config.text_config.sliding_window
        encoder = hf.model.encoder(
            input_ids=input_ids, attention_mask=encoder_masks(batch, length, window, device), cache=cache,
            position_ids=torch.arange(length, device=device)[None].expand(batch, -1),
        )
        unshard_before_cache_backward(hf, cache)  # the encoder layers' side output, under FSDP2
        encoder_logits = self.head(encoder.last_hidden_state)
        decoder = {
            "decoder_input_ids": canvas, "cache": cache,
            "decoder_attention_mask": decoder_masks(batch, length, width, device),
            "decoder_position_ids": (length + torch.arange(width, device=device))[None].expand(batch, -1),
        }
        with torch.no_grad():
            first = self.head(hf.model.decoder(**decoder).last_hidden_state)
        second = hf.model.decoder(
            **decoder, self_conditioning_logits=first.detach(), self_conditioning_mask=self_conditioning
        )
        return encoder_logits, self.head(second.last_hidden_state)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        cap = self.hf.config.text_config.final_logit_softcapping
        return cap * torch.tanh(self.hf.lm_head(hidden) / cap)


def token_count(batch: dict, encoder_loss: bool = True) -> int:
    """Tokens :func:`local_loss_sum` sums over: the decoder's targets, plus the encoder's next tokens."""
    return int((batch["targets"] != IGNORE).sum()) + (batch["input_ids"][:, 1:].numel() if encoder_loss else 0)


def local_loss_sum(model: BlockDiffusionStep, batch: dict, encoder_loss: bool = True) -> torch.Tensor:
    """Summed token cross-entropy of this rank's rows: decoder targets, plus the encoder's next-token loss."""
    encoder_logits, decoder_logits = model(batch["input_ids"], batch["canvas"], batch["self_conditioning"])
    vocab = decoder_logits.shape[-1]
    targets = batch["targets"]
    total = nn.functional.cross_entropy(
        decoder_logits.reshape(-1, vocab), targets.reshape(-1), reduction="sum", ignore_index=IGNORE
    )
    if encoder_loss:
        next_tokens = batch["input_ids"][:, 1:]
        total = total + nn.functional.cross_entropy(
            encoder_logits[:, :-1].reshape(-1, vocab), next_tokens.reshape(-1), reduction="sum"
        )
    return total


def train(
    model, steps, strategy=None, rank: int = 0, encoder_loss: bool = True, device="cpu", batch_size=GLOBAL_BATCH,
    micro_batches: int = 1,
):
    """(loss, gradient norm) of each step: SGD with momentum, step ``s`` on ``make_batch(s)`` split over the
    data-parallel ranks, each backward loss ``local sum / global count * data-parallel size``. ``micro_batches`` > 1
    splits each rank's rows into that many backward passes, with FSDP2's gradient sync deferred to the last
    (``fsdp_defer_gradient_sync``)."""
    world, group = data_parallel_size(strategy), data_parallel_group(strategy)
    optimizer = momentum_sgd([p for p in model.parameters() if p.requires_grad], lr=LR)
    history = []
    for step in steps:
        batch = {key: value[rank::world].to(device) for key, value in make_batch(step, batch_size).items()}
        total = torch.tensor(float(token_count(batch, encoder_loss)), device=device)
        if world > 1:
            dist.all_reduce(total, group=group)
        loss = torch.zeros((), device=device)
        for index in range(micro_batches):
            if micro_batches > 1:
                sync_gradients_in_backward(model, index == micro_batches - 1)
            rows = {key: value[index::micro_batches] for key, value in batch.items()}
            micro_loss = local_loss_sum(model, rows, encoder_loss) / total
            (micro_loss * world).backward()
            loss += micro_loss.detach()
        if world > 1:
            dist.all_reduce(loss, group=group)
        norm = grad_norm(model.parameters())
        optimizer.step()
        optimizer.zero_grad()
        history.append((float(loss), float(norm)))
    return history


@pytest.fixture(scope="module")
def references():
    with one_thread():
        return {
            encoder_loss: train(BlockDiffusionStep(make_model()), range(STEPS), encoder_loss=encoder_loss)
            for encoder_loss in (True, False)
        }


# -------------------------------------------------------------------------------------------- plans and units
def test_tied_modules_form_one_group():
    shared = nn.Linear(2, 2)
    a, b, c = nn.Sequential(shared), nn.Sequential(nn.Linear(2, 2)), nn.Sequential(nn.Linear(2, 2), shared)
    d = nn.Sequential(c[0])  # tied to c only, hence to a
    assert tied_groups([a, b, c, d]) == [[a, c, d], [b]]


def test_expert_plan_covers_the_decoder_experts_and_leaves_dense_layers_alone():
    """DiffusionGemma's plan names only encoder layers, and splits its dense MLP by tensor parallelism over the EP
    ranks (which would need them to share a batch): the decoder's experts join under their own names, the MLP
    entries go."""
    plan = expert_plan(make_model())
    for stack in ("model.encoder.language_model.layers", "model.decoder.layers"):
        for i in range(TEXT["num_hidden_layers"]):
            experts = f"{stack}.{i}.experts"
            assert list(plan)[list(plan).index(experts) - 2 : list(plan).index(experts) + 1] == [
                f"{experts}.gate_up_proj", f"{experts}.down_proj", experts,  # parameters before their module
            ]
            assert plan[experts] == DISPATCH_STYLE and plan[f"{experts}.gate_up_proj"] == "grouped_gemm"
    assert not any(".mlp." in name for name in plan)
    assert len(plan) == 2 * TEXT["num_hidden_layers"] * 3


def _layers(model: BlockDiffusionStep):
    return zip(model.hf.model.encoder.language_model.layers, model.hf.model.decoder.layers, strict=True)


@pytest.mark.parametrize(("fake_world", "ep"), [(2, 1), (2, 2), (4, 2), (4, 4)], indirect=["fake_world"])
def test_parallelize_keeps_the_tied_stack_tied(fake_world, ep):
    model = BlockDiffusionStep(make_model())
    strategy = init_meshes(fake_world, ep, "cpu")
    parallelize(model, strategy, activation_checkpointing=True)
    hf = model.hf
    for encoder_layer, decoder_layer in _layers(model):
        decoder_params = dict(decoder_layer.named_parameters())
        assert dict(encoder_layer.named_parameters()).keys() == decoder_params.keys()
        for name, param in encoder_layer.named_parameters():
            assert param is decoder_params[name] and isinstance(param, DTensor), name  # one sharded Parameter
        assert encoder_layer._get_fsdp_state() is decoder_layer._get_fsdp_state()  # one FSDP unit
        assert decoder_layer.gradient_checkpointing  # transformers checkpoints the decoder layers only
        for router in (encoder_layer.router, decoder_layer.router):  # frozen inside a trained unit, still frozen
            assert not router.proj.weight.requires_grad and not router.scale.requires_grad
            assert router.per_expert_scale.requires_grad
        dense = encoder_layer.mlp.gate_proj.weight
        assert dense.device_mesh.mesh_dim_names == (DATA_PARALLEL,) and dense.placements == (Shard(0),)
        experts = encoder_layer.experts.gate_up_proj
        if ep > 1:  # split over ep, then FSDP over the world / ep copies; both stacks dispatch by all-to-all
            assert experts.device_mesh.mesh_dim_names == ("expert_data_parallel", "expert_parallel")
            assert experts.to_local().shape[0] == TEXT["num_experts"] // fake_world
            for module in (encoder_layer.experts, decoder_layer.experts):
                assert module.num_experts == TEXT["num_experts"] // ep and "forward" in vars(module)
            state = encoder_layer.experts._get_fsdp_state()
            assert state is decoder_layer.experts._get_fsdp_state() is not encoder_layer._get_fsdp_state()
            (group,) = fsdp_param_groups(encoder_layer.experts)
            assert group.gradient_divide_factor == fake_world
        else:  # FSDP-sharded with the rest of the layer
            assert experts.device_mesh.mesh_dim_names == (DATA_PARALLEL,)
            assert experts.to_local().shape[0] == TEXT["num_experts"] // fake_world
    embedding = hf.model.encoder.language_model.embed_tokens.weight
    assert embedding is hf.model.decoder.embed_tokens.weight is hf.lm_head.weight and isinstance(embedding, DTensor)
    assert hf.model.encoder.language_model.norm.weight is hf.model.decoder.norm.weight


# ------------------------------------------------------------------------------------------- gloo processes
RUNS = {  # name: (expert-parallel size, activation checkpointing, encoder loss, reshard after forward, compile,
    #         micro-batches a step, the gradient sync deferred to the last)
    "fsdp2": (1, False, True, True, False, 1),
    "fsdp2, kept gathered from forward to backward": (1, False, True, False, False, 1),
    "fsdp2+ep2": (2, False, True, True, False, 1),
    "fsdp2+ep2+checkpointing, decoder loss only": (2, True, False, True, False, 1),
    "fsdp2, compiled blocks, decoder loss only": (1, False, False, True, True, 1),
    "fsdp2+ep2, kept gathered, 2 micro-batches with deferred sync": (2, False, True, False, False, 2),
}
COMPILED_RUN_BACKEND = "aot_eager"  # the compiled run's backend (inductor would build C++ for minutes on a small CPU)


def _worker(rank: int, world: int, port: int, out: str, runs: dict) -> None:
    """Each run's history, and the graphs and graph breaks of the compiled blocks (``graphs``, ``graph breaks``)."""
    results = {}
    lit_dllm.parallel.COMPILE_BACKEND = COMPILED_RUN_BACKEND
    with _gloo_group(rank, world, port):
        for name, (ep, checkpointing, encoder_loss, reshard, compile, micro_batches) in runs.items():
            strategy = init_meshes(world, ep, "cpu")
            model = parallelize(BlockDiffusionStep(make_model()), strategy, activation_checkpointing=checkpointing,
                                reshard_after_forward=reshard, compile=compile)
            results[name] = train(model, range(STEPS), strategy, rank, encoder_loss, micro_batches=micro_batches)
        results["all-gathers"] = all_gathers_per_step(world, rank)
        results["graphs"] = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        results["graph breaks"] = dict(torch._dynamo.utils.counters["graph_break"])
        if rank == 0:
            torch.save(results, Path(out) / "results.pt")


def all_gathers_per_step(world: int, rank: int) -> collections.Counter:
    """All-gathers of each FSDP2 unit (FSDP2's ``FSDP::all_gather (unit)`` profiler ranges) in the second of two
    steps of the kept-gathered FSDP2 run, under a deferred sync over 2 micro-batches and without."""
    counts = collections.Counter()
    for micro_batches in (1, 2):
        strategy = init_meshes(world, 1, "cpu")
        model = parallelize(BlockDiffusionStep(make_model()), strategy, reshard_after_forward=False)
        train(model, range(1), strategy, rank, micro_batches=micro_batches)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
            train(model, range(1, 2), strategy, rank, micro_batches=micro_batches)
        counts.update((micro_batches, event.name.split("(")[1].split(",")[0].rstrip(")"))
                      for event in profile.events() if event.name.startswith("FSDP::all_gather ("))
    return counts


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    return _spawn(_worker, 2, tmp_path_factory.mktemp("gemma_gloo"), RUNS)


@pytest.mark.parametrize("run", list(RUNS))
def test_two_processes_follow_the_single_process_run(two_processes, references, run):
    differences = relative_differences(two_processes[run], references[RUNS[run][2]])
    assert max(differences) < TOLERANCE, differences


def test_compiled_blocks_under_fsdp2_take_no_graph_break(two_processes):
    """The tied units' backward unshard is hooked outside the compiled layers (the encoder's KV cache included), so
    every compiled layer is one graph (a hook registered on a tensor inside one would break it at each module)."""
    assert two_processes["graphs"] >= len(TEXT["layer_types"]) * 2  # at least the encoder's and decoder's layers
    assert two_processes["graph breaks"] == {}


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_kept_gathered_tied_layers_gather_once_a_step(two_processes, micro_batches):
    """A shared layer kept gathered runs its encoder call, then two decoder calls, and backward through the decoder's,
    then the encoder's: gathered in the forward, it stays gathered to the end of the backward (FSDP2 alone reshards
    after the decoder's backward, then gathers again, and prefetches the last layer: 2 or 3 gathers). With 2
    micro-batches and the sync deferred, it stays gathered from the first micro-batch's forward to the last one's
    backward. The two comparisons above show the same gradients and losses."""
    gathers = {unit: count for (micro, unit), count in two_processes["all-gathers"].items() if micro == micro_batches}
    layers = {unit: count for unit, count in gathers.items() if "language_model.layers." in unit}
    assert layers == {f"hf.model.encoder.language_model.layers.{i}": 1 for i in range(len(TEXT["layer_types"]))}


@pytest.mark.skipif(not os.environ.get("LIT_DLLM_FOUR_PROCESSES"), reason="~30 s on 2 cores; the GPU check runs 4")
def test_four_processes_with_two_expert_copies_follow_the_single_process_run(tmp_path, references):
    history = _spawn(_worker, 4, tmp_path, {"dp4+ep2": (2, False, True, True, False, 1)})["dp4+ep2"]
    differences = relative_differences(history, references[True])
    assert max(differences) < TOLERANCE, differences
