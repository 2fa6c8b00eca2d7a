# Copyright 2026 The qwen3vl-static Authors. All rights reserved.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
"""The in-graph sampler: temperature, top-k, top-p (transformers' warper semantics, per-row parameters) and a draw.
The torch reference sorts (or, for a top-k of at most `candidates`, partially selects) the raw logits. The Triton
forms: for a top-k within the candidates, three launches from the logits to the drawn token (torch's top-k alone
took longer than all three); over the whole vocabulary, torch's sort, then two launches over splits of it, instead of
a dozen passes."""

import torch

from .triton_qwen3vl_graph import launch, tl, triton


def sample_tokens(logits, temperature, top_k, top_p, candidates: int | None = None, min_p=None, noise=None):
    """Tokens drawn from `logits` `(b, V)` (any float dtype) warped by `temperature`, `top_k`, `top_p` and `min_p`
    `(b,)` (`min_p` None: none); graph-safe.

    Works in descending-sorted space: top-k masks ranks >= k, top-p masks a token once the probability mass
    ranked strictly above it reaches `top_p`, min-p masks a token whose probability is below `min_p` times the
    largest (transformers' warpers, in that order). The draw is argmax(p / Exp(1)) (an exact categorical sample that
    needs no host sync, unlike torch.multinomial); `noise`: those Exp(1) draws per sorted rank (`seeded_noise`), else
    drawn from torch's generator. The logits are ordered before the temperature divides them (a positive temperature
    keeps the order), so only the selected ones are converted and divided. With `candidates`, only the largest
    `candidates` logits are selected: exact when every row's top-k is at most that many (the ranks past it are
    masked anyway).
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
    if min_p is not None:  # relative to the largest probability: exp(score - largest score)
        probs = probs.masked_fill((sorted_scores - sorted_scores[:, :1]).exp() < min_p[:, None], 0.0)
    if noise is None:
        noise = torch.empty_like(probs).exponential_()
    return order.gather(-1, (probs / noise[:, : probs.shape[-1]]).argmax(dim=-1, keepdim=True)).squeeze(-1)


_MASK32 = 0xFFFFFFFF


def _mix32(x):
    """A 32-bit integer hash (Wellons' lowbias32) on int64 tensors holding 32-bit values: the same integer ops as
    `_noise_kernel`, so both give the same bits."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def seeded_noise(seeds, draws, count: int):
    """Exp(1) noise `(b, count)` for the sampler's ranks from each row's own `seeds` and `draws` (how many draws the
    row made before) `(b,)`, int64: a row's draws depend on its seed and its step only, never on the batch around it,
    so a seeded request samples the same tokens alone or among others. A counter-based hash, graph-safe; the uniforms
    have 23 bits and lie strictly inside (0, 1) in float32 (a 24-bit one would round up to 1: noise 0, a NaN draw)."""
    ranks = torch.arange(count, device=seeds.device)
    x = _mix32(_mix32(_mix32(seeds & _MASK32) ^ (draws & _MASK32))[:, None] ^ ranks[None, :])
    return -torch.log(((x >> 9).float() + 0.5) * 2.0**-23)


if triton is not None:

    @triton.jit
    def _order(values):
        """float32 bits made order-preserving as a signed int (negative values' magnitude bits flipped); its own
        inverse on the bits."""
        bits = values.to(tl.float32).to(tl.int32, bitcast=True)
        return bits ^ ((bits >> 31) & 0x7FFFFFFF)

    @triton.jit
    def _ordered_keys(values, indices):
        """(value, index) as int64 keys in the values' order, ties broken to the lower index first: `_order` above
        the inverted index."""
        return (_order(values).to(tl.int64) << 32) | (0x7FFFFFFF - indices).to(tl.int64)

    @triton.jit
    def _chunk_offsets(chunk, chunks, CHUNK: tl.constexpr):
        """A chunk's CHUNK token ids: every `chunks`-th run of 16 (one 32-byte sector of bf16), so that ids of related
        tokens, often adjacent, spread over all chunks instead of crowding a few."""
        lanes = tl.arange(0, CHUNK)
        return ((lanes // 16) * chunks + chunk) * 16 + lanes % 16

    @triton.jit
    def _chunk_max_kernel(logits, chunk_max, counts, vocab, stride, chunks, CHUNK: tl.constexpr):
        """Per (row, chunk of CHUNK logits): the chunk's largest logit. Also empties the row's candidate list."""
        row, chunk = tl.program_id(0), tl.program_id(1)
        offsets = _chunk_offsets(chunk, chunks, CHUNK)
        x = tl.load(logits + row * stride + offsets, mask=offsets < vocab, other=float("-inf"))
        tl.store(chunk_max + row * chunks + chunk, tl.max(x.to(tl.float32), axis=0))
        if chunk == 0:
            tl.store(counts + row, 0)

    @triton.jit
    def _threshold(chunk_max, row, chunks, CANDIDATES: tl.constexpr, CHUNKS_PAD: tl.constexpr):
        """The CANDIDATES-th largest chunk maximum (-inf with fewer chunks): the largest maximum that at least
        CANDIDATES maxima reach. At least CANDIDATES logits reach it (those maxima), so the CANDIDATES largest
        logits all do."""
        ranks = tl.arange(0, CHUNKS_PAD)
        maxima = tl.load(chunk_max + row * chunks + ranks, mask=ranks < chunks, other=float("-inf"))
        reaching = tl.zeros([CHUNKS_PAD], dtype=tl.int32)
        for start in range(0, CHUNKS_PAD, 32):  # compared 32 at a time: a few registers a thread
            others = start + tl.arange(0, 32)
            other = tl.load(chunk_max + row * chunks + others, mask=others < chunks, other=float("-inf"))
            reaching += tl.sum((other[None, :] >= maxima[:, None]).to(tl.int32), axis=1)
        return tl.max(tl.where(reaching >= CANDIDATES, maxima, float("-inf")), axis=0)

    @triton.jit
    def _collect_kernel(logits, chunk_max, counts, keys, vocab, stride, chunks, CANDIDATES: tl.constexpr,
                        CHUNK: tl.constexpr, CHUNKS_PAD: tl.constexpr, LIST: tl.constexpr):
        """Per (row, chunk): appends the chunk's logits that reach the row's threshold to the row's list of LIST
        keys (slots taken atomically; the count goes on past LIST, nothing is written there)."""
        row, chunk = tl.program_id(0), tl.program_id(1)
        threshold = _threshold(chunk_max, row, chunks, CANDIDATES, CHUNKS_PAD)
        if tl.load(chunk_max + row * chunks + chunk) >= threshold:
            offsets = _chunk_offsets(chunk, chunks, CHUNK)
            x = tl.load(logits + row * stride + offsets, mask=offsets < vocab, other=float("-inf")).to(tl.float32)
            taken = ((x >= threshold) & (offsets < vocab)).to(tl.int32)
            slots = tl.atomic_add(counts + row, tl.sum(taken, axis=0)) + tl.cumsum(taken, axis=0) - 1
            tl.store(keys + row * LIST + slots, _ordered_keys(x, offsets), mask=(taken == 1) & (slots < LIST))

    @triton.jit
    def _count_reaching(logits, row, stride, vocab, key, BLOCK: tl.constexpr):
        """How many of the row's logits have an `_order` of at least `key`."""
        count = 0
        for start in range(0, vocab, BLOCK):
            offsets = start + tl.arange(0, BLOCK)
            x = tl.load(logits + row * stride + offsets, mask=offsets < vocab, other=float("-inf"))
            count += tl.sum(((_order(x) >= key) & (offsets < vocab)).to(tl.int32), axis=0)
        return count

    @triton.jit
    def _list_exactly(logits, chunk_max, keys, row, vocab, stride, chunks, CANDIDATES: tl.constexpr,
                      CHUNKS_PAD: tl.constexpr, LIST: tl.constexpr, BLOCK: tl.constexpr):
        """A list that overflowed (many logits tied at the threshold) made again, exactly CANDIDATES keys long: the
        CANDIDATES-th largest logit found by bisecting its order key (a pass over the row a step), then the logits
        above it and the first of those equal to it. Slow, and only for such rows."""
        ranks = tl.arange(0, CHUNKS_PAD)
        largest = tl.max(tl.load(chunk_max + row * chunks + ranks, mask=ranks < chunks, other=float("-inf")), axis=0)
        low = _order(_threshold(chunk_max, row, chunks, CANDIDATES, CHUNKS_PAD)).to(tl.int64)
        high = _order(largest).to(tl.int64) + 1
        above = 0  # logits reaching `high`: fewer than CANDIDATES; `low` is reached by at least CANDIDATES
        while high - low > 1:
            middle = low + (high - low) // 2
            count = _count_reaching(logits, row, stride, vocab, middle, BLOCK)
            if count >= CANDIDATES:
                low = middle
            else:
                high, above = middle, count
        greater, equal = 0, 0
        for start in range(0, vocab, BLOCK):
            offsets = start + tl.arange(0, BLOCK)
            x = tl.load(logits + row * stride + offsets, mask=offsets < vocab, other=float("-inf"))
            order = _order(x)
            is_greater = (order > low) & (offsets < vocab)
            is_equal = (order == low) & (offsets < vocab)
            slots = tl.where(is_greater, greater + tl.cumsum(is_greater.to(tl.int32), axis=0) - 1,
                             above + equal + tl.cumsum(is_equal.to(tl.int32), axis=0) - 1)
            tl.store(keys + row * LIST + slots, _ordered_keys(x, offsets),
                     mask=(is_greater | is_equal) & (slots < CANDIDATES))
            greater += tl.sum(is_greater.to(tl.int32), axis=0)
            equal += tl.sum(is_equal.to(tl.int32), axis=0)

    @triton.jit
    def _select_and_draw_kernel(logits, chunk_max, counts, keys, temperature, top_k, top_p, min_p, noise, tokens, vocab,
                                stride, chunks, CANDIDATES: tl.constexpr, CANDIDATES_PAD: tl.constexpr,
                                CHUNKS_PAD: tl.constexpr, LIST: tl.constexpr, BLOCK: tl.constexpr):
        """One row: its CANDIDATES largest logits from its list (descending), then `sample_tokens`' math after the
        selection and the draw."""
        row = tl.program_id(0)
        listed = tl.load(counts + row)
        if listed > LIST:
            _list_exactly(logits, chunk_max, keys, row, vocab, stride, chunks, CANDIDATES, CHUNKS_PAD, LIST, BLOCK)
            tl.debug_barrier()  # the list was written by other threads of this program
            listed = listed * 0 + CANDIDATES
        slots = tl.arange(0, LIST)
        unlisted = -0x7FFFFFFFFFFFFFFF  # below every key
        best = tl.topk(tl.load(keys + row * LIST + slots, mask=slots < listed, other=unlisted), CANDIDATES_PAD)
        # The logits back from their keys (`_order` is its own inverse on the bits).
        scores = _order((best >> 32).to(tl.int32).to(tl.float32, bitcast=True)).to(tl.float32, bitcast=True)
        ranks = tl.arange(0, CANDIDATES_PAD)
        live = ranks < CANDIDATES
        scores = tl.where(live, scores, float("-inf")) / tl.load(temperature + row)
        scores = tl.where(ranks < tl.load(top_k + row), scores, float("-inf"))
        weights = tl.exp(scores - tl.max(scores, axis=0))  # rank 0 is always kept: a finite maximum
        probs = weights / tl.sum(weights, axis=0)
        mass_above = tl.cumsum(probs, axis=0) - probs
        probs = tl.where((mass_above >= tl.load(top_p + row)) | (weights < tl.load(min_p + row)), 0.0, probs)
        drawn = probs / tl.load(noise + row * CANDIDATES + ranks, mask=live, other=1.0)
        rank = tl.argmax(drawn, axis=0)  # the first of equal maxima, as torch's argmax
        index = 0x7FFFFFFF - (tl.sum(tl.where(ranks == rank, best, 0), axis=0) & 0xFFFFFFFF)
        tl.store(tokens + row, tl.minimum(tl.maximum(index, 0), vocab - 1))

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
    def _sorted_draw_kernel(selected, order, temperature, top_k, top_p, min_p, sums, noise, best, best_token, vocab, stride,
                            splits, SPLIT: tl.constexpr, SPLITS_PAD: tl.constexpr):
        """Per (row, split): the split's probabilities, the mass ranked above each (the earlier splits' sums plus a
        scan), top-p's and min-p's masks and the draw; the split's largest p / noise and its token."""
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
        keep = (mass_above < tl.load(top_p + row)) & (weights >= tl.load(min_p + row)) & (ranks < vocab)
        drawn = tl.where(keep, probs / tl.load(noise + row * vocab + ranks, mask=keep, other=1.0), -1.0)
        tl.store(best + row * splits + split, tl.max(drawn, axis=0))
        rank = split * SPLIT + tl.argmax(drawn, axis=0)
        tl.store(best_token + row * splits + split, tl.load(order + row * stride + rank, mask=rank < vocab, other=0))


def sample_sorted(logits, temperature, top_k, top_p, min_p, noise=None, split: int = 4096):
    """`sample_tokens` over the whole sorted vocabulary: the sort by torch, then two launches over splits of `split`
    ranks per row (the softmax's sums, then top-p, min-p and the draw) instead of a dozen passes over the vocabulary.
    `noise` as the reference takes it, or drawn as the reference draws it."""
    rows, vocab = logits.shape
    selected, order = logits.sort(dim=-1, descending=True)
    if noise is None:
        noise = torch.empty(rows, vocab, dtype=torch.float32, device=logits.device).exponential_()
    splits = triton.cdiv(vocab, split)
    sums = torch.empty(rows, splits, dtype=torch.float32, device=logits.device)
    best, best_token = torch.empty_like(sums), torch.empty(rows, splits, dtype=torch.long, device=logits.device)
    launch(_sorted_sums_kernel, (rows, splits), selected, temperature, top_k, sums, vocab, selected.stride(0), splits,
           SPLIT=split)
    launch(_sorted_draw_kernel, (rows, splits), selected, order, temperature, top_k, top_p, min_p, sums, noise, best,
           best_token, vocab, selected.stride(0), splits, SPLIT=split, SPLITS_PAD=triton.next_power_of_2(splits))
    # The first of equal maxima, as the reference. Indexing by an argmax stays in bounds even while compiling ahead
    # (launches skipped, buffers unwritten), when a rank read back from a buffer would not.
    return best_token.gather(1, best.argmax(dim=1, keepdim=True)).squeeze(1)


def sample_candidates(logits, temperature, top_k, top_p, min_p, candidates: int, noise=None, chunk: int = 2048,
                      listed: int = 512):
    """`sample_tokens` with `candidates`, in three launches: the largest logit of each chunk (`chunk` token ids, a
    power of two of at least 16, interleaved in runs of 16); per chunk, its logits that reach the `candidates`-th
    largest of those maxima, appended to the row's list (at least `candidates` logits reach it, so the largest all
    do); per row, the `candidates` largest keys of its list (logit, then the lower token id), then the draw. A list
    past `listed` keys (a power of two, at least `candidates`; many logits at that threshold) is made again exactly
    by the last launch, slowly (bisecting the row's values, one pass a step: about 1.4 ms for the 2B's vocabulary on
    an H200). `noise` as the reference takes it, or drawn as the reference draws it (same shape, dtype and point in
    the stream), so a seed gives the same draws."""
    rows, vocab = logits.shape
    candidates = min(candidates, vocab)
    chunks = triton.cdiv(vocab, chunk)
    chunks_pad = triton.next_power_of_2(max(chunks, candidates, 32))
    if noise is None:
        noise = torch.empty(rows, candidates, dtype=torch.float32, device=logits.device).exponential_()
    chunk_max = torch.empty(rows, chunks, dtype=torch.float32, device=logits.device)
    counts = torch.empty(rows, dtype=torch.int32, device=logits.device)
    keys = torch.empty(rows, listed, dtype=torch.int64, device=logits.device)
    tokens = torch.empty(rows, dtype=torch.long, device=logits.device)
    launch(_chunk_max_kernel, (rows, chunks), logits, chunk_max, counts, vocab, logits.stride(0), chunks, CHUNK=chunk)
    launch(_collect_kernel, (rows, chunks), logits, chunk_max, counts, keys, vocab, logits.stride(0), chunks,
           CANDIDATES=candidates, CHUNK=chunk, CHUNKS_PAD=chunks_pad, LIST=listed)
    launch(_select_and_draw_kernel, (rows,), logits, chunk_max, counts, keys, temperature, top_k, top_p, min_p, noise,
           tokens,
           vocab, logits.stride(0), chunks, CANDIDATES=candidates, CANDIDATES_PAD=triton.next_power_of_2(candidates),
           CHUNKS_PAD=chunks_pad, LIST=listed, BLOCK=1024)
    return tokens
