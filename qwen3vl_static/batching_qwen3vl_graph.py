"""Continuous batching on the graph engine: many requests share the static cache's rows ("slots").

A request (token ids and, for images and videos, the processor's outputs) enters a free row through `generate`
itself (`Admission`): transformers prepares its inputs as for any call (M-RoPE positions, multimodal inputs, its
generation config's processors and criteria) and the engine's vision runner and prefill write its prompt into that
row alone, through the graphs `generate` uses. The rows in use then decode together, `steps_per_sync` steps per
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
from transformers.generation.continuous_batching.requests import GenerationOutput, RequestStatus
from transformers.utils import logging
from transformers.utils.logging import tqdm

from .compat_qwen3vl_graph import first_decode_positions
from .loops_qwen3vl_graph import device_plan, first_tokens

logger = logging.get_logger(__name__)

# Generation settings a request may set for itself; its other keywords are model inputs (the processor's outputs).
REQUEST_SETTINGS = ("max_new_tokens", "do_sample", "temperature", "top_k", "top_p", "eos_token_id")


class Admission:
    """One request's way into cache row `row`: the model's `_sample` hands `generate`'s prepared inputs to `prefill`,
    which writes the prompt into that row and draws the first token instead of decoding."""

    def __init__(self, row: int):
        self.row = row
        self.token = self.positions = self.plan = None

    def prefill(self, model, input_ids, logits_processor, stopping_criteria, generation_config, model_kwargs):
        plan = device_plan(logits_processor, stopping_criteria, generation_config)
        if plan is None:
            raise ValueError("Continuous batching takes greedy search or sampling with temperature, top-k and top-p, "
                             "stopping at EOS ids and max_new_tokens; this request's settings need another processor "
                             "or criterion: run it with `generate`.")
        logits, positions = model._prefill_prompt(input_ids, model_kwargs, 0, first_row=self.row)
        runner = model._engine.decode
        runner.set_row_sampling(self.row, plan["temperature"], plan["top_k"], plan["top_p"])
        token = first_tokens(runner, logits, plan["mode"], slice(self.row, self.row + 1))
        self.token, self.plan = token, plan
        self.positions = first_decode_positions(model, model_kwargs, positions, input_ids.shape[1])[:, 0, 0]
        return torch.cat([input_ids, token[:, None].to(input_ids.device)], dim=1)


class _Request:
    def __init__(self, request_id, input_ids, inputs, settings):
        self.input_ids, self.inputs, self.settings = input_ids, inputs, settings
        self.output = GenerationOutput(request_id=request_id, prompt_ids=input_ids[0].tolist())
        self.eos_ids = ()
        self.max_new_tokens = 0
        self.length = 0  # cache slots its row holds


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
        if request_id is None:
            request_id = f"req_{next(self._request_ids)}"
        self.timings[request_id] = {"added": time.perf_counter()}
        ids = torch.as_tensor(input_ids, dtype=torch.long)
        settings = {key: kwargs.pop(key) for key in REQUEST_SETTINGS if key in kwargs}
        if max_new_tokens is not None:
            settings["max_new_tokens"] = max_new_tokens
        mask = kwargs.pop("attention_mask", None)
        if mask is not None and not bool(torch.as_tensor(mask).bool().all()):
            raise ValueError("A request is one prompt without padding: its attention_mask must be all ones (pass each "
                             "prompt of a padded batch as a request of its own, without its padding).")
        self.input_queue.put(_Request(request_id, ids.view(1, -1), kwargs, settings))
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
        self.start()
        ids = self.add_requests(inputs, **kwargs)
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
        mode = "sample" if self.generation_config.do_sample else "greedy"
        rows = [None] * cache.rows  # the request each row holds
        pending = deque()
        while True:
            while True:
                try:
                    pending.append(self.input_queue.get_nowait())
                except queue.Empty:
                    break
            for row in range(cache.rows):
                if pending and rows[row] is None:
                    rows[row] = self._admit(pending.popleft(), row, engine)
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
            tokens, _ = runner.collect(runner.issue(steps, mode))
            for row in active:
                request = rows[row]
                request.length += steps
                for token in tokens[row].tolist():
                    if self._append(request, token):
                        rows[row] = None
                        runner.release(row)
                        break

    def _admit(self, request, row: int, engine) -> _Request | None:
        """Prefill `request` into `row`; returns it while it goes on decoding there, None once it has finished (its
        first token ended it, or it failed: its result then names the problem)."""
        model, capacity = self.model, engine.cache.capacity
        try:
            config = self.generation_config
            settings = dict(request.settings)
            if bool(settings.get("do_sample", config.do_sample)) != bool(config.do_sample):
                raise ValueError(f"This batch {'samples' if config.do_sample else 'decodes greedily'} (its generation "
                                 "config's do_sample): a request cannot change that.")
            prompt = request.input_ids.shape[1]
            new_tokens = settings.pop("max_new_tokens", None) or config.max_new_tokens or config.max_length - prompt
            # A row stops only between chunks: up to steps_per_sync - 1 steps past its end are written too.
            needed = prompt + new_tokens + engine.decode.steps_per_sync - 1
            if new_tokens < 1 or needed > capacity:
                raise ValueError(f"The request needs {needed} cache slots (a {prompt}-token prompt, {new_tokens} new "
                                 f"tokens and {engine.decode.steps_per_sync - 1} steps past them, as a row stops "
                                 f"between chunks of steps_per_sync steps) but static_cache_len is {capacity}.")
            config = copy.deepcopy(config)
            config.update(max_new_tokens=new_tokens, **settings)
            # Moved here, in the batch's thread: another thread's CUDA work could break a graph capture under way.
            device = engine.device
            inputs = {key: value.to(device) if isinstance(value, torch.Tensor) else value
                      for key, value in request.inputs.items()}
            input_ids = request.input_ids.to(device)
            admission = model._admission = Admission(row)
            try:
                model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), **inputs,
                               generation_config=config)
            finally:
                model._admission = None
        except Exception as error:  # noqa: BLE001 - this request's result names it; the others go on
            request.output.status, request.output.error = RequestStatus.FAILED, f"{type(error).__name__}: {error}"
            self.output_queue.put(request.output)
            return None
        request.eos_ids, request.max_new_tokens, request.length = set(admission.plan["eos_ids"]), new_tokens, prompt
        token = int(admission.token)  # waits for the prefill
        self.timings[request.output.request_id]["first_token"] = time.perf_counter()
        if self._append(request, token):
            return None
        engine.decode.admit(row, admission.token, admission.positions, prompt)
        return request

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


def _as_request(item) -> dict:
    """`add_request`'s keywords for one of `generate_batch`'s inputs: token ids, or one prompt's processor outputs."""
    if isinstance(item, dict) or hasattr(item, "keys"):
        return dict(item)
    return {"input_ids": item}
