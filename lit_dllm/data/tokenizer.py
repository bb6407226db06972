"""Tokenizers: any ``transformers`` tokenizer, or the embedded character-level default.

The default is a real ``transformers`` tokenizer built offline from a fixed character set (digits,
letters, space, common punctuation, newline) with the ``tokenizers`` library, plus special tokens and a
Jinja chat template. ``save_pretrained`` / ``AutoTokenizer.from_pretrained`` round-trip it like any
other tokenizer.
"""

from __future__ import annotations

import logging
import os
import string
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from lit_dllm.hub.gguf import check_gguf

log = logging.getLogger(__name__)

PAD, EOS, MASK, UNK = "<pad>", "<eos>", "<mask>", "<unk>"
ROLE_TOKENS = {role: f"<|{role}|>" for role in ("system", "user", "assistant")}
SPECIAL_TOKENS = [PAD, EOS, MASK, UNK, *ROLE_TOKENS.values()]  # ids 0..6, <pad> = 0
CHARACTERS = string.digits + string.ascii_letters + " +-*/=,.:;?!'\"()[]<>#$%&_|\n"

# Each turn is ``<|role|>content``; assistant turns end with eos, so a response is supervised up to
# and including the eos that ends it.
DEFAULT_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] -%}"
    "{{ raise_exception('unknown chat role ' + message['role'] + '; use system, user or assistant') }}"
    "{%- endif -%}"
    "<|{{ message['role'] }}|>{{ message['content'] }}"
    "{%- if message['role'] == 'assistant' %}{{ eos_token }}{% endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt %}<|assistant|>{% endif -%}"
)


def build_default_tokenizer(save_dir: str | os.PathLike | None = None) -> PreTrainedTokenizerFast:
    """The embedded character-level tokenizer (~100 ids); saved to ``save_dir`` when given."""
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + list(CHARACTERS))}
    backend = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # one char each
    backend.decoder = decoders.Fuse()  # join characters without spaces
    backend.add_special_tokens(SPECIAL_TOKENS)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD,
        eos_token=EOS,
        mask_token=MASK,
        unk_token=UNK,
        additional_special_tokens=list(ROLE_TOKENS.values()),
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = DEFAULT_CHAT_TEMPLATE
    if save_dir is not None:
        tokenizer.save_pretrained(save_dir)
    return tokenizer


def load_tokenizer(
    name_or_path: str | None,
    mask_token: str | None = None,
    trust_remote_code: bool = False,
    require_mask: bool = True,
    gguf_file: str | None = None,
) -> PreTrainedTokenizerBase:
    """Load a tokenizer by hub id or local path (``None``: the embedded default) and check its special tokens.

    Args:
        name_or_path: hub id or local directory for ``AutoTokenizer.from_pretrained``; None for the default.
        mask_token: mask token to use: one of the tokenizer's special tokens (e.g. LLaDA's), or a string not in
            its vocabulary, which is added as a new special token with id ``len(tokenizer) - 1`` (the model's
            embedding must cover ``len(tokenizer)`` ids).
        trust_remote_code: passed to ``AutoTokenizer.from_pretrained``.
        require_mask: raise when the tokenizer has no mask token (diffusion needs one; autoregressive training not).
        gguf_file: the name of a GGUF file in ``name_or_path`` (the folder or hub id holding it) whose tokenizer to
            load (transformers' GGUF loader; needs the ``gguf`` package: ``pip install 'lit_dllm[real]'``).

    Raises:
        ValueError: the tokenizer cannot be loaded, ``gguf_file`` is given without ``name_or_path``, ``mask_token``
            is an ordinary token of it, it has no mask / eos token, or its mask id is also its eos, pad, bos or unk id.
        ImportError, FileNotFoundError: ``gguf_file`` without the ``gguf`` package, or not in ``name_or_path``.
    """
    if name_or_path is None:
        if gguf_file is not None:
            raise ValueError(f"gguf_file={gguf_file!r} needs a tokenizer: the folder (or hub id) that holds it.")
        tokenizer = build_default_tokenizer()
    else:
        tokenizer = _from_pretrained(name_or_path, trust_remote_code, gguf_file)
    name = (f"{name_or_path}/{gguf_file}" if gguf_file else name_or_path) or "the embedded default"
    if mask_token is not None:
        _check_mask_token_is_free(tokenizer, mask_token, name)
        tokenizer.add_special_tokens({"mask_token": mask_token})
    _check_special_tokens(tokenizer, name, require_mask)
    return tokenizer


def _from_pretrained(
    name_or_path: str, trust_remote_code: bool, gguf_file: str | None = None
) -> PreTrainedTokenizerBase:
    if gguf_file is not None:
        check_gguf(name_or_path, gguf_file, f"the tokenizer of gguf_file={gguf_file!r}", packages=("gguf",))
        return AutoTokenizer.from_pretrained(name_or_path, gguf_file=gguf_file, trust_remote_code=trust_remote_code)
    _check_tokenizer_folder(Path(name_or_path))
    try:
        return AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
    except OSError as err:
        if Path(name_or_path).exists():
            raise
        raise ValueError(
            f"Could not load tokenizer {name_or_path!r}: it is not a local path and the hub is unreachable or "
            f"has no such repository ({err}). Pass a local directory saved with save_pretrained, or "
            "tokenizer=None for the embedded default."
        ) from err


def _check_tokenizer_folder(folder: Path) -> None:
    """A local folder given as a tokenizer must hold tokenizer files: a clear error naming what it holds instead."""
    if not folder.is_dir():
        return
    names = sorted(path.name for path in folder.iterdir())
    if any("tokenizer" in name or "vocab" in name or name.endswith((".model", "merges.txt")) for name in names):
        return
    ggufs = [name for name in names if name.endswith(".gguf")]
    hint = f" For a GGUF's tokenizer pass gguf_file={ggufs[0]!r} (tokenizer.gguf_file)." if ggufs else ""
    raise ValueError(
        f"Tokenizer {str(folder)!r} is a folder without tokenizer files: expected tokenizer.json, "
        "tokenizer_config.json or vocabulary files (vocab.json + merges.txt, vocab.txt, a sentencepiece .model), "
        f"or a GGUF file named with gguf_file. It holds: {names or 'nothing'}.{hint} Name the folder that "
        "save_pretrained wrote the tokenizer to (or a hub id)."
    )


def _check_mask_token_is_free(tokenizer: PreTrainedTokenizerBase, mask_token: str, name: str) -> None:
    """Reject a mask string that already is an ordinary token: every occurrence in the data would become the mask."""
    token_id = tokenizer.get_vocab().get(mask_token)
    special = {token.content for token in tokenizer.added_tokens_decoder.values() if token.special}
    if token_id is not None and mask_token not in special | set(tokenizer.all_special_tokens):
        raise ValueError(
            f"mask_token={mask_token!r} is an ordinary token of tokenizer {name!r} (id {token_id}): as the mask, "
            f"every {mask_token!r} in the data would read as masked. Pick a string that is not in the vocabulary, "
            "e.g. '<|mask|>', or the tokenizer's own mask token."
        )


def _check_special_tokens(tokenizer: PreTrainedTokenizerBase, name: str, require_mask: bool = True) -> None:
    """Require eos (and a mask token); refuse a mask id that is also eos, pad, bos or unk; use eos as pad when pad
    is missing."""
    if require_mask and tokenizer.mask_token_id is None:
        raise ValueError(
            f"Tokenizer {name!r} has no mask token. Pass mask_token='<|mask|>' (or any unused string): it is "
            f"added as a special token and the model's embedding must then cover len(tokenizer) ids."
        )
    if tokenizer.eos_token_id is None:
        raise ValueError(
            f"Tokenizer {name!r} has no eos token. Add one (tokenizer.add_special_tokens({{'eos_token': ...}})), "
            "save it with save_pretrained and pass that directory."
        )
    roles = {role: getattr(tokenizer, f"{role}_token_id") for role in ("eos", "pad", "bos", "unk")}
    aliased = mask_aliases(tokenizer.mask_token_id, **roles)
    if aliased:
        raise ValueError(
            f"Tokenizer {name!r}: mask token {tokenizer.mask_token!r} (id {tokenizer.mask_token_id}) is also its "
            f"{' and '.join(aliased)} token, so every such token in the data would read as masked. Pass a mask_token "
            "that is not in its vocabulary (e.g. '<|mask|>', added as a new token) or one of its unused special "
            "tokens."
        )
    if tokenizer.pad_token_id is None:
        log.info("Tokenizer %r has no pad token; using eos %r as pad.", name, tokenizer.eos_token)
        tokenizer.pad_token = tokenizer.eos_token


def mask_aliases(mask_token_id: int | None, **role_ids: int | None) -> list[str]:
    """The roles (e.g. ``eos=2, pad=0``) whose token id is also ``mask_token_id``: the one check every family
    makes, since a masked position must never read as padding, an end of answer, a start or an unknown token."""
    if mask_token_id is None:
        return []
    return [role for role, token_id in role_ids.items() if token_id == mask_token_id]


def check_mask_token_id(mask_token_id: int | None, vocab_size: int, needed_for: str | None = None,
                        **role_ids: int | None) -> None:
    """The one check of a module's ``mask_token_id``: given when the family needs one (``needed_for`` says why),
    inside the vocabulary, and no role's id (``role_ids``, see :func:`mask_aliases`)."""
    if mask_token_id is None:
        if needed_for:
            raise ValueError(
                f"mask_token_id is None: {needed_for}, and the tokenizer has no mask token. Set "
                "data.init_args.tokenizer.mask_token (e.g. '<|mask|>', a string not in its vocabulary: it is added as "
                "a special token) or use a tokenizer that has one."
            )
        return
    if not 0 <= mask_token_id < vocab_size:
        raise ValueError(f"mask_token_id={mask_token_id} is outside the vocabulary [0, {vocab_size}): link the module's "
                         "ids from the data module (vocab_size=datamodule.vocab_size, mask_token_id=...).")
    aliased = mask_aliases(mask_token_id, **role_ids)
    if aliased:
        raise ValueError(
            f"mask_token_id={mask_token_id} is also the {' and '.join(aliased)} token's id: give the mask its own "
            "token (data.init_args.tokenizer.mask_token, e.g. '<|mask|>') and link the module's ids from the data "
            "module."
        )


def unused_special_tokens(tokenizer: PreTrainedTokenizerBase, below: int) -> list[str]:
    """The tokenizer's special tokens with an id under ``below`` that neither play a role (bos, eos, pad, unk, mask)
    nor appear in its chat template: candidates for a noise token that must be one of a model's own ids."""
    roles = {tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.unk_token_id,
             tokenizer.mask_token_id}
    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else ""
    return [token.content for token_id, token in sorted(tokenizer.added_tokens_decoder.items())
            if token.special and token_id < below and token_id not in roles and token.content not in template]
