"""The strategy owns how to run (:mod:`lit_dllm.strategies`): run settings live on it, not on the module, so a
checkpoint holds no machine layout and resumes under another strategy."""

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch
import yaml
from lightning.pytorch.strategies import DDPStrategy

import lit_dllm
from lit_dllm import Parallelism, SingleDeviceStrategy
from lit_dllm.cli import main
from lit_dllm.upgrade import RUN_SETTINGS
from lit_dllm.strategies import parallelize_model, plan

ROOT = Path(__file__).resolve().parents[1]
RUN = ["--config", "configs/mdlm_tiny.yaml", "--trainer.limit_val_batches=0", "--trainer.enable_progress_bar=false",
       "--data.init_args.task.num_train=64", "--model.init_args.generation.val_generate_batches=0",
       "--trainer.callbacks=[{class_path: lightning.pytorch.callbacks.ModelCheckpoint, init_args: {save_last: true}}]"]
FSDP2 = ["--trainer.devices=2", "--trainer.strategy=lit_dllm.ExpertParallelStrategy",
         "--trainer.strategy.init_args.save_distributed_checkpoint=false", "--data.init_args.loader.batch_size=8"]


def train_py(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "train.py", "fit", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)


def load(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


def test_an_fsdp2_run_resumes_in_one_process_and_back(tmp_path):
    """FSDP2 over two gloo ranks (batch 8 each) -> one process (batch 16, the same global batch) -> FSDP2 again: each
    call continues from the last one's step with its weights, and no checkpoint records the layout."""
    out = [*RUN, f"--trainer.logger.init_args.save_dir={tmp_path}"]
    last = tmp_path / "mdlm_tiny" / "checkpoints" / "last.ckpt"
    steps = [("--trainer.max_steps=2", *FSDP2), ("--trainer.max_steps=4", "--data.init_args.loader.batch_size=16"),
             ("--trainer.max_steps=6", *FSDP2)]
    for index, call in enumerate(steps):
        before = load(last)["state_dict"] if index else None
        result = train_py(*out, *call, *(["--ckpt_path", "last"] if index else []))
        assert result.returncode == 0, result.stderr[-3000:]
        checkpoint = load(last)
        assert checkpoint["global_step"] == 2 * (index + 1)
        hparams = checkpoint["hyper_parameters"]
        assert not set(RUN_SETTINGS) & set(hparams) and "parallelism" not in hparams
        assert "activation_checkpointing" not in hparams["backbone"]
        if before is not None:  # trained on from the previous call's weights: every tensor moved, none reset
            assert checkpoint["state_dict"].keys() == before.keys()
            assert any(not torch.equal(checkpoint["state_dict"][k], before[k]) for k in before)


def test_compile_on_then_off_resumes_the_same_weights(tmp_path, monkeypatch):
    """Compiled blocks keep the eager state-dict keys, so a compiled run's checkpoint resumes without compile."""
    monkeypatch.setattr("lit_dllm.parallel.COMPILE_BACKEND", "eager")
    args = [*RUN, f"--trainer.logger.init_args.save_dir={tmp_path}", "--data.init_args.loader.batch_size=16"]
    compiled = main(["fit", *args, "--trainer.max_steps=2", "--trainer.strategy=lit_dllm.SingleDeviceStrategy",
                     "--trainer.strategy.init_args.parallelism.compile=true"])
    assert hasattr(compiled.model.model.hf.model.layers[0].forward, "_torchdynamo_orig_callable")  # compiled in place
    saved = load(tmp_path / "mdlm_tiny" / "checkpoints" / "last.ckpt")
    eager = main(["fit", *args, "--trainer.max_steps=3", "--ckpt_path", "last"])
    assert eager.trainer.global_step == 3 and plan(eager.trainer.strategy) == Parallelism()
    assert set(saved["state_dict"]) == set(eager.model.state_dict())


def test_parallelism_names_a_bad_value():
    with pytest.raises(ValueError, match="fp8='fp4' is not a float8 recipe"):
        SingleDeviceStrategy(parallelism=Parallelism(fp8="fp4"))
    with pytest.raises(ValueError, match="fsdp_reduce_dtype='float16' is not a dtype"):
        SingleDeviceStrategy(parallelism={"fsdp_reduce_dtype": "float16"})


def test_single_device_strategy_takes_the_trainers_device_and_refuses_more():
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=SingleDeviceStrategy(), logger=False)
    assert trainer.strategy.root_device == torch.device("cpu")
    two = L.Trainer(accelerator="cpu", devices=2, strategy=SingleDeviceStrategy(), logger=False)
    with pytest.raises(ValueError, match=r"runs on one device, but the trainer asks for 2 .* set trainer\.devices: 1"):
        two.strategy.root_device


def test_lightnings_own_strategies_run_the_default_plan_and_ours_their_own():
    assert plan(DDPStrategy()) == Parallelism()
    assert plan(SingleDeviceStrategy(parallelism=Parallelism(compile=False))).compile is False
    ddp = lit_dllm.DDPStrategy(parallelism={"compile": False}, find_unused_parameters=True)
    assert plan(ddp).compile is False and ddp._ddp_kwargs == {"find_unused_parameters": True}  # passed through


def test_switching_to_ddp_on_the_command_line_keeps_a_configs_run_settings(capsys):
    with pytest.raises(SystemExit):
        main(["fit", "--config", "configs/mdlm_smollm2_gsm8k.yaml", "--trainer.strategy.class_path=lit_dllm.DDPStrategy",
              "--print_config"])
    strategy = yaml.safe_load(capsys.readouterr().out)["trainer"]["strategy"]
    assert strategy["class_path"] == "lit_dllm.DDPStrategy"
    assert strategy["init_args"]["parallelism"]["compile"] is False  # the config's, kept across the switch


@pytest.mark.parametrize("family", ["gemma", "dflash"])
def test_activation_checkpointing_reaches_every_family_through_the_strategy(family):
    """One door: the strategy's plan recomputes the trained transformers blocks of the biggest families too
    (DiffusionGemma's decoder layers, DFlash's draft; the frozen target runs without gradients)."""
    from tests.families.dflash.test_dflash import dflash
    from tests.families.diffusion_gemma.test_diffusion_gemma import gemma

    module = gemma() if family == "gemma" else dflash()
    strategy = SingleDeviceStrategy(parallelism=Parallelism(activation_checkpointing=True))
    model = parallelize_model(module.model, SimpleNamespace(precision="32-true", strategy=strategy))
    trained = model.hf if family == "gemma" else model.draft
    assert trained.is_gradient_checkpointing
