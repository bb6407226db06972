"""MDLM / LLaDA training, and the hybrid diffusion + AR variant (Nemotron-Labs-Diffusion style), with LLaDA / Fast-dLLM
sampling (:class:`LLaDAGenerationMixin`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_warn

from lit_dllm.core.base import DLLMModule, StepLoss
from lit_dllm.core.build_backbone import build_backbone
from lit_dllm.core.generation import DEFAULT_GEN_LENGTH, FAMILY_KEY, GenerationMixin
from lit_dllm.core.trace import DenoisingTrace
from lit_dllm.settings import CausalBackbone, DenoisingGeneration, Tokenizer, check_positive_or_none, settings_group
from lit_dllm.data.batch import document_inputs, real_tokens, shifted_targets
from lit_dllm.data.handoff import DataFacts
from lit_dllm.noise.corruption import corrupt_blockwise, corrupt_uniform
from lit_dllm.families.mdlm.fast_sampler import CACHES, fast_generate
from lit_dllm.families.mdlm.model import DiffusionLM
from lit_dllm.families.mdlm.sampler import REMASKING, llada_generate
from lit_dllm.losses import DLLMLossOutput, elbo_weight

SAMPLERS = ("llada", "fast")
"""Masked-diffusion samplers: :func:`~lit_dllm.families.mdlm.sampler.llada_generate` (the reference) and
:func:`~lit_dllm.families.mdlm.fast_sampler.fast_generate` (threshold decoding, KV cache)."""


@dataclass(frozen=True)
class LLaDAGeneration(DenoisingGeneration):
    """:class:`~lit_dllm.settings.DenoisingGeneration` with LLaDA / Fast-dLLM sampling (the MDLM and hybrid
    families).

    Attributes:
        gen_block_length: tokens per block, denoised left to right (None: the whole answer as one block);
            ``gen_length`` must be a multiple of it (a length given per call is rounded up to whole blocks).
        remasking: ``low_confidence`` or ``random``: which masked positions each step commits.
        sampler: ``llada`` (the reference :func:`~lit_dllm.families.mdlm.sampler.llada_generate`) or ``fast``
            (Fast-dLLM style, :func:`~lit_dllm.families.mdlm.fast_sampler.fast_generate`): each step also commits the
            masked positions whose probability is at least ``gen_threshold``, with a block-wise approximate KV cache
            ``gen_cache``.
        gen_threshold: ``fast``'s commit threshold (> 0; above 1: the LLaDA schedule only).
        gen_cache: ``fast``'s cache: ``none``, ``prefix`` or ``dual``.
        gen_canvas_multiple: round each batch's rows (prompts right-padded, then the canvas) up to a multiple of this
            width, as ``collation.pad_seq_len_divisible`` rounded the training rows (None: no rounding). A
            bidirectional denoiser sees where its row ends: trained on rows of a few widths, it can answer
            differently on a width it never saw (docs/families/mdlm.md, "The canvas's width").
    """

    gen_block_length: int | None = None
    remasking: str = "low_confidence"
    sampler: str = "llada"
    gen_threshold: float = 0.9
    gen_cache: str = "prefix"
    gen_canvas_multiple: int | None = None

    def check(self) -> None:
        super().check()
        check_positive_or_none(self, {"gen_block_length": "one block", "gen_canvas_multiple": "no rounding"})
        if self.gen_length and self.gen_block_length and self.gen_length % self.gen_block_length:
            rounded = -(-self.gen_length // self.gen_block_length) * self.gen_block_length
            raise ValueError(
                f"gen_length={self.gen_length} is not a multiple of gen_block_length={self.gen_block_length}: "
                f"use gen_length={rounded}, or another gen_block_length."
            )
        if self.remasking not in REMASKING:
            raise ValueError(f"remasking={self.remasking!r}; use 'low_confidence' or 'random'.")
        if self.sampler not in SAMPLERS:
            raise ValueError(f"sampler={self.sampler!r}; use 'llada' or 'fast'.")
        threshold = self.gen_threshold
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or threshold <= 0:
            raise ValueError(f"gen_threshold={threshold!r} must be a number > 0 (above 1: the LLaDA schedule only).")
        if self.gen_cache not in CACHES:
            raise ValueError(f"gen_cache={self.gen_cache!r}; use 'none', 'prefix' or 'dual'.")


NOISE_LEVELS = {"t25": 0.25, "t50": 0.5, "t75": 0.75, "t100": 1.0}
"""Evaluation's masked accuracy by noise level: ``masked_accuracy_t25`` counts the positions masked at a rate
``t <= 0.25``, ``_t50`` those at ``0.25 < t <= 0.5``, and so on."""


def by_noise_level(correct: torch.Tensor, scored: torch.Tensor, rate: torch.Tensor) -> dict:
    """``{level: (correct, scored)}`` counts of the positions whose masking rate ``rate`` lies in each band of
    :data:`NOISE_LEVELS` (all ``[B, L]``; fixed shapes, no device sync)."""
    found, low = {}, 0.0
    for name, high in NOISE_LEVELS.items():
        band = (rate > low) & (rate <= high)
        found[name], low = ((correct & band).sum(), (scored & band).sum()), high
    return found


class LLaDAGenerationMixin(GenerationMixin):
    """:class:`GenerationMixin` with LLaDA sampling (the settings of :class:`LLaDAGeneration`), for a module whose
    ``self.model(ids)`` returns logits."""

    def connect(self, facts: DataFacts) -> None:
        """Also warn when the data rounds its rows' width and the sampler does not (``gen_canvas_multiple``)."""
        super().connect(facts)
        multiple = facts.row_multiple or 1
        if multiple > 1 and self.generation.gen_canvas_multiple is None:
            rank_zero_warn(
                f"The training rows are rounded up to a multiple of {multiple} tokens (data.init_args.collation."
                "pad_seq_len_divisible) but the sampler's rows are not: a bidirectional denoiser can answer "
                "differently on a width it never trained on. Set model.init_args.generation.gen_canvas_multiple: "
                f"{multiple}, with a gen_length that keeps the longest prompt and the canvas within the widths training "
                "saw (docs/families/mdlm.md, \"The canvas's width\")."
            )

    def sampler_settings(self, max_new_tokens: int | None = None) -> dict:
        """The keyword arguments of the sampler (``llada_generate``, or ``fast_generate``: ``threshold``, ``cache``)
        that answer ``max_new_tokens`` new tokens at most (None: ``gen_length``), ids included."""
        generation = self.generation
        length = max_new_tokens or generation.gen_length or DEFAULT_GEN_LENGTH
        block = generation.gen_block_length or length
        length = -(-length // block) * block
        steps = generation.gen_steps or length
        steps = -(-steps // (length // block)) * (length // block)
        settings = {"mask_token_id": self.mask_token_id, "pad_token_id": self.pad_token_id,
                    "eos_token_id": self.eos_token_id,
                    "gen_length": length, "steps": steps, "block_length": block, "remasking": generation.remasking,
                    "temperature": generation.temperature, "canvas_multiple": generation.gen_canvas_multiple}
        if generation.sampler == "fast":
            settings.update(threshold=generation.gen_threshold, cache=generation.gen_cache)
        return settings

    def export_config(self) -> dict:
        """The sampler and its settings (``dllm_sampler``, ``dllm_sampling``: ``llada_generate(hf, prompts,
        **config.dllm_sampling)`` answers as :meth:`generate` does), the mask id and the family (``lit_dllm_family``:
        ``mdlm``), beside ``is_causal: false``."""
        return {"mask_token_id": self.mask_token_id, "dllm_sampler": self.generation.sampler,
                "dllm_sampling": self.sampler_settings(), FAMILY_KEY: "mdlm"}

    def generate_ids(self, prompts: list[torch.Tensor], max_new_tokens: int | None = None,
                     trace: DenoisingTrace | None = None, temperature: float | None = None,
                     keys: torch.Tensor | None = None) -> list[torch.Tensor]:
        """The sampler's answers (cut before eos) at ``temperature`` (None: the generation group's), its noise keyed
        per row by ``keys`` (``[B]`` int64) when given; its steps recorded into ``trace`` when one is given."""
        settings = self.sampler_settings(max_new_tokens)
        if temperature is not None:
            settings["temperature"] = temperature
        self.check_fits(prompts, settings["gen_length"])
        sample = fast_generate if self.generation.sampler == "fast" else llada_generate
        with self.generating():
            moved = torch.cat(prompts).to(self.device).split([len(p) for p in prompts]) if prompts else []  # one copy
            return sample(self.model, list(moved), keys=keys, everywhere=self.on_every_rank, trace=trace, **settings)



class MDLMModule(LLaDAGenerationMixin, DLLMModule):
    """Masked diffusion LM (MDLM / LLaDA) on any transformers causal-LM stack, run bidirectionally.

    Args:
        backbone: the transformers stack (:class:`~lit_dllm.settings.CausalBackbone`): exactly one of ``model``
            (pretrained) or ``model_config`` (random init; ``vocab_size`` defaults to the data module's).
        corruption: ``"uniform"`` (one masking rate t per example) or ``"blockwise"`` (exact-k
            per block of ``block_size`` with an exponential position bias, ``half_life_ratio``);
            ``block_size`` is unused (a warning) with ``"uniform"``.
        eps: the minimum masking rate.
        fused_loss: apply the LM head only at the corrupted positions, chunk by chunk
            (never materialises ``[B, L, V]`` logits); ``loss_chunk_size`` positions per chunk.
        generation: answers and their scoring (:class:`LLaDAGeneration`).
        Other arguments: see :class:`DLLMModule`.
    """

    def __init__(
        self,
        vocab_size: int,
        mask_token_id: int,
        pad_token_id: int = 0,
        eos_token_id: int | None = None,
        tokenizer_settings: Tokenizer = Tokenizer(),
        backbone: CausalBackbone = CausalBackbone(),
        corruption: str = "uniform",
        eps: float = 1e-3,
        block_size: int | None = None,
        half_life_ratio: float = 0.25,
        fused_loss: bool = True,
        loss_chunk_size: int = 2048,
        generation: LLaDAGeneration = LLaDAGeneration(),
        **kwargs: Any,
    ) -> None:
        self.backbone = settings_group("backbone", CausalBackbone, backbone)
        self.generation = settings_group("generation", LLaDAGeneration, generation)
        super().__init__(vocab_size, mask_token_id, pad_token_id, eos_token_id, tokenizer_settings, **kwargs)
        if corruption not in ("uniform", "blockwise"):
            raise ValueError(f"corruption={corruption!r}; use 'uniform' or 'blockwise'.")
        if (self.backbone.model is None) == (self.backbone.model_config is None):
            raise ValueError(
                "Give exactly one of model (a hub id or local path) or model_config (model_type and sizes)."
            )
        if block_size is not None and block_size <= 0:
            raise ValueError(f"block_size={block_size} must be positive (or None for per-sequence corruption).")
        if block_size is not None and corruption == "uniform":
            rank_zero_warn(
                f"block_size={block_size} is unused with corruption='uniform'; set corruption='blockwise' or drop it."
            )
        self.corruption, self.eps, self.block_size, self.half_life_ratio = corruption, eps, block_size, half_life_ratio
        self.fused_loss, self.loss_chunk_size = fused_loss, loss_chunk_size
        self.save_settings(backbone=self.backbone, corruption=corruption, eps=eps, block_size=block_size,
                           half_life_ratio=half_life_ratio, fused_loss=fused_loss, loss_chunk_size=loss_chunk_size,
                           generation=self.generation)

    # ------------------------------------------------------------------ hooks
    def build_model(self) -> DiffusionLM:
        return build_backbone(self, DiffusionLM, self.loss_chunk_size, self.fused_loss)

    def packing_problem(self, fill_block_size: int | None) -> str | None:
        """Blockwise corruption draws per block from each document's start: its documents must fill whole blocks,
        as they do alone; without ``block_size`` it draws over the whole row, which packing would change."""
        if self.corruption != "blockwise":
            return None
        if self.block_size is None:
            return ("corruption='blockwise' without block_size draws its masking counts over the whole row, which "
                    "packing changes: set model.init_args.block_size to pack")
        if fill_block_size is None or fill_block_size % self.block_size:
            return (f"corruption='blockwise' draws per block of {self.block_size} from each document's start, so a "
                    f"packed document must fill whole blocks: set data.init_args.collation.pad_block_size to a multiple of "
                    f"{self.block_size} (got {fill_block_size})")
        return None

    def corrupt(self, batch: dict, keys: torch.Tensor) -> dict:
        ids, loss_mask = batch["input_ids"], batch["loss_mask"]
        if self.corruption == "uniform":
            noisy, noise, p = corrupt_uniform(ids, loss_mask, self.mask_token_id, self.eps, keys=keys)
        else:
            noisy, noise, p = corrupt_blockwise(
                ids, loss_mask, self.mask_token_id, self.block_size, self.eps, self.half_life_ratio, keys=keys
            )
        return {"noisy_ids": noisy, "noise_mask": noise & loss_mask.bool(), "p_mask": p}

    def diffusion_sum(self, batch: dict, noisy: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict]:
        """``Σ nll / p`` over corrupted supervised positions, plus (correct, scored) counts over the corrupted
        positions that hold real tokens (padding, easy to predict, would inflate the accuracy), and in evaluation
        those counts by noise level (:func:`by_noise_level`)."""
        selected = noisy["noise_mask"]
        weights = elbo_weight(noisy["p_mask"])
        scored = self.model(noisy["noisy_ids"], targets=batch["input_ids"], positions=selected, weights=weights,
                            **document_inputs(batch))
        hits = torch.zeros_like(selected).masked_scatter(selected, scored.correct)  # no device sync, unlike [selected]
        real = real_tokens(batch) & selected
        by_noise = {} if self.training else by_noise_level(hits & real, real, noisy["p_mask"])
        return scored.total, (hits & real).sum(), real.sum(), by_noise

    def compute_loss(self, batch: dict, noisy: dict, denominators: dict[str, torch.Tensor]) -> StepLoss:
        total, correct, scored, by_noise = self.diffusion_sum(batch, noisy)
        loss = total / denominators["diffusion"]
        return StepLoss(DLLMLossOutput(loss, loss.detach()), correct, scored, accuracy_by=by_noise)

    # ------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def loglikelihood_bound(self, context: list[int], continuation: list[int], seed: int, *, samples: int,
                            batch_size: int) -> float:
        """LLaDA's Monte-Carlo lower bound on ``log p(continuation | context)`` (its ``get_log_likelihood``).

        Each of ``samples`` draws a count ``k`` uniformly from ``1..n`` (n continuation tokens), masks ``k``
        continuation positions chosen uniformly at random (exactly ``k``, as LLaDA's evaluation does; no
        stratification across samples), runs the bidirectional model on context + partly masked continuation and
        scores ``(n / k) · Σ_masked -log p(x_i)``. The result is minus the mean over samples: an unbiased estimate
        of the ELBO, whose standard error shrinks as ``1/sqrt(samples)``. Draws come from a generator seeded with
        ``seed``; the samples run ``batch_size`` at a time with no padding, so the number depends on neither the
        batch size nor other requests (up to float rounding).
        """
        n = len(continuation)
        if n == 0:
            return 0.0
        self.check_positions(len(context), n)
        generator = torch.Generator().manual_seed(seed)
        counts = torch.randint(1, n + 1, (samples,), generator=generator)
        ranks = torch.rand(samples, n, generator=generator).argsort(1).argsort(1)
        masked = torch.zeros(samples, len(context) + n, dtype=torch.bool)
        masked[:, len(context) :] = ranks < counts[:, None]
        clean = torch.tensor(context + continuation).expand(samples, -1)
        noisy = clean.masked_fill(masked, self.mask_token_id)
        sums = torch.zeros(samples, dtype=torch.float64)
        for start in range(0, samples, batch_size):
            rows = slice(start, start + batch_size)
            scored = self.model(noisy[rows].to(self.device), targets=clean[rows].to(self.device),
                                positions=masked[rows].to(self.device))
            which = masked[rows].nonzero(as_tuple=True)[0] + start
            sums.index_add_(0, which, scored.nll.detach().double().cpu())
        return float(-(n / counts.double() * sums).mean())

    tiny_config = "configs/mdlm_tiny.yaml"
    accuracy_by = tuple(NOISE_LEVELS)
    takes_context_parallel = True


class HybridMDLMModule(MDLMModule):
    """Hybrid diffusion + AR training: a causal pass of the same backbone over the clean sequence.

    ``total = alpha · D + A`` with ``D = Σ nll/p`` over corrupted tokens divided by the global
    corrupted count (``diffusion_normalization="noise"``, the reference's choice) or by the global
    supervised count (``"supervised"``), and ``A`` the next-token CE over supervised targets
    ``loss_mask[:, 1:]`` divided by their global count (the reference counts position 0 too; we
    do not). Nemotron-style training uses ``corruption="blockwise"`` with a ``block_size``.

    With ``accumulate_grad_batches > 1`` and two different denominators, the AR term's denominator
    is estimated from the step's first micro-batch; the diffusion term stays exact.
    """

    def __init__(self, *args: Any, alpha: float = 1.0, diffusion_normalization: str = "noise", **kwargs: Any):
        super().__init__(*args, **kwargs)
        if diffusion_normalization not in ("noise", "supervised"):
            raise ValueError(
                f"diffusion_normalization={diffusion_normalization!r}; use 'noise' or 'supervised'."
            )
        self.alpha, self.diffusion_normalization = alpha, diffusion_normalization
        self.save_settings(alpha=alpha, diffusion_normalization=diffusion_normalization)

    def prepare_batch(self, batch: dict, keys: torch.Tensor) -> dict:
        """The noise, and the causal pass's next-token targets and positions (within each document of packed rows),
        both of the whole rows."""
        targets, positions = shifted_targets(batch["input_ids"], batch["loss_mask"], batch.get("document_ids"))
        return {**super().prepare_batch(batch, keys), "ar_targets": targets, "ar_positions": positions}

    def token_counts(self, batch: dict, noisy: dict) -> dict[str, torch.Tensor]:
        diffusion = noisy["noise_mask"] if self.diffusion_normalization == "noise" else batch["loss_mask"]
        return {"diffusion": diffusion.sum(), "ar": noisy["ar_positions"].sum()}

    def compute_loss(self, batch: dict, noisy: dict, denominators: dict[str, torch.Tensor]) -> StepLoss:
        diffusion, correct, scored, by_noise = self.diffusion_sum(batch, noisy)
        diffusion = self.alpha * diffusion / denominators["diffusion"]
        targets, positions = noisy["ar_targets"], noisy["ar_positions"]
        ones = torch.ones_like(positions, dtype=torch.float32)
        ar = self.model(batch["input_ids"], targets=targets, positions=positions, causal=True, weights=ones,
                        **document_inputs(batch)).total
        ar = ar / denominators["ar"]
        out = DLLMLossOutput(diffusion + ar, diffusion.detach())
        return StepLoss(out, correct, scored, extra={"ar_loss": ar.detach()}, accuracy_by=by_noise)

    def training_flops(self, batch: dict) -> float:
        """Twice the base's: a bidirectional and a causal pass over the batch (attention counted in full for both,
        as the PaLM accounting does)."""
        return 2 * super().training_flops(batch)

    tiny_config = "configs/hybrid_tiny.yaml"
