"""Speculative decoding with a DFlash draft (:class:`SpeculativeDecoding`, a mixin of
:class:`~lit_dllm.families.dflash.module.DFlashModule`): the target's own greedy answers, lossless speculative decoding
by transformers (``target.generate(assistant_model=draft, speculation_type="dflash")``), the answers that generation
and lm-eval ask for, and validation's decodes of each prompt (acceptance length τ, greedy identity, exact match)."""

from __future__ import annotations

import contextlib
from typing import Any, NamedTuple

import torch

from lit_dllm.core.generation import DEFAULT_GEN_LENGTH
from lit_dllm.data.batch import cut_at_eos, split_prompt_answer
from lit_dllm.families.dflash.acceptance import AcceptanceCounter, Decoded, acceptance_figure


class PromptScore(NamedTuple):
    """Validation's decodes of one prompt: tokens committed per verification greedy and sampled (empty when not
    sampled), whether greedy equals the target's own greedy answer, and its exact-match score."""

    greedy: list[int]
    identical: bool
    exact: float
    sampled: list[int]


class SpeculativeDecoding:
    """Decoding with the host module's ``model.target`` and ``model.draft`` (its ``generation`` settings, tokenizer,
    ``noise_seed`` and validation metrics)."""

    def score_generation(self, batch: dict, batch_idx: int, stage: str) -> None:
        """Each prompt decoded by the target alone and speculatively with the draft: ``accept_len`` (τ, greedy and at
        ``val_temperature``), ``greedy_identical`` and ``exact_match``."""
        generation, metrics = self.generation, self.eval_metrics[stage]
        _, prompts, answers = split_prompt_answer(batch, self.eos_token_id)
        if not prompts:
            return
        length = generation.gen_length or max(len(a) for a in answers) + 1
        greedy_steps = []
        for prompt, answer in zip(prompts, answers):
            scored = self.score_prompt(prompt, answer, length, generation.val_temperature)
            metrics["greedy_identical"].update(float(scored.identical))
            metrics["exact_match"].update(scored.exact)
            greedy_steps += scored.greedy
            for name, steps in (("accept_len", scored.greedy), ("accept_len_sampled", scored.sampled)):
                if steps:
                    metrics[name].update(sum(steps) / len(steps), weight=len(steps))
        if generation.val_trace and self.draws_pictures(batch_idx) and greedy_steps:
            self.logger.experiment.add_histogram(f"{stage}/accepted_lengths", torch.tensor(greedy_steps),
                                                 global_step=self.global_step)
            self.add_figure(f"{stage}/acceptance", acceptance_figure(
                greedy_steps, self.block_size, f"step {self.global_step}: {len(prompts)} greedy decodings"))
        sampled = ["accept_len_sampled"] if generation.val_temperature else []
        names = ["accept_len", "greedy_identical", "exact_match"] + sampled
        for name in names:
            self.log(f"{stage}/{name}", metrics[name], prog_bar=name == "accept_len")

    def score_prompt(self, prompt: torch.Tensor, answer: torch.Tensor, length: int,
                     temperature: float) -> PromptScore:
        """Validation's decodes of one prompt (``length`` new tokens): speculative greedy, compared with the target's
        own greedy answer and scored against ``answer`` (the reference tokens, eos removed); at ``temperature`` > 0
        also a sampled speculative decode."""
        eos, decode = self.eos_token_id, self.tokenizer.decode
        greedy = self.speculative_decode(prompt, length, temperature=0.0)
        identical = torch.equal(self.target_generate(prompt, length), greedy.tokens)
        exact = self.score_answer(decode(cut_at_eos(greedy.tokens, eos), skip_special_tokens=True),
                                  decode(answer, skip_special_tokens=True))
        sampled = self.speculative_decode(prompt, length, temperature).accepted if temperature > 0 else []
        return PromptScore(greedy.accepted, identical, exact, sampled)

    def _generate_settings(self, max_new_tokens: int, temperature: float) -> dict[str, Any]:
        settings: dict[str, Any] = {"max_new_tokens": max_new_tokens, "eos_token_id": self.eos_token_id,
                                    "pad_token_id": self.pad_token_id}
        if temperature > 0:
            settings.update(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
        else:
            settings["do_sample"] = False
        return settings

    def target_generate(self, prompt: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
        """The target's own greedy continuation of the 1-D ``prompt`` (new tokens only, up to and with eos)."""
        if self.model is None:
            self.configure_model()
        self.check_whole_model("Decoding with the target and draft")
        ids = prompt.to(self.device)[None]
        with self.generating(), torch.no_grad():
            out = self.model.target.generate(ids, attention_mask=torch.ones_like(ids),
                                              **self._generate_settings(max_new_tokens, 0.0))
        return out[0, ids.shape[1]:]

    def speculative_decode(self, prompt: torch.Tensor, max_new_tokens: int, temperature: float = 0.0) -> Decoded:
        """Lossless speculative decoding of the 1-D ``prompt`` by transformers: ``target.generate(assistant_model=
        draft, speculation_type="dflash")`` (greedy at ``temperature`` 0, else speculative sampling), with the tokens
        committed per verification step. Sampling draws from a generator forked off the global one and seeded by
        ``noise_seed``, so validation never moves the training's random state."""
        if self.model is None:
            self.configure_model()
        self.check_whole_model("Speculative decoding")
        ids = prompt.to(self.device)[None]
        counter = AcceptanceCounter()
        devices = [self.device] if self.device.type == "cuda" else []
        with self.generating(), torch.no_grad(), torch.random.fork_rng(devices=devices), self._matching_dtypes():
            torch.manual_seed(self.noise_seed)
            out = self.model.target.generate(
                ids, attention_mask=torch.ones_like(ids), assistant_model=self.model.draft,
                speculation_type="dflash", streamer=counter, **self._generate_settings(max_new_tokens, temperature),
            )
        return Decoded(out[0, ids.shape[1]:], counter.accepted)

    def _matching_dtypes(self):
        """Autocast to the target's dtype when the draft's weights differ (e.g. a bf16 target, fp32 draft weights):
        transformers' generator feeds the target's embeddings to the draft and the draft's outputs to its head."""
        target = next(self.model.target.parameters()).dtype
        if target == next(self.model.draft.parameters()).dtype:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=target)

    def decode_answers(self, prompts: list[torch.Tensor], max_new_tokens: int | None = None) -> list[Decoded]:
        """Speculative decodings of ``prompts`` (one at a time: transformers' assisted decoding takes batch 1), their
        tokens cut before the first eos, with the tokens committed per verification; greedy unless ``temperature``
        > 0."""
        generation = self.generation
        length = max_new_tokens or generation.gen_length or DEFAULT_GEN_LENGTH
        decoded = [self.speculative_decode(p, length, generation.temperature) for p in prompts]
        return [Decoded(cut_at_eos(d.tokens, self.eos_token_id), d.accepted) for d in decoded]

    def generate_ids(self, prompts: list[torch.Tensor], max_new_tokens: int | None = None) -> list[torch.Tensor]:
        """The answers of :meth:`decode_answers`."""
        return [d.tokens for d in self.decode_answers(prompts, max_new_tokens)]
