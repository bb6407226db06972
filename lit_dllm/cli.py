"""The LightningCLI behind ``train.py``: model and data chosen by class, tokenizer facts linked, one checkpoint
folder per run so ``--ckpt_path last`` finds the run's newest checkpoint."""

from __future__ import annotations

import inspect
import os
import re
import sys
from argparse import RawDescriptionHelpFormatter
from dataclasses import asdict, fields, is_dataclass
from pathlib import Path

from jsonargparse import DefaultHelpFormatter, Namespace
from lightning.pytorch.callbacks import ModelCheckpoint, ProgressBar
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

import lit_dllm
from lit_dllm import compat
from lit_dllm.callbacks import GracefulStop, RunConfig, StepProgressBar
from lit_dllm.checkpointing import (
    LAST_PREFIX,
    AtomicCheckpointIO,
    NotAFolder,
    RunLocked,
    acquire_run_lock,
    describe_path,
    find_last_checkpoint,
    is_sharded_checkpoint,
    merge_hparams,
    partial_files,
    release_run_lock,
    run_checkpoint_dir,
)
from lit_dllm.core.token_loss import TokenLossModule
from lit_dllm.settings import settings_groups
from lit_dllm.data.datamodule import GROUPS, DLLMDataModule
from lit_dllm.upgrade import current_class_path, layout_hints, upgrade_hparams


def models() -> dict[str, str]:
    """Every module class ``lit_dllm`` exports (its ``model.class_path``) that declares its own ``tiny_config`` (its
    family's tiny CPU config), with that config: the families, found by their export line."""
    exported = {name: getattr(lit_dllm, name) for name in lit_dllm.__all__}
    return {f"lit_dllm.{name}": vars(cls)["tiny_config"] for name, cls in exported.items()
            if isinstance(cls, type) and issubclass(cls, TokenLossModule) and vars(cls).get("tiny_config")}


def description() -> str:
    """The help text's description: usage examples and the families of :func:`models`."""
    return """Train, validate and sample diffusion language models (lit_dllm).

Start with a config from configs/ and override any key on the command line:
  python train.py fit --config configs/mdlm_tiny.yaml                 # the tiny CPU demo
  python train.py fit --config configs/hybrid_tiny.yaml               # hybrid diffusion + AR
  python train.py fit --config configs/mdlm_tiny.yaml --trainer.max_steps=200 --data.init_args.source.path=task:sort
  python train.py fit --config configs/mdlm_tiny.yaml --ckpt_path last   # resume the run's newest checkpoint
  python train.py predict --config configs/mdlm_tiny.yaml --ckpt_path last
  python train.py predict --config configs/smollm2_regenerate_gsm8k.yaml  # a pretrained model's answers as data
  python train.py fit --config configs/mdlm_tiny.yaml --print_config  # the full, editable config
Models (model.class_path), each with its tiny CPU config:
""" + "\n".join(f"  {path:<36}{config}" for path, config in models().items()) + """
  or your own subclass of lit_dllm.DLLMModule (diffusion) or lit_dllm.TokenLossModule (any family).
Data (data.class_path): lit_dllm.DLLMDataModule, its settings in groups (data.init_args.source, tokenizer,
formatting, collation, loader, splits, task; `python train.py fit --data.help lit_dllm.DLLMDataModule`).
`python train.py fit --help` lists every option; the tokenizer group, vocabulary size and special token ids
are linked from the data module into the model, so configs never repeat them. A run keeps its checkpoints in
<logger save_dir>/<logger name>/checkpoints; `--ckpt_path last` takes the newest last*.ckpt there, and a new
fit (no --ckpt_path) into a folder that holds checkpoints is refused. Ctrl+C / SIGTERM: fit saves last.ckpt and
exits 130 / 143."""

LINKED_FROM_DATA = ("vocab_size", "mask_token_id", "pad_token_id", "eos_token_id")
LINKED_SETTINGS = {"tokenizer": "tokenizer_settings"}
"""The data module's groups the model takes whole (``data.init_args.tokenizer`` -> ``model.init_args.
tokenizer_settings``: one knob each for the tokenizer and the model)."""


class HelpFormatter(RawDescriptionHelpFormatter, DefaultHelpFormatter):
    """jsonargparse's help, keeping the description's line breaks."""


@compat.skip_checkpoint_hparams  # parse_arguments merges them under the user's settings
class DLLMCLI(LightningCLI):
    """``fit | validate | test | predict`` for any :class:`TokenLossModule` (every family) on any
    :class:`DLLMDataModule`.

    * The tokenizer's vocabulary size and special ids are computed by the data module and linked into the model.
    * Checkpoints go to one folder per run (:func:`run_checkpoint_dir` of the logger's ``save_dir`` and ``name``),
      written atomically (:class:`AtomicCheckpointIO`); ``--ckpt_path last`` resolves to the newest ``last*.ckpt``
      there. Without one, ``fit`` starts a new run (with a warning) and ``validate``/``test``/``predict`` fail. A new
      ``fit`` (no ``--ckpt_path``) into a folder that already holds checkpoints is an error (exit 2): it would
      replace or mix with that run's.
    * ``validate``/``test``/``predict`` without ``--ckpt_path`` score pretrained weights (the module's ``model``, or
      DFlash's ``target`` and ``draft``) and say so; a randomly initialised model is an error (exit 2).
    * A checkpoint's hyper-parameters are the model's defaults; whatever a config file or the command line writes
      stays on top (also a value equal to the default), and every such override of a different checkpoint value is
      reported.
    * A GPU config without CUDA, or a ``--ckpt_path`` that is not a checkpoint (saying what is there), is an error
      naming the fix (exit 2); so is a ``fit`` into a run folder whose ``fit.lock`` a live fit holds.
    * SIGINT/SIGTERM at any moment of the CLI's run exits with ``128 + signal``; during ``fit``'s training it saves
      ``last.ckpt`` first (:class:`GracefulStop`).
    * The progress bar counts optimizer steps out of ``max_steps`` (:class:`StepProgressBar`).
    * Each call's resolved config is saved in the run's folder, never over a file (:class:`RunConfig`).
    """

    def __init__(self, *args, **kwargs) -> None:
        self.graceful_stop, self.run_lock = GracefulStop(), None
        kwargs.setdefault("save_config_callback", RunConfig)
        try:
            with self.graceful_stop.catching_signals():  # from the start: no moment where Lightning's handlers decide
                super().__init__(*args, **kwargs)
        finally:
            if self.run_lock is not None:
                release_run_lock(self.run_lock)

    def add_arguments_to_parser(self, parser) -> None:
        for name in LINKED_FROM_DATA:
            parser.link_arguments(f"data.{name}", f"model.init_args.{name}", apply_on="instantiate")
        for source, target in LINKED_SETTINGS.items():  # jsonargparse (4.53) links a dataclass group whole, at parse
            parser.link_arguments(f"data.init_args.{source}", f"model.init_args.{target}")

    def parse_arguments(self, parser, args) -> None:
        self.raw_args = list(sys.argv[1:] if args is None else args) if not isinstance(args, dict) else []
        groups = _null_groups(self.raw_args)
        if groups:
            parser.error(f"{', '.join(groups)} null: a settings group cannot be null. Leave it out for its defaults, or "
                         f"set its fields (e.g. {groups[0]}.<field>=<value>; docs/settings.md).")
        try:
            super().parse_arguments(parser, args if isinstance(args, dict) else _null_fields(self.raw_args))
        except SystemExit:
            hints = (*layout_hints(_written_model_settings(self.raw_args, ("backbone",)),
                                   _written_data_settings(self.raw_args), [_import(path) for path in models()]),
                     _strategy_hint(self.raw_args))
            for hint in hints:
                if hint:
                    print(hint, file=sys.stderr)
            raise
        self._resolve_checkpoint()

    def _run_config(self) -> Namespace:
        """The settings of the subcommand being run (the whole config when there is none)."""
        subcommand = self.config.get("subcommand")
        return self.config[subcommand] if subcommand else self.config

    # ------------------------------------------------------------------ checkpoints
    def _resolve_checkpoint(self) -> None:
        """Resolve ``last`` to a file, then load the checkpoint's hyper-parameters under the user's choices."""
        subcommand, config = self.config.get("subcommand"), self._run_config()
        self.checkpoint_dir = run_checkpoint_dir(*_run_folder(config.trainer))
        checkpointing = config.trainer.get("enable_checkpointing") is not False
        if subcommand == "fit" and checkpointing:
            self._lock_run_folder()
        if config.get("ckpt_path") == LAST_PREFIX:
            config.ckpt_path = self._resolve_last(subcommand, config)
        if config.get("ckpt_path"):
            self._check_checkpoint_path(config.ckpt_path)
        if config.get("ckpt_path") and _metadata_file(config.ckpt_path).is_file():
            self._apply_checkpoint_hparams(config)
        if subcommand in ("validate", "test", "predict") and not config.get("ckpt_path"):
            self._check_pretrained(subcommand, config.model)
        if subcommand == "fit" and not config.get("ckpt_path") and checkpointing:
            self._check_new_run_folder(config)

    def _lock_run_folder(self) -> None:
        """Hold the run folder's lock (``<save_dir>/<name>/fit.lock``, beside ``checkpoints/`` so that Lightning does
        not warn of a non-empty checkpoint folder) for this fit, on rank 0, so that a second fit into it is refused."""
        if any(os.environ.get(name, "0") != "0" for name in ("RANK", "LOCAL_RANK", "NODE_RANK")):
            return
        try:
            self.run_lock = acquire_run_lock(self.checkpoint_dir.parent)
        except (RunLocked, NotAFolder) as err:  # another fit's lock; a file where the run folder goes
            self.parser.error(str(err))
        except OSError:
            pass  # an unwritable folder: check_writable names it before the first step

    def _check_checkpoint_path(self, ckpt_path: str) -> None:
        """A ``--ckpt_path`` that is neither a file nor a sharded checkpoint folder is an error saying what is there."""
        if ckpt_path in ("best", "hpc", "registry") or "://" in ckpt_path:  # Lightning's own names, remote files
            return
        if not Path(ckpt_path).is_file() and not is_sharded_checkpoint(ckpt_path):
            self.parser.error(_not_a_checkpoint(ckpt_path, describe_path(ckpt_path)))

    def _check_new_run_folder(self, config: Namespace) -> None:
        """A new run never writes into a folder holding another run's checkpoints: its steps' and a stop's checkpoints
        would replace or mix with them."""
        folders = [Path(folder) for folder in (self.checkpoint_dir, *_explicit_checkpoint_dirs(config.trainer))]
        found = sorted(path for folder in folders if folder.is_dir() for path in folder.glob("*.ckpt"))
        if found:
            more = f" and {len(found) - 3} more" if len(found) > 3 else ""
            names = ", ".join(str(path) for path in found[:3]) + more
            self.parser.error(
                "fit without --ckpt_path starts a new run, but its checkpoint folder already holds a run's "
                f"checkpoints ({names}). Resume that run with --ckpt_path last, give the new run its own folder "
                "(--trainer.logger.init_args.name=<new name> or another save_dir), or move those checkpoints away."
            )

    def _check_pretrained(self, subcommand: str, model: Namespace) -> None:
        """Without a checkpoint the weights are those the model is built with: pretrained ones (``model``, or
        DFlash's ``target`` plus ``draft``) are scored with a note, a random initialisation is an error."""
        args = model.get("init_args") or Namespace()
        names = ("target.model", "draft") if "target" in args else ("backbone.model",)
        missing = [name for name in names if not args.get(name)]
        if not missing:
            weights = " + ".join(f"{name} {args.get(name)}" for name in names)
            rank_zero_info(f"No --ckpt_path: scoring the pretrained weights of {weights}.")
            return
        unset = " and ".join(f"model.init_args.{name}" for name in missing)
        self.parser.error(
            f"{subcommand} without --ckpt_path would score a randomly initialised model ({unset} not set). Pass "
            f"--ckpt_path last (the run's newest checkpoint) or --ckpt_path=<file.ckpt>, or set {unset} to pretrained "
            "weights (a hub id or folder)."
        )

    def _resolve_last(self, subcommand: str, config: Namespace) -> str | None:
        """The newest ``last*.ckpt`` of the run; without one, a single statement of what the run folder holds: other
        checkpoints (an error naming the newest to pass), an interrupted save's unfinished file, or nothing."""
        folders = [self.checkpoint_dir, *_explicit_checkpoint_dirs(config.trainer)]
        last = find_last_checkpoint(folders)
        if last is not None:
            rank_zero_info(f"--ckpt_path last: {last}")
            return str(last)
        where = ", ".join(str(folder) for folder in folders)
        others = sorted((path for folder in folders if Path(folder).is_dir() for path in Path(folder).glob("*.ckpt")),
                        key=lambda path: path.stat().st_mtime)
        partial = "".join(f"; {path.name} is the unfinished file of an interrupted save, not a checkpoint (delete it)"
                          for path in partial_files(folders))
        if others:
            self.parser.error(
                f"{subcommand} --ckpt_path last: no {LAST_PREFIX}*.ckpt in {where}, but it holds "
                f"{', '.join(path.name for path in others)}{partial}. Continue from the newest with "
                f"--ckpt_path={others[-1]}."
            )
        if subcommand == "fit":
            rank_zero_warn(f"--ckpt_path last: no {LAST_PREFIX}*.ckpt in {where}{partial}; starting a new run.")
            return None
        self.parser.error(
            f"{subcommand} --ckpt_path last: no {LAST_PREFIX}*.ckpt in {where}{partial}. Train first (fit with the same "
            "config and logger save_dir/name), or pass --ckpt_path=<file.ckpt>."
        )

    def _apply_checkpoint_hparams(self, config: Namespace) -> None:
        import torch

        try:
            saved = torch.load(_metadata_file(config.ckpt_path), weights_only=True, map_location="cpu")
        except Exception as err:  # noqa: BLE001 - a file that is no pickle fails in many ways (IndexError for text)
            found = f"{describe_path(config.ckpt_path)} (torch.load: {type(err).__name__})"
            self.parser.error(_not_a_checkpoint(config.ckpt_path, found))
        saved = saved.get("hyper_parameters", {})
        model = config.model
        saved_class = saved.get(compat.CLASS_PATH_KEY)
        if saved_class and not _same_class(current_class_path(saved_class), model.class_path):
            rank_zero_warn(f"{config.ckpt_path} was trained as {saved_class}; loading it into {model.class_path}.")
        given = model.init_args.as_dict() if model.get("init_args") else {}
        groups = settings_groups(_import(model.class_path))
        saved = upgrade_hparams(saved, _import(model.class_path))  # a checkpoint of an earlier layout too
        defaults = _init_defaults(model.class_path)
        saved, given, defaults = (_dotted(values, groups) for values in (saved, given, defaults))
        explicit = _written_model_settings(self.raw_args, groups)
        linked = {f"{target}.{field.name}" for target in LINKED_SETTINGS.values() for field in fields(groups[target])}
        skip = {*LINKED_FROM_DATA, *linked, compat.INSTANTIATOR_KEY, compat.CLASS_PATH_KEY}
        merged, overrides = merge_hparams(saved, given, defaults, explicit, skip)
        for name, value in merged.items():
            model.init_args[name] = value
        if overrides:
            rank_zero_warn("Your settings override the checkpoint's: " + "; ".join(overrides))

    def before_instantiate_classes(self) -> None:
        """A GPU config on a machine without CUDA: the fix, rather than Lightning's "No supported gpu backend"."""
        import torch

        trainer = self._run_config().trainer
        accelerator = trainer.get("accelerator")
        if accelerator in ("gpu", "cuda") and not torch.cuda.is_available():
            self.parser.error(
                f"trainer.accelerator={accelerator!r} (devices={trainer.get('devices')}) needs CUDA GPUs, and this "
                "machine has none. Run it on a GPU machine, or on this CPU with --trainer.accelerator=cpu "
                "--trainer.devices=1 (and --trainer.precision=32-true where the config asks for a GPU precision)."
            )

    def instantiate_trainer(self, **kwargs):
        trainer = super().instantiate_trainer(**kwargs)
        if not any(isinstance(callback, GracefulStop) for callback in trainer.callbacks):
            trainer.callbacks.append(self.graceful_stop)
        if type(trainer.strategy.checkpoint_io) is TorchCheckpointIO:  # Lightning's default; keep a user's plugin
            trainer.strategy.checkpoint_io = AtomicCheckpointIO()
        bar, configured = trainer.progress_bar_callback, self._run_config().trainer.get("callbacks") or []
        if bar is not None and not any(issubclass(_import(cb.class_path), ProgressBar) for cb in configured):
            # Lightning's default bar counts batches of an epoch; count optimizer steps out of max_steps instead
            trainer.callbacks[trainer.callbacks.index(bar)] = StepProgressBar()
        for callback in trainer.checkpoint_callbacks:
            if isinstance(callback, ModelCheckpoint) and callback.dirpath is None:
                callback.dirpath = str(self.checkpoint_dir)
        for callback in trainer.callbacks:
            if isinstance(callback, RunConfig):
                callback.run_folder = str(self.checkpoint_dir.parent)
        return trainer


def _written_model_settings(args: list[str], groups) -> set[str]:
    """The model settings the user wrote: ``--model.[init_args.]NAME`` on the command line, and the model's
    ``init_args`` of every ``--config`` file (or YAML string) and ``--model`` file, whatever their values; within the
    settings ``groups``, each field the user wrote (``generation.gen_length``)."""
    import yaml

    written = set(re.findall(r"--model\.(?:init_args\.)?([\w.]+)", " ".join(args)))
    for flag, value in _flag_values(args, ("--config", "--model")):
        document = yaml.safe_load(Path(value).read_text() if Path(value).is_file() else value)
        model = document.get("model") if flag == "--config" and isinstance(document, dict) else document
        if isinstance(model, dict):
            settings = {**(model.get("init_args") or {}), **model}
            written |= set(_dotted(settings, groups)) - {"class_path", "init_args"}
    return written


def _written_data_settings(args: list[str]) -> dict:
    """The data settings the user wrote, with their values: ``--data.[init_args.]NAME`` on the command line, and the
    data's ``init_args`` of every ``--config`` file (or YAML string) and ``--data`` file."""
    import yaml

    written: dict = {}
    for index, arg in enumerate(args):
        match = re.fullmatch(r"--data\.(?:init_args\.)?(\w+)(?:=(.*))?", arg, re.DOTALL)
        if match:
            value = match.group(2) if match.group(2) is not None else args[index + 1] if index + 1 < len(args) else None
            written[match.group(1)] = value
    for flag, value in _flag_values(args, ("--config", "--data")):
        document = yaml.safe_load(Path(value).read_text() if Path(value).is_file() else value)
        data = document.get("data") if flag == "--config" and isinstance(document, dict) else document
        if isinstance(data, dict):
            written.update({**data, **(data.get("init_args") or {})})
    return written


NULLS = ("null", "Null", "NULL", "~", "None")
"""YAML's spellings of null (and Python's)."""


def _null_args(args: list[str]) -> list[tuple[int, int, str]]:
    """``(index, count, name)`` of each ``--name null`` (count 2) or ``--name=null`` (count 1) in ``args``."""
    found = []
    for index, arg in enumerate(args):
        name, equals, value = arg.partition("=")
        if not equals and index + 1 < len(args):
            value = args[index + 1]
        if name.startswith("--") and value in NULLS:
            found.append((index, 1 if equals else 2, name[2:]))
    return found


def _null_groups(args: list[str]) -> list[str]:
    """The settings groups (of any exported module, or the data module's) set whole to null in ``args``."""
    groups = {group for class_path in models() for group in settings_groups(_import(class_path))}
    named = {"model": groups, "data": set(GROUPS)}
    return [name for _, _, name in _null_args(args)
            if (match := re.fullmatch(r"(model|data)\.(?:init_args\.)?(\w+)", name)) and match[2] in named[match[1]]]


def _null_fields(args: list[str]) -> list[str]:
    """``args`` with each ``--model.init_args.GROUP.FIELD null`` as ``--model.init_args.GROUP {FIELD: null}``:
    jsonargparse (4.53) hands a group of a subclass the string 'None', which an int field refuses."""
    args = list(args)
    for index, count, name in reversed(_null_args(args)):
        match = re.fullmatch(r"((?:model|data)\.(?:init_args\.)?\w+)\.(\w+)", name)
        if match:
            args[index : index + count] = [f"--{match[1]}", f"{{{match[2]}: null}}"]
    return args


def _strategy_hint(args: list[str]) -> str | None:
    """For a failed parse: strategy settings written on a strategy that a config names only (``auto``)."""
    written = [arg.partition("=")[0] for arg in args if arg.startswith("--trainer.strategy.init_args.")]
    if not written:
        return None
    return (f"{written[0]} sets a lit_dllm strategy's settings, which a strategy given by name (strategy: auto, ddp) "
            "does not have: name the strategy too, e.g. --trainer.strategy=lit_dllm.SingleDeviceStrategy (one device) "
            "or lit_dllm.DDPStrategy, before its settings (docs/settings.md).")


def _dotted(values: dict, groups) -> dict:
    """``values`` with each of the settings ``groups`` (a dict, a dataclass or None) as ``GROUP.FIELD`` entries."""
    dotted = {name: value for name, value in values.items() if name not in groups}
    for name in groups:
        group = values.get(name)
        group = asdict(group) if is_dataclass(group) else group or {}
        dotted.update({f"{name}.{field}": value for field, value in group.items()})
    return dotted


def _flag_values(args: list[str], flags: tuple[str, ...]) -> list[tuple[str, str]]:
    """``(flag, value)`` for each ``--flag value`` or ``--flag=value`` in ``args``."""
    found = []
    for index, arg in enumerate(args):
        flag, equals, value = arg.partition("=")
        if flag in flags and (equals or index + 1 < len(args)):
            found.append((flag, value if equals else args[index + 1]))
    return found


def _not_a_checkpoint(ckpt_path: str, found: str) -> str:
    return (f"--ckpt_path={ckpt_path} is not a checkpoint: expected a Lightning .ckpt file written by fit (e.g. "
            "<run>/checkpoints/last.ckpt), a sharded (FSDP2) checkpoint folder, or --ckpt_path last (the run's "
            f"newest); found {found} there.")


def _metadata_file(ckpt_path: str) -> Path:
    """The file holding a checkpoint's hyper-parameters: the file itself, or a distributed (FSDP2) checkpoint
    folder's ``meta.pt``."""
    path = Path(ckpt_path)
    return path / "meta.pt" if path.is_dir() else path


def _logger_configs(trainer: Namespace) -> list:
    logger = trainer.get("logger")
    return [item for item in (logger if isinstance(logger, list) else [logger]) if isinstance(item, Namespace)]


def _run_folder(trainer: Namespace) -> tuple[str, str | None]:
    """(save_dir, name) of the first logger that has them, else (default_root_dir, "lightning_logs")."""
    root = trainer.get("default_root_dir") or "."
    for logger in _logger_configs(trainer):
        args = logger.get("init_args") or Namespace()
        if args.get("save_dir"):
            return args.save_dir, args.get("name", "lightning_logs")
    return root, "lightning_logs"


def _explicit_checkpoint_dirs(trainer: Namespace) -> list[str]:
    callbacks = trainer.get("callbacks") or []
    return [
        cb.init_args.dirpath
        for cb in callbacks
        if isinstance(cb, Namespace) and cb.get("init_args") and cb.init_args.get("dirpath")
    ]


def _init_defaults(class_path: str) -> dict:
    """Keyword defaults of ``class_path.__init__`` through its bases (a subclass's default wins)."""
    defaults = {}
    for klass in reversed(_import(class_path).__mro__):
        if "__init__" in vars(klass):
            for param in inspect.signature(klass.__init__).parameters.values():
                if param.default is not inspect.Parameter.empty:
                    defaults[param.name] = param.default
    return defaults


def _import(class_path: str) -> type:
    module, _, name = class_path.rpartition(".")
    return getattr(__import__(module, fromlist=[name]), name)


def _same_class(first: str, second: str) -> bool:
    """Whether two class paths name one class (``lit_dllm.MDLMModule`` and its module path); False when either
    does not import."""
    try:
        return _import(first) is _import(second)
    except (ImportError, AttributeError, ValueError):
        return False


def main(args=None, run: bool = True) -> DLLMCLI:
    """``train.py``'s command line (``args``: its arguments); ``run=False`` only builds the trainer, model and data
    (``args`` then without a subcommand)."""
    return DLLMCLI(
        TokenLossModule,
        DLLMDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        auto_configure_optimizers=False,  # the module's own AdamW + schedule; swap it with model.init_args.optimizer
        parser_kwargs={"description": description(), "formatter_class": HelpFormatter},
        args=args,
        run=run,
    )
