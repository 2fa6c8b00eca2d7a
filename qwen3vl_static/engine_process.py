"""The continuous-batching manager in a process of its own, driven from the HTTP server's process through the part of
the manager's API the server uses (`start`, `add_request`, `register_result_handler`, `cancel_request`, `stop`,
`is_running`, `error`). Not uploaded to the Hub.

Why a process: in one process the server's event loop, its image decoding and its processor runs take the
interpreter lock that the batch's thread needs between chunks, and each request's rendering waits for the others'
(vLLM splits its API server from its engine core for the same reason). Here the engine process runs only the batch
and a small event loop that forwards: requests arrive as the processor's CPU tensors through torch's multiprocessing
queues (their storage moves to shared memory instead of being pickled), and a chunk's outputs go back in one message.
"""

import asyncio
import os
import queue
import signal
import sys
import threading
from dataclasses import dataclass

import torch.multiprocessing as mp
from transformers.generation.continuous_batching.requests import GenerationOutput, RequestStatus

# The batch's thread must get the interpreter lock back soon after each wait for the GPU: Python's default switch
# interval (5 ms) is two decode steps of a large batch.
SWITCH_INTERVAL_S = 0.0005
POLL_S = 0.5  # how often the engine checks its batch and its parent


@dataclass(frozen=True)
class EngineInfo:
    """What the server checks requests against, read off the engine once it is built."""

    row_slots: int  # a cache row's slots
    reserved: int  # slots of a row that steps past a request's end may write
    rows: int
    eos_ids: frozenset


class EngineProcess:
    """`build_model()` (picklable: it runs in the new process) built and batched in a spawned process, with
    `manager_kwargs` for `init_continuous_batching`. Blocks until the model is built; a build that fails raises
    here with the engine's error."""

    def __init__(self, build_model, manager_kwargs: dict):
        context = mp.get_context("spawn")
        self._requests, self._outputs = context.Queue(), context.Queue()
        self._process = context.Process(target=_engine_main, name="qwen3vl-static-engine", daemon=True,
                                        args=(build_model, manager_kwargs, self._requests, self._outputs, os.getpid()))
        self._process.start()
        kind, payload = self._next_output(waiting_for="the model to be built")
        if kind != "ready":
            self._process.join()
            raise RuntimeError(f"The engine process failed while building the model: {payload}")
        self.info: EngineInfo = payload
        self.error = None  # what ended the batch, if anything did
        self._handlers = {}  # request id -> (callback, event loop)
        self._lock = threading.Lock()
        self._reader = None
        self._stopped = threading.Event()

    # -- the manager's API ---------------------------------------------------------------------------------

    def start(self) -> None:
        if self._reader is None:
            self._reader = threading.Thread(target=self._read, name="qwen3vl-static-engine-outputs", daemon=True)
            self._reader.start()

    def is_running(self) -> bool:
        return self._process.is_alive() and not self._stopped.is_set()

    def add_request(self, request_id: str, **kwargs) -> str:
        """The manager's `add_request(**kwargs)` in the engine process (tensors on the CPU)."""
        self._requests.put(("add", request_id, kwargs))
        return request_id

    def register_result_handler(self, request_id: str, callback) -> None:
        """`callback(output)` for each output of the request, on the caller's running event loop."""
        with self._lock:
            self._handlers[request_id] = (callback, asyncio.get_running_loop())

    def cancel_request(self, request_id: str) -> None:
        self._requests.put(("cancel", request_id))

    def stop(self, block: bool = True, timeout: float | None = None) -> None:
        """The requests added so far finish, then the batch and its process end."""
        if self._process.is_alive():
            self._requests.put(("stop",))
        if block:
            self._process.join(timeout)
            if self._reader is not None:
                self._reader.join(timeout)

    # -- outputs ---------------------------------------------------------------------------------------------

    def _next_output(self, waiting_for: str):
        while True:
            try:
                return self._outputs.get(timeout=POLL_S)
            except queue.Empty:
                if not self._process.is_alive():
                    return "died", f"the engine process exited (code {self._process.exitcode}) while waiting for " \
                                   f"{waiting_for}"

    def _read(self) -> None:
        """The engine's messages: each chunk's outputs handed to their handlers' event loops (one wake-up per loop)."""
        while True:
            kind, payload = self._next_output(waiting_for="outputs")
            if kind == "outputs":
                self._hand_over(payload)
            elif kind == "error":
                self.error = RuntimeError(payload)
            else:  # "stopped" or "died"
                if kind == "died":
                    self.error = self.error or RuntimeError(payload)
                    with self._lock:  # no outputs will come: every waiting caller sees why
                        waiting = list(self._handlers)
                    self._hand_over([(request_id, RequestStatus.FAILED, [], f"the batch stopped: {payload}")
                                     for request_id in waiting])
                self._stopped.set()
                return

    def _hand_over(self, outputs: list) -> None:
        calls = {}
        with self._lock:
            for request_id, status, tokens, error in outputs:
                final = status in (RequestStatus.FINISHED, RequestStatus.FAILED)
                handler = self._handlers.pop(request_id, None) if final else self._handlers.get(request_id)
                if handler is not None:
                    output = GenerationOutput(request_id=request_id, generated_tokens=tokens, status=status,
                                              error=error)
                    calls.setdefault(handler[1], []).append((handler[0], output))
        for loop, batch in calls.items():
            try:
                loop.call_soon_threadsafe(_run_all, batch)
            except RuntimeError:  # the loop is closed: its caller is gone
                pass


def _run_all(calls: list) -> None:
    for callback, output in calls:
        callback(output)


# -- the engine's side ---------------------------------------------------------------------------------------


def _engine_main(build_model, manager_kwargs: dict, requests, outputs, parent: int) -> None:
    # The server's process stops the engine (after its own drain): Ctrl-C reaches the whole process group.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    try:
        model = build_model()
        manager = model.init_continuous_batching(**manager_kwargs)
        engine = model.graph_engine()
        eos = model.generation_config.eos_token_id
        info = EngineInfo(row_slots=engine.cache.capacity, reserved=manager.past_end(engine), rows=engine.cache.rows,
                          eos_ids=frozenset([] if eos is None else [eos] if isinstance(eos, int) else eos))
    except Exception as error:  # noqa: BLE001 - reported to the server's process, which raises it
        outputs.put(("failed", f"{type(error).__name__}: {error}"))
        return
    outputs.put(("ready", info))
    asyncio.run(_forward(manager, requests, outputs, parent))


async def _forward(manager, requests, outputs, parent: int) -> None:
    """Requests into the manager, its outputs out: the outputs of one chunk (delivered to this loop in one wake-up)
    in one message."""
    loop = asyncio.get_running_loop()
    pending = []

    def send():
        outputs.put(("outputs", pending[:]))
        pending.clear()

    def handler(output):
        if not pending:
            loop.call_soon(send)  # after the rest of the chunk's outputs, which this wake-up delivers
        pending.append((output.request_id, output.status, list(output.generated_tokens), output.error))

    def next_command():
        while True:
            try:
                return requests.get(timeout=POLL_S)
            except queue.Empty:
                if os.getppid() != parent:  # the server's process is gone: finish what runs, then end
                    return ("stop",)
                if manager.error is not None or not manager.is_running():
                    return ("failed",)

    manager.start()
    reported = False
    while True:
        command = await loop.run_in_executor(None, next_command)
        if command[0] == "add":
            _, request_id, kwargs = command
            if manager.error is not None:  # a stopped batch takes no requests: fail it here
                outputs.put(("outputs", [(request_id, RequestStatus.FAILED, [], "the continuous batch stopped: "
                                          f"{type(manager.error).__name__}: {manager.error}")]))
                continue
            manager.register_result_handler(request_id, handler)
            manager.add_request(request_id=request_id, **kwargs)
        elif command[0] == "cancel":
            manager.cancel_request(command[1])
        elif command[0] == "failed":
            if not reported:
                outputs.put(("error", f"{type(manager.error).__name__}: {manager.error}"))
                reported = True
        else:  # "stop"
            await loop.run_in_executor(None, manager.stop)
            break
    await asyncio.sleep(0)  # the last chunk's delivery, then its send
    await asyncio.sleep(0)
    if pending:
        send()
    outputs.put(("stopped", None))
