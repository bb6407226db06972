"""What every family reads from a collated batch (:class:`~lit_dllm.data.collate.DLLMCollator`'s rows): the example's
own tokens, next-token targets, and the prompt / answer split of prompt-response rows."""

from __future__ import annotations

import torch

__all__ = ["real_tokens", "shifted_targets", "split_prompt_answer"]


def real_tokens(batch: dict) -> torch.Tensor:
    """``[B, L]`` bool: the example's own tokens (``input_lengths``), not the collator's padding or block fill."""
    if "input_lengths" not in batch:
        return batch["attention_mask"].bool()
    ids = batch["input_ids"]
    return torch.arange(ids.shape[1], device=ids.device)[None, :] < batch["input_lengths"][:, None]


def shifted_targets(ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token targets and positions: position ``i`` predicts ``ids[i+1]`` where ``mask[i+1]``."""
    targets = torch.cat([ids[:, 1:], ids[:, -1:]], dim=1)
    positions = torch.cat([mask[:, 1:].bool(), torch.zeros_like(mask[:, :1], dtype=torch.bool)], dim=1)
    return targets, positions


def split_prompt_answer(batch: dict) -> tuple[list[int], list[torch.Tensor], list[torch.Tensor]]:
    """Row numbers, prompts (unsupervised prefix) and reference answers (supervised content, EOS fill excluded).

    Rows with no prompt or no supervised token (plain-text data) are skipped; the row numbers say which were kept.
    """
    rows, prompts, answers = [], [], []
    supervised = batch["loss_mask"].bool()
    first = torch.where(supervised.any(1), supervised.float().argmax(1), torch.zeros_like(supervised[:, 0], dtype=torch.long))
    for row in range(len(first)):
        start, end = int(first[row]), int(batch["input_lengths"][row])
        if start == 0 or end <= start:
            continue
        rows.append(row)
        prompts.append(batch["input_ids"][row, :start])
        answers.append(batch["input_ids"][row, start:end])
    return rows, prompts, answers
