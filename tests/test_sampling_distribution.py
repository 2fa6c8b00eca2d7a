"""The in-graph sampler draws from the distribution of transformers' warpers: a chi-square goodness-of-fit test (CPU).

For every warper combination the device loop takes, the parameters travel as they do in `generate`: `device_plan`
reads the warpers, `DecodeRunner.set_sampling` stores them per row (an absent top-k as top_k = vocab, an absent top-p
as top_p = inf, an absent min-p as 0), `sample_tokens` draws. The reference is the warpers themselves (temperature,
top-k, top-p, min-p in that order) and a softmax. Draws from continuous batching's per-row seeds (`seeded_noise`) fit
too.
"""

from itertools import combinations
from statistics import NormalDist

import pytest
import torch
from transformers import GenerationConfig, LogitsProcessorList
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)
from transformers.generation.stopping_criteria import MaxLengthCriteria, StoppingCriteriaList

from qwen3vl_static.decode_qwen3vl_graph import DecodeRunner
from qwen3vl_static.loops_qwen3vl_graph import MAX_EOS_IDS, TOP_K_CANDIDATES, candidates, device_plan
from qwen3vl_static.ops_sample_qwen3vl_graph import sample_tokens, seeded_noise

VOCAB, DRAWS = 16, 200_000
SIGNIFICANCE = 1e-3  # of each fit test; the draws are seeded, so a pass is reproducible
WARPERS = {"temperature": lambda: TemperatureLogitsWarper(0.7), "top_k": lambda: TopKLogitsWarper(6),
           "top_p": lambda: TopPLogitsWarper(0.8), "min_p": lambda: MinPLogitsWarper(0.05)}
# Every combination the device loop takes: none (plain softmax), each warper alone, and every set of them.
COMBINATIONS = [names for size in range(len(WARPERS) + 1) for names in combinations(WARPERS, size)]


def logits():
    return torch.randn(VOCAB, generator=torch.Generator().manual_seed(0))


def warpers(names, **overrides):
    """The warpers of `names` in transformers' order, with `overrides` in place of the default ones."""
    return LogitsProcessorList([overrides.get(name) or WARPERS[name]() for name in names])


def expected_probabilities(processors):
    return processors(None, logits()[None].clone()).softmax(-1)[0].double()


def draw(processors, seed=0, top_k_candidates=None, seeded=False):
    """DRAWS tokens from `sample_tokens` in the plan's mode, the parameters read from `processors` by `device_plan` and
    stored per row by `DecodeRunner.set_sampling` (on a stand-in holding the runner's sampling buffers).
    `top_k_candidates`: the "sample_top_k" mode's candidates, if not TOP_K_CANDIDATES (more than this vocabulary).
    `seeded`: the noise of row i from seed `seed + i` (continuous batching's), not from torch's generator."""
    config = GenerationConfig(do_sample=True)
    plan = device_plan(processors, StoppingCriteriaList([MaxLengthCriteria(max_length=2)]), config)
    assert plan is not None, "the device loop does not take these warpers"
    runner = DecodeRunner.__new__(DecodeRunner)
    vars(runner).update(
        temperature=torch.empty(DRAWS), top_k=torch.empty(DRAWS, dtype=torch.long), top_p=torch.empty(DRAWS),
        min_p=torch.empty(DRAWS),
        logits=torch.empty(0, VOCAB), eos_ids=torch.empty(MAX_EOS_IDS, dtype=torch.long),
        pad_id=torch.empty((), dtype=torch.long), unfinished=torch.empty(DRAWS, dtype=torch.bool),
    )
    runner.set_sampling(plan["temperature"], plan["top_k"], plan["top_p"], plan["eos_ids"], None, plan["min_p"])
    torch.manual_seed(seed)
    count = candidates(plan["mode"])
    if count is not None and top_k_candidates is not None:
        count = top_k_candidates
    noise = None
    if seeded:
        noise = seeded_noise(seed + torch.arange(DRAWS), torch.zeros(DRAWS, dtype=torch.long), count or VOCAB)
    return sample_tokens(logits().expand(DRAWS, -1), runner.temperature, runner.top_k, runner.top_p, count,
                         runner.min_p, noise)


def chi_square_quantile(probability, degrees):
    """The `probability` quantile of the chi-square distribution with `degrees` degrees of freedom, by Wilson and
    Hilferty (1931): for X of that distribution, (X / k)^(1/3) is nearly normal with mean 1 - 2 / (9k) and variance
    2 / (9k). At the 0.999 quantile it lies a little above the exact value (3% for k = 1, 1.4% for k = 4, 0.4% for
    k = 15), so the test is marginally more lenient than SIGNIFICANCE says."""
    spread = 2 / (9 * degrees)
    return degrees * (1 - spread + NormalDist().inv_cdf(probability) * spread**0.5) ** 3


def fits(tokens, probabilities) -> bool:
    """Pearson's chi-square test of the draws' counts against `probabilities` over the tokens of positive
    probability (those of zero probability are checked apart): whether the fit is accepted at SIGNIFICANCE."""
    counts = torch.bincount(tokens, minlength=VOCAB).double()
    support = probabilities > 0
    expected = probabilities[support] * len(tokens)
    assert expected.min() >= 5, "too few expected draws of a token for the chi-square approximation"
    statistic = float(((counts[support] - expected) ** 2 / expected).sum())
    return statistic <= chi_square_quantile(1 - SIGNIFICANCE, int(support.sum()) - 1)


@pytest.mark.parametrize("names", COMBINATIONS, ids=lambda names: "+".join(names) or "softmax")
def test_sampler_draws_from_the_warpers_distribution(names):
    processors = warpers(names)
    probabilities = expected_probabilities(processors)
    assert int((probabilities > 0).sum()) >= 3  # a distribution with something to test
    tokens = draw(processors)
    assert not torch.bincount(tokens, minlength=VOCAB)[probabilities == 0].any()  # never a token the warpers remove
    assert fits(tokens, probabilities)


@pytest.mark.parametrize("names", [names for names in COMBINATIONS if "top_k" in names], ids="+".join)
def test_top_k_candidates_draw_from_the_warpers_distribution(names):
    """A top-k within the candidates takes the "sample_top_k" mode, which sorts only the largest scores (here 8 of
    the 16, for a top-k of 6): the same distribution."""
    processors = warpers(names)
    plan = device_plan(processors, StoppingCriteriaList([MaxLengthCriteria(max_length=2)]), GenerationConfig(do_sample=True))
    assert plan["mode"] == "sample_top_k"
    probabilities = expected_probabilities(processors)
    tokens = draw(processors, top_k_candidates=8)
    assert not torch.bincount(tokens, minlength=VOCAB)[probabilities == 0].any()
    assert fits(tokens, probabilities)


@pytest.mark.parametrize("top_k, mode", [(TOP_K_CANDIDATES, "sample_top_k"), (TOP_K_CANDIDATES + 1, "sample")])
def test_only_a_top_k_within_the_candidates_takes_them(top_k, mode):
    processors = LogitsProcessorList([TopKLogitsWarper(top_k)])
    criteria = StoppingCriteriaList([MaxLengthCriteria(max_length=2)])
    assert device_plan(processors, criteria, GenerationConfig(do_sample=True))["mode"] == mode


def test_fit_rejects_a_wrong_temperature():
    """The test has power: draws at temperature 0.8 do not fit the distribution at 0.7."""
    reference = expected_probabilities(warpers(["temperature"]))
    assert not fits(draw(warpers(["temperature"], temperature=TemperatureLogitsWarper(0.8))), reference)


def test_seeded_draws_reproduce():
    processors = warpers(WARPERS)
    assert torch.equal(draw(processors, seed=3), draw(processors, seed=3))
    assert not torch.equal(draw(processors, seed=3), draw(processors, seed=4))


@pytest.mark.parametrize("names", [(), tuple(WARPERS)], ids=["softmax", "all"])
def test_seeded_noise_draws_from_the_warpers_distribution(names):
    """Continuous batching's draws (each row's noise from its own seed, `seeded_noise`) fit the warpers' distribution
    as the generator's do."""
    processors = warpers(names)
    probabilities = expected_probabilities(processors)
    tokens = draw(processors, seed=1000, seeded=True)
    assert not torch.bincount(tokens, minlength=VOCAB)[probabilities == 0].any()
    assert fits(tokens, probabilities)
