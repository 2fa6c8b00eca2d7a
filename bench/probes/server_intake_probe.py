"""The server's host work per image request, in the HTTP process and in the engine process (CPU; JSON to a path):
the benchmark's 448x448 JPEG chat rendered by `bench_processor`, handed over as the server hands it, and taken in by
the engine, in two forms:

- uint8: the processor's rescale and normalize off in the HTTP process, the patches checked whole and sent as uint8,
  normalized in the engine (`PixelNormalizer`, the form the split shipped with); without torchvision the processor is
  PIL's, whose normalizer is a lookup table, so the torch backend's arithmetic (`uint8_fused_normalizer`: what the
  GPU machine, with torchvision, ran) is timed on the same patches too;
- tower dtype: the processor's float32 cast to bfloat16 in the HTTP process and sent as bytes (`WiredTensor`), only
  unpickled in the engine.

The engine's side is timed alone and beside a thread that wants the interpreter all the time (the batch's thread
between chunks), with the engine's 0.5 ms switch interval. Medians of 30 (15 beside the busy thread), min and max.
Run: `python bench/probes/server_intake_probe.py OUT.json [--threads 1]`.
"""

import argparse
import json
import pickle
import platform
import statistics
import sys
import threading
import time

import numpy as np
import torch

from qwen3vl_static.bench_server import bench_processor, image_url
from qwen3vl_static.engine_process import SWITCH_INTERVAL_S, EngineInfo, from_wire, to_wire
from qwen3vl_static.media import MediaLimits, _data_url_bytes
from qwen3vl_static.pixels import PixelNormalizer, as_uint8
from qwen3vl_static.server import render_chat


def timed(work, repeats: int) -> dict:
    work()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        times.append(1000 * (time.perf_counter() - start))
    return {"median_ms": round(statistics.median(times), 3), "min_ms": round(min(times), 3),
            "max_ms": round(max(times), 3)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    media = MediaLimits()
    messages = [{"role": "user", "content": [
        {"type": "image", "image": _data_url_bytes(image_url(np.random.default_rng(0)), media)},
        {"type": "text", "text": "word " * 30}]}]

    raw_processor = bench_processor("2b")
    normalizer = PixelNormalizer.for_processor(raw_processor)
    PixelNormalizer.raw(raw_processor.image_processor)
    processor = bench_processor("2b")
    info = EngineInfo(row_slots=1024, reserved=16, max_requests=64, eos_ids=frozenset(), pixel_dtype="bfloat16")

    def http_uint8() -> bytes:
        inputs = render_chat(raw_processor, media, messages)
        inputs["pixel_values"] = as_uint8(inputs["pixel_values"])
        return pickle.dumps({key: value.numpy() for key, value in inputs.items()}, protocol=pickle.HIGHEST_PROTOCOL)

    def engine_uint8(message: bytes) -> dict:
        tensors = {key: torch.from_numpy(value) for key, value in pickle.loads(message).items()}
        tensors["pixel_values"] = normalizer(tensors["pixel_values"])
        return tensors

    def http_tower_dtype() -> bytes:
        inputs = info.cast_pixels(render_chat(processor, media, messages))
        return pickle.dumps({key: to_wire(value) for key, value in inputs.items()}, protocol=pickle.HIGHEST_PROTOCOL)

    def engine_tower_dtype(message: bytes) -> dict:
        return {key: from_wire(value) for key, value in pickle.loads(message).items()}

    fused = PixelNormalizer(normalizer.rescale_factor, normalizer.mean, normalizer.std, channels_fused=True)

    def engine_uint8_fused(message: bytes) -> dict:
        tensors = {key: torch.from_numpy(value) for key, value in pickle.loads(message).items()}
        tensors["pixel_values"] = fused(tensors["pixel_values"])
        return tensors

    forms = {"uint8": (http_uint8, engine_uint8), "uint8_fused_normalizer": (http_uint8, engine_uint8_fused),
             "tower_dtype": (http_tower_dtype, engine_tower_dtype)}
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    results = {"command": " ".join(["python", *sys.argv]), "cpu": platform.processor() or platform.machine(),
               "torch": torch.__version__, "threads": args.threads,
               "image_processor": type(processor.image_processor).__name__,
               "normalizer": "fused (torch backend)" if normalizer.channels_fused else "table (PIL backend)"}
    for name, (http, engine) in forms.items():
        message = http()
        results[name] = {"message_bytes": len(message), "http_process": timed(http, 30),
                         "engine_alone": timed(lambda: engine(message), 30)}
    busy = threading.Event()
    busy.set()

    def spin():
        while busy.is_set():
            pass

    threading.Thread(target=spin, daemon=True).start()
    for name, (http, engine) in forms.items():
        message = http()
        results[name]["engine_beside_busy_thread"] = timed(lambda: engine(message), 15)
    busy.clear()
    with open(args.out, "w") as file:
        json.dump(results, file, indent=1)
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
