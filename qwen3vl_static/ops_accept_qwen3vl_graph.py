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
"""A speculative cycle's acceptance: which of the draft's proposals the target keeps, the tokens the cycle outputs (cut
at an EOS id or at the request's limit), their record, and the verify rows moving past them; the torch reference and
one Triton launch instead of some thirty small kernels (0.1 ms a cycle on an H200).
"""

from typing import NamedTuple

import torch

from .triton_qwen3vl_graph import launch, tl, triton


class CycleState(NamedTuple):
    """What the acceptance reads and advances, all on the device (`SpeculativeRunner`'s buffers)."""

    proposals: torch.Tensor  # (K,) the draft's proposals the verify rows checked
    eos_ids: torch.Tensor  # (MAX_EOS_IDS,), -1 where unused
    produced: torch.Tensor  # () tokens output so far
    max_new: torch.Tensor  # () the request's limit
    alive: torch.Tensor  # () bool: no stop yet
    chunk_cycle: torch.Tensor  # (1,) the cycle's row in the chunk's record
    out_tokens: torch.Tensor  # (cycles, K + 1) the record: each cycle's target tokens ...
    out_counts: torch.Tensor  # (cycles,) ... and how many of them it outputs
    cache_lens: torch.Tensor  # (K + 1,) the verify rows' slots
    positions: torch.Tensor  # (3, K + 1, 1) their M-RoPE positions
    input_ids: torch.Tensor  # (K + 1, 1) their tokens (row 0 gets the next pending token here)
    first_position: torch.Tensor  # (3, 1) M-RoPE position of slot `prompt_len`
    prompt_len: torch.Tensor  # ()
    kept: torch.Tensor  # () out: proposals kept
    # out: the draft's 2K slots and their M-RoPE positions `(3, 2K, 1)`: this cycle's K + 1 verified ones, then the
    # K - 1 its next chain writes (after the last kept token's)
    draft_slots: torch.Tensor
    draft_positions: torch.Tensor


def accept_reference(predicted, state: CycleState) -> None:
    """Given the target's tokens after each verify row `predicted` `(K + 1,)`: the proposals kept are the longest
    prefix equal to the target's; the cycle outputs them and the target's next token, cut after the first EOS id and
    at `max_new` (none once stopped). Records them in the chunk's row, counts them, moves the verify rows to the
    slots after them (the first row's token: the last output) and gives the draft its slots."""
    k = state.proposals.shape[0]
    order = torch.arange(k + 1, device=predicted.device)
    kept = (state.proposals == predicted[:k]).long().cumprod(dim=0).sum()
    stops = (predicted[:, None] == state.eos_ids).any(dim=-1) & (order <= kept)
    count = torch.where(stops.any(), stops.long().argmax() + 1, kept + 1)
    count = (torch.minimum(count, state.max_new - state.produced) * state.alive).view(1)
    state.out_tokens.index_copy_(0, state.chunk_cycle, predicted[None])
    state.out_counts.index_copy_(0, state.chunk_cycle, count)
    state.chunk_cycle.add_(1)
    state.produced.add_(count[0])
    state.alive.logical_and_(~stops.any() & (state.produced < state.max_new))
    start = state.cache_lens[:1].clone()
    state.kept.copy_(kept)
    state.input_ids[:1, 0] = predicted.index_select(0, (count - 1).clamp(min=0))

    def positions(slots):
        return (state.first_position + (slots - state.prompt_len)).unsqueeze(2)

    slots = start + count + order
    state.cache_lens.copy_(slots)
    state.positions.copy_(positions(slots))
    draft_slots = torch.cat([start + order, start + kept + 1 + order[: k - 1]])
    state.draft_slots.copy_(draft_slots)
    state.draft_positions.copy_(positions(draft_slots))


if triton is not None:

    @triton.jit
    def _accept_kernel(predicted, proposals, eos_ids, produced, max_new, alive, chunk_cycle, out_tokens, out_counts,
                       cache_lens, positions, input_ids, first_position, prompt_len, kept_out, draft_slots,
                       draft_positions, K: tl.constexpr, BLOCK: tl.constexpr, DRAFT_BLOCK: tl.constexpr,
                       EOS: tl.constexpr):
        """`accept_reference` in one program: rows 0..K of a BLOCK-wide vector."""
        i = tl.arange(0, BLOCK)
        rows = i <= K
        p = tl.load(predicted + i, mask=rows, other=-1)
        d = tl.load(proposals + i, mask=i < K, other=-2)
        kept = tl.min(tl.where((d != p) | (i >= K), i, BLOCK), axis=0)  # the first row without a matching proposal
        eos = tl.load(eos_ids + tl.arange(0, EOS))
        stops = (tl.sum((p[:, None] == eos[None, :]).to(tl.int32), axis=1) > 0) & (i <= kept) & rows
        first_stop = tl.min(tl.where(stops, i, BLOCK), axis=0)
        was_alive = tl.load(alive).to(tl.int64)
        done, limit = tl.load(produced), tl.load(max_new)
        count = tl.minimum(tl.minimum(first_stop, kept) + 1, limit - done) * was_alive
        cycle = tl.load(chunk_cycle)
        tl.store(out_tokens + cycle * (K + 1) + i, p, mask=rows)
        tl.store(out_counts + cycle, count)
        tl.store(chunk_cycle, cycle + 1)
        tl.store(produced, done + count)
        tl.store(alive, (was_alive != 0) & (first_stop == BLOCK) & (done + count < limit))
        start = tl.load(cache_lens)
        tl.store(kept_out, kept.to(tl.int64))
        tl.store(input_ids, tl.sum(tl.where(i == tl.maximum(count - 1, 0), p, 0), axis=0))
        slots = start + count + i
        tl.store(cache_lens + i, slots, mask=rows)
        j = tl.arange(0, DRAFT_BLOCK)
        drafted = j < 2 * K
        chain_slots = start + tl.where(j <= K, j, kept + j - K)
        tl.store(draft_slots + j, chain_slots, mask=drafted)
        offset = tl.load(prompt_len)
        for component in tl.static_range(3):
            first = tl.load(first_position + component) - offset
            tl.store(positions + component * (K + 1) + i, first + slots, mask=rows)
            tl.store(draft_positions + component * (2 * K) + j, first + chain_slots, mask=drafted)


def accept(predicted, state: CycleState) -> None:
    """`accept_reference` in one launch."""
    k = state.proposals.shape[0]
    launch(_accept_kernel, (1,), predicted, state.proposals, state.eos_ids, state.produced, state.max_new, state.alive,
           state.chunk_cycle, state.out_tokens, state.out_counts, state.cache_lens, state.positions, state.input_ids,
           state.first_position, state.prompt_len, state.kept, state.draft_slots, state.draft_positions,
           K=k, BLOCK=triton.next_power_of_2(k + 1), DRAFT_BLOCK=triton.next_power_of_2(2 * k),
           EOS=state.eos_ids.shape[0])
