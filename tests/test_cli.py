"""The LightningCLI: configs parse, arguments link from the data module, fit/validate/predict run."""

import inspect
import json
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest
import torch
import yaml

import lit_dllm
from lit_dllm.cli import DLLMCLI, _import, description, main, models
from lit_dllm.settings import Tokenizer, settings_groups
from lit_dllm.core.token_loss import TokenLossModule as DLLMModule
from lit_dllm.data.datamodule import DLLMDataModule
from lit_dllm.testing import TINY_LLAMA

TINY_OVERRIDES = [
    "--trainer.max_steps=4", "--trainer.val_check_interval=4", "--trainer.limit_val_batches=1",
    "--trainer.enable_progress_bar=false", "--data.init_args.task.num_train=128", "--data.init_args.task.num_val=16",
    "--data.init_args.loader.batch_size=8",
    f"--model.init_args.backbone.model_config={json.dumps(dict(TINY_LLAMA, max_position_embeddings=64))}",
]

REPO = Path(__file__).resolve().parents[1]


def train_py(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """``python train.py ARGS`` from the repository root, as a user runs it (stdout and stderr together)."""
    return subprocess.run([sys.executable, "train.py", *args], cwd=REPO, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=timeout)


@pytest.mark.parametrize("config", ["configs/mdlm_tiny.yaml", "configs/hybrid_tiny.yaml", "configs/ar_tiny.yaml",
                                    "configs/mdlm_moe_ep.yaml", "configs/llada_8b_sft.yaml"])
def test_every_config_parses(config, capsys):
    if "llada" in config:  # real scale: parse only (instantiating would need the hub)
        from lightning.pytorch.cli import LightningCLI  # noqa: F401

        with pytest.raises(SystemExit) as exit_info:
            main(["fit", "--config", config, "--print_config=skip_null"] + ["--data.init_args.tokenizer.name=null"])
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


@pytest.mark.parametrize("class_path", models())
def test_each_module_help_groups_its_backbone_and_generation_settings(class_path, capsys):
    """Every setting of a module's groups appears once, under its group (``--model.generation.gen_length``), with the
    group's description as the heading; no flat repeat of them is left beside (a module's own argument of the same
    name, DFlash's draft ``attn_implementation``, is not a repeat)."""
    with pytest.raises(SystemExit):
        main(["fit", "--model.help", class_path])
    out = capsys.readouterr().out
    groups = settings_groups(_import(class_path))
    assert "generation" in groups and ("backbone" in groups) == (class_path != "lit_dllm.DFlashModule")
    own = set(inspect.signature(_import(class_path).__init__).parameters)
    for name, kind in groups.items():
        for field in fields(kind):
            assert out.count(f"--model.{name}.{field.name} ") == 2, field.name  # the usage line, then its group's help
            assert f"--model.{field.name} " not in out or field.name in own
    assert "answers and their scoring" in out  # the generation group's heading


def test_the_help_names_every_module_class_with_its_tiny_config(capsys):
    """Every concrete module class lit_dllm exports declares a tiny config that trains that class, and the help names
    both; the two bases are named as what to subclass."""
    bases = {lit_dllm.TokenLossModule, lit_dllm.DLLMModule}
    exported = [getattr(lit_dllm, name) for name in lit_dllm.__all__]
    modules = {c for c in exported if isinstance(c, type) and issubclass(c, lit_dllm.TokenLossModule)} - bases
    assert {_import(path) for path in models()} == modules
    for path, config in models().items():
        assert _import(yaml.safe_load(Path(REPO, config).read_text())["model"]["class_path"]) is _import(path)
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    for text in [*models(), *models().values(), "lit_dllm.DLLMModule", "lit_dllm.TokenLossModule"]:
        assert text in description() and text in out


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
    assert not shared, shared
    assert cli.model.tokenizer_settings == cli.datamodule.tokenizer_settings  # the data module's group, linked whole
    assert cli.model.hparams.tokenizer_settings == cli.datamodule.hparams.tokenizer


def test_the_data_tokenizer_group_is_linked_whole_into_the_model(tmp_path):
    """One ``data.init_args.tokenizer`` group: each of its fields reaches the model's ``tokenizer_settings``."""
    cli = main(["fit", "--config", "configs/mdlm_tiny.yaml", f"--trainer.default_root_dir={tmp_path}",
                f"--trainer.logger.init_args.save_dir={tmp_path}", "--trainer.max_steps=0",
                "--data.init_args.tokenizer.mask_token=<|mask|>"] + TINY_OVERRIDES[1:])
    assert cli.model.tokenizer_settings == Tokenizer(mask_token="<|mask|>") == cli.datamodule.tokenizer_settings
    assert cli.model.mask_token_id == cli.datamodule.mask_token_id == cli.datamodule.tokenizer.mask_token_id


def test_optimizer_and_schedule_are_configurable_from_the_cli(tmp_path):
    cli = main(["fit", "--config", "configs/mdlm_tiny.yaml", "--trainer.logger=false", "--trainer.callbacks=[]",
                f"--trainer.default_root_dir={tmp_path}",
                "--trainer.enable_checkpointing=false", "--model.init_args.optimization.optimizer=torch.optim.SGD",
                "--model.init_args.optimization.optimizer.init_args.lr=0.05", "--model.init_args.optimization.warmup=10"] + TINY_OVERRIDES[1:]
               + ["--trainer.max_steps=1"])
    optimizer = cli.trainer.optimizers[0]
    assert isinstance(optimizer, __import__("torch").optim.SGD)
    assert optimizer.param_groups[1]["weight_decay"] == 0.0  # norms and biases
    assert abs(optimizer.param_groups[0]["lr"] - 0.05 * 2 / 10) < 1e-9  # after one step of a 10-step warm-up


# ---------------------------------------------------------------------------- the README's commands


def readme_commands() -> list[list[str]]:
    """The ``train.py`` command lines of the README's "Using it" block, as argument lists (comments dropped)."""
    import re
    import shlex
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text().replace("\\\n", " ")  # continued lines
    lines = re.findall(r"^\.venv/bin/python train\.py (.+?)(?:\s+#.*)?$", readme, flags=re.M)
    return [shlex.split(line) for line in lines if "--config" in line and "--print_config" not in line]


def run_readme(command: list[str], save_dir, *extra: str):
    """A README command with the tiny overrides and this test's output folder appended."""
    return main([*command, *TINY_OVERRIDES, f"--trainer.logger.init_args.save_dir={save_dir}", *extra])


def test_readme_commands_resume_validate_test_and_predict_the_trained_run(tmp_path, capsys):
    commands = {command[0] + (" last" if "last" in command else ""): command for command in readme_commands()}
    assert {"fit last", "validate last", "test last", "predict last"} <= set(commands), commands
    first = run_readme(["fit", "--config", "configs/mdlm_tiny.yaml"], tmp_path, "--trainer.max_steps=4")
    checkpoint = tmp_path / "mdlm_tiny" / "checkpoints" / "last.ckpt"  # one folder per run name, every call
    assert first.trainer.global_step == 4 and checkpoint.is_file()

    capsys.readouterr()
    resumed = run_readme(commands["fit last"], tmp_path, "--trainer.max_steps=8")
    assert resumed.trainer.global_step == 8
    assert "Finished after 8 optimizer steps (4 in this call)" in capsys.readouterr().out
    assert resumed.trainer.ckpt_path == str(checkpoint)
    fitted_val_loss = float(resumed.trainer.callback_metrics["val/loss"])  # validation ran at step 8

    validate = run_readme(commands["validate last"], tmp_path)
    assert float(validate.trainer.callback_metrics["val/loss"]) == pytest.approx(fitted_val_loss, rel=1e-6)
    test = run_readme(commands["test last"], tmp_path)
    assert "test/exact_match" in test.trainer.callback_metrics
    predict = run_readme(commands["predict last"], tmp_path, "--trainer.limit_predict_batches=1")
    assert predict.trainer.ckpt_path == str(checkpoint)
    assert predict.trainer.predict_loop.predictions[0]


def test_the_readme_packed_rows_command_trains_on_packed_rows(tmp_path):
    (command,) = [command for command in readme_commands() if "--data.init_args.collation.pack=true" in command]
    cli = run_readme(command, tmp_path, "--trainer.max_steps=3")
    assert cli.trainer.global_step == 3 and (tmp_path / "mdlm_tiny_packed" / "checkpoints" / "last.ckpt").is_file()
    batch = next(iter(cli.datamodule.train_dataloader()))
    assert batch["input_ids"].shape == (8, 64) and len(batch["input_lengths"]) > 2 * 8  # several examples a row


@pytest.mark.parametrize("subcommand", ["validate", "test", "predict"])
def test_evaluating_last_without_a_checkpoint_is_an_error(tmp_path, subcommand, capsys):
    with pytest.raises(SystemExit) as exit_info:
        run_readme([subcommand, "--config", "configs/mdlm_tiny.yaml", "--ckpt_path", "last"], tmp_path)
    assert exit_info.value.code != 0
    err = capsys.readouterr().err
    assert "no last*.ckpt in" in err and str(tmp_path / "mdlm_tiny" / "checkpoints") in err


def test_fit_last_without_a_checkpoint_starts_a_new_run(tmp_path):
    with pytest.warns(UserWarning, match="starting a new run"):
        cli = run_readme(["fit", "--config", "configs/mdlm_tiny.yaml", "--ckpt_path", "last"], tmp_path,
                         "--trainer.max_steps=1")
    assert cli.trainer.global_step == 1


def test_explicit_settings_override_the_checkpoint_and_are_reported(tmp_path):
    fit = run_readme(["fit", "--config", "configs/mdlm_tiny.yaml"], tmp_path, "--trainer.max_steps=1",
                     "--model.init_args.generation.remasking=random", "--model.init_args.generation.temperature=0.5")
    assert fit.model.generation.remasking == "random"
    with pytest.warns(UserWarning, match=r"override the checkpoint's: .*gen_length=3 \(checkpoint: 10\)"):
        predict = run_readme(["predict", "--config", "configs/mdlm_tiny.yaml", "--ckpt_path", "last"], tmp_path,
                             "--model.init_args.generation.gen_length=3", "--model.init_args.generation.temperature=0.0",
                             "--trainer.limit_predict_batches=1")
    generation = predict.model.generation
    assert generation.gen_length == 3  # the command line wins
    assert generation.temperature == 0.0  # ... also when it names the default value
    assert generation.remasking == "random"  # unset here: the checkpoint's choice, though its group is written
    assert all(len(row["generated"]) <= 3 for row in predict.trainer.predict_loop.predictions[0])


def test_a_config_file_value_equal_to_the_default_overrides_the_checkpoint(tmp_path):
    """temperature: 0.0 in a YAML config is the user's choice, though it equals the default."""
    run_readme(["fit", "--config", "configs/mdlm_tiny.yaml"], tmp_path, "--trainer.max_steps=1",
               "--model.init_args.generation.temperature=0.5", "--model.init_args.generation.remasking=random")
    greedy = tmp_path / "greedy.yaml"
    greedy.write_text("model:\n  init_args:\n    generation:\n      temperature: 0.0\n")
    with pytest.warns(UserWarning, match=r"override the checkpoint's: generation.temperature=0.0 \(checkpoint: 0.5\)"):
        predict = run_readme(["predict", "--config", "configs/mdlm_tiny.yaml", f"--config={greedy}", "--ckpt_path",
                              "last"], tmp_path, "--trainer.limit_predict_batches=1")
    assert predict.model.generation.temperature == 0.0
    assert predict.model.generation.remasking == "random"  # written nowhere: the checkpoint's


@pytest.mark.parametrize("accumulate, stop", [(1, 7), (2, 7), (1, 4)])
def test_resume_after_max_steps_continues_with_the_next_unseen_batch(tmp_path, accumulate, stop):
    """4-step epochs stopped mid-epoch (7 steps) or at an epoch's last batch (4: Lightning then takes one more batch
    in that epoch before it starts the next); resuming to 10 gives the uninterrupted run's losses."""
    import lightning as L

    class Losses(L.Callback):
        def on_train_start(self, trainer, *args):
            self.values, self.step = [], trainer.global_step

        def on_train_batch_end(self, trainer, *args):
            if trainer.global_step != self.step:  # an optimizer step ended
                self.step = trainer.global_step
                self.values.append(float(trainer.callback_metrics["train/loss"]))

    def run(save_dir, max_steps, resume=False):
        args = ["--config", "configs/mdlm_tiny.yaml", *TINY_OVERRIDES, f"--trainer.max_steps={max_steps}",
                "--data.init_args.task.num_train=64", f"--data.init_args.loader.batch_size={16 // accumulate}",
                f"--trainer.accumulate_grad_batches={accumulate}", "--model.init_args.generation.val_generate_batches=0",
                "--trainer.val_check_interval=3", "--model.init_args.optimization.min_lr_ratio=1.0",
                "--model.init_args.optimization.warmup=0",  # an lr that ignores max_steps
                f"--trainer.logger.init_args.save_dir={save_dir}"]
        cli = DLLMCLI(DLLMModule, DLLMDataModule, subclass_mode_model=True, subclass_mode_data=True,
                      auto_configure_optimizers=False, args=args, run=False)
        losses = Losses()
        cli.trainer.callbacks.append(losses)
        last = save_dir / "mdlm_tiny" / "checkpoints" / "last.ckpt"
        cli.trainer.fit(cli.model, cli.datamodule, ckpt_path=str(last) if resume else None)
        return losses.values

    whole = run(tmp_path / "whole", 10)
    first = run(tmp_path / "parts", stop)
    rest = run(tmp_path / "parts", 10, resume=True)
    assert len(first) == stop and len(rest) == 10 - stop
    assert first + rest == whole


def test_optimizer_and_lr_scheduler_subcommand_options_are_not_offered(capsys):
    """The module builds its own optimizer (model.init_args.optimizer swaps it): no dead --optimizer flag."""
    with pytest.raises(SystemExit):
        main(["fit", "--help"])
    out = capsys.readouterr().out
    assert "--optimizer " not in out and "--lr_scheduler" not in out
    assert "--model.init_args.optimizer" in out or "optimizer" in out


def test_the_cli_progress_bar_counts_optimizer_steps(tmp_path):
    from lit_dllm.callbacks import StepProgressBar

    cli = run_readme(["fit", "--config", "configs/mdlm_tiny.yaml"], tmp_path, "--trainer.max_steps=2",
                     "--trainer.enable_progress_bar=true")
    bar = cli.trainer.progress_bar_callback
    assert isinstance(bar, StepProgressBar) and (bar.train_progress_bar.n, bar.train_progress_bar.total) == (2, 2)


def test_a_mask_token_aliasing_eos_stops_train_py(tmp_path):
    """Every family loads its tokenizer through the same check (tests/data/test_tokenizer.py: eos, unk, '', bos)."""
    result = train_py("fit", "--config", "configs/mdlm_tiny.yaml", "--data.init_args.tokenizer.mask_token=<eos>",
                      f"--trainer.logger.init_args.save_dir={tmp_path}", "--trainer.max_steps=1")
    assert result.returncode != 0, result.stdout[-2000:]
    assert "mask token '<eos>' (id 1) is also its eos token" in result.stdout
    assert not list(tmp_path.rglob("*.ckpt"))


def test_a_mask_token_aliasing_unk_stops_a_causal_lm_run(tmp_path):
    with pytest.raises(ValueError, match=r"mask token '' \(id 3\) is also its unk token"):
        main(["fit", "--config", "configs/ar_tiny.yaml", "--data.init_args.tokenizer.mask_token=",
              f"--trainer.logger.init_args.save_dir={tmp_path}"])


# ---------------------------------------------------------------------------- the message the user needs


def test_train_py_evaluates_pretrained_weights_and_refuses_random_ones_without_a_checkpoint(tmp_path):
    """validate without --ckpt_path: a random-init model is refused (exit 2, the --ckpt_path last hint); a pretrained
    folder is scored, and the log says which weights."""
    from tests.test_regenerate import tiny_pretrained

    run = [f"--trainer.logger.init_args.save_dir={tmp_path}", "--trainer.limit_val_batches=1",
           "--data.init_args.task.num_val=8", "--trainer.enable_progress_bar=false"]
    random_init = train_py("validate", "--config", "configs/mdlm_tiny.yaml", *run)
    assert random_init.returncode == 2, random_init.stdout[-2000:]
    assert "would score a randomly initialised model" in random_init.stdout and "--ckpt_path last" in random_init.stdout
    folder = tmp_path / "pretrained"
    tiny_pretrained(folder)
    pretrained = train_py("validate", "--config", "configs/ar_tiny.yaml",
                          f"--model.init_args.backbone={{model: {folder}, model_config: null}}",
                          f"--data.init_args.tokenizer.name={folder}", *run)
    assert pretrained.returncode == 0, pretrained.stdout[-2000:]
    assert f"No --ckpt_path: scoring the pretrained weights of backbone.model {folder}" in pretrained.stdout
    assert "val/loss" in pretrained.stdout


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without CUDA")
def test_a_gpu_config_on_a_cpu_only_machine_names_the_fix(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        run_readme(["fit", "--config", "configs/mdlm_tiny.yaml"], tmp_path, "--trainer.accelerator=gpu",
                   "--trainer.devices=2")
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "trainer.accelerator='gpu' (devices=2) needs CUDA GPUs, and this machine has none" in err
    assert "--trainer.accelerator=cpu --trainer.devices=1" in err


def test_accumulate_grad_batches_zero_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match=r"accumulate_grad_batches=0 must be a positive number of micro-batches"):
        run_readme(["fit", "--config", "configs/mdlm_tiny.yaml"], tmp_path, "--trainer.accumulate_grad_batches=0")
    assert not list(tmp_path.rglob("*.ckpt"))


def test_a_text_file_as_checkpoint_is_named(tmp_path, capsys):
    notes = tmp_path / "notes.txt"
    notes.write_text("not a checkpoint\n")
    with pytest.raises(SystemExit) as exit_info:
        run_readme(["validate", "--config", "configs/mdlm_tiny.yaml", f"--ckpt_path={notes}"], tmp_path)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"--ckpt_path={notes} is not a checkpoint" in err and "weights_only" not in err


def test_a_new_fit_into_a_folder_with_a_runs_checkpoints_is_refused(tmp_path, capsys):
    """A second ``fit`` without --ckpt_path in the same run folder must not mix with or replace the first run's
    checkpoints (a later stop would overwrite last.ckpt): exit 2 naming the folder and the three ways on."""
    run_readme(["fit", "--config", "configs/mdlm_tiny.yaml"], tmp_path, "--trainer.max_steps=2")
    folder = tmp_path / "mdlm_tiny" / "checkpoints"
    before = {path.name: path.read_bytes() for path in folder.iterdir()}
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        run_readme(["fit", "--config", "configs/mdlm_tiny.yaml"], tmp_path, "--trainer.max_steps=3")
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert str(folder) in err and "last.ckpt" in err
    assert "--ckpt_path last" in err and "--trainer.logger.init_args.name" in err
    assert {path.name: path.read_bytes() for path in folder.iterdir()} == before


def test_resuming_a_run_that_reached_max_steps_says_nothing_was_trained(tmp_path, capsys):
    run_readme(["fit", "--config", "configs/mdlm_tiny.yaml"], tmp_path, "--trainer.max_steps=2")
    capsys.readouterr()
    resumed = run_readme(["fit", "--config", "configs/mdlm_tiny.yaml", "--ckpt_path", "last"], tmp_path,
                         "--trainer.max_steps=2")  # returns: exit 0
    assert resumed.trainer.global_step == 2
    out = capsys.readouterr().out
    assert "Nothing trained in this call: the run is at optimizer step 2 and max_steps=2 is reached" in out, out
    assert "Finished after" not in out and "--trainer.max_steps" in out


@pytest.mark.parametrize("signum", [15, 2], ids=["SIGTERM", "SIGINT"])
@pytest.mark.parametrize("hook", ["setup", "on_sanity_check_start", "on_train_batch_end", "on_train_end"])
def test_a_signal_at_any_moment_of_fit_exits_128_plus_signal(tmp_path, hook, signum, default_sigint, sigterm_raises):
    """Before training (data set-up, the sanity check: Lightning's own SIGTERM handler would exit 0 there) nothing is
    saved; during or after training the run's last.ckpt holds the last step. Either way: exit 128 + signal."""
    signal_at = json.dumps({"class_path": "tests.test_callbacks.SignalAt",
                            "init_args": {"step": 2, "signum": signum, "hook": hook}})
    with pytest.raises(SystemExit) as exit_info:
        run_readme(["fit", "--config", "configs/mdlm_tiny.yaml"], tmp_path, "--trainer.num_sanity_val_steps=1",
                   f"--trainer.callbacks+={signal_at}")
    assert exit_info.value.code == 128 + signum
    saved = sorted((tmp_path / "mdlm_tiny" / "checkpoints").glob("*"))
    if hook in ("setup", "on_sanity_check_start"):
        assert saved == []
    else:
        assert [path.name for path in saved] == ["last.ckpt"]
        assert torch.load(saved[0], weights_only=False)["global_step"] == {"on_train_batch_end": 2}.get(hook, 4)


def test_a_group_field_set_to_null_on_the_command_line_is_none(tmp_path):
    """jsonargparse hands a group of a subclass's init_args the string 'None' for ``null``; the group reads None."""
    cli = main(["fit", "--config", "configs/mdlm_tiny.yaml", "--model.init_args.backbone.model=null",
                f"--trainer.default_root_dir={tmp_path}", f"--trainer.logger.init_args.save_dir={tmp_path}",
                "--trainer.max_steps=0"] + TINY_OVERRIDES[1:])
    assert cli.model.backbone.model is None and cli.model.backbone.model_config is not None


def test_the_resolved_config_never_replaces_a_file(tmp_path, monkeypatch):
    """Issue 60: without a logger Lightning wrote config.yaml into the working folder (or default_root_dir) over the
    user's own; the record goes to the run folder instead, and a second call into one logger version (a resume)
    keeps the first call's record and writes its own beside it."""
    monkeypatch.chdir(tmp_path)
    mine = tmp_path / "config.yaml"
    mine.write_text("my: settings\n")
    quick = ["--config", str(REPO / "configs/mdlm_tiny.yaml"), "--trainer.max_steps=0",
             "--trainer.num_sanity_val_steps=0", *TINY_OVERRIDES[1:]]
    main(["fit", *quick, "--trainer.logger=false"])
    main(["fit", *quick, "--trainer.logger=false", f"--trainer.default_root_dir={tmp_path}"])
    assert mine.read_text() == "my: settings\n"
    run = tmp_path / "lightning_logs"
    assert sorted(path.name for path in run.glob("config*")) == ["config-v1.yaml", "config.yaml"]
    version = [*quick, f"--trainer.logger.init_args.save_dir={tmp_path}", "--trainer.logger.init_args.version=0"]
    main(["fit", *version])
    first = (tmp_path / "mdlm_tiny" / "version_0" / "config.yaml").read_text()
    main(["fit", *version, "--model.init_args.noise_seed=7"])
    assert (tmp_path / "mdlm_tiny" / "version_0" / "config.yaml").read_text() == first
    assert "noise_seed: 7" in (tmp_path / "mdlm_tiny" / "version_0" / "config-v1.yaml").read_text()


def test_a_documented_null_field_is_accepted_and_a_null_group_is_refused(tmp_path, capsys):
    """Issue 60: ``generation.gen_length null`` (an ``int | None`` field) was refused (jsonargparse hands the string
    'None'); a whole group set to null gave a raw "functools.partial ... must be a mapping"."""
    quick = ["--config", "configs/mdlm_tiny.yaml", f"--trainer.default_root_dir={tmp_path}", "--trainer.logger=false"]
    cli = main([*quick, "--model.init_args.generation.gen_length", "null", "--data.init_args.loader.val_batch_size=null"],
               run=False)
    assert cli.model.generation.gen_length is None and cli.model.generation.val_generate_batches == 1  # the rest stays
    assert cli.datamodule.loader.val_batch_size is None and cli.datamodule.loader.batch_size == 64
    for group in ("--model.init_args.optimization", "--data.init_args.loader"):
        with pytest.raises(SystemExit) as refused:
            main([*quick, group, "null"], run=False)
        assert refused.value.code == 2
        assert f"{group[2:]} null: a settings group cannot be null. Leave it out" in capsys.readouterr().err
    assert main([*quick, "--model.init_args.lora=null"], run=False).model.lora is None  # an optional group may be


def test_strategy_settings_on_a_strategy_named_auto_say_to_name_a_lit_dllm_strategy(tmp_path, capsys):
    settings = ["--trainer.strategy.init_args.parallelism.compile", "false"]
    quick = ["--config", "configs/mdlm_tiny.yaml", f"--trainer.default_root_dir={tmp_path}", "--trainer.logger=false"]
    with pytest.raises(SystemExit):
        main([*quick, *settings], run=False)
    assert "name the strategy too, e.g. --trainer.strategy=lit_dllm.SingleDeviceStrategy" in capsys.readouterr().err
    cli = main([*quick, "--trainer.strategy=lit_dllm.SingleDeviceStrategy", *settings], run=False)  # the fix
    assert type(cli.trainer.strategy).__name__ == "SingleDeviceStrategy"
