"""The Fast-dLLM sampler: LLaDA exactly without threshold and cache, threshold decoding, what of the KV cache
is exact (a cache refreshed on the current canvas; any cache of a one-layer model), keyed sampling noise (both
samplers: a row's answer alone and in any batch), and the same answers from a model sharded by FSDP2 (and expert
parallelism) over two gloo processes as from one process."""

import re
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from lit_dllm import MDLMModule
from lit_dllm.noise.keys import example_keys
from lit_dllm.families.mdlm import fast_sampler
from lit_dllm.families.mdlm.fast_sampler import CACHES, CanvasCache, cached_pass, fast_generate
from lit_dllm.families.mdlm.model import DiffusionLM
from lit_dllm.families.mdlm.sampler import REMASKING, llada_generate
from lit_dllm.hub.hf import load_causal_lm
from lit_dllm.parallel import parallelize
from lit_dllm.strategies import init_meshes
from lit_dllm.testing import TINY_LLAMA

from tests.test_parallel import _gloo_group, _spawn, one_thread
from tests.test_parallel import make_module as make_moe_module
from tests.families.mdlm.test_sampler import EOS, MASK, PAD, oracle

V = 12
PROMPTS = [torch.tensor([5, 6, 7]), torch.tensor([5]), torch.tensor([2, 3, 4, 5, 6]), torch.tensor([8, 8])]


def denoiser(layers: int, seed: int = 0) -> DiffusionLM:
    """A random bidirectional Llama in float64 (so that cached and full passes give the same argmax)."""
    torch.manual_seed(seed)
    hf = load_causal_lm(None, {**TINY_LLAMA, "num_hidden_layers": layers, "vocab_size": V}, attn_implementation="sdpa")
    return DiffusionLM(hf).double().eval()


def run(sample, model, **kwargs):
    kwargs = {"mask_token_id": V - 1, "pad_token_id": 0, "eos_token_id": 1, "gen_length": 8, "steps": 8,
              "block_length": 4, "generator": torch.Generator().manual_seed(0), **kwargs}
    return [o.tolist() for o in sample(model, PROMPTS, **kwargs)]


@pytest.mark.parametrize("keyed", [False, True], ids=["generator", "keys"])
@pytest.mark.parametrize("remasking, temperature", [("low_confidence", 0.0), ("random", 0.0), ("low_confidence", 1.0)])
@pytest.mark.parametrize("steps, block_length", [(8, 4), (4, 4), (2, 8), (8, 2)])
def test_without_threshold_or_cache_it_is_llada(remasking, temperature, steps, block_length, keyed):
    model = denoiser(2)
    kwargs = dict(steps=steps, block_length=block_length, remasking=remasking, temperature=temperature,
                  keys=example_keys(0, torch.arange(len(PROMPTS))) if keyed else None)
    expected = run(llada_generate, model, **kwargs)
    assert run(fast_generate, model, threshold=1.5, cache="none", **kwargs) == expected
    assert any(len(o) < 8 for o in expected)  # a row stops at EOS: the EOS fill is covered too


SAME_LENGTH = [torch.tensor([5, 6, 7]), torch.tensor([2, 9, 4]), torch.tensor([8, 8, 3]), torch.tensor([7, 3, 3])]
"""Prompts of one length: the canvas attends to its right padding, which the batch's longest prompt sets."""
SAMPLERS = {"llada": llada_generate, **{f"fast-{cache}": partial(fast_generate, threshold=0.5, cache=cache)
                                        for cache in CACHES}}


@pytest.mark.parametrize("remasking", REMASKING)
@pytest.mark.parametrize("sampler", SAMPLERS)
def test_with_keys_a_row_answers_the_same_alone_as_in_any_batch(sampler, remasking):
    """At temperature 1, each row's tokens (and ``random`` remasking's order) are keyed draws of its own key: its
    answer is the same alone, in a batch with other prompts, at another row and in a batch of another size."""
    model, sample = denoiser(2), SAMPLERS[sampler]

    def answers(rows: list[int], seed: int = 0) -> list[list[int]]:
        return [o.tolist() for o in sample(
            model, [SAME_LENGTH[r] for r in rows], mask_token_id=V - 1, pad_token_id=0, eos_token_id=1, gen_length=8,
            steps=8, block_length=4, remasking=remasking, temperature=1.0, keys=example_keys(seed, torch.tensor(rows)))]

    batch = answers([0, 1, 2, 3])
    assert [answers([row])[0] for row in range(4)] == batch
    assert answers([3, 1]) == [batch[3], batch[1]]
    assert len({tuple(answer) for answer in batch}) == 4  # sampled: the rows differ
    assert answers([0, 1, 2, 3], seed=1) != batch  # other keys, other draws


def test_threshold_decodes_confident_positions_together():
    calls = []
    out = fast_generate(oracle([[2, 3, 4, 5], [8, 8]], [3, 1], calls), PROMPTS[:2], mask_token_id=MASK,
                        pad_token_id=PAD, eos_token_id=EOS, gen_length=8, steps=8, block_length=4, threshold=0.9)
    assert [o.tolist() for o in out] == [[2, 3, 4, 5], [8, 8]]
    assert len(calls) == 2  # the oracle is sure: each block in one step


def test_threshold_commits_at_least_one_token_per_step():
    calls = []
    unsure = lambda x: calls.append(x) or torch.zeros(*x.shape, V)  # noqa: E731
    fast_generate(unsure, [torch.tensor([7])], mask_token_id=V - 1, pad_token_id=0, gen_length=6, steps=6,
                  block_length=3, threshold=0.9)
    assert len(calls) == 6


def windows(cols: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The prefix and dual caches' window passes over a 13-column canvas: each row's columns and the block's inputs."""
    return {"prefix": (torch.arange(4, 13).expand(2, -1), cols - 4), "dual": (cols, torch.arange(4).expand(2, -1))}


@pytest.mark.parametrize("cache", ["prefix", "dual"])
@pytest.mark.parametrize("exported", [False, True], ids=["wrapper", "transformers"])
@pytest.mark.parametrize("keep", [True, False], ids=["head-at-columns", "full-head"])
def test_a_cache_of_the_current_canvas_gives_the_full_pass_logits(cache, exported, keep):
    """Positions, cache columns and the bidirectional mask are right: only staleness makes the cache approximate.
    The passes run the denoiser (a ``DiffusionLM``) or the transformers model inside it (an export), with the LM head
    at the block's columns only or over every column; the rows' blocks start at different columns."""
    model, x = denoiser(3), torch.randint(0, V, (2, 13))
    rows, cols = torch.arange(2)[:, None], torch.tensor([[4, 5, 6, 7], [5, 6, 7, 8]])  # each row's block
    passes, kv = (model.hf if exported else model), CanvasCache(13)
    full = torch.arange(13).expand(2, -1)
    torch.testing.assert_close(cached_pass(passes, x, kv, full, cols, keep), model(x)[rows, cols])
    for _ in range(2):  # a window pass rewrites its own columns' entries only: the same ones again
        torch.testing.assert_close(cached_pass(passes, x, kv, *windows(cols)[cache], keep), model(x)[rows, cols])


@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_a_window_pass_sees_the_other_columns_as_the_last_full_pass_left_them(cache):
    """The cache keeps the full pass's entries outside the window (stale by design) and the window's current ones: a
    one-layer model's window logits are then those of a full pass over the current canvas."""
    model, x = denoiser(1), torch.randint(0, V - 1, (2, 13))
    rows, cols = torch.arange(2)[:, None], torch.tensor([[4, 5, 6, 7], [5, 6, 7, 8]])
    kv, full = CanvasCache(13), torch.arange(13).expand(2, -1)
    cached_pass(model, x, kv, full, cols, True)
    x[rows, cols] = V - 1  # the blocks change after the full pass
    torch.testing.assert_close(cached_pass(model, x, kv, *windows(cols)[cache], True), model(x)[rows, cols])
    with pytest.raises(ValueError, match="covers all 13 columns, not 4"):
        cached_pass(model, x, CanvasCache(13), *windows(cols)["dual"], True)


@pytest.mark.parametrize("cache", CACHES)
def test_the_lm_head_runs_at_the_block_columns_only(cache, monkeypatch):
    """Each pass projects only the rows' block columns onto the vocabulary (``logits_to_keep``), never the whole
    canvas, and answers as the full-canvas head does."""
    model = denoiser(2)
    widths = []
    model.hf.lm_head.register_forward_hook(lambda _, args, out: widths.append(args[0].shape[1]))
    kept = run(fast_generate, model, threshold=0.2, cache=cache)
    assert set(widths) == {4}  # block_length
    monkeypatch.setattr(fast_sampler, "keeps_columns", lambda _: False)
    assert run(fast_generate, model, threshold=0.2, cache=cache) == kept
    assert max(widths) > 4


def test_llada_runs_the_lm_head_at_the_block_columns_only(monkeypatch):
    model = denoiser(2)
    widths = []
    model.hf.lm_head.register_forward_hook(lambda _, args, out: widths.append(args[0].shape[1]))
    kept = run(llada_generate, model)
    assert set(widths) == {4}
    assert run(llada_generate, lambda ids: model(ids)) == kept  # a plain function: the whole canvas's logits


@pytest.mark.parametrize("cache", ["prefix", "dual"])
@pytest.mark.parametrize("threshold", [0.2, 1.5])
@pytest.mark.parametrize("canvas_multiple", [None, 16])
def test_the_cache_is_exact_for_one_layer(cache, threshold, canvas_multiple):
    """One layer's keys / values depend only on the tokens, and cached columns keep theirs through a block (the
    padding after a rounded-up canvas included)."""
    model = denoiser(1)
    expected = run(fast_generate, model, threshold=threshold, cache="none", canvas_multiple=canvas_multiple)
    assert run(fast_generate, model, threshold=threshold, cache=cache, canvas_multiple=canvas_multiple) == expected


def test_bad_arguments_are_named():
    kwargs = dict(mask_token_id=MASK, pad_token_id=PAD)
    prompt = [torch.tensor([1])]
    with pytest.raises(ValueError, match=re.escape("threshold=0 must be a number > 0")):
        fast_generate(lambda x: x, prompt, threshold=0, **kwargs)
    with pytest.raises(ValueError, match=re.escape("threshold=True must be a number > 0")):
        fast_generate(lambda x: x, prompt, threshold=True, **kwargs)
    with pytest.raises(ValueError, match=re.escape("cache='full'; use 'none', 'prefix' or 'dual'")):
        fast_generate(lambda x: x, prompt, cache="full", **kwargs)
    with pytest.raises(ValueError, match=re.escape("cache='dual' needs model.hf")):
        fast_generate(lambda x: x, prompt, cache="dual", **kwargs)
    sliding = SimpleNamespace(hf=SimpleNamespace(config=SimpleNamespace(layer_types=["sliding_attention"])))
    with pytest.raises(ValueError, match=re.escape("cache='prefix' needs full-attention layers only")):
        fast_generate(sliding, prompt, cache="prefix", **kwargs)


def module(**generation):
    """A tiny MDLM; ``generation``: its generation settings besides gen_length 8 in blocks of 4."""
    return MDLMModule(vocab_size=V, mask_token_id=V - 1, eos_token_id=1, backbone={"model_config": TINY_LLAMA},
                      generation={"gen_length": 8, "gen_block_length": 4, **generation})


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"sampler": "dream"}, "sampler='dream'; use 'llada' or 'fast'"),
        ({"gen_threshold": 0.0}, "gen_threshold=0.0 must be a number > 0"),
        ({"gen_threshold": "high"}, "gen_threshold='high' must be a number > 0"),
        ({"gen_cache": "full"}, "gen_cache='full'; use 'none', 'prefix' or 'dual'"),
        ({"gen_canvas_multiple": 0}, "gen_canvas_multiple=0 must be a positive int, or None (no rounding)"),
    ],
)
def test_bad_sampler_hyperparameters_fail_at_construction(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        module(**kwargs)


@pytest.mark.parametrize("cache", ["none", "dual"])
@pytest.mark.parametrize("canvas_multiple", [None, 16])
def test_the_module_generates_with_the_chosen_sampler(cache, canvas_multiple):
    fast = module(sampler="fast", gen_threshold=0.2, gen_cache=cache, gen_canvas_multiple=canvas_multiple)
    fast.configure_model()
    reference = module(gen_canvas_multiple=canvas_multiple)
    reference.configure_model()
    reference.load_state_dict(fast.state_dict())
    kwargs = dict(mask_token_id=V - 1, pad_token_id=0, eos_token_id=1, gen_length=8, steps=8, block_length=4,
                  canvas_multiple=canvas_multiple)
    with torch.no_grad():
        expected = fast_generate(fast.model.eval(), PROMPTS, threshold=0.2, cache=cache, **kwargs)
        assert [o.tolist() for o in fast.generate_ids(PROMPTS)] == [o.tolist() for o in expected]
        expected = llada_generate(reference.model.eval(), PROMPTS, **kwargs)
        assert [o.tolist() for o in reference.generate_ids(PROMPTS)] == [o.tolist() for o in expected]


# ---------------------------------------------------------------------- sharded: FSDP2 and EP over gloo processes
RANK_PROMPTS = [
    [torch.tensor([5, 6, 7]), torch.tensor([9, 2, 4, 4, 3, 8, 2])],
    [torch.tensor([12]), torch.tensor([20, 21]), torch.tensor([7, 7, 7, 7, 7])],
]
"""Each rank's prompts (different counts and lengths); alone, the ranks' prompts take different numbers of steps."""
SHARPEN = 60.0
"""LM-head scale of the random model: its probabilities then often pass the threshold (0.5), so blocks end early."""


def sampling_module(cache: str) -> MDLMModule:
    """tests/test_parallel.py's tiny MoE MDLM (fp32, unsharded) with a sharper head and the fast sampler."""
    module = make_moe_module(generation={"val_generate_batches": 0, "sampler": "fast", "gen_threshold": 0.5,
                                          "gen_cache": cache, "gen_length": 16, "gen_block_length": 4})
    with torch.no_grad():
        module.model.hf.lm_head.weight.mul_(SHARPEN)
    return module


def single_process_answers(cache: str, prompts: list[torch.Tensor], device="cpu") -> tuple[list[list[int]], int]:
    """The unsharded module's answers to ``prompts`` and how many passes of the transformers model they took."""
    module = sampling_module(cache).to(device)
    calls = []
    module.model.hf.register_forward_hook(lambda *_: calls.append(1))
    return [answer.tolist() for answer in module.generate_ids(prompts)], len(calls)


def sharded_answers(device="cpu") -> dict[str, dict[str, list[list[int]]]]:
    """This rank's answers to its own prompts (``RANK_PROMPTS[rank]``) from the module sharded over every rank, by
    cache and layout: FSDP2, and FSDP2 with the experts split over 2 ranks. ``generate_ids`` asks whether a flag
    holds on every rank (``on_every_rank``) as Lightning's strategies answer it: every rank votes."""
    world, prompts = dist.get_world_size(), RANK_PROMPTS[dist.get_rank()]

    def every_rank_agrees(flag: bool, all: bool) -> bool:  # asked with all=True
        votes = torch.tensor(int(flag), device=device)
        dist.all_reduce(votes)
        return int(votes) == world

    trainer = SimpleNamespace(world_size=world, strategy=SimpleNamespace(reduce_boolean_decision=every_rank_agrees))
    layouts = {name: init_meshes(world, ep, torch.device(device).type) for name, ep in (("fsdp2", 1), ("fsdp2+ep2", 2))}
    answers = {cache: {} for cache in CACHES}
    for cache in CACHES:
        for name, meshes in layouts.items():
            module = sampling_module(cache).to(device)
            parallelize(module.model, meshes)
            module._trainer = trainer
            answers[cache][name] = [answer.tolist() for answer in module.generate_ids(prompts)]
    return answers


def _sharded_sampling_worker(rank: int, world: int, port: int, out: str) -> None:
    """Rank 0 saves every rank's :func:`sharded_answers`."""
    with _gloo_group(rank, world, port):
        answers = [None] * world
        dist.all_gather_object(answers, sharded_answers())
        if rank == 0:
            torch.save(answers, Path(out) / "results.pt")


@pytest.fixture(scope="module")
def sharded_runs(tmp_path_factory):
    return _spawn(_sharded_sampling_worker, 2, tmp_path_factory.mktemp("gloo"))


@pytest.mark.parametrize("cache", CACHES)
def test_sharded_ranks_answer_their_own_prompts_as_one_process_does(sharded_runs, cache):
    """Two processes, each with its own prompts, ``generate_ids`` with the fast sampler (threshold 0.5): each rank's
    answers are those of one unsharded process, under FSDP2 and FSDP2 + EP=2. The cached passes must run through the
    root module's FSDP hooks (which gather the embedding and LM head), and the ranks must agree on every early exit
    (a block finished, every row at EOS): otherwise one rank waits in a collective the other never joins."""
    with one_thread():
        expected, calls = zip(*(single_process_answers(cache, prompts) for prompts in RANK_PROMPTS))
    assert calls[0] != calls[1]  # alone, the ranks would stop after different numbers of passes
    for layout in ("fsdp2", "fsdp2+ep2"):
        assert [answers[cache][layout] for answers in sharded_runs] == list(expected), layout


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")
@pytest.mark.parametrize("keep", [True, False], ids=["head-at-columns", "full-head"])
def test_cuda_graph_window_passes_answer_as_the_eager_ones(keep, monkeypatch):
    """The dual cache's window pass, captured once and replayed for every later step of every block (prompts of
    different lengths: the window spans every row's block), gives the eager passes' answers."""
    model, replays = denoiser(3).cuda(), []
    monkeypatch.setattr(fast_sampler, "keeps_columns", lambda _: keep)
    replay = fast_sampler.GraphedWindow.__call__
    monkeypatch.setattr(fast_sampler.GraphedWindow, "__call__", lambda *a: replays.append(1) or replay(*a))
    kwargs = {"mask_token_id": V - 1, "pad_token_id": 0, "gen_length": 8, "steps": 8, "block_length": 4,
              "threshold": 1.5, "cache": "dual"}
    prompts = [p.cuda() for p in PROMPTS]
    eager = [o.tolist() for o in fast_generate(model, prompts, graphs=False, **kwargs)]
    assert not replays
    assert [o.tolist() for o in fast_generate(model, prompts, **kwargs)] == eager
    assert len(replays) == 5  # 2 blocks of 4 steps, each a full pass then 3 window passes; the first one is eager


@pytest.mark.parametrize("sample", [llada_generate, fast_generate])
def test_sampling_records_no_autograd_graph(sample):
    """Called outside Lightning's no-grad loops (a notebook, a bench, lm-eval), a sampler still runs without autograd:
    with it, a batch of 219 SmolLM2 prompts held 137 GiB of saved activations."""
    model, grad_enabled = denoiser(2), []
    model.hf.register_forward_pre_hook(lambda *_: grad_enabled.append(torch.is_grad_enabled()))
    run(sample, model)
    assert grad_enabled and not any(grad_enabled)
