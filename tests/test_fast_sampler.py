"""The Fast-dLLM sampler: LLaDA exactly without threshold and cache, threshold decoding, and what of the KV cache
is exact (a cache refreshed on the current canvas; any cache of a one-layer model)."""

import re
from types import SimpleNamespace

import pytest
import torch

from lit_dllm import MDLMModule
from lit_dllm.models.diffusion_lm import DiffusionLM
from lit_dllm.models.hf import load_causal_lm
from lit_dllm.sampling.fast import block_start_pass, fast_generate, keep_outside, window_pass
from lit_dllm.sampling.llada import llada_generate

from .conftest import TINY_LLAMA
from .test_sampling import EOS, MASK, PAD, oracle

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


@pytest.mark.parametrize("remasking, temperature", [("low_confidence", 0.0), ("random", 0.0), ("low_confidence", 1.0)])
@pytest.mark.parametrize("steps, block_length", [(8, 4), (4, 4), (2, 8), (8, 2)])
def test_without_threshold_or_cache_it_is_llada(remasking, temperature, steps, block_length):
    model = denoiser(2)
    kwargs = dict(steps=steps, block_length=block_length, remasking=remasking, temperature=temperature)
    expected = run(llada_generate, model, **kwargs)
    assert run(fast_generate, model, threshold=1.5, cache="none", **kwargs) == expected
    assert any(len(o) < 8 for o in expected)  # a row stops at EOS: the EOS fill is covered too


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


@pytest.mark.parametrize("start, end", [(4, 13), (4, 9)], ids=["prefix", "dual"])
def test_a_cache_of_the_current_canvas_gives_the_full_pass_logits(start, end):
    """Positions, cache columns and the bidirectional mask are right: only staleness makes the cache approximate."""
    model, x = denoiser(3), torch.randint(0, V, (2, 13))
    _, kv = block_start_pass(model.hf, x)
    kv = keep_outside(kv, start, end)
    for _ in range(2):  # the window pass leaves the cache as it found it
        torch.testing.assert_close(window_pass(model.hf, x, kv, start, end), model(x)[:, start:end])


@pytest.mark.parametrize("cache", ["prefix", "dual"])
@pytest.mark.parametrize("threshold", [0.2, 1.5])
def test_the_cache_is_exact_for_one_layer(cache, threshold):
    """One layer's keys / values depend only on the tokens, and cached columns keep theirs through a block."""
    model = denoiser(1)
    expected = run(fast_generate, model, threshold=threshold, cache="none")
    assert run(fast_generate, model, threshold=threshold, cache=cache) == expected


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


def module(**kwargs):
    return MDLMModule(**{"vocab_size": V, "mask_token_id": V - 1, "eos_token_id": 1, "model_config": TINY_LLAMA,
                         "gen_length": 8, "gen_block_length": 4, **kwargs})


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"sampler": "dream"}, "sampler='dream'; use 'llada' or 'fast'"),
        ({"gen_threshold": 0.0}, "gen_threshold=0.0 must be a number > 0"),
        ({"gen_threshold": "high"}, "gen_threshold='high' must be a number > 0"),
        ({"gen_cache": "full"}, "gen_cache='full'; use 'none', 'prefix' or 'dual'"),
    ],
)
def test_bad_sampler_hyperparameters_fail_at_construction(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        module(**kwargs)


@pytest.mark.parametrize("cache", ["none", "dual"])
def test_the_module_generates_with_the_chosen_sampler(cache):
    fast = module(sampler="fast", gen_threshold=0.2, gen_cache=cache)
    fast.configure_model()
    reference = module()
    reference.configure_model()
    reference.load_state_dict(fast.state_dict())
    kwargs = dict(mask_token_id=V - 1, pad_token_id=0, eos_token_id=1, gen_length=8, steps=8, block_length=4)
    with torch.no_grad():
        expected = fast_generate(fast.model.eval(), PROMPTS, threshold=0.2, cache=cache, **kwargs)
        assert [o.tolist() for o in fast.generate_ids(PROMPTS)] == [o.tolist() for o in expected]
        expected = llada_generate(reference.model.eval(), PROMPTS, **kwargs)
        assert [o.tolist() for o in reference.generate_ids(PROMPTS)] == [o.tolist() for o in expected]
