"""Callbacks used by the default configs: step progress, a run summary, safe interruption, prediction files."""

from __future__ import annotations

import itertools
import json
import signal
import threading
import time
from collections import deque
from contextlib import contextmanager
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import BasePredictionWriter, ModelCheckpoint, TQDMProgressBar
from lightning.pytorch.cli import SaveConfigCallback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_only, rank_zero_warn

from lit_dllm import compat
from lit_dllm.checkpointing import check_writable
from lit_dllm.data.batch import real_tokens
from lit_dllm.data.datamodule import DLLMDataModule
from lit_dllm.meshes import data_parallel_group
from lit_dllm.throughput import peak_flops


class StepProgressBar(TQDMProgressBar):
    """The training bar counts optimizer steps out of ``max_steps``, with tqdm's rate and ETA, across epochs.

    Without ``max_steps`` (epoch-based runs) it is Lightning's per-epoch bar.
    """

    def on_train_epoch_start(self, trainer: L.Trainer, *args) -> None:
        if trainer.max_steps < 0:
            return super().on_train_epoch_start(trainer, *args)
        bar = self.train_progress_bar
        if bar.total != trainer.max_steps:
            bar.reset(total=trainer.max_steps)
            bar.initial = trainer.global_step  # a resumed run: the rate and ETA count this call's steps only
            _show(bar, trainer.global_step)
        bar.set_description(f"Epoch {trainer.current_epoch}")

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:
        if trainer.max_steps < 0:
            return super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        step = trainer.global_step
        if self.is_enabled and (step % self.refresh_rate == 0 or step == trainer.max_steps):
            _show(self.train_progress_bar, step)
            self.train_progress_bar.set_postfix(self.get_metrics(trainer, pl_module))


def _show(bar, step: int) -> None:
    """Move a tqdm bar to ``step`` and redraw it (a disabled bar ignores both)."""
    bar.n = step
    bar.refresh()


class RunSummary(L.Callback):
    """At the end of ``fit``: steps, wall time, tokens/s, the loss smoothed over the last ``window`` steps, the final
    metrics, and where the logs and checkpoints are."""

    def __init__(self, window: int = 50) -> None:
        self.window = window

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.on_train_start(trainer, pl_module)  # a fit that never trains (max_steps reached) still gets a summary
        self.trained = False

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # after a checkpoint's state is restored, so a resumed run counts only this call's steps
        self.start, self.first_step, self.tokens, self.trained = time.perf_counter(), trainer.global_step, 0, True
        self.losses: deque[float] = deque(maxlen=self.window)
        self._logged_step = trainer.global_step

    def on_train_batch_end(self, trainer: L.Trainer, pl_module, outputs, batch, batch_idx) -> None:
        tokens = batch["input_ids"].numel() if "input_ids" in batch else batch["prompt_lengths"].sum()  # RL: prompts
        self.tokens += int(tokens) * trainer.world_size
        loss = trainer.callback_metrics.get("train/loss")
        if loss is not None and trainer.global_step != self._logged_step:  # a new optimizer step was logged
            self.losses.append(float(loss))
            self._logged_step = trainer.global_step

    @rank_zero_only
    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        seconds = time.perf_counter() - self.start
        steps = trainer.global_step - self.first_step
        metrics = {k: float(v) for k, v in sorted(trainer.callback_metrics.items()) if v.numel() == 1}
        lines = [
            (f"Finished after {trainer.global_step} optimizer steps ({steps} in this call) in {_duration(seconds)}: "
             f"{self.tokens / max(seconds, 1e-9):,.0f} tokens/s (padding included).") if self.trained
            else _untrained(trainer)
        ]
        if self.losses:
            lines.append(f"  {'train/loss, last ' + str(len(self.losses)) + ' steps':<28} {sum(self.losses) / len(self.losses):.4f}")
        lines += [f"  {name:<28} {value:.4f}" for name, value in metrics.items()]
        if trainer.logger is not None and trainer.logger.log_dir:
            lines.append(f"Logs:        {trainer.logger.log_dir}  (tensorboard --logdir {trainer.logger.save_dir})")
        checkpoint = trainer.checkpoint_callback
        if checkpoint is not None:
            lines.append(f"Checkpoint:  {checkpoint.last_model_path or checkpoint.best_model_path}")
        print("\n".join(lines), flush=True)


class ThroughputMonitor(L.Callback):
    """Training speed, logged at every ``log_every_n_steps``-th optimizer step to the logger and the progress bar:

    * ``train/tokens_per_sec`` (bar: ``ktok/s``): real tokens, the examples' own (no padding or block fill; see
      :func:`~lit_dllm.data.batch.real_tokens`), per second, summed over the data-parallel ranks;
    * ``train/samples_per_sec``: examples (packed rows: documents) per second, summed over the data-parallel ranks;
    * ``train/mfu`` (bar: ``mfu%``): model FLOPs per second per device (the module's ``training_flops(batch)`` summed
      over ranks, divided by the world size; a mixture-of-experts model counts its active parameters, the top-k
      experts a token runs) over one device's peak: ``peak_flops`` if given, else
      :func:`lit_dllm.throughput.peak_flops` of the card at the trainer's precision; absent where neither is known
      (a CPU). Under ``fp8`` it stays against the bf16 dense peak (a bf16-equivalent MFU, which fp8's speed-up raises);
    * ``train/peak_memory_gib``: ``torch.cuda.max_memory_allocated`` of rank 0's GPU so far (absent on a CPU).

    Rates cover the optimizer steps since the previous log: every micro-batch of gradient accumulation, the optimizer
    step, data loading and checkpointing, but not validation. A resumed run counts from its first new step. The clock
    is read after one CUDA synchronisation per log, not per step.

    Why not Lightning's ``ThroughputMonitor``: it synchronises at every micro-batch, multiplies rank 0's counts by the
    world size (padding included unless a ``length_fn`` says otherwise), writes to the logger only, and its peak table
    misses the plain "NVIDIA H200" name and gives sparsity peaks for some Hopper cards.
    """

    def __init__(self, peak_flops: float | None = None) -> None:
        self.peak_flops = peak_flops
        self._validation_start: float | None = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.peak = self.peak_flops or peak_flops(trainer.strategy.root_device, trainer.precision)
        self._step = trainer.global_step
        self._restart(trainer)

    def _restart(self, trainer: L.Trainer) -> None:
        _synchronize(trainer)
        self._start, self._paused = time.perf_counter(), 0.0
        self._tokens = torch.zeros((), dtype=torch.float64, device=trainer.strategy.root_device)
        self._samples = 0
        self._flops = torch.zeros((), dtype=torch.float64, device=trainer.strategy.root_device)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._tokens += real_tokens(batch).sum()
        self._samples += len(batch["input_lengths"]) if "input_lengths" in batch else len(batch["input_ids"])
        flops = getattr(pl_module, "training_flops", None)
        self._flops += flops(batch) if flops is not None else 0.0
        stepped, self._step = trainer.global_step != self._step, trainer.global_step
        if stepped and _logger_writes(trainer):
            self._log(trainer, pl_module)

    def _log(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        _synchronize(trainer)
        seconds = max(time.perf_counter() - self._start - self._paused, 1e-9)
        totals = torch.stack([self._tokens, self._tokens.new_tensor(self._samples), self._flops])
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(totals, group=data_parallel_group(trainer.strategy))
        tokens, samples, flops = totals.tolist()
        metrics = {"train/tokens_per_sec": tokens / seconds, "train/samples_per_sec": samples / seconds}
        bar = {"ktok/s": tokens / seconds / 1e3}
        if self.peak and flops:
            metrics["train/mfu"] = flops / trainer.world_size / seconds / self.peak
            bar["mfu%"] = 100 * metrics["train/mfu"]
        if trainer.strategy.root_device.type == "cuda":
            metrics["train/peak_memory_gib"] = torch.cuda.max_memory_allocated(trainer.strategy.root_device) / 2**30
        pl_module.log_dict(metrics, on_step=True, on_epoch=False, rank_zero_only=True)
        pl_module.log_dict(bar, on_step=True, on_epoch=False, prog_bar=True, logger=False, rank_zero_only=True)
        self._restart(trainer)

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.state.fn == "fit" and not trainer.sanity_checking:  # time out of the training rates
            _synchronize(trainer)
            self._validation_start = time.perf_counter()

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._validation_start is not None:
            _synchronize(trainer)
            self._paused += time.perf_counter() - self._validation_start
            self._validation_start = None


def _logger_writes(trainer: L.Trainer) -> bool:
    """Whether the logger writes the metrics of the optimizer step just taken: Lightning's rule, on the global step
    (Lightning's private count of the batches that stepped, which equals it with one optimizer)."""
    every = trainer.log_every_n_steps
    return every > 0 and (trainer.global_step % every == 0 or trainer.should_stop)


def _synchronize(trainer: L.Trainer) -> None:
    if trainer.strategy.root_device.type == "cuda":
        torch.cuda.synchronize(trainer.strategy.root_device)


def _untrained(trainer: L.Trainer) -> str:
    limit = (f"max_steps={trainer.max_steps} is reached" if 0 <= trainer.max_steps <= trainer.global_step
             else "another limit (max_epochs, max_time, limit_train_batches) is reached")
    return (f"Nothing trained in this call: the run is at optimizer step {trainer.global_step} and {limit}. Pass a "
            "larger --trainer.max_steps (or that limit) to train on.")


def _duration(seconds: float) -> str:
    minutes, seconds = divmod(round(seconds), 60)
    return f"{minutes} min {seconds} s" if minutes else f"{seconds} s"


class StoppedBySignal(SystemExit):
    """``fit`` stopped by SIGINT or SIGTERM: the process exits with ``128 + signal`` (130 / 143), the status a shell
    gives a process that signal ended. A ``SystemExit`` like Lightning's own ``SIGTERMException``: the
    ``on_exception`` hooks run, the rest of the loop (validation, further saves) does not."""

    def __init__(self, signum: int) -> None:
        super().__init__(128 + int(signum))
        self.signal = signal.Signals(signum)


class GracefulStop(L.Callback):
    """Stop ``fit`` safely on SIGINT (Ctrl+C) or SIGTERM (schedulers, ``kill``), raising :class:`StoppedBySignal`
    (exit 130 / 143).

    * During training the optimizer step in flight finishes (a validation pass in flight too, then one more step),
      every ``ModelCheckpoint(save_last=True)`` saves its ``last`` checkpoint, and the run stops at once: no
      validation, no second checkpoint. The save goes where Lightning's would, so a new run keeps another run's
      ``last.ckpt`` (``last-v1.ckpt`` beside it). A second Ctrl+C aborts at once without saving.
    * Before training (data set-up, restoring a checkpoint, the sanity check) and after the final save there is
      nothing to save: it stops at once. This needs the handlers held outside training too, as the CLI does for its
      whole run with :meth:`catching_signals`; through the Trainer API alone they are in place during training.

    Handlers are installed in the main thread only and not for a signal that is ignored (``nohup``, ``&``).
    ``signal`` holds what stopped the run. Before the first step it checks that the checkpoint and log folders are
    writable, so a read-only output fails before any compute is spent.

    At the end of every fit it also refreshes a stale ``last.ckpt``: Lightning's ``ModelCheckpoint(save_last=True,
    every_n_train_steps=k)`` saves the final state only if no ``last`` was saved before, so a run of 750 steps with
    ``k=500`` would leave ``last.ckpt`` at step 500 and ``--ckpt_path last`` would silently lose 250 steps.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.signal: signal.Signals | None = None
        self._previous: dict = {}
        self._holders = 0  # catching_signals and a fit's training: the handlers go back when neither holds them
        self._training = False
        self._step = -1

    @contextmanager
    def catching_signals(self):
        """Handle SIGINT and SIGTERM as described above while the block runs."""
        self._hold()
        try:
            yield self
        finally:
            self._release()

    def _hold(self) -> None:
        if self._holders == 0 and threading.current_thread() is threading.main_thread():
            wanted = [sig for sig in self.SIGNALS if signal.getsignal(sig) is not signal.SIG_IGN]
            self._previous = {sig: signal.signal(sig, self._receive) for sig in wanted}
        self._holders += 1

    def _release(self) -> None:
        self._holders -= 1
        if self._holders == 0:
            for sig, handler in self._previous.items():
                signal.signal(sig, handler)
            self._previous = {}

    def _receive(self, signum: int, frame) -> None:
        again, self.signal = self.signal is not None, self.signal or signal.Signals(signum)
        if self._training and not (again and signum == signal.SIGINT):
            rank_zero_info(f"\n{self.signal.name}: stopping after this optimizer step, saving a checkpoint first "
                           "(Ctrl+C again aborts without saving).")
            return
        what = "aborted without saving" if self._training else "nothing to save"
        rank_zero_warn(f"{signal.Signals(signum).name}: stopped at once ({what}).")
        raise StoppedBySignal(signum)

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.signal, self._step = None, trainer.global_step
        for folder, what in _output_folders(trainer):
            check_writable(folder, what)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._training = True
        self._hold()
        for sig in self._previous:  # over Lightning's SIGTERM handler, which would exit 0 from inside the loop
            signal.signal(sig, self._receive)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self._step:  # inside a gradient-accumulation window
            return
        self._step = trainer.global_step
        self._stop_if_signalled(trainer)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._save_last(trainer)  # runs before ModelCheckpoint's own on_train_end
        self._stop_if_signalled(trainer)
        self._end_training()

    def _stop_if_signalled(self, trainer: L.Trainer) -> None:
        if not trainer.strategy.reduce_boolean_decision(self.signal is not None, all=False):  # any rank stops all
            return
        self.signal = self.signal or signal.SIGTERM
        paths = self._save_last(trainer)
        saved = f"saved {', '.join(paths)}" if paths else "nothing saved (no ModelCheckpoint(save_last=True))"
        rank_zero_warn(f"Stopped by {self.signal.name} after optimizer step {trainer.global_step}; {saved}. "
                       "Resume with --ckpt_path last (or ckpt_path=that file).")
        raise StoppedBySignal(self.signal)

    @staticmethod
    def _save_last(trainer: L.Trainer) -> list[str]:
        """Save each ``ModelCheckpoint(save_last=True)``'s ``last`` checkpoint unless it holds this step; their
        paths."""
        callbacks = [cb for cb in trainer.checkpoint_callbacks if isinstance(cb, ModelCheckpoint) and cb.save_last]
        for callback in callbacks:
            compat.save_last_checkpoint(callback, trainer)
        return [callback.last_model_path for callback in callbacks]

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._end_training()

    def _end_training(self) -> None:
        # before Lightning restores the handlers it found at the start of fit (ours, where the CLI holds them)
        if self._training:
            self._training = False
            self._release()


class RunConfig(SaveConfigCallback):
    """The CLI's record of each call's resolved config, in a folder of the run and never over an existing file: the
    logger's version folder (``runs/mdlm_tiny/version_0/config.yaml``), or without a logger the run folder
    (:attr:`run_folder`, ``<default_root_dir>/lightning_logs``, which the CLI sets), never the working folder, which
    may hold a config of yours. A call into a folder that already holds one (a resume into an explicit logger
    ``version``) writes ``config-v1.yaml``, ``config-v2.yaml``..., so the first call's record stays."""

    run_folder: str | None = None

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **{**kwargs, "overwrite": False, "save_to_log_dir": False})

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.folder = Path(trainer.log_dir if trainer.loggers else self.run_folder or trainer.default_root_dir)
        super().setup(trainer, pl_module, stage)  # trainer.log_dir broadcasts: every rank asks it, rank 0 writes

    def save_config(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        name = Path(self.config_filename)
        path = next(path for number in itertools.count() if not (path := self.folder / (
            name.name if number == 0 else f"{name.stem}-v{number}{name.suffix}")).exists())
        self.folder.mkdir(parents=True, exist_ok=True)
        self.parser.save(self.config, str(path), skip_none=False, multifile=self.multifile)


def _is_json(line: str) -> bool:
    try:
        json.loads(line)
    except json.JSONDecodeError:
        return False
    return True


def _output_folders(trainer: L.Trainer) -> list[tuple[str, str]]:
    folders = [(cb.dirpath, "checkpoint") for cb in trainer.checkpoint_callbacks if getattr(cb, "dirpath", None)]
    if trainer.logger is not None and trainer.logger.save_dir:
        folders.append((trainer.logger.save_dir, "log"))
    return folders or [(trainer.default_root_dir, "output")]


class JsonlPredictionWriter(BasePredictionWriter):
    """Write ``predict`` outputs (lists of dicts, e.g. prompt / generated / reference) as JSON lines.

    ``path`` defaults to ``predictions.jsonl`` in the logger's directory (else the trainer's root dir);
    with several ranks each writes its own ``predictions.rank<r>.jsonl``. A file already there is refused (a
    ValueError naming it) unless ``overwrite=True`` or this writer created it in an earlier ``predict`` call.
    """

    def __init__(self, path: str | None = None, overwrite: bool = False) -> None:
        super().__init__(write_interval="batch")
        self.path = path
        self.overwrite = overwrite
        self._created: set[Path] = set()  # files this writer started: a later predict call may start them again

    def on_predict_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.path is None:
            folder = trainer.logger.log_dir if trainer.logger is not None else trainer.default_root_dir
            name = "predictions.jsonl" if trainer.world_size == 1 else f"predictions.rank{trainer.global_rank}.jsonl"
            self.path = str(Path(folder) / name)
        path = Path(self.path)
        if path.exists() and not (path.is_file() and (self.overwrite or path.resolve() in self._created)):
            kind = "a file" if path.is_file() else "not a file"
            raise ValueError(
                f"JsonlPredictionWriter: {path} already exists ({kind}), and predict would overwrite it. Choose "
                "another path (--trainer.callbacks.init_args.path=...), move the file away, or pass "
                "--trainer.callbacks.init_args.overwrite=true to replace it."
            )
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("")
        self._created.add(path.resolve())

    def write_on_batch_end(self, trainer, pl_module, prediction, batch_indices, batch, batch_idx, dataloader_idx) -> None:
        with open(self.path, "a") as out:
            out.writelines(json.dumps(row) + "\n" for row in prediction)

    def on_predict_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        rank_zero_info(f"Predictions: {self.path}")


class RegeneratedDataWriter(BasePredictionWriter):
    """Write the model's own answers as a data file: for every prompt of the predict split, its source row (same
    fields, raw prompt) with the response replaced by the generated answer (see
    :meth:`DLLMDataModule.replace_response`), plus its ``example_index``. ``DLLMDataModule`` reads the file back
    with the same field settings, e.g. to train a DFlash draft on its target's answers.

    Resumable: the rows already in ``path`` are kept (each checked against its source row) and their prompts are
    left out of the predict loader, so rerunning an interrupted command generates only the missing ones. At the
    end it logs the rows written now, those already there, the total against the split's examples, and how many
    new answers hit ``generation.gen_length`` without eos or are empty. One process only (``trainer.devices=1``).
    """

    def __init__(self, path: str) -> None:
        super().__init__(write_interval="batch")
        self.path = Path(path)
        self._data: DLLMDataModule | None = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "predict":
            return
        data = trainer.datamodule
        if not isinstance(data, DLLMDataModule):
            raise TypeError(f"RegeneratedDataWriter needs a DLLMDataModule to read source rows, got {type(data)}.")
        if trainer.world_size > 1:
            raise ValueError(
                f"RegeneratedDataWriter writes one file from one process, but predict runs {trainer.world_size} "
                "processes: set trainer.devices=1 (and trainer.num_nodes=1)."
            )
        if Path(data.source.path).resolve() == self.path.resolve():
            raise ValueError(f"RegeneratedDataWriter would overwrite its input data {self.path}: choose another path.")
        if pl_module.generation.gen_length is None:
            rank_zero_warn("model.init_args.generation.gen_length is None: each answer is limited to its batch's longest "
                           "reference answer + 1 token. Set model.init_args.generation.gen_length for regeneration.")
        self._kept = self._existing_rows(data)
        self._data, self._written, self._hit_length, self._empty = data, 0, 0, 0
        data.exclude_from_predict(self._kept)
        if self._kept:
            rank_zero_info(f"{self.path}: keeping the {len(self._kept)} rows already there; generating the others.")

    def _existing_rows(self, data: DLLMDataModule) -> set[int]:
        """The example indices of the rows already in ``path``, each checked against its source row. A last line
        cut by an interruption (no newline) is removed; its prompt is answered again."""
        if not self.path.exists():
            self.path.parent.mkdir(parents=True, exist_ok=True)
            return set()
        if not self.path.is_file():
            raise ValueError(f"RegeneratedDataWriter: {self.path} exists and is not a file: choose another path.")
        text = self.path.read_text(encoding="utf-8")
        lines = text.splitlines()
        cut = bool(text) and not text.endswith("\n") and not _is_json(lines[-1])  # an interrupted write's last line
        done: set[int] = set()
        for number, line in enumerate(lines[:-1] if cut else lines, 1):
            if not line.strip():
                continue
            where = f"{self.path} line {number}"
            try:
                row = json.loads(line)
                index = row.pop("example_index")
                source = data.source_row(index)
            except (json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as err:
                raise ValueError(f"{where} is not a row of this data ({type(err).__name__}: {err}). Delete the file "
                                 "to start over, or run the config that wrote it.") from err
            blank = data.replace_response  # compared without their responses
            if set(row) != set(source) or blank(row, "") != blank(source, ""):
                raise ValueError(f"{where} (example_index {index}) does not match that example's source row: the "
                                 "file was written from other data or settings. Delete it, or choose another path.")
            if index in done:
                raise ValueError(f"{where} repeats example_index {index}; remove the duplicate line.")
            done.add(index)
        # checked before any change: the file is this writer's own (its rows), else it is refused above
        if cut and not (done or lines[-1].lstrip().startswith("{")):
            raise ValueError(f"{self.path} line {len(lines)} is not a row of this data (nor part of one): the file "
                             "was not written by RegeneratedDataWriter. Choose another path, or delete the file.")
        if cut:
            self.path.write_text(text[: text.rfind("\n") + 1], encoding="utf-8")
            rank_zero_warn(f"{self.path}: removed an incomplete last line (an interrupted write); it is regenerated.")
        elif text and not text.endswith("\n"):  # a whole last row without its newline: kept, the newline added
            with self.path.open("a", encoding="utf-8") as out:
                out.write("\n")
        return done

    def write_on_batch_end(self, trainer, pl_module, prediction, batch_indices, batch, batch_idx, dataloader_idx):
        data = self._data
        rows = [{**data.replace_response(data.source_row(p["example_index"]), p["generated"]),
                 "example_index": p["example_index"]} for p in prediction]
        with self.path.open("a", encoding="utf-8") as out:
            out.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
        self._written += len(rows)
        self._hit_length += sum(bool(p.get("hit_gen_length")) for p in prediction)
        self._empty += sum(not p["generated"].strip() for p in prediction)

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage == "predict" and self._data is not None:
            self._report(pl_module)

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        if trainer.state.fn == "predict" and self._data is not None:  # e.g. Ctrl+C: what is there so far
            self._report(pl_module)

    def _report(self, pl_module: L.LightningModule) -> None:
        """Log the rows written now, those kept, the total against the split's examples and the cut answers."""
        data, self._data = self._data, None
        data.exclude_from_predict(())
        examples, sources = data.num_examples("predict")
        total = len(self._kept) + self._written
        message = (f"{self.path}: wrote {self._written} rows now, {len(self._kept)} were already there: {total} rows "
                   f"for the {examples} predict examples")
        if sources > examples:
            message += f" ({sources - examples} of the {sources} source rows dropped by the data module, as logged)"
        message += "."
        if self._hit_length:
            message += (f" {self._hit_length} of the {self._written} new answers hit gen_length="
                        f"{pl_module.generation.gen_length} without eos (cut short; raise model.init_args.generation.gen_length "
                        "to let them finish).")
        if self._empty:
            message += f" {self._empty} new answers are empty (the data module drops them when it reads the file)."
        rank_zero_info(message)
        if total < examples:
            rank_zero_warn(f"{examples - total} of the {examples} predict examples have no row in {self.path} yet: "
                           "rerun the same command to generate them.")
