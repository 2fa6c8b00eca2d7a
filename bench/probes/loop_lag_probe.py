"""How late does an HTTP process's event loop run while its render threads render a burst of requests, by their number
and priority and the interpreter's switch interval? The loop is what sends every stream's tokens: each of its
wake-ups that comes late delays the tokens of all the streams the process serves (the inter-token p99 at 64 clients).

One process as `serve`'s HTTP processes are: an asyncio loop and a pool of render threads. A ticker on the loop sleeps
1 ms at a time and records how late each wake-up comes, while bursts of `bench --server`'s chat (its 448x448 JPEG data
URL and question, through `render_chat` with the bench's processor) render in the pool, one burst after another.
Reported per switch interval and number of render threads, in a plain pool (the loop's priority) and in `serve`'s
(`render_pool`: the threads below the loop's priority): the lateness p50 / p99 / max over the bursts, the bursts'
render p50, and the same ticker with nothing rendering. CPU only: no GPU is used.

Usage: python bench/probes/loop_lag_probe.py [--burst 16] [--threads 4 1] [--bursts 5] [--switch-ms 5 0.5]
"""

import argparse
import asyncio
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import harness
from qwen3vl_static.bench_server import bench_processor
from qwen3vl_static.media import MediaLimits
from qwen3vl_static.server import RENDER_NICENESS, render_chat, render_pool

TICK_S = 0.001


def percentile(values: list, share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))]


async def measure(render, executor, burst: int, bursts: int) -> dict:
    """The ticker's lateness (ms) while `bursts` bursts of `burst` renders run in `executor` one after another (none:
    the ticker alone for a while), and each render's time from its burst's start."""
    loop, late, renders, rendering = asyncio.get_running_loop(), [], [], True

    async def ticker():
        while rendering:
            due = time.perf_counter() + TICK_S
            await asyncio.sleep(TICK_S)
            late.append(1000 * (time.perf_counter() - due))

    async def one(start: float):
        await loop.run_in_executor(executor, render)
        renders.append(1000 * (time.perf_counter() - start))

    task = asyncio.create_task(ticker())
    if executor is None:
        await asyncio.sleep(0.5)
    for _ in range(bursts if executor is not None else 0):
        start = time.perf_counter()
        await asyncio.gather(*(one(start) for _ in range(burst)))
    rendering = False
    await task
    return {"late_ms_p50": percentile(late, 0.5), "late_ms_p99": percentile(late, 0.99), "late_ms_max": max(late),
            "ticks": len(late), "render_ms_p50": statistics.median(renders) if renders else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--burst", type=int, default=16, help="requests at once (64 clients over 4 HTTP processes)")
    parser.add_argument("--threads", type=int, nargs="+", default=[4, 1],
                        help="render threads (serve's on 16 cores: 4 a process)")
    parser.add_argument("--bursts", type=int, default=5)
    parser.add_argument("--switch-ms", type=float, nargs="+", default=[5.0, 0.5])
    args = parser.parse_args()
    processor, media = bench_processor("2b"), MediaLimits()
    messages = harness.bench_chat(media)

    def render():
        render_chat(processor, media, messages)

    for _ in range(5):
        render()
    rows = {}
    for switch_ms in args.switch_ms:
        sys.setswitchinterval(switch_ms / 1000)
        forms = [("idle", None)]
        forms += [(f"{threads} render threads", ThreadPoolExecutor(threads)) for threads in args.threads]
        forms += [(f"{threads} render threads at nice +{RENDER_NICENESS} (serve's pool)", render_pool(threads))
                  for threads in args.threads]
        for name, pool in forms:
            row = asyncio.run(measure(render, pool, args.burst, args.bursts))
            rows[f"switch {switch_ms} ms, {name}"] = row
            print(f"switch {switch_ms} ms, {name}: late p50 {row['late_ms_p50']:.2f} / p99 {row['late_ms_p99']:.2f} / "
                  f"max {row['late_ms_max']:.2f} ms, render p50 {row['render_ms_p50']}", flush=True)
    harness.write_cpu_json({"burst": args.burst, "bursts": args.bursts,
                            "image_processor": type(processor.image_processor).__name__, "forms": rows})


if __name__ == "__main__":
    main()
