"""Where a continuous batch's time goes, and what its knobs change: the `--batching` text workload (2,048 requests of
228 tokens, answers of mean 128, greedy) by `generate_batch`'s sizing, per variant of settings, a first and a second
run each in a new model, with the manager's `stats` (GPU ms in prefills and in decode chunks, host ms waiting, decode
steps, row-steps queued and held by requests).

Usage: python bench/probes/batching_probe.py [--requests N] [--variants "steps_per_sync=8" "max_prefill_tokens=16384"]
(a variant: comma-separated config settings and `init_continuous_batching` keywords; "" is the defaults)
"""

import argparse
import gc

import harness
import torch

from qwen3vl_static.bench_batching import PROMPT_TOKENS, answer_lengths, continuous
from qwen3vl_static.workloads import build_ours, generate_exactly_as_asked, text_prompt

MANAGER_SETTINGS = ("max_prefill_tokens", "gpu_memory_utilization")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2048)
    parser.add_argument("--variants", nargs="+", default=[""])
    args = parser.parse_args()
    harness.require_cuda()
    generator = torch.Generator().manual_seed(0)
    lengths = answer_lengths(args.requests, generator)
    rows = []
    for variant in args.variants:
        settings = {key: int(value) for key, value in (item.split("=") for item in variant.split(",") if item)}
        manager = {key: settings.pop(key) for key in MANAGER_SETTINGS if key in settings}
        model = build_ours(torch.device("cuda"), torch.bfloat16, "2b", **settings)
        generate_exactly_as_asked(model)
        prompts = [text_prompt(model.config, 1, PROMPT_TOKENS, torch.device("cpu"), generator)
                   for _ in range(args.requests)]
        for run in ("first", "second"):
            row, _ = continuous(model, prompts, lengths, **manager)
            rows.append({"variant": variant or "defaults", "run": run, **row})
            print(rows[-1], flush=True)
        del model
        gc.collect()
        torch.cuda.empty_cache()
    harness.write_json({"rows": rows})


if __name__ == "__main__":
    main()
