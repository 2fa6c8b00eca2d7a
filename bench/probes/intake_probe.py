"""How long a continuous batch takes from its start to its first prefill when many requests were queued before it
(`generate_all`, as `bench --batching` runs), and how many of them it checked and resolved on the host (`_prepare`)
by then: the tiny model's shapes with the benchmark's prompts (text of 228 tokens, or one 448x448 image + 30 tokens),
one new token each, a new manager per run. What it measures is host work, which a CUDA device waits through before
its first prefill; so it runs on the CPU (no GPU is used).

Usage: python bench/probes/intake_probe.py [--requests 2048] [--runs 3]
"""

import argparse
import time

import torch
from transformers.generation.continuous_batching.requests import RequestStatus

import harness
from qwen3vl_static import Qwen3VLGraphForConditionalGeneration
from qwen3vl_static.bench_batching import PROMPT_TOKENS
from qwen3vl_static.presets import tiny_config
from qwen3vl_static.workloads import image_prompt, text_prompt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2048)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    config = tiny_config(static_cache_len=768, max_batch_size=64)
    model = Qwen3VLGraphForConditionalGeneration(config).eval()
    generator, cpu, vocab = torch.Generator().manual_seed(0), torch.device("cpu"), config.text_config.vocab_size

    def prompt(kind: str) -> dict:
        built = (text_prompt(config, 1, PROMPT_TOKENS, cpu, generator) if kind == "text"
                 else image_prompt(config, cpu, generator))
        ids = built["input_ids"]  # the tiny vocabulary: random text ids folded into it, special ids kept
        built["input_ids"] = torch.where(ids >= vocab, ids % (vocab - 64), ids)
        return built

    rows = {}
    for kind in ("text", "image"):
        prompts = [{**prompt(kind), "max_new_tokens": 1} for _ in range(args.requests)]
        rows[kind] = []
        for _ in range(args.runs):
            manager, marks = model.init_continuous_batching(), {"checked": 0}
            prepare, launch = manager._prepare, manager._launch

            def counted(*call, prepare=prepare, marks=marks, **named):
                marks["checked"] += 1
                return prepare(*call, **named)

            def first(part, *rest, launch=launch, marks=marks):
                marks.setdefault("first", (time.perf_counter(), marks["checked"]))
                return launch(part, *rest)

            manager._prepare, manager._launch = counted, first
            manager.add_requests(prompts)
            began = time.perf_counter()
            manager.start()
            manager.stop()
            assert all(result.status == RequestStatus.FINISHED for result in manager), "a request failed"
            at, checked = marks["first"]
            rows[kind].append({"ms_to_first_prefill": 1000 * (at - began), "checked_before_it": checked})
            print(kind, rows[kind][-1])
    harness.write_cpu_json({"requests": args.requests, "runs": rows})


if __name__ == "__main__":
    main()
