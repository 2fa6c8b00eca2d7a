"""How fast is the continuous batch alone under `bench --server`'s load, and where does its thread wait? C clients
each send a request (one 448x448 image + 30 tokens, 128 new tokens, streaming), and the next as soon as the last
ended, R each, straight into the manager (no HTTP, no rendering: the engine's share of the server's figures), with the
server's sizing (rows from memory). A first run captures and tunes; the second is measured: output tok/s, TTFT p50/p99
(from `add_request` to the host reading the first token), inter-token gaps p50/p99 as the host read them, and the
manager's counters (admission wait, first-token read, GPU time in prefills and decode chunks, prefills beside
decoding rows). A third run, under CUDA's sync debug mode, counts each place where the host waited for the device, by
its call stack (reading a chunk's tokens, an event, is the one wait meant to be there and the mode does not flag it);
a fourth has the batch's thread under torch's profiler: the host and CUDA runtime calls it spent longest in (self
time) say what else it waits for (a launch, a copy, an allocation).

Usage: python bench/probes/closed_loop_probe.py [--clients 64] [--requests-per-client 4] [--check]
(`--check`: the tiny model on the CPU, one client, to try the plumbing.)
"""

import argparse
import collections
import statistics
import threading
import time
import traceback
import warnings

import harness
import torch

from qwen3vl_static import batching_qwen3vl_graph as batching
from qwen3vl_static.bench_batching import percentile
from qwen3vl_static.workloads import build_ours, generate_exactly_as_asked, image_prompt

NEW_TOKENS = 128


def closed_loop(model, prompts: list, clients: int, per_client: int, rows: int | None = None) -> dict:
    """One closed-loop run: every client keeps one request in the batch until it has sent `per_client`. `rows`: the
    batch's rows (None: sized from memory, as the server does once; a later run passes the first run's rows, since
    another size rebuilds the cache and captures every graph again)."""
    manager = model.init_continuous_batching(max_batch_size=rows)
    results, lock, finished = [], threading.Lock(), threading.Event()
    sent = [0] * clients

    def send(client: int) -> None:
        index = client * per_client + sent[client]
        sent[client] += 1
        request_id = manager.add_request(**prompts[index % len(prompts)], max_new_tokens=NEW_TOKENS,
                                         streaming=True, record_timestamps=True)
        manager.register_result_handler(request_id, lambda output: ended(client, output))

    def ended(client: int, output) -> None:
        if output.status.name not in ("FINISHED", "FAILED"):
            return
        with lock:
            results.append(output)
            if sent[client] < per_client:
                send(client)
            if len(results) == clients * per_client:
                finished.set()

    memory = allocator_counts()
    began = time.perf_counter()
    with lock:
        for client in range(clients):
            send(client)
    manager.start()
    finished.wait()
    seconds = time.perf_counter() - began
    manager.stop()
    failed = [output.error for output in results if output.error]
    assert not failed, f"requests failed: {failed[:3]}"
    assert all(len(output.generated_tokens) == NEW_TOKENS for output in results), "an answer of another length"
    ttft = [1000 * (output.timestamps[0] - output.created_time) for output in results]
    gaps = [1000 * (later - earlier) for output in results
            for earlier, later in zip(output.timestamps, output.timestamps[1:])]
    stats = dict(manager.stats)
    memory = {key: value - memory.get(key, 0) for key, value in allocator_counts().items()}
    admitted = max(stats["admitted"], 1)
    return {"clients": clients, "requests": len(results), "seconds": seconds,
            "output_tokens_per_s": NEW_TOKENS * len(results) / seconds, "rows": model.config.max_batch_size,
            "ttft_ms_p50": statistics.median(ttft), "ttft_ms_p99": percentile(ttft, 0.99),
            "itl_ms_p50": statistics.median(gaps), "itl_ms_p99": percentile(gaps, 0.99),
            "admission_wait_ms_mean": stats.pop("admission_wait_ms") / admitted,
            "first_token_read_ms_mean": stats.pop("first_token_ms") / admitted, **stats, **memory}


def allocator_counts() -> dict:
    """The CUDA caching allocators' counts of what can stall the host: device allocations and frees (each a cudaMalloc
    or cudaFree, which wait for the device), allocations retried after freeing the cache, and pinned host
    allocations (cudaHostAlloc) and their milliseconds."""
    if not torch.cuda.is_available():
        return {}
    device, host = torch.cuda.memory_stats(), getattr(torch.cuda, "host_memory_stats", dict)()
    kinds = ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_sync_all_streams")
    counts = {f"device_{key}": device.get(key, 0) for key in kinds}
    counts.update({f"host_{key}": host.get(key, 0) for key in ("num_host_alloc", "num_host_free")})
    counts["host_alloc_ms"] = host.get("host_alloc_time.total", 0) / 1000
    return counts


def profiled(model, prompts: list, clients: int, per_client: int, rows: int | None) -> str:
    """A closed-loop run with the batch's thread under torch's profiler: its host calls by self time."""
    loop, listing = batching.GraphBatchingManager._loop, []
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)

    def loop_profiled(self, *args):
        with torch.profiler.profile(activities=activities) as profile:  # call stacks: not recorded off the main thread
            loop(self, *args)
        listing.append(profile.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))

    batching.GraphBatchingManager._loop = loop_profiled
    try:
        closed_loop(model, prompts, clients, per_client, rows)
    finally:
        batching.GraphBatchingManager._loop = loop
    return "\n".join(listing)


def syncs(model, prompts: list, clients: int, per_client: int, rows: int | None) -> list:
    """A closed-loop run under CUDA's sync debug mode: each call stack at which the host waited for the device, with
    how many times, most first."""
    seen, show = collections.Counter(), warnings.showwarning

    def record(message, category, *rest, **kwargs):
        if "called a synchronizing" in str(message):
            stack = [line for line in traceback.format_stack(limit=10)[:-1] if "warnings.py" not in line]
            seen[f"{str(message)[:80]}\n" + "".join(stack[-6:])] += 1
        else:
            show(message, category, *rest, **kwargs)

    warnings.showwarning = record
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            closed_loop(model, prompts, clients, per_client, rows)
    finally:
        torch.cuda.set_sync_debug_mode("default")
        warnings.showwarning = show
    return [{"count": count, "where": where} for where, count in seen.most_common(15)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--requests-per-client", type=int, default=4)
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    generator = torch.Generator().manual_seed(0)
    cpu = torch.device("cpu")
    if args.check:
        from qwen3vl_static.modeling_qwen3vl_graph import Qwen3VLGraphForConditionalGeneration
        from qwen3vl_static.presets import tiny_config

        model = Qwen3VLGraphForConditionalGeneration(tiny_config(static_cache_len=512, max_batch_size=4)).eval()
        generate_exactly_as_asked(model)
        prompts = [image_prompt(model.config, cpu, generator, sides=(64,), question=0) for _ in range(2)]
        print(closed_loop(model, prompts, 2, 2))
        print(profiled(model, prompts, 1, 1, None)[:2000])
        return
    harness.require_cuda()
    model = build_ours(torch.device("cuda"), torch.bfloat16, "2b")
    generate_exactly_as_asked(model)
    prompts = [image_prompt(model.config, cpu, generator) for _ in range(args.clients * args.requests_per_client)]
    runs, rows = {}, None
    for run in ("first", "second"):
        runs[run] = closed_loop(model, prompts, args.clients, args.requests_per_client, rows)
        rows = model.config.max_batch_size
        print(run, {key: round(value, 2) if isinstance(value, float) else value for key, value in runs[run].items()})
    harness.write_json({"runs": runs})
    waits = syncs(model, prompts, args.clients, args.requests_per_client, rows)
    for wait in waits:
        print(wait["count"], wait["where"])
    harness.write_json({"runs": runs, "syncs": waits})
    listing = profiled(model, prompts, args.clients, args.requests_per_client, rows)
    print(listing)
    harness.write_json({"runs": runs, "syncs": waits, "profile": listing})


if __name__ == "__main__":
    main()
