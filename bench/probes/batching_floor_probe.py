"""How fast could `bench --batching` go on an H200, whatever the schedule? Arithmetic on the benchmark's own work, no
GPU (JSON to $OUT).

The work is fixed by the workload: 2,048 prompts of 228 tokens (each with one 448x448 image for the image workload),
answers of the benchmark's seeded lengths (geometric, mean 128, 1..512, EOS off), greedy on the 2B. Counted here from
the real config: the prefill's FLOPs, the tower's, the decode matmuls' (2 per weight per token, lm_head included), the
KV cache bytes the decode attention reads (every answer token after the first reads its row's written slots: the
prompt's and the answer's so far) and the weight bytes each step reads. Two schedules, first come first served:
`--rows` rows (the defaults' 512) and every request in a row at once (the fewest steps, as many as the longest
answer). Each is priced two ways, kernels one after another (each engine's step runs them so):

- at the device's peaks (`--peak-tflops`, `--peak-tbps`): a step takes its matmuls' FLOPs or its weight bytes,
  whichever is longer, then its KV bytes; prefill and tower their FLOPs;
- at what today's kernels measure on the H200 (`STEP_MS` by batch, linear between and past them; `PREFILL_US_PER_TOKEN`;
  `TOWER_MS_PER_IMAGE`), with no host time and nothing lost to running side by side.

Useful tokens/s = the answers' tokens over the sum. Arithmetic, not a measurement: it says what no schedule can beat
with these kernels, and what the kernels would need for a target.

Usage: python bench/probes/batching_floor_probe.py [--rows 512] [--targets 40000 30000]
"""

import argparse
import bisect
import heapq

import torch

import harness
from qwen3vl_static.bench_batching import BATCHING_REQUESTS, PROMPT_TOKENS, answer_lengths
from qwen3vl_static.presets import real_config

# Today's kernels on one H200, bf16 2B: the decode step by batch at ~300-slot contexts (README, docs/design.md; as
# `batch_host_probe.py`), a prefill graph's time a token (`prefill_kernels_probe.py`, 8-32 x 256 tokens, 56 % of the
# peak's floor) and the tower's time an image (eight 448x448 images in one call, 9.07 ms).
STEP_MS = {1: 1.38, 8: 1.61, 64: 2.40, 256: 4.80, 512: 8.69}
PREFILL_US_PER_TOKEN = 5.1
TOWER_MS_PER_IMAGE = 9.07 / 8
IMAGE_PATCHES = (448 // 16) ** 2  # a 448x448 image's patches (16-pixel patches, 2 frames folded into one)


def step_ms(rows: int) -> float:
    """`STEP_MS` at `rows`: linear between its neighbours, and past the largest along its last segment."""
    sizes = sorted(STEP_MS)
    upper = min(max(bisect.bisect_left(sizes, rows), 1), len(sizes) - 1)
    low, high = sizes[upper - 1], sizes[upper]
    return STEP_MS[low] + (STEP_MS[high] - STEP_MS[low]) * (rows - low) / (high - low)


def schedule(lengths: list, rows: int) -> list:
    """First come first served into `rows` rows: per decode step, the (rows decoding, slots they read). A request's
    first token comes from its prefill; its decode steps then read its prompt's slots and its answer's so far."""
    free_at = [0] * min(rows, len(lengths))  # the step at which each row is free again
    starts = []
    for length in lengths:
        start = heapq.heappop(free_at)
        starts.append(start)
        heapq.heappush(free_at, start + length - 1)
    steps = max(start + length - 1 for start, length in zip(starts, lengths))
    decoding, slots = [0] * steps, [0] * steps
    for start, length in zip(starts, lengths):
        for token in range(1, length):
            decoding[start + token - 1] += 1
            slots[start + token - 1] += PROMPT_TOKENS + token
    return list(zip(decoding, slots))


def model_counts(config) -> dict:
    text, vision = config.text_config, config.vision_config
    hidden, head_dim = text.hidden_size, text.head_dim
    layer = hidden * head_dim * (2 * text.num_attention_heads + 2 * text.num_key_value_heads) \
        + 3 * hidden * text.intermediate_size
    decode_weights = text.num_hidden_layers * layer + text.vocab_size * hidden  # lm_head reads the embedding's size
    width = vision.hidden_size
    merger_in = width * vision.spatial_merge_size**2
    mergers = (1 + len(vision.deepstack_visual_indexes)) * (merger_in * merger_in + merger_in * vision.out_hidden_size)
    # Attention's own products: a prompt's causal QK and PV (half the square), an image's full square over its patches.
    prompt_attention = 2 * PROMPT_TOKENS * text.num_attention_heads * head_dim * text.num_hidden_layers
    image_attention = 4 * IMAGE_PATCHES**2 * width * vision.depth
    return {
        "prefill_flops_per_token": 2 * text.num_hidden_layers * layer + prompt_attention,
        "decode_flops_per_token": 2 * decode_weights,
        "weight_bytes_per_step": 2 * decode_weights,
        "kv_bytes_per_slot": 2 * 2 * text.num_hidden_layers * text.num_key_value_heads * head_dim,
        "tower_flops_per_image": 2 * IMAGE_PATCHES * vision.depth * (4 * width * width + 2 * width * vision.intermediate_size)
        + 2 * IMAGE_PATCHES // vision.spatial_merge_size**2 * mergers + image_attention,
    }


def at_peaks(steps: list, counts: dict, requests: int, peak_flops: float, peak_bytes: float,
             kv_bytes_scale: float) -> dict:
    """Seconds of prefill, tower (the image workload) and decode at the device's peaks, kernels one after another: a
    step its matmuls' FLOPs or its weight bytes, whichever is longer, then its K/V bytes (`kv_bytes_scale` of bf16's)."""
    return {
        "prefill_s": requests * PROMPT_TOKENS * counts["prefill_flops_per_token"] / peak_flops,
        "tower_s": requests * counts["tower_flops_per_image"] / peak_flops,
        "decode_s": sum(max(rows * counts["decode_flops_per_token"] / peak_flops,
                            counts["weight_bytes_per_step"] / peak_bytes)
                        + slots * counts["kv_bytes_per_slot"] * kv_bytes_scale / peak_bytes for rows, slots in steps),
    }


def with_todays_kernels(steps: list, requests: int) -> dict:
    """Seconds of prefill, tower and decode at today's kernels' measured times (bf16)."""
    return {"prefill_s": requests * PROMPT_TOKENS * PREFILL_US_PER_TOKEN / 1e6,
            "tower_s": requests * TOWER_MS_PER_IMAGE / 1e3,
            "decode_s": sum(step_ms(rows) for rows, _ in steps) / 1e3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--peak-tflops", type=float, default=989.0)  # H200 SXM, dense bf16
    parser.add_argument("--peak-tbps", type=float, default=4.8)  # H200 HBM3e
    parser.add_argument("--targets", type=float, nargs=2, default=(40000, 30000), metavar=("TEXT", "IMAGE"))
    args = parser.parse_args()
    lengths = answer_lengths(BATCHING_REQUESTS, torch.Generator().manual_seed(0))  # the benchmark's first draw
    tokens = sum(lengths)
    counts = model_counts(real_config("2b"))
    peak_flops, peak_bytes = args.peak_tflops * 1e12, args.peak_tbps * 1e12
    result = {"requests": len(lengths), "prompt_tokens": PROMPT_TOKENS, "answer_tokens": tokens, **counts,
              "step_ms": STEP_MS, "prefill_us_per_token": PREFILL_US_PER_TOKEN,
              "tower_ms_per_image": TOWER_MS_PER_IMAGE, "schedules": []}
    for rows in (args.rows, len(lengths)):
        steps = schedule(lengths, rows)
        entry = {"rows": rows, "decode_steps": len(steps), "steps_at_full_rows": sum(n == rows for n, _ in steps),
                 "kv_tb_read": sum(slots for _, slots in steps) * counts["kv_bytes_per_slot"] / 1e12}
        priced = {"peak_bf16_kv": at_peaks(steps, counts, len(lengths), peak_flops, peak_bytes, 1.0),
                  "today_bf16": with_todays_kernels(steps, len(lengths)),
                  "peak_float8_kv": at_peaks(steps, counts, len(lengths), peak_flops, peak_bytes, 0.5)}
        for name, seconds in priced.items():
            text_s = seconds["prefill_s"] + seconds["decode_s"]
            image_s = text_s + seconds["tower_s"]
            entry[name] = {**{key: round(value, 3) for key, value in seconds.items()},
                           "text_tokens_per_s": round(tokens / text_s), "image_tokens_per_s": round(tokens / image_s),
                           "text_s_for_target": round(tokens / args.targets[0], 3),
                           "image_s_for_target": round(tokens / args.targets[1], 3)}
        result["schedules"].append(entry)
        print(entry, flush=True)
    harness.write_cpu_json(result)


if __name__ == "__main__":
    main()
