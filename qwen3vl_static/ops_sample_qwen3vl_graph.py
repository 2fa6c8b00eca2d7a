"""The in-graph sampler: temperature, top-k, top-p (transformers' warper semantics, per-row parameters) and a draw.
The torch reference sorts (or, for a top-k of at most `candidates`, partially selects) the raw logits; the Triton
launches do the rest, from the temperature to the drawn token: over a few candidates in one program per row, over
the sorted vocabulary in two launches over splits of it, instead of a dozen passes.
"""

import torch

from .triton_qwen3vl_graph import launch, tl, triton


def sample_tokens(logits, temperature, top_k, top_p, candidates: int | None = None):
    """Tokens drawn from `logits` `(b, V)` (any float dtype) warped by `temperature`, `top_k`, `top_p` `(b,)`;
    graph-safe.

    Works in descending-sorted space: top-k masks ranks >= k, top-p masks a token once the probability mass
    ranked strictly above it reaches `top_p`. The draw is argmax(p / Exp(1)) (an exact categorical sample that
    needs no host sync, unlike torch.multinomial). The logits are ordered before the temperature divides them (a
    positive temperature keeps the order), so only the selected ones are converted and divided. With `candidates`,
    only the largest `candidates` logits are selected: exact when every row's top-k is at most that many (the ranks
    past it are masked anyway).
    """
    if candidates is None:
        selected, order = logits.sort(dim=-1, descending=True)
    else:
        selected, order = logits.topk(min(candidates, logits.shape[-1]), dim=-1)
    sorted_scores = selected.float() / temperature[:, None]
    ranks = torch.arange(sorted_scores.shape[-1], device=logits.device)
    sorted_scores = sorted_scores.masked_fill(ranks >= top_k[:, None], float("-inf"))
    probs = sorted_scores.softmax(dim=-1)
    mass_above = probs.cumsum(dim=-1) - probs
    probs = probs.masked_fill(mass_above >= top_p[:, None], 0.0)
    noise = torch.empty_like(probs).exponential_()
    return order.gather(-1, (probs / noise).argmax(dim=-1, keepdim=True)).squeeze(-1)


if triton is not None:

    @triton.jit
    def _sample_candidates_kernel(selected, order, temperature, top_k, top_p, noise, tokens,
                                  CANDIDATES: tl.constexpr, BLOCK: tl.constexpr):
        """One row: `sample_tokens`' math after the selection, over its CANDIDATES largest logits (descending)."""
        row = tl.program_id(0)
        ranks = tl.arange(0, BLOCK)
        live = ranks < CANDIDATES
        scores = tl.load(selected + row * CANDIDATES + ranks, mask=live, other=float("-inf")).to(tl.float32)
        scores = scores / tl.load(temperature + row)
        scores = tl.where(ranks < tl.load(top_k + row), scores, float("-inf"))
        weights = tl.exp(scores - tl.max(scores, axis=0))  # rank 0 is always kept: a finite maximum
        probs = weights / tl.sum(weights, axis=0)
        mass_above = tl.cumsum(probs, axis=0) - probs
        probs = tl.where(mass_above >= tl.load(top_p + row), 0.0, probs)
        drawn = probs / tl.load(noise + row * CANDIDATES + ranks, mask=live, other=1.0)
        rank = tl.argmax(drawn, axis=0)  # the first of equal maxima, as torch's argmax
        tl.store(tokens + row, tl.load(order + row * CANDIDATES + rank, mask=rank < CANDIDATES, other=0))

    @triton.jit
    def _sorted_scores(selected, row, ranks, stride, temperature, top_k, vocab):
        """A row's temperature-scaled sorted logits at `ranks` (-inf past its top-k or the vocabulary) and its
        largest, float32."""
        t = tl.load(temperature + row)
        live = (ranks < tl.load(top_k + row)) & (ranks < vocab)
        scores = tl.load(selected + row * stride + ranks, mask=live, other=float("-inf")).to(tl.float32) / t
        return scores, tl.load(selected + row * stride).to(tl.float32) / t

    @triton.jit
    def _sorted_sums_kernel(selected, temperature, top_k, sums, vocab, stride, splits, SPLIT: tl.constexpr):
        """Per (row, split of SPLIT ranks): the sum of exp(score - largest) over the split, the softmax's parts."""
        row, split = tl.program_id(0), tl.program_id(1)
        scores, top = _sorted_scores(selected, row, split * SPLIT + tl.arange(0, SPLIT), stride, temperature, top_k,
                                     vocab)
        tl.store(sums + row * splits + split, tl.sum(tl.exp(scores - top), axis=0))

    @triton.jit
    def _sorted_draw_kernel(selected, order, temperature, top_k, top_p, sums, noise, best, best_token, vocab, stride,
                            splits, SPLIT: tl.constexpr, SPLITS_PAD: tl.constexpr):
        """Per (row, split): the split's probabilities, the mass ranked above each (the earlier splits' sums plus a
        scan), top-p's mask and the draw; the split's largest p / noise and its token."""
        row, split = tl.program_id(0), tl.program_id(1)
        others = tl.arange(0, SPLITS_PAD)
        parts = tl.load(sums + row * splits + others, mask=others < splits, other=0.0)
        total = tl.sum(parts, axis=0)
        before = tl.sum(tl.where(others < split, parts, 0.0), axis=0)
        ranks = split * SPLIT + tl.arange(0, SPLIT)
        scores, top = _sorted_scores(selected, row, ranks, stride, temperature, top_k, vocab)
        weights = tl.exp(scores - top)
        probs = weights / total
        mass_above = (tl.cumsum(weights, axis=0) + before) / total - probs
        keep = (mass_above < tl.load(top_p + row)) & (ranks < vocab)
        drawn = tl.where(keep, probs / tl.load(noise + row * vocab + ranks, mask=keep, other=1.0), -1.0)
        tl.store(best + row * splits + split, tl.max(drawn, axis=0))
        rank = split * SPLIT + tl.argmax(drawn, axis=0)
        tl.store(best_token + row * splits + split, tl.load(order + row * stride + rank, mask=rank < vocab, other=0))


def sample_sorted(logits, temperature, top_k, top_p, split: int = 4096):
    """`sample_tokens` over the whole sorted vocabulary: the sort by torch, then two launches over splits of `split`
    ranks per row (the softmax's sums, then top-p and the draw) instead of a dozen passes over the vocabulary. The
    noise is drawn as the reference draws it."""
    rows, vocab = logits.shape
    selected, order = logits.sort(dim=-1, descending=True)
    noise = torch.empty(rows, vocab, dtype=torch.float32, device=logits.device).exponential_()
    splits = triton.cdiv(vocab, split)
    sums = torch.empty(rows, splits, dtype=torch.float32, device=logits.device)
    best, best_token = torch.empty_like(sums), torch.empty(rows, splits, dtype=torch.long, device=logits.device)
    launch(_sorted_sums_kernel, (rows, splits), selected, temperature, top_k, sums, vocab, selected.stride(0), splits,
           SPLIT=split)
    launch(_sorted_draw_kernel, (rows, splits), selected, order, temperature, top_k, top_p, sums, noise, best,
           best_token, vocab, selected.stride(0), splits, SPLIT=split, SPLITS_PAD=triton.next_power_of_2(splits))
    # The first of equal maxima, as the reference. Indexing by an argmax stays in bounds even while compiling ahead
    # (launches skipped, buffers unwritten), when a rank read back from a buffer would not.
    return best_token.gather(1, best.argmax(dim=1, keepdim=True)).squeeze(1)


def sample_candidates(logits, temperature, top_k, top_p, candidates: int):
    """`sample_tokens` with `candidates`: the selection by torch, the rest in one launch. The noise is drawn as the
    reference draws it (same shape, dtype and point in the stream), so a seed gives the same draws."""
    selected, order = logits.topk(min(candidates, logits.shape[-1]), dim=-1)
    noise = torch.empty(selected.shape, dtype=torch.float32, device=logits.device).exponential_()
    tokens = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
    launch(_sample_candidates_kernel, (logits.shape[0],), selected, order, temperature, top_k, top_p, noise, tokens,
           CANDIDATES=selected.shape[1], BLOCK=triton.next_power_of_2(selected.shape[1]))
    return tokens
