"""The server's engine process: the model's continuous-batching manager, fed by the HTTP processes over one pipe each.
Not uploaded to the Hub.

Why processes (vLLM's API-server / engine-core split): in one process the event loop's HTTP, JSON, image decoding,
processor runs and per-token streaming take the interpreter lock that the batch's thread needs between chunks, so at
many clients the batch waits on the host. Here the engine process runs only the batch and two light threads: one
reads the requests of every HTTP process (`EngineProcess` starts it; messages are pickled tuples), image patches
crossing as uint8 (`pixels.py`: a quarter of float32's bytes), which the batch normalizes on the GPU; the other, an
asyncio loop, adds them to the manager and sends each HTTP process the outputs of a chunk in one message, tokens new
since the last. The HTTP processes hold an `EngineClient` each.

Messages, HTTP process -> engine: ("submit", job id, request ids, model inputs, per-choice settings), ("cancel", request
id), ("stats", token). Engine -> HTTP process: ("submitted", job id, refusal or None), ("outputs", [(request id,
status, new tokens, error)]), ("stats", token, counters), ("error", what stopped the batch).
"""

import asyncio
import itertools
import logging
import os
import pickle
import queue
import signal
import socket
import struct
import sys
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import wait

import numpy as np
import torch
from transformers.generation.continuous_batching.requests import GenerationOutput, RequestStatus

from .gc_pauses import GcPauses, freeze_startup_heap
from .pixels import PixelNormalizer

logger = logging.getLogger(__name__)

# The batch's thread must get the interpreter lock back soon after each wait for the GPU: Python's default switch
# interval (5 ms) is two decode steps of a large batch.
SWITCH_INTERVAL_S = 0.0005
POLL_S = 0.5  # how often a waiting process checks that the other side is alive
ENDED = (RequestStatus.FINISHED, RequestStatus.FAILED)


@dataclass(frozen=True)
class EngineInfo:
    """What the HTTP processes check requests against, read off the engine once it is built."""

    row_slots: int  # a cache row's slots
    reserved: int  # slots of a row that steps past a request's end may write
    max_requests: int  # running and waiting choices at once (rows + max_waiting); past it: 503
    eos_ids: frozenset
    uint8_pixels: bool  # image patches cross unnormalized, as uint8, normalized on the device (`PixelNormalizer`)
    config: object = None  # the model's config: the HTTP processes compute prompts' M-RoPE positions with it


class EngineProcess:
    """`build_model()` and `build_processor()` (picklable: they run in the new process) built and batched in a spawned
    process, with `fronts` pipes for the HTTP processes (`connections`). Blocks until the model is built; a build that
    fails raises here with the engine's error."""

    def __init__(self, context, build_model, build_processor, max_batch_size: int | None, max_waiting: int,
                 fronts: int, max_prefill_tokens: int | None = None, warmup: bool = False):
        pipes = [context.Pipe() for _ in range(fronts)]
        self._control, control = context.Pipe()
        self.process = context.Process(
            target=_engine_main, name="qwen3vl-static-engine",
            args=(build_model, build_processor, max_batch_size, max_waiting, [engine for _, engine in pipes], control,
                  max_prefill_tokens, warmup))
        self.process.start()
        for _, engine in pipes:  # the engine holds these; closing ours lets each side see the other end
            engine.close()
        control.close()
        self.connections = [front for front, _ in pipes]
        while not self._control.poll(POLL_S):
            if not self.process.is_alive():
                raise RuntimeError(f"The engine process exited (code {self.process.exitcode}) while building the model")
        kind, payload = self._control.recv()
        if kind != "ready":
            self.process.join()
            raise RuntimeError(f"The engine process failed while building the model: {payload}")
        self.info: EngineInfo = payload

    def stop(self, timeout: float | None = None) -> None:
        """The requests added so far finish, then the batch and its process end."""
        if self.process.is_alive():
            try:
                self._control.send(("stop",))
            except OSError:
                pass
        self.process.join(timeout)


# -- the engine's side ---------------------------------------------------------------------------------------------


def _engine_main(build_model, build_processor, max_batch_size, max_waiting: int, connections: list, control,
                 max_prefill_tokens: int | None, warmup: bool) -> None:
    # The server's first process stops the engine after the HTTP processes drained: Ctrl-C reaches the whole group.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s:     %(message)s")
    try:
        began = time.perf_counter()
        processor = build_processor()
        loaded = time.perf_counter()
        model = build_model()
        built = time.perf_counter()
        budget = {} if max_prefill_tokens is None else {"max_prefill_tokens": max_prefill_tokens}  # None: the default
        normalizer = PixelNormalizer.for_processor(processor)
        manager = model.init_continuous_batching(max_batch_size=max_batch_size, **budget,
                                                 tokenizer=getattr(processor, "tokenizer", processor),
                                                 pixel_transform=normalizer)
        batched = time.perf_counter()
        if warmup:
            logger.info("engine process: graphs of the batch captured ahead in %.1f s", manager.warmup())
        engine = model.graph_engine()
        eos = model.generation_config.eos_token_id
        info = EngineInfo(row_slots=engine.cache.capacity, reserved=manager.past_end(engine),
                          max_requests=engine.cache.rows + max_waiting,
                          eos_ids=frozenset([] if eos is None else [eos] if isinstance(eos, int) else eos),
                          uint8_pixels=normalizer is not None, config=model.config)
    except Exception as error:  # noqa: BLE001 - reported to the first process, which raises it
        control.send(("failed", f"{type(error).__name__}: {error}"))
        return
    logger.info("engine process [%d]: %d rows of %d slots, up to %d prompt tokens admitted per turn; "
                "image patches cross as %s; built in %.1f s (processor %.1f, model %.1f, batch %.1f)",
                os.getpid(), engine.cache.rows, engine.cache.capacity, manager.max_prefill_tokens,
                "uint8, normalized on the device" if normalizer is not None else "float32 (the processor's own)",
                time.perf_counter() - began, loaded - began, built - loaded, batched - built)
    freeze_startup_heap("engine process")
    control.send(("ready", info))
    asyncio.run(_Engine(manager, normalizer, info.max_requests, connections).run(control))


class _Engine:
    def __init__(self, manager, normalizer, max_requests: int, connections: list):
        self.manager, self.normalizer, self.max_requests = manager, normalizer, max_requests
        self.connections = connections
        self.owner = {}  # request id -> the index of the HTTP process that sent it
        self.pending = {}  # HTTP process index -> outputs not sent yet
        self.error_sent = False
        self.cpu_start = time.process_time()
        self.gc = None  # the garbage collector's pauses while it runs
        self.loop = None
        self.stopping = None

    async def run(self, control) -> None:
        self.loop, self.stopping = asyncio.get_running_loop(), asyncio.Event()
        self.gc = GcPauses("engine process")
        try:
            self.manager.start()
            threading.Thread(target=self._read, args=(control,), name="qwen3vl-static-engine-requests",
                             daemon=True).start()
            await self.stopping.wait()
            await self.loop.run_in_executor(None, self.manager.stop)  # what was added finishes
            await asyncio.sleep(0)  # the last chunk's delivery, then its send
            await asyncio.sleep(0)
            self._flush()
        finally:
            self.gc.close()

    # -- requests in (the reader thread) ------------------------------------------------------------------------

    def _read(self, control) -> None:
        readers = {connection: MessageReader(connection) for connection in self.connections}
        try:
            self._read_from(readers, control)
        finally:
            for reader in readers.values():
                reader.close()

    def _read_from(self, readers: dict, control) -> None:
        live = {connection: index for index, connection in enumerate(self.connections)}
        live[control] = None
        while live:
            for connection in wait(list(live)):
                front = live[connection]
                try:
                    message = pickle.loads(readers[connection].read()) if front is not None else connection.recv()
                except (EOFError, OSError):
                    del live[connection]
                    # The first process gone: finish what runs and end. An HTTP process gone: its requests cancelled.
                    if front is None:
                        self.loop.call_soon_threadsafe(self.stopping.set)
                    else:
                        self.loop.call_soon_threadsafe(self._front_gone, front)
                    continue
                if message[0] == "submit":
                    try:
                        message = self._tensors(message)
                    except Exception as error:  # noqa: BLE001 - this request's inputs; the others go on
                        message = ("refuse", message[1], (400, f"The request's inputs could not be read "
                                                               f"({type(error).__name__}: {error})"))
                self.loop.call_soon_threadsafe(self._command, front, message)
                if message[0] == "stop":
                    return

    def _tensors(self, message: tuple) -> tuple:
        """A submission's arrays as the tensors `add_request` takes, uint8 patches checked for the batch's
        `pixel_transform` (which normalizes them on the device)."""
        kind, job_id, request_ids, inputs, settings = message
        tensors = {key: torch.from_numpy(value) if isinstance(value, np.ndarray) else value
                   for key, value in inputs.items()}
        if self.normalizer is not None and "pixel_values" in tensors:  # the image processor's: images only
            self.normalizer.check(tensors["pixel_values"])
        return kind, job_id, request_ids, tensors, settings

    # -- the loop -------------------------------------------------------------------------------------------

    def _command(self, front, message: tuple) -> None:
        kind = message[0]
        if kind == "submit":
            self._submit(front, *message[1:])
        elif kind == "refuse":
            self._send(front, ("submitted", message[1], message[2]))
        elif kind == "cancel":
            self.manager.cancel_request(message[1])
        elif kind == "stats":
            counters = {**self.manager.stats, "in_flight": len(self.owner),
                        "engine_cpu_s": time.process_time() - self.cpu_start, "engine_gc_ms": self.gc.ms,
                        "engine_gc_full": self.gc.full}
            self._send(front, ("stats", message[1], counters))
        else:  # "stop"
            self.stopping.set()

    def _submit(self, front: int, job_id: str, request_ids: list, inputs: dict, settings: list) -> None:
        manager = self.manager
        if manager.error is not None or self.stopping.is_set():
            reason = f"on an error: {manager.error}" if manager.error is not None else "(shutting down)"
            return self._send(front, ("submitted", job_id, (503, f"The model's batch has stopped {reason}")))
        if len(self.owner) + len(request_ids) > self.max_requests:
            return self._send(front, ("submitted", job_id, (
                503, f"The server is full: {len(self.owner)} requests are running or waiting, at most "
                     f"{self.max_requests} (rows + --max-waiting); retry later")))
        for request_id, own in zip(request_ids, settings):
            self.owner[request_id] = front
            # Called on this loop, a chunk per wake-up, with the tokens new since the last call.
            manager.register_result_handler(request_id, self._deliver, delta=True)
            manager.add_request(**inputs, request_id=request_id, streaming=True, **own)
        self._send(front, ("submitted", job_id, None))

    def _front_gone(self, front: int) -> None:
        for request_id, owner in list(self.owner.items()):
            if owner == front:
                self.manager.cancel_request(request_id)

    def _deliver(self, output) -> None:
        request_id = output.request_id
        front = self.owner[request_id]
        if output.status in ENDED:
            del self.owner[request_id]
        if not self.pending:
            self.loop.call_soon(self._flush)  # after the rest of the chunk's outputs, which this wake-up delivers
        self.pending.setdefault(front, []).append((request_id, output.status, output.generated_tokens, output.error))

    def _flush(self) -> None:
        if self.manager.error is not None and not self.error_sent:  # before the failures it explains
            self.error_sent = True
            for front in range(len(self.connections)):
                self._send(front, ("error", f"{type(self.manager.error).__name__}: {self.manager.error}"))
        pending, self.pending = self.pending, {}
        for front, outputs in pending.items():
            self._send(front, ("outputs", outputs))

    def _send(self, front: int, message: tuple) -> None:
        try:
            self.connections[front].send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))
        except OSError:  # the HTTP process is gone; the reader cancels its requests
            pass


class MessageReader:
    """The messages of one pipe end (`Connection.send_bytes`' framing: the size in 4 bytes, big-endian, or -1 and then
    8, then the bytes), each read straight into one buffer of its size, the interpreter lock free while the kernel
    copies. `Connection.recv_bytes` gathers a message in a BytesIO and copies it out, both holding the lock, and a 448²
    image request carries 1.2 MB of patches: its reading took 0.31-0.33 ms of CPU against 0.22-0.26 here, and a busy
    Python thread beside 300 such messages a second ran 15-17 % slower against 10-11 % (100 a second: 4-5 against 3-4;
    `bench/probes/pipe_read_probe.py`, 2 cores). An end that is not a socket (`Pipe(duplex=False)`, Windows) is read
    by `recv_bytes`."""

    def __init__(self, connection):
        self.connection, self.socket = connection, None
        handle = os.dup(connection.fileno())
        try:
            self.socket = socket.socket(fileno=handle)
        except OSError:
            os.close(handle)

    def read(self):
        """The next message's bytes; EOFError once the other end closed."""
        if self.socket is None:
            return self.connection.recv_bytes()
        (size,) = struct.unpack("!i", self._exactly(4))
        if size == -1:
            (size,) = struct.unpack("!Q", self._exactly(8))
        return self._exactly(size)

    def close(self) -> None:
        if self.socket is not None:
            self.socket.close()

    def _exactly(self, size: int) -> memoryview:
        buffer = memoryview(np.empty(size, dtype=np.uint8))  # not zeroed: every byte is read into
        got = 0
        while got < size:
            count = self.socket.recv_into(buffer[got:])
            if not count:
                raise EOFError
            got += count
        return buffer


# -- the HTTP process's side ---------------------------------------------------------------------------------------


class EngineClient:
    """An HTTP process's end of its pipe to the engine: submissions, cancellations and counters out; each choice's
    outputs (transformers' `GenerationOutput`, every token so far) to its handler on the event loop."""

    def __init__(self, connection, info: EngineInfo):
        self.connection, self.info = connection, info
        self.error = None  # what stopped the batch (or the engine process), if anything did
        self._gone = False  # the engine process exited
        self._outbox = queue.SimpleQueue()  # messages for the sender thread (the event loop never blocks on the pipe)
        self._requests = {}  # request id -> (handler, its tokens so far)
        self._waiting = {}  # job id or stats token -> the future its answer resolves
        self._tokens = itertools.count()
        self._loop = None

    def start(self) -> None:
        """Begin reading and sending (call on the event loop that handlers run on)."""
        self._loop = asyncio.get_running_loop()
        threading.Thread(target=self._send_all, name="qwen3vl-static-to-engine", daemon=True).start()
        threading.Thread(target=self._read_all, name="qwen3vl-static-from-engine", daemon=True).start()

    @property
    def alive(self) -> bool:
        return self.error is None

    async def submit(self, job_id: str, request_ids: list, inputs: dict, settings: list, handlers: list):
        """Add one job's choices, each with its own settings and handler; the engine's refusal `(status, message)`
        (the batch stopped or the server is full), else None."""
        if self.error is not None:
            return 503, f"The model's batch has stopped on an error: {self.error}"
        for request_id, handler in zip(request_ids, handlers):
            self._requests[request_id] = (handler, [])
        arrays = {key: value.numpy() if isinstance(value, torch.Tensor) else value for key, value in inputs.items()}
        refusal = await self._ask(job_id, ("submit", job_id, request_ids, arrays, settings), self._gone_refusal())
        if refusal is not None:
            for request_id in request_ids:
                self._requests.pop(request_id, None)
        return refusal

    def cancel(self, request_id: str) -> None:
        self._outbox.put(("cancel", request_id))

    async def stats(self) -> dict:
        """The batch's counters and the engine process's CPU time ({} once the engine process is gone)."""
        token = next(self._tokens)
        return await self._ask(token, ("stats", token), {})

    def _ask(self, key, message: tuple, if_gone) -> asyncio.Future:
        """A future of the engine's answer to `message`, or of `if_gone` when the engine process is gone."""
        future = self._loop.create_future()
        if self._gone:
            future.set_result(if_gone)
        else:
            self._waiting[key] = future
            self._outbox.put(message)
        return future

    def _gone_refusal(self) -> tuple:
        return 503, f"The model's batch has stopped: {self.error}"

    def _send_all(self) -> None:
        while True:
            message = self._outbox.get()
            try:
                self.connection.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))
            except OSError:
                return

    def _read_all(self) -> None:
        try:
            while True:
                try:
                    message = pickle.loads(self.connection.recv_bytes())
                except (EOFError, OSError):
                    self._loop.call_soon_threadsafe(self._engine_gone)
                    return
                self._loop.call_soon_threadsafe(self._take, message)
        except RuntimeError:  # the event loop closed: this process is ending
            return

    def _take(self, message: tuple) -> None:
        kind = message[0]
        if kind == "outputs":
            for request_id, status, new_tokens, error in message[1]:
                handler, tokens = self._requests.get(request_id, (None, None))
                if handler is None:
                    continue
                tokens += new_tokens
                if status in ENDED:
                    del self._requests[request_id]
                handler(GenerationOutput(request_id=request_id, generated_tokens=list(tokens), status=status,
                                         error=error))
        elif kind == "error":
            self.error = message[1]
        else:  # "submitted" or "stats": the answer someone awaits
            future = self._waiting.pop(message[1], None)
            if future is not None and not future.done():
                future.set_result(message[2])

    def _engine_gone(self) -> None:
        """The engine process exited: every waiting caller learns it."""
        self._gone = True
        self.error = self.error or "the engine process exited"
        for key, future in self._waiting.items():
            if not future.done():
                future.set_result(self._gone_refusal() if isinstance(key, str) else {})
        self._waiting.clear()
        requests, self._requests = self._requests, {}
        for request_id, (handler, tokens) in requests.items():
            handler(GenerationOutput(request_id=request_id, generated_tokens=list(tokens), status=RequestStatus.FAILED,
                                     error=f"the continuous batch stopped: {self.error}"))
