"""What the probes share: a CUDA device check, timing a CUDA graph's replays, a model's decode ms/step, the JSON
each probe writes (with the command that made it and the device or the CPU it ran on), and `bench --server`'s chat.

Probes import it as `harness` (Python puts the probe's own folder first on the path). Kernels a probe times alone
go through the tuner's own method, `KernelTuner().time_calls` (each call its own graph between two small kernels,
L2 flushed), so a probe's microseconds are the ones the tuner compares.
"""

import gc
import json
import os
import platform
import statistics
import sys
import tempfile
from pathlib import Path

import torch
import triton

from qwen3vl_static.bench import LONG, decode_slope
from qwen3vl_static.workloads import build_ours, generate_exactly_as_asked, text_prompt

SPIN_CYCLES = 2_000_000  # about 1 ms on an H200: the replays queue up behind it, so none waits for the host


def require_cuda() -> None:
    if not torch.cuda.is_available():
        sys.exit(f"{Path(sys.argv[0]).name} needs a CUDA device.")


def capture(call) -> torch.cuda.CUDAGraph:
    """`call` captured as a CUDA graph, after one eager run (compiling its kernels outside the capture)."""
    call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    graph.replay()
    return graph


def replay_us(graph, replays=10) -> float:
    """Median microseconds of one replay of `graph`, each timed with CUDA events."""
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(replays)]
    torch.cuda._sleep(SPIN_CYCLES)
    for start, end in events:
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    return 1000 * statistics.median(start.elapsed_time(end) for start, end in events)


def decode_ms(batch, context, static_cache_len=8192, **settings) -> float:
    """Greedy decode ms/step (the benchmark's slope) of a bf16 2B model built for `batch` rows of `context`-token text
    prompts, warmed for that shape and freed afterwards (a probe patches what it compares before calling it)."""
    model = build_ours(torch.device("cuda"), torch.bfloat16, static_cache_len=static_cache_len, **settings)
    generate_exactly_as_asked(model)
    prompt = text_prompt(model.config, batch, context, "cuda", torch.Generator().manual_seed(0))
    model.warmup(batch_sizes=[batch], cache_lengths=[context + LONG], modes=("greedy",), prompt_lengths=[context],
                 image_patches=[])
    ms, _ = decode_slope(model, prompt)
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return ms


def trace_events(profile) -> list:
    """The events of a finished `torch.profiler.profile`, as its Chrome trace holds them (each kernel's name, grid,
    start and duration, which the profiler's own tables do not give per launch)."""
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "trace.json")
        profile.export_chrome_trace(path)
        return json.loads(Path(path).read_text())["traceEvents"]


def write_json(result: dict, suffix: str = "") -> Path:
    """`result` as `$OUT/<probe><suffix>.json` (default `bench/results/`), headed by the command line, the device
    and the software it ran on."""
    out = Path(os.environ.get("OUT", "bench/results"))
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{Path(sys.argv[0]).stem}{suffix}.json"
    header = {"command": " ".join(["python", *sys.argv]), "device": torch.cuda.get_device_name(),
              "torch": torch.__version__, "triton": triton.__version__}
    path.write_text(json.dumps({**header, **result}, indent=1))
    print(f"wrote {path}")
    return path


def write_cpu_json(result: dict) -> Path:
    """A CPU probe's `result` as `$OUT/cpu-<cores>core-<probe>.json` (default `bench/results/`), headed by the command
    line and the machine and software it ran on."""
    out = Path(os.environ.get("OUT", "bench/results"))
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"cpu-{os.cpu_count()}core-{Path(sys.argv[0]).stem}.json"
    header = {"command": " ".join(["python", *sys.argv]), "machine": platform.machine(), "cores": os.cpu_count(),
              "python": platform.python_version(), "torch": torch.__version__}
    path.write_text(json.dumps({**header, **result}, indent=1))
    print(f"wrote {path}")
    return path


def bench_chat(media) -> list:
    """`bench --server`'s first chat (its 448x448 JPEG and question) with the image's bytes fetched within `media`'s
    limits, as an HTTP process reads them: what `render_chat` takes."""
    import asyncio

    import numpy as np

    from qwen3vl_static.bench_server import chat_body, image_url
    from qwen3vl_static.media import fetch_image_data

    content = chat_body(0, image_url(np.random.default_rng(0)))["messages"][0]["content"]
    data = asyncio.run(fetch_image_data(content[0]["image_url"]["url"], media, None))
    return [{"role": "user", "content": [{"type": "image", "image": data}, content[1]]}]
