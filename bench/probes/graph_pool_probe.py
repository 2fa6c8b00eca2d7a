"""Where does the graph pool's memory go, bf16 against FP8? (H200; JSON to $OUT.)

For each variant, on a fresh model, this reserves memory phase by phase (the engine's build: the KV cache, the fused
QKV and gate/up weights; one decode graph and a 16-token prefill graph; one 2,048-token prefill graph; then the 2B
benchmark's warmup at batch 1, 4 and 8), and after each phase reports the GiB reserved in all and in the model's graph
pool (the benchmark's `graph_pool_gib`: the `torch.cuda.memory_snapshot()` segments of that pool) and the GiB
allocated.

Run: python bench/probes/graph_pool_probe.py [--model 2b|8b] (writes graph_pool_probe-<model>.json).
"""

import argparse
import gc
import json

import torch

import harness
from qwen3vl_static.bench import graph_pool_gib
from qwen3vl_static.fp8_quantize import quantize_fp8
from qwen3vl_static.workloads import build_ours, generate_exactly_as_asked

GIB = 2**30


def memory(model=None) -> dict:
    """GiB reserved in all, in `model`'s graph pools (none: 0), and allocated, after emptying the cache."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    engine = None if model is None else model.graph_engine()
    pools = () if engine is None else (engine.capturer.pool, engine.prefill.capturer.pool, engine.vision.capturer.pool)
    return {"reserved_gib": torch.cuda.memory_reserved() / GIB, "graph_pool_gib": graph_pool_gib(*pools),
            "allocated_gib": torch.cuda.memory_allocated() / GIB}


def phases(model_name: str, fp8: bool) -> dict:
    model = build_ours(torch.device("cuda"), torch.bfloat16, model_name)
    if fp8:
        quantize_fp8(model)
    generate_exactly_as_asked(model)
    rows = {"model": memory()}  # before the engine exists
    model.graph_engine()
    rows["engine"] = memory(model)
    model.warmup(batch_sizes=[1], cache_lengths=[1024], modes=("greedy",), prompt_lengths=[16])
    rows["decode_and_prefill_16"] = memory(model)
    model.warmup(batch_sizes=[1], cache_lengths=[1024], modes=("greedy",), prompt_lengths=[2048])
    rows["prefill_2048"] = memory(model)
    model.warmup(batch_sizes=[1, 4, 8], cache_lengths=[592, 356], modes=("greedy",))
    rows["bench_warmup"] = memory(model)
    rows["graphs"] = {name: len(runner.graphs) for name, runner in zip(("decode", "prefill", "vision"),
                                                                        model.graph_engine().runners)}
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=("2b", "4b", "8b"), default="2b")
    model = parser.parse_args().model
    harness.require_cuda()
    result = {"model": model, "bf16": phases(model, fp8=False), "fp8": phases(model, fp8=True)}
    print(json.dumps(result, indent=1))
    harness.write_json(result, f"-{model}")


if __name__ == "__main__":
    main()
