"""Where an admission's host time goes: requests of one 448x448 image + 30 tokens each (the server's workload) through
continuous batching at a server's row count, the engine thread's `_enter` calls profiled (cProfile) in a second run,
each part's prefill timed on the host with its rows, length and whether it ran eagerly.

Usage: python bench/probes/admission_probe.py [--requests 512] [--rows 64] [--kind image|text]
"""

import argparse
import cProfile
import io
import pstats
import time

import harness
import torch

from qwen3vl_static import batching_qwen3vl_graph as batching
from qwen3vl_static.bench_batching import PROMPT_TOKENS, answer_lengths, continuous
from qwen3vl_static.workloads import build_ours, generate_exactly_as_asked, image_prompt, text_prompt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=512)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--kind", choices=("image", "text"), default="image")
    args = parser.parse_args()
    harness.require_cuda()
    generator = torch.Generator().manual_seed(0)
    lengths = answer_lengths(args.requests, generator)
    model = build_ours(torch.device("cuda"), torch.bfloat16, "2b")
    generate_exactly_as_asked(model)
    cpu = torch.device("cpu")
    prompts = [image_prompt(model.config, cpu, generator) if args.kind == "image"
               else text_prompt(model.config, 1, PROMPT_TOKENS, cpu, generator) for _ in range(args.requests)]
    continuous(model, prompts, lengths, max_batch_size=args.rows)  # captures and tunes

    profile, parts = cProfile.Profile(), []
    enter, launch = batching.GraphBatchingManager._enter, batching.GraphBatchingManager._launch

    def profiled_enter(self, *call):
        profile.enable()
        try:
            return enter(self, *call)
        finally:
            profile.disable()

    def timed_launch(self, part, engine, *rest):
        began, eager = time.perf_counter(), engine.prefill.eager_runs
        try:
            return launch(self, part, engine, *rest)
        finally:
            parts.append({"requests": len(part), "length": max(sequence.prompt_len for sequence in part),
                          "eager": engine.prefill.eager_runs > eager,
                          "host_ms": 1000 * (time.perf_counter() - began)})

    batching.GraphBatchingManager._enter, batching.GraphBatchingManager._launch = profiled_enter, timed_launch
    row, _ = continuous(model, prompts, lengths, max_batch_size=args.rows)
    batching.GraphBatchingManager._enter, batching.GraphBatchingManager._launch = enter, launch
    listing = io.StringIO()
    stats = pstats.Stats(profile, stream=listing)
    stats.sort_stats("cumulative").print_stats(45)
    stats.sort_stats("tottime").print_stats(30)
    print(listing.getvalue())
    for kind in (True, False):
        chosen = [part for part in parts if part["eager"] == kind]
        if chosen:
            print(f"eager={kind}: {len(chosen)} parts, mean {sum(p['requests'] for p in chosen) / len(chosen):.1f} "
                  f"requests, host {sum(p['host_ms'] for p in chosen) / len(chosen):.1f} ms each")
    harness.write_json({"run": row, "parts": parts, "profile": listing.getvalue()})


if __name__ == "__main__":
    main()
