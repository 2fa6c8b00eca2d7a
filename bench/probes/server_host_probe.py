"""How much of the server process's CPU does one streamed token take? `serve`'s app over a stand-in batch (no model, no
GPU: every --step-ms it draws one token for each running request and hands that step's outputs to the event loop in
one wake-up, as the continuous batch does), driven by --clients closed-loop streaming clients in this process (the
benchmark's, `bench_server.closed_loop`), text-only chats (`--image`: the benchmark's, a 448x448 JPEG and a question)
of --new-tokens tokens.

At 64 clients the H200's decode step is ~2.5 ms, so the event loop gets 64 tokens to send every 2.5 ms while the
batch's thread needs the same interpreter lock between steps: the CPU microseconds a token costs here bound that.
Runs on any machine (the CPU only). Writes `$OUT/server_host_probe.json` (default bench/results/): the server
process's CPU per streamed token, tokens/s delivered, the stand-in's late steps; `--profile` adds the event loop's
top functions (cProfile, in the server process).

    python bench/probes/server_host_probe.py [--clients 64] [--step-ms 2.5] [--new-tokens 128] [--requests 256] [--image]
"""

import argparse
import asyncio
import copy
import cProfile
import io
import json
import os
import platform
import pstats
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
from transformers.generation.continuous_batching.requests import GenerationOutput, RequestStatus

from qwen3vl_static.bench_server import (NAME, bench_processor, chat_body, closed_loop, free_port, image_url,
                                         process_cpu_s, summarize, wait_until_up)
from qwen3vl_static.server import METRICS

ROW_SLOTS = 4096


class StandInBatch:
    """The part of the continuous-batching manager's API the server uses, drawing `tokens` in turn for every running
    request each `step_s` seconds on a thread of its own."""

    def __init__(self, step_s: float, tokens: list):
        self.step_s, self.tokens = step_s, tokens
        self.stats = dict.fromkeys(METRICS, 0)
        self.error = None
        self.late_steps = 0
        self._new, self._cancelled = queue.SimpleQueue(), queue.SimpleQueue()
        self._handlers = {}
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stand-in-batch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def is_running(self) -> bool:
        return self._thread.is_alive()

    def stop(self, block: bool = True, timeout: float | None = None) -> None:
        self._stopping.set()
        if block:
            self._thread.join(timeout)

    @staticmethod
    def past_end(engine) -> int:
        return 0

    def add_request(self, input_ids, request_id: str, max_new_tokens: int, streaming: bool = True, **_) -> str:
        self._new.put((request_id, max_new_tokens))
        return request_id

    def register_result_handler(self, request_id: str, callback) -> None:
        self._handlers[request_id] = (callback, asyncio.get_running_loop())

    def cancel_request(self, request_id: str) -> None:
        self._cancelled.put(request_id)

    def _run(self) -> None:
        running, due = {}, time.perf_counter()
        while not self._stopping.is_set() or running:
            due += self.step_s
            while not self._new.empty():
                request_id, new_tokens = self._new.get()
                output = GenerationOutput(request_id=request_id)
                output.status = RequestStatus.DECODING
                running[request_id] = (output, new_tokens)
            while not self._cancelled.empty():
                running.pop(self._cancelled.get(), None)
            calls = {}
            for request_id, (output, new_tokens) in list(running.items()):
                output.generated_tokens.append(self.tokens[len(output.generated_tokens) % len(self.tokens)])
                snapshot = copy.copy(output)  # as the manager hands out: a copy holding every token so far
                snapshot.generated_tokens = list(output.generated_tokens)
                if len(output.generated_tokens) == new_tokens:
                    snapshot.status = RequestStatus.FINISHED
                    del running[request_id]
                callback, loop = self._handlers[request_id]
                calls.setdefault(loop, []).append((callback, snapshot))
            for loop, batch in calls.items():
                loop.call_soon_threadsafe(lambda batch=batch: [callback(output) for callback, output in batch])
            self.stats["steps"] += 1
            wait = due - time.perf_counter()
            if wait < 0:
                self.late_steps += 1
                due = time.perf_counter()
            time.sleep(max(wait, 0))


def visible_tokens(tokenizer, count: int = 64) -> list:
    """Ids that decode, alone, to text (the benchmark's random weights draw such tokens)."""
    tokens = []
    for token in range(1000, 200_000):
        if len(tokens) == count:
            return tokens
        text = tokenizer.decode([token], skip_special_tokens=True)
        if text.strip() and "\ufffd" not in text:
            tokens.append(token)
    raise RuntimeError("the tokenizer decodes too few ids to text")


def server_main(port: int, step_ms: float, profile: Path | None) -> None:
    import uvicorn

    from qwen3vl_static.server import OpenAIServer

    processor = bench_processor()
    batch = StandInBatch(step_ms / 1000, visible_tokens(processor.tokenizer))
    engine = SimpleNamespace(cache=SimpleNamespace(capacity=ROW_SLOTS, rows=1024))
    model = SimpleNamespace(init_continuous_batching=lambda **_: batch, graph_engine=lambda: engine,
                            generation_config=SimpleNamespace(eos_token_id=None))
    sys.setswitchinterval(0.0005)  # as `serve`
    app = OpenAIServer(model, processor, NAME).app()

    @app.get("/probe")
    def probe() -> dict:
        return {"late_steps": batch.late_steps, "steps": batch.stats["steps"]}

    signal.signal(signal.SIGTERM, lambda *_: None)  # uvicorn raises it again after draining: exit cleanly instead
    profiler = cProfile.Profile() if profile else None
    if profiler:
        profiler.enable()
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")
    if profiler:
        profiler.disable()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(45)
        profile.write_text(text.getvalue())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--step-ms", type=float, default=2.5)
    parser.add_argument("--image", action="store_true", help="the benchmark's chats: a 448x448 image and a question")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--server", type=int, help=argparse.SUPPRESS)  # the server process: its port
    parser.add_argument("--profile-to", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.server:
        return server_main(args.server, args.step_ms, args.profile_to)
    import httpx

    out = Path(os.environ.get("OUT", "bench/results"))
    out.mkdir(parents=True, exist_ok=True)
    port, profile = free_port(), (out / "server_host_probe-profile.txt") if args.profile else None
    child = [sys.executable, __file__, "--server", str(port), "--step-ms", str(args.step_ms)]
    process = subprocess.Popen(child + (["--profile-to", str(profile)] if profile else []))
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until_up(base, process, Path(os.devnull))
        if args.image:  # the benchmark's bodies: a 448x448 JPEG data URL and a question
            urls = [image_url(np.random.default_rng(index)) for index in range(8)]
            bodies = [chat_body(index, urls[index % 8], new_tokens=args.new_tokens) for index in range(args.requests)]
        else:
            bodies = [{"model": NAME, "stream": True, "stream_options": {"include_usage": True},
                       "max_tokens": args.new_tokens, "temperature": 0,
                       "messages": [{"role": "user", "content": "What does this show, in detail?"}]}] * args.requests
        asyncio.run(closed_loop(base, bodies[:args.clients], args.clients))  # warm up
        before_cpu, before = process_cpu_s(process.pid), httpx.get(f"{base}/probe").json()
        answers, seconds = asyncio.run(closed_loop(base, bodies, args.clients))
        cpu, after = process_cpu_s(process.pid) - before_cpu, httpx.get(f"{base}/probe").json()
    finally:
        process.terminate()
        process.wait(timeout=60)
    row = summarize(answers, seconds, new_tokens=args.new_tokens)
    tokens = args.requests * args.new_tokens
    result = {"command": " ".join(["python", *sys.argv]), "machine": platform.processor() or platform.machine(),
              "cores": os.cpu_count(), "python": platform.python_version(), **vars(args),
              "server_cpu_us_per_token": 1e6 * cpu / tokens, "server_cores_busy": cpu / seconds,
              "tokens_per_s": tokens / seconds, "steps_per_s": (after["steps"] - before["steps"]) / seconds,
              "late_steps": after["late_steps"] - before["late_steps"],
              **{key: row[key] for key in ("ttft_ms_p50", "itl_ms_p50", "itl_ms_p99", "tokens_per_chunk")}}
    result.pop("server"), result.pop("profile_to")
    if profile:
        result["profile"] = profile.read_text().splitlines()[:45]
    print(json.dumps({key: value for key, value in result.items() if key != "profile"}, indent=1))
    path = out / "server_host_probe.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
