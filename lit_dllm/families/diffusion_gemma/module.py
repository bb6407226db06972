"""Block-diffusion Gemma: training transformers' DiffusionGemma (docs/DESIGN.md §9.3) on any ``DLLMDataModule`` data.

Per micro-batch: every supervised token is replaced by a uniform random token with probability ``t`` (one ``t`` per
example; the canvas starts as uniform random tokens at inference); the response window (prompt end to the attended
fill end) becomes the canvas, denoised block-causally against the clean sequence's encoder KV; one canvas block per
example carries the diffusion loss, and the encoder's next-token loss over the whole sequence is added with weight
``encoder_loss_weight``. The canvas block and the self-conditioning coin of each example are keyed by (seed, example
index, epoch) like its noise, so they do not depend on batch size, accumulation or data-parallel size. Validation
scores every canvas block with no AR term and a zero self-conditioning signal, and answers prompts with transformers'
own ``generate`` on the model being trained.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import torch

from lit_dllm.core.generation import DEFAULT_GEN_LENGTH, GenerationMixin
from lit_dllm.core.trace import DenoisingTrace
from lit_dllm.hub.hf import HUB_OR_PATH, require_exactly_one
from lit_dllm.settings import Backbone, DenoisingGeneration, settings_group
from lit_dllm.core.token_loss import StepLoss, TokenLossModule
from lit_dllm.data.batch import cut_rows_at_eos, real_tokens, shifted_targets
from lit_dllm.noise.corruption import corrupt_uniform_random
from lit_dllm.noise.keys import Stream, keyed_uniform
from lit_dllm.families.diffusion_gemma.likelihood import block_diffusion_nelbo, uniform_diffusion_nelbo
from lit_dllm.families.diffusion_gemma.masks import (
    block_diffusion_batch_mask,
    block_diffusion_block_mask,
    encoder_attention_masks,
    encoder_block_masks,
)
from lit_dllm.families.diffusion_gemma.model import BlockDiffusionGemma, canvas_length_of, load_diffusion_gemma
from lit_dllm.families.diffusion_gemma.trace import DraftRecorder
from lit_dllm.lora import LLAMA_STYLE_TARGETS
from lit_dllm.losses import DLLMLossOutput
from lit_dllm.throughput import attention_flops, expert_share, matmul_params


class BlockDiffusionGemmaModule(GenerationMixin, TokenLossModule):
    """Block-diffusion training of ``DiffusionGemmaForBlockDiffusion`` (the model stays transformers' own class).

    Logs ``train/loss`` (diffusion + weighted AR), ``train/dllm_loss`` (diffusion), ``train/ar_loss``, and in
    validation ``val/loss`` (diffusion over every canvas block), ``val/masked_accuracy`` and ``val/exact_match``.

    Args:
        vocab_size, pad_token_id, eos_token_id, tokenizer: linked from the data module (``mask_token_id`` is
            accepted and unused: the noise is random tokens, not a mask).
        backbone: the DiffusionGemma model (:class:`~lit_dllm.settings.Backbone`): exactly one of ``model``, a
            hub id or local path of a DiffusionGemma checkpoint (e.g. ``google/diffusiongemma-26B-A4B``; not a GGUF:
            llama.cpp has no DiffusionGemma architecture), or ``model_config``, ``DiffusionGemmaConfig`` keys
            (``text_config``, ``vision_config``, ``canvas_length``) for random init; ``text_config`` ``vocab_size`` /
            ``pad_token_id`` / ``eos_token_id`` default to the tokenizer's. The canvas block size is
            ``canvas_length``: the data module's ``collation.pad_block_size`` must equal it, with
            ``collation.response_window: true`` (:meth:`required_collation`, checked by the data module).
            ``attn_implementation: flex_attention`` passes FlexAttention block masks (the same masks, block-sparse:
            fully masked tiles are skipped) instead of dense ones; training it needs CUDA (no CPU backward in torch).
        eps: the minimum replacement rate ``t``.
        self_conditioning_p: probability that an example's second decoder pass sees the first pass's logits.
        encoder_loss_weight: weight of the encoder's next-token loss (0: diffusion only).
        freeze_router: keep the MoE router weights fixed (docs/DESIGN.md §9.1); the vision tower is always frozen.
        loss_chunk_size: positions per chunk of the fused LM head + cross-entropy.
        generation: answers and their scoring (:class:`~lit_dllm.settings.DenoisingGeneration`): ``gen_steps``
            denoising steps per canvas (transformers' ``max_denoising_steps``; None: its default); ``temperature`` 0
            keeps transformers' default sampler, > 0 is passed to ``generate``.
        Other arguments: see :class:`TokenLossModule`.
    """

    accuracy_name = "masked_accuracy"
    lora_defaults = {**TokenLossModule.lora_defaults, "target_modules": LLAMA_STYLE_TARGETS,
                     "exclude_modules": r".*vision_tower.*"}
    """LoRA on the attention and dense MLP projections of the shared stack. The experts are parameters, not linear
    layers: include them with ``target_parameters: [experts.gate_up_proj, experts.down_proj]``."""

    def __init__(
        self,
        vocab_size: int,
        backbone: Backbone = Backbone(),
        eps: float = 1e-3,
        self_conditioning_p: float = 0.5,
        encoder_loss_weight: float = 1.0,
        freeze_router: bool = True,
        loss_chunk_size: int = 2048,
        generation: DenoisingGeneration = DenoisingGeneration(),
        **kwargs: Any,
    ) -> None:
        self.backbone = settings_group("backbone", Backbone, backbone)
        self.generation = settings_group("generation", DenoisingGeneration, generation)
        super().__init__(vocab_size, **kwargs)
        require_exactly_one(("model", self.backbone.model, HUB_OR_PATH),
                            ("model_config", self.backbone.model_config, "DiffusionGemmaConfig keys for random init"))
        if not 0.0 <= self_conditioning_p <= 1.0:
            raise ValueError(f"self_conditioning_p={self_conditioning_p} must lie in [0, 1].")
        if encoder_loss_weight < 0:
            raise ValueError(f"encoder_loss_weight={encoder_loss_weight} must be >= 0 (0: diffusion loss only).")
        self.eps, self.self_conditioning_p, self.encoder_loss_weight = eps, self_conditioning_p, encoder_loss_weight
        self.freeze_router, self.loss_chunk_size = freeze_router, loss_chunk_size
        self.save_settings(backbone=self.backbone, eps=eps, self_conditioning_p=self_conditioning_p,
                           encoder_loss_weight=encoder_loss_weight, freeze_router=freeze_router,
                           loss_chunk_size=loss_chunk_size, generation=self.generation)
        self._widest: tuple[torch.Tensor | None, int] = (None, 0)

    # ------------------------------------------------------------------ model
    def build_model(self) -> BlockDiffusionGemma:
        backbone = self.backbone
        config = None
        if backbone.model_config is not None:
            config = copy.deepcopy(dict(backbone.model_config))
            text = config.setdefault("text_config", {})
            text.setdefault("vocab_size", self.vocab_size)
            text.setdefault("pad_token_id", self.pad_token_id)
            text.setdefault("eos_token_id", self.eos_token_id)
        hf = load_diffusion_gemma(
            backbone.model, config, torch_dtype=backbone.torch_dtype, attn_implementation=backbone.attn_implementation
        )
        model = BlockDiffusionGemma(hf, chunk_size=self.loss_chunk_size)
        if model.vocab_size < self.vocab_size:
            raise ValueError(
                f"The model's vocabulary ({model.vocab_size}) is smaller than the tokenizer's ({self.vocab_size}): use "
                "the tokenizer that matches the model."
            )
        model.freeze_vision()
        if self.freeze_router:
            model.freeze_router()
        return model

    def required_collation(self) -> dict[str, Any]:
        """Whole canvases, attended: each response window padded to a multiple of ``canvas_length`` (the built model's,
        else the one ``backbone`` names, read without building it)."""
        canvas_length = (self.model.canvas_length if self.model is not None
                         else canvas_length_of(self.backbone.model, self.backbone.model_config))
        return {} if canvas_length is None else {"pad_block_size": canvas_length, "response_window": True}

    def packing_problem(self, fill_block_size: int | None) -> str | None:
        """Each row is one example's response laid out as canvases after its prompt's KV cache: a row holds one
        example."""
        return ("its rows are one example each (a prompt's causal pass, then canvases of its response window), so "
                "examples cannot share a row; set collation.pack: false")

    @property
    def canvas_length(self) -> int:
        return self.model.canvas_length

    # ------------------------------------------------------------------ training step
    def prepare_batch(self, batch: dict, keys: torch.Tensor) -> dict:
        """Noise, then :meth:`canvas_inputs`."""
        noisy, _, _ = corrupt_uniform_random(batch["input_ids"], batch["loss_mask"], self.model.vocab_size, None,
                                             self.eps, keys=keys)
        return self.canvas_inputs(batch, noisy, keys)

    def canvas_inputs(self, batch: dict, noisy: torch.Tensor, keys: torch.Tensor | None = None) -> dict:
        """The response window of ``noisy`` (the batch's ``input_ids`` with some supervised tokens replaced) as the
        canvas, its masks, and (training, drawn from ``keys``) the coins; ``loss_index`` ``[B, K]`` holds the canvas
        offsets that can carry the loss (training: the scored block, K = ``canvas_length``; evaluation: all, K = the
        window width), and ``targets``, ``scored`` (supervised) and ``real`` are ``[B, K]`` at those offsets. No
        device-to-host transfer for a batch that :meth:`transfer_batch_to_device` moved (it read the window width on
        the CPU), one for any other (:meth:`_window_width`)."""
        ids = batch["input_ids"]
        length = ids.shape[1]
        block = self.canvas_length
        prefix, lengths = response_windows(batch)
        widest_ids, width = self._widest
        if widest_ids is not ids:
            width = self._window_width(prefix, lengths)
            self._widest = (ids, width)
        offsets = torch.arange(width, device=ids.device)
        positions = (prefix[:, None] + offsets).clamp_max(length - 1)
        index = self._loss_index(lengths, offsets, keys)
        at_loss = positions.gather(1, index)
        scored = batch["loss_mask"].bool().gather(1, at_loss) & (index < lengths[:, None])
        window = self.model.text_config.sliding_window
        if self.model.flex_attention:  # block-sparse masks: fully masked tiles are skipped
            encoder_masks = encoder_block_masks(batch["attention_mask"], window)
            decoder_mask = block_diffusion_block_mask
        else:
            dtype = self._mask_dtype(ids.device.type)
            encoder_masks = encoder_attention_masks(batch["attention_mask"], window, dtype)
            decoder_mask = functools.partial(block_diffusion_batch_mask, dtype=dtype)
        prepared = {
            "encoder_masks": encoder_masks,
            "canvas_ids": noisy.gather(1, positions),
            "decoder_masks": {  # windows inside the sequence by construction: no value check (a device wait)
                "full_attention": decoder_mask(prefix, lengths, width, length, block, check_values=False),
                "sliding_attention": decoder_mask(prefix, lengths, width, length, block, sliding_window=window,
                                                  check_values=False),
            },
            "decoder_positions": positions,
            "loss_index": index,
            "targets": ids.gather(1, at_loss),
            "scored": scored,
            "real": real_tokens(batch).gather(1, at_loss) & scored,
        }
        if self.training:
            prepared["coins"] = keyed_uniform(keys, Stream.SELF_CONDITIONING) < self.self_conditioning_p
            if self.encoder_loss_weight > 0:
                prepared["ar_targets"], prepared["ar_scored"] = shifted_targets(ids, batch["attention_mask"])
        return prepared

    def _loss_index(self, lengths: torch.Tensor, offsets: torch.Tensor, keys: torch.Tensor | None) -> torch.Tensor:
        """``[B, K]`` canvas offsets that can carry the loss: in training one whole canvas block per example, drawn
        from ``keys``; in evaluation all ``offsets``."""
        if not self.training:
            return offsets.expand(len(lengths), -1)
        block = self.canvas_length
        chosen = (keyed_uniform(keys, Stream.CANVAS_BLOCK) * (lengths // block)).long()
        return chosen[:, None] * block + offsets[:block]

    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        """Lightning's transfer, after reading the widest response window of a batch still on the CPU (checked as
        :meth:`canvas_inputs` would check it). The step then never waits for the device: a wait there would leave it
        idle while the host launches the micro-batch's work. Prediction (answers only) reads no window."""
        width, trainer = None, self.attached_trainer
        scored = isinstance(batch, dict) and WINDOW_KEYS <= batch.keys() and not (trainer and trainer.predicting)
        if scored and batch["input_ids"].device.type == "cpu":
            width = self._window_width(*response_windows(batch))
        moved = super().transfer_batch_to_device(batch, device, dataloader_idx)
        if width is not None:
            self._widest = (moved["input_ids"], width)  # for canvas_inputs and training_flops of this batch
        return moved

    def _window_width(self, prefix: torch.Tensor, lengths: torch.Tensor) -> int:
        """The widest response window, checked (whole canvases, none empty); one device-to-host transfer when
        ``lengths`` is on the device."""
        block = self.canvas_length
        uneven, empty, width = torch.stack([(lengths % block).amax(), (lengths == 0).any(), lengths.amax()]).tolist()
        if uneven:
            row = int((lengths % block).nonzero()[0, 0])
            raise ValueError(
                f"Row {row}'s response window holds {int(lengths[row])} tokens, not a multiple of canvas_length="
                f"{block}: collate with pad_block_size={block} and response_window=True (data.init_args.collation: "
                f"{{pad_block_size: {block}, response_window: true}})."
            )
        if empty:
            row = int((lengths == 0).nonzero()[0, 0])
            raise ValueError(
                f"Row {row} has no response in its {int(prefix[row])} tokens (the prompt fills the sequence or "
                "nothing is supervised): raise data.init_args.max_seq_len, or use data.init_args.formatting.overlong: "
                "truncate_prompt."
            )
        return width

    def _mask_dtype(self, device: str) -> torch.dtype:
        """Dense additive masks in the attention's compute dtype (autocast's, else the parameters')."""
        if torch.is_autocast_enabled(device):
            return torch.get_autocast_dtype(device)
        return next(self.model.parameters()).dtype

    def token_counts(self, batch: dict, prepared: dict) -> dict[str, torch.Tensor]:
        counts = {"diffusion": prepared["scored"].sum()}
        if "ar_scored" in prepared:
            counts["ar"] = prepared["ar_scored"].sum()
        return counts

    def token_sums(self, batch: dict, prepared: dict) -> dict[str, torch.Tensor]:
        return {**super().token_sums(batch, prepared), "canvas_tokens": prepared["scored"].sum()}

    def compute_loss(self, batch: dict, prepared: dict, denominators: dict[str, torch.Tensor]) -> StepLoss:
        """Both losses' denominators (and the AR weight) go into the rows' weights, so one LM-head call forms the tied
        head's gradient once for both."""
        scored = prepared["scored"].float()
        weights, ar_weights = scored / denominators["diffusion"], None
        if "ar_scored" in prepared:
            ar_weights = prepared["ar_scored"].float() * (self.encoder_loss_weight / denominators["ar"])
        scores = self.model(
            batch["input_ids"], prepared["encoder_masks"], prepared["canvas_ids"], prepared["decoder_masks"],
            prepared["decoder_positions"], prepared["loss_index"], prepared["targets"], weights,
            prepared.get("coins"), prepared.get("ar_targets"), ar_weights,
        )
        diffusion, extra = (scores.nll * weights.flatten()).sum(), {}
        if scores.ar_nll is not None:
            extra["ar_loss"] = (scores.ar_nll * prepared["ar_scored"].flatten()).sum() / denominators["ar"]
        real = prepared["real"].flatten()
        return StepLoss(DLLMLossOutput(scores.loss, diffusion), (scores.correct & real).sum(), real.sum(), extra)

    # ------------------------------------------------------------------ generation
    def generate_ids(self, prompts: list[torch.Tensor], max_new_tokens: int | None = None,
                     trace: DenoisingTrace | None = None) -> list[torch.Tensor]:
        """Answers (cut before the first eos) from transformers' ``generate``, prompts of one length per call (no
        padding, so positions match training), with a fixed seed for the random initial canvases; each canvas's
        denoising recorded into ``trace`` when one is given (:class:`~lit_dllm.families.diffusion_gemma.trace.
        DraftRecorder`)."""
        generation = self.generation
        length = max_new_tokens or generation.gen_length or DEFAULT_GEN_LENGTH
        self.check_whole_model("Generation with transformers' DiffusionGemma generate")
        settings: dict[str, Any] = {"max_new_tokens": length, "eos_token_id": self.eos_token_id,
                                    "pad_token_id": self.pad_token_id}
        if generation.gen_steps is not None:
            settings["max_denoising_steps"] = generation.gen_steps
        if generation.temperature > 0:
            settings["temperature"] = generation.temperature
        answers: list[torch.Tensor | None] = [None] * len(prompts)
        groups: dict[int, list[int]] = {}
        for row, prompt in enumerate(prompts):
            groups.setdefault(len(prompt), []).append(row)
        devices = [self.device] if self.device.type == "cuda" else []
        with self.generating(), torch.random.fork_rng(devices=devices):
            torch.manual_seed(self.noise_seed)
            for rows in groups.values():
                ids = torch.stack([prompts[row] for row in rows]).to(self.device)
                streamer = DraftRecorder(trace, rows) if trace is not None else None
                out = self.model.hf.generate(ids, return_dict_in_generate=False, streamer=streamer, **settings)
                for row, answer in zip(rows, cut_rows_at_eos(out[:, ids.shape[1]:], self.eos_token_id)):
                    answers[row] = answer
        return answers

    # ------------------------------------------------------------------ throughput
    def training_flops(self, batch: dict) -> float:
        """Model FLOPs of one training micro-batch (``B`` rows of ``S`` tokens, response windows ``W`` wide at most):
        the shared stack (its matmul parameters ``N``, experts scaled by top-k / experts) runs the encoder over the
        ``B·S`` tokens with gradients (6·N per token, plus the LM head of the encoder loss), then the decoder over the
        ``B·W`` canvas tokens twice: without gradients for the self-conditioning logits (2·N and the head), then
        with them (6·N), the diffusion loss's head at the ``B·canvas_length`` scored tokens. Attention is counted
        over every key (S for the encoder, S + W for the decoder; sliding windows are not discounted). ``W`` is the
        one :meth:`transfer_batch_to_device` or :meth:`canvas_inputs` found for this batch (no device sync), else it is
        read from the batch."""
        rows, length = batch["input_ids"].shape
        prepared_ids, width = self._widest
        if prepared_ids is not batch["input_ids"]:
            width = int(response_windows(batch)[1].max())
        config, hf = self.model.text_config, self.model.hf
        stack = sum(matmul_params(hf.model.decoder, expert_share(config)))
        head = hf.get_output_embeddings().weight.numel()
        encoder_head = 6 * head if self.encoder_loss_weight > 0 else 0
        encoder = length * (6 * stack + encoder_head + 3 * attention_flops(config, length))
        decoder = width * (8 * stack + 2 * head + 4 * attention_flops(config, length + width))
        return rows * (encoder + decoder + 6 * head * self.canvas_length)

    # ------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def loglikelihood_bound(self, context: list[int], continuation: list[int], seed: int, *, samples: int,
                            batch_size: int) -> float:
        """A Monte-Carlo lower bound on ``log p(continuation | context)`` under block diffusion.

        The continuation is cut into canvas blocks of ``canvas_length`` tokens, the last one completed with the
        collator's fill (eos, else pad) as in training and validation. Block diffusion factorises ``log p(x) =
        Σ_b log p(x_b | context, x_<b)``, and each block is bounded by the continuous-time ELBO of its uniform-token
        noise (:func:`~lit_dllm.families.diffusion_gemma.likelihood.uniform_diffusion_nelbo`): ``log p(x_b | ·) ≥
        −∫_0^1 E_{z_t} Σ_{i∈b} f_i dt``. One forward scores every block of a draw, as validation does: the encoder runs
        over the clean context and continuation, each noised canvas block attends to the clean tokens before it (the
        block-causal masks) and to itself, with a zero self-conditioning signal; the denoiser ``x_θ`` is the softmax
        of the decoder's logits. Each of ``samples`` draws takes its own ``t ~ U(eps, 1)`` per block (``eps``: the
        minimum noise level); the result is minus the mean of the draws
        (:func:`~lit_dllm.families.diffusion_gemma.likelihood.block_diffusion_nelbo`), its standard error shrinking as
        ``1/sqrt(samples)``, though a draw is heavy-tailed (a token redrawn at a small ``t`` weighs about ``1/t``).
        The draws are seeded with ``seed``, so the number depends on neither the batch size nor other requests (up to
        float rounding).

        Two departures from a strict bound: the integral starts at ``eps``, as training's noise does (the left-out
        part is ≥ 0, about ``eps·log(V/eps)`` nats a token: 0.012 for a uniform denoiser at V = 96, eps = 1e-3), and
        the fill of the last block is noised with it but not scored (only real tokens count; scoring the fill too
        would bound ``log p(x, fill) ≤ log p(x)`` instead).
        """
        n = len(continuation)
        if n == 0:
            return 0.0
        block = self.canvas_length
        width = -(-n // block) * block
        self.check_positions(len(context), width)
        fill = self.eos_token_id if self.eos_token_id is not None else self.pad_token_id
        answer = torch.tensor(continuation + [fill] * (width - n))
        clean = torch.tensor(context + answer.tolist(), device=self.device)
        supervised = torch.arange(len(clean), device=self.device) >= len(context)

        def nelbo(canvases: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
            rows, canvases, t = len(canvases), canvases.to(self.device), t.to(self.device)
            batch = {"input_ids": clean.expand(rows, -1), "loss_mask": supervised.expand(rows, -1),
                     "attention_mask": torch.ones_like(clean).expand(rows, -1)}
            prepared = self.canvas_inputs(batch, torch.cat([clean[: len(context)].expand(rows, -1), canvases], 1))
            hidden, _ = self.model.denoise(batch["input_ids"], prepared["encoder_masks"], prepared["canvas_ids"],
                                           prepared["decoder_masks"], prepared["decoder_positions"])
            spans = [slice(start, min(start + block, n)) for start in range(0, n, block)]  # V-wide logits per block
            return torch.cat([uniform_diffusion_nelbo(self.model.logits(hidden[:, span]), canvases[:, span],
                                                      clean[len(context) :][span], t[:, span]) for span in spans], 1)

        draws = block_diffusion_nelbo(nelbo, answer, n, block, self.model.vocab_size, self.eps, samples, batch_size, seed)
        return float(-draws.mean())

    tiny_config = "configs/gemma_tiny.yaml"


WINDOW_KEYS = {"input_ids", "loss_mask", "attention_mask"}
"""The batch entries :func:`response_windows` reads."""


def response_windows(batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, where the response window starts (the first supervised token; the row's length if none) and how many
    attended tokens it holds."""
    supervised, length = batch["loss_mask"].bool(), batch["input_ids"].shape[1]
    prefix = torch.where(supervised.any(1), supervised.int().argmax(1), length)
    return prefix, (batch["attention_mask"].sum(1) - prefix).clamp_min(0)
