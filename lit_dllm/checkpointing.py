"""A run's checkpoints: one stable folder per run name, the newest ``last`` checkpoint, atomic writes, the
tokenizer that travels inside each checkpoint, and the hyper-parameters a checkpoint brings back (checkpoints of
earlier layouts: :mod:`lit_dllm.upgrade`)."""

from __future__ import annotations

import os
import socket
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO

LAST_PREFIX = "last"
TOKENIZER_KEY = "lit_dllm_tokenizer_files"
LOCK_NAME = "fit.lock"
PARTIAL_SUFFIX = ".partial"


def run_checkpoint_dir(save_dir: str | os.PathLike, name: str | None) -> Path:
    """``<save_dir>/<name>/checkpoints``: the same folder for every call of a run, whatever its logger version.

    Lightning's default puts checkpoints under the logger's ``version_N``, which each CLI call increments, so
    ``--ckpt_path last`` would never find the previous call's checkpoint.
    """
    return Path(save_dir, name or "", "checkpoints").resolve()


def find_last_checkpoint(folders: list[str | os.PathLike]) -> Path | None:
    """The most recently written ``last*.ckpt`` in ``folders`` (None when there is none)."""
    found = [path for folder in folders if Path(folder).is_dir() for path in Path(folder).glob(f"{LAST_PREFIX}*.ckpt")]
    return max(found, key=lambda path: path.stat().st_mtime) if found else None


def partial_files(folders: list[str | os.PathLike]) -> list[Path]:
    """The unfinished temporary files of interrupted saves (:class:`AtomicCheckpointIO`) in ``folders``."""
    return sorted(path for folder in folders if Path(folder).is_dir()
                  for path in Path(folder).glob(f".*.ckpt{PARTIAL_SUFFIX}"))


def is_sharded_checkpoint(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a torch-DCP (FSDP2) checkpoint folder: one holding DCP's ``.metadata``."""
    return Path(path, ".metadata").is_file()


def load_sharded_checkpoint(folder: str | os.PathLike) -> dict[str, Any]:
    """A torch-DCP (FSDP2) checkpoint folder as one process reads a ``.ckpt`` file: Lightning's ``meta.pt`` with the
    whole ``state_dict`` and ``optimizer_states``, gathered by torch's own ``dcp_to_torch_save`` (no process group)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as scratch:
        whole = Path(scratch, "whole.pt")
        dcp_to_torch_save(folder, whole)
        states = torch.load(whole, map_location="cpu", weights_only=True)
    checkpoint = torch.load(Path(folder, "meta.pt"), map_location="cpu", weights_only=False)
    checkpoint["state_dict"] = states.pop("state_dict")
    checkpoint["optimizer_states"] = [states[f"optimizer_{index}"] for index in range(len(states))]
    return checkpoint


def describe_path(path: str | os.PathLike) -> str:
    """What is at ``path``, for an error: nothing, a folder and some of its entries, a text file's first words, or a
    binary file's size."""
    path = Path(path)
    if path.is_dir():
        names = sorted(entry.name + ("/" if entry.is_dir() else "") for entry in path.iterdir())
        more = f" and {len(names) - 5} more" if len(names) > 5 else ""
        return f"a folder holding {', '.join(names[:5])}{more}" if names else "an empty folder"
    if not path.exists():
        return "nothing (no such file or folder)"
    head = path.read_bytes()[:60] if path.is_file() else b""
    try:
        text = head.decode()
    except UnicodeDecodeError:
        return f"a binary file of {path.stat().st_size} bytes that torch cannot read"
    return f"a text file starting with {text.strip()!r}" if text.strip() else "an empty file"


class RunLocked(RuntimeError):
    """Another live process is training into the run's checkpoint folder."""


def acquire_run_lock(folder: str | os.PathLike) -> Path:
    """Create ``<folder>/fit.lock`` (atomically, holding ``pid host``) so that a second fit into the same run folder
    is refused; a stale lock (its pid not alive on this host) is taken over with a warning. Raises :class:`RunLocked`
    naming the lock file and its owner otherwise, and :func:`check_writable`'s errors for a folder it cannot make."""
    lock, host = Path(folder, LOCK_NAME), socket.gethostname()
    check_writable(folder, "run")
    for _ in range(2):
        try:
            descriptor = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            pid, owner = _lock_owner(lock)
            if owner != host or pid is None or _pid_alive(pid):
                holder = f"fit process {pid} on {owner}" if pid is not None else "another fit (writing it now)"
                raise RunLocked(
                    f"{lock} says {holder} is training into this run folder; two runs would "
                    "overwrite each other's checkpoints. Wait for it to end, give this run its own folder "
                    "(--trainer.logger.init_args.name=<new name> or another save_dir), or, if that process is gone, "
                    "delete the lock file."
                ) from None
            warnings.warn(f"Taking over {lock}: its process {pid} on {host} is no longer running.", stacklevel=2)
            lock.unlink(missing_ok=True)
            continue
        with os.fdopen(descriptor, "w") as out:
            out.write(f"{os.getpid()} {host}\n")
        return lock
    raise RunLocked(f"Could not take over the stale lock {lock}: another process took it first.")


def release_run_lock(lock: Path) -> None:
    """Remove ``lock`` if this process still holds it."""
    if _lock_owner(lock) == (os.getpid(), socket.gethostname()):
        lock.unlink(missing_ok=True)


def _lock_owner(lock: Path) -> tuple[int | None, str | None]:
    try:
        pid, _, host = lock.read_text().strip().partition(" ")
        return int(pid), host
    except (OSError, ValueError):
        return None, None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


class NotAFolder(PermissionError):
    """An output folder, or a folder above it, is a file (which stays as it is)."""


def check_writable(folder: str | os.PathLike, what: str) -> None:
    """Create ``folder`` and write a probe file in it, so a read-only output fails before the first step (a
    PermissionError); a folder (or a folder above it) that is a file is :class:`NotAFolder`, naming that file."""
    folder = Path(folder)
    file = next((path for path in (folder, *folder.parents) if path.exists() and not path.is_dir()), None)
    if file is not None:
        raise NotAFolder(
            f"The {what} folder {str(folder)!r} is not writable: {str(file)!r} is a file (left as it is); nothing was "
            "trained. Point it elsewhere (e.g. --trainer.logger.init_args.save_dir=<dir> or ModelCheckpoint(dirpath="
            "...))."
        )
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder):
            pass
    except OSError as err:
        raise PermissionError(
            f"The {what} folder {str(folder)!r} is not writable ({err.strerror}); nothing was trained. Point it "
            "elsewhere (e.g. --trainer.logger.init_args.save_dir=<dir> or ModelCheckpoint(dirpath=...)) or fix its "
            "permissions."
        ) from err


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's ``TorchCheckpointIO`` writing each checkpoint atomically: into a temporary file beside it, synced,
    then renamed over it. A failed save (disk full, a folder made read-only) is an error naming the file and leaves
    the file there unchanged, never half written.

    Why not Lightning's own: it writes a temporary file in the system's temp folder and moves it, which onto another
    disk is a copy that a full disk truncates, and a move refused over an existing file is dropped without a word.
    """

    def load_checkpoint(self, path, *args, **kwargs) -> dict[str, Any]:
        """A ``.ckpt`` file, or a sharded (FSDP2) checkpoint folder gathered whole (:func:`load_sharded_checkpoint`)."""
        if is_sharded_checkpoint(path):
            return load_sharded_checkpoint(path)
        return super().load_checkpoint(path, *args, **kwargs)

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options=None) -> None:
        if storage_options is not None:
            raise TypeError(f"AtomicCheckpointIO takes no storage_options (got {storage_options!r}).")
        path = Path(path)
        temporary = path.with_name(f".{path.name}{PARTIAL_SUFFIX}")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(temporary, "wb") as out:
                torch.save(checkpoint, out)
                out.flush()
                os.fsync(out.fileno())
            os.replace(temporary, path)
        except (OSError, RuntimeError) as err:  # torch.save reports a failed write as a RuntimeError
            cause = err.__context__ if isinstance(err.__context__, OSError) and not isinstance(err, OSError) else err
            raise OSError(
                f"Could not save the checkpoint {path}: {getattr(cause, 'strerror', None) or cause}. The file there, "
                "if any, is unchanged. Free space on that disk or make the folder writable (or save elsewhere, e.g. "
                "--trainer.logger.init_args.save_dir=<dir>), then resume with --ckpt_path last."
            ) from err
        finally:
            temporary.unlink(missing_ok=True)  # gone after the rename; removed after a failure or an interruption


def name_optimizer_states(checkpoint: dict, module, optimizers) -> None:
    """Key each optimizer state of ``checkpoint`` by parameter name (its fully qualified name in ``module``), as
    FSDP2 checkpoints are, instead of by position (what one process writes): a sharded run can then resume it, and a
    plain optimizer still loads it (``Optimizer.load_state_dict`` pairs parameters by their order)."""
    names = {id(param): name for name, param in module.named_parameters(remove_duplicate=False)}
    for state, optimizer in zip(checkpoint.get("optimizer_states", ()), optimizers):
        order = [names[id(param)] for group in optimizer.param_groups for param in group["params"]]
        if any(not isinstance(key, int) for key in state.get("state", {"named": 0})) or len(order) != len(set(order)):
            continue  # named already (FSDP2; other ranks hold none), or a parameter under two names: as written
        state["state"] = {order[key]: value for key, value in state["state"].items()}
        for group in state["param_groups"]:
            group["params"] = [order[index] for index in group["params"]]


# ---------------------------------------------------------------------------------------------- tokenizer
def tokenizer_files(tokenizer) -> dict[str, bytes]:
    """The files ``tokenizer.save_pretrained`` writes, as ``{name: bytes}`` (stored inside checkpoints)."""
    with tempfile.TemporaryDirectory() as folder:
        tokenizer.save_pretrained(folder)
        return {path.name: path.read_bytes() for path in Path(folder).iterdir() if path.is_file()}


def tokenizer_from_files(files: dict[str, bytes], trust_remote_code: bool = False):
    """Rebuild a tokenizer (added tokens such as an added mask included) from :func:`tokenizer_files`."""
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory() as folder:
        for name, content in files.items():
            Path(folder, name).write_bytes(content)
        return AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code)


# ---------------------------------------------------------------------------------------------- hyper-parameters
def merge_hparams(
    saved: dict[str, Any], given: dict[str, Any], defaults: dict[str, Any], explicit: set[str], skip: set[str]
) -> tuple[dict[str, Any], list[str]]:
    """A checkpoint's hyper-parameters, with the user's explicit choices on top.

    ``given`` holds the values the user's config and command line produced, ``defaults`` the class defaults and
    ``explicit`` the names the user wrote (command line or config files). A name counts as the user's choice when it
    is in ``explicit`` or its given value differs from the default (a form of input ``explicit`` does not read);
    otherwise the checkpoint's value is used. Names in ``skip`` (linked
    from the data module) are left alone. Returns the merged values and a line for each choice that overrides a
    different checkpoint value.
    """
    merged, overrides = dict(given), []
    for name, value in saved.items():
        if name in skip or name.startswith("_"):
            continue
        chosen = name in explicit or (name in given and given[name] != defaults.get(name, value))
        if not chosen:
            merged[name] = value
        elif given.get(name) != value:
            overrides.append(f"{name}={given.get(name)!r} (checkpoint: {value!r})")
    return merged, overrides
