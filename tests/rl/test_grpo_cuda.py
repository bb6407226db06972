"""The RL modules on a GPU: a whole fit (rollouts, rewards, updates, validation) of each policy in bf16-mixed, with
each dLLM sampler and estimator: everything a step builds lands on the module's device. Skipped without CUDA."""

import lightning as L
import pytest
import torch

from lit_dllm import CausalGRPOModule, DiffuGRPOModule
from tests.rl.test_grpo import data, policy

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize(("cls", "sampler", "rl"), [
    (DiffuGRPOModule, "llada", {}), (DiffuGRPOModule, "fast", {}), (CausalGRPOModule, None, {}),
    (DiffuGRPOModule, "fast", {"estimator": "elbo", "mc_samples": 2, "objective": "sequence"}),
    (DiffuGRPOModule, "fast", {"estimator": "exact", "objective": "weighted"})])
def test_a_fit_on_the_gpu_moves_the_policy_and_logs_finite_values(tmp_path, cls, sampler, rl):
    dm = data(tmp_path)
    generation = {"gen_length": 4, **({"sampler": sampler} if sampler else {})}
    if rl.get("estimator") == "exact":
        generation["gen_block_length"] = 1
    module = policy(dm, cls, generation=generation, inner_updates=2, **rl)
    before = [p.detach().clone() for p in module.parameters()]
    devices = []
    module.on_train_batch_start = lambda *args: devices.append(module.device.type)
    trainer = L.Trainer(max_steps=4, accelerator="gpu", devices=1, precision="bf16-mixed", logger=False,
                        enable_progress_bar=False, enable_checkpointing=False, default_root_dir=tmp_path,
                        val_check_interval=2, check_val_every_n_epoch=None, limit_val_batches=1)
    trainer.fit(module, dm)
    metrics = trainer.callback_metrics
    assert devices == ["cuda"] * 2 and trainer.global_step == 4  # 2 batches of rollouts, 2 updates each
    assert {"train/reward", "train/loss", "val/accuracy", "train/peak_gib_update", "train/tied_groups"} <= set(metrics)
    assert all(torch.isfinite(value).all() for value in metrics.values())
    assert any(not torch.equal(b, p.detach().cpu()) for b, p in zip(before, module.parameters()))
