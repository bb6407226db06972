"""The LightningCLI: configs parse, arguments link from the data module, fit/validate/predict run."""

import pytest

from lit_dllm.cli import main

TINY_OVERRIDES = [
    "--trainer.max_steps=4", "--trainer.val_check_interval=4", "--trainer.limit_val_batches=1",
    "--trainer.enable_progress_bar=false", "--data.init_args.task_num_train=128", "--data.init_args.task_num_val=16",
    "--data.init_args.batch_size=8",
    '--model.init_args.model_config={"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, '
    '"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}',
]


@pytest.mark.parametrize("config", ["configs/mdlm_tiny.yaml", "configs/hybrid_tiny.yaml", "configs/llada_8b_sft.yaml"])
def test_every_config_parses(config, capsys):
    if "llada" in config:  # real scale: parse only (instantiating would need the hub)
        from lightning.pytorch.cli import LightningCLI  # noqa: F401

        with pytest.raises(SystemExit) as exit_info:
            main(["fit", "--config", config, "--print_config=skip_null"] + ["--data.init_args.tokenizer=null"])
    else:
        with pytest.raises(SystemExit) as exit_info:
            main(["fit", "--config", config, "--print_config"])
    assert exit_info.value.code == 0
    assert "class_path: lit_dllm." in capsys.readouterr().out


def test_unknown_config_key_is_a_clear_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", "configs/mdlm_tiny.yaml", "--model.init_args.not_a_knob=1"])
    assert exit_info.value.code != 0
    assert "not_a_knob" in capsys.readouterr().err


def test_help_is_useful(capsys):
    with pytest.raises(SystemExit):
        main(["fit", "--help"])
    out = capsys.readouterr().out
    assert "--model" in out and "--data" in out and "--trainer" in out


def test_fit_then_validate_test_and_predict_from_the_checkpoint(tmp_path, capsys):
    root = [f"--trainer.default_root_dir={tmp_path}", f"--trainer.logger.init_args.save_dir={tmp_path}"]
    args = ["--config", "configs/mdlm_tiny.yaml", *TINY_OVERRIDES, *root]
    cli = main(["fit", *args])
    assert cli.model.hparams.vocab_size == cli.datamodule.vocab_size  # linked
    assert cli.model.hparams.mask_token_id == cli.datamodule.mask_token_id
    assert cli.trainer.global_step == 4
    out = capsys.readouterr()
    assert "Checkpoint:" in out.out + out.err and "Logs:" in out.out + out.err
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(cli.trainer.logger.log_dir))
    events.Reload()
    assert "val/exact_match" in events.Tags()["scalars"]
    assert any("val/samples" in tag for tag in events.Tags()["tensors"])  # generations logged as text
    last = next(tmp_path.rglob("last.ckpt"))
    from lit_dllm import MDLMModule

    reloaded = MDLMModule.load_from_checkpoint(last)  # a notebook user's path back to the trained model
    prompts = ["rev 4821=", "rev 90="]
    assert reloaded.generate(prompts, max_new_tokens=6) == cli.model.generate(prompts, max_new_tokens=6)
    validate = main(["validate", *args, f"--ckpt_path={last}"])
    assert {"val/loss", "val/masked_accuracy", "val/exact_match"} <= set(validate.trainer.callback_metrics)
    test = main(["test", *args, f"--ckpt_path={last}"])
    assert {"test/loss", "test/masked_accuracy", "test/exact_match"} <= set(test.trainer.callback_metrics)
    predict = main(["predict", *args, f"--ckpt_path={last}", "--trainer.limit_predict_batches=1"])
    rows = predict.trainer.predict_loop.predictions[0]
    assert {"prompt", "generated", "reference"} <= set(rows[0])
    written = next(tmp_path.rglob("predictions.jsonl")).read_text().splitlines()
    assert [__import__("json").loads(line) for line in written] == rows


def test_model_and_data_hyperparameters_never_collide(tmp_path):
    """Lightning refuses a model and data module whose hparams share a key with different values."""
    cli = main(["fit", "--config", "configs/mdlm_tiny.yaml", f"--trainer.default_root_dir={tmp_path}",
                f"--trainer.logger.init_args.save_dir={tmp_path}", "--model.init_args.noise_seed=7", "--data.init_args.seed=3",
                "--trainer.max_steps=0"] + TINY_OVERRIDES[1:])
    shared = {k for k in set(cli.model.hparams) & set(cli.datamodule.hparams) if not k.startswith("_")}
    assert shared == {"tokenizer", "trust_remote_code"}, shared  # both linked from the data module
    assert all(cli.model.hparams[k] == cli.datamodule.hparams[k] for k in shared)


def test_optimizer_and_schedule_are_configurable_from_the_cli(tmp_path):
    cli = main(["fit", "--config", "configs/mdlm_tiny.yaml", "--trainer.logger=false", "--trainer.callbacks=[]",
                f"--trainer.default_root_dir={tmp_path}",
                "--trainer.enable_checkpointing=false", "--model.init_args.optimizer=torch.optim.SGD",
                "--model.init_args.optimizer.init_args.lr=0.05", "--model.init_args.warmup=10"] + TINY_OVERRIDES[1:]
               + ["--trainer.max_steps=1"])
    optimizer = cli.trainer.optimizers[0]
    assert isinstance(optimizer, __import__("torch").optim.SGD)
    assert optimizer.param_groups[1]["weight_decay"] == 0.0  # norms and biases
    assert abs(optimizer.param_groups[0]["lr"] - 0.05 * 2 / 10) < 1e-9  # after one step of a 10-step warm-up
