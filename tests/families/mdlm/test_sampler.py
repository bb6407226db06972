"""The LLaDA sampler with an oracle denoiser: exact schedules, block order, EOS stop, batching."""

import pytest
import torch

from lit_dllm.families.mdlm import sampler
from lit_dllm.families.mdlm.sampler import StepDraws, llada_generate, transfer_schedule
from lit_dllm.noise.keys import example_keys

MASK, PAD, EOS, V = 9, 0, 1, 10


def oracle(answers, prompt_lengths, calls):
    """Logits that put all mass on the answer token at each canvas position (EOS after the answer)."""

    def logits_fn(x):
        calls.append(x.clone())
        out = torch.full((*x.shape, V), -10.0)
        for row, (answer, start) in enumerate(zip(answers, prompt_lengths)):
            for j in range(x.shape[1] - start):
                token = answer[j] if j < len(answer) else EOS
                out[row, start + j, token] = 10.0 - 0.1 * j  # earlier positions more confident
        return out

    return logits_fn


def test_transfer_schedule_splits_evenly_with_extras_first():
    assert transfer_schedule(torch.tensor([7, 4, 0]), 3).tolist() == [[3, 2, 2], [2, 1, 1], [0, 0, 0]]


@pytest.mark.parametrize("remasking", ["low_confidence", "random"])
def test_batched_prompts_of_different_lengths_get_their_answers(remasking):
    prompts = [torch.tensor([5, 6, 7]), torch.tensor([5])]
    answers = [[2, 3, 4, 5], [8, 8]]
    calls = []
    out = llada_generate(oracle(answers, [3, 1], calls), prompts, mask_token_id=MASK, pad_token_id=PAD,
                         eos_token_id=EOS, gen_length=8, steps=8, block_length=4, remasking=remasking,
                         generator=torch.Generator().manual_seed(0))
    assert [o.tolist() for o in out] == answers
    assert calls[0][0, :3].tolist() == [5, 6, 7] and calls[0][1, 0] == 5  # prompts kept, right padded
    assert (calls[0][1, 1:9] == MASK).all()


@pytest.mark.parametrize("canvas_multiple, width", [(None, 11), (1, 11), (8, 16), (11, 11)])
def test_rows_are_rounded_up_to_the_canvas_multiple_with_padding_after_the_canvas(canvas_multiple, width):
    """As the collator rounds training rows: the longest prompt (3) and the canvas (8) give 11 columns, padded after
    the canvas to the multiple; the answers are unchanged."""
    prompts, answers, calls = [torch.tensor([5, 6, 7]), torch.tensor([5])], [[2, 3, 4, 5], [8, 8]], []
    out = llada_generate(oracle(answers, [3, 1], calls), prompts, mask_token_id=MASK, pad_token_id=PAD,
                         eos_token_id=EOS, gen_length=8, steps=8, block_length=4, canvas_multiple=canvas_multiple)
    assert [o.tolist() for o in out] == answers
    assert {c.shape[1] for c in calls} == {width}
    assert calls[0][0, 3:11].eq(MASK).all() and calls[0][1, 1:9].eq(MASK).all()
    assert calls[0][:, 11:].eq(PAD).all() and calls[0][1, 9:11].eq(PAD).all()


def test_low_confidence_commits_the_most_confident_first_and_blocks_in_order():
    calls = []
    llada_generate(oracle([[2, 3, 4, 5]], [1], calls), [torch.tensor([7])], mask_token_id=MASK, pad_token_id=PAD,
                   eos_token_id=None, gen_length=4, steps=4, block_length=2)
    masked = [(c[0, 1:5] == MASK).tolist() for c in calls]
    assert masked == [[True] * 4, [False, True, True, True], [False, False, True, True], [False, False, False, True]]


def test_generation_stops_early_once_every_row_ended():
    calls = []
    out = llada_generate(oracle([[2]], [1], calls), [torch.tensor([7])], mask_token_id=MASK, pad_token_id=PAD,
                         eos_token_id=EOS, gen_length=8, steps=8, block_length=2)
    assert out[0].tolist() == [2]
    assert len(calls) == 2  # the first block decodes "2 <eos>"; the other three blocks need no forward


def test_a_rank_keeps_step_while_another_rank_still_decodes():
    """Sharded models need every rank in every forward: early exits happen only when ``everywhere`` agrees."""
    calls = []
    out = llada_generate(oracle([[2]], [1], calls), [torch.tensor([7])], mask_token_id=MASK, pad_token_id=PAD,
                         eos_token_id=EOS, gen_length=8, steps=8, block_length=2, everywhere=lambda flag: False)
    assert out[0].tolist() == [2]  # the same answer
    assert len(calls) == 8  # one forward per step, as the slowest rank needs


def test_temperature_sampling_is_seeded():
    uniform = lambda x: torch.zeros(*x.shape, V)  # noqa: E731
    run = lambda seed: llada_generate(uniform, [torch.tensor([7])], mask_token_id=MASK, pad_token_id=PAD,  # noqa: E731
                                      gen_length=6, steps=6, block_length=6, temperature=1.0,
                                      generator=torch.Generator().manual_seed(seed))[0]
    assert torch.equal(run(1), run(1)) and not torch.equal(run(1), run(2))


def test_bad_arguments_are_named():
    kwargs = dict(mask_token_id=MASK, pad_token_id=PAD)
    with pytest.raises(ValueError, match="remasking='greedy'"):
        llada_generate(lambda x: x, [torch.tensor([1])], remasking="greedy", **kwargs)
    with pytest.raises(ValueError, match="temperature=-1.0 must be >= 0"):
        llada_generate(lambda x: x, [torch.tensor([1])], temperature=-1.0, **kwargs)
    with pytest.raises(ValueError, match="gen_length=10 must be a positive multiple of block_length=4"):
        llada_generate(lambda x: x, [torch.tensor([1])], gen_length=10, block_length=4, **kwargs)
    with pytest.raises(ValueError, match="steps=3"):
        llada_generate(lambda x: x, [torch.tensor([1])], gen_length=8, block_length=4, steps=3, **kwargs)
    with pytest.raises(ValueError, match="canvas_multiple=0 must be a positive int.*pad_seq_len_divisible"):
        llada_generate(lambda x: x, [torch.tensor([1])], gen_length=4, block_length=4, canvas_multiple=0, **kwargs)


@pytest.mark.parametrize("remasking, temperature, keyed", [("low_confidence", 1.0, True), ("random", 0.7, True),
                                                           ("low_confidence", 0.0, False), ("random", 1.0, False)])
def test_tokens_and_scores_are_drawn_a_few_rows_at_a_time_with_the_same_result(monkeypatch, remasking, temperature,
                                                                               keyed):
    """A step's float32 copies of the logits are ``[CONFIDENCE_ROWS, block, V]`` at most where the draws are per row
    (keyed, or greedy tokens by confidence): the tokens and scores equal those of all rows at once. A generator's
    noise is drawn over the whole batch in one call, as before (its stream depends on the shape)."""
    logits = torch.randn(7, 5, 50, generator=torch.Generator().manual_seed(0))
    draws = StepDraws(example_keys(3, torch.arange(7)), start=10) if keyed else None
    whole = sampler._confidence(logits, temperature, remasking, torch.Generator().manual_seed(1), draws)
    rows, draw_rows = [], sampler._draw_rows
    monkeypatch.setattr(sampler, "CONFIDENCE_ROWS", 3)
    monkeypatch.setattr(sampler, "_draw_rows", lambda logits, *args: rows.append(len(logits)) or draw_rows(logits, *args))
    parts = sampler._confidence(logits, temperature, remasking, torch.Generator().manual_seed(1), draws)
    assert torch.equal(whole[0], parts[0]) and torch.equal(whole[1], parts[1])
    per_row = keyed or (temperature == 0 and remasking == "low_confidence")
    assert rows == ([3, 3, 1] if per_row else [7])
