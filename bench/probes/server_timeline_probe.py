"""Where does the GPU wait while `bench --server` runs at many clients? The bench's server (its model, processor and
defaults) with torch's profiler in the engine process for part of a measured closed-loop pass: CUDA's activity (every
kernel and copy on each stream, and every CUDA runtime call of every thread of the engine process), summarized as each
stream's busy time, the GPU's idle gaps by length, and the runtime calls that took longest per thread; and a picture of
the streams' busy share over time, with a zoom on the first requests of the window.

A first pass captures and tunes (not profiled); the second pass is the bench's second; the profiler runs from its
start for --seconds. The profiler's kernel records cost the GPU a little: its figures are for reading the shape of the
timeline, not for the bench's tables. Its records can stop before the window ends (at 64 clients on an H100 they held
the first ~700 ms of 1.2 s): the summary's busy and idle times cover the span its kernels were recorded in.

Usage: python bench/probes/server_timeline_probe.py [--concurrency 64] [--seconds 1.2] [--requests-per-client 4]
"""

import argparse
import asyncio
import collections
import json
import subprocess
import sys
import tempfile
import threading
import time
from functools import partial
from pathlib import Path

import harness
import numpy as np

from qwen3vl_static.bench_server import (NAME, bench_model, bench_processor, chat_body,
                                         closed_loop, free_port, image_url, summarize, wait_until_up)

GAP_BINS_MS = (0.05, 0.5, 2.0, 10.0)  # idle gaps shorter than each, and the rest
DEVICE_KINDS = ("kernel", "gpu_memcpy", "gpu_memset")


def profiled_model(trace_dir: str):
    """The bench's model, and a thread that profiles this (the engine) process once `trace_dir/start` appears, for the
    seconds it holds, into `trace_dir/engine.json` (then `trace_dir/done`)."""
    model = bench_model()
    threading.Thread(target=_profile_when_asked, args=(Path(trace_dir),), daemon=True).start()
    return model


def _profile_when_asked(folder: Path) -> None:
    import torch

    start = folder / "start"
    while not start.exists():
        time.sleep(0.005)
    seconds = float(start.read_text())
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as profile:
        time.sleep(seconds)
    profile.export_chrome_trace(str(folder / "engine.json"))
    (folder / "done").write_text("")


def serve_main(port: int, trace_dir: str) -> None:
    from qwen3vl_static.server import serve

    serve(partial(profiled_model, trace_dir), bench_processor, NAME, port=port)


def merged(intervals: list) -> list:
    """Intervals (start, end) merged where they overlap, in order."""
    out = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return out


def device_events(trace: dict) -> list:
    """The trace's kernels, copies and memsets."""
    return [event for event in trace["traceEvents"] if event.get("ph") == "X" and event.get("cat") in DEVICE_KINDS]


def stream_intervals(device: list, begin: float = 0.0) -> dict:
    """stream -> its events' (start, end) in ms after `begin` (trace microseconds)."""
    streams = collections.defaultdict(list)
    for event in device:
        streams[event["args"].get("stream", -1)].append(((event["ts"] - begin) / 1000,
                                                        (event["ts"] + event["dur"] - begin) / 1000))
    return dict(sorted(streams.items()))


def longest(events: list, group, most: int) -> dict:
    """Per `group(event)`, the `most` event names with the longest total time: {group: {name: {count, ms}}}."""
    totals = collections.defaultdict(lambda: collections.defaultdict(lambda: [0, 0.0]))
    for event in events:
        entry = totals[group(event)][event["name"][:80]]
        entry[0] += 1
        entry[1] += event["dur"] / 1000
    return {key: {name: {"count": count, "ms": round(ms, 3)}
                  for name, (count, ms) in sorted(names.items(), key=lambda item: -item[1][1])[:most]}
            for key, names in totals.items()}


def summarize_trace(trace: dict) -> dict:
    """Each stream's busy time, kernels and the kernels that took longest, the GPU's idle gaps (no stream busy) by
    length, and per thread of the process the CUDA runtime calls by total time; times in ms."""
    events = [event for event in trace["traceEvents"] if event.get("ph") == "X" and "dur" in event]
    device = device_events(trace)
    runtime = [event for event in events if event.get("cat") in ("cuda_runtime", "cuda_driver")]
    streams = stream_intervals(device)
    busy = merged([interval for intervals in streams.values() for interval in intervals])
    gaps = [after[0] - before[1] for before, after in zip(busy, busy[1:])]
    bins = collections.Counter()
    for gap in gaps:
        bins[next((f"<{edge} ms" for edge in GAP_BINS_MS if gap < edge), f">={GAP_BINS_MS[-1]} ms")] += gap
    return {
        "window_ms": (max(event["ts"] + event["dur"] for event in events) - min(event["ts"] for event in events)) / 1000,
        "kernels_recorded_ms": busy[-1][1] - busy[0][0],
        "top_kernels_by_stream": longest(device, lambda event: str(event["args"].get("stream", -1)), 12),
        "streams": {str(stream): {"kernels": len(intervals), "busy_ms": sum(b - a for a, b in merged(intervals))}
                    for stream, intervals in streams.items()},
        "gpu_busy_ms": sum(b - a for a, b in busy),
        "idle_gaps_ms_by_length": {name: bins[name] for name in
                                   [*(f"<{edge} ms" for edge in GAP_BINS_MS), f">={GAP_BINS_MS[-1]} ms"]},
        "idle_gaps": len(gaps),
        "runtime_calls_by_thread": longest(runtime, lambda event: str(event.get("tid")), 8),
    }


def picture(trace: dict, path: Path, bin_ms: float = 5.0, zoom_ms: float = 60.0) -> None:
    """Each stream's busy share per `bin_ms` over the window, and the first `zoom_ms` of it interval by interval."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    device = device_events(trace)
    streams = stream_intervals(device, begin=min(event["ts"] for event in device))
    figure, (whole, zoom) = plt.subplots(2, 1, figsize=(13, 7))
    for lane, (stream, intervals) in enumerate(streams.items()):
        spans = merged(intervals)
        edges = np.arange(0, max(b for _, b in spans) + bin_ms, bin_ms)
        share = np.zeros(len(edges) - 1)
        for a, b in spans:
            for index in range(int(a // bin_ms), min(int(b // bin_ms) + 1, len(share))):
                share[index] += max(0.0, min(b, edges[index + 1]) - max(a, edges[index])) / bin_ms
        whole.step(edges[:-1], share, where="post", label=f"stream {stream} ({len(intervals)} kernels)")
        zoom.broken_barh([(a, b - a) for a, b in spans if a < zoom_ms], (lane - 0.4, 0.8))
    whole.set(xlabel="ms", ylabel=f"busy share per {bin_ms:g} ms", title="GPU streams in the engine process")
    whole.legend(loc="upper right", fontsize=8)
    zoom.set(xlim=(0, zoom_ms), xlabel="ms", yticks=range(len(streams)),
             yticklabels=[f"stream {stream}" for stream in streams], title=f"the first {zoom_ms:g} ms")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=1.2)
    parser.add_argument("--requests-per-client", type=int, default=4)
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--trace-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        return serve_main(args.port, args.trace_dir)
    harness.require_cuda()
    folder = Path(tempfile.mkdtemp(prefix="server-timeline-"))
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = folder / "server.log"
    generator = np.random.default_rng(0)
    requests = args.requests_per_client * args.concurrency
    urls = [image_url(generator) for _ in range(requests)]
    bodies = [chat_body(index, urls[index]) for index in range(requests)]
    with log.open("w") as sink:
        process = subprocess.Popen([sys.executable, __file__, "--serve", "--port", str(port), "--trace-dir",
                                    str(folder)], stdout=sink, stderr=subprocess.STDOUT)
    try:
        wait_until_up(base, process, log)
        rows = []
        for run in ("first", "second"):
            if run == "second":
                (folder / "start").write_text(str(args.seconds))
            answers, seconds = asyncio.run(closed_loop(base, bodies, args.concurrency))
            rows.append({"run": run, **summarize(answers, seconds)})
            print(json.dumps(rows[-1]), flush=True)
        deadline = time.monotonic() + 300
        while not (folder / "done").exists() and time.monotonic() < deadline:
            time.sleep(0.5)
    finally:
        process.terminate()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    trace = json.loads((folder / "engine.json").read_text())
    summary = summarize_trace(trace)
    print(json.dumps(summary, indent=1))
    written = harness.write_json({"concurrency": args.concurrency, "profiled_seconds": args.seconds, "rows": rows,
                                  "timeline": summary})
    picture(trace, written.with_suffix(".png"))


if __name__ == "__main__":
    main()
