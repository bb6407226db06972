"""Tests for lit_dllm.noise.keys: the hash, example keys, keyed draws and the one registry of stream ids."""

from __future__ import annotations

import math

import pytest
import torch

from lit_dllm.noise.keys import (
    FIRST_FAMILY_STREAM,
    Stream,
    _absorb,
    _mix64,
    _wrap64,
    example_keys,
    keyed_categorical,
    keyed_rand,
    keyed_uniform,
)

Z = 4.5  # tolerance in standard deviations for the statistical checks


def test_hash_is_splitmix64():
    """Published splitmix64 outputs (seed 0, and seed 1234567 three times)."""
    assert _absorb(torch.tensor(0), 0).item() == _wrap64(0xE220A8397B1DCDAF)
    outputs = _absorb(torch.tensor(1234567), torch.arange(3))
    assert outputs.tolist() == [_wrap64(v) for v in (6457827717110365317, 3203168211198807973, 9817491932198370423)]


def test_mix64_is_a_bijection_on_a_sample():
    x = torch.randint(-(2**62), 2**62, (100_000,), generator=torch.Generator().manual_seed(0))
    assert torch.unique(x).numel() == torch.unique(_mix64(x)).numel()


def test_example_keys_distinct_and_well_mixed():
    index = torch.arange(4096)
    keys = {(s, e): example_keys(s, index, e) for s in (0, 1, 2**64 - 1) for e in (0, 1, 7)}
    everything = torch.cat(list(keys.values()))
    assert torch.unique(everything).numel() == everything.numel()
    # Every bit is set in about half the keys (binomial, n=4096, p=1/2).
    bits = (keys[(0, 0)][:, None] >> torch.arange(64)) & 1
    assert ((bits.sum(0) - 2048).abs() < Z * math.sqrt(4096 / 4)).all()
    assert torch.equal(example_keys(0, index, 0), keys[(0, 0)])
    assert torch.equal(example_keys(5, torch.tensor([3, 9]), 2), example_keys(5, torch.tensor([9, 3]), 2).flip(0))


@pytest.mark.parametrize(("call", "error", "message"), [
    (lambda: example_keys(0, torch.rand(3)), TypeError, "integer tensor"),
    (lambda: example_keys(0.5, torch.arange(3)), TypeError, "seed=0.5"),
    (lambda: keyed_uniform(torch.rand(3), Stream.CANVAS_BLOCK), TypeError, "integer tensor"),
])
def test_bad_input_raises_naming_the_value(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_stream_ids_are_unique():
    """Two kinds of draw on one stream id would draw the same numbers: every id is listed once, with its own value."""
    values = [member.value for member in Stream]
    assert len(values) == len(set(values)) == len(Stream.__members__)  # no aliases either
    assert all(isinstance(value, int) and value >= 0 for value in values)


def test_corruption_and_family_streams_are_apart():
    """The corruption kernels' streams sit below FIRST_FAMILY_STREAM, the families' at or above it, and the values
    are the ones every run so far drew with (renumbering would change the noise)."""
    corruption = {Stream.LEVEL: 0, Stream.TOKEN_UNIFORM: 1, Stream.GUMBEL: 2, Stream.REPLACEMENT: 3}
    families = {Stream.CANVAS_BLOCK: 16, Stream.SELF_CONDITIONING: 17, Stream.DFLASH_ANCHOR: 18,
                Stream.DFLASH_PREFIX: 19, Stream.RL_PROMPT_MASK: 20, Stream.RL_ROLLOUT: 21, Stream.RANDOM_REMASK: 22,
                Stream.RL_ELBO_TIME: 23, Stream.RL_ELBO_MASK: 24}
    assert {**corruption, **families} == {member: member.value for member in Stream}
    assert max(corruption.values()) < FIRST_FAMILY_STREAM <= min(families.values())


def test_keyed_uniform_is_per_example_and_its_first_column_is_the_single_draw():
    keys = example_keys(7, torch.arange(6), 2)
    many = keyed_uniform(keys, Stream.DFLASH_ANCHOR, 5)
    assert many.shape == (6, 5) and ((many >= 0) & (many < 1)).all()
    assert torch.equal(many[:, 0], keyed_uniform(keys, Stream.DFLASH_ANCHOR))
    assert torch.equal(keyed_uniform(keys[[4, 1]], Stream.DFLASH_ANCHOR, 5), many[[4, 1]])  # whatever batch it is in
    assert not torch.equal(keyed_uniform(keys, Stream.DFLASH_PREFIX, 5), many)  # another stream, other draws
    assert torch.equal(many, keyed_rand(keys, Stream.DFLASH_ANCHOR, (6, 5)))  # the corruption kernels' draws
    with pytest.raises(ValueError, match="reserved"):
        keyed_uniform(keys, Stream.REPLACEMENT)


def test_keyed_rand_from_start_reads_the_same_sequence_further_on():
    keys = example_keys(3, torch.arange(5))
    whole = keyed_rand(keys, Stream.RL_ROLLOUT, (5, 12))
    assert torch.equal(keyed_rand(keys, Stream.RL_ROLLOUT, (5, 2, 3), start=6), whole[:, 6:].view(5, 2, 3))


def test_keyed_categorical_draws_from_the_distribution_per_row():
    """Inverse CDF of one keyed uniform per position: each index as often as its probability says (a zero-probability
    index never, an unnormalised row as its normalised one), and a row's draws depend on its key alone."""
    probs = torch.tensor([0.1, 0.0, 0.6, 0.3])
    n = 20_000
    keys = example_keys(1, torch.arange(n))
    draws = keyed_categorical(probs.expand(n, 4), keys, Stream.RL_ROLLOUT)
    counts = torch.bincount(draws, minlength=4).double()
    assert counts[1] == 0
    assert ((counts - n * probs).abs() <= Z * (n * probs * (1 - probs)).sqrt()).all(), counts
    assert torch.equal(keyed_categorical(5 * probs.expand(n, 4), keys, Stream.RL_ROLLOUT), draws)
    many = keyed_categorical(probs.expand(8, 3, 4), keys[:8], Stream.RL_ROLLOUT, start=7)  # [B, positions, V]
    assert torch.equal(keyed_categorical(probs.expand(2, 3, 4), keys[[5, 2]], Stream.RL_ROLLOUT, start=7), many[[5, 2]])
    assert torch.equal(many[:, 0], keyed_categorical(probs.expand(8, 4), keys[:8], Stream.RL_ROLLOUT, start=7))
    assert keyed_categorical(torch.tensor([[0.0, 0.0, 1.0]]), keys[:1], Stream.RL_ROLLOUT).item() == 2  # the last
