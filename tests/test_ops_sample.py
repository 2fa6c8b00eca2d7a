"""The sampler's Triton launches (ops_sample_qwen3vl_graph.py) against the torch reference: with
the same seed both draw the same noise, so they must pick the same tokens (the distribution of the reference itself
is tested against transformers' warpers in test_sampling_distribution.py)."""

import pytest
import torch
from ops_checks import DEVICE, DTYPES, needs_triton, randn

from qwen3vl_static.ops_sample_qwen3vl_graph import sample_candidates, sample_sorted, sample_tokens, seeded_noise

pytestmark = needs_triton


def lowest_id_first(logits):
    """`logits` in float64 less an offset far below their spacing: equal logits ordered by token id, as the Triton
    selection orders them (torch's top-k leaves ties in no set order; bfloat16 logits tie often)."""
    return logits.double() - 1e-12 * torch.arange(logits.shape[-1], device=logits.device)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("chunk, listed", [(64, 64), (1024, 32)])
def test_sample_from_candidates_draws_the_reference_tokens(dtype, chunk, listed):
    """Candidates selected through chunks of 64 logits (10 a row, four interleaved runs of 16 each; the 8th largest
    of their maxima the threshold) or through one chunk whose 600 logits overflow a list of 32 keys (the exact
    selection)."""
    rows, vocab, candidates = 16, 600, 8
    generator = torch.Generator().manual_seed(0)
    logits = 3 * randn(rows, vocab, dtype=dtype)
    temperature = (0.5 + torch.rand(rows, generator=generator)).to(DEVICE)
    top_k = torch.randint(1, candidates + 1, (rows,), generator=generator).to(DEVICE)
    top_p = torch.rand(rows, generator=generator).to(DEVICE)
    top_p[::4] = float("inf")  # no top-p on a quarter of the rows, as the runner stores it
    min_p = torch.zeros(rows, device=DEVICE)
    min_p[1::3] = 0.2  # min-p on a third of the rows
    torch.manual_seed(1)
    expected = sample_tokens(lowest_id_first(logits), temperature, top_k, top_p, candidates, min_p)
    torch.manual_seed(1)
    got = sample_candidates(logits, temperature, top_k, top_p, min_p, candidates, chunk=chunk, listed=listed)
    # Only a float32 rounding of the top-p boundary or of a near-tied draw may part them.
    assert (got == expected).float().mean() >= 15 / 16
    ranks = (logits > logits.gather(1, got[:, None])).sum(dim=1)  # how many logits beat each drawn token
    assert bool((ranks < top_k).all())  # always within its row's top-k
    assert len(set(got.tolist())) > 8  # drawn, not a constant


@pytest.mark.parametrize("listed", [128, 16])
def test_candidates_tied_at_the_edge_are_the_lowest_token_ids(listed):
    """Logits of four values, each taken by ~75 tokens: the candidates tied at the selection's edge are the lowest
    token ids, within the list or (a list of 16 overflowed) by the exact selection."""
    rows, vocab, candidates = 8, 300, 16
    generator = torch.Generator().manual_seed(0)
    logits = torch.randint(0, 4, (rows, vocab), generator=generator).to(DEVICE, DTYPES[0])
    temperature, top_p = torch.ones(rows, device=DEVICE), torch.full((rows,), float("inf"), device=DEVICE)
    top_k = torch.full((rows,), candidates, device=DEVICE)
    torch.manual_seed(1)
    expected = sample_tokens(lowest_id_first(logits), temperature, top_k, top_p, candidates)
    torch.manual_seed(1)
    got = sample_candidates(logits, temperature, top_k, top_p, torch.zeros_like(temperature), candidates, chunk=16,
                            listed=listed)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("split", [64, 4096])
def test_sample_over_the_sorted_vocabulary_draws_the_reference_tokens(dtype, split):
    """The same over the whole sorted vocabulary (no top-k, or one past the candidates), in splits of 64 ranks (five
    per row here, the mass above each rank carried across them) or one split."""
    rows, vocab = 128, 300
    generator = torch.Generator().manual_seed(0)
    logits = 3 * randn(rows, vocab, dtype=dtype)
    temperature = (0.5 + torch.rand(rows, generator=generator)).to(DEVICE)
    top_k = torch.full((rows,), vocab, dtype=torch.long)
    top_k[::2] = torch.randint(65, vocab, (rows // 2,), generator=generator)
    top_k = top_k.to(DEVICE)
    top_p = torch.rand(rows, generator=generator).to(DEVICE)
    top_p[::4] = float("inf")
    min_p = torch.zeros(rows, device=DEVICE)
    min_p[1::3] = 0.05
    torch.manual_seed(1)
    expected = sample_tokens(logits, temperature, top_k, top_p, min_p=min_p)
    torch.manual_seed(1)
    got = sample_sorted(logits, temperature, top_k, top_p, min_p, split=split)
    assert (got == expected).float().mean() >= 0.99
    ranks = (logits > logits.gather(1, got[:, None])).sum(dim=1)
    assert bool((ranks < top_k).all())
    assert len(set(got.tolist())) > 50


def test_sampling_stays_in_bounds_while_its_launches_only_compile(monkeypatch):
    """While the engine compiles kernels ahead, launches are skipped and their outputs stay unwritten: the torch glue
    after them must not index by what those buffers hold (a device-side assert on a GPU)."""
    import qwen3vl_static.ops_sample_qwen3vl_graph as sampler

    def unwritten(*size, dtype=None, **kwargs):  # what a skipped launch leaves: far outside any index range
        fill = float("nan") if dtype is None or dtype.is_floating_point else 2**40
        return torch.full(size[0] if len(size) == 1 and not isinstance(size[0], int) else size, fill, dtype=dtype,
                          **kwargs)

    rows, vocab = 4, 300
    logits = randn(rows, vocab, dtype=DTYPES[0])
    settings = (torch.ones(rows, device=DEVICE), torch.full((rows,), vocab, device=DEVICE),
                torch.full((rows,), 0.9, device=DEVICE), torch.zeros(rows, device=DEVICE))
    monkeypatch.setattr(sampler, "launch", lambda *args, **kwargs: None)
    monkeypatch.setattr(torch, "empty", unwritten)
    monkeypatch.setattr(torch, "empty_like", lambda tensor: unwritten(tensor.shape, dtype=tensor.dtype,
                                                                      device=tensor.device))
    tokens = sample_sorted(logits, *settings, split=64)
    assert tokens.shape == (rows,)


def test_min_p_keeps_the_tokens_within_its_share_of_the_largest_probability():
    """min-p as transformers' `MinPLogitsWarper` after temperature: a token stays only while its probability is at least
    `min_p` times the largest; here the logits 0, -1, -3 (ratios 1, 0.37, 0.05) under min_p 0.1 keep the first two."""
    logits = torch.tensor([[0.0, -1.0, -3.0]], device=DEVICE).expand(4000, -1)
    rows = logits.shape[0]
    settings = (torch.ones(rows, device=DEVICE), torch.full((rows,), 3, device=DEVICE),
                torch.full((rows,), float("inf"), device=DEVICE), None, torch.full((rows,), 0.1, device=DEVICE))
    counts = sample_tokens(logits, *settings).bincount(minlength=3).tolist()
    assert counts[2] == 0 and counts[0] > counts[1] > 500


def test_seeded_noise_depends_on_the_row_s_seed_and_draw_only():
    """The noise of a row is a function of its seed and its draw count: the same in any batch, different from draw to
    draw and from seed to seed, and Exp(1)-distributed."""
    seeds, draws = torch.tensor([7, 7, 8, 7]), torch.tensor([0, 1, 0, 0])
    noise = seeded_noise(seeds, draws, 5000)
    assert torch.equal(noise[0], noise[3]) and torch.equal(noise[0], seeded_noise(seeds[:1], draws[:1], 5000)[0])
    assert not torch.equal(noise[0], noise[1]) and not torch.equal(noise[0], noise[2])
    assert abs(noise.mean().item() - 1) < 0.03 and abs(noise.var().item() - 1) < 0.08
    assert bool((noise > 0).all())


def test_seeded_draws_agree_between_the_reference_and_the_kernels():
    rows, vocab, candidates = 8, 600, 16
    logits = 3 * randn(rows, vocab, dtype=DTYPES[0])
    temperature, top_p, min_p = (torch.ones(rows, device=DEVICE), torch.full((rows,), 0.95, device=DEVICE),
                                 torch.zeros(rows, device=DEVICE))
    top_k = torch.full((rows,), candidates, device=DEVICE)
    seeds, draws = torch.arange(rows, device=DEVICE), torch.zeros(rows, dtype=torch.long, device=DEVICE)
    noise = seeded_noise(seeds, draws, candidates)
    expected = sample_tokens(lowest_id_first(logits), temperature, top_k, top_p, candidates, min_p, noise)
    got = sample_candidates(logits, temperature, top_k, top_p, min_p, candidates, noise, chunk=64, listed=64)
    assert torch.equal(got, expected)
    full = seeded_noise(seeds, draws, vocab)
    top_k = torch.full((rows,), vocab, device=DEVICE)
    assert torch.equal(sample_sorted(logits, temperature, top_k, top_p, min_p, full, split=64),
                       sample_tokens(logits, temperature, top_k, top_p, None, min_p, full))


def test_seeded_noise_is_positive_and_finite_at_the_ends_of_its_range(monkeypatch):
    """The hash's largest and smallest values give noise strictly between 0 and infinity (a noise of 0 would make
    a removed token's draw 0 / 0, a NaN that argmax picks)."""
    import qwen3vl_static.ops_sample_qwen3vl_graph as sampler

    for extreme in (0, 0xFFFFFFFF):
        monkeypatch.setattr(sampler, "_mix32", lambda x, extreme=extreme: torch.full_like(x, extreme))
        noise = seeded_noise(torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long), 4)
        assert bool(((noise > 0) & noise.isfinite()).all())
