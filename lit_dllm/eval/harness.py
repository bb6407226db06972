"""lm-evaluation-harness model for lit_dllm: ``--model lit_dllm`` (see :class:`LitDLLMEval`).

The harness knows no family: it asks the module (:class:`~lit_dllm.core.token_loss.TokenLossModule`'s evaluation
hooks, which each family fills in its own folder).

* ``generate_until``: ``module.decode_answers`` (the family's sampler); a speculative decoder (DFlash) also gives the
  tokens each target verification committed, and their mean, the acceptance length τ, is reported beside the score.
* ``loglikelihood``: exact by ``module.exact_scores`` where ``module.exact_scoring`` (a causal LM), else the family's
  Monte-Carlo lower bound ``module.loglikelihood_bound`` (MDLM / hybrid: LLaDA's; block-diffusion Gemma: its
  uniform-noise NELBO), keyed by the request. A family with neither (DFlash) raises ``NotImplementedError``.
* ``loglikelihood_rolling``: exact ones in windows of the model's positions, bounds on the whole text.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import pickle
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lm_eval.models  # noqa: F401  (fills the registry's built-in names before ours, see get_model)
import torch
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

import lit_dllm
from lit_dllm import compat
from lit_dllm.upgrade import current_class_path
from lit_dllm.settings import CausalBackbone, Tokenizer
from lit_dllm.core.token_loss import TokenLossModule
from lit_dllm.data.formats import encode_prompt
from lit_dllm.data.tokenizer import load_tokenizer
from lit_dllm.families.causal_lm.module import CausalLMModule
from lit_dllm.families.mdlm.module import LLaDAGeneration, MDLMModule

__all__ = ["LitDLLMEval", "load_module"]

DEFAULT_MAX_GEN_TOKS = 256
"""New tokens per answer when neither the request, ``max_gen_toks=`` nor the module's ``gen_length`` says."""
GEN_KWARGS = {"until", "max_gen_toks", "do_sample", "temperature"}
"""The generation settings honoured; others are reported once and ignored."""


def module_class(name: str) -> type[TokenLossModule]:
    """``MDLMModule`` (a name exported by ``lit_dllm``) or ``package.module.Class`` (a module path of the earlier
    layout too: :func:`~lit_dllm.upgrade.current_class_path`) -> the class."""
    module_path, _, attr = current_class_path(name).rpartition(".")
    try:
        cls = getattr(__import__(module_path, fromlist=[attr]), attr) if module_path else getattr(lit_dllm, attr)
    except (ImportError, AttributeError) as err:
        raise ValueError(
            f"module={name!r} names no class: use a lit_dllm module name (e.g. MDLMModule, CausalLMModule) or a "
            "dotted path (package.module.Class)."
        ) from err
    if not (isinstance(cls, type) and issubclass(cls, TokenLossModule)):
        raise ValueError(f"module={name!r} is not a lit_dllm module class (a TokenLossModule subclass).")
    return cls


CHECKPOINT = "a Lightning checkpoint file (a .ckpt that fit writes, e.g. runs/<name>/checkpoints/last.ckpt)"


def folder_contents(path: Path) -> str:
    """What the folder ``path`` is, and what to pass instead of it as ``checkpoint=``."""
    if (path / "config.json").is_file():
        return f"a Hugging Face model folder: pass pretrained={path} instead"
    if (path / "meta.pt").is_file():
        return ("a sharded checkpoint folder, which LitDLLMEval does not read: export it (save_pretrained under the "
                "run's strategy, docs/scale-out.md) and pass pretrained=<that folder>")
    checkpoints = sorted(p.name for p in path.glob("*.ckpt"))
    return f"a folder holding {checkpoints}: pass one of them" if checkpoints else "a folder without checkpoints"


def checkpoint_hparams(checkpoint: str) -> dict[str, Any]:
    """The hyper-parameters of ``checkpoint``, a Lightning checkpoint file; a ValueError saying what was expected at
    that path and what is there otherwise (a folder, a file torch cannot read, one without weights)."""
    path = Path(checkpoint)
    if path.is_dir():
        raise ValueError(f"checkpoint={checkpoint!r} is {folder_contents(path)}; checkpoint= takes {CHECKPOINT}.")
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint={checkpoint!r} does not exist; checkpoint= takes {CHECKPOINT}.")
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError) as err:
        with open(path, "rb") as file:
            start = file.read(16)
        raise ValueError(f"checkpoint={checkpoint!r} is not {CHECKPOINT}: torch.load cannot read it "
                         f"({type(err).__name__}; it starts with {start!r}).") from err
    if not (isinstance(saved, dict) and "state_dict" in saved):
        raise ValueError(f"checkpoint={checkpoint!r} holds a {type(saved).__name__} without a state_dict, not "
                         f"{CHECKPOINT}.")
    return saved.get("hyper_parameters", {})


def check_family(cls: type[TokenLossModule], recorded: str, checkpoint: str) -> None:
    """``module=`` names the checkpoint's recorded class, a subclass or a base of it (``HybridMDLMModule`` for an
    ``MDLMModule`` checkpoint); a class of another family is a ValueError naming both."""
    try:
        trained = module_class(recorded)
    except ValueError:  # a class that is gone: module= replaces it
        return
    if not (issubclass(cls, trained) or issubclass(trained, cls)):
        raise ValueError(
            f"module={cls.__name__} is another family than checkpoint={checkpoint!r}, trained as {trained.__name__} "
            f"({recorded}): drop module= (the recorded class is used) or name {trained.__name__} or a subclass of it."
        )


def load_module(checkpoint: str, module: str | None = None, device: str = "cpu") -> TokenLossModule:
    """The module of a Lightning checkpoint, of the class the checkpoint records (``train.py`` saves it), else of
    ``module`` (a class name; it may also name a subclass or base of the recorded one, never another family's)."""
    saved = checkpoint_hparams(checkpoint)
    recorded = saved.get(compat.CLASS_PATH_KEY)
    if module is None and recorded is None:
        raise ValueError(
            f"checkpoint={checkpoint!r} does not record its module class (it was saved outside train.py): name it, "
            "e.g. model_args checkpoint=...,module=MDLMModule."
        )
    cls = module_class(module or recorded)
    if module is not None and recorded is not None:
        check_family(cls, recorded, checkpoint)
    # a train.py checkpoint is rebuilt by Lightning's instantiator from its recorded class: name ours instead
    key = compat.CLASS_PATH_KEY
    class_path = {key: f"{cls.__module__}.{cls.__qualname__}"} if key in saved else {}
    return cls.load_from_checkpoint(checkpoint, map_location=device, **class_path)


def pretrained_module(path: str) -> CausalLMModule | MDLMModule:
    """The module around a Hugging Face folder (or hub id) and its tokenizer: an :class:`MDLMModule` with the
    recorded mask id and sampler for a lit_dllm MDLM / hybrid export (``dllm_sampling`` in its config), else a
    :class:`CausalLMModule`."""
    from transformers import AutoConfig

    tokenizer = load_tokenizer(path, require_mask=False)
    sampling = getattr(AutoConfig.from_pretrained(path), "dllm_sampling", None)
    if sampling is None:
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        module = CausalLMModule(len(tokenizer), backbone=CausalBackbone(model=path),
                                tokenizer_settings=Tokenizer(name=path), pad_token_id=pad,
                                eos_token_id=tokenizer.eos_token_id)
    else:
        fast = {"gen_threshold": sampling["threshold"], "gen_cache": sampling["cache"]} if "cache" in sampling else {}
        generation = LLaDAGeneration(gen_length=sampling["gen_length"], gen_steps=sampling["steps"],
                                     gen_block_length=sampling["block_length"], remasking=sampling["remasking"],
                                     temperature=sampling["temperature"], sampler="fast" if fast else "llada", **fast)
        module = MDLMModule(len(tokenizer), sampling["mask_token_id"], sampling["pad_token_id"],
                            sampling["eos_token_id"], backbone=CausalBackbone(model=path),
                            tokenizer_settings=Tokenizer(name=path), generation=generation)
    module.tokenizer = tokenizer
    module.configure_model()
    return module


def request_seed(seed: int, *parts: str) -> int:
    """A stable 63-bit seed from ``seed`` and the request's strings (the same in every process and run)."""
    digest = hashlib.sha256("\0".join([str(seed), *parts]).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def cut_at_stops(text: str, until: list[str]) -> str:
    """``text`` up to the first occurrence of any stop string."""
    ends = [text.find(stop) for stop in until if stop and stop in text]
    return text[: min(ends)] if ends else text


@register_model("lit_dllm")
class LitDLLMEval(LM):
    """A lit_dllm module as an lm-evaluation-harness model.

    Args (``--model_args``, comma-separated):
        checkpoint: a Lightning checkpoint (``.ckpt``); its module class is the one it records, else ``module``.
        pretrained: instead, a Hugging Face folder or hub id: a causal LM, scored as a ``CausalLMModule``, or a
            lit_dllm MDLM / hybrid export, scored as an ``MDLMModule`` with its recorded sampler.
        module: a class name for ``checkpoint`` (``MDLMModule``, ``lit_dllm.HybridMDLMModule``...);
            in Python, also an already built module (then neither ``checkpoint`` nor ``pretrained``).
        device: where the module runs (``cpu``, ``cuda``, ``cuda:1``); CUDA without a GPU falls back to the CPU
            (a warning), since the harness's command line defaults to ``cuda``.
        batch_size: prompts per generation call, sequences per forward when scoring (an int; no ``auto``).
        mc_num: Monte-Carlo samples per diffusion log-likelihood.
        seed: with the request's text, fixes the Monte-Carlo draws (a rerun gives the same number).
        max_gen_toks: new tokens per answer when the task does not say (default: the module's ``gen_length``,
            else 256).
    """

    def __init__(self, checkpoint: str | None = None, pretrained: str | None = None, module: Any = None,
                 device: str = "cpu", batch_size: int | str = 8, mc_num: int = 128, seed: int = 0,
                 max_gen_toks: int | None = None, **unused: Any) -> None:
        super().__init__()
        self.warned: set[str] = set()
        if str(device).startswith("cuda") and not torch.cuda.is_available():
            self.warn_once(f"device={device!r} but CUDA is not available: running on the CPU (pass --device cpu).")
            device = "cpu"
        if isinstance(module, TokenLossModule):
            if checkpoint or pretrained:
                raise ValueError("Give a built module, or checkpoint= / pretrained=, not both.")
        elif (checkpoint is None) == (pretrained is None):
            raise ValueError("Give exactly one of checkpoint=<file.ckpt> or pretrained=<Hugging Face folder>.")
        elif checkpoint is not None:
            module = load_module(checkpoint, module, device)
        else:
            module = pretrained_module(pretrained)
        for name, value in {"batch_size": batch_size, "mc_num": mc_num}.items():
            if not str(value).isdigit() or int(value) <= 0:
                raise ValueError(f"{name}={value!r} must be a positive int.")
        self.module = module.to(device).eval()
        self.tokenizer = module.tokenizer
        self.batch_size, self.mc_num, self.seed = int(batch_size), int(mc_num), int(seed)
        self.max_gen_toks = int(max_gen_toks) if max_gen_toks is not None else None
        self.chat = False  # set when the harness renders prompts with the chat template
        self.verifications: list[int] = []  # speculative decoding: tokens committed per target verification
        if unused:  # the harness passes its own settings (e.g. max_batch_size) to every model
            self.warn_once(f"LitDLLMEval ignores {sorted(unused)}.")

    @property
    def device(self) -> torch.device:
        """Where the module runs (the harness's ``LM.device``)."""
        return self.module.device

    def warn_once(self, message: str) -> None:
        if message not in self.warned:
            self.warned.add(message)
            warnings.warn(message, stacklevel=3)

    # ------------------------------------------------------------------ tokens
    def encode_context(self, text: str) -> list[int]:
        """Prompt ids as training made them: with the tokenizer's specials (e.g. bos), special-token strings kept as
        text; a chat-template rendering is tokenised as ``encode_chat`` does (its specials parsed, none added)."""
        if self.chat:
            return self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return encode_prompt(self.tokenizer, text)

    def encode_continuation(self, text: str) -> list[int]:
        """Answer ids as training made them (no specials added, special-token strings kept as text)."""
        return self.tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]

    def pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """(context ids, continuation ids); an empty context becomes the bos (else eos) token, as the harness's
        own models do, so that the first token is scored given something."""
        context_ids = self.encode_context(context)
        if not context_ids:
            prefix = self.tokenizer.bos_token_id
            context_ids = [prefix if prefix is not None else self.module.eos_token_id]
        return context_ids, self.encode_continuation(continuation)

    # ------------------------------------------------------------------ chat templates
    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        self.chat = True
        return self.tokenizer.apply_chat_template(chat_history, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    @property
    def tokenizer_name(self) -> str:
        return (self.tokenizer.name_or_path or "lit_dllm").replace("/", "__")

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        return self.tokenizer.chat_template

    # ------------------------------------------------------------------ generation
    @contextmanager
    def temperature(self, value: float):
        """The module samples at ``value`` for the block (0: greedy): its ``generation`` group's ``temperature``."""
        saved = self.module.generation
        self.module.generation = dataclasses.replace(saved, temperature=value)
        try:
            yield
        finally:
            self.module.generation = saved

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Answers from ``module.generate_ids``, batched per generation setting, cut at the first stop string (the
        sampler itself stops only at eos or ``max_gen_toks``, which LLaDA sampling rounds up to whole blocks).
        ``do_sample`` samples at the request's ``temperature`` (the global torch RNG, which the harness seeds);
        otherwise greedy, whatever the module's own ``temperature``."""
        results: list[str | None] = [None] * len(requests)
        groups: dict[str, list[int]] = {}
        for index, request in enumerate(requests):
            groups.setdefault(json.dumps(request.args[1], sort_keys=True, default=str), []).append(index)
        for indices in groups.values():
            kwargs = dict(requests[indices[0]].args[1])
            for name in sorted(set(kwargs) - GEN_KWARGS):
                self.warn_once(f"LitDLLMEval ignores the generation setting {name}={kwargs[name]!r}.")
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            own = self.module.generation.gen_length
            length = int(kwargs.get("max_gen_toks") or self.max_gen_toks or own or DEFAULT_MAX_GEN_TOKS)
            temperature = float(kwargs.get("temperature", 1.0)) if kwargs.get("do_sample") else 0.0
            prompts = {i: self.encode_context(requests[i].args[0]) for i in indices}
            order = sorted(indices, key=lambda i: -len(prompts[i]))  # similar lengths share a batch
            for start in range(0, len(order), self.batch_size):
                chunk = order[start : start + self.batch_size]
                with torch.no_grad(), self.temperature(temperature):
                    answers = self.answer([torch.tensor(prompts[i]) for i in chunk], length)
                for i, answer in zip(chunk, answers):
                    text = cut_at_stops(self.tokenizer.decode(answer, skip_special_tokens=True), until)
                    results[i] = text
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
        if self.verifications:
            family = type(self.module).__name__.removesuffix("Module")
            self.warn_once(f"{family} acceptance length τ = {self.acceptance_length:.3f} over "
                           f"{len(self.verifications)} target verifications (tokens committed per verification, all "
                           "answers so far).")
        return results

    def answer(self, prompts: list[torch.Tensor], length: int) -> list[torch.Tensor]:
        """``module.decode_answers``' answers; a speculative decoder's committed tokens per target verification are
        kept for τ."""
        decoded = self.module.decode_answers(prompts, length)
        self.verifications += [n for _, accepted in decoded for n in accepted]
        return [tokens for tokens, _ in decoded]

    @property
    def acceptance_length(self) -> float | None:
        """A speculative decoder's τ over every answer so far: tokens committed per target verification (None for a
        family that does not decode speculatively)."""
        return sum(self.verifications) / len(self.verifications) if self.verifications else None

    # ------------------------------------------------------------------ scoring
    def bound(self, context: list[int], continuation: list[int], seed: int) -> float:
        """The family's Monte-Carlo lower bound on ``log p(continuation | context)``, ``mc_num`` draws seeded by
        ``seed``."""
        return self.module.loglikelihood_bound(context, continuation, seed, samples=self.mc_num,
                                               batch_size=self.batch_size)

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        pairs = [self.pair(*request.args) for request in requests]
        if self.module.exact_scoring:
            results = self.module.exact_scores(pairs, self.batch_size)
        else:
            results = [(self.bound(ctx, cont, request_seed(self.seed, *request.args)), False)
                       for (ctx, cont), request in zip(pairs, requests)]
        for request, result in zip(requests, results):
            self.cache_hook.add_partial("loglikelihood", request.args, result)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Exact scores: in windows of the model's positions. Bounds: the bound on the whole text given only the bos
        (else eos) token."""
        results = []
        for request in requests:
            (text,) = request.args
            prefix, tokens = self.pair("", text)
            if self.module.exact_scoring:
                limit = self.module.max_positions or len(tokens) + 1
                windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
                    token_list=tokens, prefix_token=prefix[0], max_seq_len=limit, context_len=1)]
                result = sum(score for score, _ in self.module.exact_scores(windows, self.batch_size))
            else:
                result = self.bound(prefix, tokens, request_seed(self.seed, text))
            results.append(result)
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, result)
        return results
