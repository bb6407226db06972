"""A run's checkpoints: one stable folder per run name, the newest ``last`` checkpoint, atomic writes, the
tokenizer that travels inside each checkpoint, the hyper-parameters a checkpoint brings back, and the module class
paths of the package's earlier layout (:data:`MOVED_MODULES`)."""

from __future__ import annotations

import os
import pydoc
import tempfile
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO

from lit_dllm import compat
from lit_dllm.settings import grouped_settings

LAST_PREFIX = "last"
TOKENIZER_KEY = "lit_dllm_tokenizer_files"

MOVED_MODULES = {
    "lit_dllm.modules.token_loss": "lit_dllm.core.token_loss",
    "lit_dllm.modules.base": "lit_dllm.core.base",
    "lit_dllm.modules.generation": "lit_dllm.core.generation",
    "lit_dllm.modules.optim": "lit_dllm.core.optim",
    "lit_dllm.modules.backbone": "lit_dllm.core.build_backbone",
    "lit_dllm.models.backbone": "lit_dllm.core.backbone",
    "lit_dllm.models.hf": "lit_dllm.hub.hf",
    "lit_dllm.models.gguf": "lit_dllm.hub.gguf",
    "lit_dllm.modules.mdlm": "lit_dllm.families.mdlm.module",
    "lit_dllm.models.diffusion_lm": "lit_dllm.families.mdlm.model",
    "lit_dllm.sampling.llada": "lit_dllm.families.mdlm.sampler",
    "lit_dllm.sampling.fast": "lit_dllm.families.mdlm.fast_sampler",
    "lit_dllm.modules.causal_lm": "lit_dllm.families.causal_lm.module",
    "lit_dllm.models.causal_lm": "lit_dllm.families.causal_lm.model",
    "lit_dllm.modules.dflash": "lit_dllm.families.dflash.module",
    "lit_dllm.models.dflash": "lit_dllm.families.dflash.model",
    "lit_dllm.modules.diffusion_gemma": "lit_dllm.families.diffusion_gemma.module",
    "lit_dllm.models.diffusion_gemma": "lit_dllm.families.diffusion_gemma.model",
}
"""Each module of the layout before ``lit_dllm/core`` + ``lit_dllm/families`` (``lit_dllm.modules``,
``lit_dllm.models``, ``lit_dllm.sampling``) and where it went. ``train.py`` records a run's module class among its
checkpoint's hyper-parameters as its config named it (``_class_path``: ``lit_dllm.MDLMModule``, or a module path
such as ``lit_dllm.modules.dflash.DFlashModule``); :func:`current_class_path` maps such a path to today's, so
checkpoints of the earlier layout stay loadable (``tests/core/test_old_checkpoints.py``)."""


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


def check_writable(folder: str | os.PathLike, what: str) -> None:
    """Create ``folder`` and write a probe file in it, so a read-only output fails before the first step."""
    folder = Path(folder)
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

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options=None) -> None:
        if storage_options is not None:
            raise TypeError(f"AtomicCheckpointIO takes no storage_options (got {storage_options!r}).")
        path = Path(path)
        temporary = path.with_name(f".{path.name}.partial")
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
def current_class_path(class_path: str | None) -> str | None:
    """``class_path`` (``package.module.Class``) with a module of the earlier layout replaced by where it went
    (:data:`MOVED_MODULES`); any other path (None too) as it is."""
    if class_path is None:
        return None
    module, _, name = class_path.rpartition(".")
    return f"{MOVED_MODULES[module]}.{name}" if module in MOVED_MODULES else class_path


def current_checkpoint(checkpoint: dict, cls: type, class_path: str | None = None) -> dict:
    """``checkpoint`` (as loaded) brought to today's layout, in place: unless ``class_path`` names the module class,
    the class it records by a path of the earlier layout (``lit_dllm.modules.dflash.DFlashModule``) becomes today's
    (:func:`current_class_path`); settings of that class's groups it holds flat (written before
    :mod:`lit_dllm.settings`: ``gen_length``, ``model_config``...) move into their groups
    (:func:`~lit_dllm.settings.grouped_settings`; ``cls``'s when the class is not found). Lightning's CLI
    instantiator would pass flat settings on as untyped YAML (the answer pattern ``"#### (\\S+)"`` read as a comment,
    i.e. None)."""
    hparams = checkpoint.get("hyper_parameters")
    if not isinstance(hparams, dict):
        return checkpoint
    if class_path is None and compat.CLASS_PATH_KEY in hparams:
        hparams[compat.CLASS_PATH_KEY] = current_class_path(hparams[compat.CLASS_PATH_KEY])
    named = class_path or hparams.get(compat.CLASS_PATH_KEY)
    grouped = grouped_settings(hparams, (named and pydoc.locate(current_class_path(named))) or cls)
    if set(hparams) - set(grouped):
        checkpoint["hyper_parameters"] = grouped
    return checkpoint


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
