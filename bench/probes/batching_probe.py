"""Where continuous batching's time goes (H200; JSON to $OUT): the `bench --batching` rows, then one more continuous run
of each workload with its stages timed, synchronized, after the same warmup: admissions (`_admit`: `generate` calls
through vision and prefill into free rows) and decode chunks (issue to collect), with their counts and the mean rows
stepped per chunk; within the admissions, the GPU time of the prefills (CUDA events around `PrefillRunner.run`) and
the tokens they computed (bucket rows x tokens, padding included), to tell the prefills' compute from the rest.

Run: `python bench/probes/batching_probe.py [--no-rows]` (`--no-rows`: only the timed runs).
"""

import json
import sys
import time
from argparse import Namespace

import torch

import harness
from qwen3vl_static.batching_qwen3vl_graph import GraphBatchingManager
from qwen3vl_static.bench_batching import (
    BATCHING_REQUESTS,
    BATCHING_SLOTS,
    MAX_ANSWER,
    PROMPT_TOKENS,
    answer_lengths,
    batching,
    continuous,
    warm_graphs,
)
from qwen3vl_static.decode_qwen3vl_graph import DecodeRunner
from qwen3vl_static.prefill_qwen3vl_graph import PrefillRunner
from qwen3vl_static.workloads import build_models, build_ours, generate_exactly_as_asked, image_prompt, text_prompt


def timed_stages(model, prompts, lengths) -> dict:
    """One continuous run with `_admit` (each round of admissions) and the decode chunks timed (synchronized: the run
    is slower than untimed), and the `generate` calls of the admissions counted."""
    stages = {"admit_ms": 0.0, "admissions": 0, "generate_calls": 0, "chunk_ms": 0.0, "chunks": 0, "rows_stepped": 0,
              "prefill_tokens": 0}
    admit, issue, collect = GraphBatchingManager._admit, DecodeRunner.issue, DecodeRunner.__dict__["collect"]
    generate, prefill = model.generate, PrefillRunner.run
    prefill_events = []

    def timed_prefill(self, input_ids, *args, **kwargs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        result = prefill(self, input_ids, *args, **kwargs)
        end.record()
        prefill_events.append((start, end))
        bucket = self.bucket(*input_ids.shape)
        stages["prefill_tokens"] += bucket[0] * bucket[1] if bucket else input_ids.numel()
        return result

    def counted_generate(**inputs):
        stages["generate_calls"] += 1
        return generate(**inputs)

    def timed_admit(self, *args):
        torch.cuda.synchronize()
        began = time.perf_counter()
        result = admit(self, *args)
        torch.cuda.synchronize()
        stages["admit_ms"] += 1000 * (time.perf_counter() - began)
        stages["admissions"] += 1
        return result

    def timed_issue(self, steps, mode):
        stages["issued"] = time.perf_counter()
        stages["chunks"] += 1
        stages["rows_stepped"] += self.batch_size
        return issue(self, steps, mode)

    def timed_collect(handle):
        result = collect.__func__(handle)
        stages["chunk_ms"] += 1000 * (time.perf_counter() - stages.pop("issued"))
        return result

    GraphBatchingManager._admit, DecodeRunner.issue = timed_admit, timed_issue
    DecodeRunner.collect, model.generate = staticmethod(timed_collect), counted_generate
    PrefillRunner.run = timed_prefill
    try:
        row, _ = continuous(model, prompts, lengths)
    finally:
        GraphBatchingManager._admit, DecodeRunner.issue, DecodeRunner.collect = admit, issue, collect
        PrefillRunner.run = prefill
        del model.generate
    torch.cuda.synchronize()
    stages["prefill_gpu_ms"] = sum(start.elapsed_time(end) for start, end in prefill_events)
    stages["mean_rows_per_chunk"] = stages.pop("rows_stepped") / max(stages["chunks"], 1)
    return {**row, **stages}


def main() -> None:
    harness.require_cuda()
    device, dtype = torch.device("cuda"), torch.bfloat16
    result = {}
    if "--no-rows" not in sys.argv:
        _, stock = build_models(device, dtype)
        result["rows"] = batching(Namespace(model="2b"), stock, {}, torch.Generator().manual_seed(0))  # prints them
        del stock
    generator = torch.Generator().manual_seed(0)
    lengths = answer_lengths(BATCHING_REQUESTS, generator)
    model = build_ours(device, dtype, max_batch_size=BATCHING_SLOTS, static_cache_len=PROMPT_TOKENS + MAX_ANSWER + 8)
    generate_exactly_as_asked(model)
    warm_graphs(model)
    for workload, prompt in (("text", lambda: text_prompt(model.config, 1, PROMPT_TOKENS, device, generator)),
                             ("448x448 image", lambda: image_prompt(model.config, device, generator))):
        prompts = [prompt() for _ in range(BATCHING_REQUESTS)]
        continuous(model, prompts[:BATCHING_SLOTS], lengths[:BATCHING_SLOTS])
        result[workload] = timed_stages(model, prompts, lengths)
        print(workload, json.dumps(result[workload]))
    harness.write_json(result)


if __name__ == "__main__":
    main()
