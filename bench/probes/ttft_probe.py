"""Where a TTFT goes, and what a decode step's GPU time is made of (H200; JSON to $OUT): the stage split of one
`generate(max_new_tokens=1)` on a 448x448 image prompt (vision, prefill, M-RoPE index, the rest), TTFT without the
prompt prefilled ahead and without the vision tower run ahead either, the tower eagerly at its exact size and with
the stock Conv3d patch embedding, kernel profiles of a batch-1 decode step and of the call's vision tower and
prefill, when the host enters and leaves each stage of a call (unprofiled), the host time of one call by function,
and the call's timeline: when the GPU first gets work, and each gap in its work with what the host was doing then.

The probe wraps runner methods to time them (the benchmark never does). Run: `python bench/probes/ttft_probe.py
[--batch 8]` (rows of one 448x448 image + 30 tokens each).
"""

import argparse
import cProfile
import json
import pstats
import time
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import torch
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLModel

import harness
from qwen3vl_static import modeling_qwen3vl_graph
from qwen3vl_static.bench import best_ms, timed_generate
from qwen3vl_static.workloads import build_models, image_prompt


@contextmanager
def instrumented(stages: dict):
    """Wrap methods `{name: (owner, attribute)}` for the duration: each call's synchronized wall time is added up
    under `times[name]` (ms) and its arguments kept as `arguments[name]`."""
    times, arguments = {}, {}
    for name, (owner, attribute) in stages.items():
        def timed(*args, _call=getattr(owner, attribute), _name=name, **kwargs):
            torch.cuda.synchronize()
            began = time.perf_counter()
            result = _call(*args, **kwargs)
            torch.cuda.synchronize()
            times[_name] = times.get(_name, 0.0) + 1000 * (time.perf_counter() - began)
            arguments[_name] = (args, kwargs)
            return result

        setattr(owner, attribute, timed)  # an instance attribute over the method, removed below
    try:
        yield times, arguments
    finally:
        for owner, attribute in stages.values():
            delattr(owner, attribute)


def generate_stages(model) -> dict:
    """The parts of a `generate` call that TTFT is split into."""
    engine = model.graph_engine()
    return {"vision_ms": (engine.vision, "encode"), "prefill_ms": (engine.prefill, "run"),
            "rope_index_ms": (model.model, "get_rope_index")}


def host_profile(call, top=20) -> dict:
    """Host (Python) time of one `call()` by function, ms: the `top` largest by own time and by cumulative time."""
    profiler = cProfile.Profile()
    profiler.runcall(call)
    stats = pstats.Stats(profiler).stats  # {(file, line, name): (calls, primitive calls, own s, cumulative s, callers)}

    def largest(column):
        rows = sorted(stats.items(), key=lambda item: -item[1][column])[:top]
        return {f"{Path(file).name}:{line}({name}) x{values[0]}": round(1000 * values[column], 3)
                for (file, line, name), values in rows}

    return {"own": largest(2), "cumulative": largest(3)}


KERNEL_CLASSES = {
    "gemv/gemm": ("gemv", "gemm", "xmma", "cutlass", "nvjet", "splitk", "skinny_matmul", "sum_splits", "qkv_norm_rope"),
    "attention": ("attention", "fmha", "flash", "sdpa", "softmax", "merge"),
    "indexing": ("index", "scatter", "gather"),
    "argmax/sampling": ("argmax", "argmin", "sort", "exponential", "finish_step"),
    "norm/rope/elementwise": ("elementwise", "vectorized", "reduce", "norm", "cat", "copy", "roll", "silu", "gelu"),
}


def kernel_profile(call, calls=1, top=15) -> dict:
    """GPU time of `call()` per call, by kernel class and for the top kernels. Under programmatic dependent launch
    a kernel starts before its predecessor ends and waits for it, so kernel times overlap: their sum ("gpu_ms_total")
    can exceed the call's time, and a kernel's time includes its wait."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    by_class, by_kernel = {}, {}
    for event in prof.key_averages():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        ms = event.device_time_total / 1000 / calls
        kind = next((label for label, keys in KERNEL_CLASSES.items() if any(key in event.key.lower() for key in keys)), "other")
        by_class[kind] = by_class.get(kind, 0.0) + ms
        by_kernel[f"{event.key[:90]} (x{event.count // calls})"] = ms
    largest = dict(sorted(by_kernel.items(), key=lambda item: -item[1])[:top])
    return {"gpu_ms_total": sum(by_class.values()), "ms_by_class": by_class, "top_kernels_ms": largest}


def timeline(call, gap_us=20.0) -> dict:
    """One `call()` under the profiler (host Python stacks and GPU work): when the GPU first and last works, relative
    to the call's start, how long it is busy, and each gap of at least `gap_us` with the innermost Python functions
    and the CUDA runtime calls running at its middle (what the GPU waits for). The profiler slows the host, so the
    host's share is overstated; the order of events is what this shows."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA],
                                with_stack=True) as prof:
        call()
        torch.cuda.synchronize()
    events = [event for event in harness.trace_events(prof) if event.get("ph") == "X"]
    gpu_kinds = ("kernel", "gpu_memcpy", "gpu_memset")
    gpu = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") in gpu_kinds)
    python = [e for e in events if e.get("cat") == "python_function"]
    runtime = [e for e in events if e.get("cat") == "cuda_runtime"]
    start = min(e["ts"] for e in python)
    busy, gaps, end = 0.0, [], gpu[0][0]
    for began, ended in gpu:
        if began - end >= gap_us:
            middle = (end + began) / 2

            def running(kind, middle=middle):
                return sorted((e for e in kind if e["ts"] <= middle <= e["ts"] + e["dur"]), key=lambda e: e["dur"])

            gaps.append({"at_us": round(end - start, 1), "us": round(began - end, 1),
                         "python": [e["name"][:80] for e in running(python)[:4]],
                         "cuda_runtime": [e["name"] for e in running(runtime)]})
        busy += max(0.0, ended - max(began, end))
        end = max(end, ended)
    return {"first_gpu_work_us": round(gpu[0][0] - start, 1), "last_gpu_work_us": round(end - start, 1),
            "gpu_busy_us": round(busy, 1), "gaps": gaps}


def host_stages(model, image, repeats=5) -> dict:
    """When the host enters and leaves each stage of a `generate(max_new_tokens=1)` call, ms from the call's start
    (no profiler, no syncs inside: the host's own pace), and when the first token is on the host ("done"); the
    fastest of `repeats` calls."""
    engine = model.graph_engine()
    stages = {"check inputs": (modeling_qwen3vl_graph, "_check_generate_inputs"),
              "engine check": (model, "_current_engine"), "tower ahead": (engine.vision, "encode_ahead"),
              "prefill ahead": (modeling_qwen3vl_graph, "prefill_ahead"), "prefill": (model, "_prefill_prompt"),
              "rope index": (model.model, "get_rope_index"),
              "generation config": (model, "_prepare_generation_config"),
              "cache prepared": (model, "_prepare_cache_for_generation")}
    spans = []
    saved = {name: getattr(owner, attribute) for name, (owner, attribute) in stages.items()}
    for name, (owner, attribute) in stages.items():
        def stamped(*args, _call=saved[name], _name=name, **kwargs):
            began = time.perf_counter()
            try:
                return _call(*args, **kwargs)
            finally:
                spans.append((_name, began, time.perf_counter()))

        setattr(owner, attribute, stamped)
    best = None
    try:
        for _ in range(repeats):
            spans.clear()
            torch.cuda.synchronize()
            began = time.perf_counter()
            timed_generate(model, image, 1)
            done = time.perf_counter()
            if best is None or done - began < best["done"] / 1000:
                best = {name: [round(1000 * (start - began), 3), round(1000 * (end - began), 3)]
                        for name, start, end in sorted(spans, key=lambda span: span[1])}
                best["done"] = 1000 * (done - began)
    finally:
        for name, (owner, attribute) in stages.items():
            if owner is modeling_qwen3vl_graph:
                setattr(owner, attribute, saved[name])
            else:
                delattr(owner, attribute)
    return best


def kernel_breakdown(model, image) -> dict:
    """Where the GPU time goes: one greedy decode step (batch 1), and the vision tower and prefill of `image`."""
    engine = model.graph_engine()
    runner = engine.decode
    steps = runner.steps_per_sync
    decode = kernel_profile(lambda: runner.collect(runner.issue(steps, "greedy")), steps)
    with instrumented(generate_stages(model)) as (_, arguments):  # the runners' arguments in a real call
        timed_generate(model, image, 1)
    with torch.no_grad():
        profiles = {name: kernel_profile(lambda: getattr(owner, attribute)(*arguments[f"{name}_ms"][0]), top=25)
                    for name, (owner, attribute) in (("vision", (engine.vision, "encode")),
                                                     ("prefill", (engine.prefill, "run")))}
    return {"decode_step_batch1": decode, "vision_tower": profiles["vision"], "prefill": profiles["prefill"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=1, help="rows of one 448x448 image + 30 tokens each")
    args = parser.parse_args()
    harness.require_cuda()
    device = torch.device("cuda")
    ours, _ = build_models(device, torch.bfloat16)
    image = image_prompt(ours.config, device, torch.Generator().manual_seed(0), batch=args.batch)
    ours.warmup(batch_sizes=[args.batch], cache_lengths=[image["input_ids"].shape[1] + 128], modes=("greedy",),
                image_patches=[image["pixel_values"].shape[0] // args.batch])
    engine = ours.graph_engine()
    pixels, grid = image["pixel_values"].to(torch.bfloat16), image["image_grid_thw"]
    result = {"batch": args.batch, "ttft_ms": best_ms(lambda: timed_generate(ours, image, 1))}
    with instrumented(generate_stages(ours)) as (spans, _):
        total = best_ms(lambda: timed_generate(ours, image, 1), repeats=1)
    spans = {key: value / 2 for key, value in spans.items()}  # best_ms made two calls
    # generate's own host work, first token, syncs. The stages are synchronized: `vision_ms` is what is left of the
    # tower when `encode` takes what `encode_ahead` queued as generate began.
    result.update(spans, other_ms=total - sum(spans.values()))
    prefill_ahead, modeling_qwen3vl_graph.prefill_ahead = modeling_qwen3vl_graph.prefill_ahead, lambda *args: None
    result["ttft_ms_not_prefilled_ahead"] = best_ms(lambda: timed_generate(ours, image, 1))
    engine.vision.encode_ahead = lambda *args, **kwargs: None  # an instance attribute over the method
    result["ttft_ms_tower_not_run_ahead"] = best_ms(lambda: timed_generate(ours, image, 1))
    del engine.vision.encode_ahead
    modeling_qwen3vl_graph.prefill_ahead = prefill_ahead
    with torch.no_grad():
        engine.vision.limit, limit = None, engine.vision.limit  # no chunk in the buffers: eager
        result["vision_tower_eager_exact_ms"] = best_ms(lambda: ours.model.visual(pixels, grid_thw=grid))
        engine.vision.limit = limit
        ours.model.visual.patch_embed.mode, saved = "conv3d", engine.vision.graphs
        engine.vision.graphs = type(saved)()  # conv3d graphs of their own, dropped afterwards
        result["vision_tower_conv3d_ms"] = best_ms(lambda: ours.model.visual(pixels, grid_thw=grid))
        ours.model.visual.patch_embed.mode, engine.vision.graphs = "gemm", saved
    # The M-RoPE index as `generate` computes it (ours: stock's on host copies of the inputs) and stock's own on the GPU.
    rope_inputs = {key: value for key, value in image.items() if key not in ("input_ids", "pixel_values")}
    for name, rope_index in (("ours", ours.model.get_rope_index),
                             ("stock_on_gpu", partial(Qwen3VLModel.get_rope_index, ours.model))):
        result[f"rope_index_ms_{name}"] = best_ms(lambda rope_index=rope_index: rope_index(image["input_ids"],
                                                                                           **rope_inputs))
    result["host_stages_ms"] = host_stages(ours, image)
    result["gpu_profile"] = kernel_breakdown(ours, image)
    result["host_profile_ms"] = host_profile(lambda: timed_generate(ours, image, 1))
    result["timeline"] = timeline(lambda: timed_generate(ours, image, 1))
    print(json.dumps({key: value for key, value in result.items() if key != "host_profile_ms"}, indent=1))
    harness.write_json(result, f"-batch{args.batch}" if args.batch > 1 else "")


if __name__ == "__main__":
    main()
