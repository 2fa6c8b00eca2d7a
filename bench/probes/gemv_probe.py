"""Is the skinny Triton matmul faster than cuBLAS on the decode step's matmuls, and is its tiling rule right? (H200;
JSON to $OUT.)

For each weight shape of Qwen3-VL-2B's decode step and 1 to 64 rows (bf16): microseconds per call of F.linear and of
`skinny_matmul` (ops_matmul_qwen3vl_graph.py) at the tiling its rule picks and at alternatives that each change one
thing (no split of K, half or twice the split, other tile shapes, warps, stages). Timed as in the step: 28 calls over
distinct weight copies (read from HBM, not L2) captured in one CUDA graph; the Triton calls follow each other under
programmatic dependent launch where the device has it. Also what the tuner measures by its own method (each call
alone between two small kernels), which `TritonOps.linear` picks from.
Run: python bench/probes/gemv_probe.py (about half a minute, most of it compiling the tilings)
"""

import math

import torch
import torch.nn.functional as F

import harness
from qwen3vl_static.ops_matmul_qwen3vl_graph import skinny_config, skinny_matmul
from qwen3vl_static.triton_qwen3vl_graph import sm_count
from qwen3vl_static.tuner_qwen3vl_graph import KernelTuner

SHAPES = {"qkv": (4096, 2048), "o_proj": (2048, 2048), "gate_up": (12288, 2048), "down_proj": (2048, 6144),
          "lm_head": (151936, 2048)}  # (out_features N, in_features K)
ROWS = (1, 2, 4, 8, 16, 64)
CALLS = 28  # one per layer, as in the step


def tilings(n, k, sms) -> dict:
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


def chain_us(matmul, x, weights) -> float:
    """Microseconds per call in a graph of CALLS calls cycling through the weight copies."""
    graph = harness.capture(lambda: [matmul(x, weights[call % len(weights)]) for call in range(CALLS)])
    return harness.replay_us(graph) / CALLS


def measure_shape(n, k, sms, l2_bytes, ticket) -> dict:
    copies = min(CALLS, max(2, math.ceil(4 * l2_bytes / (n * k * 2))))  # together 4x the L2
    weights = [0.02 * torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
    configs = tilings(n, k, sms)
    entry = {"n": n, "k": k, "weight_copies": copies,
             "tilings": {label: config._asdict() for label, config in configs.items()}, "rows": {}}
    for rows in ROWS:
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        exact = x.float() @ weights[0].float().T
        cublas = F.linear(x, weights[0])
        row = {"cublas_us": chain_us(F.linear, x, weights),
               "cublas_err_vs_fp32": (cublas.float() - exact).abs().max().item()}
        for label, config in configs.items():
            def matmul(x, weight, config=config):
                return skinny_matmul(x, weight, config, ticket=ticket)

            try:  # a tiling that fails to compile or run must not cost the other numbers
                out = matmul(x, weights[0])
                row[label] = {"us": chain_us(matmul, x, weights),
                              "err_vs_cublas": (out.float() - cublas.float()).abs().max().item(),
                              "err_vs_fp32": (out.float() - exact).abs().max().item()}
            except Exception as error:  # noqa: BLE001 - reported, not timed
                row[label] = {"us": math.inf, "error": f"{type(error).__name__}: {str(error)[:200]}"}
        cublas_alone, rule_alone = KernelTuner().time_calls(
            (lambda: F.linear(x, weights[0]), lambda: skinny_matmul(x, weights[0], configs["rule"], ticket=ticket)))
        row["tuner_us"] = {"cublas": cublas_alone, "rule": rule_alone}
        entry["rows"][rows] = row
        print(f"{n}x{k}, {rows} rows: cuBLAS {row['cublas_us']:.1f} us, "
              + ", ".join(f"{label} {row[label]['us']:.1f}" for label in configs), flush=True)
    return entry


def main() -> None:
    harness.require_cuda()
    torch.manual_seed(0)
    properties = torch.cuda.get_device_properties(0)
    ticket = torch.zeros(1 << 16, dtype=torch.int32, device="cuda")  # counters of split-K sums, left at zero
    shapes = {name: measure_shape(n, k, sm_count(torch.device("cuda")), properties.L2_cache_size, ticket)
              for name, (n, k) in SHAPES.items()}

    def step_us(rows, per_call):  # a call per layer of each projection, plus one lm_head
        return sum((1 if name == "lm_head" else CALLS) * per_call(shapes[name]["rows"][rows]) for name in SHAPES)

    step = {rows: {"cublas": step_us(rows, lambda r: r["cublas_us"]),
                   "rule": step_us(rows, lambda r: r["rule"]["us"]),
                   "faster_of_the_two": step_us(rows, lambda r: min(r["cublas_us"], r["rule"]["us"]))}
            for rows in ROWS}
    for rows, totals in step.items():
        print(f"step matmuls, {rows} rows: " + ", ".join(f"{which} {us / 1000:.3f} ms" for which, us in totals.items()))
    harness.write_json({"calls_per_graph": CALLS, "shapes": shapes, "step_us": step})


if __name__ == "__main__":
    main()
