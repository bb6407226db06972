"""Interrupted, diverging and misconfigured runs: a checkpoint is kept, the run stops, the exit code says so."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lit_dllm import callbacks
from lit_dllm.callbacks import GracefulStop, RunSummary, StepProgressBar, ThroughputMonitor
from lit_dllm.core import finite
from lit_dllm.data.batch import real_tokens

from .core.test_resume_and_errors import RecordLosses, data, module

REPO = Path(__file__).resolve().parents[1]


def trainer(folder, *callbacks, max_steps=7, accelerator="cpu", **kwargs):
    return L.Trainer(
        max_steps=max_steps, accelerator=accelerator, logger=False, enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=0, default_root_dir=folder, callbacks=[*callbacks,
        ModelCheckpoint(dirpath=folder, save_last=True, every_n_train_steps=kwargs.pop("every", 100))], **kwargs,
    )


class SignalAt(L.Callback):
    """Deliver a real signal to this process at ``hook``: ``on_train_batch_end`` once ``step`` optimizer steps are
    done, or the first call of ``setup`` / ``on_sanity_check_start`` / ``on_train_end``."""

    def __init__(self, step: int = 1, signum: int = signal.SIGTERM, hook: str = "on_train_batch_end"):
        self.step, self.signum, self.hook = step, signum, hook

    def _send(self, hook: str) -> None:
        if hook == self.hook:
            os.kill(os.getpid(), self.signum)

    def setup(self, trainer, pl_module, stage):
        self._send("setup")

    def on_sanity_check_start(self, trainer, pl_module):
        self._send("on_sanity_check_start")

    def on_train_batch_end(self, trainer, *args):
        if trainer.global_step == self.step:
            self._send("on_train_batch_end")

    def on_train_end(self, trainer, pl_module):
        self._send("on_train_end")


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_saves_the_step_and_resume_continues_bit_for_bit(tmp_path, signum, default_sigint):
    whole = RecordLosses()
    dm = data()
    trainer(tmp_path / "whole", whole).fit(module(dm), dm)

    stop, first = GracefulStop(), RecordLosses()
    dm = data()
    interrupted = trainer(tmp_path / "parts", SignalAt(3, signum), first, stop)  # no hook runs after stop's raise
    with pytest.raises(SystemExit) as exit_info:
        interrupted.fit(module(dm), dm)
    assert exit_info.value.code == 128 + signum and stop.signal == signum and interrupted.global_step == 3
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # handlers restored after fit
    saved = torch.load(tmp_path / "parts" / "last.ckpt", weights_only=False)
    assert saved["global_step"] == 3

    rest = RecordLosses()
    dm = data()
    trainer(tmp_path / "parts", rest).fit(module(dm), dm, ckpt_path=str(tmp_path / "parts" / "last.ckpt"))
    assert first.losses + rest.losses == whole.losses


def test_a_new_run_stopped_by_a_signal_keeps_another_runs_last_checkpoint(tmp_path, sigterm_raises):
    """Two runs of the Trainer API in one folder: the second, stopped by SIGTERM, saves beside the first run's
    last.ckpt (Lightning's version suffix), never over it."""
    dm = data()
    trainer(tmp_path, GracefulStop(), max_steps=3).fit(module(dm), dm)
    dm = data()
    with pytest.raises(SystemExit):
        trainer(tmp_path, SignalAt(1), GracefulStop()).fit(module(dm), dm)
    assert torch.load(tmp_path / "last.ckpt", weights_only=False)["global_step"] == 3
    assert torch.load(tmp_path / "last-v1.ckpt", weights_only=False)["global_step"] == 1


class MarkAt(L.Callback):
    """Create the file ``path`` once ``step`` optimizer steps are done: tells a test in another process that the run
    is training."""

    def __init__(self, path: str, step: int = 2):
        self.path, self.step = path, step

    def on_train_batch_end(self, trainer, *args):
        if trainer.global_step == self.step:
            Path(self.path).touch()


def cli_fit(save_dir, *extra: str) -> subprocess.Popen:
    """``train.py fit`` of the tiny MDLM config in a subprocess, training until stopped; ``save_dir/training``
    appears after two optimizer steps."""
    mark = json.dumps({"class_path": "tests.test_callbacks.MarkAt", "init_args": {"path": str(save_dir / "training")}})
    command = [sys.executable, "train.py", "fit", "--config", "configs/mdlm_tiny.yaml", "--trainer.max_steps=100000",
               f"--trainer.logger.init_args.save_dir={save_dir}", "--trainer.enable_progress_bar=false",
               "--data.init_args.task.num_train=256", "--model.init_args.generation.val_generate_batches=0",
               f"--trainer.callbacks+={mark}", *extra]
    return subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # as in a terminal


def wait_for_training(process: subprocess.Popen, save_dir) -> None:
    started = time.monotonic()
    while not (save_dir / "training").exists() and time.monotonic() - started < 300:
        assert process.poll() is None, process.communicate()[0][-3000:]
        time.sleep(0.2)


def test_sigterm_from_outside_saves_one_checkpoint_and_exits_at_once(tmp_path):
    """The real CLI in a subprocess: SIGTERM mid-training -> one resumable last.ckpt, no validation pass after it
    (which would write a second last-v1.ckpt), exit 128 + 15."""
    process = cli_fit(tmp_path)
    wait_for_training(process, tmp_path)
    process.send_signal(signal.SIGTERM)
    output, _ = process.communicate(timeout=120)
    assert process.returncode == 128 + signal.SIGTERM, output[-3000:]
    folder = tmp_path / "mdlm_tiny" / "checkpoints"
    assert "Stopped by SIGTERM" in output and sorted(path.name for path in folder.iterdir()) == ["last.ckpt"]
    assert torch.load(folder / "last.ckpt", weights_only=False)["global_step"] > 0


def test_a_second_ctrl_c_aborts_at_once_with_exit_130(tmp_path):
    """The first Ctrl+C asks for a stop after the optimizer step in flight (32 micro-batches here); a second one
    during that step aborts without saving: exit 130, not Lightning's 1, and no checkpoint or temporary file."""
    process = cli_fit(tmp_path, "--trainer.accumulate_grad_batches=32")
    wait_for_training(process, tmp_path)
    process.send_signal(signal.SIGINT)
    for line in process.stdout:
        if "SIGINT: stopping after this optimizer step" in line:
            break
    process.send_signal(signal.SIGINT)
    output, _ = process.communicate(timeout=120)
    assert process.returncode == 128 + signal.SIGINT, output[-3000:]
    assert not list((tmp_path / "mdlm_tiny" / "checkpoints").glob("*"))


def fused_adamw(groups):
    return torch.optim.AdamW(groups, fused=True)


ON_GPU = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
POISONED_STEP = 3


@pytest.mark.parametrize(("optimizer", "accelerator"), [
    pytest.param(None, "cpu", id="checked-before-the-step"), pytest.param(fused_adamw, "cpu", id="skipped-on-device"),
    pytest.param(None, "cuda", id="skipped-on-gpu", marks=ON_GPU)])
def test_a_non_finite_loss_stops_the_run_and_keeps_the_last_good_checkpoint(tmp_path, optimizer, accelerator,
                                                                            monkeypatch):
    """A NaN loss at step 4: AdamW is checked before its step; fused AdamW (the default on CUDA) skips its step on
    the device (``found_inf``) and the check is read after it. Either way the bad update never reaches the weights,
    the optimizer state or a checkpoint."""
    deferred = []
    copy = finite._copy_to_host
    monkeypatch.setattr(finite, "_copy_to_host", lambda flag: deferred.append(flag) or copy(flag))
    dm = data()
    run = trainer(tmp_path, max_steps=50, every=1, accelerator=accelerator)
    model = module(dm, optimization={"optimizer": optimizer})
    compute_loss = model.compute_loss

    def poisoned(batch, prepared, denominators):
        step = compute_loss(batch, prepared, denominators)
        if model.global_step == POISONED_STEP:
            step.output = type(step.output)(step.output.total_loss * float("nan"), step.output.dllm_loss)
        return step

    model.compute_loss = poisoned
    with pytest.raises(FloatingPointError, match=r"Non-finite training loss .* at optimizer step 4 ") as error:
        run.fit(model, dm)
    assert run.global_step == POISONED_STEP  # the bad update never happened
    saved = torch.load(tmp_path / "last.ckpt", weights_only=False)
    assert saved["global_step"] == POISONED_STEP
    assert all(torch.isfinite(value).all() for value in saved["state_dict"].values())
    assert all(torch.equal(saved["state_dict"][name].cpu(), value.cpu()) for name, value in model.state_dict().items())
    adam = run.optimizers[0]
    assert all(int(state["step"]) == POISONED_STEP for state in adam.state.values())
    assert "found_inf" not in vars(adam) and f"lr={model.optimization.lr}" in error.value.args[0]
    assert len(deferred) == (0 if accelerator == "cpu" and optimizer is None else POISONED_STEP + 1)


def test_the_final_step_is_saved_even_between_checkpoint_intervals(tmp_path):
    """Lightning alone would leave last.ckpt at step 2 (its end-of-training save runs only if no last was saved)."""
    dm = data()
    trainer(tmp_path, GracefulStop(), max_steps=3, every=2).fit(module(dm), dm)
    assert torch.load(tmp_path / "last.ckpt", weights_only=False)["global_step"] == 3


def test_an_unwritable_checkpoint_folder_fails_before_the_first_step(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    dm = data()
    run = L.Trainer(max_steps=3, accelerator="cpu", logger=False, enable_progress_bar=False, limit_val_batches=0,
                    callbacks=[GracefulStop(), ModelCheckpoint(dirpath=blocker / "checkpoints")])
    with pytest.raises(PermissionError, match="checkpoint folder .*a_file/checkpoints.* is not writable"):
        run.fit(module(dm), dm)
    assert run.global_step == 0


def test_step_progress_bar_counts_optimizer_steps_and_the_summary_reports_throughput(tmp_path, capsys):
    dm = data()
    bar = StepProgressBar()
    run = L.Trainer(max_steps=6, accelerator="cpu", logger=False, enable_model_summary=False, limit_val_batches=0,
                    default_root_dir=tmp_path, callbacks=[bar, RunSummary(window=4)], accumulate_grad_batches=2)
    run.fit(module(dm), dm)
    assert (bar.train_progress_bar.n, bar.train_progress_bar.total) == (6, 6)  # across 3 epochs of 2 steps
    out = capsys.readouterr().out
    assert "Finished after 6 optimizer steps" in out and "tokens/s" in out and "train/loss, last 4 steps" in out
    assert "train/grad_norm" in out


def test_a_diverging_cli_run_exits_non_zero_naming_the_step(tmp_path):
    command = [sys.executable, "train.py", "fit", "--config", "configs/mdlm_tiny.yaml", "--trainer.max_steps=200",
               f"--trainer.logger.init_args.save_dir={tmp_path}", "--trainer.enable_progress_bar=false",
               "--data.init_args.task.num_train=256", "--model.init_args.generation.val_generate_batches=0",
               "--model.init_args.optimization.lr=1000", "--model.init_args.optimization.warmup=0", "--trainer.gradient_clip_val=null"]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-2000:]
    assert "FloatingPointError: Non-finite training" in result.stderr and "at optimizer step" in result.stderr


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def perf_counter(self):
        return self.now


def test_throughput_is_hand_derived_per_optimizer_step_without_validation_time(monkeypatch):
    """Two micro-batches of 4 rows (25 real tokens of 40 each) make one optimizer step in 2 s of a fake clock."""
    clock, logged = FakeClock(), {}
    monkeypatch.setattr(callbacks, "time", clock)
    module = SimpleNamespace(training_flops=lambda batch: 3e12, log_dict=lambda metrics, **kw: logged.update(metrics))
    run = SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device("cpu")), precision="bf16-mixed",
                          global_step=0, world_size=1, log_every_n_steps=1, should_stop=False,
                          state=SimpleNamespace(fn="fit"), sanity_checking=False)
    batch = {"input_ids": torch.zeros(4, 10, dtype=torch.long), "attention_mask": torch.ones(4, 10),
             "input_lengths": torch.tensor([10, 7, 3, 5])}
    monitor = ThroughputMonitor(peak_flops=1e13)
    monitor.on_train_start(run, module)
    clock.now += 1.0
    monitor.on_train_batch_end(run, module, None, batch, 0)
    assert logged == {}  # inside the accumulation window
    clock.now += 1.0
    run.global_step = 1
    monitor.on_train_batch_end(run, module, None, batch, 1)
    assert logged == {"train/tokens_per_sec": 50 / 2, "train/samples_per_sec": 8 / 2, "train/mfu": 6e12 / 2 / 1e13,
                      "ktok/s": 0.025, "mfu%": 30.0}
    monitor.on_validation_start(run, module)
    clock.now += 5.0  # validation: not training time
    monitor.on_validation_end(run, module)
    clock.now += 0.5
    run.global_step = 2
    monitor.on_train_batch_end(run, module, None, batch, 2)
    assert logged["train/tokens_per_sec"] == 25 / 0.5 and logged["train/mfu"] == 3e12 / 0.5 / 1e13


class RecordTokens(L.Callback):
    def __init__(self):
        self.real, self.samples, self.padded = [], [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.real.append(int(real_tokens(batch).sum()))
        self.samples.append(batch["input_ids"].shape[0])
        self.padded.append(batch["input_ids"].numel())


def test_a_fit_logs_throughput_of_real_tokens_to_tensorboard_and_the_bar(tmp_path):
    from lightning.pytorch.loggers import TensorBoardLogger
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    dm, record = data(), RecordTokens()
    logger = TensorBoardLogger(tmp_path, name="run")
    run = L.Trainer(max_steps=4, accelerator="cpu", logger=logger, log_every_n_steps=2, accumulate_grad_batches=2,
                    enable_model_summary=False, limit_val_batches=0, enable_checkpointing=False,
                    callbacks=[ThroughputMonitor(peak_flops=1e12), record])
    run.fit(module(dm), dm)
    assert {"ktok/s", "mfu%"} <= set(run.progress_bar_metrics)
    events = EventAccumulator(logger.log_dir)
    events.Reload()
    series = {key: [event.value for event in events.Scalars(key)] for key in
              ("train/tokens_per_sec", "train/samples_per_sec", "train/mfu")}
    assert [event.step for event in events.Scalars("train/mfu")] == [1, 3]  # optimizer steps 2 and 4
    assert all(value > 0 for values in series.values() for value in values)
    # both rates share an interval's clock: their ratio is that interval's real tokens per row (4 micro-batches)
    for interval, (tokens, samples) in enumerate(zip(series["train/tokens_per_sec"], series["train/samples_per_sec"])):
        window = slice(4 * interval, 4 * interval + 4)
        expected = sum(record.real[window]) / sum(record.samples[window])
        assert tokens / samples == pytest.approx(expected, rel=1e-6)
    assert sum(record.real) < sum(record.padded)  # the batches were padded: the ratio would differ with padding


class PerRankBatch(L.LightningDataModule):
    """Rank r trains on ``batches[r]`` (no distributed sampler)."""

    def __init__(self, *batches):
        super().__init__()
        self.batches = batches

    def train_dataloader(self):
        return torch.utils.data.DataLoader([self.batches[self.trainer.global_rank]], batch_size=None)


def test_throughput_counts_every_data_parallel_rank(tmp_path):
    """DDP on two CPU processes with batches of different sizes: the logged rates are of both ranks' rows and real
    tokens (their ratio shares one clock), not rank 0's times the world size."""
    dm = data(loader={"batch_size": 8})
    dm.setup("fit")
    full = next(iter(dm.train_dataloader()))
    small = {key: value[:3] for key, value in full.items() if torch.is_tensor(value) and value.dim() > 0}
    small.update({key: value for key, value in full.items() if key not in small})
    run = L.Trainer(max_steps=1, accelerator="cpu", devices=2, strategy="ddp_spawn", logger=False,
                    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                    limit_val_batches=0, log_every_n_steps=1, default_root_dir=tmp_path,
                    callbacks=[ThroughputMonitor(peak_flops=1e12)])
    run.fit(module(dm), datamodule=PerRankBatch(full, small))
    metrics = run.callback_metrics
    tokens, samples = float(metrics["train/tokens_per_sec"]), float(metrics["train/samples_per_sec"])
    both = int(real_tokens(full).sum() + real_tokens(small).sum())
    assert tokens / samples == pytest.approx(both / (8 + 3), rel=1e-6)
    assert tokens / samples != pytest.approx(2 * int(real_tokens(full).sum()) / 16, rel=1e-3)  # rank 0 × world size
