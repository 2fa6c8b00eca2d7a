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
"""The end of a decode step: the next token (greedy argmax or a drawn one), EOS and padding, the chunk's record of
tokens and flags, and the rows' cache lengths and positions moving on; the torch reference and one Triton launch
instead of a dozen.
"""

import torch

from .ops_argmax_qwen3vl_graph import BLOCK, PARTS, part_argmax, pick_from_parts
from .triton_qwen3vl_graph import _wait_then_release, launch, tl, triton


def advance(cache_lens, positions):
    """The step's end for its rows: each row's cache length `(b,)` and M-RoPE positions `(3, b, 1)` move one on."""
    cache_lens += 1
    positions += 1


def finish_step_reference(logits, tokens, unfinished, pad_id, eos_ids, input_ids, out_tokens, out_unfinished,
                          chunk_step, cache_lens, positions):
    """The end of a sampling step, for rows `(b,)`: the greedy token (`tokens` None: argmax of `logits`, the first
    of equal maxima) or the drawn `tokens`; finished rows emit `pad_id` (as stock generate pads them) and an EOS
    token (`eos_ids`, -1 where unused) finishes its row. Feeds the token to the next step (`input_ids`), records
    it and the flags in column `chunk_step` of `out_tokens` / `out_unfinished`, advances `chunk_step` and
    `advance`s the rows' cache lengths and positions."""
    if tokens is None:
        tokens = logits.float().argmax(dim=-1)
    tokens = torch.where(unfinished, tokens, pad_id)
    unfinished &= ~(tokens[:, None] == eos_ids).any(dim=-1)
    input_ids[:, 0] = tokens
    out_tokens.index_copy_(1, chunk_step, tokens[:, None])
    out_unfinished.index_copy_(1, chunk_step, unfinished[:, None])
    chunk_step += 1
    advance(cache_lens, positions)


if triton is not None:

    @triton.jit
    def _finish_step_kernel(
        logits, n_vocab, stride_logits, part_value, part_index, tokens, unfinished, pad_id, eos_ids, input_ids,
        stride_input_ids, out_tokens, stride_out_tokens, out_unfinished, stride_out_unfinished, chunk_step, ticket, rows,
        cache_lens, positions, stride_positions, ARGMAX: tl.constexpr, PARTS: tl.constexpr, BLOCK: tl.constexpr,
        ROWS_PAD: tl.constexpr, EOS_IDS: tl.constexpr, EOS_PAD: tl.constexpr, PDL: tl.constexpr,
    ):
        """`finish_step_reference` in one launch instead of a dozen. ARGMAX: a program per (row, part of the
        vocabulary) finds the part's largest logit and its first index, and the last program to finish (a ticket
        counts them) picks each row's token from the parts; else one program takes the drawn `tokens`. That last
        program alone finishes the step, for every row, lengths and positions included."""
        _wait_then_release(PDL)
        if ARGMAX:
            row, part = tl.program_id(0), tl.program_id(1)
            top, index = part_argmax(logits + row * stride_logits, n_vocab, part, PARTS, BLOCK)
            tl.store(part_value + row * PARTS + part, top)
            tl.store(part_index + row * PARTS + part, index)
            # The barrier puts this program's stores before the ticket's release; the last program's acquire puts
            # every program's stores before its reads (which bypass L1).
            tl.debug_barrier()
            last = tl.atomic_add(ticket, 1, sem="acq_rel") == rows * PARTS - 1
        else:
            last = True
        if last:
            row_ids = tl.arange(0, ROWS_PAD)
            real = row_ids < rows
            if ARGMAX:
                token = pick_from_parts(part_value, part_index, row_ids, real, n_vocab, PARTS)
                tl.store(ticket, 0)  # ready for the next launch
            else:
                token = tl.load(tokens + row_ids, mask=real, other=0)
            live = tl.load(unfinished + row_ids, mask=real, other=0) != 0
            token = tl.where(live, token, tl.load(pad_id))
            eos = tl.load(eos_ids + tl.arange(0, EOS_PAD), mask=tl.arange(0, EOS_PAD) < EOS_IDS, other=-1)
            live = live & (tl.sum((eos[None, :] == token[:, None]).to(tl.int32), axis=1) == 0)
            step = tl.load(chunk_step)
            tl.store(unfinished + row_ids, live, mask=real)
            tl.store(input_ids + row_ids * stride_input_ids, token, mask=real)
            tl.store(out_tokens + row_ids * stride_out_tokens + step, token, mask=real)
            tl.store(out_unfinished + row_ids * stride_out_unfinished + step, live, mask=real)
            tl.store(chunk_step, step + 1)
            # Every earlier kernel of the step has finished (each waited for its predecessor): lengths and positions
            # move on here, not in launches of their own.
            tl.store(cache_lens + row_ids, tl.load(cache_lens + row_ids, mask=real) + 1, mask=real)
            component = tl.arange(0, 4)[:, None] * stride_positions + row_ids[None, :]
            in_positions = (tl.arange(0, 4)[:, None] < 3) & real[None, :]
            tl.store(positions + component, tl.load(positions + component, mask=in_positions) + 1, mask=in_positions)


def finish_step(logits, tokens, unfinished, pad_id, eos_ids, input_ids, out_tokens, out_unfinished, chunk_step,
                cache_lens, positions, ticket):
    """`finish_step_reference` in one launch; `ticket`: a counter at zero (left at zero) that the greedy argmax's
    last program finds itself by."""
    rows, vocab = logits.shape
    greedy = tokens is None
    parts = PARTS if greedy else 1
    part_value = torch.empty(rows * parts, dtype=torch.float32, device=logits.device)
    part_index = torch.empty(rows * parts, dtype=torch.int32, device=logits.device)
    launch(_finish_step_kernel, (rows if greedy else 1, parts),
        logits, vocab, logits.stride(0), part_value, part_index, logits if greedy else tokens, unfinished, pad_id,
        eos_ids, input_ids, input_ids.stride(0), out_tokens, out_tokens.stride(0), out_unfinished,
        out_unfinished.stride(0), chunk_step, ticket, rows, cache_lens, positions,
        positions.stride(0), ARGMAX=greedy, PARTS=parts, BLOCK=BLOCK,
        ROWS_PAD=max(2, triton.next_power_of_2(rows)), EOS_IDS=len(eos_ids), EOS_PAD=triton.next_power_of_2(len(eos_ids)),
    )
