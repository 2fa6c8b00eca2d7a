"""Continuous batching on the graph engine: many requests share the static cache's rows ("slots").

A request (token ids and, for images and videos, the processor's outputs) enters a free row through `generate`
itself (`Admission`): transformers prepares its inputs as for any call (M-RoPE positions, multimodal inputs, its
generation config's processors and criteria) and the engine's vision runner and prefill write its prompt into that
row alone, through the graphs `generate` uses. Requests that arrive together with the same settings enter together,
one `generate` call for as many rows as a batch bucket holds (a call's host work costs more than its prefill). The
rows in use then decode together, `steps_per_sync` steps per
chunk, through the decode graphs; the host reads each chunk's tokens and ends each row by its own request's rules
(its EOS ids, its max_new_tokens), and a finished row takes the next request while the others keep decoding. No
graph is captured per request: prefill and decode graphs are keyed by buckets, and the row is data.

The API follows transformers' continuous batching (`init_continuous_batching()` -> a manager with `start`,
`add_request`, `get_result`, `stop`; `generate_batch`), and results are transformers' own `GenerationOutput`s.
"""

import copy
import itertools
import queue
import threading
import time
from collections import deque

import torch
import torch.nn.functional as F
from transformers.generation.continuous_batching.requests import GenerationOutput, RequestStatus
from transformers.utils import logging
from transformers.utils.logging import tqdm

from .compat_qwen3vl_graph import first_decode_positions
from .loops_qwen3vl_graph import device_plan, first_tokens

logger = logging.get_logger(__name__)

# Generation settings a request may set for itself; its other keywords are model inputs (the processor's outputs).
REQUEST_SETTINGS = ("max_new_tokens", "do_sample", "temperature", "top_k", "top_p", "eos_token_id")


# Model inputs that one `generate` call can carry for several requests (each one prompt's processor outputs): token
# rows padded on the left, as processors pad (with these values; None: the pad token id), and media joined in order.
PADDED_INPUTS = {"input_ids": None, "attention_mask": 0, "mm_token_type_ids": 0}
JOINED_INPUTS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")


class Admission:
    """Requests' way into the decode runner's rows `rows`, one row each: the model's `_sample` hands `generate`'s
    prepared inputs to `prefill`, which writes the prompts into those rows' cache rows, draws their first tokens and
    sets the rows decoding, instead of decoding itself."""

    def __init__(self, rows: list):
        self.rows = rows
        self.tokens = self.plan = None

    def prefill(self, model, input_ids, logits_processor, stopping_criteria, generation_config, model_kwargs):
        plan = device_plan(logits_processor, stopping_criteria, generation_config)
        if plan is None:
            raise ValueError("Continuous batching takes greedy search or sampling with temperature, top-k and top-p, "
                             "stopping at EOS ids and max_new_tokens; this request's settings need another processor "
                             "or criterion: run it with `generate`.")
        runner = model._engine.decode
        rows = torch.tensor(self.rows, device=input_ids.device)
        cache_rows = torch.tensor([runner.cache_row_of[row] for row in self.rows], device=input_ids.device)
        logits, positions = model._prefill_prompt(input_ids, model_kwargs, 0, rows=cache_rows)
        runner.set_row_sampling(rows, plan["temperature"], plan["top_k"], plan["top_p"])
        tokens = first_tokens(runner, logits, plan["mode"], rows)
        positions = first_decode_positions(model, model_kwargs, positions, input_ids.shape[1])[:, :, 0]
        mask = model_kwargs.get("attention_mask")
        runner.admit(rows, tokens, positions, torch.ones_like(input_ids) if mask is None else mask)
        self.tokens, self.plan = tokens, plan
        return torch.cat([input_ids, tokens[:, None].to(input_ids.device)], dim=1)


class _Request:
    def __init__(self, request_id, input_ids, inputs, settings):
        self.input_ids, self.inputs, self.settings = input_ids, inputs, settings  # as added: read when admitted
        self.output = GenerationOutput(request_id=request_id)
        self.prompt = None  # its model inputs on the model's device, `(1, n)` token rows
        self.eos_ids = ()
        self.mode = None  # its decode mode (`device_plan`)
        self.max_new_tokens = 0
        self.length = 0  # cache slots its row holds

    def group(self) -> tuple:
        """Requests of one group can enter in one `generate` call: the same kinds of inputs and the same settings
        besides max_new_tokens."""
        if set(self.prompt) - set(PADDED_INPUTS) - set(JOINED_INPUTS):
            return (id(self),)  # inputs this module cannot join: alone
        settings = sorted((key, repr(value)) for key, value in self.settings.items() if key != "max_new_tokens")
        return tuple(sorted(self.prompt)), tuple(settings)


class GraphBatchingManager:
    """Continuous batching of one model's requests on its graph engine (see the module docstring). A background
    thread runs the batch from `start()` to `stop()`, holding the model for the whole time (`generate` calls from
    other threads wait); `stop()` lets every request already added finish first."""

    def __init__(self, model, generation_config=None, max_queue_size: int = 0):
        self.model = model
        self.generation_config = generation_config if generation_config is not None else model.generation_config
        self.input_queue = queue.Queue(max_queue_size)
        self.output_queue = queue.Queue()
        self._request_ids = itertools.count()
        self._stopping = threading.Event()
        self._thread = None
        self.error = None  # what ended the batch itself, if anything did
        # Per request id, `time.perf_counter()` when it was added, when its first token was drawn, when it finished.
        self.timings = {}

    # -- transformers' manager API --------------------------------------------------------------------------

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

    def add_request(self, input_ids, request_id: str | None = None, max_new_tokens: int | None = None, **kwargs) -> str:
        """Queue one request: `input_ids` (a list of ids, or a `(n,)` / `(1, n)` tensor); `kwargs` are its own
        generation settings (`REQUEST_SETTINGS`) and its model inputs (the processor's `pixel_values`,
        `image_grid_thw`, ... for this one prompt). Returns its request id."""
        # Nothing here touches the device: a CUDA call from this thread would break a graph that the batch's thread
        # may be capturing. The batch's thread reads and checks the tensors when the request enters a row.
        if request_id is None:
            request_id = f"req_{next(self._request_ids)}"
        self.timings[request_id] = {"added": time.perf_counter()}
        settings = {key: kwargs.pop(key) for key in REQUEST_SETTINGS if key in kwargs}
        if max_new_tokens is not None:
            settings["max_new_tokens"] = max_new_tokens
        self.input_queue.put(_Request(request_id, input_ids, kwargs, settings))
        return request_id

    def add_requests(self, inputs, **kwargs) -> list:
        """`add_request` for each of `inputs` (token ids, or a dict of one prompt's processor outputs), `kwargs` for
        every one of them."""
        return [self.add_request(**_as_request(item), **kwargs) for item in inputs]

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

    # -- the batch ------------------------------------------------------------------------------------------

    def _run(self) -> None:
        model = self.model
        try:
            with model._generate_lock, model.backend_flags(), torch.no_grad():
                engine = model.graph_engine()
                try:
                    self._decode_rows(engine)
                finally:
                    engine.decode.idle()
                    engine.cache.clear()
        except Exception as error:  # noqa: BLE001 - handed to the caller of get_result
            logger.error(f"The continuous batch stopped: {error!r}")
            self.error = error

    def _decode_rows(self, engine) -> None:
        runner, cache = engine.decode, engine.cache
        runner.open_slots(self.generation_config.pad_token_id)
        rows = [None] * cache.rows  # the request each row holds
        pending = deque()
        while True:
            while True:
                try:
                    pending.append(self.input_queue.get_nowait())
                except queue.Empty:
                    break
            free = [row for row, request in enumerate(rows) if request is None]
            entering = min(len(free), len(pending))
            # While requests wait, free rows gather until an eighth of the rows is free (or every waiting request
            # fits): a `generate` call costs several ms of host work, more than those rows' steps in the meantime.
            if entering and entering >= max(1, min(cache.rows // 8, len(pending))):
                admitted = self._admit([pending.popleft() for _ in range(entering)], free, engine)
                for row, request in admitted.items():
                    rows[row] = request
            active = [row for row, request in enumerate(rows) if request is not None]
            if not active:
                if pending:
                    continue
                if self._stopping.is_set() and self.input_queue.empty():
                    return
                try:
                    pending.append(self.input_queue.get(timeout=0.05))
                except queue.Empty:
                    pass
                continue
            runner.continue_rows(active[-1] + 1, max(rows[row].length for row in active))
            steps = runner.steps_per_sync
            # The candidates' mode only where every row's top-k allows it (greedy batches: "greedy" throughout).
            modes = {rows[row].mode for row in active}
            mode = "sample" if "sample" in modes else modes.pop()
            tokens, _ = runner.collect(runner.issue(steps, mode))
            for row in active:
                request = rows[row]
                request.length += steps
                for token in tokens[row].tolist():
                    if self._append(request, token):
                        rows[row] = None
                        runner.release(row)
                        break
            # The rows in use to the front: the next steps cover them and as few free rows as their bucket leaves.
            order = sorted(range(len(rows)), key=lambda row: rows[row] is None)
            if order != sorted(order):
                runner.reorder(order)
                rows = [rows[row] for row in order]

    def _admit(self, requests, free: list, engine) -> dict:
        """Prefill `requests` into `free` rows, a group of alike requests per `generate` call (its size a batch
        bucket: `_parts`); returns {row: request} for those that go on decoding (the others finished with their first
        token, or failed: their results then name the problem)."""
        groups = {}
        for request in requests:
            try:
                self._prepare(request, engine)
            except Exception as error:  # noqa: BLE001 - this request's result names it; the others go on
                self._fail(request, error)
                continue
            groups.setdefault(request.group(), []).append(request)
        rows, admitted = iter(free), {}
        for group in groups.values():
            for part in _parts(group, engine.prefill.batch_buckets):
                admitted.update(self._enter(part, [next(rows) for _ in part], engine))
        return admitted

    def _prepare(self, request, engine) -> None:
        """Read and check a request as added, in the batch's thread: its inputs on the model's device, its settings
        against the batch's, its length against the cache. Raises what is wrong with it."""
        device, config = engine.device, self.generation_config
        input_ids = torch.as_tensor(request.input_ids, dtype=torch.long, device=device).view(1, -1)
        request.output.prompt_ids = input_ids[0].tolist()
        prompt = {key: value.to(device) if isinstance(value, torch.Tensor) else value
                  for key, value in request.inputs.items()}
        mask = prompt.get("attention_mask")
        if mask is not None and not bool(mask.bool().all()):
            raise ValueError("A request is one prompt without padding: its attention_mask must be all ones (pass each "
                             "prompt of a padded batch as a request of its own, without its padding).")
        if bool(request.settings.get("do_sample", config.do_sample)) != bool(config.do_sample):
            raise ValueError(f"This batch {'samples' if config.do_sample else 'decodes greedily'} (its generation "
                             "config's do_sample): a request cannot change that.")
        length = input_ids.shape[1]
        new_tokens = request.settings.get("max_new_tokens") or config.max_new_tokens or config.max_length - length
        self._check_capacity(length, new_tokens, engine)
        request.prompt = {**prompt, "input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}
        request.max_new_tokens = new_tokens

    @staticmethod
    def _check_capacity(prompt: int, new_tokens: int, engine) -> None:
        steps = engine.decode.steps_per_sync
        # A row stops only between chunks: up to steps_per_sync - 1 steps past its end are written too.
        needed = prompt + new_tokens + steps - 1
        if new_tokens < 1 or needed > engine.cache.capacity:
            raise ValueError(f"The request needs {needed} cache slots (a {prompt}-token prompt, {new_tokens} new "
                             f"tokens and {steps - 1} steps past them, as a row stops between chunks of steps_per_sync "
                             f"steps) but static_cache_len is {engine.cache.capacity}.")

    def _enter(self, part, rows, engine) -> dict:
        """Prefill the alike requests `part` into `rows` through one `generate` call (prompts of several lengths
        padded on the left); {row: request} for those that go on decoding. A call that fails for several requests is
        retried for each alone, so that only a bad request fails."""
        runner, model = engine.decode, self.model
        try:
            inputs = _joined([request.prompt for request in part], self.generation_config.pad_token_id)
            for request in part:
                self._check_capacity(inputs["input_ids"].shape[1], request.max_new_tokens, engine)
            admission = model._admission = Admission(rows)
            try:
                config = copy.deepcopy(self.generation_config)
                config.update(**{**part[0].settings, "max_new_tokens": max(request.max_new_tokens for request in part)})
                model.generate(**inputs, generation_config=config)
            finally:
                model._admission = None
            tokens = admission.tokens.tolist()  # waits for the prefill
        except Exception as error:  # noqa: BLE001 - the requests' results name it; the others go on
            for row in rows:
                runner.release(row)
            if len(part) == 1:
                self._fail(part[0], error)
                return {}
            admitted = {}
            for request, row in zip(part, rows):
                admitted.update(self._enter([request], [row], engine))
            return admitted
        now, admitted = time.perf_counter(), {}
        for request, row, token in zip(part, rows, tokens):
            request.eos_ids, request.length = set(admission.plan["eos_ids"]), inputs["input_ids"].shape[1]
            request.mode = admission.plan["mode"]
            self.timings[request.output.request_id]["first_token"] = now
            if self._append(request, token):
                runner.release(row)
            else:
                admitted[row] = request
        return admitted

    def _fail(self, request, error) -> None:
        request.output.status, request.output.error = RequestStatus.FAILED, f"{type(error).__name__}: {error}"
        self.output_queue.put(request.output)

    def _append(self, request, token: int) -> bool:
        """Record one generated token; True (the result handed out) when it ends the request."""
        output = request.output
        output.generated_tokens.append(token)
        if token in request.eos_ids or len(output.generated_tokens) >= request.max_new_tokens:
            output.status = RequestStatus.FINISHED
            self.timings[output.request_id]["finished"] = time.perf_counter()
            self.output_queue.put(output)
            return True
        return False


def _parts(requests, batch_sizes) -> list:
    """`requests` in consecutive parts, each of the largest of `batch_sizes` that fits the rest (a rest smaller than
    every size: one part). A prefill of a batch bucket's size has no padding rows, which would write other rows."""
    parts, start = [], 0
    while start < len(requests):
        left = len(requests) - start
        size = max((size for size in batch_sizes if size <= left), default=left)
        parts.append(requests[start:start + size])
        start += size
    return parts


def _joined(prompts, pad_id) -> dict:
    """One `generate` batch of single prompts' inputs (`PADDED_INPUTS` padded on the left to the longest,
    `JOINED_INPUTS` joined in row order)."""
    if len(prompts) == 1:
        return prompts[0]
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
