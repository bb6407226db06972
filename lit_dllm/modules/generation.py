"""Generation for MDLM-style modules: ``generate(prompts)``, ``predict_step`` and exact-match validation."""

from __future__ import annotations

import torch
from lightning.pytorch.loggers import TensorBoardLogger
from torchmetrics import MeanMetric

from lit_dllm.data.formats import encode_prompt
from lit_dllm.sampling.llada import llada_generate


def split_prompt_answer(batch: dict) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Prompts (unsupervised prefix) and reference answers (supervised content, EOS fill excluded).

    Rows with no prompt or no supervised token (plain-text data) are skipped.
    """
    prompts, answers = [], []
    supervised = batch["loss_mask"].bool()
    first = torch.where(supervised.any(1), supervised.float().argmax(1), torch.zeros_like(supervised[:, 0], dtype=torch.long))
    for row in range(len(first)):
        start, end = int(first[row]), int(batch["input_lengths"][row])
        if start == 0 or end <= start:
            continue
        prompts.append(batch["input_ids"][row, :start])
        answers.append(batch["input_ids"][row, start:end])
    return prompts, answers


class GenerationMixin:
    """LLaDA sampling on top of a module whose ``self.model(ids)`` returns logits.

    Hyper-parameters read: ``gen_length`` (None: the reference answer length, rounded up to a block),
    ``gen_steps`` (None: one token per step), ``gen_block_length`` (None: the whole answer as one
    block), ``remasking``, ``temperature``, ``val_generate_batches`` (validation / test batches per
    pass whose prompts are answered and scored by exact match; 0 disables).
    """

    def stage_metrics(self):
        metrics = super().stage_metrics()
        metrics["exact_match"] = MeanMetric()
        return metrics

    def generate_ids(self, prompts: list[torch.Tensor], max_new_tokens: int | None = None) -> list[torch.Tensor]:
        hp = self.hparams
        length = max_new_tokens or hp.gen_length or 64
        block = hp.gen_block_length or length
        length = -(-length // block) * block
        steps = hp.gen_steps or length
        steps = -(-steps // (length // block)) * (length // block)
        was_training = self.training
        self.eval()
        try:
            return llada_generate(
                self.model,
                [p.to(self.device) for p in prompts],
                mask_token_id=hp.mask_token_id,
                pad_token_id=hp.pad_token_id,
                eos_token_id=hp.eos_token_id,
                gen_length=length,
                steps=steps,
                block_length=block,
                remasking=hp.remasking,
                temperature=hp.temperature,
            )
        finally:
            self.train(was_training)

    def generate(self, prompts: list[str], max_new_tokens: int | None = None) -> list[str]:
        """Answer each text prompt (the prompt is tokenised as the data module formats it)."""
        tok = self.tokenizer
        ids = [torch.tensor(encode_prompt(tok, p)) for p in prompts]
        return [tok.decode(a, skip_special_tokens=True) for a in self.generate_ids(ids, max_new_tokens)]

    def answer_batch(self, batch: dict) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
        """Prompts, reference answers (EOS removed) and generated answers for a batch's prompt rows."""
        prompts, answers = split_prompt_answer(batch)
        if not prompts:
            return [], [], []
        eos = self.hparams.eos_token_id
        answers = [a[a != eos] if eos is not None else a for a in answers]
        outputs = self.generate_ids(prompts, self.hparams.gen_length or max(len(a) for a in answers) + 1)
        return prompts, answers, outputs

    def decoded(self, prompts, answers, outputs) -> list[dict]:
        decode = self.tokenizer.decode
        return [
            {"prompt": decode(p), "generated": decode(o, skip_special_tokens=True), "reference": decode(a, skip_special_tokens=True)}
            for p, a, o in zip(prompts, answers, outputs)
        ]

    def predict_step(self, batch: dict, batch_idx: int) -> list[dict]:
        return self.decoded(*self.answer_batch(batch))

    def evaluate(self, batch: dict, batch_idx: int, stage: str) -> None:
        super().evaluate(batch, batch_idx, stage)
        if batch_idx >= self.hparams.val_generate_batches:
            return
        prompts, answers, outputs = self.answer_batch(batch)
        if not prompts:
            return
        hits = torch.tensor([torch.equal(o.cpu(), a.cpu()) for o, a in zip(outputs, answers)], dtype=torch.float)
        exact_match = self.eval_metrics[stage]["exact_match"]
        exact_match.update(hits.mean().to(self.device), weight=len(hits))
        self.log(f"{stage}/exact_match", exact_match, prog_bar=True)
        if batch_idx == 0 and isinstance(self.logger, TensorBoardLogger) and not self.trainer.sanity_checking:
            rows = [f"| `{r['prompt']}` | `{r['generated']}` | `{r['reference']}` |" for r in self.decoded(prompts[:4], answers[:4], outputs[:4])]
            table = "| prompt | generated | reference |\n|---|---|---|\n" + "\n".join(rows)
            self.logger.experiment.add_text(f"{stage}/samples", table, global_step=self.global_step)
