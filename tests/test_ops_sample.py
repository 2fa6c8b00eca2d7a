"""The sampler's Triton launches (ops_sample_qwen3vl_graph.py) against the torch reference: with
the same seed both draw the same noise, so they must pick the same tokens (the distribution of the reference itself
is tested against transformers' warpers in test_sampling_distribution.py)."""

import pytest
import torch
from ops_checks import DEVICE, DTYPES, needs_triton, randn

from qwen3vl_static.ops_sample_qwen3vl_graph import sample_candidates, sample_sorted, sample_tokens

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
    torch.manual_seed(1)
    expected = sample_tokens(lowest_id_first(logits), temperature, top_k, top_p, candidates)
    torch.manual_seed(1)
    got = sample_candidates(logits, temperature, top_k, top_p, candidates, chunk=chunk, listed=listed)
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
    got = sample_candidates(logits, temperature, top_k, top_p, candidates, chunk=16, listed=listed)
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
    torch.manual_seed(1)
    expected = sample_tokens(logits, temperature, top_k, top_p)
    torch.manual_seed(1)
    got = sample_sorted(logits, temperature, top_k, top_p, split)
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
                torch.full((rows,), 0.9, device=DEVICE))
    monkeypatch.setattr(sampler, "launch", lambda *args, **kwargs: None)
    monkeypatch.setattr(torch, "empty", unwritten)
    monkeypatch.setattr(torch, "empty_like", lambda tensor: unwritten(tensor.shape, dtype=tensor.dtype,
                                                                      device=tensor.device))
    tokens = sample_sorted(logits, *settings, split=64)
    assert tokens.shape == (rows,)
