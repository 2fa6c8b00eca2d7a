"""Capture the decode CUDA graphs ahead of time at chosen cache lengths ("milestones"), then generate.

On a CUDA GPU: the real Qwen3-VL-2B architecture with random bf16 weights (no download), graphs captured for
batch sizes 1 and 4 at KV lengths 512, 1024 and 2048, then one generate call that needs no further capture.
On the CPU there are no CUDA graphs: the tiny model's `warmup()` returns 0 and generate runs the same static
loop eagerly.

    python examples/warmup_milestones.py
"""

import time

import torch

from qwen3vl_static import Qwen3VLGraphForConditionalGeneration
from qwen3vl_static.presets import real_config, tiny_config

if torch.cuda.is_available():
    # The cache holds 2048 slots per row for up to 4 rows; its length buckets are the milestones below.
    config = real_config("2b", max_batch_size=4, static_cache_len=2048, graph_cache_lengths=[512, 1024, 2048])
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen3VLGraphForConditionalGeneration._from_config(config, dtype=torch.bfloat16).eval()
    model.generation_config.eos_token_id = None  # random weights: generate exactly max_new_tokens
    # Each (batch size, cache length) is rounded up to its bucket; "greedy", "sample" and "sample_top_k" graphs
    # by default.
    seconds = model.warmup(batch_sizes=[1, 4], cache_lengths=[512, 1024, 2048])
    captured = len(model.graph_engine().decode.graphs)
    print(f"captured {captured} decode graphs in {seconds:.2f} s")
    input_ids = torch.randint(0, 150000, (4, 300), device="cuda")
    began = time.perf_counter()
    out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=128, do_sample=False)
    torch.cuda.synchronize()
    print(f"generated {out.shape[0]} x {out.shape[1] - 300} tokens in {time.perf_counter() - began:.2f} s "
          f"(prefill included); captured during generate: {len(model.graph_engine().decode.graphs) - captured}")
else:
    print("No CUDA device: CUDA graphs need one, so warmup() has nothing to capture; the tiny model shows the calls.")
    model = Qwen3VLGraphForConditionalGeneration(tiny_config(max_batch_size=4, static_cache_len=2048)).eval()
    seconds = model.warmup(batch_sizes=[1, 4], cache_lengths=[512, 1024, 2048])
    print(f"warmup returned {seconds}")
    input_ids = torch.randint(0, 256, (4, 40))
    out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=16, do_sample=False)
    print(f"generated {out.shape[0]} x {out.shape[1] - 40} tokens eagerly on the static cache")
