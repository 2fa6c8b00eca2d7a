"""Where do the GPU and the engine process's threads spend a measured pass of `bench --server` at many clients? The
bench's server (its model, processor and defaults) with a profiler in the engine process for part of a measured
closed-loop pass:

- `--profile cuda` (torch's profiler): CUDA's activity (every kernel and copy on each stream, and every CUDA runtime
  call of every thread of the engine process), summarized as each stream's busy time, the GPU's idle gaps by length,
  and the runtime calls that took longest per thread; and a picture of the streams' busy share over time, with a zoom
  on the first requests of the window.
- `--profile threads`: each thread's CPU time in the window (the kernel's per-thread counters, named by Python's
  threads), and, where py-spy is installed and may read the process, where each thread's wall time went (py-spy's
  samples of every thread, idle ones too: by thread, innermost function and innermost function of this package, and
  the most frequent whole stacks).

A first pass captures and tunes (not profiled); the second pass is the bench's second; the profiler runs from its
start for --seconds. The profiler's kernel records cost the GPU a little: its figures are for reading the shape of the
timeline, not for the bench's tables. Its records can stop before the window ends (at 64 clients on an H100 they held
the first ~700 ms of 1.2 s): the summary's busy and idle times cover the span its kernels were recorded in.

Usage: python bench/probes/server_timeline_probe.py [--profile cuda|threads] [--concurrency 64] [--seconds 1.2]
       [--requests-per-client 4]
"""

import argparse
import collections
import ctypes
import json
import os
import shutil
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
                                         free_port, image_url, run_clients, stop_server, summarize, wait_until_up)

GAP_BINS_MS = (0.05, 0.5, 2.0, 10.0)  # idle gaps shorter than each, and the rest
DEVICE_KINDS = ("kernel", "gpu_memcpy", "gpu_memset")


def profiled_model(trace_dir: str, profile: str):
    """The bench's model, and a thread that profiles this (the engine) process once `trace_dir/start` appears, for the
    seconds it holds, into `trace_dir/engine.json` (then `trace_dir/done`)."""
    model = bench_model()
    threading.Thread(target=_profile_when_asked, args=(Path(trace_dir), profile), daemon=True).start()
    return model


def _profile_when_asked(folder: Path, profile: str) -> None:
    start = folder / "start"
    while not start.exists():
        time.sleep(0.005)
    seconds = float(start.read_text())
    if profile == "cuda":
        import torch

        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as profiler:
            time.sleep(seconds)
        profiler.export_chrome_trace(str(folder / "engine.json"))
    else:
        (folder / "engine.json").write_text(json.dumps(thread_profile(seconds, folder)))
    (folder / "done").write_text("")


def thread_cpu_s() -> dict:
    """This process's threads' CPU seconds (user + system) by native id, from the kernel's counters."""
    tick = os.sysconf("SC_CLK_TCK")
    times = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            fields = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended
            continue
        times[int(tid)] = (int(fields[11]) + int(fields[12])) / tick
    return times


def thread_profile(seconds: float, folder: Path) -> dict:
    """Each thread's share of a core over the next `seconds`, and py-spy's samples of every thread's stack."""
    names = {thread.native_id: thread.name for thread in threading.enumerate()}
    spy = shutil.which("py-spy")
    sampler = None
    if spy is not None:
        # py-spy reads this process's memory: a child may, only where the process allows it (Yama's ptrace scope 1).
        ctypes.CDLL(None).prctl(0x59616D61, ctypes.c_ulong(-1), 0, 0, 0)  # PR_SET_PTRACER, PR_SET_PTRACER_ANY
        sampler = subprocess.Popen([spy, "record", "--pid", str(os.getpid()), "--idle", "--threads", "--nonblocking",
                                    "--rate", "500", "--duration", str(max(1, round(seconds))), "--format", "raw",
                                    "--output", str(folder / "stacks.txt")],
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    before, began = thread_cpu_s(), time.perf_counter()
    time.sleep(seconds)
    after, wall = thread_cpu_s(), time.perf_counter() - began
    shares = collections.Counter()
    for tid, cpu in after.items():
        shares[names.get(tid, "native (not a Python thread)")] += (cpu - before.get(tid, 0.0)) / wall
    out = {"wall_s": wall, "core_share_by_thread": {name: round(share, 3) for name, share in shares.most_common()},
           "process_core_share": round(sum(shares.values()), 3)}
    if sampler is None:
        out["stacks"] = "py-spy is not installed"
    else:
        said = sampler.communicate(timeout=seconds + 120)[0]
        samples = folder / "stacks.txt"
        out["stacks"] = stack_summary(samples.read_text()) if samples.exists() else f"py-spy failed: {said[-1500:]}"
    return out


def stack_summary(raw: str, most: int = 15) -> dict:
    """py-spy's raw samples (`frames count` lines, the thread first) as each thread's share of them, and per thread the
    functions they were in: innermost frame, innermost frame of this package, and the most frequent whole stacks."""
    threads = collections.Counter()
    inner, ours, stacks = (collections.defaultdict(collections.Counter) for _ in range(3))
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        name, count = frames[0], int(count)  # "thread (native id): name"
        threads[name] += count
        inner[name][frames[-1][:120]] += count
        mine = [frame for frame in frames[1:] if "qwen3vl_static" in frame]
        ours[name][mine[-1][:120] if mine else "(outside the package)"] += count
        stacks[name][" < ".join(frame.split(" (")[0] for frame in reversed(frames[1:]))[:400]] += count

    def shares(counter: collections.Counter, of: int) -> dict:
        return {key: round(count / of, 4) for key, count in counter.most_common(most)}

    return {"samples_by_thread": dict(threads.most_common()),
            "innermost_by_thread": {name: shares(inner[name], threads[name]) for name in threads},
            "package_frame_by_thread": {name: shares(ours[name], threads[name]) for name in threads},
            "stacks_by_thread": {name: shares(stacks[name], threads[name]) for name in threads}}


def serve_main(port: int, trace_dir: str, profile: str) -> None:
    from qwen3vl_static.server import serve

    serve(partial(profiled_model, trace_dir, profile), bench_processor, NAME, port=port)


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
    parser.add_argument("--profile", choices=("cuda", "threads"), default="cuda")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=1.2)
    parser.add_argument("--requests-per-client", type=int, default=4)
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--trace-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        return serve_main(args.port, args.trace_dir, args.profile)
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
                                    str(folder), "--profile", args.profile], stdout=sink, stderr=subprocess.STDOUT)
    try:
        wait_until_up(base, process, log)
        rows = []
        for run in ("first", "second"):
            if run == "second":
                (folder / "start").write_text(str(args.seconds))
            answers, seconds, *_ = run_clients(base, bodies, args.concurrency)
            rows.append({"run": run, **summarize(answers, seconds)})
            print(json.dumps(rows[-1]), flush=True)
        deadline = time.monotonic() + 300
        while not (folder / "done").exists() and time.monotonic() < deadline:
            time.sleep(0.5)
    finally:
        stop_server(process)
    trace = json.loads((folder / "engine.json").read_text())
    summary = summarize_trace(trace) if args.profile == "cuda" else trace
    print(json.dumps(summary, indent=1))
    written = harness.write_json({"concurrency": args.concurrency, "profile": args.profile,
                                  "profiled_seconds": args.seconds, "rows": rows,
                                  "timeline" if args.profile == "cuda" else "threads": summary},
                                 suffix="" if args.profile == "cuda" else "-threads")
    if args.profile == "cuda":
        picture(trace, written.with_suffix(".png"))


if __name__ == "__main__":
    main()
