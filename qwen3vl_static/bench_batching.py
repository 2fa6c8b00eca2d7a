"""`bench --batching`: many requests of uneven answer lengths by continuous batching, as a user runs it.

The workload (the serving engines' kind of measurement): BATCHING_REQUESTS prompts of PROMPT_TOKENS text tokens, and
the same count with one 448x448 image and a 30-token question each (228 tokens too), answer lengths from a seeded
geometric distribution of mean 128 clipped to 1..MAX_ANSWER, EOS off, greedy. Useful tokens/s = the tokens the requests
asked for over the wall time. No `warmup()`: the first run captures the graphs it meets on the way (and measures the
kernel choices), the second runs on them; both are reported, with TTFT p50/p99 and peak memory. The defaults are
`generate_batch`'s (rows sized from the GPU's memory and the requests' lengths); `--batching-slots` set the rows by hand
beside them (text). Every request's token count is checked, and the tokens of the first EQUALITY_REQUESTS requests
against the same run with CUDA graphs off (the eager static path: the same schedule, so the same shapes).
"""

import gc
import json
import statistics
import time

import torch

from .batching_qwen3vl_graph import cache_len_for
from .workloads import build_ours, generate_exactly_as_asked, image_prompt, text_prompt

BATCHING_REQUESTS = 2048
PROMPT_TOKENS = 228
MAX_ANSWER = 512
EQUALITY_REQUESTS = 256


def percentile(values: list, fraction: float) -> float:
    """The value `fraction` of the way up `values`, sorted (the nearest rank at or below it)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def answer_lengths(count: int, generator, mean: int = 128, high: int = MAX_ANSWER) -> list:
    """`count` seeded answer lengths: geometric (a new token ends the answer with probability 1 / mean), clipped to
    1..high."""
    uniform = torch.rand(count, generator=generator, dtype=torch.float64)
    lengths = torch.ceil(torch.log1p(-uniform) / torch.log1p(torch.tensor(-1.0 / mean, dtype=torch.float64)))
    return lengths.clamp(1, high).long().tolist()


def continuous(model, prompts, lengths, max_batch_size=None, **manager_settings) -> tuple:
    """One continuous-batching run of `prompts` (`generate_batch`'s sizing unless `max_batch_size`; `manager_settings`
    for `init_continuous_batching`): (row, {request id: generated tokens})."""
    requests = [{**prompt, "max_new_tokens": length} for prompt, length in zip(prompts, lengths)]
    cache_len = cache_len_for(requests, None, model.config.steps_per_sync)
    manager = model.init_continuous_batching(max_batch_size=max_batch_size, static_cache_len=cache_len,
                                             requests=len(requests), **manager_settings)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    began = time.perf_counter()
    results = manager.generate_all(requests, progress_bar=False, record_timestamps=True)
    seconds = time.perf_counter() - began
    failed = [result.error for result in results.values() if result.error]
    assert not failed, f"requests failed: {failed[:3]}"
    assert [len(result.generated_tokens) for result in results.values()] == lengths, "a request generated another length"
    ttft = [1000 * (result.timestamps[0] - result.created_time) for result in results.values()]
    stats = dict(manager.stats)
    wait = stats.pop("admission_wait_ms")  # on the host's clock, from add_request: per request below
    queued = stats.pop("queued_ms")  # of it, until the batch's thread took the request in
    first_read = stats.pop("first_token_ms")  # from the prefill's launch to the host reading the first token
    row = {"seconds": seconds, "useful_tokens_per_s": sum(lengths) / seconds, "requests_per_s": len(results) / seconds,
           "rows": model.config.max_batch_size, "static_cache_len": model.config.static_cache_len,
           "kv_cache_dtype": model.config.kv_cache_dtype, "prefill_graph_tokens": model.config.prefill_graph_tokens,
           "ttft_ms_p50": statistics.median(ttft), "ttft_ms_p99": percentile(ttft, 0.99),
           "peak_mem_gb": torch.cuda.max_memory_allocated() / 2**30,
           **{f"gpu_{key}" if key.endswith("_ms") else key: value for key, value in stats.items()},
           "admission_wait_ms_mean": wait / max(stats["admitted"], 1),
           "admission_queued_ms_mean": queued / max(stats["admitted"], 1),
           "first_token_read_ms_mean": first_read / max(stats["admitted"], 1)}
    return row, {i: result.generated_tokens for i, result in results.items()}


def batching(args, settings, generator) -> list:
    """The --batching rows: per workload, the defaults' first and second runs, then each hand-set row count's."""
    device, dtype = torch.device("cuda"), torch.bfloat16
    lengths = answer_lengths(BATCHING_REQUESTS, generator)
    model = build_ours(device, dtype, args.model, **settings)  # the config's defaults, no warmup
    generate_exactly_as_asked(model)
    cpu = torch.device("cpu")  # as a processor gives them
    workloads = {"text": lambda: text_prompt(model.config, 1, PROMPT_TOKENS, cpu, generator),
                 "448x448 image": lambda: image_prompt(model.config, cpu, generator)}
    workloads = {name: [prompt() for _ in range(BATCHING_REQUESTS)] for name, prompt in workloads.items()
                 if name.split()[-1] in args.batching_workloads}
    rows = []

    def record(row):
        rows.append(row)
        print(json.dumps(row), flush=True)  # as measured: the table comes at the end of the whole bench

    for workload, prompts in workloads.items():
        assert prompts[0]["input_ids"].shape[1] == PROMPT_TOKENS, "the workloads' prompts have PROMPT_TOKENS tokens"
        base = {"workload": workload, "requests": BATCHING_REQUESTS}
        for run in ("first", "second"):
            row, _ = continuous(model, prompts, lengths)
            record({**base, "system": "ours_continuous_defaults", "run": run, **row})
        head, head_lengths = prompts[:EQUALITY_REQUESTS], lengths[:EQUALITY_REQUESTS]
        _, tokens = continuous(model, head, head_lengths)
        model.set_cuda_graphs(False)
        try:
            _, eager = continuous(model, head, head_lengths)
        finally:
            model.set_cuda_graphs(True)
        rows[-1]["tokens_equal_eager_static_path"] = tokens == eager
        rows[-1]["equality_requests"] = EQUALITY_REQUESTS
        if workload == "text":
            for slots in args.batching_slots:
                for run in ("first", "second"):
                    row, _ = continuous(model, prompts, lengths, max_batch_size=slots)
                    record({**base, "system": f"ours_continuous_{slots}_rows", "run": run, **row})
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return rows
