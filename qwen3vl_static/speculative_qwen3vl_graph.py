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
"""Speculative decoding with an EAGLE-3 draft, one captured CUDA graph per cycle.

A cycle, all on the device (no host read inside, so consecutive replays need no host work):
1. verify: the target's decode step over K + 1 rows that share the request's cache row: the pending token and the
   draft's K proposals at slots L..L+K (row i attends to the slots up to L + i: the decode attention bounds each row by
   its own length, and every row's K/V is written before any row attends). It keeps the outputs of the layers the
   draft reads;
2. accept: the target's token at each position (its argmax, or drawn with the request's sampling settings); the
   proposals it agrees with, as a prefix, are kept, plus its own next token (at most K + 1 tokens), cut at an EOS id or
   at `max_new_tokens`. For a draft that proposes one token for sure (its argmax), drawing every row from the target and
   keeping a proposal where the draw equals it is the standard rejection rule: a proposal is kept with the target's
   probability of it, and the draw that differs is distributed as the target's residual (its distribution without the
   proposal, renormalized), so the output is distributed as the target's own sampling. Cache lengths move past the kept
   tokens only; K/V written past them is rewritten by the next cycle before anything reads it;
3. draft: the draft's layer over the K + 1 verified slots (their features, the token at each next slot), then its chain
   of K proposals from the last kept one.
The host reads each chunk's kept tokens once (`issue` / `collect`, one chunk queued ahead, as the plain loop does).
"""

from collections import deque

import torch

from .decode_qwen3vl_graph import DecodeRunner
from .decoder_qwen3vl_graph import recording
from .draft_qwen3vl_graph import table_rows
from .loops_qwen3vl_graph import first_tokens
from .ops_accept_qwen3vl_graph import CycleState
from .runner_qwen3vl_graph import GraphRunner, bucket_of, collected, copy_to_host


class SpeculativeRunner(GraphRunner):
    def __init__(self, decode: DecodeRunner, draft, num_draft_tokens: int):
        """`decode`: the engine's decode runner (its weights, cache, ops and buckets); `draft`: an `Eagle3Draft` or
        anything with its `layer_ids`, `prepare`, `rotary_tables`, `extend`, `chain` and
        `extend_and_chain`."""
        super().__init__(decode.capturer, decode.use_graphs, decode.can_use_graphs)
        k = num_draft_tokens
        cache = decode.cache
        self.verify = DecodeRunner(decode.text, cache, decode.ops, decode.rotary_components, [k + 1],
                                   decode.cache_buckets, decode.steps_per_sync, decode.capturer, False, rows=k + 1)
        self.draft, self.k = draft, k
        device = cache.full_keys[0].device
        hidden = decode.text.embed.shape[1]
        self.cycles_per_sync = max(1, decode.steps_per_sync // 2)
        self.order = torch.arange(k + 1, device=device)
        self.taps = torch.zeros(k + 1, len(draft.layer_ids) * hidden, dtype=decode.text.embed.dtype, device=device)
        self.record = recording(draft.layer_ids, self.taps)
        self.proposals = self.verify.input_ids[1:, 0]  # the rows after the pending token's: a view
        self.prompt_len = torch.zeros((), dtype=torch.long, device=device)
        self.first_position = torch.zeros(3, 1, dtype=torch.long, device=device)  # M-RoPE position of slot prompt_len
        self.produced = torch.zeros((), dtype=torch.long, device=device)
        self.max_new = torch.zeros((), dtype=torch.long, device=device)
        self.alive = torch.zeros((), dtype=torch.bool, device=device)
        self.out_tokens = torch.zeros(self.cycles_per_sync, k + 1, dtype=torch.long, device=device)
        self.out_counts = torch.zeros(self.cycles_per_sync, dtype=torch.long, device=device)
        self.chunk_cycle = torch.zeros(1, dtype=torch.long, device=device)
        verify = self.verify
        self.accepted = CycleState(
            self.proposals, verify.eos_ids, self.produced, self.max_new, self.alive, self.chunk_cycle,
            self.out_tokens, self.out_counts, verify.cache_lens, verify.positions, verify.input_ids,
            self.first_position, self.prompt_len, kept=torch.zeros((), dtype=torch.long, device=device),
            draft_slots=torch.zeros(2 * k, dtype=torch.long, device=device),
            draft_positions=torch.zeros(3, 2 * k, 1, dtype=torch.long, device=device))

    def positions(self, slots):
        """M-RoPE positions `(3, n, 1)` of generated slots `slots` `(n,)`: one apart from the first."""
        return (self.first_position + (slots - self.prompt_len)).unsqueeze(2)

    # -- the cycle -----------------------------------------------------------------------------------------

    def step(self, kv_len: int, mode: str) -> None:
        # The next cycle's rows: the pending token (`accept` writes it), then the proposals (the draft writes them).
        self.propose(kv_len, self.verify_and_accept(kv_len, mode))

    def verify_and_accept(self, kv_len: int, mode: str):
        """Steps 1 and 2: the target's tokens after each row `(K + 1,)` (a `MODES` mode of the decode runner: greedy or
        drawn); what the cycle keeps and outputs is recorded and the rows move past it (`ops.accept`)."""
        verify, rows = self.verify, self.k + 1
        logits = verify.forward(rows, kv_len, self.record)
        predicted = verify.ops.argmax(logits) if mode == "greedy" else first_tokens(verify, logits, mode, slice(0, rows))
        verify.ops.accept(predicted, self.accepted)
        return predicted

    def propose(self, kv_len: int, predicted):
        """Step 3: the draft over the verified slots (the target's `predicted` tokens are the tokens at their next
        slots), then its K proposals after the last kept token, into the next cycle's rows. Its slots, positions and
        the count kept are the acceptance's; their rotary tables take one launch."""
        k, draft, state = self.k, self.draft, self.accepted
        rotary = draft.rotary_tables(state.draft_positions, state.draft_slots)
        verified, chained = slice(0, k + 1), slice(k + 1, 2 * k)
        hidden, normed = draft.extend(predicted, self.taps, table_rows(rotary, verified), state.draft_slots[verified],
                                      kv_len + k)
        last = state.kept.view(1)
        draft.chain(hidden.index_select(0, last), normed.index_select(0, last), table_rows(rotary, chained),
                    state.draft_slots[chained], kv_len + k, self.proposals)

    def state(self) -> tuple:
        verify = self.verify
        return verify.input_ids, verify.cache_lens, verify.positions, self.produced, self.alive, self.chunk_cycle

    def describe(self, key) -> str:
        return f"speculative cycle ({self.k} draft tokens, {key[0]} cache slots, {key[1]})"

    # -- the loop ------------------------------------------------------------------------------------------

    def issue(self, cycles: int, kv_len: int, mode: str):
        """Queue `cycles` cycles attending to the first `kv_len` slots and the copy of their kept tokens to the host;
        returns a handle for `collect`."""
        self.chunk_cycle.zero_()
        self.execute((kv_len, mode), cycles)
        return copy_to_host(self.out_tokens[:cycles], self.out_counts[:cycles])

    collect = staticmethod(collected)

    @torch.no_grad()
    def generate(self, input_ids, logits, prompt_taps, prompt_positions, first_position, plan, streamer=None,
                 start: int = 0):
        """The tokens after the prompt `input_ids` `(1, n)` as `plan` (`device_plan`'s: greedy or sampling settings,
        max length, EOS ids) asks, from its prefill's float32 `logits` `(1, vocab)` and the draft's layers' outputs
        `prompt_taps` `(n - start, 3 * hidden)` at its M-RoPE `prompt_positions` `(3, 1, n - start)` of the prompt's
        slots from `start` on (a later turn: the draft's cache holds the ones before, from the turns it ran); the
        first generated token sits at `first_position` `(3, 1, 1)`. Returns the sequence (prompt and new tokens) on the
        host and the tokens kept per cycle."""
        verify, k, draft, mode = self.verify, self.k, self.draft, plan["mode"]
        prompt_len, max_new_tokens = input_ids.shape[1], plan["max_length"] - input_ids.shape[1]
        verify.set_row_sampling(slice(None), plan["temperature"], plan["top_k"], plan["top_p"], plan["min_p"])
        first_token = first_tokens(verify, logits, mode, slice(0, 1))
        sequence = [*input_ids[0].tolist(), int(first_token)]
        if streamer is not None:
            streamer.put(first_token.cpu())
        eos_ids = plan["eos_ids"]
        eos = set(eos_ids)
        if sequence[-1] in eos or max_new_tokens <= 1:
            return torch.tensor([sequence]), []
        # The draft's cache gets the prompt's slots (the chain writes up to K - 1 past a cycle's verified ones); its
        # first chain follows.
        draft.prepare(verify.ops, verify.cache.capacity + k, verify.text.rotary_emb, verify.rotary_components)
        slots = torch.arange(start, prompt_len, device=input_ids.device)
        tokens = torch.cat([input_ids[0, start + 1:], first_token])
        proposals = draft.extend_and_chain(tokens, prompt_taps, prompt_positions.transpose(1, 2), slots,
                                           first_position.view(3, 1, 1), k, prompt_len + k - 1)
        verify.idle()
        verify.cache_rows.zero_()  # every row reads and writes the request's cache row
        verify.eos_ids.fill_(-1)
        verify.eos_ids[: len(eos)] = torch.tensor(sorted(eos), dtype=torch.long)
        verify.input_ids[:, 0] = torch.cat([first_token, proposals])
        self.prompt_len.fill_(prompt_len)
        self.first_position.copy_(first_position.view(3, 1))
        slots = prompt_len + self.order
        verify.cache_lens.copy_(slots)
        verify.positions.copy_(self.positions(slots))
        self.produced.fill_(1)
        self.max_new.fill_(max_new_tokens)
        self.alive.fill_(True)
        # Host bookkeeping: a cycle keeps 1 to K + 1 tokens, so queued cycles move the pending token's slot by at most
        # K + 1 each, never past the last one `max_new_tokens` allows. Chunks are sized for the tokens still to come
        # at the mean kept so far.
        last_slot = prompt_len + max_new_tokens - 1
        chunks, kept = deque(), []
        while True:
            generated = len(sequence) - prompt_len
            queued = sum(cycles for cycles, _ in chunks)
            while len(chunks) < 2 and generated + queued < max_new_tokens:
                per_cycle = (generated - 1) / len(kept) if kept else 1.0
                wanted = -(-(max_new_tokens - generated) // max(per_cycle, 1.0)) - queued
                if chunks and wanted <= 0:
                    break
                cycles = int(min(self.cycles_per_sync, max(1, wanted)))
                furthest = min(last_slot, len(sequence) - 1 + (queued + cycles) * (k + 1))
                chunks.append((cycles, self.issue(cycles, bucket_of(verify.cache_buckets, furthest + k + 1), mode)))
                queued += cycles
            _, handle = chunks.popleft()
            rows, counts = self.collect(handle)
            if not counts.any():  # every cycle finished: the host must have seen its stop
                raise RuntimeError("The speculative loop's cycles stopped before the host saw EOS or max_new_tokens.")
            stopped = False
            for row, count in zip(rows.tolist(), counts.tolist()):
                if count:
                    kept.append(count)
                    sequence += row[:count]
                    stopped = stopped or not eos.isdisjoint(row[:count])  # the device cut the cycle after it
                    if streamer is not None:
                        streamer.put(torch.tensor(row[:count]))
            if stopped or len(sequence) - prompt_len >= max_new_tokens:
                return torch.tensor([sequence]), kept
