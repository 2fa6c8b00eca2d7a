"""How long, and how often, does Python's garbage collector stop the server's processes while they stream? Each pause
holds the interpreter lock of its process: in the engine process it holds the batch's thread (every row's next
step), in an HTTP process its event loop (every token of the streams it serves).

`serve` on a tiny random-weight checkpoint, on the CPU, from each source tree given (`--trees`: e.g. this one and a
`git archive` of another commit, to compare), one engine process and one HTTP process. Every process logs each of the
collector's passes (its generation and milliseconds: a `sitecustomize` module on the server's path that hooks
`gc.callbacks`), while `--clients` streaming clients send `--requests` chats, each a 64x64 JPEG data URL and a
question, `--tokens` tokens each. Reported per tree and run: in each process, the passes during the clients' window by
generation (count, total and longest ms), and the clients' gaps between stream chunks (p50 / p99 / max). The passes at
start-up are left out. CPU only; `--runs` rounds, the trees' order reversed every other round.

Usage: python bench/probes/gc_pause_probe.py [--trees . /tmp/before] [--runs 3] [--requests 600] [--clients 16]
"""

import argparse
import asyncio
import base64
import io
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
from PIL import Image

import harness
from qwen3vl_static.bench_server import free_port, stop_server, wait_until_up

# Imported first by every process started with this folder on its path: each collector pass, one line per pass.
SITECUSTOMIZE = '''
import gc, os, time
folder = os.environ.get("GC_PAUSE_LOG_DIR")
if folder:
    sink = open(os.path.join(folder, f"{os.getpid()}.log"), "a", buffering=1)
    began = [0.0]
    def passed(phase, info):
        if phase == "start":
            began[0] = time.perf_counter()
        else:
            sink.write(f"{time.time():.6f} {info['generation']} {1000 * (time.perf_counter() - began[0]):.3f}\\n")
    gc.callbacks.append(passed)
'''


def jpeg_url(generator: np.random.Generator) -> str:
    buffer = io.BytesIO()
    Image.fromarray(generator.integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(buffer, "JPEG")
    return "data:image/jpeg;base64," + base64.b64encode(buffer.getvalue()).decode()


async def stream_all(url: str, bodies: list, clients: int) -> tuple:
    """Every body streamed by `clients` clients at once: (the gaps between chunks in ms, the window's wall times)."""
    waiting, gaps = list(reversed(bodies)), []
    async with httpx.AsyncClient(timeout=600) as client:
        async def one_client():
            while waiting:
                last = None
                async with client.stream("POST", f"{url}/v1/chat/completions", json=waiting.pop()) as response:
                    assert response.status_code == 200, await response.aread()
                    async for line in response.aiter_lines():
                        if line.startswith("data: "):
                            now = time.perf_counter()
                            if last is not None:
                                gaps.append(1000 * (now - last))
                            last = now

        began = time.time()
        await asyncio.gather(*(one_client() for _ in range(clients)))
        return gaps, (began, time.time())


def passes_in(log: Path, window: tuple) -> dict:
    """The collector's passes a process logged within `window`, by generation: count, total and longest ms."""
    found = {}
    for line in log.read_text().splitlines():
        at, generation, ms = line.split()
        if window[0] <= float(at) <= window[1]:
            count, total, longest = found.get(f"generation_{generation}", (0, 0.0, 0.0))
            found[f"generation_{generation}"] = (count + 1, total + float(ms), max(longest, float(ms)))
    return {generation: {"passes": count, "total_ms": round(total, 1), "longest_ms": round(longest, 1)}
            for generation, (count, total, longest) in sorted(found.items())}


def serve_once(tree: Path, checkpoint: Path, site: Path, args) -> dict:
    with tempfile.TemporaryDirectory() as logs:
        port = free_port()
        env = {**os.environ, "GC_PAUSE_LOG_DIR": logs, "PYTHONPATH": f"{site}{os.pathsep}{tree}"}
        output = Path(logs) / "server.out"
        with output.open("w") as sink:
            server = subprocess.Popen([sys.executable, "-m", "qwen3vl_static", "serve", str(checkpoint), "--port",
                                       str(port), "--api-server-count", "1", "--device", "cpu"], env=env,
                                      stdout=sink, stderr=subprocess.STDOUT, cwd=tree)
        url = f"http://127.0.0.1:{port}"
        try:
            wait_until_up(url, server, output)
            generator = np.random.default_rng(0)
            bodies = [{"model": str(checkpoint), "stream": True, "max_tokens": args.tokens, "temperature": 0,
                       "messages": [{"role": "user", "content": [
                           {"type": "image_url", "image_url": {"url": jpeg_url(generator)}},
                           {"type": "text", "text": f"What is in picture {index}?"}]}]}
                      for index in range(args.requests)]
            gaps, window = asyncio.run(stream_all(url, bodies, args.clients))
        finally:
            stop_server(server, timeout=120)
        text = output.read_text()
        roles = {re.search(r"engine process \[(\d+)\]", text)[1]: "engine",
                 re.search(r"Started server process \[(\d+)\]", text)[1]: "http"}
        found = {role: passes_in(Path(logs) / f"{pid}.log", window) for pid, role in roles.items()}
        return {**found, "seconds": round(window[1] - window[0], 2),
                "frozen_at_start": re.findall(r"(\d+) objects of its start-up heap frozen", text),
                "gap_ms_p50": round(float(np.percentile(gaps, 50)), 2),
                "gap_ms_p99": round(float(np.percentile(gaps, 99)), 2), "gap_ms_max": round(max(gaps), 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trees", type=Path, nargs="+", default=[Path(".")])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--requests", type=int, default=600)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        site, checkpoint = Path(scratch) / "site", Path(scratch) / "tiny"
        site.mkdir()
        (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
        subprocess.run([sys.executable, "-m", "qwen3vl_static", "tiny", str(checkpoint)], check=True,
                       stdout=subprocess.DEVNULL)
        results = {str(tree): [] for tree in args.trees}
        for run in range(args.runs):
            for tree in args.trees if run % 2 == 0 else reversed(args.trees):  # each tree first in turn
                found = serve_once(tree.resolve(), checkpoint, site, args)
                results[str(tree)].append(found)
                print(json.dumps({"run": run, "tree": str(tree), **found}), flush=True)
    harness.write_cpu_json({"requests": args.requests, "clients": args.clients, "tokens": args.tokens,
                            "runs": results})


if __name__ == "__main__":
    main()
