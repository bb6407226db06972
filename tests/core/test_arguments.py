"""Bad generation arguments, model-config typos and too-short position tables fail early and clearly."""

import re
import warnings

import lightning as L
import pytest
import torch

from lit_dllm import (
    BuiltinTask,
    CausalBackbone,
    DataSource,
    DenoisingGeneration,
    DFlashGeneration,
    DLLMDataModule,
    Loader,
    Generation,
    LLaDAGeneration,
    MDLMModule,
)
from lit_dllm.hub.hf import load_causal_lm
from lit_dllm.settings import settings_group
from lit_dllm.testing import TINY_LLAMA, TINY_MOE

TINY_GPT2 = {"model_type": "gpt2", "n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 128}


def module(generation: dict | None = None, model_config: dict = TINY_LLAMA, **kwargs):
    return MDLMModule(40, 39, backbone=CausalBackbone(model_config=model_config),
                      generation=LLaDAGeneration(**(generation or {})), **kwargs)


# ---------------------------------------------------------------------------- generation arguments


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"gen_length": 0}, "gen_length=0 must be a positive int, or None (the reference answer's length)"),
        ({"gen_steps": -1}, "gen_steps=-1 must be a positive int, or None (one token per step with LLaDA"),
        ({"gen_block_length": 0}, "gen_block_length=0 must be a positive int, or None (one block)"),
        ({"gen_length": 10, "gen_block_length": 4}, "gen_length=10 is not a multiple of gen_block_length=4"),
        ({"remasking": "greedy"}, "remasking='greedy'; use 'low_confidence' or 'random'"),
        ({"temperature": -0.5}, "temperature=-0.5 must be >= 0 (0: greedy)"),
        ({"val_generate_batches": -1}, "val_generate_batches=-1 must be >= 0 (0: no generation)"),
        ({"answer_pattern": r"#### \S+"}, r"answer_pattern='#### \\S+' has no capture group"),
        ({"answer_pattern": r"#### (\S+"}, r"answer_pattern='#### (\\S+' is not a valid regular expression"),
    ],
)
def test_bad_generation_arguments_fail_at_construction(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        module(generation=kwargs)


@pytest.mark.parametrize(
    "kind, kwargs, message",
    [
        (Generation, {"gen_length": 1.5}, "gen_length=1.5 must be a positive int, or None"),
        (Generation, {"temperature": -1.0}, "temperature=-1.0 must be >= 0 (0: greedy)"),
        (DenoisingGeneration, {"gen_steps": 0}, "gen_steps=0 must be a positive int, or None (one token per step"),
        (LLaDAGeneration, {"sampler": "greedy"}, "sampler='greedy'; use 'llada' or 'fast'"),
        (LLaDAGeneration, {"gen_threshold": 0}, "gen_threshold=0 must be a number > 0"),
        (LLaDAGeneration, {"gen_cache": "all"}, "gen_cache='all'; use 'none', 'prefix' or 'dual'"),
        (DFlashGeneration, {"val_temperature": -1.0}, "val_temperature=-1.0 must be >= 0"),
    ],
)
def test_each_generation_group_names_its_bad_value(kind, kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        kind(**kwargs).check()
    with pytest.raises(ValueError, match=re.escape(message)):
        settings_group("generation", kind, kwargs)


def test_good_generation_arguments_pass_silently():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        module(generation={"gen_length": 256, "gen_block_length": 32, "gen_steps": 128, "remasking": "random",
                           "temperature": 0.5, "val_generate_batches": 0, "answer_pattern": r"#### (\S+)"},
               corruption="blockwise", block_size=8)
        module(generation={"gen_length": 10})  # no block length: one block of any length


def test_block_size_with_uniform_corruption_warns():
    with pytest.warns(UserWarning, match=r"block_size=8 is unused with corruption='uniform'.*corruption='blockwise'"):
        module(block_size=8)


# ---------------------------------------------------------------------------- model config keys


@pytest.mark.parametrize(
    "config, message",
    [
        ({"model_type": "llama", "num_hidden_layer": 2}, r"\['num_hidden_layer'\].*model_type='llama'.*num_hidden_layers"),
        ({"model_type": "qwen3", "hiden_size": 32, "rope_theeta": 1.0}, r"\['hiden_size', 'rope_theeta'\].*hidden_size.*rope_theta"),
    ],
)
def test_model_config_typos_are_named_with_close_matches(config, message):
    with pytest.raises(ValueError, match=message):
        load_causal_lm(config=config)


@pytest.mark.parametrize("model_type", ["llama", "qwen3", "gemma2", "mistral"])
def test_legitimate_model_config_keys_take_effect(model_type):
    config = dict(TINY_LLAMA, model_type=model_type, vocab_size=48, head_dim=8, tie_word_embeddings=True,
                  rope_theta=5000.0, pad_token_id=0)
    hf = load_causal_lm(config=config).config
    assert (hf.num_hidden_layers, hf.num_key_value_heads, hf.head_dim, hf.vocab_size) == (2, 2, 8, 48)
    assert (hf.max_position_embeddings, hf.tie_word_embeddings, hf.pad_token_id) == (128, True, 0)
    assert hf.rope_parameters["rope_theta"] == 5000.0


def test_head_dim_reaches_qwen3_moe_whose_config_does_not_declare_it():
    hf = load_causal_lm(config=dict(TINY_MOE, vocab_size=48, head_dim=16))  # hidden 32 / 4 heads would give 8
    attention = hf.model.layers[0].self_attn
    assert (attention.head_dim, attention.q_proj.out_features, attention.k_proj.out_features) == (16, 64, 32)


def test_aliased_config_keys_are_known():
    hf = load_causal_lm(config=dict(TINY_GPT2, vocab_size=48)).config
    assert (hf.hidden_size, hf.num_hidden_layers, hf.max_position_embeddings) == (32, 2, 128)


# ---------------------------------------------------------------------------- position limits


def test_max_seq_len_beyond_max_position_embeddings_warns_when_the_model_is_built():
    dm = DLLMDataModule(DataSource(path="task:reverse"), max_seq_len=32, loader=Loader(batch_size=8),
                        task=BuiltinTask(num_train=16, num_val=8))
    m = MDLMModule(vocab_size=dm.vocab_size, mask_token_id=dm.mask_token_id, pad_token_id=dm.pad_token_id,
                   backbone=CausalBackbone(model_config=dict(TINY_LLAMA, max_position_embeddings=16)),
                   generation=LLaDAGeneration(val_generate_batches=0))
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=1)
    with pytest.warns(UserWarning, match=r"max_position_embeddings=16 < the data's max_seq_len=32.*Raise max_position_embeddings"):
        trainer.validate(m, dm)  # RoPE: runs past the table; an absolute-position model would fail


@pytest.mark.parametrize("config", [dict(TINY_LLAMA, max_position_embeddings=16), dict(TINY_GPT2, n_positions=16)])
def test_generation_beyond_max_position_embeddings_is_a_clear_error(config):
    m = module(model_config=config, generation={"gen_length": 8})
    m.configure_model()
    with pytest.raises(ValueError, match=r"prompt \(10 tokens\) \+ gen_length 8 = 18 positions > max_position_embeddings=16"):
        m.generate_ids([torch.arange(3, 13), torch.arange(3, 8)])
    assert len(m.generate_ids([torch.arange(3, 11)])[0]) <= 8  # 8 + 8 = 16 fits


@pytest.mark.parametrize("multiple", [0, -64])
def test_pad_vocab_multiple_of_must_be_positive(multiple):
    with pytest.raises(ValueError, match=rf"pad_vocab_multiple_of={multiple} must be a positive int, or None"):
        CausalBackbone(model="some/model", pad_vocab_multiple_of=multiple).check()


@pytest.mark.parametrize("pattern", [None, "None"])
def test_an_answer_pattern_lost_to_a_yaml_comment_is_an_error_naming_the_quoting(pattern):
    """``answer_pattern: #### (\\S+)`` unquoted is a YAML comment: the key arrives empty (None, or 'None' on the command
    line) and the run would score whole answers without a word."""
    with pytest.raises(ValueError, match=r"no pattern arrived .* Quote it: answer_pattern: '#### \(\\S\+\)'"):
        Generation(answer_pattern=pattern).check()
