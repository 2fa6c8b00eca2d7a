"""`bench --batching`: many requests of uneven answer lengths, by continuous batching against static batches.

The workload: BATCHING_REQUESTS prompts of PROMPT_TOKENS text tokens (and the same count with one 448x448 image and
a 30-token question each, 228 tokens too), answer lengths from a seeded geometric distribution of mean 128 clipped
to 1..512, EOS off, greedy. Useful tokens/s = the tokens the requests asked for over the wall time. Systems: ours
by `generate` in static batches of BATCHING_SLOTS requests (in input order, each batch running to its longest
answer), ours by continuous batching over BATCHING_SLOTS rows, and (text only, STOCK_REQUESTS of the requests, as
it runs far slower) transformers' own continuous batching on the stock model with the same weights. Every request's
token count is checked, and ours' continuous-batching tokens against the same run with CUDA graphs off (the eager
static path: the same schedule, so the same shapes).
"""

import gc
import json
import statistics
import time

import torch

from .workloads import build_ours, generate_exactly_as_asked, image_prompt, text_prompt

BATCHING_REQUESTS = 512
BATCHING_SLOTS = 64
PROMPT_TOKENS = 228
STOCK_REQUESTS = 128
MAX_ANSWER = 512


def answer_lengths(count: int, generator, mean: int = 128, high: int = MAX_ANSWER) -> list:
    """`count` seeded answer lengths: geometric (a new token ends the answer with probability 1 / mean), clipped to
    1..high."""
    uniform = torch.rand(count, generator=generator, dtype=torch.float64)
    lengths = torch.ceil(torch.log1p(-uniform) / torch.log1p(torch.tensor(-1.0 / mean, dtype=torch.float64)))
    return lengths.clamp(1, high).long().tolist()


def static_batches(model, prompts, lengths) -> dict:
    """`generate` over batches of BATCHING_SLOTS prompts in order, each to its longest answer (stacked prompts: the
    text and image prompts have one length)."""
    torch.cuda.synchronize()
    began = time.perf_counter()
    for start in range(0, len(prompts), BATCHING_SLOTS):
        batch = prompts[start:start + BATCHING_SLOTS]
        inputs = {key: torch.cat([prompt[key] for prompt in batch]) for key in batch[0]}
        new_tokens = max(lengths[start:start + BATCHING_SLOTS])
        out = model.generate(**inputs, max_new_tokens=new_tokens)
        assert out.shape[1] - inputs["input_ids"].shape[1] == new_tokens, "a static batch generated another length"
    torch.cuda.synchronize()
    seconds = time.perf_counter() - began
    return {"seconds": seconds, "useful_tokens_per_s": sum(lengths) / seconds}


def continuous(model, prompts, lengths) -> tuple:
    """Ours by continuous batching: (row, {request id: generated tokens})."""
    manager = model.init_continuous_batching()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.synchronize()
    began = time.perf_counter()
    # All queued before the batch starts: the schedule, and so the shapes, are the same in every run.
    ids = [manager.add_request(**prompt, max_new_tokens=length) for prompt, length in zip(prompts, lengths)]
    manager.start()
    manager.stop(block=False)
    results = {result.request_id: result for result in manager}
    manager.join()
    seconds = time.perf_counter() - began
    failed = [result.error for result in results.values() if result.error]
    assert not failed, f"requests failed: {failed[:3]}"
    assert [len(results[i].generated_tokens) for i in ids] == lengths, "a request generated another length"
    ttft = sorted(1000 * (manager.timings[i]["first_token"] - manager.timings[i]["added"]) for i in ids)
    row = {"seconds": seconds, "useful_tokens_per_s": sum(lengths) / seconds, "requests_per_s": len(ids) / seconds,
           "ttft_ms_p50": statistics.median(ttft), "ttft_ms_p99": ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))],
           "peak_mem_gb": torch.cuda.max_memory_allocated() / 2**30}
    return row, {i: results[i].generated_tokens for i in ids}


def stock_continuous(stock, prompts, lengths) -> dict:
    """transformers' own continuous batching (text prompts: it takes token ids only)."""
    manager = stock.init_continuous_batching()
    torch.cuda.synchronize()
    began = time.perf_counter()
    manager.start()
    ids = [manager.add_request(prompt["input_ids"][0].tolist(), max_new_tokens=length)
           for prompt, length in zip(prompts, lengths)]
    results = {}
    while len(results) < len(ids):
        result = manager.get_result(timeout=600)
        if result is None:
            raise RuntimeError("transformers' continuous batching returned no result within 10 minutes")
        results[result.request_id] = result  # not streaming: final results only
    manager.stop(block=True)
    seconds = time.perf_counter() - began
    assert [len(results[i].generated_tokens) for i in ids] == lengths, "a stock request generated another length"
    return {"seconds": seconds, "useful_tokens_per_s": sum(lengths) / seconds}


def warm_graphs(model) -> None:
    """Capture ahead the graphs the runs meet: decode steps of any number of rows at every KV length, prefills of the
    groups that enter together (batch buckets up to 8 rows fit the prefill graph budget), the vision tower of the
    groups' images (one image per request)."""
    patches = (448 // model.config.vision_config.patch_size) ** 2  # image_prompt's 448x448 image
    model.warmup(batch_sizes=list(range(1, BATCHING_SLOTS + 1)), modes=("greedy",), prompt_lengths=[PROMPT_TOKENS],
                 image_patches=[patches])


def batching(args, stock, settings, generator) -> list:
    """The --batching rows (one per workload and system)."""
    device, dtype = stock.device, stock.dtype
    lengths = answer_lengths(BATCHING_REQUESTS, generator)
    cache_len = PROMPT_TOKENS + MAX_ANSWER + 8  # a row may step past its end until the chunk ends
    model = build_ours(device, dtype, args.model, max_batch_size=BATCHING_SLOTS, static_cache_len=cache_len,
                       **settings)
    generate_exactly_as_asked(model)
    warm_graphs(model)
    rows = []
    workloads = {"text": [text_prompt(model.config, 1, PROMPT_TOKENS, device, generator)
                          for _ in range(BATCHING_REQUESTS)],
                 "448x448 image": [image_prompt(model.config, device, generator) for _ in range(BATCHING_REQUESTS)]}
    for workload, prompts in workloads.items():
        assert prompts[0]["input_ids"].shape[1] == PROMPT_TOKENS, "the workloads' prompts have PROMPT_TOKENS tokens"
        continuous(model, prompts[:BATCHING_SLOTS], lengths[:BATCHING_SLOTS])  # warms the graphs it meets
        row, tokens = continuous(model, prompts, lengths)
        model.set_cuda_graphs(False)
        try:
            _, eager = continuous(model, prompts, lengths)
        finally:
            model.set_cuda_graphs(True)
        row["tokens_equal_eager_static_path"] = tokens == eager
        rows.append({"workload": workload, "system": "ours_continuous", "requests": BATCHING_REQUESTS, **row})
        print(json.dumps(rows[-1]))  # as measured: the table comes at the end of the whole bench
        rows.append({"workload": workload, "system": "ours_static_batches", "requests": BATCHING_REQUESTS,
                     **static_batches(model, prompts, lengths)})
        print(json.dumps(rows[-1]))
        if workload == "text":
            try:
                stock_row = stock_continuous(stock, prompts[:STOCK_REQUESTS], lengths[:STOCK_REQUESTS])
            except Exception as error:  # noqa: BLE001 - the other rows still stand; the row says why it is missing
                stock_row = {"error": f"{type(error).__name__}: {error}"}
            rows.append({"workload": workload, "system": "hf_continuous_batching", "requests": STOCK_REQUESTS,
                         **stock_row})
            print(json.dumps(rows[-1]))
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return rows
