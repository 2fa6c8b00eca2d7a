"""Do the decode step's matmuls run faster as the skinny Triton kernel than on cuBLAS? (H200 probe; numbers go to $OUT.)

For each weight shape of Qwen3-VL-2B's decode step and 1, 2, 4, 8 rows (bf16): microseconds per call of F.linear and
of `skinny_matmul` (ops_matmul_qwen3vl_graph.py) with the tiling its rule picks and with alternatives (is the rule right?). Timed as
in the step: 28 calls over distinct weight copies (read from HBM, not L2) captured in one CUDA graph, replays timed
with CUDA events; the Triton calls follow each other under programmatic dependent launch where the device has it.
Also what `TritonOps.linear`'s tuner measures and picks by itself on first use.
Run: python bench/probes/gemv_probe.py (about half a minute, most of it compiling the tilings)
"""

import json
import math
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    sys.exit("gemv_probe.py measures GPU kernels: it needs a CUDA device (none found).")

from qwen3vl_static.ops_matmul_qwen3vl_graph import skinny_config, skinny_matmul
from qwen3vl_static.triton_qwen3vl_graph import triton
from qwen3vl_static.tuner_qwen3vl_graph import KernelTuner

if triton is None:
    sys.exit("gemv_probe.py needs Triton (not installed).")

SHAPES = {"qkv": (4096, 2048), "o_proj": (2048, 2048), "gate_up": (12288, 2048), "down_proj": (2048, 6144),
          "lm_head": (151936, 2048)}  # (out_features N, in_features K)
ROWS = (1, 2, 4, 8)
CALLS = 28  # one per layer, as in the step
REPLAYS = 10
device = torch.device("cuda")
properties = torch.cuda.get_device_properties(device)
sms = properties.multi_processor_count


def tilings(n, k):
    """The rule's tiling and alternatives that each change one thing about it."""
    rule = skinny_config(n, k, sms)
    return {
        "rule": rule,
        "no-split": rule._replace(split_k=1),
        "split-half": rule._replace(split_k=max(1, rule.split_k // 2)),
        "split-x2": rule._replace(split_k=2 * rule.split_k),
        "n32-k256": skinny_config(n, k, sms, block_n=32, block_k=256),
        "n128-k64": skinny_config(n, k, sms, block_n=128, block_k=64),
        "w8": rule._replace(num_warps=8),
        "s2": rule._replace(num_stages=2),
        "s6": rule._replace(num_stages=6),
    }


LABELS = list(tilings(*SHAPES["qkv"]))


def graph_us(matmul, x, weights):
    """Median microseconds per call over graph replays of CALLS calls that cycle through the weight copies."""
    matmul(x, weights[0])  # compiles / warms up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in range(CALLS):
            matmul(x, weights[call % len(weights)])
    graph.replay()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(REPLAYS)]
    torch.cuda._sleep(2_000_000)  # ~1 ms: the replays queue up behind it, so none waits for the host
    for start, end in events:
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    return 1000 * statistics.median(start.elapsed_time(end) for start, end in events) / CALLS


def terabytes_per_s(n, k, us):
    return n * k * 2 / (us * 1e-6) / 1e12


def step_us(shapes, rows, per_call):
    """The step's matmul time: a call per layer of qkv, o_proj, gate_up and down_proj, plus one lm_head."""
    return sum((1 if name == "lm_head" else CALLS) * per_call(shapes[name]["rows"][rows]) for name in SHAPES)


began = time.perf_counter()
torch.manual_seed(0)
results = {"device": properties.name, "sms": sms, "l2_bytes": properties.L2_cache_size, "torch": torch.__version__,
           "triton": triton.__version__, "calls_per_graph": CALLS, "shapes": {}}
for name, (n, k) in SHAPES.items():
    copies = min(CALLS, max(2, math.ceil(4 * properties.L2_cache_size / (n * k * 2))))  # together 4x the L2
    weights = [0.02 * torch.randn(n, k, device=device, dtype=torch.bfloat16) for _ in range(copies)]
    configs = tilings(n, k)
    entry = results["shapes"][name] = {"n": n, "k": k, "weight_copies": copies,
                                       "tilings": {label: config._asdict() for label, config in configs.items()}, "rows": {}}
    for rows in ROWS:
        x = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
        exact = x.float() @ weights[0].float().T
        cublas = F.linear(x, weights[0])
        row = {"cublas_us": graph_us(F.linear, x, weights), "cublas_err_vs_fp32": (cublas.float() - exact).abs().max().item()}
        for label, config in configs.items():
            matmul = lambda x, weight, config=config: skinny_matmul(x, weight, config)  # noqa: E731
            try:  # a tiling that fails to compile or run must not cost the other numbers
                out = matmul(x, weights[0])
                row[label] = {"us": graph_us(matmul, x, weights),
                              "err_vs_cublas": (out.float() - cublas.float()).abs().max().item(),
                              "err_vs_fp32": (out.float() - exact).abs().max().item()}
            except Exception as error:
                row[label] = {"us": math.inf, "error": f"{type(error).__name__}: {str(error)[:200]}"}
        # What the package decides by itself (its own timing method, the rule's tiling) on first use of this shape.
        try:
            own_cublas_us, own_triton_us = KernelTuner().time_calls(
                (lambda weight=weights[0]: F.linear(x, weight), lambda weight=weights[0]: skinny_matmul(x, weight)))
            row["linear_measured"] = {"cublas_us": own_cublas_us, "triton_us": own_triton_us,
                                      "picks": "triton" if own_triton_us < own_cublas_us else "cublas"}
        except Exception as error:
            row["linear_measured"] = {"picks": f"error: {type(error).__name__}", "cublas_us": math.nan, "triton_us": math.nan}
        row["graph_faster"] = "triton" if row["rule"]["us"] < row["cublas_us"] else "cublas"
        entry["rows"][rows] = row
    del weights
    torch.cuda.empty_cache()


shapes = results["shapes"]
results["step_us"] = {
    rows: {
        "cublas": step_us(shapes, rows, lambda r: r["cublas_us"]),
        "rule": step_us(shapes, rows, lambda r: r["rule"]["us"]),
        "faster_of_the_two": step_us(shapes, rows, lambda r: min(r["cublas_us"], r["rule"]["us"])),
        "best_tiling_or_cublas": step_us(shapes, rows, lambda r: min([r["cublas_us"]] + [r[label]["us"] for label in LABELS])),
    }
    for rows in ROWS
}
results["seconds"] = time.perf_counter() - began

print(f"{properties.name}, {sms} SMs, bf16; us per call (TB/s) in graphs of {CALLS} calls; linear() picks from its own"
      " timing (cuBLAS/Triton us); max err: the rule's tiling against cuBLAS")
print(f"{'shape':<10}{'rows':>5}{'cuBLAS':>16}" + "".join(f"{label:>16}" for label in LABELS)
      + f"{'linear() picks':>24}{'max err':>10}")
for name, entry in results["shapes"].items():
    n, k = entry["n"], entry["k"]
    for rows, row in entry["rows"].items():
        cells = [row["cublas_us"]] + [row[label]["us"] for label in LABELS]
        text = "".join(f"{us:>8.1f} ({terabytes_per_s(n, k, us):4.2f})" for us in cells)
        own = row["linear_measured"]
        pick = f"{own['picks']} ({own['cublas_us']:.1f}/{own['triton_us']:.1f})"
        print(f"{name:<10}{rows:>5}{text}{pick:>24}{row['rule'].get('err_vs_cublas', math.nan):>10.3g}")
for rows, totals in results["step_us"].items():
    print(f"step matmuls, {rows} rows: " + ", ".join(f"{which} {us / 1000:.3f} ms" for which, us in totals.items()))
print("split-K of the rule: " + ", ".join(f"{name} {entry['tilings']['rule']['split_k']}"
                                          for name, entry in results["shapes"].items()))
print(f"{results['seconds']:.1f} s")
out = os.environ.get("OUT", "bench/results")
os.makedirs(out, exist_ok=True)
with open(os.path.join(out, "gemv-probe.json"), "w") as handle:
    json.dump(results, handle, indent=1)
