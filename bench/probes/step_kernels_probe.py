"""Where the decode step's time goes, kernel by kernel (H200; JSON and PNG to $OUT).

A dense model's decode step (default the 2B) at some batch sizes (default 1 and 8; 512-token prompts), in bf16 and
with every text linear in Qwen's FP8 format (default both), under torch.profiler: each kernel launch of a `generate`
call grouped by (kernel, grid), with its mean duration and the step time attributed to it (its end minus the previous
kernel's end: under PDL a kernel starts early and waits, so its duration overstates it, while the attributed times add
up to the step). Groups launched fewer times than the call's steps are left out; the prefill's own groups launched
more often remain (at batch 8, cuBLAS's prefill matmuls show up at 1.4 per step).

Run: python bench/probes/step_kernels_probe.py [--model 2b] [--batches 1 8] [--variants bf16 fp8] [--context 512].
`--plot JSON [JSON ...] --png PATH` draws saved runs in one picture (no GPU needed): each step's attributed time by
kind of kernel.
"""

import argparse
import gc
import json
from collections import defaultdict
from pathlib import Path

import torch

import harness
from qwen3vl_static.bench import LONG, decode_slope, timed_generate
from qwen3vl_static.fp8_quantize import NOT_CONVERTED, quantize_fp8
from qwen3vl_static.workloads import build_ours, generate_exactly_as_asked, text_prompt


def kernel_rows(model, prompt) -> tuple:
    """(kernel groups of the decode steps, sorted by attributed time; the attributed ms per step)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        timed_generate(model, prompt, LONG)
    kernels = sorted((e for e in harness.trace_events(profile) if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    groups = defaultdict(lambda: {"count": 0, "duration_us": 0.0, "attributed_us": 0.0})
    previous_end = None
    for event in kernels:
        end = event["ts"] + event["dur"]
        group = groups[(event["name"][:60], str(event["args"].get("grid")))]
        group["count"] += 1
        group["duration_us"] += event["dur"]
        group["attributed_us"] += 0.0 if previous_end is None else max(0.0, end - max(previous_end, event["ts"] - 50))
        previous_end = end if previous_end is None else max(previous_end, end)
    steps = LONG - 1
    rows = [{"kernel": name, "grid": grid, "per_step": group["count"] / steps,
             "mean_duration_us": group["duration_us"] / group["count"],
             "attributed_us_per_step": group["attributed_us"] / steps}
            for (name, grid), group in groups.items() if group["count"] >= steps]
    rows.sort(key=lambda row: -row["attributed_us_per_step"])
    return rows, sum(row["attributed_us_per_step"] for row in rows) / 1000


def measure(variant: str, batches, context, preset="2b") -> dict:
    model = build_ours(torch.device("cuda"), torch.bfloat16, preset, max_batch_size=max(batches))
    if variant == "fp8":
        quantize_fp8(model, NOT_CONVERTED)
    generate_exactly_as_asked(model)
    model.warmup(batch_sizes=list(batches), cache_lengths=[context + LONG], modes=("greedy",))
    generator = torch.Generator().manual_seed(0)
    result = {}
    for batch in batches:
        prompt = text_prompt(model.config, batch, context, torch.device("cuda"), generator)
        slope = decode_slope(model, prompt)[0]
        rows, attributed = kernel_rows(model, prompt)
        tuner = model.graph_engine().tuner  # which form each op took at this batch (0: cuBLAS / separate kernels)
        choices = {f"{op} {shape}": tuner.choices[key] for key in tuner.choices for op, shape, _ in [key]
                   if shape.startswith(f"{batch}x")}
        result[f"batch{batch}"] = {"ms_per_step": slope, "attributed_ms_per_step": attributed, "kernels": rows,
                                   "measured_choices": choices}
        print(variant, batch, f"{slope:.3f} ms/step", flush=True)
        for row in rows[:14]:
            print(f"  {row['attributed_us_per_step']:8.1f} us/step  {row['per_step']:5.1f}x  "
                  f"{row['mean_duration_us']:7.2f} us  {row['kernel']} {row['grid']}", flush=True)
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return result


# Kinds of kernel, by name: the first whose words a kernel's name holds. Matmuls launched once a step are the lm_head.
KINDS = {
    "attention": ("decode_attention", "merge"),
    "norms, SwiGLU, split-K sums": ("add_rms_norm", "qk_norm_rope_write_kernel", "silu_mul", "sum_splits",
                                    "splitKreduce", "decode_rotary"),
    "projections": ("skinny_matmul", "qkv_norm_rope_write", "nvjet", "gemm", "cutlass"),
    "step end": ("finish_step",),
}


def kind(row) -> str:
    name = row["kernel"]
    found = next((label for label, words in KINDS.items() if any(word in name for word in words)), "other")
    if abs(row["per_step"] - round(row["per_step"])) > 0.05:  # launched by the prefill, not every step
        return "prefill (counted in)"
    if found == "projections" and round(row["per_step"]) == 1:  # (the prefill's own lm_head shares its group)
        return "lm_head"
    return found


def plot(runs: dict, path, preset="2b") -> None:
    """Horizontal bars, one per run `{label: (kernel rows, ms/step)}`: the attributed ms/step of each kind of kernel,
    and the measured ms/step as a tick."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(runs)
    kinds = ["projections", "lm_head", "attention", "norms, SwiGLU, split-K sums", "step end", "other",
             "prefill (counted in)"]
    fig, ax = plt.subplots(figsize=(9, 0.6 * len(labels) + 1.5))
    left = [0.0] * len(labels)
    for name in kinds:
        widths = [sum(row["attributed_us_per_step"] for row in runs[label][0] if kind(row) == name) / 1000
                  for label in labels]
        if any(widths):
            ax.barh(labels, widths, left=left, label=name)
            left = [a + b for a, b in zip(left, widths)]
    ax.scatter([runs[label][1] for label in labels], labels, marker="|", s=400, color="black", zorder=3,
               label="measured ms/step (slope)")
    ax.invert_yaxis()
    ax.set(xlabel="ms per decode step, attributed to each kernel (its end minus the previous kernel's end)",
           title=f"Qwen3-VL-{preset.upper()} decode step by kind of kernel (H200)")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=3, fontsize=8)
    fig.savefig(path, dpi=120, bbox_inches="tight")


def saved_runs(paths) -> dict:
    """`plot`'s runs from saved JSONs: one per variant and batch size."""
    runs = {}
    for path in paths:
        saved = json.loads(Path(path).read_text())
        for variant in ("bf16", "fp8"):
            for batch, result in saved.get(variant, {}).items():
                label = f"{'FP8' if variant == 'fp8' else 'bf16'}, batch {batch.removeprefix('batch')}"
                runs[label] = (result["kernels"], result["ms_per_step"])
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("2b", "4b", "8b"), default="2b", help="the dense preset's shapes")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--variants", nargs="+", choices=("bf16", "fp8"), default=["bf16", "fp8"])
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--plot", nargs="+", metavar="JSON", help="draw these saved runs instead of measuring")
    parser.add_argument("--png", default="step-kernels.png", help="where --plot writes its picture")
    args = parser.parse_args()
    if args.plot:
        plot(saved_runs(args.plot), args.png, json.loads(Path(args.plot[0]).read_text()).get("model", "2b"))
        print(f"wrote {args.png}")
        return
    harness.require_cuda()
    results = {variant: measure(variant, args.batches, args.context, args.model) for variant in args.variants}
    out = harness.write_json({"model": args.model, "context": args.context, **results})
    plot(saved_runs([out]), out.with_suffix(".png"), args.model)
    print(f"wrote {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
