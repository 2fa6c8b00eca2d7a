"""The engine process's protocol without a model: the engine's loop over a stand-in manager in a thread of this
process, two HTTP processes' `EngineClient`s on one event loop, each over a pipe of its own."""

import asyncio
import multiprocessing
import pickle
import threading

import numpy as np
import pytest
import torch
from transformers.generation.continuous_batching.requests import GenerationOutput, RequestStatus

from qwen3vl_static.engine_process import EngineClient, EngineInfo, MessageReader, _Engine
from qwen3vl_static.pixels import PixelNormalizer

NORMALIZER = PixelNormalizer(rescale_factor=1 / 255, mean=(0.5,) * 3, std=(0.5,) * 3, channels_fused=True)
INFO = EngineInfo(row_slots=64, reserved=16, max_requests=3, eos_ids=frozenset([2]), uint8_pixels=True)
TIMEOUT_S = 30


class StandInManager:
    """What the engine uses of the continuous-batching manager; `emit` delivers an output as the manager does (to the
    handler's event loop)."""

    def __init__(self):
        self.added, self.cancelled, self.handlers = {}, [], {}
        self.error = None
        self.stats = {"steps": 7}
        self.stopped = threading.Event()

    def start(self):
        pass

    def stop(self):
        self.stopped.set()

    def register_result_handler(self, request_id, callback, delta=False):
        assert delta  # the engine takes each output's new tokens only
        self.handlers[request_id] = (callback, asyncio.get_running_loop())

    def add_request(self, input_ids, request_id, streaming, **kwargs):
        self.added[request_id] = {"input_ids": input_ids, "streaming": streaming, **kwargs}

    def cancel_request(self, request_id):
        self.cancelled.append(request_id)

    def emit(self, request_id, tokens, status=RequestStatus.DECODING):
        """An output with the tokens new since the last (`delta` handlers')."""
        callback, loop = self.handlers[request_id]
        loop.call_soon_threadsafe(callback, GenerationOutput(request_id=request_id, generated_tokens=list(tokens),
                                                             status=status))


@pytest.fixture
def engine():
    """(manager, control pipe, [two clients' connections]); the engine's loop runs until the control pipe says stop."""
    pipes = [multiprocessing.Pipe() for _ in range(2)]
    control, engine_control = multiprocessing.Pipe()
    manager = StandInManager()
    runner = threading.Thread(target=lambda: asyncio.run(
        _Engine(manager, NORMALIZER, INFO.max_requests, [end for _, end in pipes]).run(engine_control)), daemon=True)
    runner.start()
    yield manager, control, [front for front, _ in pipes]
    control.send(("stop",))
    runner.join(TIMEOUT_S)
    assert not runner.is_alive()


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, TIMEOUT_S))


async def eventually(condition):
    while not condition():
        await asyncio.sleep(0.01)


def test_requests_cross_with_their_settings_and_uint8_patches_for_the_device(engine):
    manager, _, connections = engine
    patches = torch.randint(0, 256, (4, 3 * 8), dtype=torch.uint8)

    async def main():
        client = EngineClient(connections[0], INFO)
        client.start()
        refusal = await client.submit("job", ["job-0", "job-1"], {"input_ids": torch.tensor([[5, 6, 7]]),
                                                                  "pixel_values": patches},
                                      [{"max_new_tokens": 4, "seed": 1}, {"max_new_tokens": 4, "seed": 2}],
                                      [lambda _: None] * 2)
        assert refusal is None

    run(main())
    assert list(manager.added) == ["job-0", "job-1"]
    first = manager.added["job-0"]
    assert first["streaming"] and first["max_new_tokens"] == 4 and first["seed"] == 1
    assert manager.added["job-1"]["seed"] == 2
    assert torch.equal(first["input_ids"], torch.tensor([[5, 6, 7]]))
    assert first["pixel_values"].dtype == torch.uint8 and torch.equal(first["pixel_values"], patches)  # as they
    # crossed: the batch normalizes them on the device


def test_outputs_reach_their_own_client_with_every_token_so_far(engine):
    manager, _, connections = engine

    async def main():
        clients = [EngineClient(connection, INFO) for connection in connections]
        received = {0: [], 1: []}
        for index, client in enumerate(clients):
            client.start()
            assert await client.submit(f"job{index}", [f"job{index}-0"], {"input_ids": torch.tensor([[1]])},
                                       [{}], [received[index].append]) is None
        manager.emit("job0-0", [4, 5])
        manager.emit("job1-0", [9])
        manager.emit("job0-0", [6])
        manager.emit("job0-0", [2], RequestStatus.FINISHED)
        await eventually(lambda: len(received[0]) == 3 and received[1])
        return received

    received = run(main())
    assert [output.generated_tokens for output in received[0]] == [[4, 5], [4, 5, 6], [4, 5, 6, 2]]
    assert [output.status for output in received[0]][-1] == RequestStatus.FINISHED
    assert [output.generated_tokens for output in received[1]] == [[9]]


def test_the_queue_bound_counts_every_clients_requests_and_bad_inputs_fail_alone(engine):
    manager, _, connections = engine

    async def main():
        first, second = (EngineClient(connection, INFO) for connection in connections)
        first.start()
        second.start()
        ids = {"input_ids": torch.tensor([[1]])}
        assert await first.submit("a", ["a-0", "a-1"], ids, [{}, {}], [lambda _: None] * 2) is None
        status, message = await second.submit("b", ["b-0", "b-1"], ids, [{}, {}], [lambda _: None] * 2)
        assert status == 503 and "The server is full: 2 requests" in message and "at most 3" in message
        for odd in (torch.zeros(2, 7, dtype=torch.uint8), torch.zeros(2, 6)):  # 7 values: not 3 channels' worth;
            odd = {**ids, "pixel_values": odd}  # float: not what the batch's normalizer takes
            status, message = await second.submit("c", ["c-0"], odd, [{}], [lambda _: None])
            assert status == 400 and "could not be read" in message and "must be uint8" in message
        assert await second.submit("d", ["d-0"], ids, [{}], [lambda _: None]) is None
        manager.emit("a-0", [3], RequestStatus.FINISHED)  # a row frees (before the counters are asked for)
        stats = await second.stats()
        assert stats["in_flight"] == 2 and stats["steps"] == 7 and stats["engine_cpu_s"] >= 0
        assert await second.submit("e", ["e-0"], ids, [{}], [lambda _: None]) is None

    run(main())
    assert sorted(manager.added) == ["a-0", "a-1", "d-0", "e-0"]


def test_a_client_gone_cancels_its_requests_only(engine):
    manager, _, connections = engine
    first = connections[0]
    # The first client played by hand (an EngineClient's threads would hold its pipe open), the second an EngineClient.

    def submit(connection, job_id, request_ids):
        connection.send_bytes(pickle.dumps(("submit", job_id, request_ids, {"input_ids": np.ones((1, 1), np.int64)},
                                            [{}] * len(request_ids))))
        assert pickle.loads(connection.recv_bytes()) == ("submitted", job_id, None)

    async def main():
        second = EngineClient(connections[1], INFO)
        second.start()
        assert await second.submit("b", ["b-0"], {"input_ids": torch.tensor([[1]])}, [{}], [lambda _: None]) is None
        await asyncio.to_thread(submit, first, "a", ["a-0", "a-1"])
        first.close()
        await eventually(lambda: len(manager.cancelled) == 2)

    run(main())
    assert sorted(manager.cancelled) == ["a-0", "a-1"]


def test_an_engine_gone_fails_what_waits_and_refuses_what_comes():
    """The engine played by hand: it accepts one job, then its end of the pipe closes."""
    front, engine_end = multiprocessing.Pipe()

    def accept_then_exit():
        kind, job_id, *_ = pickle.loads(engine_end.recv_bytes())
        engine_end.send_bytes(pickle.dumps(("submitted", job_id, None)))
        engine_end.send_bytes(pickle.dumps(("outputs", [(f"{job_id}-0", RequestStatus.DECODING, [7, 8], None)])))
        engine_end.close()

    threading.Thread(target=accept_then_exit, daemon=True).start()

    async def main():
        client = EngineClient(front, INFO)
        client.start()
        received = []
        assert await client.submit("a", ["a-0"], {"input_ids": torch.tensor([[1]])}, [{}], [received.append]) is None
        await eventually(lambda: not client.alive)
        refusal = await client.submit("b", ["b-0"], {"input_ids": torch.tensor([[1]])}, [{}], [received.append])
        return received, refusal, await client.stats()

    received, refusal, stats = run(main())
    assert [output.generated_tokens for output in received] == [[7, 8], [7, 8]]
    assert received[-1].status == RequestStatus.FAILED and "the engine process exited" in received[-1].error
    assert refusal[0] == 503 and "the engine process exited" in refusal[1]
    assert stats == {}


@pytest.mark.parametrize("duplex", [True, False], ids=["socket", "os-pipe"])
def test_the_engine_reads_each_message_whole_as_the_pipe_framed_it(duplex):
    """`MessageReader` reads what `Connection.send_bytes` wrote, message by message, small ones and a request's
    megabytes of patches (on a socket straight into one buffer; an end that is not a socket through `recv_bytes`),
    and raises EOFError once the other end closed."""
    reading, writing = multiprocessing.Pipe(duplex=duplex)
    reader = MessageReader(reading)
    assert (reader.socket is not None) == duplex
    patches = np.random.default_rng(0).integers(0, 256, (784, 1536), dtype=np.uint8)
    messages = [pickle.dumps(("submit", "job", ["r"], {"pixel_values": patches}, [{}]), protocol=5), b"", b"x",
                pickle.dumps(("cancel", "r-1"))]
    sender = threading.Thread(target=lambda: [writing.send_bytes(message) for message in messages] + [writing.close()])
    sender.start()
    try:
        got = [bytes(reader.read()) for _ in messages]
        with pytest.raises(EOFError):
            reader.read()
    finally:
        sender.join()
        reader.close()
        reading.close()
    assert got == messages
    assert np.array_equal(pickle.loads(got[0])[3]["pixel_values"], patches)
