"""Backbones load like real checkpoints (local path), any causal-LM family works, text pre-training runs."""

import lightning as L
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from lit_dllm import CausalLMModule, DataSource, DLLMDataModule, Loader, MDLMModule
from lit_dllm.testing import TINY_LLAMA


def bidirectional(module, vocab):
    ids = torch.randint(3, vocab, (1, 8))
    changed = ids.clone()
    changed[0, -1] = 3 if ids[0, -1] != 3 else 4
    with torch.no_grad():
        return (module.model(ids)[0, 0] - module.model(changed)[0, 0]).abs().max() > 1e-5


def test_a_saved_checkpoint_loads_from_its_local_path(tmp_path):
    config = dict(TINY_LLAMA)
    hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(config.pop("model_type"), vocab_size=50, **config))
    hf.save_pretrained(tmp_path)
    module = MDLMModule(vocab_size=50, mask_token_id=49, backbone={"model": str(tmp_path)})
    module.configure_model()
    for name, param in hf.state_dict().items():
        assert torch.equal(module.model.hf.state_dict()[name], param), name
    assert bidirectional(module, 50)


@pytest.mark.parametrize("model_type", ["qwen3", "gemma2", "mistral"])
def test_other_causal_lm_families_run_bidirectionally(model_type):
    config = dict(TINY_LLAMA, model_type=model_type, head_dim=8)
    module = MDLMModule(vocab_size=40, mask_token_id=39, backbone={"model_config": config, "attn_implementation": "eager"})
    module.configure_model()
    assert bidirectional(module, 40)


def test_pretraining_on_plain_text(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(f"the number {i} is {'even' if i % 2 == 0 else 'odd'}." for i in range(200)))
    data = DLLMDataModule(DataSource(path=str(corpus)), max_seq_len=32, loader=Loader(batch_size=8))
    module = MDLMModule(vocab_size=data.vocab_size, mask_token_id=data.mask_token_id, pad_token_id=data.pad_token_id,
                        eos_token_id=data.eos_token_id, backbone={"model_config": TINY_LLAMA},
                        generation={"val_generate_batches": 1})
    trainer = L.Trainer(max_steps=5, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, limit_val_batches=1, val_check_interval=5)
    trainer.fit(module, data)
    batch = next(iter(data.train_dataloader()))
    assert (batch["loss_mask"] == 1).all()  # packed text: every token supervised
    assert torch.isfinite(trainer.callback_metrics["train/loss"]) and torch.isfinite(trainer.callback_metrics["val/loss"])
    assert "val/exact_match" not in trainer.callback_metrics  # no prompts, no answers to score


@pytest.mark.parametrize(("model_type", "attention", "maskless"), [
    ("llama", "sdpa", True), ("qwen3", "sdpa", True), ("llama", "eager", False),
    ("gemma3_text", "sdpa", False),  # sliding-window layers: a window mask would make the pass bidirectional
])
def test_the_hybrid_causal_pass_is_causal_and_asks_sdpa_for_it_without_a_mask(monkeypatch, model_type, attention,
                                                                               maskless):
    from lit_dllm import HybridMDLMModule
    from lit_dllm.families.mdlm.model import causal_additive_mask

    config = dict(TINY_LLAMA, model_type=model_type, head_dim=8)
    module = HybridMDLMModule(vocab_size=40, mask_token_id=39,
                              backbone={"model_config": config, "attn_implementation": attention})
    module.configure_model()
    ids = torch.randint(3, 39, (2, 12))
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(*args, **kwargs):
        calls.append((kwargs.get("attn_mask") is None, kwargs.get("is_causal")))
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    with torch.no_grad():
        causal = module.model(ids, causal=True)
        expected = module.model.hf(ids, attention_mask=causal_additive_mask(2, 12, torch.float32, ids.device)).logits
        changed = ids.clone()
        changed[:, -1] = 3 + (ids[:, -1] - 2) % 36  # a later token never changes earlier outputs
        later = module.model(changed, causal=True)
    torch.testing.assert_close(causal, expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(later[:, :-1], causal[:, :-1], rtol=0, atol=1e-6)
    assert module.model.causal_without_mask == maskless
    if maskless:
        assert calls and all(call == (True, True) for call in calls[:config["num_hidden_layers"]])


def test_a_pretrained_model_grows_its_embeddings_for_an_added_mask_token(tmp_path):
    """The tokenizer's added mask token (id 50) gets a new embedding row, padded to a multiple of 8: every new row
    is the mean of the old ones, the old rows and the tied head are untouched, and a checkpoint and the export keep
    the grown size."""
    config = dict(TINY_LLAMA, tie_word_embeddings=True)
    hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(config.pop("model_type"), vocab_size=50, **config))
    hf.save_pretrained(tmp_path / "base")
    old = hf.get_input_embeddings().weight.detach()
    module = CausalLMModule(vocab_size=51, mask_token_id=50,
                            backbone={"model": str(tmp_path / "base"), "pad_vocab_multiple_of": 8})
    module.configure_model()
    grown = module.model.hf.get_input_embeddings().weight.detach()
    assert grown.shape == (56, 32) and module.model.hf.config.vocab_size == 56
    assert torch.equal(grown[:50], old)
    assert torch.allclose(grown[50:], old.mean(0).expand(6, -1))
    assert module.model.hf.get_output_embeddings().weight is module.model.hf.get_input_embeddings().weight
    module.save_pretrained(tmp_path / "export")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "export")
    assert torch.equal(reloaded.get_input_embeddings().weight, grown)


def test_a_model_config_smaller_than_the_tokenizer_is_an_error():
    module = CausalLMModule(vocab_size=51, backbone={"model_config": dict(TINY_LLAMA, vocab_size=40)})
    with pytest.raises(ValueError, match="model_config's vocab_size=40 is smaller than the tokenizer's 51"):
        module.configure_model()
