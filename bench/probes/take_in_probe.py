"""What does taking a server request in cost the batch's thread on the host, with nothing else running? The 2B config
(weights and cache on the meta device: no memory, no GPU), `bench --server`'s chats rendered as an HTTP process
renders them (patches as uint8), queued with `add_request` as the engine process queues them, then `_take_in` (the
checks, the settings, the M-RoPE positions) until the queue is empty: with the positions computed there, and brought
by the request as `serve`'s HTTP processes send them (`prompt_position_ids`). Reported: ms per request, median of the
runs, to set beside the batch thread's `take_in` time per request at 64 server clients (`bench --server`'s
`take_in_share`): the difference is the thread's wait for a core or the interpreter. CPU only.

Usage: python bench/probes/take_in_probe.py [--requests 64] [--runs 5]
"""

import argparse
import statistics
import time

import torch

import harness
from qwen3vl_static.batching_qwen3vl_graph import prompt_position_ids
from qwen3vl_static.bench_server import bench_processor
from qwen3vl_static.media import MediaLimits
from qwen3vl_static.pixels import PixelNormalizer, as_uint8
from qwen3vl_static.presets import real_config
from qwen3vl_static.scheduler_qwen3vl_graph import Scheduler
from qwen3vl_static.server import meta_model, render_chat


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)  # the batch's thread, alone
    model = meta_model(real_config("2b", max_batch_size=args.requests, static_cache_len=512))
    processor, media = bench_processor("2b"), MediaLimits()
    PixelNormalizer.raw(processor.image_processor)  # as the HTTP processes run it for an engine taking uint8
    inputs = render_chat(processor, media, harness.bench_chat(media))
    ids = inputs.pop("input_ids")[0].tolist()
    inputs.pop("attention_mask")
    inputs["pixel_values"] = as_uint8(inputs["pixel_values"])
    # As `serve`'s HTTP processes send it: its M-RoPE positions computed there, on a meta-device copy of the model.
    ahead = {**inputs, "position_ids": prompt_position_ids(model, torch.tensor([ids]), inputs)}
    manager, engine = model.init_continuous_batching(), model.graph_engine()
    row = {}
    for form, request in (("positions_computed", inputs), ("positions_brought", ahead)):
        per_request = []
        for _ in range(args.runs):
            for _ in range(args.requests):
                manager.add_request(ids, max_new_tokens=128, streaming=True, **request)
            scheduler, began = Scheduler(engine.cache.rows, manager.max_prefill_tokens), time.perf_counter()
            while not manager.input_queue.empty():
                manager._take_in(scheduler, engine, wait=False)
                scheduler.waiting.clear()  # room for the next: what is measured is the taking in
            per_request.append(1000 * (time.perf_counter() - began) / args.requests)
        row[form] = {"take_in_ms_per_request": statistics.median(per_request), "runs_ms": per_request}
        print(f"taking a request in, {form.replace('_', ' ')}: {statistics.median(per_request):.3f} ms (runs "
              f"{min(per_request):.3f}-{max(per_request):.3f})")
    harness.write_cpu_json({"requests": args.requests, "prompt_tokens": len(ids),
                            "patches": list(inputs["pixel_values"].shape), **row})


if __name__ == "__main__":
    main()
