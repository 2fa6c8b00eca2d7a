"""`bench --server`: the OpenAI server under concurrent streaming clients, over real HTTP on one machine.

The server is `serve`'s, with its defaults (cache rows sized from the GPU's memory), in a process of its own: the
preset's shapes with random weights (seed 0), EOS off, and a processor whose tokenizer has Qwen's special-token ids
(`real_ids_tokenizer`) and whose image processor is the checkpoint's. The clients are asyncio tasks, each streaming one
chat completion after another (a closed loop at each concurrency): a 448x448 JPEG as a data URL and a
QUESTION_TOKENS-token question, NEW_TOKENS new tokens, greedy. Past CLIENTS_PER_PROCESS clients they run in processes of
their own, that many to a process (`client_processes`), so that no client's event loop is busy enough to delay what
it measures. The concurrencies run in passes: the first pass meets the graph captures and kernel measurements on
the way, the later ones (`--server-passes`, default one) run on them; every pass is reported, and past one later pass
each concurrency's median and range over them (`pass_spread`).

Reported per concurrency: TTFT (request sent to its first text, HTTP and image decoding included), inter-token latency
(between a stream's text chunks, as vLLM's benchmark counts it; with the tokens per chunk beside it), time per output
token (a request's time after its first text over its other tokens), output tokens/s (the completion tokens the server
reports, over the wall time). Checked: every answer has NEW_TOKENS tokens and finish reason "length", and the first
concurrency's first MIN_REQUESTS answers are compared with `generate` on the same prompts in this process after the
server stops.
"""

import argparse
import asyncio
import base64
import gc
import importlib
import io
import json
import os
import queue
import re
import resource
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from .bench_batching import percentile
from .presets import ASSETS, real_ids_tokenizer
from .workloads import build_ours, generate_exactly_as_asked

CONCURRENCY = (1, 16, 64, 256)
MIN_REQUESTS = 16
IMAGE_SIDE = 448
QUESTION_TOKENS = 30
NEW_TOKENS = 128
# The row figures whose median and range over the measured passes `pass_spread` gives.
SPREAD = ("output_tokens_per_s", "ttft_ms_p50", "ttft_ms_p99", "itl_ms_p50", "itl_ms_p99", "tpot_ms_p50")
NAME = "qwen3vl-static-bench"
START_TIMEOUT_S = 900  # the server builds its model first
CLIENTS_PER_PROCESS = 16  # streaming clients per client process (`client_processes`)


def bench_processor(model: str = "2b"):
    """The processor the server and the reference share: the preset's image processor (the fast one where torchvision
    is installed, as a user's full processor has it) and `real_ids_tokenizer`."""
    from transformers import AutoImageProcessor, Qwen2VLImageProcessor

    from .dataset_runner import ImageChatProcessor

    folder = ASSETS / f"qwen3-vl-{model}"
    try:
        image_processor = AutoImageProcessor.from_pretrained(folder)
    except ImportError:
        image_processor = Qwen2VLImageProcessor.from_pretrained(folder)
    return ImageChatProcessor(real_ids_tokenizer(model), image_processor)


def bench_model(model: str = "2b", kv_cache_dtype: str = "auto"):
    """The served model: the preset's shapes with random weights (seed 0), EOS off (built in the engine process)."""
    built = build_ours(torch.device("cuda"), torch.bfloat16, model, kv_cache_dtype=kv_cache_dtype)
    generate_exactly_as_asked(built)
    return built


def server_main(argv=None) -> None:
    """The server's processes: `serve` on the bench model until SIGTERM."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", default="2b")
    parser.add_argument("--api-server-count", type=int)
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--max-prefill-tokens", type=int)
    parser.add_argument("--warmup", action="store_true")
    args = parser.parse_args(argv)
    from .server import serve

    serve(partial(bench_model, args.model, args.kv_cache_dtype), partial(bench_processor, args.model), NAME, port=args.port,
          api_servers=args.api_server_count, max_prefill_tokens=args.max_prefill_tokens, warmup=args.warmup)


def start_split(log: str) -> dict:
    """Where the server's start went, as it logs it: the engine process's build (processor, model, batch; seconds)
    and the engine ready after the start (the HTTP processes start then)."""
    built = re.search(r"built in ([0-9.]+) s \(processor ([0-9.]+), model ([0-9.]+), batch ([0-9.]+)\)", log)
    ready = re.search(r"ready ([0-9.]+) s after the start", log)
    names = ("engine_built_s", "processor_s", "model_s", "batch_s")
    split = dict(zip(names, map(float, built.groups()))) if built else {}
    return split | ({"engine_ready_s": float(ready[1])} if ready else {})


def served_processes(log: str) -> tuple:
    """(HTTP processes, render threads in each) as `serve` logs them at start."""
    found = re.search(r"from (\d+) HTTP process\(es\) of (\d+) render threads each", log)
    return (int(found[1]), int(found[2])) if found else (None, None)


def image_url(generator: np.random.Generator) -> str:
    """A JPEG data URL of a smooth random picture (colour gradients and boxes: the size of a photo's JPEG, not
    noise's)."""
    y, x = np.mgrid[0:IMAGE_SIDE, 0:IMAGE_SIDE] / IMAGE_SIDE
    pixels = np.stack([generator.uniform(0, 255) * x + generator.uniform(0, 255) * y for _ in range(3)], axis=-1) / 2
    for _ in range(6):
        top, left = generator.integers(0, IMAGE_SIDE - 64, 2)
        pixels[top:top + 64, left:left + 64] = generator.uniform(0, 255, 3)
    data = io.BytesIO()
    Image.fromarray(pixels.astype(np.uint8)).save(data, format="JPEG", quality=90)
    return "data:image/jpeg;base64," + base64.b64encode(data.getvalue()).decode()


def question(index: int) -> str:
    """QUESTION_TOKENS characters, one token each."""
    return f"Request {index}: what does this picture show, in detail?".ljust(QUESTION_TOKENS)[:QUESTION_TOKENS]


def chat_body(index: int, url: str, model: str = NAME, new_tokens: int = NEW_TOKENS) -> dict:
    return {"model": model, "stream": True, "stream_options": {"include_usage": True}, "max_tokens": new_tokens,
            "temperature": 0, "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": question(index)}]}]}


async def stream_one(client, url: str, body: dict) -> dict:
    """One streamed chat completion: when it was sent, when each text chunk came, its text, usage and finish reason."""
    sent, arrivals, pieces, usage, finish = time.perf_counter(), [], [], None, None
    async with client.stream("POST", url, json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread()).decode()[:300]}")
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                break
            chunk = json.loads(line[len("data: "):])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            usage = chunk.get("usage") or usage
            for choice in chunk["choices"]:
                if choice["delta"].get("content"):
                    arrivals.append(time.perf_counter())
                    pieces.append(choice["delta"]["content"])
                finish = choice["finish_reason"] or finish
    return {"sent": sent, "arrivals": arrivals, "text": "".join(pieces), "usage": usage, "finish_reason": finish}


async def closed_loop(base: str, bodies: list, concurrency: int, headers: dict | None = None) -> tuple:
    """`bodies` through `concurrency` clients of this process, each sending its next as soon as its last ended:
    (answers, seconds)."""
    import httpx

    pending, answers = iter(enumerate(bodies)), [None] * len(bodies)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=base, timeout=600, limits=limits, headers=headers) as client:
        async def client_loop():
            for index, body in pending:
                answers[index] = await stream_one(client, "/v1/chat/completions", body)

        began = time.perf_counter()
        await asyncio.gather(*(client_loop() for _ in range(concurrency)))
        return answers, time.perf_counter() - began


def client_processes(concurrency: int) -> int:
    """Processes for `concurrency` streaming clients: one per CLIENTS_PER_PROCESS, at most half the cores.
    One process's event loop parsing every client's stream would be busy most of the time at 64 clients, and a busy
    loop reads the tokens late and sends the next requests late: its own delays would count as the server's."""
    return max(1, min(-(-concurrency // CLIENTS_PER_PROCESS), (os.cpu_count() or 2) // 2))


def run_clients(base: str, bodies: list, concurrency: int, headers: dict | None = None,
                processes: int | None = None, on_start=None) -> tuple:
    """`closed_loop` with the clients split over `processes` processes (default `client_processes`), each with its
    share of the clients and every `processes`-th body, started together once every process is ready: (answers in
    `bodies`' order, seconds from the first client's start to the last one's end, each client process's CPU seconds,
    what `on_start()` returned just before the start, or None)."""
    import multiprocessing

    processes = min(processes or client_processes(concurrency), concurrency)
    if processes == 1:
        started = on_start() if on_start is not None else None
        cpu = process_cpu_s()
        answers, seconds = asyncio.run(closed_loop(base, bodies, concurrency, headers))
        return answers, seconds, [process_cpu_s() - cpu], started
    context = multiprocessing.get_context("spawn")
    go, messages = context.Event(), context.Queue()
    workers = [context.Process(target=_client_process, name=f"bench-clients-{index}", daemon=True,
                               args=(base, bodies[index::processes],
                                     concurrency // processes + (index < concurrency % processes), headers, go,
                                     messages, index))
               for index in range(processes)]
    for worker in workers:
        worker.start()
    try:
        for _ in workers:
            _next_message(messages, workers)  # ready
        started = on_start() if on_start is not None else None
        go.set()
        shares = [_next_message(messages, workers) for _ in workers]
    except BaseException:  # interrupted (or a client failed): the others stop now, not after their requests
        for worker in workers:
            worker.kill()
        raise
    finally:
        for worker in workers:
            worker.join(timeout=10)
            if worker.is_alive():
                worker.kill()
    failed = [share["error"] for share in shares if share["error"] is not None]
    if failed:
        raise RuntimeError(f"a client process failed: {failed[0]}")
    answers = [None] * len(bodies)
    for share in shares:
        answers[share["index"]::processes] = share["answers"]
    seconds = max(share["ended"] for share in shares) - min(share["began"] for share in shares)
    return answers, seconds, [share["cpu_s"] for share in shares], started


def _next_message(messages, workers: list):
    """The client processes' next message; raises once one of them exited without sending it."""
    while True:
        try:
            return messages.get(timeout=1)
        except queue.Empty:
            dead = next((worker for worker in workers if worker.exitcode not in (None, 0)), None)
            if dead is not None:
                raise RuntimeError(f"the client process {dead.name} exited with code {dead.exitcode}") from None


def _client_process(base: str, bodies: list, clients: int, headers, go, messages, index: int) -> None:
    """One client process of `run_clients`: "ready", then, once `go` is set, its share: its answers, when it began and
    ended (perf_counter: one clock for the machine's processes), its CPU seconds, its error or None."""
    importlib.import_module("httpx")  # before the start: every process begins its clients at once
    messages.put("ready")
    go.wait()
    cpu, began = process_cpu_s(), time.perf_counter()
    try:
        answers, error = asyncio.run(closed_loop(base, bodies, clients, headers))[0], None
    except Exception as failure:  # noqa: BLE001 - the parent raises it
        answers, error = None, f"{type(failure).__name__}: {failure}"
    messages.put({"index": index, "answers": answers, "began": began, "ended": time.perf_counter(),
                  "cpu_s": process_cpu_s() - cpu, "error": error})


def summarize(answers: list, seconds: float, new_tokens: int = NEW_TOKENS) -> dict:
    ttft = [1000 * (answer["arrivals"][0] - answer["sent"]) for answer in answers]
    itl = [1000 * (after - before) for answer in answers for before, after in zip(answer["arrivals"], answer["arrivals"][1:])]
    tokens = [answer["usage"]["completion_tokens"] for answer in answers]
    tpot = [1000 * (answer["arrivals"][-1] - answer["arrivals"][0]) / (count - 1) for answer, count in zip(answers, tokens)]
    return {"requests": len(answers), "seconds": seconds, "output_tokens_per_s": sum(tokens) / seconds,
            "ttft_ms_p50": statistics.median(ttft), "ttft_ms_p99": percentile(ttft, 0.99),
            "itl_ms_p50": statistics.median(itl), "itl_ms_p99": percentile(itl, 0.99),
            "tpot_ms_p50": statistics.median(tpot), "tpot_ms_p99": percentile(tpot, 0.99),
            "tokens_per_chunk": sum(tokens) / sum(len(answer["arrivals"]) for answer in answers),
            "prompt_tokens": answers[0]["usage"]["prompt_tokens"],
            "answers_as_asked": sum(count == new_tokens and answer["finish_reason"] == "length"
                                    for answer, count in zip(answers, tokens))}


def pass_spread(rows: list) -> list:
    """Per concurrency, in the order met, the median, least and greatest of each SPREAD figure over its measured
    passes (the rows whose `run` is "second"; the first pass meets the captures and is left out)."""
    by_level = {}
    for row in rows:
        if row["run"] == "second":
            by_level.setdefault(row["concurrency"], []).append(row)
    spread = []
    for level, measured in by_level.items():
        figures = {"concurrency": level, "passes": len(measured)}
        for key in SPREAD:
            values = [row[key] for row in measured]
            figures |= {f"{key}_median": statistics.median(values), f"{key}_min": min(values),
                        f"{key}_max": max(values)}
        spread.append(figures)
    return spread


def server_split(log: str, ttft_ms_p50: float) -> dict:
    """A row's time to first token split by the server's log lines of its requests (`log`: what the server logged
    during the row), p50 / p99 each: a request's read and render in its HTTP process, the engine's taking it, its first
    token back from the engine after the hand-over (intake, the wait for a row and an admission, the prefill, the chunk
    that reads its token, the message back), its first text sent after its body began to be read (the server's whole
    share); and the clients' TTFT p50 less that share's p50 (`ttft_outside_server_ms`: the client's own loop, the
    connection and the framework's parts before and after the handler)."""
    found = {name: [float(ms) for ms in re.findall(pattern, log)] for name, pattern in (
        ("server_read_and_render_ms", r"read and rendered in ([0-9.]+) ms"),
        ("engine_intake_ms", r"taken by the engine in ([0-9.]+) ms"),
        ("engine_first_token_ms", r"first token back from the engine ([0-9.]+) ms after"),
        ("server_first_text_ms", r"first text sent ([0-9.]+) ms after"))}
    split = {}
    for name, values in found.items():
        if values:
            split |= {f"{name}_p50": statistics.median(values), f"{name}_p99": percentile(values, 0.99)}
    if "server_first_text_ms_p50" in split:
        split["ttft_outside_server_ms"] = ttft_ms_p50 - split["server_first_text_ms_p50"]
    return split


def gc_pauses_logged(log: str) -> dict:
    """The garbage collector's pauses of LONG_PAUSE_MS or more that the server's processes logged during a row (`log`):
    how many in the engine process and in the HTTP processes, and the longest."""
    found = re.findall(r"(engine process|HTTP process \[\d+\]): garbage collection paused it ([0-9.]+) ms", log)
    return {"gc_long_pauses_engine": sum(process == "engine process" for process, _ in found),
            "gc_long_pauses_http": sum(process != "engine process" for process, _ in found),
            "gc_pause_ms_max": max((float(ms) for _, ms in found), default=0.0)}


def metrics(base: str) -> dict:
    """The server's GET /metrics counters by name."""
    import httpx

    lines = httpx.get(f"{base}/metrics", timeout=10).text.splitlines()
    return {name: float(value) for name, value in (line.split() for line in lines if not line.startswith("#"))}


def batch_counters(before: dict, after: dict, seconds: float) -> dict:
    """What the batch did during a row: the GPU's busy fractions, prefill launches and requests per launch, the share of
    launches beside decoding rows (the prefill and the steps then share the GPU), the steps per chunk (the tokens a
    stream gets at once). Per prefill launch: its GPU time (a vision tower still running beside it included), the batch
    thread's host time issuing it (where that comes near the GPU time, the host bounds admissions) and whether it ran
    eagerly for want of a graph. Per admitted request, how long it waited in the batch for its prefill's launch (and of
    that, in the input queue until the batch's thread took it in), and from that launch to the batch reading its first
    token. The GPU time decoding rows waited for a prefill beside them, per launch (its rows began before it was
    through), and from its end to its rows beginning (time they could have decoded). Of the requests with images, the
    share the tower encoded beside a decode chunk rather than as they entered. The shares of the row's time the batch's
    thread waited for the GPU (reading a chunk's tokens: near 0, the host bounds the batch, not the GPU), issued
    admissions, took requests in and issued the tower ahead, and the engine process stood still in the garbage
    collector (with its full passes); and of the GPU's time between decode chunks while
    requests went on decoding, with the count of such gaps of 10 ms or more (each held every stream's next token)."""
    def grown(name):
        return after[f"qwen3vl_static_{name}"] - before[f"qwen3vl_static_{name}"]

    prefills = grown("prefills_total")
    ahead = grown("requests_encoded_ahead_total")
    return {"gpu_prefill_busy": grown("gpu_prefill_seconds_total") / seconds,
            "gpu_decode_busy": grown("gpu_decode_seconds_total") / seconds, "prefills": int(prefills),
            "requests_per_prefill": grown("admitted_requests_total") / max(prefills, 1),
            "prefill_gpu_ms_mean": 1000 * grown("gpu_prefill_seconds_total") / max(prefills, 1),
            "admit_host_ms_mean": 1000 * grown("admit_host_seconds_total") / max(prefills, 1),
            "eager_prefill_share": grown("eager_prefills_total") / max(prefills, 1),
            "admission_wait_ms_mean": 1000 * grown("admission_wait_seconds_total")
            / max(grown("admitted_requests_total"), 1),
            "admission_queued_ms_mean": 1000 * grown("admission_queued_seconds_total")
            / max(grown("admitted_requests_total"), 1),
            "first_token_read_ms_mean": 1000 * grown("first_token_read_seconds_total")
            / max(grown("admitted_requests_total"), 1),
            "prefill_beside_share": grown("prefills_beside_total") / max(prefills, 1),
            "activation_wait_ms_per_prefill": 1000 * grown("gpu_activation_wait_seconds_total") / max(prefills, 1),
            "activation_slack_ms_per_prefill": 1000 * grown("gpu_activation_slack_seconds_total") / max(prefills, 1),
            "decode_steps": int(grown("decode_steps_total")),
            "steps_per_chunk": grown("decode_steps_total") / max(grown("decode_chunks_total"), 1),
            "engine_cores_busy": grown("engine_cpu_seconds_total") / seconds,
            "engine_gc_share": grown("engine_gc_pause_seconds_total") / seconds,
            "engine_gc_full_collections": int(grown("engine_gc_full_collections_total")),
            "host_wait_share": grown("host_wait_seconds_total") / seconds,
            "admit_host_share": grown("admit_host_seconds_total") / seconds,
            "take_in_share": grown("take_in_seconds_total") / seconds,
            "media_ahead_host_share": grown("media_ahead_host_seconds_total") / seconds,
            "decode_stall_share": grown("gpu_decode_stall_seconds_total") / seconds,
            "decode_long_stalls": int(grown("decode_long_stalls_total")),
            "encoded_ahead_share": ahead / max(ahead + grown("requests_encoded_at_admission_total"), 1)}


def process_cpu_s(pid: int | None = None) -> float:
    """CPU seconds (user + system) used by this process, or by `pid` and the processes under it, running now (Linux)."""
    if pid is None:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        children = [int(child) for task in Path(f"/proc/{pid}/task").iterdir()
                    for child in (task / "children").read_text().split()]
    except OSError:  # gone meanwhile
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK") + sum(map(process_cpu_s, children))


@contextmanager
def terminated_as_exit():
    """Within it, SIGTERM (`timeout`'s, a job scheduler's) raises SystemExit in the main thread instead of ending the
    process at once, so that `finally` blocks stop the server and the client processes it started: otherwise they go
    on serving and loading the machine after the benchmark is gone."""

    def exit_now(signum, frame):
        raise SystemExit(128 + signum)

    before = signal.signal(signal.SIGTERM, exit_now)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


def stop_server(process: subprocess.Popen, timeout: float = 60) -> None:
    """SIGTERM to a server started with `Popen`, which drains and exits; killed if it has not within `timeout` s."""
    process.terminate()
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def wait_until_up(base: str, process, log: Path) -> None:
    import httpx

    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited ({process.returncode}): {log.read_text()[-2000:]}")
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the server did not start within {START_TIMEOUT_S} s: {log.read_text()[-2000:]}")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def reference_answers(model_name: str, urls: list, indices: list, kv_cache_dtype: str) -> tuple:
    """`generate`'s answers (new token ids) to the chat bodies of `indices`, in this process (the server's weights,
    cache dtype and processor), and that processor."""
    from .media import MediaLimits, fetch_image

    model = bench_model(model_name, kv_cache_dtype)
    processor, answers = bench_processor(model_name), []
    for index in indices:
        image = asyncio.run(fetch_image(urls[index], MediaLimits(), client=None))  # as the server reads it
        messages = [{"role": "user", "content": [{"type": "image", "image": image},
                                                 {"type": "text", "text": question(index)}]}]
        inputs = processor.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=True,
                                               return_tensors="pt").to(model.device)
        out = model.generate(**inputs, max_new_tokens=NEW_TOKENS)
        answers.append(out[0, inputs["input_ids"].shape[1]:].tolist())
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return answers, processor


def tokens_agreeing(text: str, tokens: list, processor) -> int:
    """How many of `tokens`, from the first, the streamed `text` starts with."""
    agreeing = 0
    while agreeing < len(tokens) and text.startswith(processor.decode(
            tokens[:agreeing + 1], skip_special_tokens=True, clean_up_tokenization_spaces=False)):
        agreeing += 1
    return agreeing


def server_rows(args) -> dict:
    """The --server measurement: each concurrency's row per pass, and the first concurrency's first answers against
    `generate`."""
    generator = np.random.default_rng(0)
    levels = args.server_concurrency
    counts = {level: max(MIN_REQUESTS, args.server_requests_per_client * level) for level in levels}
    urls = [image_url(generator) for _ in range(max(counts.values()))]
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    with tempfile.NamedTemporaryFile(prefix="bench-server-", suffix=".log", delete=False) as file:
        log = Path(file.name)
    rows, first_level_answers = [], None
    with terminated_as_exit():  # a SIGTERM stops the server and the clients before the benchmark ends
        with log.open("w") as sink:
            child = ["--port", str(port), "--model", args.model, "--kv-cache-dtype", args.kv_cache_dtype]
            if args.server_api_server_count:
                child += ["--api-server-count", str(args.server_api_server_count)]
            if args.server_max_prefill_tokens:
                child += ["--max-prefill-tokens", str(args.server_max_prefill_tokens)]
            if args.server_warmup:
                child += ["--warmup"]
            process = subprocess.Popen([sys.executable, "-m", "qwen3vl_static.bench_server", *child], stdout=sink,
                                       stderr=subprocess.STDOUT)
        try:
            began = time.perf_counter()
            wait_until_up(base, process, log)
            start_s = time.perf_counter() - began
            for number, run in enumerate(("first",) + ("second",) * args.server_passes, start=1):
                for level in levels:
                    bodies = [chat_body(index, urls[index]) for index in range(counts[level])]
                    # The server's counters from when the clients start.
                    answers, seconds, client_cpu, (server_cpu, counters, logged) = run_clients(
                        base, bodies, level, processes=args.server_client_processes,
                        on_start=lambda: (process_cpu_s(process.pid), metrics(base), log.stat().st_size))
                    # Cores busy on average: a client process near 1 is the measurement's own limit; the server's are
                    # its processes' together (the engine's alone: engine_cores_busy, from /metrics).
                    cores = {"client_processes": len(client_cpu), "client_cores_busy": sum(client_cpu) / seconds,
                             "client_cores_busy_most": max(client_cpu) / seconds,
                             "server_cores_busy": (process_cpu_s(process.pid) - server_cpu) / seconds}
                    row = {"run": run, "pass": number, "concurrency": level, **summarize(answers, seconds), **cores,
                           **batch_counters(counters, metrics(base), seconds)}
                    with log.open("rb") as file:  # what the server logged during the row: its requests' lines
                        file.seek(logged)
                        logged_text = file.read().decode(errors="replace")
                        row |= server_split(logged_text, row["ttft_ms_p50"]) | gc_pauses_logged(logged_text)
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                    if number == 2 and level == levels[0]:
                        first_level_answers = answers
        finally:
            stopping = time.perf_counter()
            stop_server(process)
            stop_s = time.perf_counter() - stopping
    checked = list(range(min(counts[levels[0]], MIN_REQUESTS)))  # the first level's first answers
    began = time.perf_counter()
    expected, processor = reference_answers(args.model, urls, checked, args.kv_cache_dtype)
    reference_s = time.perf_counter() - began
    # Random weights leave near-ties that bf16 rounding of another schedule (the batch's cache and kernels, not
    # generate's) settles either way, and an answer goes its own way after one: the leading tokens that agree say
    # how far. The CUDA tests check the batch's tokens against stock's where the margin is clear.
    agreeing = [tokens_agreeing(answer["text"], tokens, processor)
                for answer, tokens in zip(first_level_answers, expected)]
    text = log.read_text()
    http_processes, render_threads = served_processes(text)
    # Where a run's fixed time goes, beside the passes: the server's start and its drain at SIGTERM, the reference.
    spread = {"spread": pass_spread(rows)} if args.server_passes > 1 else {}
    return {"rows": rows, **spread, "server_start_s": start_s, "server_start_split": start_split(text),
            "server_stop_s": stop_s, "reference_s": reference_s,
            "server_log_tail": text[-4000:],
            f"concurrency_{levels[0]}_answers_equal_generate": f"{agreeing.count(NEW_TOKENS)}/{len(agreeing)}",
            f"concurrency_{levels[0]}_tokens_agreeing_with_generate": agreeing,
            "kv_cache_dtype": args.kv_cache_dtype, "requests_per_client": args.server_requests_per_client,
            "measured_passes": args.server_passes,
            "max_prefill_tokens": args.server_max_prefill_tokens or "serve's default",
            "http_processes": http_processes, "render_threads_per_http_process": render_threads,
            "warmup": args.server_warmup,
            "image": f"{IMAGE_SIDE}x{IMAGE_SIDE} JPEG data URL",
            "image_processor": type(processor.image_processor).__name__,
            "question_tokens": QUESTION_TOKENS,
            "new_tokens": NEW_TOKENS}


if __name__ == "__main__":
    server_main()
