"""How much does the engine process's reader thread slow the batch's thread while requests arrive? Both share one
interpreter lock: whatever the reader does holding it, the batch's thread waits for.

A busy Python thread (a fixed loop standing in for the batch's host work, timed) beside a reader thread that takes
messages from a pipe as `serve`'s engine does: a submission of `bench --server`'s size (a 448x448 image's uint8
patches, 784 x 1536, with its prompt's ids and positions), sent by another process at `--rates` messages a second.
Read by `Connection.recv_bytes` (a BytesIO of the pieces, then a copy out, holding the lock) and by the engine's
`MessageReader` (straight into one buffer, the kernel copying with the lock free), alternately. Reported per rate and
form: the busy loop's median time against its time alone, and the reader thread's CPU time a message. CPU only.

Usage: python bench/probes/pipe_read_probe.py [--rates 100 200 400] [--rounds 2] [--loops 5]
"""

import argparse
import multiprocessing
import pickle
import statistics
import sys
import threading
import time

import numpy as np

import harness
from qwen3vl_static.engine_process import SWITCH_INTERVAL_S, MessageReader

SECONDS = 4


def send(connection, rate: float, seconds: float) -> None:
    """`bench --server`'s submission, `rate` times a second for `seconds`, then the end closed."""
    patches = np.random.default_rng(0).integers(0, 256, (784, 1536), dtype=np.uint8)
    inputs = {"input_ids": np.arange(247)[None], "pixel_values": patches, "image_grid_thw": np.array([[1, 28, 28]]),
              "position_ids": np.zeros((3, 247), dtype=np.int64)}
    message = pickle.dumps(("submit", "job", ["job-0"], inputs, [{"max_new_tokens": 128}]),
                           protocol=pickle.HIGHEST_PROTOCOL)
    due = end = time.perf_counter()
    end += seconds
    while time.perf_counter() < end:
        connection.send_bytes(message)
        due += 1 / rate
        time.sleep(max(0.0, due - time.perf_counter()))
    connection.close()


def busy_ms() -> float:
    began, total = time.perf_counter(), 0
    for step in range(2_000_000):
        total += step & 7
    return 1000 * (time.perf_counter() - began)


def measure(context, rate: float, form: str, loops: int) -> dict:
    reading, writing = context.Pipe()
    sender = context.Process(target=send, args=(writing, rate, SECONDS))
    sender.start()
    writing.close()
    read = reading.recv_bytes if form == "recv_bytes" else MessageReader(reading).read
    received, arriving, cpu = [0], threading.Event(), [0.0]

    def reader():
        began = time.thread_time()
        try:
            while True:
                pickle.loads(read())
                received[0] += 1
                arriving.set()
        except EOFError:
            cpu[0] = time.thread_time() - began

    thread = threading.Thread(target=reader)
    thread.start()
    arriving.wait()  # the sending process has started (it imports this module first)
    times = [busy_ms() for _ in range(loops)]
    sent_while_timed = received[0]
    sender.join()
    thread.join()
    reading.close()
    return {"busy_ms_p50": statistics.median(times), "busy_ms": times, "messages": received[0],
            "messages_while_timed": sent_while_timed, "reader_cpu_ms_per_message": 1000 * cpu[0] / received[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", type=float, nargs="+", default=[100, 200, 400])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--loops", type=int, default=5)
    args = parser.parse_args()
    sys.setswitchinterval(SWITCH_INTERVAL_S)  # the engine process's
    context = multiprocessing.get_context("spawn")
    alone = statistics.median(busy_ms() for _ in range(args.loops))
    print(f"busy loop alone: {alone:.1f} ms")
    rows = []
    for rate in args.rates:
        for round_ in range(args.rounds):
            for form in ("recv_bytes", "MessageReader"):
                row = {"rate": rate, "round": round_, "form": form, **measure(context, rate, form, args.loops)}
                row["slowdown"] = row["busy_ms_p50"] / alone - 1
                rows.append(row)
                print(f"{rate:.0f}/s {form}: busy loop {row['busy_ms_p50']:.1f} ms ({100 * row['slowdown']:+.0f} %), "
                      f"{row['messages']} messages, the reader's CPU {row['reader_cpu_ms_per_message']:.3f} ms each")
    harness.write_cpu_json({"busy_ms_alone": alone, "seconds_per_run": SECONDS, "rows": rows})


if __name__ == "__main__":
    main()
