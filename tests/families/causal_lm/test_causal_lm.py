"""Autoregressive SFT (CausalLMModule): the fused next-token loss, global normalisation, causal attention,
transformers' generate (greedy, sampled, keyed per row), learning, save_pretrained export, the CLI and a tokenizer
without a mask token."""

import json

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer

from lit_dllm import BuiltinTask, DataSource, DLLMDataModule, Loader, Tokenizer, build_default_tokenizer
from lit_dllm.cli import main
from lit_dllm.noise.keys import Stream, example_keys, keyed_categorical
from lit_dllm.families.causal_lm.module import CausalLMModule
from lit_dllm.testing import TINY_LLAMA

from tests.core.test_training_step import EOS, PAD, VOCAB, collate, make_examples, make_module, one_step
from tests.data.test_datamodule import gpt2_tokenizer
from tests.test_cli import TINY_OVERRIDES

TOK = build_default_tokenizer()


def ar_module(**kwargs) -> CausalLMModule:
    return make_module(CausalLMModule, **kwargs)


def quiet_trainer(**kwargs) -> L.Trainer:
    return L.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False, **kwargs)


def test_fused_loss_equals_cross_entropy_on_full_shifted_logits():
    module, dense = ar_module(), ar_module(fused_loss=False)
    batch = collate(make_examples())  # random prompt lengths: loss mask 0 on the prompt, 1 on the response
    shifted = module.prepare_batch(batch, None)
    count = module.token_counts(batch, shifted)["ar"]
    ids, supervised = batch["input_ids"], batch["loss_mask"].bool()
    assert int(count) == int(supervised[:, 1:].sum())  # every supervised token but one at position 0
    step = module.compute_loss(batch, shifted, {"ar": count.float()})
    logits = module.model.hf(input_ids=ids).logits  # the plain transformers forward, causal
    expected = F.cross_entropy(logits[:, :-1][supervised[:, 1:]], ids[:, 1:][supervised[:, 1:]])
    torch.testing.assert_close(step.output.total_loss, expected)
    torch.testing.assert_close(dense.compute_loss(batch, shifted, {"ar": count.float()}).output.total_loss, expected)
    params = list(module.parameters())
    for got, want in zip(torch.autograd.grad(step.output.total_loss, params, allow_unused=True),
                         torch.autograd.grad(expected, params, allow_unused=True)):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    hits = logits[:, :-1].argmax(-1) == ids[:, 1:]
    assert int(step.num_correct) == int(hits[supervised[:, 1:]].sum()) and int(step.num_scored) == int(count)


def test_next_token_accuracy_skips_padding_targets():
    module = ar_module()
    batch = collate(make_examples(n=2))
    batch["input_ids"][:, 8:], batch["input_lengths"][:] = PAD, 8  # supervised padding after 8 real tokens
    step = module.compute_loss(batch, module.prepare_batch(batch, None), {"ar": torch.tensor(1.0)})
    assert int(step.num_scored) == int(batch["loss_mask"][:, 1:8].sum())


def test_attention_stays_causal():
    """No position sees a later one: a prefix alone gives the same logits as inside the whole row."""
    module = ar_module()
    ids = torch.randint(2, VOCAB, (2, 10))
    with torch.no_grad():
        torch.testing.assert_close(module.model(ids[:, :6]), module.model(ids)[:, :6])


def test_accumulated_half_batches_give_the_full_batch_gradient():
    full, full_metrics = one_step(ar_module(), batch_size=8, accumulate=1)
    split, split_metrics = one_step(ar_module(), batch_size=4, accumulate=2)
    for name in full:
        torch.testing.assert_close(split[name], full[name], rtol=1e-5, atol=1e-7, msg=name)
    assert float(split_metrics["train/loss"]) == pytest.approx(float(full_metrics["train/loss"]), rel=1e-5)


def until_eos(answer: torch.Tensor) -> torch.Tensor:
    """``answer`` cut before its first eos."""
    ends = (answer == EOS).nonzero()
    return answer[: ends[0, 0]] if len(ends) else answer


def test_generation_equals_hf_generate_greedy_on_each_prompt_alone():
    module = ar_module()
    with torch.no_grad():  # make eos likely, so that rows stop at different steps
        module.model.hf.lm_head.weight[EOS] *= 3
    prompts = [torch.randint(2, VOCAB, (n,), generator=torch.Generator().manual_seed(n)) for n in (3, 9, 6)]
    got = module.generate_ids(prompts, max_new_tokens=7)
    module.eval()
    for prompt, answer in zip(prompts, got):
        alone = module.model.hf.generate(prompt[None], max_new_tokens=7, do_sample=False, eos_token_id=EOS,
                                         pad_token_id=PAD)[0, len(prompt):]
        assert torch.equal(answer, until_eos(alone))
    assert any(len(answer) < 7 for answer in got)  # some stopped at eos
    torch.manual_seed(0)
    sampled = ar_module(generation={"temperature": 1.0}).generate_ids(prompts, max_new_tokens=7)
    assert all(len(a) <= 7 for a in sampled) and not all(map(torch.equal, sampled, got))


def test_keyed_sampling_draws_each_token_from_the_rows_key_alone():
    """With keys, new token ``t`` of a row is the keyed inverse-CDF draw at ``t`` from the softmax of the row's own
    teacher-forced logits at the temperature: the row answers the same alone as in a batch with other prompts (of
    other lengths: left padding is masked), and the argument's temperature is the one used."""
    module = ar_module()  # greedy by default: the argument sets the temperature
    with torch.no_grad():  # eos likely: some rows end early
        module.model.hf.lm_head.weight[EOS] *= 8
    prompts = [torch.randint(2, VOCAB, (n,), generator=torch.Generator().manual_seed(n)) for n in (3, 9, 6, 4)]
    keys = example_keys(0, torch.arange(4))
    batch = module.generate_ids(prompts, 7, temperature=0.7, keys=keys)
    assert all(torch.equal(module.generate_ids([prompts[b]], 7, temperature=0.7, keys=keys[b : b + 1])[0], batch[b])
               for b in range(4))
    assert len({tuple(answer.tolist()) for answer in batch}) == 4 and min(map(len, batch)) < 7
    module.eval()
    for prompt, answer, key in zip(prompts, batch, keys):
        drawn = torch.cat([answer, answer.new_tensor([EOS])]) if len(answer) < 7 else answer  # eos: a draw too
        with torch.no_grad():
            logits = module.model.hf(torch.cat([prompt, drawn])[None]).logits[:, len(prompt) - 1 : -1]
        expected = keyed_categorical(torch.softmax(logits / 0.7, -1), key[None], Stream.RL_ROLLOUT)[0]
        assert torch.equal(drawn, expected)


def test_save_pretrained_round_trip(tmp_path):
    module = CausalLMModule(vocab_size=len(TOK), pad_token_id=TOK.pad_token_id, eos_token_id=TOK.eos_token_id,
                            backbone={"model_config": TINY_LLAMA})
    module.save_pretrained(tmp_path)  # builds the model on first use
    hf, tokenizer = AutoModelForCausalLM.from_pretrained(tmp_path), AutoTokenizer.from_pretrained(tmp_path)
    for name, param in module.model.hf.state_dict().items():
        assert torch.equal(hf.state_dict()[name], param), name
    prompt = "rev 4821="
    assert tokenizer(prompt)["input_ids"] == TOK(prompt)["input_ids"]
    ids = torch.tensor([tokenizer(prompt)["input_ids"]])
    reloaded = hf.generate(ids, max_new_tokens=8, do_sample=False)[0, ids.shape[1]:]  # eos and pad from the export
    assert torch.equal(until_eos(reloaded), module.generate_ids([ids[0]], 8)[0])


def test_learns_to_reverse_digits():
    """~300 steps of a small model on 2-3 digit reversal answer most held-out prompts exactly."""
    torch.manual_seed(0)
    data = DLLMDataModule(DataSource(path="task:reverse"), max_seq_len=16,
                          loader=Loader(batch_size=32, val_batch_size=64),
                          task=BuiltinTask(num_train=900, num_val=64, kwargs={"min_len": 2, "max_len": 3}))
    config = dict(TINY_LLAMA, hidden_size=64, intermediate_size=128)
    module = CausalLMModule(vocab_size=data.vocab_size, mask_token_id=data.mask_token_id,
                            pad_token_id=data.pad_token_id, eos_token_id=data.eos_token_id,
                            backbone={"model_config": config}, optimization={"lr": 3e-3})
    trainer = quiet_trainer(max_steps=300, val_check_interval=300, check_val_every_n_epoch=None, gradient_clip_val=1.0)
    trainer.fit(module, data)
    metrics = trainer.callback_metrics
    assert float(metrics["val/exact_match"]) >= 0.9, metrics
    assert float(metrics["val/next_token_accuracy"]) >= 0.9 and float(metrics["val/loss"]) < 0.3


def test_cli_fits_ar_tiny_then_predicts_from_the_last_checkpoint(tmp_path):
    args = ["--config", "configs/ar_tiny.yaml", *TINY_OVERRIDES, f"--trainer.logger.init_args.save_dir={tmp_path}"]
    fit = main(["fit", *args])
    assert isinstance(fit.model, CausalLMModule) and fit.trainer.global_step == 4
    assert {"val/loss", "val/next_token_accuracy", "val/exact_match"} <= set(fit.trainer.callback_metrics)
    predict = main(["predict", *args, "--ckpt_path=last", "--trainer.limit_predict_batches=1"])
    rows = predict.trainer.predict_loop.predictions[0]
    assert {"prompt", "generated", "reference"} <= set(rows[0])
    written = next(tmp_path.rglob("predictions.jsonl")).read_text().splitlines()
    assert [json.loads(line) for line in written] == rows
    exported = tmp_path / "hf"
    CausalLMModule.load_from_checkpoint(next(tmp_path.rglob("last.ckpt"))).save_pretrained(exported)
    assert AutoModelForCausalLM.from_pretrained(exported).config.eos_token_id == TOK.eos_token_id


def test_a_tokenizer_without_a_mask_token_trains_and_generates(tmp_path):
    gpt2_tokenizer(with_extras=False).save_pretrained(tmp_path / "gpt2")
    data = DLLMDataModule(DataSource(path="task:reverse", cache_dir=str(tmp_path / "cache")),
                          Tokenizer(name=str(tmp_path / "gpt2")), max_seq_len=32, loader=Loader(batch_size=4),
                          task=BuiltinTask(num_train=8, num_val=4))
    assert data.mask_token_id is None and data.pad_token_id == data.eos_token_id  # GPT-2: pad falls back to eos
    module = CausalLMModule(vocab_size=data.vocab_size, mask_token_id=data.mask_token_id,
                            pad_token_id=data.pad_token_id, eos_token_id=data.eos_token_id,
                            tokenizer_settings={"name": str(tmp_path / "gpt2")}, backbone={"model_config": TINY_LLAMA})
    trainer = quiet_trainer(max_steps=2, limit_val_batches=1)
    trainer.fit(module, data)
    assert torch.isfinite(trainer.callback_metrics["train/loss"]) and "val/exact_match" in trainer.callback_metrics
    assert isinstance(module.generate(["rev 123="], max_new_tokens=3)[0], str)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"backbone": {"model_config": None}}, "exactly one of model=None"),
        ({"backbone": {"model": "some/model", "model_config": TINY_LLAMA}}, "exactly one of model='some/model'"),
        ({"generation": {"gen_length": 0}}, r"gen_length=0 must be a positive int"),
        ({"generation": {"temperature": -1.0}}, r"temperature=-1.0 must be >= 0"),
        ({"generation": {"val_generate_batches": -1}}, "val_generate_batches=-1 must be >= 0"),
        ({"generation": {"answer_pattern": "#### \\S+"}}, "has no capture group"),
        ({"loss_chunk_size": 0}, "loss_chunk_size=0 must be a positive"),
    ],
)
def test_bad_arguments_are_clear_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        CausalLMModule(**{"vocab_size": VOCAB, "backbone": {"model_config": TINY_LLAMA}, **kwargs})
