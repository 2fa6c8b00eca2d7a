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
"""The decode runner: one language-model step on static buffers, captured as CUDA graphs and replayed.

The runner owns every tensor a decode step touches: token ids `(B, 1)`, M-RoPE positions `(3, B, 1)`,
per-row cache lengths `(B,)`, a per-row "attendable slot" mask `(B, slots)` that is False on left padding,
the sampling parameters and EOS flags. Shapes are fixed at the model's `max_batch_size`, so a step for `b`
rows uses the first rows of each buffer; a graph of a larger batch bucket carries dummy rows whose data
keeps them inert (token 0, position 0, one attendable slot, their own cache rows). Positions, cache lengths,
EOS flags and the next input token all advance on the device inside the step, so consecutive replays need
no host work at all; the host reads the chunk's tokens once per `steps_per_sync` steps.

Graphs are keyed by (batch bucket, KV-length bucket, mode) and share the model's one memory pool. Modes: "logits"
returns float32 logits (for loops that post-process them on the host), "greedy", "sample" and "sample_top_k" (every
row's top-k at most `TOP_K_CANDIDATES`: no sort of the whole vocabulary) pick the next token inside the graph. The
"_seeded" sampling modes (continuous batching) draw each row's noise from its own seed and draw count
(`seeded_noise`) instead of torch's generator, so that a request's draws do not depend on the rows around it. A mode
ending in "_penalized" (continuous batching, once a request sets a penalty) first applies each row's repetition
penalty (transformers': over its prompt and answer) and presence and frequency penalties (OpenAI's: over its answer)
to the logits (`Penalties`).
"""

from dataclasses import dataclass

import torch

from .decoder_qwen3vl_graph import decoder_layers
from .loops_qwen3vl_graph import MAX_EOS_IDS, candidates
from .ops_sample_qwen3vl_graph import seeded_noise
from .runner_qwen3vl_graph import GraphRunner, bucket_of, collected, copy_to_host, to_device

MODES = ("logits", "greedy", "sample", "sample_top_k", "sample_seeded", "sample_top_k_seeded")
PENALIZED = "_penalized"  # a sampling mode's suffix: the rows' penalties first


def split_mode(mode: str) -> tuple:
    """(the sampling mode, whether penalties apply first) of a decode `mode`."""
    return mode.removesuffix(PENALIZED), mode.endswith(PENALIZED)


@dataclass
class Penalties:
    """Per row: its repetition penalty (1: none), presence and frequency penalties (0: none), which tokens its prompt
    holds and how often its answer holds each token. (rows, vocab) each: allocated by the first request that sets a
    penalty, not before."""

    repetition: torch.Tensor
    presence: torch.Tensor
    frequency: torch.Tensor
    prompt_seen: torch.Tensor  # bool
    counts: torch.Tensor  # int32

    @classmethod
    def zeros(cls, rows: int, vocab: int, device) -> "Penalties":
        return cls(torch.ones(rows, device=device), torch.zeros(rows, device=device), torch.zeros(rows, device=device),
                   torch.zeros(rows, vocab, dtype=torch.bool, device=device),
                   torch.zeros(rows, vocab, dtype=torch.int32, device=device))

    def buffers(self) -> tuple:
        return self.repetition, self.presence, self.frequency, self.prompt_seen, self.counts

    def apply(self, logits: torch.Tensor, rows) -> torch.Tensor:
        """`logits` of `rows` (a slice or an index tensor) penalized, in float32 as transformers' processors run, then
        in their own dtype again. A row without penalties keeps its logits bit for bit."""
        counts = self.counts[rows]
        answered = counts > 0
        scores = logits.float()
        repetition = self.repetition[rows][:, None]
        scores = torch.where(self.prompt_seen[rows] | answered,
                             torch.where(scores < 0, scores * repetition, scores / repetition), scores)
        scores = scores - self.frequency[rows][:, None] * counts - self.presence[rows][:, None] * answered
        return scores.to(logits.dtype)

    def count(self, rows, tokens: torch.Tensor) -> None:
        """One more of each of `tokens` `(b,)` in the answers of `rows` (a slice, or an index tensor of distinct
        rows)."""
        if isinstance(rows, slice):
            self.counts[rows].scatter_add_(1, tokens[:, None], torch.ones_like(tokens[:, None], dtype=torch.int32))
        else:
            self.counts.index_put_((rows, tokens), torch.ones_like(tokens, dtype=torch.int32), accumulate=True)


class DecodeRunner(GraphRunner):
    def __init__(self, text, cache, ops, rotary_components, batch_buckets, cache_buckets, steps_per_sync: int, capturer,
                 use_graphs: bool, rows: int | None = None):
        """`rows`: the rows of the step's buffers (default: the cache's; the speculative loop's verify step has one
        per position it checks, all on one cache row)."""
        device = cache.full_keys[0].device
        super().__init__(capturer, use_graphs, can_use_graphs=device.type == "cuda")
        self.text = text  # TextWeights
        self.cache = cache
        self.ops = ops
        self.rotary_components = rotary_components  # `ops.rotary_components` of the text rotary embedding
        self.batch_buckets = batch_buckets
        self.cache_buckets = cache_buckets
        rows, slots = rows or cache.rows, cache.capacity
        vocab = text.lm_head.shape[0]

        def zeros(*shape, dtype=torch.long):
            return torch.zeros(*shape, dtype=dtype, device=device)

        self.input_ids = zeros(rows, 1)
        self.positions = zeros(3, rows, 1)
        self.cache_lens = zeros(rows)
        # The cache row of each row: its own (`start`), or under continuous batching wherever its request's prompt
        # is, so that the rows in use are always the first ones (`reorder`). Always a permutation: a free row's inert
        # steps write into a free cache row.
        self.cache_rows = torch.arange(rows, device=device)
        self.cache_row_of = list(range(rows))  # the same, on the host
        self.attendable = torch.ones(rows, slots, dtype=torch.bool, device=device)
        self.logits = zeros(rows, vocab, dtype=torch.float32)
        self.temperature = torch.ones(rows, device=device)
        self.top_k = torch.full((rows,), vocab, dtype=torch.long, device=device)
        self.top_p = torch.full((rows,), float("inf"), device=device)
        self.min_p = torch.zeros(rows, device=device)
        self.seeds = zeros(rows)  # the "_seeded" modes' per-row noise: its seed, and the draws made so far
        self.draws = zeros(rows)
        self.eos_ids = torch.full((MAX_EOS_IDS,), -1, dtype=torch.long, device=device)
        self.pad_id = zeros(())
        self.unfinished = torch.ones(rows, dtype=torch.bool, device=device)
        # Per row, the end of its prompt while that is being prefilled (continuous batching, beside the steps), else
        # 0: an inert row's cache length goes back there every chunk, so its steps write only past the prompt.
        self.park_lens = zeros(rows)
        self.steps_per_sync = steps_per_sync
        self.out_tokens = zeros(rows, steps_per_sync)
        self.out_unfinished = torch.zeros(rows, steps_per_sync, dtype=torch.bool, device=device)
        self.chunk_step = zeros(1)
        self.penalties = None  # `enable_penalties`
        self.batch_size = 0
        self.length = 0  # slots filled in every real row (rows advance in lockstep)

    # -- request state -------------------------------------------------------------------------------------

    def start(self, positions, attention_mask, prompt_len: int) -> None:
        """Load the state after prefill: the first generated token's M-RoPE positions `(3, b, 1)` and the prompt's
        2D padding mask."""
        batch = positions.shape[1]
        self.batch_size, self.length = batch, prompt_len
        self.input_ids.zero_()
        self._own_cache_rows()
        self.positions.zero_()
        self.positions[:, :batch] = positions
        self.cache_lens.zero_()
        self.cache_lens[:batch] = prompt_len
        self.attendable.fill_(True)
        if attention_mask is not None:
            self.attendable[:batch, :prompt_len] = attention_mask.bool()

    def set_sampling(self, temperature: float, top_k: int | None, top_p: float | None, eos_ids, pad_id,
                     min_p: float | None = None) -> None:
        """Sampling parameters and EOS ids of the request (None disables top-k / top-p / min-p). Every row starts
        finished; the caller marks the real rows unfinished after its first token."""
        self.set_row_sampling(slice(None), temperature, top_k, top_p, min_p)
        self.eos_ids.fill_(-1)
        self.eos_ids[: len(eos_ids)] = torch.tensor(eos_ids, dtype=torch.long)
        self.pad_id.fill_(0 if pad_id is None else int(pad_id))
        self.unfinished.fill_(False)

    def set_row_sampling(self, rows, temperature: float, top_k: int | None, top_p: float | None,
                         min_p: float | None = None) -> None:
        """Sampling parameters of `rows` (an index or a slice; None disables top-k / top-p / min-p)."""
        self.temperature[rows] = temperature
        self.top_k[rows] = self.logits.shape[1] if top_k is None else top_k
        self.top_p[rows] = float("inf") if top_p is None else top_p
        self.min_p[rows] = 0.0 if min_p is None else min_p

    def set_rows_sampling(self, rows, settings) -> None:
        """Per-row sampling parameters of `rows` (a `(b,)` tensor), each a `(b,)` tensor on the device in `settings`:
        temperature, top_k, top_p, min_p, seed (continuous batching admits requests of their own settings)."""
        for buffer, name in ((self.temperature, "temperature"), (self.top_k, "top_k"), (self.top_p, "top_p"),
                             (self.min_p, "min_p"), (self.seeds, "seed")):
            buffer[rows] = settings[name].to(buffer.dtype)
        self.draws.index_fill_(0, rows, 0)

    def enable_penalties(self) -> None:
        """Per-row penalties from now on (`Penalties`, each row without any until `set_rows_penalties`); the graphs
        of "_penalized" modes read them."""
        if self.penalties is None:
            self.penalties = Penalties.zeros(*self.logits.shape, self.logits.device)

    def set_rows_penalties(self, rows, values, prompts: list) -> None:
        """Penalties of `rows` (a `(b,)` tensor): `values` `(b, 3)` (repetition, presence, frequency) and each row's
        prompt ids (`prompts`, `(n,)` tensors on the device); their answers start empty."""
        penalties = self.penalties
        for buffer, column in zip((penalties.repetition, penalties.presence, penalties.frequency), values.unbind(1)):
            buffer[rows] = column
        penalties.counts.index_fill_(0, rows, 0)
        penalties.prompt_seen.index_fill_(0, rows, False)
        prompt_rows = torch.cat([row.expand(len(ids)) for row, ids in zip(rows, prompts)])
        seen = torch.ones((), dtype=torch.bool, device=rows.device)  # on the device: no copy from the host
        penalties.prompt_seen.index_put_((prompt_rows, torch.cat(prompts)), seen)

    # -- rows that start and stop on their own (continuous batching) ---------------------------------------

    def open_slots(self, pad_id) -> None:
        """Every row free: no request, inert (finished, so it emits `pad_id`; nothing attended beyond slot 0). The
        device sees no EOS ids: the host finishes each row by its own request's rules."""
        self.idle()
        self.eos_ids.fill_(-1)
        self.pad_id.fill_(0 if pad_id is None else int(pad_id))

    def admit(self, rows, tokens, positions, attention_mask) -> None:
        """Rows `rows` (a `(b,)` tensor) continue requests whose prompts fill their first cache slots as
        `attention_mask` `(b, prompt)` says (zeros: left padding, never attended): `tokens` `(b,)` are their next
        inputs, at M-RoPE `positions` `(3, b)` (their sampling parameters: `set_row_sampling`)."""
        self.input_ids[rows, 0] = tokens
        self.positions[:, rows, 0] = positions
        # Scalars go in through index_fill_ / fill_: written through an index, PyTorch copies them from pageable memory
        # and waits for the stream, i.e. for every chunk queued ahead (the row writes below and in `park`, `release`).
        self.cache_lens.index_fill_(0, rows, attention_mask.shape[1])
        self.attendable.index_fill_(0, rows, True)
        self.attendable[rows, : attention_mask.shape[1]] = attention_mask.bool()
        self.unfinished.index_fill_(0, rows, True)
        self.park_lens.index_fill_(0, rows, 0)

    def park(self, rows, length: int) -> None:
        """Rows `rows` (a `(b,)` tensor) are taken by prompts of `length` slots being prefilled, maybe on another
        stream while they step: they stay inert, their steps write from slot `length` on (slots their first decode
        steps write again before anything reads them) and attend only those, not the prompt's slots."""
        self.cache_lens.index_fill_(0, rows, length)
        self.park_lens.index_fill_(0, rows, length)
        self.attendable.index_fill_(0, rows, True)
        self.attendable[:, :length].index_fill_(0, rows, False)

    def release(self, row: int) -> None:
        """Row `row` is free again (finished: inert, as `open_slots` leaves it)."""
        self.unfinished[row].fill_(False)
        self.park_lens[row].fill_(0)

    def reorder(self, order: list) -> None:
        """Row i takes over everything row `order[i]` held (its request's state and its cache row): continuous
        batching moves the rows in use to the front, so that a step covers them and few others."""
        index = to_device(torch.tensor(order), self.cache_rows.device)
        penalties = self.penalties.buffers() if self.penalties is not None else ()
        for buffer in (self.input_ids, self.cache_lens, self.cache_rows, self.attendable, self.unfinished,
                       self.park_lens, self.temperature, self.top_k, self.top_p, self.min_p, self.seeds, self.draws,
                       *penalties):
            buffer.copy_(buffer.index_select(0, index))
        self.positions.copy_(self.positions.index_select(1, index))
        self.cache_row_of = [self.cache_row_of[row] for row in order]

    def continue_rows(self, rows: int, length: int) -> None:
        """The next chunk steps the first `rows` rows, the longest of them holding `length` cache slots. Free rows go
        back to slot 0 of their own cache row first and parked rows to their prompt's end, so however long they stay
        inert they never pass their cache row's end."""
        inert = ~self.unfinished
        self.cache_lens.copy_(torch.where(inert, self.park_lens, self.cache_lens))  # a free row's is 0
        self.positions.masked_fill_(inert[None, :, None], 0)
        self.batch_size, self.length = rows, length

    # -- stepping ------------------------------------------------------------------------------------------

    def logits_step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Feed one token per row, return the next-token float32 logits `(b, vocab)`."""
        self.input_ids[: self.batch_size, 0] = tokens
        self._advance("logits", 1)
        return self.logits[: self.batch_size]

    def issue(self, steps: int, mode: str):
        """Queue `steps` (<= steps_per_sync) steps that continue from the current input tokens (each step feeds its
        token to the next) and the copy of their tokens and flags to the host; returns a handle for `collect`. The
        host does not wait: it can queue the next chunk while the GPU runs this one."""
        self.chunk_step.zero_()
        self._advance(mode, steps)
        batch = self.batch_size
        return copy_to_host(self.out_tokens[:batch, :steps], self.out_unfinished[:batch, :steps])

    collect = staticmethod(collected)  # waits for an issued chunk: its tokens and unfinished flags, `(b, steps)` each

    def _advance(self, mode: str, steps: int) -> None:
        rows = bucket_of(self.batch_buckets, self.batch_size)
        kv_len = bucket_of(self.cache_buckets, self.length + steps)
        self.execute((rows, kv_len, mode), steps)
        self.length += steps

    def step(self, rows: int, kv_len: int, mode: str) -> None:
        """One decode step over the first `rows` rows, attending to the first `kv_len` cache slots."""
        logits = self.forward(rows, kv_len)
        cache_lens, positions = self.cache_lens[:rows], self.positions[:, :rows]
        if mode == "logits":
            self.logits[:rows] = logits
            self.ops.advance(cache_lens, positions)
            return
        mode, penalized = split_mode(mode)
        if penalized:
            logits = self.penalties.apply(logits, slice(0, rows))
        tokens = None  # greedy: the argmax, inside finish_step
        if mode != "greedy":
            tokens = self.sample(logits, slice(0, rows), mode)
        self.ops.finish_step(logits, tokens, self.unfinished[:rows], self.pad_id, self.eos_ids, self.input_ids[:rows],
                             self.out_tokens[:rows], self.out_unfinished[:rows], self.chunk_step, cache_lens, positions)
        if penalized:  # the step's tokens (a finished row's padding too: it is inert, and counted afresh on admission)
            self.penalties.count(slice(0, rows), self.input_ids[:rows, 0])

    def sample(self, logits, rows, mode: str) -> torch.Tensor:
        """Tokens drawn from `logits` for `rows` (a slice or an index tensor) with their own parameters; a "_seeded"
        mode draws from their seeds and advances their draw counts."""
        noise = None
        if mode.endswith("_seeded"):
            count = candidates(mode) or logits.shape[1]
            noise = seeded_noise(self.seeds[rows], self.draws[rows], min(count, logits.shape[1]))
            self.draws[rows] += 1
        return self.ops.sample(logits, self.temperature[rows], self.top_k[rows], self.top_p[rows], candidates(mode),
                               self.min_p[rows], noise)

    def forward(self, rows: int, kv_len: int, record=()) -> torch.Tensor:
        """Embedding -> decoder layers over the cache -> norm -> lm_head for one token per row. (The step's end
        advances the rows' lengths and positions: `step`.) `record`: layer outputs to keep (`decoder_layers`)."""
        hidden, x, attend = self.layer_inputs(rows, kv_len)
        x = decoder_layers(self.ops, self.text.layers, self.cache.full_keys, self.cache.full_values, hidden, x, attend,
                           record=record)
        return self.ops.linear(x, self.text.lm_head)

    def layer_inputs(self, rows: int, kv_len: int) -> tuple:
        """What `decoder_layers` takes for the first `rows` rows' tokens: the residual stream and its first norm
        `(rows, hidden)`, and how a layer attends (each row to its first `kv_len` cache slots, writing its K/V)."""
        ops, text = self.ops, self.text
        positions, cache_lens = self.positions[:, :rows], self.cache_lens[:rows]
        hidden, x = ops.embed_rms_norm(self.input_ids[:rows, 0], text.embed, *text.first_norm)
        rotary = ops.decode_rotary(text.rotary_emb, hidden, positions, self.rotary_components)  # shared by all layers
        context = ops.attention_context(self.attendable[:rows], self.cache_rows[:rows], cache_lens, kv_len, hidden.dtype)

        def attend(layer, keys, values, x):
            return ops.decode_attention(x, layer.qkv, layer.heads, layer.qk_norms, rotary, keys, values, cache_lens,
                                        context, kv_len, layer.scaling)

        return hidden, x, attend

    # -- CUDA graphs ---------------------------------------------------------------------------------------

    def state(self) -> tuple:
        counts = (self.penalties.counts,) if self.penalties is not None else ()
        return self.input_ids, self.positions, self.cache_lens, self.unfinished, self.chunk_step, self.draws, *counts

    def describe(self, key) -> str:
        rows, kv_len, mode = key
        return f"decode ({rows} rows x {kv_len} cache slots, {mode})"

    def settle_near_ties(self, rows: int, kv_len: int, mode: str) -> None:
        """Settle the measured choices of the step for `rows` rows whose candidates timed alone nearly tie
        (the tuner's `near_ties`) by timing the whole step's graph with each of them, one choice after another (`warmup` does
        this before capturing a batch size's graphs; graphs captured before keep their choices)."""
        step, state = self.graph_step((rows, kv_len, mode))
        with self.capturer.restoring(state):
            step()  # measures the step's choices alone first
        tuner = self.ops.tuner
        # Latest measured first: a choice whose candidate runs another measured op (the separate forms) was measured
        # after it, and settling it first decides whether the inner choice runs in the step at all.
        for key, indices in reversed(tuner.near_ties(self.input_ids.device, rows).items()):
            per_step = [None] * len(tuner.timings[key])
            for index in indices:
                tuner.choices[key] = index
                graph = self.capturer.capture(step, state, name=f"decode ({rows} rows, {key[0]} candidate {index})")
                per_step[index] = self.replay_ms(graph, state)
            tuner.step_timings[key] = per_step
            tuner.choices[key] = min((ms, index) for index, ms in enumerate(per_step) if ms is not None)[1]
            tuner.keep(key)

    def replay_ms(self, graph, state, chunks: int = 3) -> float:
        """Milliseconds per replay of a step graph, the fastest of `chunks` chunks of `steps_per_sync` replays back to
        back; `state` (what the step advances) is restored afterwards."""
        best = float("inf")
        with self.capturer.restoring(state):
            for _ in range(chunks):
                self.chunk_step.zero_()  # a chunk's steps record their tokens in its `steps_per_sync` columns
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(self.steps_per_sync):
                    graph.replay()
                end.record()
                end.synchronize()
                best = min(best, start.elapsed_time(end) / self.steps_per_sync)
        return best

    def warmup_keys(self, batch_sizes, cache_lengths, modes) -> list:
        """The (batch bucket, KV bucket, mode) graphs covering these sizes, largest first (later graphs then fit
        in the memory the pool already holds), after checking the sizes fit."""
        if set(modes) - set(MODES):
            raise ValueError(f"warmup modes must be among {MODES}, got {list(modes)}")
        if max(batch_sizes) > self.batch_buckets[-1] or max(cache_lengths) > self.cache_buckets[-1]:
            raise ValueError(
                f"warmup sizes exceed the cache: batch sizes {list(batch_sizes)} (max_batch_size="
                f"{self.batch_buckets[-1]}), cache lengths {list(cache_lengths)} (static_cache_len={self.cache_buckets[-1]})"
            )
        keys = {(bucket_of(self.batch_buckets, b), bucket_of(self.cache_buckets, n), mode)
                for b in batch_sizes for n in cache_lengths for mode in modes}
        return sorted(keys, reverse=True)

    def idle(self) -> None:
        """A dummy request for warm-up steps: every row finished, one slot, nothing read beyond it."""
        self.batch_size, self.length = 0, 0
        self._own_cache_rows()
        self.cache_lens.zero_()
        self.positions.zero_()
        self.attendable.fill_(True)
        self.unfinished.fill_(False)
        self.park_lens.zero_()

    def _own_cache_rows(self) -> None:
        """Each row on its own cache row again (after continuous batching)."""
        rows = list(range(len(self.cache_row_of)))
        if self.cache_row_of != rows:
            self.cache_rows.copy_(torch.arange(len(rows), device=self.cache_rows.device))
            self.cache_row_of = rows
