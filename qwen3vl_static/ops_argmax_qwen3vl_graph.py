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
"""The greedy pick: each row's first index of its largest logit, optionally mapped through a table of offsets (an
EAGLE-3 draft's `d2t`: draft id -> target id); the torch reference and one Triton launch instead of torch's reduction
and the gathers after it (which also break the chain of programmatic dependent launches).

The parts (`part_argmax`) and the pick from them (`pick_from_parts`) are shared with the step's end."""

import torch

from .triton_qwen3vl_graph import _wait_then_release, launch, tl, triton

PARTS = 64  # of a row per program: a vocabulary is read with many SMs
BLOCK = 1024


def argmax_reference(logits, offsets=None, out=None):
    """The first index of each row's largest value `(rows,)` (+ `offsets[index]` where given), written to `out` where
    given."""
    tokens = logits.argmax(dim=-1)
    if offsets is not None:
        tokens = tokens + offsets[tokens]
    if out is None:
        return tokens
    out.copy_(tokens)
    return out


if triton is not None:

    @triton.jit
    def part_argmax(row_logits, n_vocab, part, PARTS: tl.constexpr, BLOCK: tl.constexpr):
        """Part `part` of PARTS of one row: its largest value (float32) and that value's first index."""
        width = tl.cdiv(tl.cdiv(n_vocab, PARTS), BLOCK) * BLOCK
        # Per lane, the largest value and its first index; then the first index of the largest over lanes.
        best = tl.full((BLOCK,), float("-inf"), tl.float32)
        best_index = tl.zeros((BLOCK,), tl.int32)
        for start in range(part * width, part * width + width, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(row_logits + cols, mask=cols < n_vocab, other=float("-inf")).to(tl.float32)
            better = x > best
            best = tl.where(better, x, best)
            best_index = tl.where(better, cols, best_index)
        top = tl.max(best, axis=0)
        return top, tl.min(tl.where(best == top, best_index, n_vocab), axis=0)

    @triton.jit
    def pick_from_parts(part_value, part_index, row_ids, real, n_vocab, PARTS: tl.constexpr):
        """Rows `row_ids`' first index of their largest value, from their parts' (`part_argmax`), as int64. Reads past
        L1 (".cg"): the parts are other programs' stores of this launch."""
        parts = row_ids[:, None] * PARTS + tl.arange(0, PARTS)[None, :]
        values = tl.load(part_value + parts, mask=real[:, None], other=float("-inf"), cache_modifier=".cg")
        indices = tl.load(part_index + parts, mask=real[:, None], other=0, cache_modifier=".cg")
        row_top = tl.max(values, axis=1)
        return tl.min(tl.where(values == row_top[:, None], indices, n_vocab), axis=1).to(tl.int64)

    @triton.jit
    def _argmax_kernel(logits, n_vocab, stride_logits, offsets, part_value, part_index, out, stride_out, ticket, rows,
                       OFFSETS: tl.constexpr, PARTS: tl.constexpr, BLOCK: tl.constexpr, ROWS_PAD: tl.constexpr,
                       PDL: tl.constexpr):
        """A program per (row, part); the last to finish (a ticket counts them) picks every row's index."""
        _wait_then_release(PDL)
        row, part = tl.program_id(0), tl.program_id(1)
        top, index = part_argmax(logits + row * stride_logits, n_vocab, part, PARTS, BLOCK)
        tl.store(part_value + row * PARTS + part, top)
        tl.store(part_index + row * PARTS + part, index)
        # The barrier puts this program's stores before the ticket's release; the last program's acquire puts every
        # program's stores before its reads.
        tl.debug_barrier()
        if tl.atomic_add(ticket, 1, sem="acq_rel") == rows * PARTS - 1:
            row_ids = tl.arange(0, ROWS_PAD)
            real = row_ids < rows
            token = pick_from_parts(part_value, part_index, row_ids, real, n_vocab, PARTS)
            if OFFSETS:
                token += tl.load(offsets + token, mask=real, other=0)
            tl.store(out + row_ids * stride_out, token, mask=real)
            tl.store(ticket, 0)  # ready for the next launch

else:
    part_argmax = pick_from_parts = None


def argmax(logits, offsets, out, ticket):
    """`argmax_reference` in one launch (`out`: None or int64 `(rows,)`); `ticket`: a counter at zero (left at
    zero)."""
    rows, vocab = logits.shape
    if out is None:
        out = torch.empty(rows, dtype=torch.long, device=logits.device)
    part_value = torch.empty(rows * PARTS, dtype=torch.float32, device=logits.device)
    part_index = torch.empty(rows * PARTS, dtype=torch.int32, device=logits.device)
    launch(_argmax_kernel, (rows, PARTS), logits, vocab, logits.stride(0), logits if offsets is None else offsets,
           part_value, part_index, out, out.stride(0), ticket, rows, OFFSETS=offsets is not None, PARTS=PARTS, BLOCK=BLOCK,
           ROWS_PAD=max(2, triton.next_power_of_2(rows)))
    return out
