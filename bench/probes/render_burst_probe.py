"""How long an HTTP process takes to render a burst of requests (a wave of clients that all send at once), by how
many threads render them: `bench --server`'s chat (its 448x448 JPEG data URL and question) through `render_chat` with
the bench's processor, N at once on one event loop, through asyncio's default executor (a thread per request, as
`asyncio.to_thread`) and through pools of 1, 2, 4 ... threads. Reports each request's latency from the burst's start
(median of the bursts' p50 and max), and one render alone. CPU only: no GPU is used.

Usage: python bench/probes/render_burst_probe.py [--burst 16] [--threads 1 2 4] [--bursts 7]
"""

import argparse
import asyncio
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import harness
from qwen3vl_static.bench_server import bench_processor
from qwen3vl_static.media import MediaLimits
from qwen3vl_static.server import render_chat


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--burst", type=int, default=16, help="requests at once (64 clients over 4 HTTP processes)")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--bursts", type=int, default=7)
    args = parser.parse_args()
    processor, media = bench_processor("2b"), MediaLimits()
    messages = harness.bench_chat(media)
    for _ in range(5):
        render_chat(processor, media, messages)
    began = time.perf_counter()
    for _ in range(20):
        render_chat(processor, media, messages)
    alone_ms = 1000 * (time.perf_counter() - began) / 20

    async def burst(executor) -> list:
        loop, start = asyncio.get_running_loop(), time.perf_counter()

        async def one() -> float:
            await loop.run_in_executor(executor, render_chat, processor, media, messages)
            return 1000 * (time.perf_counter() - start)

        return sorted(await asyncio.gather(*(one() for _ in range(args.burst))))

    forms = {"a thread per request": None, **{f"{threads} threads": ThreadPoolExecutor(threads)
                                              for threads in args.threads}}
    rows = {}
    for name, executor in forms.items():
        bursts = [asyncio.run(burst(executor)) for _ in range(args.bursts)]
        rows[name] = {"p50_ms": statistics.median(statistics.median(each) for each in bursts),
                      "max_ms": statistics.median(each[-1] for each in bursts),
                      "p50_ms_range": [min(statistics.median(each) for each in bursts),
                                       max(statistics.median(each) for each in bursts)]}
        print(f"{name}: p50 {rows[name]['p50_ms']:.1f} ms, max {rows[name]['max_ms']:.1f} ms")
    print(f"one render alone: {alone_ms:.1f} ms")
    harness.write_cpu_json({"burst": args.burst, "bursts": args.bursts, "render_alone_ms": alone_ms, "forms": rows})


if __name__ == "__main__":
    main()
