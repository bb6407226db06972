"""What every family reads from a collated batch (:class:`~lit_dllm.data.collate.DLLMCollator`'s rows): the example's
own tokens, next-token targets, and the prompt / answer split of prompt-response rows; and where a generated answer
ends (:func:`cut_at_eos`, for every sampler and family)."""

from __future__ import annotations

import torch

__all__ = ["cut_at_eos", "cut_rows_at_eos", "document_inputs", "is_packed", "real_tokens", "shifted_targets", "split_prompt_answer"]


def is_packed(batch: dict) -> bool:
    """Whether ``batch`` holds packed rows (:class:`~lit_dllm.data.packing.PackedCollator`'s), documents side by side."""
    return "document_ids" in batch


def real_tokens(batch: dict) -> torch.Tensor:
    """``[B, L]`` bool: the example's own tokens (``input_lengths``), not the collator's padding or block fill; in
    packed rows, each document's own tokens."""
    if "input_lengths" not in batch:  # a batch of another collator: its attention mask, else every token
        return batch["attention_mask"].bool() if "attention_mask" in batch else torch.ones_like(batch["input_ids"]).bool()
    if is_packed(batch):
        documents = batch["document_ids"]
        lengths = batch["input_lengths"][documents.clamp(min=0)]
        return (documents >= 0) & (batch["position_ids"] < lengths)
    ids = batch["input_ids"]
    return torch.arange(ids.shape[1], device=ids.device)[None, :] < batch["input_lengths"][:, None]


def shifted_targets(ids: torch.Tensor, mask: torch.Tensor, document_ids: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token targets and positions: position ``i`` predicts ``ids[i+1]`` where ``mask[i+1]`` (and, in packed
    rows, where ``i+1`` is in the same document as ``i``)."""
    targets = torch.cat([ids[:, 1:], ids[:, -1:]], dim=1)
    positions = torch.cat([mask[:, 1:].bool(), torch.zeros_like(mask[:, :1], dtype=torch.bool)], dim=1)
    if document_ids is not None:
        positions[:, :-1] &= document_ids[:, 1:] == document_ids[:, :-1]
    return targets, positions


def document_inputs(batch: dict) -> dict:
    """What a model needs besides the ids to keep the documents of packed rows apart (``document_ids``,
    ``position_ids``); nothing for unpacked rows."""
    if not is_packed(batch):
        return {}
    return {"document_ids": batch["document_ids"], "position_ids": batch["position_ids"]}


def split_prompt_answer(batch: dict, eos_token_id: int | None = None
                        ) -> tuple[list[int], list[torch.Tensor], list[torch.Tensor]]:
    """Row numbers, prompts (unsupervised prefix) and reference answers (supervised content up to ``input_lengths``,
    so without the collator's fill; cut before the first ``eos_token_id`` when given, as generated answers are),
    on the CPU: one copy of the batch, cut as Python lists (cheaper than tensor operations per row).

    Rows with no prompt or no supervised token (plain-text data) are skipped; the row numbers say which were kept.
    """
    rows, prompts, answers = [], [], []
    ids, supervised = batch["input_ids"].cpu(), batch["loss_mask"].cpu().bool()
    first = torch.where(supervised.any(1), supervised.float().argmax(1), 0).tolist()
    for row, (tokens, start, end) in enumerate(zip(ids.tolist(), first, batch["input_lengths"].tolist())):
        if start == 0 or end <= start:
            continue
        rows.append(row)
        prompts.append(torch.tensor(tokens[:start], dtype=ids.dtype))
        answer = tokens[start:end]
        if eos_token_id in answer:  # what follows (a chat template's newline) is not part of the answer
            answer = answer[: answer.index(eos_token_id)]
        answers.append(torch.tensor(answer, dtype=ids.dtype))
    return rows, prompts, answers


def cut_at_eos(tokens: torch.Tensor, eos_token_id: int | None) -> torch.Tensor:
    """A generated 1-D answer up to (without) its first ``eos_token_id``, on the CPU; all of it without one (or with
    None)."""
    return cut_rows_at_eos(tokens[None], eos_token_id)[0]


def cut_rows_at_eos(tokens: torch.Tensor, eos_token_id: int | None) -> list[torch.Tensor]:
    """Each row of ``tokens`` ``[B, G]`` cut as :func:`cut_at_eos` does, on the CPU (where answers are decoded): one
    copy of the batch, not a device sync per row."""
    tokens = tokens.cpu()
    if eos_token_id is None:
        return list(tokens)
    hit = tokens == eos_token_id
    ends = torch.where(hit.any(1), hit.int().argmax(1), tokens.shape[1]).tolist()
    return [row[:end] for row, end in zip(tokens, ends)]
