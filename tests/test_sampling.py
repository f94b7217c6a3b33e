"""The sampler's draws (replica/sampling.py), pure logic: frequencies follow the probabilities, a zero-probability token
is never drawn, top-k / top-p cut where they should, a seed repeats its draws."""

from __future__ import annotations

import math

import pytest
import torch

from common.types import SamplingParams
from replica.sampling import draw, sample_tokens

PROBS = [0.1, 0.0, 0.2, 0.3, 0.4, 0.0]


def counts(values: list[int], size: int) -> list[float]:
    return [values.count(index) / len(values) for index in range(size)]


def test_draws_follow_the_probabilities_and_never_pick_a_zero():
    generator = torch.Generator().manual_seed(0)
    probs = torch.tensor(PROBS)
    frequencies = counts([draw(probs, generator) for _ in range(20000)], len(PROBS))
    # 20000 draws: the standard error of a frequency is <= 0.0035, so 0.015 is > 4 sigma
    for observed, expected in zip(frequencies, PROBS):
        assert observed == pytest.approx(expected, abs=0.015)
    assert frequencies[1] == frequencies[5] == 0.0


def test_probabilities_that_do_not_sum_to_one_are_drawn_in_proportion():
    """top-p leaves a cut distribution whose mass is below 1: the draw scales to the mass that is left."""
    generator = torch.Generator().manual_seed(1)
    probs = torch.tensor([0.0, 0.15, 0.0, 0.05])
    frequencies = counts([draw(probs, generator) for _ in range(8000)], 4)
    assert frequencies[1] == pytest.approx(0.75, abs=0.03) and frequencies[3] == pytest.approx(0.25, abs=0.03)
    assert frequencies[0] == frequencies[2] == 0.0


def test_sample_tokens_applies_temperature_top_k_and_top_p_and_repeats_a_seed():
    logits = torch.tensor([[math.log(p) if p else -math.inf for p in PROBS]] * 2, dtype=torch.bfloat16)

    def run(params: SamplingParams, seed: int, n: int = 3000) -> list[int]:
        generator = torch.Generator().manual_seed(seed)
        return [sample_tokens(logits[:1], [params], [generator])[0] for _ in range(n)]

    plain = counts(run(SamplingParams(temperature=1.0), 2), len(PROBS))
    assert plain[4] == pytest.approx(0.4, abs=0.04) and plain[0] == pytest.approx(0.1, abs=0.03)
    assert run(SamplingParams(temperature=0.01), 3, 200) == [4] * 200  # nearly greedy
    assert set(run(SamplingParams(temperature=1.0, top_k=2), 4)) == {3, 4}
    assert set(run(SamplingParams(temperature=1.0, top_p=0.65), 5)) == {3, 4}  # 0.4 + 0.3 reaches 0.65
    assert run(SamplingParams(temperature=1.0), 6, 50) == run(SamplingParams(temperature=1.0), 6, 50)
    assert run(SamplingParams(temperature=1.0), 6, 50) != run(SamplingParams(temperature=1.0), 7, 50)
    # greedy rows take the argmax, whatever the other rows do
    assert sample_tokens(logits, [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)],
                         [None, torch.Generator().manual_seed(8)])[0] == 4
