"""lm-evaluation-harness model for lit_dllm: ``--model lit_dllm`` (see :class:`LitDLLMEval`).

Every family answers ``generate_until`` with its own sampler (``module.generate_ids``). Scoring:

* ``CausalLMModule``: ``loglikelihood`` and ``loglikelihood_rolling`` exact (sums of next-token log-probs).
* ``MDLMModule`` / ``HybridMDLMModule``: ``loglikelihood`` is LLaDA's Monte-Carlo lower bound (:meth:`LitDLLMEval.
  diffusion_loglikelihood`), ``loglikelihood_rolling`` the same bound on the whole text.
* ``BlockDiffusionGemmaModule``: the Monte-Carlo bound of block diffusion with uniform-token noise (:meth:`LitDLLMEval.
  block_diffusion_loglikelihood`, its per-time integrand :func:`uniform_diffusion_nelbo`), likewise.
* DFlash: generation only; scoring raises ``NotImplementedError``. It answers by speculative decoding against its
  target, and the acceptance length τ is reported beside the score.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from contextlib import contextmanager
from typing import Any, Callable

import lm_eval.models  # noqa: F401  (fills the registry's built-in names before ours, see get_model)
import torch
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

import lit_dllm
from lit_dllm import compat
from lit_dllm.checkpointing import current_class_path
from lit_dllm.settings import CausalBackbone
from lit_dllm.core.token_loss import TokenLossModule
from lit_dllm.data.formats import encode_prompt
from lit_dllm.data.tokenizer import load_tokenizer
from lit_dllm.families.causal_lm.module import CausalLMModule
from lit_dllm.families.dflash.module import DFlashModule
from lit_dllm.families.diffusion_gemma.module import BlockDiffusionGemmaModule
from lit_dllm.families.mdlm.module import LLaDAGeneration, MDLMModule

__all__ = ["LitDLLMEval", "block_diffusion_nelbo", "load_module", "uniform_diffusion_nelbo"]

DEFAULT_MAX_GEN_TOKS = 256
"""New tokens per answer when neither the request, ``max_gen_toks=`` nor the module's ``gen_length`` says."""
GEN_KWARGS = {"until", "max_gen_toks", "do_sample", "temperature"}
"""The generation settings honoured; others are reported once and ignored."""


def module_class(name: str) -> type[TokenLossModule]:
    """``MDLMModule`` (a name exported by ``lit_dllm``) or ``package.module.Class`` (a module path of the earlier
    layout too: :func:`~lit_dllm.checkpointing.current_class_path`) -> the class."""
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


def load_module(checkpoint: str, module: str | None = None, device: str = "cpu") -> TokenLossModule:
    """The module of a Lightning checkpoint, of the class the checkpoint records (``train.py`` saves it), else of
    ``module`` (a class name; it also overrides the recorded one)."""
    hparams = torch.load(checkpoint, map_location="cpu", weights_only=True, mmap=True).get("hyper_parameters", {})
    name = module or hparams.get(compat.CLASS_PATH_KEY)
    if name is None:
        raise ValueError(
            f"checkpoint={checkpoint!r} does not record its module class (it was saved outside train.py): name it, "
            "e.g. model_args checkpoint=...,module=MDLMModule."
        )
    cls = module_class(name)
    # a train.py checkpoint is rebuilt by Lightning's instantiator from its recorded class: name ours instead
    key = compat.CLASS_PATH_KEY
    recorded = {key: f"{cls.__module__}.{cls.__qualname__}"} if key in hparams else {}
    return cls.load_from_checkpoint(checkpoint, map_location=device, **recorded)


def pretrained_module(path: str) -> CausalLMModule | MDLMModule:
    """The module around a Hugging Face folder (or hub id) and its tokenizer: an :class:`MDLMModule` with the
    recorded mask id and sampler for a lit_dllm MDLM / hybrid export (``dllm_sampling`` in its config), else a
    :class:`CausalLMModule`."""
    from transformers import AutoConfig

    tokenizer = load_tokenizer(path, require_mask=False)
    sampling = getattr(AutoConfig.from_pretrained(path), "dllm_sampling", None)
    if sampling is None:
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        module = CausalLMModule(len(tokenizer), backbone=CausalBackbone(model=path), tokenizer=path, pad_token_id=pad,
                                eos_token_id=tokenizer.eos_token_id)
    else:
        fast = {"gen_threshold": sampling["threshold"], "gen_cache": sampling["cache"]} if "cache" in sampling else {}
        generation = LLaDAGeneration(gen_length=sampling["gen_length"], gen_steps=sampling["steps"],
                                     gen_block_length=sampling["block_length"], remasking=sampling["remasking"],
                                     temperature=sampling["temperature"], sampler="fast" if fast else "llada", **fast)
        module = MDLMModule(len(tokenizer), sampling["mask_token_id"], sampling["pad_token_id"],
                            sampling["eos_token_id"], backbone=CausalBackbone(model=path), tokenizer=path,
                            generation=generation)
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


def uniform_diffusion_nelbo(logits: torch.Tensor, noisy: torch.Tensor, clean: torch.Tensor,
                            t: torch.Tensor) -> torch.Tensor:
    r"""Per token, the integrand at time ``t`` of the continuous-time NELBO of uniform-state discrete diffusion.

    The noise (``corrupt_uniform_random``) keeps a token with probability ``α_t = 1 − t``, else redraws it uniformly
    from the ``V`` tokens (possibly itself): ``q_t(z | x) = α_t·[z = x] + (1 − α_t)/V``. That is the marginal of the
    jump process that redraws a token at rate ``β_t = −α'_t/α_t = 1/α_t`` (``z → w ≠ z`` at rate ``β_t/V``). Write
    ``x̄ = V·q_t(·|x) = V·α_t·e_x + 1 − α_t``; the time reversal given ``x`` jumps ``z → w`` at rate ``(β_t/V)·r_w``,
    ``r_w = x̄_w/x̄_z``. The model puts its denoiser ``x_θ(z_t)`` (the softmax of ``logits``) in place of ``e_x``:
    ``r^θ_w = x̄^θ_w/x̄^θ_z``, ``x̄^θ = V·α_t·x_θ + 1 − α_t`` (the continuous-time limit of UDLM's
    ``q(z_s | z_t, x = x_θ)``). The ELBO of a jump process, the path KL between the true and the model's reversal
    (no prior term, since ``q_1`` is uniform, and no reconstruction, since ``z_0 = x``), summed over the tokens,
    which jump one at a time:

        −log p_θ(x) ≤ ∫_0^1 E_{z_t ~ q_t(·|x)} Σ_i f_i dt,
        f = (β_t/V)·Σ_{w≠z} [r^θ_w − r_w − r_w·log(r^θ_w/r_w)] = 1/(V·α_t) · Σ_w r_w·(e^{u_w} − 1 − u_w),
        u_w = log(r^θ_w/r_w)   (the w = z term is 0).

    Summing ``r^θ`` and ``r`` over ``w`` (``Σ_w x̄_w = V``) gives UDLM's continuous-time NELBO (Schiff et al. 2024;
    Sahoo et al. 2025) at ``α'_t = −1``: ``f = 1/(V·α_t)·[V/x̄^θ_z − V/x̄_z + Σ_{w≠z} (x̄_w/x̄_z)·log(x̄_w·x̄^θ_z /
    (x̄_z·x̄^θ_w))]``. The first form is computed here, in log space: each summand is ≥ 0, so nothing large cancels;
    ``f ≥ 0``, and ``f = 0`` for a denoiser with all its mass on ``x``.

    Args:
        logits: ``[..., V]`` denoiser logits.
        noisy, clean: ``[...]`` token ids, ``z_t`` and ``x``.
        t: the noise level of each token (broadcast to ``noisy``), in ``(0, 1)``.
    Returns:
        ``[...]`` the integrand per token, in the logits' dtype (at least fp32).
    """
    vocab = logits.shape[-1]
    dtype = torch.promote_types(logits.dtype, torch.float32)
    alpha = (1 - torch.as_tensor(t, dtype=torch.float64)).expand(noisy.shape)[..., None]
    log_kept, log_redrawn = torch.log(vocab * alpha).to(dtype), torch.log1p(-alpha).to(dtype)

    def log_scaled(log_y: torch.Tensor) -> torch.Tensor:  # log(V·α·y + 1 − α) for a distribution y
        return torch.logaddexp(log_y + log_kept, log_redrawn)

    def log_ratios(log_y: torch.Tensor) -> torch.Tensor:  # log r_w (y = e_x) or log r^θ_w (y = x_θ)
        scaled = log_scaled(log_y)
        return scaled - scaled.gather(-1, noisy[..., None])

    log_r = log_ratios(torch.nn.functional.one_hot(clean, vocab).to(dtype).log())
    u = log_ratios(logits.to(dtype).log_softmax(-1)) - log_r
    return (log_r.exp() * (u.expm1() - u)).sum(-1) / (vocab * alpha[..., 0]).to(dtype)


def block_diffusion_nelbo(nelbo: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], answer: torch.Tensor,
                          length: int, block: int, vocab: int, eps: float, samples: int, batch_size: int,
                          seed: int) -> torch.Tensor:
    """``samples`` Monte-Carlo draws of the block-diffusion NELBO of ``answer[:length]`` (float64, ``[samples]``);
    the model enters only through ``nelbo``, so a toy denoiser can stand in for it.

    ``answer`` holds whole canvas blocks of ``block`` tokens (the real ones, then fill). Each draw takes, per block,
    ``t ~ U(eps, 1)`` and noises each token of the block with it (kept with probability ``1 − t``, else uniform over
    ``vocab``); ``nelbo(canvases, t)`` (``[n, W]`` noised canvases, the ``[n, W]`` level of each token) returns
    :func:`uniform_diffusion_nelbo` at the first ``length`` positions (``[n, length]``). A draw is ``(1 − eps)·Σ f``:
    its mean estimates ``Σ_blocks ∫_eps^1 E[Σ f] dt``. The draws come from a generator seeded with ``seed``, all
    before the first ``nelbo`` call, so they depend neither on ``batch_size`` nor on the device.
    """
    generator = torch.Generator().manual_seed(seed)
    width = len(answer)
    t = eps + (1 - eps) * torch.rand(samples, width // block, generator=generator, dtype=torch.float64)
    t = t.repeat_interleave(block, 1)
    redrawn = torch.rand(samples, width, generator=generator, dtype=torch.float64) < t
    canvases = torch.where(redrawn, torch.randint(vocab, (samples, width), generator=generator), answer)
    sums = [nelbo(canvases[rows], t[rows]).double().sum(1).cpu() for rows in torch.arange(samples).split(batch_size)]
    return (1 - eps) * torch.cat(sums)


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
        self.verifications: list[int] = []  # DFlash: tokens committed per target verification
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
            context_ids = [prefix if prefix is not None else self.module.hparams.eos_token_id]
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
        hparams = self.module.hparams
        saved = dict(hparams)
        hparams["generation"] = {**hparams.get("generation", {}), "temperature": value}
        try:
            yield
        finally:
            hparams.clear()
            hparams.update(saved)

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
            own = self.module.hparams.get("generation", {}).get("gen_length")
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
            self.warn_once(f"DFlash acceptance length τ = {self.acceptance_length:.3f} over {len(self.verifications)} "
                           "target verifications (tokens committed per verification, all answers so far).")
        return results

    def answer(self, prompts: list[torch.Tensor], length: int) -> list[torch.Tensor]:
        """``module.generate_ids``; for DFlash, its speculative decodings, whose committed tokens per target
        verification are kept for τ."""
        if not isinstance(self.module, DFlashModule):
            return self.module.generate_ids(prompts, length)
        decoded = self.module.decode_answers(prompts, length)
        self.verifications += [n for d in decoded for n in d.accepted]
        return [d.tokens for d in decoded]

    @property
    def acceptance_length(self) -> float | None:
        """DFlash's τ over every answer so far: tokens committed per target verification (None for other families)."""
        return sum(self.verifications) / len(self.verifications) if self.verifications else None

    # ------------------------------------------------------------------ scoring
    def monte_carlo_bound(self) -> Callable[[list[int], list[int], int], float] | None:
        """The family's Monte-Carlo log-likelihood bound ``(context, continuation, seed) -> float``; None for a causal
        LM, scored exactly."""
        if isinstance(self.module, MDLMModule):
            return self.diffusion_loglikelihood
        if isinstance(self.module, BlockDiffusionGemmaModule):
            return self.block_diffusion_loglikelihood
        if isinstance(self.module, CausalLMModule):
            return None
        raise NotImplementedError(
            f"{type(self.module).__name__} has no log-likelihood here, only generate_until (generation tasks such as "
            "gsm8k). Scoring is implemented for CausalLMModule (exact), MDLMModule / HybridMDLMModule and "
            "BlockDiffusionGemmaModule (Monte-Carlo bounds)."
        )

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        bound = self.monte_carlo_bound()
        pairs = [self.pair(*request.args) for request in requests]
        if bound is None:
            results = self.causal_scores(pairs)
        else:
            results = [(bound(ctx, cont, request_seed(self.seed, *request.args)), False)
                       for (ctx, cont), request in zip(pairs, requests)]
        for request, result in zip(requests, results):
            self.cache_hook.add_partial("loglikelihood", request.args, result)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Causal: exact, in windows of the model's positions. Diffusion: the Monte-Carlo bound on the whole text
        given only the bos (else eos) token."""
        bound = self.monte_carlo_bound()
        results = []
        for request in requests:
            (text,) = request.args
            prefix, tokens = self.pair("", text)
            if bound is None:
                limit = self.module.max_positions or len(tokens) + 1
                windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
                    token_list=tokens, prefix_token=prefix[0], max_seq_len=limit, context_len=1)]
                result = sum(score for score, _ in self.causal_scores(windows))
            else:
                result = bound(prefix, tokens, request_seed(self.seed, text))
            results.append(result)
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, result)
        return results

    @torch.no_grad()
    def causal_scores(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """Exact ``(Σ log p(continuation | context), greedy)`` per pair: right-padded batches (causal attention
        never sees the padding), the context cut from the left to the model's positions."""
        results: list[tuple[float, bool] | None] = [None] * len(pairs)
        limit = self.module.max_positions
        inputs = [(ctx + cont)[-(limit + 1) :][:-1] if limit else (ctx + cont)[:-1] for ctx, cont in pairs]
        order = sorted(range(len(pairs)), key=lambda i: -len(inputs[i]))
        pad = self.module.hparams.pad_token_id
        for start in range(0, len(order), self.batch_size):
            chunk = order[start : start + self.batch_size]
            ids = torch.full((len(chunk), len(inputs[chunk[0]])), pad, dtype=torch.long)
            for row, i in enumerate(chunk):
                ids[row, : len(inputs[i])] = torch.tensor(inputs[i])
            logits = self.module.model(ids.to(self.device)).float().log_softmax(-1).cpu()
            for row, i in enumerate(chunk):
                cont = torch.tensor(pairs[i][1])
                end = len(inputs[i])
                logprobs = logits[row, end - len(cont) : end]
                score = float(logprobs.gather(-1, cont[:, None]).sum())
                results[i] = (score, bool((logprobs.argmax(-1) == cont).all()))
        return results

    @torch.no_grad()
    def diffusion_loglikelihood(self, context: list[int], continuation: list[int], seed: int) -> float:
        """LLaDA's Monte-Carlo lower bound on ``log p(continuation | context)`` (its ``get_log_likelihood``).

        Each of ``mc_num`` samples draws a count ``k`` uniformly from ``1..n`` (n continuation tokens), masks ``k``
        continuation positions chosen uniformly at random (exactly ``k``, as LLaDA's evaluation does; no
        stratification across samples), runs the bidirectional model on context + partly masked continuation and
        scores ``(n / k) · Σ_masked -log p(x_i)``. The result is minus the mean over samples: an unbiased estimate
        of the ELBO, whose standard error shrinks as ``1/sqrt(mc_num)``. Draws come from a generator seeded with
        ``seed``; the samples of one request run ``batch_size`` at a time with no padding, so the number depends
        on neither the batch size nor the other requests (up to float rounding).
        """
        hp, n = self.module.hparams, len(continuation)
        if n == 0:
            return 0.0
        self.check_positions(len(context), n)
        generator = torch.Generator().manual_seed(seed)
        counts = torch.randint(1, n + 1, (self.mc_num,), generator=generator)
        ranks = torch.rand(self.mc_num, n, generator=generator).argsort(1).argsort(1)
        masked = torch.zeros(self.mc_num, len(context) + n, dtype=torch.bool)
        masked[:, len(context) :] = ranks < counts[:, None]
        clean = torch.tensor(context + continuation).expand(self.mc_num, -1)
        noisy = clean.masked_fill(masked, hp.mask_token_id)
        sums = torch.zeros(self.mc_num, dtype=torch.float64)
        for start in range(0, self.mc_num, self.batch_size):
            rows = slice(start, start + self.batch_size)
            scored = self.module.model(noisy[rows].to(self.device), targets=clean[rows].to(self.device),
                                       positions=masked[rows].to(self.device))
            which = masked[rows].nonzero(as_tuple=True)[0] + start
            sums.index_add_(0, which, scored.nll.detach().double().cpu())
        return float(-(n / counts.double() * sums).mean())

    @torch.no_grad()
    def block_diffusion_loglikelihood(self, context: list[int], continuation: list[int], seed: int) -> float:
        """A Monte-Carlo lower bound on ``log p(continuation | context)`` under block-diffusion Gemma.

        The continuation is cut into canvas blocks of ``canvas_length`` tokens, the last one completed with the
        collator's fill (eos, else pad) as in training and validation. Block diffusion factorises ``log p(x) =
        Σ_b log p(x_b | context, x_<b)``, and each block is bounded by the continuous-time ELBO of its uniform-token
        noise (:func:`uniform_diffusion_nelbo`): ``log p(x_b | ·) ≥ −∫_0^1 E_{z_t} Σ_{i∈b} f_i dt``. One forward scores
        every block of a draw, as validation does: the encoder runs over the clean context and continuation, each
        noised canvas block attends to the clean tokens before it (the block-causal masks) and to itself, with a zero
        self-conditioning signal; the denoiser ``x_θ`` is the softmax of the decoder's logits. Each of ``mc_num`` draws
        takes its own ``t ~ U(eps, 1)`` per block (``eps``: the module's minimum noise level); the result is minus
        the mean of the draws (:func:`block_diffusion_nelbo`), its standard error shrinking as ``1/sqrt(mc_num)``,
        though a draw is heavy-tailed (a token redrawn at a small ``t`` weighs about ``1/t``). The draws are seeded
        with ``seed``, so the number depends on neither the batch size nor the other requests (up to float rounding).

        Two departures from a strict bound: the integral starts at ``eps``, as training's noise does (the left-out
        part is ≥ 0, about ``eps·log(V/eps)`` nats a token: 0.012 for a uniform denoiser at V = 96, eps = 1e-3), and
        the fill of the last block is noised with it but not scored (only real tokens count; scoring the fill too
        would bound ``log p(x, fill) ≤ log p(x)`` instead).
        """
        module, n = self.module, len(continuation)
        if n == 0:
            return 0.0
        block, hp = module.canvas_length, module.hparams
        width = -(-n // block) * block
        self.check_positions(len(context), width)
        fill = hp.eos_token_id if hp.eos_token_id is not None else hp.pad_token_id
        answer = torch.tensor(continuation + [fill] * (width - n))
        clean = torch.tensor(context + answer.tolist(), device=self.device)
        supervised = torch.arange(len(clean), device=self.device) >= len(context)

        def nelbo(canvases: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
            rows, canvases, t = len(canvases), canvases.to(self.device), t.to(self.device)
            batch = {"input_ids": clean.expand(rows, -1), "loss_mask": supervised.expand(rows, -1),
                     "attention_mask": torch.ones_like(clean).expand(rows, -1)}
            prepared = module.canvas_inputs(batch, torch.cat([clean[: len(context)].expand(rows, -1), canvases], 1))
            hidden, _ = module.model.denoise(batch["input_ids"], prepared["encoder_masks"], prepared["canvas_ids"],
                                             prepared["decoder_masks"], prepared["decoder_positions"])
            spans = [slice(start, min(start + block, n)) for start in range(0, n, block)]  # V-wide logits per block
            return torch.cat([uniform_diffusion_nelbo(module.model.logits(hidden[:, span]), canvases[:, span],
                                                      clean[len(context) :][span], t[:, span]) for span in spans], 1)

        draws = block_diffusion_nelbo(nelbo, answer, n, block, module.model.vocab_size, hp.eps, self.mc_num,
                                      self.batch_size, seed)
        return float(-draws.mean())

    def check_positions(self, context: int, continuation: int) -> None:
        limit = self.module.max_positions
        if limit is not None and context + continuation > limit:
            raise ValueError(
                f"context ({context} tokens) + continuation ({continuation}) > max_position_embeddings={limit}: "
                "shorten the task's prompts (e.g. fewer few-shot examples)."
            )
