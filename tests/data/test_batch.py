"""Tests for lit_dllm.data.batch: hand-derived layouts of the batch helpers every family shares."""

from __future__ import annotations

import torch

from lit_dllm.data.batch import cut_at_eos, real_tokens, shifted_targets, split_prompt_answer

EOS = 9


def test_cut_at_eos_keeps_what_comes_before_the_first_eos():
    assert cut_at_eos(torch.tensor([4, 5, EOS, 6, EOS]), EOS).tolist() == [4, 5]
    assert cut_at_eos(torch.tensor([EOS, 4]), EOS).tolist() == []
    assert cut_at_eos(torch.tensor([4, 5]), EOS).tolist() == [4, 5]  # no eos: the whole answer
    assert cut_at_eos(torch.tensor([4, EOS]), None).tolist() == [4, EOS]  # no eos id: nothing is cut


def test_real_tokens_and_shifted_targets():
    batch = {"input_ids": torch.tensor([[1, 2, 3, 0], [4, 5, 0, 0]]), "input_lengths": torch.tensor([3, 2])}
    assert real_tokens(batch).tolist() == [[True, True, True, False], [True, True, False, False]]
    assert real_tokens({"attention_mask": torch.tensor([[1, 0]])}).tolist() == [[True, False]]
    targets, positions = shifted_targets(batch["input_ids"], torch.tensor([[0, 1, 1, 0], [1, 1, 1, 1]]))
    assert targets.tolist() == [[2, 3, 0, 0], [5, 0, 0, 0]]
    assert positions.tolist() == [[True, True, False, False], [True, True, True, False]]


def test_split_prompt_answer_skips_rows_without_a_prompt_and_cuts_at_eos_when_asked():
    batch = {
        "input_ids": torch.tensor([[1, 2, 3, EOS, EOS], [4, 5, 6, 7, 0], [8, 8, 8, 0, 0]]),
        "loss_mask": torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 0], [0, 0, 0, 0, 0]]),
        "input_lengths": torch.tensor([4, 4, 3]),  # row 0's last eos is the collator's fill
    }
    rows, prompts, answers = split_prompt_answer(batch)
    assert rows == [0] and prompts[0].tolist() == [1, 2] and answers[0].tolist() == [3, EOS]
    assert split_prompt_answer(batch, EOS)[2][0].tolist() == [3]
    # a chat template's turn ends "<eos>\n": the newline after eos is no part of the answer, as in generation
    batch["input_lengths"] = torch.tensor([5, 4, 3])
    batch["input_ids"][0, 4] = 9
    assert split_prompt_answer(batch)[2][0].tolist() == [3, EOS, 9]
    assert split_prompt_answer(batch, EOS)[2][0].tolist() == [3]
