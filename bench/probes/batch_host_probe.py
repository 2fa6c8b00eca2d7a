"""How much host time does the continuous batch's thread spend on `bench --batching`'s schedule, with the model's
work taken away? On the H200 the 2,048-request text run leaves the GPU idle ~1.25 s of its ~10 s while the host
works (docs/design.md): this measures that host work alone, where it can be changed and timed without a GPU.

A tiny model on the CPU with the decode and prefill forwards stubbed out (a logits row that draws one token; the
steps' sampling and bookkeeping stay), `--requests` text prompts of `--prompt-tokens` random ids and the benchmark's
answer lengths (geometric, mean 128, 1..512, EOS off, greedy), through `generate_all` at `--rows` rows with the
benchmark's cache length and prefill budget. Reported: wall seconds (median of `--runs`), the batch's chunks and
prefills, the decode steps by batch bucket (the schedule's shape: how many steps run below the full rows, the ramp
and the tail), the decode GPU time that schedule comes to at the H200's measured step times (`STEP_MS`, arithmetic,
not a measurement), and with `--profile` the functions that took the most of the batch thread's time in one more run
(cProfile, by own time and by cumulative time). CPU only.

Usage: python bench/probes/batch_host_probe.py [--requests 2048] [--rows 512] [--runs 3] [--profile]
"""

import argparse
import bisect
import collections
import cProfile
import io
import pstats
import statistics
import time

import torch

import harness
from qwen3vl_static import Qwen3VLGraphForConditionalGeneration
from qwen3vl_static.batching_qwen3vl_graph import cache_len_for
from qwen3vl_static.bench_batching import answer_lengths
from qwen3vl_static.decode_qwen3vl_graph import DecodeRunner
from qwen3vl_static.prefill_qwen3vl_graph import PrefillRunner
from qwen3vl_static.presets import tiny_config
from qwen3vl_static.workloads import generate_exactly_as_asked

TOKEN = 5  # what the stubbed forwards draw: not an EOS id (EOS is off anyway)
# The 2B's bf16 decode step on one H200 by batch bucket, ms (static cache, ~300-slot contexts: README and
# docs/design.md); buckets between them interpolated linearly in rows.
STEP_MS = {1: 1.38, 8: 1.61, 64: 2.40, 256: 4.80, 512: 8.69}
steps_by_batch = collections.Counter()  # decode steps by batch bucket, as the stubbed forward meets them


def step_ms(rows: int) -> float:
    """`STEP_MS` at `rows`, interpolated between its neighbours."""
    sizes = sorted(STEP_MS)
    if rows in STEP_MS:
        return STEP_MS[rows]
    upper = bisect.bisect(sizes, rows)
    low, high = sizes[upper - 1], sizes[upper]
    return STEP_MS[low] + (STEP_MS[high] - STEP_MS[low]) * (rows - low) / (high - low)


def stubbed_decode(self, rows: int, kv_len: int, record=()) -> torch.Tensor:
    steps_by_batch[rows] += 1
    logits = torch.zeros(rows, self.text.lm_head.shape[0])
    logits[:, TOKEN] = 1.0
    return logits


def stubbed_prefill(self, input_ids, *args, **kwargs) -> torch.Tensor:
    logits = torch.zeros(input_ids.shape[0], self.text.lm_head.shape[0])
    logits[:, TOKEN] = 1.0
    return logits


def one_run(args, profile: cProfile.Profile | None = None) -> dict:
    generator = torch.Generator().manual_seed(0)
    lengths = answer_lengths(args.requests, generator)
    prompts = torch.randint(0, 256, (args.requests, args.prompt_tokens), generator=generator)
    requests = [{"input_ids": prompt[None], "attention_mask": torch.ones(1, args.prompt_tokens, dtype=torch.long),
                 "max_new_tokens": length} for prompt, length in zip(prompts, lengths)]
    torch.manual_seed(0)
    model = Qwen3VLGraphForConditionalGeneration(tiny_config(max_batch_size=args.rows)).eval()
    generate_exactly_as_asked(model)
    manager = model.init_continuous_batching(max_batch_size=args.rows, requests=len(requests),
                                             static_cache_len=cache_len_for(requests, None,
                                                                            model.config.steps_per_sync))
    if profile is not None:  # the batch's own thread, where its host work runs
        run = manager._run
        manager._run = lambda: (profile.enable(), run(), profile.disable())
    steps_by_batch.clear()
    began = time.perf_counter()
    results = manager.generate_all(requests, progress_bar=False)
    seconds = time.perf_counter() - began
    assert [len(result.generated_tokens) for result in results.values()] == lengths
    stats = manager.stats
    return {"seconds": seconds, "chunks": stats["chunks"], "steps": stats["steps"], "prefills": stats["prefills"],
            "take_in_ms": stats["take_in_ms"], "admit_host_ms": stats["admit_host_ms"],
            "decode_steps_by_batch": dict(sorted(steps_by_batch.items(), reverse=True)),
            "decode_gpu_s_at_step_ms": sum(count * step_ms(rows) for rows, count in steps_by_batch.items()) / 1000,
            "decode_gpu_s_all_full": sum(lengths) / args.rows * step_ms(args.rows) / 1000}


def top(profile: cProfile.Profile, key: str, count: int = 25) -> str:
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats(key).print_stats(count)
    return text.getvalue()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=2048)
    parser.add_argument("--prompt-tokens", type=int, default=228)
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    if not 1 <= args.rows <= max(STEP_MS):
        parser.error(f"--rows must be 1 to {max(STEP_MS)} (the batch's most rows, and STEP_MS's)")
    torch.set_num_threads(1)
    DecodeRunner.forward = stubbed_decode
    PrefillRunner.forward = stubbed_prefill
    runs = [one_run(args) for _ in range(args.runs)]
    for run in runs:
        print({key: round(value, 1) if isinstance(value, float) else value for key, value in run.items()}, flush=True)
    result = {"runs": runs, "seconds_median": statistics.median(run["seconds"] for run in runs),
              "requests": args.requests, "rows": args.rows, "prompt_tokens": args.prompt_tokens}
    if args.profile:
        profile = cProfile.Profile()
        one_run(args, profile)
        result["profile_own_time"] = top(profile, "tottime")
        result["profile_cumulative"] = top(profile, "cumulative")
        print(result["profile_own_time"])
        print(result["profile_cumulative"])
    harness.write_cpu_json(result)


if __name__ == "__main__":
    main()
