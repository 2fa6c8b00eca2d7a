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
"""Continuous batching on the graph engine: many requests share the static cache's rows, each with its own settings.

A background thread owns the batch. Each turn of its loop
1. asks the `Scheduler` which waiting requests enter free rows now (as many as fit a prefill token budget; streaming
   ones that arrive beside many decoding rows first wait a moment for others to enter with them, `gathers`) and parks
   their rows (`DecodeRunner.park`: inert, stepping only past the prompt);
2. lets rows begin decoding (sampling settings, penalties, first token) on the batch's stream, which waits for their
   prefill on the GPU: while requests stream, once the host finds the prefill done; otherwise once the decode steps
   that the side stream's work up to their prefill takes are queued beside it (`SideWork`: a count, so that an
   offline batch's schedule does not depend on timing); at once (the next turn) when no row decodes;
3. queues the next chunk of `steps_per_sync` decode steps for every row in use (fewer while requests stream:
   `StreamingSteps`), sampling in the graph with each row's own parameters and seed (seeded modes:
   `DecodeRunner.sample`);
4. queues the prefills of the rows parked in step 1 directly through the engine's prefill runner (no `generate`
   call: its host work would cost more than the prefill), several prompts per launch, padded on the left within
   groups of one kind, from their images' features (most encoded ahead, step 6); a prompt longer than the budget is
   prefilled a budget per turn instead. On a GPU they run on the model's side stream, after the parking only, beside
   the chunk just queued (which the GPU runs while the host issues them) and the ones after it: a request entering
   does not hold up the rows decoding;
5. takes new requests in while the GPU runs that chunk (`_prepare`, on the host: inputs checked, settings resolved,
   M-RoPE positions computed unless the request brings them; a bad request fails alone here, before anything is
   written), as many as keep two
   prefill budgets waiting, and cancellations (an idle batch takes them in first, waiting for them);
6. runs the vision tower over the images of the requests next in line, on the side stream beside that chunk;
7. reads the chunk queued one turn before (so the GPU always has the next chunk while the host reads one), ends each
   request by its own rules (EOS ids, max_new_tokens, stop strings, cancellation) and streams tokens.
No graph is captured per request: decode graphs are keyed by (batch bucket, KV bucket, mode), and the row is data.
The prefill graphs have a memory pool, capture stream and kernel counters of their own (`GraphEngine`), as two
graphs replaying at once must not share them.

The manager's API is transformers' `ContinuousBatchingManager`'s (`init_continuous_batching()`, `start`,
`add_request(..., streaming=...)`, `get_result`, `request_id_iter`, `register_result_handler`, `cancel_request`,
`stop`, `generate_batch`) and its results are transformers' own `GenerationOutput`s.
"""

import asyncio
import itertools
import math
import queue
import threading
import time
from collections import deque
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers.generation.continuous_batching.requests import GenerationOutput, RequestStatus
from transformers.utils import logging
from transformers.utils.logging import tqdm

from .cache_qwen3vl_graph import kv_heads_and_dim
from .compat_qwen3vl_graph import generate_position_ids, media_features, prompt_positions
from .decode_qwen3vl_graph import PENALIZED, split_mode
from .loops_qwen3vl_graph import TOP_K_CANDIDATES, first_tokens
from .runner_qwen3vl_graph import bucket_of, collected, copy_to_host, to_device
from .scheduler_qwen3vl_graph import NO_PENALTIES, Scheduler, Sequence

logger = logging.get_logger(__name__)

# Generation settings a request may set for itself; its other keywords are model inputs (the processor's outputs).
REQUEST_SETTINGS = ("max_new_tokens", "do_sample", "temperature", "top_k", "top_p", "min_p", "seed", "eos_token_id",
                    "stop_strings", "repetition_penalty", "presence_penalty", "frequency_penalty")
# Settings that make a request sample when it sets them and not `do_sample` (as a server's client expects).
SAMPLING_SETTINGS = ("temperature", "top_k", "top_p", "min_p", "seed")
# Penalties (a request's or the generation config's; none by default): transformers' repetition penalty over the
# prompt and the answer, OpenAI's presence and frequency penalties over the answer (`Penalties` in the decode runner).
PENALTIES = ("repetition_penalty", "presence_penalty", "frequency_penalty")
# Model inputs one request may carry: token rows (padded on the left when prompts enter together, with these values;
# None: the pad token id) and media (joined in row order).
PADDED_INPUTS = {"input_ids": None, "attention_mask": 0, "mm_token_type_ids": 0}
JOINED_INPUTS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")
BATCH_MODES = ("greedy", "sample_seeded", "sample_top_k_seeded")  # `batch_mode`'s without penalties
PIXELS = ("pixel_values", "pixel_values_videos")  # the tower's inputs: they leave a request once it is encoded
DEFAULT_MAX_PREFILL_TOKENS = 8192
# Prefill budgets of prompts kept checked and waiting, their images encoded ahead: a turn admits one budget, and the
# next one's images are encoded meanwhile.
AHEAD_BUDGETS = 2
# Prompt tokens a prefill beside the decode steps gets through per step (`SideWork`). A step takes longer the more rows
# it has, and more runs beside it. On an H200 (2B): at 64 server clients prefills of 5.7 image prompts (1,460 tokens
# padded) took 10.0 ms beside steps of about 64 rows and 2.8 ms, about 400 tokens a step; alone with the steps, an
# 8 x 256-token prefill spans about 4 steps of 64 rows (2.4 ms each) and 2 of 256 (4.9 ms). The lower figure is taken:
# a row that begins early stops the decoding rows until its prefill is through, one that begins a step late only
# waits that step.
PREFILL_TOKENS_PER_STEP = 200
PREFILL_TOKENS_PER_STEP_ROW = 3
# The vision tower's work in prompt tokens per feature it makes: on an H200 eight 448x448 images (1,568 features) take
# the tower 9.07 ms, eight 256-token prompts the prefill 9.40 ms.
TOWER_TOKENS_PER_FEATURE = 1.25
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
MAX_SLOTS = 512  # past this many rows a step's KV reads grow with the rows and tokens/s no longer does
LONG_STALL_MS = 10  # a gap between decode chunks this long holds every decoding stream's next token as long
# While requests stream, a turn's own host work (taking requests in, encoding their media ahead) stops after this long,
# at least one request and one group of media done: the tokens of the chunk queued a turn before reach their clients
# only after it, so a wave of arrivals is spread over several turns instead of holding every stream's next token.
TURN_HOST_S = 0.003
MEDIA_AHEAD_GROUP = 4  # requests whose media one tower call encodes ahead while a turn's host time is bounded
# Streaming requests that arrive while many rows decode wait a moment to enter together: each prefill beside the
# decode steps slows every decoding row for as long as it runs, and a prefill of a few prompts costs nearly as much as
# one of many. They wait until they hold this share of a prefill budget or the oldest has waited GATHER_S, and only
# beside GATHER_MIN_DECODING_ROWS or more: with fewer, a prefill costs the decoding rows little and the wait is all
# TTFT. (H100, 448-pixel image chats, `bench --server`: at 64 clients 13,669-13,736 output tok/s and inter-token p99
# 9.6-13.1 ms against 12,806-12,908 and 12.7-14.2 without waiting; at 16 clients waiting beside any decoding row
# took TTFT p50 from 46 to 83 ms, beside 32 or more it stayed at 40.)
GATHER_BUDGET_SHARE = 0.25
GATHER_S = 0.025
GATHER_MIN_DECODING_ROWS = 32


def kv_bytes_per_slot(config, dtype: torch.dtype) -> int:
    """Bytes of K and V one cache slot holds across the layers."""
    kv_heads, head_dim = kv_heads_and_dim(config)
    layers = config.get_text_config(decoder=True).num_hidden_layers
    return 2 * layers * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def media_bytes_per_token(config, dtype: torch.dtype) -> int:
    """Bytes of the vision features one image or video placeholder token takes once encoded: its merged feature and
    one per DeepStack layer, in the model's `dtype`."""
    vision = config.vision_config
    features = 1 + len(vision.deepstack_visual_indexes)
    return features * vision.out_hidden_size * torch.empty((), dtype=dtype).element_size()


def steps_past_end(steps_per_sync: int) -> int:
    """Steps a row may run past its request's end: the rest of its chunk and the chunk queued after it."""
    return 2 * steps_per_sync


def batch_mode(sequences) -> str:
    """The decode mode that serves these sequences' rows (each its own `Sequence.mode`): greedy only when every row is
    (a greedy row among sampled ones samples with top-k 1, its argmax); penalized when any row sets a penalty (the
    others have none, which leaves their logits as they are)."""
    modes = {sequence.mode for sequence in sequences}
    if modes == {"greedy"}:
        mode = "greedy"
    else:
        mode = "sample_seeded" if "sample_seeded" in modes else "sample_top_k_seeded"
    return mode + PENALIZED if any(sequence.penalized for sequence in sequences) else mode


def device_memory(device) -> tuple | None:
    """(free, total) bytes of `device`, or None where there is no such figure (the CPU)."""
    if torch.device(device).type != "cuda":
        return None
    return torch.cuda.mem_get_info(device)


def slots_from_memory(free: int, total: int, held: int, slot_bytes: int, cache_len: int, gpu_memory_utilization: float,
                      max_prefill_tokens: int, requests: int | None = None, media_bytes: int = 0) -> tuple:
    """(rows, why): how many cache rows of `cache_len` slots fit in `gpu_memory_utilization` of the device's `total`
    memory, given what is `free` and the bytes of the cache it replaces (`held`), leaving room for a prefill of
    `max_prefill_tokens` (64 KiB a token: its activations), the features of the images encoded ahead
    (`AHEAD_BUDGETS` of tokens, `media_bytes` a token) and 1 GiB of graphs and workspace; at most MAX_SLOTS rows and
    `requests` (when known)."""
    in_use = total - free - held
    reserve = max_prefill_tokens * (64 * 1024 + AHEAD_BUDGETS * media_bytes) + 2**30
    budget = int(total * gpu_memory_utilization) - in_use - reserve
    fit = max(0, budget // (slot_bytes * cache_len))
    rows = min(fit, MAX_SLOTS, requests or MAX_SLOTS)
    why = (f"{fit} rows of {cache_len} slots ({slot_bytes * cache_len / 2**20:.0f} MiB each) fit in "
           f"{budget / 2**30:.1f} GiB: gpu_memory_utilization={gpu_memory_utilization} of {total / 2**30:.1f} GiB, less "
           f"{in_use / 2**30:.1f} GiB in use and {reserve / 2**30:.1f} GiB kept for prefill, image features and graphs")
    if rows < fit:
        why += f"; {rows} used ({'the requests' if rows == requests else f'at most {MAX_SLOTS}'})"
    return rows, why


class StreamingSteps:
    """Decode steps per chunk while some running request streams. A chunk's tokens reach their clients when the host
    reads the chunk, so one step per chunk sends each token as it is drawn, where `steps_per_sync` would send them in
    bursts; but every chunk costs the host a read and the clients an output each. So: as few steps as the host and
    the clients keep up with. Doubles (up to `steps_per_sync`) when they fell behind the GPU (it had run out of queued
    work by the time the host queued more, or an event loop had not yet run the outputs handed to it a chunk
    before), one step fewer when they kept up; without a measure (no CUDA events) it stays put."""

    def __init__(self, most: int):
        self.most, self.steps = most, 1

    def next(self, behind: bool | None) -> int:
        if behind is not None:
            self.steps = min(self.most, 2 * self.steps) if behind else max(1, self.steps - 1)
        return self.steps


class _Delivery:
    """One chunk's outputs for the result handlers of one event loop, handed over in one wake-up of the loop (not one
    per output); `taken` once they ran."""

    def __init__(self, calls: list):
        self.calls, self.taken = calls, False

    def run(self) -> None:
        for callback, output in self.calls:
            try:
                callback(output)
            except Exception:  # noqa: BLE001 - one handler's failure is its own; the others still get theirs
                logger.exception(f"The result handler of {output.request_id} failed")
        self.taken = True


@dataclass
class _Chunk:
    """Work queued on the batch's stream whose results the host has not read yet."""

    handle: object  # `DecodeRunner.issue`'s, None when no decode steps were queued
    owners: dict  # row -> Sequence when the steps were queued
    steps: int
    entered: list  # sequences whose rows began decoding before the steps, their first tokens in `first_tokens`
    first_tokens: object = None
    events: tuple = ()  # CUDA timing events before and after the decode steps
    done: object = None  # a CUDA event after all of its work

    def finished(self) -> bool | None:
        """Whether the device has run all of it (None: no event to tell)."""
        return None if self.done is None else self.done.query()


@dataclass(eq=False)
class _Prefilled:
    """Prompts queued into their rows (on a GPU, on the side stream while the rows step inert): what their rows need to
    begin decoding once the prefill is done."""

    part: list  # their sequences, in the prefill's row order
    logits: torch.Tensor  # of their last positions
    attention_mask: torch.Tensor  # `(b, length)`, on the host: zeros for the left padding
    next_positions: torch.Tensor  # their first tokens' M-RoPE positions `(3, b)`, on the host
    done: object = None  # the CUDA event after the prefill (None: the CPU's one stream, done)
    mark: float = 0.0  # `SideWork.queued` once it was queued: through once the work up to there is covered


def prefill_tokens_per_step(rows: int, side) -> float:
    """Prompt tokens the `side` stream gets through per decode step of `rows` rows queued beside it; unbounded on the
    CPU's one stream (None), where work is done once queued."""
    return math.inf if side is None else PREFILL_TOKENS_PER_STEP + PREFILL_TOKENS_PER_STEP_ROW * rows


class SideWork:
    """The work queued on the model's `side` stream (prefills; the vision tower, `TOWER_TOKENS_PER_FEATURE` a feature)
    that the decode steps queued beside it have not yet covered, in prompt tokens: when the side stream is through it,
    counted in decode steps rather than found by the host, for a batch whose schedule must not depend on timing. The
    stream runs its work in order: a prefill is through once everything queued before it is, so it counts from there
    (its `mark`: the work queued up to and with it). Decode steps cover work queued before them or beside them, never
    ahead of it (an idle side stream banks nothing).
    """

    def __init__(self, side):
        self.side, self.queued, self.covered = side, 0.0, 0.0

    def add(self, tokens: float) -> None:
        """Work queued now."""
        self.queued += tokens

    def through(self, mark: float) -> bool:
        return self.covered >= mark

    def stepped(self, steps: int, rows: int) -> None:
        """`steps` decode steps of `rows` rows were queued beside the work queued so far."""
        if steps:
            self.covered = min(self.queued, self.covered + steps * prefill_tokens_per_step(rows, self.side))

    def waited(self, mark: float) -> None:
        """The batch's stream waits on the GPU for the work up to `mark`."""
        self.covered = max(self.covered, mark)


def gathers(waiting, decoding_rows: int, max_prefill_tokens: int, now: float) -> bool:
    """Whether the `waiting` requests (in arrival order) wait longer to enter together, beside `decoding_rows` decoding
    rows, at time `now` (`time.perf_counter()`): all of them stream, they hold less than GATHER_BUDGET_SHARE of a
    prefill budget and the oldest has waited less than GATHER_S, beside at least GATHER_MIN_DECODING_ROWS."""
    return (bool(waiting) and decoding_rows >= GATHER_MIN_DECODING_ROWS
            and all(sequence.streaming for sequence in waiting)
            and sum(sequence.prompt_len for sequence in waiting) < GATHER_BUDGET_SHARE * max_prefill_tokens
            and now - waiting[0].taken_in < GATHER_S)


def joins_now(prefilled: _Prefilled, side_work: SideWork, follows_timing: bool) -> bool:
    """Whether the rows of a prefill queued beside decoding rows may begin decoding now. While a request streams the
    batch's chunks already follow the GPU's timing (`StreamingSteps`), so the rows begin as soon as the host finds the
    prefill done on the device: no later, as their first token waits for it, and no earlier, as the decoding rows
    would wait for it on the GPU. Otherwise once the steps queued beside it cover the side stream's work up to it
    (`SideWork`), so that a batch's schedule, and with it each row's rounding, is the same every run."""
    if follows_timing and prefilled.done is not None:
        return prefilled.done.query()
    return side_work.through(prefilled.mark)


class GraphBatchingManager:
    """Continuous batching of one model's requests on its graph engine (see the module docstring). A background
    thread runs the batch from `start()` to `stop()`, holding the model for the whole time (`generate` calls from
    other threads wait); `stop()` lets every request already added finish first."""

    def __init__(self, model, generation_config=None, max_queue_size: int = 0,
                 max_prefill_tokens: int = DEFAULT_MAX_PREFILL_TOKENS, tokenizer=None, pixel_transform=None):
        if max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens must be positive, got {max_prefill_tokens}")
        self.model = model
        self.generation_config = generation_config if generation_config is not None else model.generation_config
        self.max_prefill_tokens = max_prefill_tokens
        self.tokenizer = tokenizer  # decodes the tail of an answer for requests with stop strings
        # Applied on the device to the requests' image pixels as the tower takes them (`_encode`): a server hands over
        # raw uint8 patches and normalizes them on the GPU.
        self.pixel_transform = pixel_transform
        self.input_queue = queue.Queue(max_queue_size)
        self.output_queue = queue.Queue()
        self._cancelled = queue.SimpleQueue()
        self._cancelled_queued = set()  # ids of requests cancelled while still in `input_queue` (the batch's thread's)
        self._streams = {}  # request id -> its queue of outputs (streaming requests)
        self._handlers = {}  # request id -> (callback, event loop or None, delta)
        self._lock = threading.Lock()
        self._request_ids = itertools.count()
        self._outbox = None  # (loop, callback, output) of the chunk being read, handed over together
        self._handed = []  # the `_Delivery`s of the last chunk read
        self._clients_behind = False  # an event loop had not run the outputs of the chunk before the last one read
        self._stopping = threading.Event()
        self._thread = None
        self.error = None  # what ended the batch itself, if anything did
        # Where a run's time went (CUDA): GPU ms in prefills and in decode chunks, GPU ms that decoding rows waited for
        # prefills as their rows began decoding (they began before the prefill's end) and from a prefill's end to its
        # rows beginning (time the rows could have decoded), host ms waiting for the GPU, issuing admissions, taking
        # requests in (their checks and positions) after a turn's work is queued and issuing the vision tower ahead,
        # decode steps, row-steps queued (rows covered x steps) and of them held by a request, prefill launches (of them
        # run eagerly for want of a graph, and launched while rows decoded: beside them) and the requests they
        # admitted, the ms the admitted requests waited from `add_request` to their prefill's launch (of it, in the
        # input queue until this thread took them in) and from it to the host reading their first token (any device),
        # requests with images encoded ahead (beside a chunk) and at their admission, and the GPU time between two
        # decode chunks while requests went on decoding (`stall_ms`: no step queued for them; `long_stalls`: gaps of
        # LONG_STALL_MS or more), and the turns that held waiting requests back to enter together (`gathers`).
        self.stats = dict.fromkeys(("prefill_ms", "decode_ms", "activation_wait_ms", "activation_slack_ms",
                                    "host_wait_ms", "admit_host_ms", "take_in_ms", "media_ahead_host_ms", "chunks",
                                    "steps", "row_steps", "request_steps", "prefills", "eager_prefills",
                                    "prefills_beside", "admitted", "admission_wait_ms", "queued_ms", "first_token_ms",
                                    "encoded_ahead", "encoded_at_admission", "stall_ms", "long_stalls",
                                    "gathering_turns"), 0)
        self._spans = deque()  # (stat, CUDA event before, after) of GPU time not in `stats` yet (`_count_spans`)
        self._last_chunk = None  # (its end event, its requests' sequences) of the last decode chunk timed
        self._side_work = SideWork(None)  # the batch's (`_loop`)

    # -- transformers' manager API --------------------------------------------------------------------------

    def warmup(self) -> float:
        """Capture ahead what the batch replays, so that no request waits for a graph capture or a kernel measurement:
        the decode step of every batch bucket and cache length in the greedy and both sampling modes, and the prefills
        within the graph budget (`model.warmup`; a new image size's tower graph is still captured on first use).
        Returns the seconds it took (0 where graphs are not used)."""
        return self.model.warmup(modes=BATCH_MODES)

    def start(self) -> None:
        if self.is_running():
            return
        self._stopping.clear()
        self._thread = threading.Thread(target=self._run, name="qwen3vl-static-batching", daemon=True)
        self._thread.start()

    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self, block: bool = True, timeout: float | None = None) -> None:
        """Finish the requests added so far, then end the batch."""
        self._stopping.set()
        if block:
            self.join(timeout)

    def join(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def add_request(self, input_ids, request_id: str | None = None, max_new_tokens: int | None = None,
                    streaming: bool = False, record_timestamps: bool = False, **kwargs) -> str:
        """Queue one request: `input_ids` (a list of ids, or a `(n,)` / `(1, n)` tensor, best on the CPU); `kwargs`
        are its own generation settings (`REQUEST_SETTINGS`) and its model inputs (the processor's `pixel_values`,
        `image_grid_thw`, ... for this one prompt; optionally its M-RoPE `position_ids` from `prompt_position_ids`,
        computed off the batch's thread). `streaming`: its tokens are delivered as they are drawn (through
        `request_id_iter` or a registered handler), each output holding every token so far. `record_timestamps`: its
        output's `timestamps` hold, per generated token, the `time.perf_counter()` at which the host read it (its
        `created_time` is when it was added). Returns its request id."""
        # Nothing here touches the device: a CUDA call from this thread would break a graph that the batch's thread
        # may be capturing. The batch's thread checks the request when it takes it in.
        if request_id is None:
            request_id = f"req_{next(self._request_ids)}"
        output = GenerationOutput(request_id=request_id)
        output.created_time = time.perf_counter()  # (4.57's output has no such field)
        output.timestamps = [] if record_timestamps else None
        settings = {key: kwargs.pop(key) for key in REQUEST_SETTINGS if key in kwargs}
        if max_new_tokens is not None:
            settings["max_new_tokens"] = max_new_tokens
        if streaming:
            self._streams[request_id] = queue.Queue()
        self.input_queue.put((output, input_ids, kwargs, settings, streaming))
        return request_id

    def add_requests(self, inputs, **kwargs) -> list:
        """`add_request` for each of `inputs` (token ids, or a dict of one prompt's processor outputs), `kwargs` for
        every one of them."""
        return [self.add_request(**_as_request(item), **kwargs) for item in inputs]

    def cancel_request(self, request_id: str) -> None:
        """Cancel a request: a waiting one never starts, a running one frees its row at the next chunk. Its result
        (status FAILED, error "cancelled") holds the tokens drawn until then."""
        self._cancelled.put(request_id)

    def get_result(self, request_id: str | None = None, timeout: float | None = None) -> GenerationOutput | None:
        """The next finished request (of id `request_id`, when given) within `timeout` seconds, else None. Raises
        what ended the batch, if something did."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self.error is not None:
                raise RuntimeError("the continuous batch stopped on an error") from self.error
            wait = 0.05 if deadline is None else max(0.0, min(0.05, deadline - time.monotonic()))
            try:
                result = self.output_queue.get(timeout=wait)
            except queue.Empty:
                if (deadline is not None and time.monotonic() >= deadline) or not self.is_running():
                    if self.error is not None:
                        continue
                    return None
                continue
            if request_id is None or result.request_id == request_id:
                return result
            self.output_queue.put(result)

    def request_id_iter(self, request_id: str):
        """The outputs of one request as they come (a streaming request's after every chunk, each with every token so
        far; otherwise its result), until it is finished or failed."""
        stream = self._streams.get(request_id)
        while True:
            if stream is None:
                result = self.get_result(request_id, timeout=0.1)
            else:
                try:
                    result = stream.get(timeout=0.1)
                except queue.Empty:
                    result = None
            if result is not None:
                yield result
                if result.status in (RequestStatus.FINISHED, RequestStatus.FAILED):
                    self._streams.pop(request_id, None)
                    return
            elif self.error is not None:
                raise RuntimeError("the continuous batch stopped on an error") from self.error
            elif not self.is_running() and (stream is None or stream.empty()):
                return

    def register_result_handler(self, request_id: str, callback, delta: bool = False) -> None:
        """Call `callback(output)` with each output of the request (streaming: after every chunk; else its result):
        on the caller's asyncio event loop when one is running (as transformers' manager), else on the batch's thread
        (keep it short). Removed when the request ends. `delta`: each output's `generated_tokens` holds only the
        tokens new since the one before (as vLLM's DELTA outputs), not every token so far, whose copy grows with the
        answer at every chunk; the last output's status says it ended."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        with self._lock:
            self._handlers[request_id] = (callback, loop, delta)

    def __iter__(self):
        """Results as they finish, until the batch has stopped and every result is taken."""
        while self.is_running() or not self.output_queue.empty():
            result = self.get_result(timeout=0.1)
            if result is not None:
                yield result

    def generate_all(self, inputs, progress_bar: bool = True, **kwargs) -> dict:
        """Run `inputs` (as `add_requests` takes them) to the end: {request id: GenerationOutput}, in input order."""
        ids = self.add_requests(inputs, **kwargs)  # all queued before the batch starts: the first rows fill at once
        self.start()
        self.stop(block=False)
        results = {}
        with tqdm(total=len(ids), desc="Generating", unit="request", disable=not progress_bar) as bar:
            began, tokens = time.perf_counter(), 0
            for result in self:
                results[result.request_id] = result
                tokens += len(result.generated_tokens)
                bar.update(1)
                bar.set_postfix(tokens_per_s=f"{tokens / max(time.perf_counter() - began, 1e-9):.0f}")
        self.join()
        if self.error is not None:
            raise RuntimeError("the continuous batch stopped on an error") from self.error
        return {request_id: results[request_id] for request_id in ids}

    # -- delivery -------------------------------------------------------------------------------------------

    def _deliver(self, sequence: Sequence, final: bool) -> None:
        """Hand out the request's output: a snapshot after a chunk (streaming), or its result; to a `delta` handler,
        the tokens new since its last output."""
        output = sequence.output
        since, sequence.delivered = sequence.delivered, len(output.generated_tokens)
        with self._lock:
            handler = self._handlers.pop(output.request_id, None) if final else self._handlers.get(output.request_id)
        if handler is not None and handler[2]:
            output = _snapshot(output, since)
        elif not final:
            output = _snapshot(output)
        if handler is not None:
            if final:  # the handler took every output: nothing waits on the request's queue
                self._streams.pop(output.request_id, None)
            callback, loop, _ = handler
            if loop is None:
                callback(output)
            elif self._outbox is not None:
                self._outbox.append((loop, callback, output))
            else:
                loop.call_soon_threadsafe(callback, output)
        elif sequence.streaming:
            self._streams[output.request_id].put(output)
        else:
            self.output_queue.put(output)

    def _end(self, sequence: Sequence, scheduler, status, error=None) -> None:
        output = sequence.output
        output.status, output.error = status, error
        scheduler.finish(sequence)
        self._deliver(sequence, final=True)

    # -- the batch ------------------------------------------------------------------------------------------

    def _run(self) -> None:
        model = self.model
        scheduler = None
        try:
            with model._generate_lock, model.backend_flags(), torch.no_grad():
                engine = model.graph_engine()
                scheduler = Scheduler(engine.cache.rows, self.max_prefill_tokens)
                try:
                    self._loop(engine, scheduler)
                finally:
                    engine.decode.idle()
                    engine.cache.clear()
        except Exception as error:  # noqa: BLE001 - every waiting caller sees it
            logger.error(f"The continuous batch stopped: {error!r}")
            self.error = error
            message = f"the continuous batch stopped: {type(error).__name__}: {error}"
            pending = [] if scheduler is None else [*scheduler.waiting, *scheduler.running.values()]
            while True:
                try:
                    pending.append(self._prepare(*self.input_queue.get_nowait(), engine=None))
                except queue.Empty:
                    break
                except ValueError:
                    continue
            for sequence in pending:
                if sequence is not None and not sequence.done:
                    sequence.done = True
                    sequence.output.status, sequence.output.error = RequestStatus.FAILED, message
                    self._deliver(sequence, final=True)

    def _loop(self, engine, scheduler) -> None:
        runner = engine.decode
        runner.open_slots(self.generation_config.pad_token_id)
        in_flight, streaming_steps = deque(), StreamingSteps(runner.steps_per_sync)
        timed = engine.device.type == "cuda"
        side = engine.capturer.side_stream() if timed else None  # where prefills run, beside the decode chunks
        side_work = self._side_work = SideWork(side)
        prefilled = []  # `_Prefilled` prompts whose rows do not decode yet
        while True:
            if not (scheduler.has_work() or in_flight):
                self._count_spans(wait=True)  # all read: nothing is left running to wait for
                self._take_in(scheduler, engine, wait=True)
            # A long prompt's next chunk takes the turn's prefill budget; else waiting requests enter, while rows are
            # in use only once their images are encoded (ahead, beside a chunk): no prefill waits for the tower.
            prefilling = [sequence for sequence in scheduler.running.values() if sequence.prefilling]
            busy = len(prefilling) < len(scheduler.running)
            decoding_count = sum(sequence.decoding for sequence in scheduler.running.values())
            # Only a turn with a free row holds anyone back (without one, none would enter anyway).
            if prefilling or not scheduler.free or not gathers(scheduler.waiting, decoding_count,
                                                               self.max_prefill_tokens, time.perf_counter()):
                entered = prefilling[:1] or scheduler.schedule(_encoded if busy else None)
            else:
                entered = []
                self.stats["gathering_turns"] += 1
            decoding_rows = decoding_count > 0
            gpu_idle = in_flight[-1].finished() if in_flight else None  # before this turn queues anything
            behind = None if gpu_idle is None else gpu_idle or self._clients_behind
            # The entering rows are parked now, on the batch's stream, and step inert in the chunk queued next; their
            # prefills, whose host work takes longer, are queued after that chunk (on the side stream, after the
            # parking only), so that the GPU runs the chunk while the host issues them.
            parts = self._parts(entered, engine)
            parked = _event() if parts and side is not None else None
            # Prompts prefilled beside decoding rows join them once their prefill is through (`joins_now`), or at
            # once when no row decodes; the batch's stream waits for the prefill on the GPU.
            ready = prefilled
            if prefilled and decoding_rows:
                follows_timing = any(sequence.streaming for sequence in scheduler.running.values())
                ready = [part for part in prefilled if joins_now(part, side_work, follows_timing)]
            chunk = None
            if ready:
                prefilled = [part for part in prefilled if part not in ready]
                chunk = _Chunk(None, {}, 0, *self._activate(ready, engine, decoding_rows))
                side_work.waited(max(part.mark for part in ready))
            decoding = {row: sequence for row, sequence in scheduler.running.items() if sequence.decoding}
            streams = any(sequence.streaming for sequence in decoding.values())
            steps = streaming_steps.next(behind) if streams else runner.steps_per_sync
            if decoding:
                order = scheduler.compact(lambda rows: bucket_of(runner.batch_buckets, rows))
                if order is not None:
                    runner.reorder(order)
                    decoding = {row: sequence for row, sequence in scheduler.running.items() if sequence.decoding}
                # Parked rows step from their prompt's end (back there every chunk), as the others from theirs.
                runner.continue_rows(scheduler.active_rows(),
                                     max(sequence.length for sequence in scheduler.running.values()))
                mode = batch_mode(decoding.values())
                chunk = chunk or _Chunk(None, {}, 0, [])
                before = _event() if timed else None
                chunk.handle, chunk.owners, chunk.steps = runner.issue(steps, mode), decoding, steps
                for sequence in decoding.values():
                    sequence.length += steps
                if timed:
                    chunk.events = (before, _event())
                    chunk.done = chunk.events[-1]
                    self._spans.append(("decode_ms", *chunk.events))
                    self._time_stall(chunk)
                self.stats["chunks"] += 1
                self.stats["steps"] += steps
                self.stats["row_steps"] += runner.batch_size * steps
                self.stats["request_steps"] += len(decoding) * steps
            elif chunk is not None and timed:
                chunk.done = _event()
            if chunk is not None:
                in_flight.append(chunk)
            if parts:
                began, eager = time.perf_counter(), engine.prefill.eager_runs
                launched = self._enter(parts, engine, scheduler, side, parked)
                prefilled += launched
                self.stats["admit_host_ms"] += 1000 * (time.perf_counter() - began)
                self.stats["eager_prefills"] += engine.prefill.eager_runs - eager
                self.stats["prefills_beside"] += len(launched) if decoding else 0
            began = time.perf_counter()
            until = began + TURN_HOST_S if decoding and streams else None
            self._take_in(scheduler, engine, wait=False, until=until)  # while the GPU runs what was just queued
            taken = time.perf_counter()
            self._media_ahead(scheduler, engine, until)
            self.stats["take_in_ms"] += 1000 * (taken - began)
            self.stats["media_ahead_host_ms"] += 1000 * (time.perf_counter() - taken)
            if decoding:  # the chunk's steps run beside what the side stream holds, this turn's prefills and tower too
                side_work.stepped(steps, runner.batch_size)
            # One chunk stays queued while the host reads the one before; with nothing new queued, read them all.
            while len(in_flight) > (1 if chunk is not None else 0):
                self._read(in_flight.popleft(), scheduler, runner)
            if not in_flight and not scheduler.has_work() and self._stopping.is_set() and self.input_queue.empty():
                self._count_spans(wait=True)
                return

    def _take_in(self, scheduler, engine, wait: bool, until: float | None = None) -> None:
        """New requests into the scheduler, each checked (a bad one fails here, alone), while the waiting ones' prompts
        hold fewer than `AHEAD_BUDGETS` prefill budgets (what the next admissions and the media ahead look at): a long
        queue is checked a little each turn, while the GPU runs a chunk, not all of it before the first admission.
        Then cancellations (`wait`: for the first request, a moment; `until`: a `perf_counter` time past which no
        further request is taken in this turn)."""
        waiting, taken = sum(sequence.prompt_len for sequence in scheduler.waiting), 0
        while waiting < AHEAD_BUDGETS * self.max_prefill_tokens and not (
                taken and until is not None and time.perf_counter() > until):
            try:
                item = self.input_queue.get(timeout=0.05) if wait else self.input_queue.get_nowait()
            except queue.Empty:
                break
            wait = False
            if item[0].request_id in self._cancelled_queued:
                self._cancelled_queued.discard(item[0].request_id)
                self._fail_unprepared(item, "cancelled")
                continue
            try:
                sequence = self._prepare(*item, engine=engine)
            except Exception as error:  # noqa: BLE001 - this request's result names it; the others go on
                self._fail_unprepared(item, f"{type(error).__name__}: {error}")
                continue
            sequence.taken_in = time.perf_counter()
            scheduler.add(sequence)
            waiting += sequence.prompt_len
            taken += 1
        while True:
            try:
                request_id = self._cancelled.get_nowait()
            except queue.Empty:
                break
            sequence = scheduler.find(request_id)
            if sequence is None:
                if self._queued(request_id):
                    self._cancelled_queued.add(request_id)
                continue
            if sequence in scheduler.waiting or sequence.prefilling:
                if sequence.row is not None:
                    engine.decode.release(sequence.row)
                self._end(sequence, scheduler, RequestStatus.FAILED, "cancelled")
            else:
                sequence.cancelled = True  # its row frees when the chunks queued for it are read

    def _queued(self, request_id: str) -> bool:
        """Whether request `request_id` is still in `input_queue` (added, not taken in yet)."""
        with self.input_queue.mutex:
            return any(item[0].request_id == request_id for item in self.input_queue.queue)

    def _fail_unprepared(self, item: tuple, error: str) -> None:
        """A request ended before it was taken in (`item` as `add_request` queued it): failed with `error`."""
        output, streaming = item[0], item[4]
        output.status, output.error = RequestStatus.FAILED, error
        self._deliver(Sequence(output, {}, None, 0, streaming=streaming), final=True)

    def _media_ahead(self, scheduler, engine, until: float | None = None) -> None:
        """The images and videos of the requests next in line (`AHEAD_BUDGETS` prefill budgets) encoded now, on the
        tower's stream while the GPU runs the decode chunk just queued: their prefill then starts from the
        features. `until`: a `perf_counter` time past which no further group of `MEDIA_AHEAD_GROUP` requests is
        encoded this turn (else all in one call). A request whose media cannot be encoded fails alone."""
        upcoming = scheduler.upcoming(AHEAD_BUDGETS * self.max_prefill_tokens)
        pending = [sequence for sequence in upcoming if _unencoded(sequence)]
        group = len(pending) if until is None else MEDIA_AHEAD_GROUP
        for first in range(0, len(pending), max(group, 1)):
            if first and time.perf_counter() > until:
                return
            part = pending[first:first + group]
            try:
                self._encode(part, engine, ahead=True)
            except Exception:  # noqa: BLE001 - one by one: only a bad request fails
                for sequence in part:
                    try:
                        self._encode([sequence], engine, ahead=True)
                    except Exception as error:  # noqa: BLE001 - this request's result names it; the others go on
                        self._end(sequence, scheduler, RequestStatus.FAILED, f"{type(error).__name__}: {error}")

    def _encode(self, sequences: list, engine, ahead: bool) -> None:
        """The vision tower over `sequences`' images and videos in one call, on the tower's stream (a CUDA device):
        each sequence's share of the features becomes its `media`, done when `media_done` is (`_media_of` waits); its
        pixels leave it. `ahead`: beside a decode chunk, not at their admission (counted apart). The tower has a
        stream of its own, so that a prefill waits for its own requests' features only, not behind the tower's work
        for the requests after it (its graphs have a pool and counters of their own)."""
        if not sequences:
            return
        device = engine.device
        tower = engine.capturer.tower_stream() if device.type == "cuda" else None
        with torch.cuda.stream(tower) if tower is not None else nullcontext():
            joined = {}
            for key in JOINED_INPUTS:  # each copied on its own (no join on the host), then joined on the device
                parts = [_to_device_but_grids(key, sequence.prompt[key], device) for sequence in sequences
                         if key in sequence.prompt]
                if parts:
                    joined[key] = torch.cat(parts) if len(parts) > 1 else parts[0]
                    if key == "pixel_values" and self.pixel_transform is not None:
                        joined[key] = self.pixel_transform(joined[key])
            media = media_features(self.model, joined)
            done = _event() if tower is not None else None
        unit = self.model.config.vision_config.spatial_merge_size ** 2
        shares = [[] for _ in sequences]
        for kind, token, features, deepstack in media:
            grids = f"{kind}_grid_thw"  # on the host
            sizes = [int(sequence.prompt[grids].prod(-1).sum()) // unit if grids in sequence.prompt else 0
                     for sequence in sequences]
            for share, piece, *layers in zip(shares, features.split(sizes), *(layer.split(sizes) for layer in deepstack)):
                if piece.shape[0]:
                    share.append((kind, token, piece, layers))
            self._side_work.add(TOWER_TOKENS_PER_FEATURE * sum(sizes))
        for sequence, share in zip(sequences, shares):
            sequence.media, sequence.media_done = share, done
            for key in PIXELS:
                sequence.prompt.pop(key, None)
        self.stats["encoded_ahead" if ahead else "encoded_at_admission"] += len(sequences)

    def _media_of(self, sequences: list, engine) -> list:
        """`sequences`' encoded media (encoded now where they were not ahead) joined per kind in row order, as a
        prefill gathers them (images, then videos), the current stream waiting for their encoding."""
        self._encode([sequence for sequence in sequences if _unencoded(sequence)], engine, ahead=False)
        if engine.device.type == "cuda":  # before anything here reads them (the joins below too)
            stream = torch.cuda.current_stream()
            for done in {id(sequence.media_done): sequence.media_done for sequence in sequences
                         if sequence.media_done is not None}.values():
                stream.wait_event(done)
            for sequence in sequences:  # made on the tower's stream, read here: not reused until this one is done
                for _, _, features, layers in sequence.media or ():
                    for tensor in (features, *layers):
                        tensor.record_stream(stream)
        joined = []
        for kind in ("image", "video"):
            parts = [(token, features, layers) for sequence in sequences for each, token, features, layers
                     in sequence.media or () if each == kind]
            if len(parts) == 1:  # a request alone (a long prompt's every chunk): no copy
                joined.append((kind, *parts[0]))
            elif parts:
                joined.append((kind, parts[0][0], torch.cat([features for _, features, _ in parts]),
                               [torch.cat(layer) for layer in zip(*(layers for _, _, layers in parts))]))
        return joined

    def _prepare(self, output, input_ids, inputs, settings, streaming, engine) -> Sequence:
        """A request as added, checked and resolved on the host: its inputs, its settings against the batch's
        generation config, its length against the cache, its prompt's M-RoPE positions. Raises what is wrong."""
        if engine is None:  # the batch stopped: only its output is needed
            return Sequence(output, {}, None, 0, streaming=streaming)
        ids = torch.as_tensor(input_ids).cpu()
        if ids.dtype.is_floating_point or ids.dim() > 2 or (ids.dim() == 2 and ids.shape[0] != 1) or not ids.numel():
            raise ValueError(f"input_ids must be one prompt's token ids (a list, or a (n,) or (1, n) tensor of "
                             f"integers), got {'an empty prompt' if not ids.numel() else tuple(ids.shape)}")
        ids = ids.long().view(1, -1)
        unknown = set(inputs) - set(PADDED_INPUTS) - set(JOINED_INPUTS) - {"position_ids"}
        if unknown:
            raise ValueError(f"Unknown request keywords {sorted(unknown)}: a request takes generation settings "
                             f"{list(REQUEST_SETTINGS)}, the processor's outputs {[*PADDED_INPUTS, *JOINED_INPUTS]} "
                             f"and its prompt's position_ids (`prompt_position_ids`).")
        prompt = {key: value.cpu() if isinstance(value, torch.Tensor) else value for key, value in inputs.items()}
        positions = prompt.pop("position_ids", None)
        mask = prompt.get("attention_mask")
        if mask is not None and (tuple(mask.shape) != tuple(ids.shape) or not bool(mask.bool().all())):
            raise ValueError("A request is one prompt without padding: its attention_mask must be all ones and of its "
                             "input_ids' shape (pass each prompt of a padded batch as a request of its own).")
        self.model._check_inputs(ids, prompt)  # generate's own checks
        output.prompt_ids = ids[0].tolist()
        prompt = {**prompt, "input_ids": ids, "attention_mask": torch.ones_like(ids)}
        sequence = Sequence(output, prompt, None, 0, streaming=streaming)
        self._resolve_settings(sequence, settings, engine)
        sequence.positions = (prompt_position_ids(self.model, ids, prompt) if positions is None
                              else _given_positions(positions, ids.shape[1])).unsqueeze(1)
        sequence.length = ids.shape[1]
        return sequence

    def _resolve_settings(self, sequence: Sequence, settings: dict, engine) -> None:
        """The request's settings over the batch's generation config, checked and named when wrong."""
        config = self.generation_config
        unknown_type = {key for key in ("max_new_tokens", "top_k", "seed")
                        if settings.get(key) is not None and (isinstance(settings[key], bool)
                                                              or not isinstance(settings[key], int))}
        unknown_type |= {key for key in ("temperature", "top_p", "min_p", *PENALTIES)
                         if settings.get(key) is not None and (isinstance(settings[key], bool)
                                                               or not isinstance(settings[key], (int, float)))}
        if unknown_type:
            raise ValueError("Request settings of the wrong type: " + ", ".join(
                f"{key}={settings[key]!r}" for key in sorted(unknown_type)) + " (max_new_tokens, top_k and seed take "
                "integers; temperature, top_p, min_p and the penalties numbers).")

        def value(key):
            return settings[key] if settings.get(key) is not None else getattr(config, key, None)

        if "do_sample" in settings:
            do_sample = bool(settings["do_sample"])
        elif any(settings.get(key) is not None for key in SAMPLING_SETTINGS):
            do_sample = settings.get("temperature") != 0  # sets sampling parameters: samples (temperature 0: greedy)
        else:
            do_sample = bool(config.do_sample)
        temperature = value("temperature")
        temperature = 1.0 if temperature is None else float(temperature)
        if do_sample and temperature == 0:
            do_sample = False
        top_k, top_p, min_p = value("top_k"), value("top_p"), value("min_p")
        vocab = engine.decode.logits.shape[1]
        if temperature < 0 or (top_p is not None and not 0 < top_p <= 1) or (min_p is not None and not 0 <= min_p <= 1) \
                or (top_k is not None and top_k < 0):
            raise ValueError(f"Sampling settings out of range: temperature={temperature} (>= 0), top_k={top_k} "
                             f"(>= 0), top_p={top_p} (in (0, 1]), min_p={min_p} (in [0, 1]).")
        repetition, presence, frequency = (float(none if value(key) is None else value(key))
                                           for key, none in zip(PENALTIES, NO_PENALTIES))
        if not (0 < repetition < math.inf and math.isfinite(presence) and math.isfinite(frequency)):
            raise ValueError(f"Penalties out of range: repetition_penalty={repetition} (> 0; 1: none), "
                             f"presence_penalty={presence} and frequency_penalty={frequency} (finite; 0: none).")
        sequence.penalties = (repetition, presence, frequency)
        seed = settings.get("seed")
        if seed is None:  # drawn from torch's generator: `torch.manual_seed` makes a batch reproducible
            seed = int(torch.randint(0, 2**31 - 1, ()))
        sequence.do_sample = do_sample
        sequence.sampling = {
            "temperature": temperature if do_sample else 1.0,
            "top_k": (top_k or vocab) if do_sample else 1,  # a greedy row among sampled ones: its argmax
            "top_p": float("inf") if not do_sample or top_p is None or top_p >= 1 else float(top_p),
            "min_p": float(min_p or 0.0) if do_sample else 0.0,
            "seed": seed, "candidates": TOP_K_CANDIDATES,
        }
        eos = settings["eos_token_id"] if "eos_token_id" in settings else config.eos_token_id
        eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        if not all(isinstance(token, int) and not isinstance(token, bool) for token in eos):
            raise ValueError(f"eos_token_id must be a token id or a list of them, got {eos!r}")
        sequence.eos_ids = frozenset(eos)
        stops = settings.get("stop_strings") or config.stop_strings or ()
        stops = (stops,) if isinstance(stops, str) else tuple(stops)
        if stops and (self.tokenizer is None or not all(isinstance(stop, str) and stop for stop in stops)):
            raise ValueError("stop_strings need the manager's tokenizer (init_continuous_batching(tokenizer=...)) and "
                             f"non-empty strings, got {stops!r}")
        sequence.stop_strings = stops
        cache, past_end = engine.cache, self.past_end(engine)
        length = sequence.prompt_len
        new_tokens = value("max_new_tokens")
        if new_tokens is not None and new_tokens < 1:
            raise ValueError(f"max_new_tokens={new_tokens}: a request generates at least 1 token.")
        room = cache.capacity - length - past_end
        if (new_tokens or 1) > room:
            raise ValueError(
                f"The request does not fit a cache row: a {length}-token prompt and "
                f"{'at least 1 new token' if new_tokens is None else f'max_new_tokens={new_tokens}'} need "
                f"{length + (new_tokens or 1) + past_end} slots with the {past_end} steps a row may run past its end, "
                f"and a row holds {cache.capacity} (static_cache_len). Ask for fewer new tokens or raise "
                "static_cache_len.")
        sequence.max_new_tokens = room if new_tokens is None else new_tokens  # unset: as many as the row holds

    @staticmethod
    def past_end(engine) -> int:
        """`steps_past_end` of the engine's decode runner: slots a row holds beyond its prompt and answer."""
        return steps_past_end(engine.decode.steps_per_sync)

    def _parts(self, entered: list, engine) -> list:
        """The admitted `entered` as the prefills that take them: groups of one kind (their inputs but the pixels),
        shortest first, cut where the budget or a row would be passed, then shaped as captured graphs; each part's rows
        parked (`_park`)."""
        groups = {}
        for sequence in sorted(entered, key=lambda sequence: sequence.prompt_len):  # a kind: its inputs but the pixels,
            groups.setdefault(tuple(sorted(set(sequence.prompt) - set(PIXELS))), []).append(sequence)  # encoded or not
        parts, capacity = [], engine.cache.capacity - self.past_end(engine)
        for group in groups.values():  # shortest first: a part's padding stays within the budget and every row
            part, most_new = [], 0
            for sequence in group:
                longest, new = sequence.prompt_len, max(most_new, sequence.max_new_tokens)
                if part and (longest * (len(part) + 1) > self.max_prefill_tokens or longest + new > capacity):
                    parts.append(part)
                    part, new = [], sequence.max_new_tokens
                part.append(sequence)
                most_new = new
            parts += _graph_shaped(part, engine.prefill)
        for part in parts:
            self._park(part, engine)
        return parts

    @staticmethod
    def _park(part: list, engine) -> None:
        """`part`'s rows parked on the batch's stream for its prefill, at its longest prompt's length (its padding
        included): inert, stepping only past the prompt (`DecodeRunner.park`). A long prompt's row stays parked from its
        first chunk on."""
        if part[0].prefilled:
            return
        length = max(sequence.prompt_len for sequence in part)
        engine.decode.park(to_device(torch.tensor([sequence.row for sequence in part]), engine.device), length)
        for sequence in part:
            sequence.length = length

    def _enter(self, parts: list, engine, scheduler, side, parked) -> list:
        """Queue the prefills of `parts` into their parked rows (`_launch`, after the event `parked`); returns their
        `_Prefilled`s (a long prompt's only with its last chunk). A part whose prefill fails is tried again one by one,
        each parked at its own length, so that only a bad request fails."""
        launched = []
        for part in parts:
            try:
                launched.append(self._launch(part, engine, side, parked))
            except Exception as error:  # noqa: BLE001 - the requests' results name it; the others go on
                if len(part) == 1:
                    engine.decode.release(part[0].row)
                    self._end(part[0], scheduler, RequestStatus.FAILED, f"{type(error).__name__}: {error}")
                    continue
                for sequence in part:
                    try:
                        self._park([sequence], engine)
                        launched.append(self._launch([sequence], engine, side, parked))
                    except Exception as alone:  # noqa: BLE001
                        engine.decode.release(sequence.row)
                        self._end(sequence, scheduler, RequestStatus.FAILED, f"{type(alone).__name__}: {alone}")
        launched = [prefilled for prefilled in launched if prefilled is not None]  # None: a long prompt's chunk
        for prefilled in launched:
            self._count_wait(prefilled.part)
        self.stats["prefills"] += len(launched)
        self.stats["admitted"] += sum(len(prefilled.part) for prefilled in launched)
        return launched

    def _count_wait(self, part: list) -> None:
        """The admission wait of requests whose prefill was just launched: from `add_request` to now (and of it, until
        this thread took them in)."""
        now = time.perf_counter()
        self.stats["admission_wait_ms"] += sum(1000 * (now - sequence.output.created_time) for sequence in part)
        self.stats["queued_ms"] += sum(1000 * (sequence.taken_in - sequence.output.created_time) for sequence in part)
        for sequence in part:
            sequence.launched = now

    def _launch(self, part: list, engine, side, parked) -> _Prefilled | None:
        """Queue one prefill of `part` (prompts of one kind, padded on the left) into their parked rows: on a GPU on the
        `side` stream, after the CUDA event `parked` (None: no wait), which the batch's stream recorded after parking
        them and before its next chunk. Every step queued before it may have written anywhere in these rows (their
        last requests', free rows' at slot 0); the chunks queued after it step them inert, writing only past the
        prompt, so the prefill runs beside them. A prompt longer than the budget, alone, is prefilled one budget of it
        per call: None until its last chunk."""
        model, runner, device = self.model, engine.decode, engine.device
        first = part[0]
        chunked = len(part) == 1 and (first.prefilled or first.prompt_len > self.max_prefill_tokens)
        if parked is not None:
            side.wait_event(parked)
        with torch.cuda.stream(side) if side is not None else nullcontext():
            before = _event() if side is not None else None
            cache_rows = to_device(torch.tensor([runner.cache_row_of[sequence.row] for sequence in part]), device)
            if chunked:
                start = first.prefilled
                length = min(first.prompt_len, start + self.max_prefill_tokens)
                ids = first.prompt["input_ids"][:, :length]
                mask = torch.ones_like(ids)
                inputs = {"input_ids": to_device(ids, device), "attention_mask": to_device(mask, device),
                          "position_ids": to_device(first.positions[..., :length], device)}
                logits, _ = model._prefill_prompt(inputs["input_ids"], inputs, start, rows=cache_rows, padded=False,
                                                  media=self._media_between(first, start, length, engine))
                self._side_work.add(length - start)
                first.prefilled = length
                if not first.prefilling:
                    first.media = None
            else:
                media = self._media_of(part, engine)  # most encoded ahead
                inputs = _joined([sequence.prompt for sequence in part], self.generation_config.pad_token_id)
                mask, length = inputs["attention_mask"], inputs["input_ids"].shape[1]
                positions = torch.cat([F.pad(sequence.positions, (length - sequence.prompt_len, 0), value=1)
                                       for sequence in part], dim=1)
                padded = any(sequence.prompt_len != length for sequence in part)
                inputs = {key: _to_device_but_grids(key, value, device) for key, value in inputs.items()}
                inputs["position_ids"] = to_device(positions, device)
                logits, _ = model._prefill_prompt(inputs["input_ids"], inputs, 0, rows=cache_rows, padded=padded,
                                                  media=media)
                self._side_work.add(len(part) * length)
                for sequence in part:
                    sequence.prefilled, sequence.media = sequence.prompt_len, None
            after = _event() if side is not None else None
        if side is not None:
            self._spans.append(("prefill_ms", before, after))
        if first.prefilling:
            return None
        for sequence in part:
            for key in JOINED_INPUTS:  # in its row now: the device memory of its pixels goes back
                sequence.prompt.pop(key, None)
        next_positions = torch.stack([sequence.positions[:, 0, -1] + 1 for sequence in part], dim=1)
        return _Prefilled(part, logits, mask, next_positions, after, self._side_work.queued)

    def _activate(self, ready: list, engine, beside: bool) -> tuple:
        """The rows of the `ready` prefills begin decoding, on the batch's stream (which waits for the prefills on the
        GPU; `beside` decoding rows, which wait too: timed): their sampling settings, penalties and first tokens.
        Returns (their sequences, their first tokens on their way to the host)."""
        runner, device = engine.decode, engine.device
        sequences, tokens = [], []
        for prefilled in ready:
            part, logits = prefilled.part, prefilled.logits
            if prefilled.done is not None:
                stream, before = torch.cuda.current_stream(), _event() if beside else None
                stream.wait_event(prefilled.done)
                if beside:  # the wait's end: the prefill's end, or the rows' turn where that came before
                    joined = _event()
                    self._spans.append(("activation_wait_ms", before, joined))
                    self._spans.append(("activation_slack_ms", prefilled.done, joined))
                logits.record_stream(stream)  # made on the side stream, read on this one
            rows = to_device(torch.tensor([sequence.row for sequence in part]), device)  # compaction may move rows
            settings = {name: to_device(torch.tensor([sequence.sampling[name] for sequence in part]), device)
                        for name in ("temperature", "top_k", "top_p", "min_p", "seed")}
            runner.set_rows_sampling(rows, settings)
            mode, penalized = split_mode(batch_mode(part))
            if penalized:
                runner.enable_penalties()
            if runner.penalties is not None:  # rows last held by a request with penalties: set afresh (maybe to none)
                runner.set_rows_penalties(rows, to_device(torch.tensor([sequence.penalties for sequence in part]),
                                                          device),
                                          [to_device(sequence.prompt["input_ids"][0], device) for sequence in part])
            if penalized:
                logits = runner.penalties.apply(logits, rows)
            first = first_tokens(runner, logits, mode, rows)
            if penalized:
                runner.penalties.count(rows, first)
            runner.admit(rows, first, to_device(prefilled.next_positions, device),
                         to_device(prefilled.attention_mask, device))
            for sequence in part:
                sequence.decoding = True
                sequence.output.status = RequestStatus.DECODING
            sequences += part
            tokens.append(first)
        return sequences, copy_to_host(torch.cat(tokens))

    def _media_between(self, sequence: Sequence, start: int, end: int, engine) -> list:
        """`media_features` of the images and videos whose placeholders lie in the prompt's tokens [start, end): the
        whole prompt's encoded once (`_media_of`), then the rows of the placeholders before `start` skipped."""
        ids, media = sequence.prompt["input_ids"][0], []
        for kind, token, features, deepstack in self._media_of([sequence], engine):
            before, inside = int((ids[:start] == token).sum()), int((ids[start:end] == token).sum())
            if inside:
                media.append((kind, token, features[before:before + inside],
                              [layer[before:before + inside] for layer in deepstack]))
        return media

    def _read(self, chunk: _Chunk, scheduler, runner) -> None:
        """The host's half of a chunk: its first tokens and steps' tokens appended to their requests, which end by
        their own rules (their rows free for the next admissions), streamed outputs delivered (those of handlers on
        an event loop in one wake-up per loop)."""
        self._outbox = []
        try:
            self._read_tokens(chunk, scheduler, runner)
        finally:
            outbox, self._outbox = self._outbox, None
            calls = {}
            for loop, callback, output in outbox:
                calls.setdefault(loop, []).append((callback, output))
            self._handed = [_Delivery(batch) for batch in calls.values()]
            for loop, delivery in zip(calls, self._handed):
                loop.call_soon_threadsafe(delivery.run)

    def _read_tokens(self, chunk: _Chunk, scheduler, runner) -> None:
        touched, began = set(), time.perf_counter()
        if chunk.entered:
            (tokens,) = collected(chunk.first_tokens)
            read = time.perf_counter()
            self.stats["first_token_ms"] += sum(1000 * (read - sequence.launched) for sequence in chunk.entered)
            for sequence, token in zip(chunk.entered, tokens.tolist()):
                if not sequence.done:
                    self._append(sequence, [token], scheduler, runner)
                    touched.add(sequence)
        if chunk.handle is not None:
            tokens, _ = runner.collect(chunk.handle)
        self.stats["host_wait_ms"] += 1000 * (time.perf_counter() - began)
        self._clients_behind = not all(delivery.taken for delivery in self._handed)  # they had a chunk's time
        self._count_spans(wait=False)
        if chunk.handle is not None:
            tokens = tokens.tolist()
            for row, sequence in chunk.owners.items():
                if not sequence.done:
                    self._append(sequence, tokens[row], scheduler, runner)
                    touched.add(sequence)
        for sequence in touched:
            if sequence.done:
                continue
            if sequence.cancelled:
                runner.release(sequence.row)
                self._end(sequence, scheduler, RequestStatus.FAILED, "cancelled")
            elif sequence.streaming and len(sequence.output.generated_tokens) > sequence.delivered:
                self._deliver(sequence, final=False)

    def _count_spans(self, wait: bool) -> None:
        """The GPU time of the spans whose end is done into `stats`, in the order they were queued (`wait`: all of
        them, waiting for their ends). Never an end not yet done: CUDA refuses its elapsed time, and a chunk's end
        comes after its tokens' copy, which is all the host waits for when it reads them."""
        while self._spans and (wait or self._spans[0][2].query()):
            stat, before, after = self._spans.popleft()
            if wait:
                after.synchronize()
            elapsed = before.elapsed_time(after)
            self.stats[stat] += elapsed
            if stat == "stall_ms" and elapsed >= LONG_STALL_MS:
                self.stats["long_stalls"] += 1

    def _time_stall(self, chunk: _Chunk) -> None:
        """The GPU time from the last decode chunk's end to `chunk`'s start, where requests of the one go on decoding
        in the other: their streams' next token waited that long on top of the steps (the host issuing admissions or
        taking requests in while the GPU had no step of theirs queued, or the rows' own wait for a prefill)."""
        if self._last_chunk is not None and not self._last_chunk[1].isdisjoint(chunk.owners.values()):
            self._spans.append(("stall_ms", self._last_chunk[0], chunk.events[0]))
        self._last_chunk = chunk.events[1], set(chunk.owners.values())

    def _append(self, sequence: Sequence, tokens: list, scheduler, runner) -> None:
        """Record a request's new tokens up to its end; at its end, its result goes out and its row frees."""
        generated, timestamps = sequence.output.generated_tokens, sequence.output.timestamps
        now = time.perf_counter()
        for token in tokens:
            generated.append(token)
            if timestamps is not None:
                timestamps.append(now)
            if (token in sequence.eos_ids or len(generated) >= sequence.max_new_tokens
                    or (sequence.stop_strings and self._stopped(sequence))):
                runner.release(sequence.row)
                self._end(sequence, scheduler, RequestStatus.FINISHED)
                return

    def _stopped(self, sequence: Sequence) -> bool:
        """Whether the answer's text (special tokens left out, as a server shows it) now holds one of its stop strings,
        ending in its last token or inside it (a token may hold a stop string and more). Only the tail is decoded: a
        stop string spans at most as many tokens as it has UTF-8 bytes (+1 for a character the tail starts inside),
        and one that ended earlier would have stopped the request then."""
        longest = max(len(stop.encode()) for stop in sequence.stop_strings)
        tail = self.tokenizer.decode(sequence.output.generated_tokens[-longest - 1:], skip_special_tokens=True,
                                     clean_up_tokenization_spaces=False)
        return any(stop in tail for stop in sequence.stop_strings)


def prompt_position_ids(model, input_ids: torch.Tensor, inputs: dict) -> torch.Tensor:
    """The M-RoPE positions `(3, n)` of one prompt, `input_ids` `(1, n)` with its other model inputs `inputs` (on the
    host), as `generate` and the stock forward compute them. A request may bring them as `position_ids`, computed
    off the batch's thread: the batch's thread then skips their computation when it takes the request in, two thirds
    of what it spends on a 448x448 image request there (0.35 ms on a 2-core machine, `bench/probes/take_in_probe.py`);
    `serve`'s HTTP processes do so on a copy of the model on the meta device."""
    prompt = {**inputs, "input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}
    with torch.no_grad():
        position_ids = generate_position_ids(model, input_ids, prompt)
        if position_ids is not None:
            prompt["position_ids"] = position_ids
        return prompt_positions(model, input_ids, prompt)[:, 0]


def _given_positions(positions, length: int) -> torch.Tensor:
    """A request's own `position_ids`, checked: integer M-RoPE positions `(3, n)` of its `length` prompt tokens (they
    only turn its own queries and keys, so wrong values cannot reach another request or past a buffer)."""
    positions = torch.as_tensor(positions)
    if positions.dtype.is_floating_point or positions.dtype == torch.bool or tuple(positions.shape) != (3, length):
        raise ValueError(f"position_ids must be the prompt's M-RoPE positions, integers of shape (3, {length}) "
                         f"(`prompt_position_ids`), got {positions.dtype} {tuple(positions.shape)}")
    return positions.long()


def _snapshot(output: GenerationOutput, since: int = 0) -> GenerationOutput:
    """A streamed output as it is now, its tokens from `since` on a list of their own: `copy.copy`'s result in a third
    of its time (0.56 against 1.64 us on the 2-core development machine), which a server pays for every stream at
    every chunk."""
    snapshot = object.__new__(type(output))
    snapshot.__dict__.update(output.__dict__)
    snapshot.generated_tokens = output.generated_tokens[since:]
    return snapshot


def _event() -> torch.cuda.Event:
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def _unencoded(sequence: Sequence) -> bool:
    """Whether a request's images or videos still wait for the tower."""
    return sequence.media is None and any(key in sequence.prompt for key in PIXELS)


def _encoded(sequence: Sequence) -> bool:
    """Whether a request may enter without running the tower: it has no images or videos, or they are encoded."""
    return not _unencoded(sequence)


def _graph_shaped(part: list, prefill) -> list:
    """`part` (sequences shortest first) as the prefills that replay captured graphs (`PrefillRunner.graph_pieces`):
    an eager prefill of a few prompts spends tens of milliseconds launching kernels while decoding rows wait, a graph
    well under ten. As it is when no such pieces exist."""
    pieces = prefill.graph_pieces([sequence.prompt_len for sequence in part])
    if pieces is None:
        return [part]
    ends = list(itertools.accumulate(pieces))
    return [part[end - rows : end] for rows, end in zip(pieces, ends)]


def _to_device_but_grids(key: str, tensor: torch.Tensor, device) -> torch.Tensor:
    """A prefill input on `device`, except the images' and videos' grids: the tower reads them on the host, where a read
    does not wait for the decode chunk queued before."""
    return tensor if key.endswith("_grid_thw") else to_device(tensor, device)


def _joined(prompts, pad_id) -> dict:
    """One prefill batch of single prompts' inputs (`PADDED_INPUTS` padded on the left to the longest,
    `JOINED_INPUTS` joined in row order)."""
    if len(prompts) == 1:
        return dict(prompts[0])
    length = max(prompt["input_ids"].shape[1] for prompt in prompts)
    batch = {}
    for key, value in PADDED_INPUTS.items():
        if key in prompts[0]:
            pad = (pad_id or 0) if value is None else value
            batch[key] = torch.cat([F.pad(prompt[key], (length - prompt[key].shape[1], 0), value=pad)
                                    for prompt in prompts])
    for key in JOINED_INPUTS:
        if key in prompts[0]:
            batch[key] = torch.cat([prompt[key] for prompt in prompts])
    return batch


def _as_request(item) -> dict:
    """`add_request`'s keywords for one of `generate_batch`'s inputs: token ids, or one prompt's processor outputs."""
    if isinstance(item, dict) or hasattr(item, "keys"):
        return dict(item)
    return {"input_ids": item}


def cache_len_for(inputs, default_new_tokens: int | None, steps_per_sync: int) -> int | None:
    """Cache slots per row for `inputs` (as `generate_batch` takes them, each with its max_new_tokens or
    `default_new_tokens`): what the longest needs, with the steps a row may run past its end, rounded up to 64; None
    when some request's length is unknown."""
    longest = 0
    for item in inputs:
        request = _as_request(item)
        ids, new_tokens = request["input_ids"], request.get("max_new_tokens") or default_new_tokens
        if not isinstance(new_tokens, int):
            return None
        length = len(ids) if isinstance(ids, (list, tuple)) else ids.shape[-1]
        longest = max(longest, length + new_tokens)
    return 64 * math.ceil((longest + steps_past_end(steps_per_sync)) / 64)
