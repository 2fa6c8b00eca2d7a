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
"""The continuous-batching scheduler: which requests wait, which decode row holds which request, which enter next.

Host bookkeeping only (no tensors), apart from the runner that computes the steps: requests wait in arrival order;
`schedule()` admits the first waiting ones into free rows while their prompts fit the prefill token budget (a prompt
larger than the budget enters alone, and the manager prefills it a budget per turn), lowest rows first; `finish()` frees a row; `compact()` moves the rows in use to
the front, so that a step covers them and as few free rows as their batch bucket leaves.
"""

from collections import deque
from dataclasses import dataclass, field

from transformers.generation.continuous_batching.requests import GenerationOutput

NO_PENALTIES = (1.0, 0.0, 0.0)  # a request's repetition, presence and frequency penalties when it sets none


@dataclass(eq=False)  # compared and hashed by identity
class Sequence:
    """One request through the batch."""

    output: GenerationOutput
    prompt: dict  # its model inputs, on the host: `(1, n)` token rows and its media
    positions: object  # its prompt's M-RoPE positions `(3, 1, n)`, on the host
    max_new_tokens: int
    eos_ids: frozenset = frozenset()
    stop_strings: tuple = ()
    sampling: dict = field(default_factory=dict)  # temperature, top_k, top_p, min_p, seed (the runner's row buffers)
    do_sample: bool = False
    penalties: tuple = NO_PENALTIES  # repetition, presence, frequency
    streaming: bool = False
    row: int | None = None
    length: int = 0  # cache slots its row holds (prompt, then one per step)
    prefilled: int = 0  # prompt tokens queued into its row so far (a long prompt enters in chunks)
    decoding: bool = False  # its row decodes: its prompt's prefill is done and its first token drawn
    media: list | None = None  # its images' and videos' features once encoded (ahead of its prefill), in order
    media_done: object = None  # the CUDA event after which they are on the device (None: on the CPU)
    delivered: int = 0  # generated tokens already streamed
    taken_in: float = 0.0  # `time.perf_counter()` when the batch took it in (checked, out of the input queue)
    launched: float = 0.0  # `time.perf_counter()` when its prefill was launched
    cancelled: bool = False
    done: bool = False

    @property
    def request_id(self) -> str:
        return self.output.request_id

    @property
    def prompt_len(self) -> int:
        return self.prompt["input_ids"].shape[1]

    @property
    def prefilling(self) -> bool:
        """Whether its prompt is not all queued into its row yet."""
        return self.prefilled < self.prompt_len

    @property
    def penalized(self) -> bool:
        return self.penalties != NO_PENALTIES

    @property
    def mode(self) -> str:
        """Its decode mode: "greedy", or a seeded sampling mode (its top-k within the candidates or not)."""
        if not self.do_sample:
            return "greedy"
        return "sample_top_k_seeded" if self.sampling["top_k"] <= self.sampling["candidates"] else "sample_seeded"


class Scheduler:
    def __init__(self, rows: int, max_prefill_tokens: int):
        self.rows = rows
        self.max_prefill_tokens = max_prefill_tokens
        self.waiting = deque()
        self.running = {}  # row -> Sequence
        self.free = list(range(rows))  # kept sorted: admissions take the lowest rows

    def add(self, sequence: Sequence) -> None:
        self.waiting.append(sequence)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, ready=None) -> list:
        """The waiting requests that enter now, each given a free row: in arrival order, while rows are free, their
        prompts fit `max_prefill_tokens` together (the first one always enters) and `ready(request)` holds (None:
        always)."""
        admitted, tokens = [], 0
        while self.waiting and self.free and (ready is None or ready(self.waiting[0])):
            cost = self.waiting[0].prompt_len
            if admitted and tokens + cost > self.max_prefill_tokens:
                break
            sequence = self.waiting.popleft()
            sequence.row = self.free.pop(0)
            self.running[sequence.row] = sequence
            admitted.append(sequence)
            tokens += cost
        return admitted

    def upcoming(self, tokens: int) -> list:
        """The waiting requests next in line whose prompts add up to at most `tokens` (the first one always)."""
        ahead, total = [], 0
        for sequence in self.waiting:
            total += sequence.prompt_len
            if ahead and total > tokens:
                break
            ahead.append(sequence)
        return ahead

    def finish(self, sequence: Sequence) -> None:
        """`sequence` leaves its row (finished, failed or cancelled)."""
        sequence.done = True
        if sequence.row is not None and self.running.get(sequence.row) is sequence:
            del self.running[sequence.row]
            self.free.append(sequence.row)
            self.free.sort()
        elif sequence in self.waiting:
            self.waiting.remove(sequence)

    def find(self, request_id: str) -> Sequence | None:
        for sequence in (*self.waiting, *self.running.values()):
            if sequence.request_id == request_id:
                return sequence
        return None

    def active_rows(self) -> int:
        """Rows a step must cover: up to the last one in use."""
        return max(self.running) + 1 if self.running else 0

    def compact(self, bucket_of) -> list | None:
        """When the rows in use would fit a smaller batch bucket (`bucket_of(rows)`) at the front: the permutation
        `order` (new row i takes old row `order[i]`) that moves them there, applied to this bookkeeping; else None."""
        if bucket_of(self.active_rows()) == bucket_of(len(self.running)):
            return None
        used = sorted(self.running)
        order = used + [row for row in range(self.rows) if row not in self.running]
        self.running = {new: self.running[old] for new, old in enumerate(used)}
        for row, sequence in self.running.items():
            sequence.row = row
        self.free = list(range(len(used), self.rows))
        return order
