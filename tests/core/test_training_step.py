"""The base training step: global token normalisation, keyed noise, no NaN, bidirectionality."""

import warnings
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from lit_dllm.families.mdlm.module import HybridMDLMModule, MDLMModule
from lit_dllm.settings import Optimization, Parallelism
from lit_dllm.strategies import SingleDeviceStrategy, parallelize_model
from lit_dllm.testing import TINY_LLAMA

VOCAB, MASK, PAD, EOS = 40, 39, 0, 1


def make_examples(n=8, length=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    examples = []
    for i in range(n):
        ids = torch.randint(2, MASK, (length,), generator=g)
        prompt = int(torch.randint(1, length - 2, (1,), generator=g))
        loss_mask = torch.zeros(length)
        loss_mask[prompt:] = 1.0
        examples.append({"input_ids": ids, "loss_mask": loss_mask, "example_index": torch.tensor(i)})
    return examples


def collate(rows):
    return {
        "input_ids": torch.stack([r["input_ids"] for r in rows]),
        "loss_mask": torch.stack([r["loss_mask"] for r in rows]),
        "attention_mask": torch.ones(len(rows), len(rows[0]["input_ids"]), dtype=torch.long),
        "input_lengths": torch.full((len(rows),), len(rows[0]["input_ids"])),
        "example_index": torch.stack([r["example_index"] for r in rows]),
    }


def sgd(groups):
    return torch.optim.SGD(groups, lr=1.0)


def make_module(cls=MDLMModule, optimizer=sgd, generation: dict | None = None, **kwargs):
    torch.manual_seed(0)
    config = dict(TINY_LLAMA, max_position_embeddings=64)
    module = cls(
        vocab_size=VOCAB, mask_token_id=MASK, pad_token_id=PAD, eos_token_id=EOS,
        backbone={"model_config": config, "attn_implementation": "eager"},
        optimization={"optimizer": optimizer, "warmup": 0, "weight_decay": 0.0},
        generation={"val_generate_batches": 0, **(generation or {})},
        **kwargs,
    )
    module.configure_model()
    return module


def one_step(module, batch_size, accumulate, accelerator="cpu"):
    loader = DataLoader(make_examples(), batch_size=batch_size, collate_fn=collate)
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    trainer = L.Trainer(
        max_steps=1, accumulate_grad_batches=accumulate, accelerator=accelerator, devices=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
    )
    trainer.fit(module, loader)
    return {n: before[n] - p.detach() for n, p in module.named_parameters()}, trainer.callback_metrics


@pytest.mark.parametrize("cls", [MDLMModule, HybridMDLMModule])
def test_accumulated_half_batches_give_the_full_batch_gradient(cls):
    extra = {} if cls is MDLMModule else {"diffusion_normalization": "supervised"}
    full, full_metrics = one_step(make_module(cls, **extra), batch_size=8, accumulate=1)
    split, split_metrics = one_step(make_module(cls, **extra), batch_size=4, accumulate=2)
    for name in full:
        torch.testing.assert_close(split[name], full[name], rtol=1e-5, atol=1e-7, msg=name)
    assert abs(float(full_metrics["train/loss"]) - float(split_metrics["train/loss"])) < 1e-5
    assert float(full_metrics["train/supervised_tokens"]) == float(split_metrics["train/supervised_tokens"])
    norm = float(full_metrics["train/grad_norm"])  # logged before clipping, the same for either split
    assert norm > 0 and abs(norm - float(split_metrics["train/grad_norm"])) < 1e-5 * norm
    if cls is HybridMDLMModule:  # every loss term is logged: total = diffusion + AR (alpha = 1)
        terms = float(full_metrics["train/dllm_loss"]) + float(full_metrics["train/ar_loss"])
        assert float(full_metrics["train/loss"]) == pytest.approx(terms, rel=1e-6)
        assert float(split_metrics["train/ar_loss"]) == pytest.approx(float(full_metrics["train/ar_loss"]), rel=1e-5)


class SyncRecordingMDLM(MDLMModule):
    """Records where ``on_before_optimizer_step`` makes the host wait for the device (``file:line``)."""

    def on_before_optimizer_step(self, optimizer) -> None:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                super().on_before_optimizer_step(optimizer)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        self.syncs = [f"{w.filename}:{w.lineno}" for w in caught if "synchronizing CUDA operation" in str(w.message)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_accumulated_gradients_are_rescaled_without_waiting_for_the_gpu():
    """With fused AdamW (its finite check stays on the device), the hook before the update (the rescale of accumulated
    gradients, their norm, the logs) never waits for the device: a wait there idles it while the host launches the
    update."""
    module = make_module(SyncRecordingMDLM, optimizer=lambda groups: torch.optim.AdamW(groups, fused=True))
    one_step(module, batch_size=4, accumulate=2, accelerator="gpu")
    assert module.syncs == []


def test_noise_depends_on_the_example_not_on_its_batch():
    module = make_module()
    examples = make_examples()
    whole = module.corrupt(collate(examples), module.noise_keys(collate(examples), 0))
    part = module.corrupt(collate(examples[5:7]), module.noise_keys(collate(examples[5:7]), 0))
    assert torch.equal(whole["noisy_ids"][5:7], part["noisy_ids"])
    other_epoch = module.corrupt(collate(examples), module.noise_keys(collate(examples), 1))
    assert not torch.equal(whole["noise_mask"], other_epoch["noise_mask"])


def test_attention_is_bidirectional():
    module = make_module()
    ids = torch.randint(2, MASK, (2, 10))
    changed = ids.clone()
    changed[:, -1] = (changed[:, -1] + 1) % MASK
    with torch.no_grad():
        delta = (module.model(ids)[:, 0] - module.model(changed)[:, 0]).abs().max()
    assert delta > 1e-4


def test_no_nan_without_supervision_or_noise():
    module = make_module(cls=HybridMDLMModule)
    batch = collate(make_examples(n=2))
    batch["loss_mask"].zero_()
    noisy = module.prepare_batch(batch, module.noise_keys(batch, 0))
    step = module.compute_loss(batch, noisy, {"diffusion": torch.tensor(1.0), "ar": torch.tensor(1.0)})
    assert step.output.total_loss.item() == 0.0
    step.output.total_loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in module.parameters() if p.grad is not None)


@pytest.mark.parametrize("cls", [MDLMModule, HybridMDLMModule])
def test_fused_loss_equals_the_public_losses_on_full_logits(cls):
    from lit_dllm.reference.losses import HybridDiffusionLLMLoss, MDLMCrossEntropyLoss

    fused = make_module(cls)
    dense = make_module(cls, fused_loss=False)
    batch = collate(make_examples())
    noisy = fused.prepare_batch(batch, fused.noise_keys(batch, 0))
    denominators = {"diffusion": torch.tensor(37.0), "ar": torch.tensor(41.0)}
    got = fused.compute_loss(batch, noisy, denominators).output.total_loss
    dense_loss = dense.compute_loss(batch, noisy, denominators).output.total_loss
    assert torch.allclose(dense_loss, got, atol=1e-6)
    # the fused head forms its gradients in the forward pass; they equal plain autograd's on the full logits
    (got * 3.0).backward()
    (dense_loss * 3.0).backward()
    for (name, param), other in zip(fused.named_parameters(), dense.parameters()):
        torch.testing.assert_close(param.grad, other.grad, atol=1e-6, rtol=1e-5, msg=name)
    with torch.no_grad():
        logits = fused.model(noisy["noisy_ids"])
        args = (logits, batch["input_ids"], noisy["noise_mask"], noisy["p_mask"], batch["loss_mask"])
        if cls is MDLMModule:
            expected = MDLMCrossEntropyLoss()(*args, num_diffusion_tokens=37).total_loss
        else:
            causal = fused.model(batch["input_ids"], causal=True)
            expected = HybridDiffusionLLMLoss()(
                *args, loss_mask_ar=batch["loss_mask"], num_diffusion_tokens=37, num_ar_tokens=41, causal_logits=causal
            ).total_loss
    assert torch.allclose(got, expected, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_bf16_mixed_training_lowers_the_loss():
    module = make_module()
    module.optimization = Optimization(lr=3e-3)
    losses = []

    class Record(L.Callback):
        def on_train_batch_end(self, trainer, *args):
            losses.append(float(trainer.callback_metrics["train/loss"]))

    examples = make_examples(n=64)
    for row in examples:  # constant rows: every visible token tells what the masked ones are
        row["input_ids"][:] = row["input_ids"][0]
    loader = DataLoader(examples, batch_size=16, collate_fn=collate)
    L.Trainer(max_steps=60, accelerator="gpu", devices=1, precision="bf16-mixed", logger=False,
              enable_checkpointing=False, enable_progress_bar=False, limit_val_batches=0,
              callbacks=[Record()]).fit(module, loader)
    assert all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[-10:]) < 0.8 * sum(losses[:10])


def test_two_data_parallel_ranks_give_the_single_process_gradient():
    """DDP on two CPU processes (gloo), half the batch each, equals one process with the whole batch."""
    full, _ = one_step(make_module(), batch_size=8, accumulate=1)
    module = make_module()
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    trainer = L.Trainer(
        max_steps=1, accelerator="cpu", devices=2, strategy="ddp_spawn", logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
    )
    trainer.fit(module, DataLoader(make_examples(), batch_size=4, collate_fn=collate))
    for name, param in module.named_parameters():
        torch.testing.assert_close(before[name] - param.detach(), full[name], rtol=1e-5, atol=1e-7, msg=name)


def run_under(module, **settings):
    """``module``'s model with the plan of a :class:`SingleDeviceStrategy` of ``settings`` applied (on the CPU)."""
    strategy = SingleDeviceStrategy(parallelism=Parallelism(**settings))
    module.model = parallelize_model(module.model, SimpleNamespace(precision="32-true", strategy=strategy))
    return module


def test_activation_checkpointing_changes_nothing_but_memory():
    plain, checkpointed = make_module(), run_under(make_module(), activation_checkpointing=True)
    assert checkpointed.model.hf.is_gradient_checkpointing and not plain.model.hf.is_gradient_checkpointing
    batch = collate(make_examples())
    grads = []
    for module in (plain, checkpointed):
        module.train()
        noisy = module.corrupt(batch, module.noise_keys(batch, 0))
        module.compute_loss(batch, noisy, {"diffusion": torch.tensor(50.0)}).output.total_loss.backward()
        grads.append({n: p.grad for n, p in module.named_parameters()})
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], msg=name)


def test_masked_accuracy_counts_real_tokens_only():
    """A model that always predicts padding scores 0, however much supervised padding is masked."""
    from lit_dllm.families.mdlm.model import TokenNLL

    class PredictsPadding(torch.nn.Module):
        def forward(self, input_ids, targets, positions, causal=False, weights=None):
            chosen = targets[positions]
            return TokenNLL(torch.zeros(chosen.shape), chosen == PAD, torch.zeros(()))

    module = make_module()
    module.model = PredictsPadding()
    batch = collate(make_examples(n=4))
    batch["input_ids"][:, 8:] = PAD  # the last 4 positions are supervised padding (LLaDA-style SFT)
    batch["input_lengths"][:] = 8
    noisy = module.corrupt(batch, module.noise_keys(batch, 0))
    assert noisy["noise_mask"][:, 8:].any()  # padding was masked too
    step = module.compute_loss(batch, noisy, {"diffusion": batch["loss_mask"].sum()})
    assert int(step.num_scored) == int(noisy["noise_mask"][:, :8].sum()) > 0
    assert int(step.num_correct) == 0


def test_frozen_modules_stay_frozen_and_out_of_checkpoints(tmp_path):
    module = make_module(frozen_modules=["model.hf.model.embed_tokens"])
    embed = module.model.hf.model.embed_tokens
    assert not any(p.requires_grad for p in embed.parameters()) and not embed.training
    before = embed.weight.detach().clone()
    grads, _ = one_step(module, batch_size=8, accumulate=1)
    assert torch.equal(embed.weight, before) and not embed.training  # Lightning's train() left it in eval
    optimized = {id(p) for group in module.trainer.optimizers[0].param_groups for p in group["params"]}
    assert id(embed.weight) not in optimized
    path = tmp_path / "frozen.ckpt"
    module.trainer.save_checkpoint(path)
    saved = torch.load(path, weights_only=False)["state_dict"]
    assert not any(key.startswith("model.hf.model.embed_tokens.") for key in saved)
    reloaded = MDLMModule.load_from_checkpoint(path)  # frozen weights come from build_model, the rest from the file
    assert torch.equal(reloaded.model.hf.model.layers[0].mlp.up_proj.weight, module.model.hf.model.layers[0].mlp.up_proj.weight)
    with pytest.raises(ValueError, match="frozen_modules: no submodule 'model.nope'"):
        make_module(frozen_modules=["model.nope"])
