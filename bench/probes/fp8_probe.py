"""FP8 decode on the 2B shapes: the skinny matmul's FP8 tilings (its `tl.dot` form at the rule's tiling, the FMA form
at 16-64 columns x 256-1024 inputs) timed alone as the tuner times them, and decode ms/step / TTFT of the bf16 and FP8
models (ours, graphs). Writes $OUT/fp8_probe.json.

Usage (H200): python bench/probes/fp8_probe.py
"""

import json
import os
import time
from pathlib import Path

import torch

from qwen3vl_static import ops_matmul_qwen3vl_graph as matmul
from qwen3vl_static.fp8_qwen3vl_graph import Fp8Weight
from qwen3vl_static.fp8_quantize import quantize_fp8
from qwen3vl_static.tuner_qwen3vl_graph import KernelTuner
from qwen3vl_static.workloads import build_models, image_prompt, text_prompt

SHAPES = {"qkv": (4096, 2048), "o_proj": (2048, 2048), "gate_up": (12288, 2048), "down_proj": (2048, 6144),
          "lm_head (bf16 in the checkpoints)": (151936, 2048)}


def tilings(rows):
    tuner = KernelTuner()
    out = {}
    for name, (n, k) in SHAPES.items():
        weight = Fp8Weight((torch.randn(n, k, device="cuda") * 32).to(torch.float8_e4m3fn),
                           torch.rand(-(-n // 128), k // 128, device="cuda"), 128)
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        rule = matmul.rule_config(weight)
        configs = [rule._replace(num_stages=4)]
        configs += [matmul.SkinnyConfig(block_n, width, -(-k // width), warps, 1, fma=True)
                    for block_n in (16, 32, 64) for width in (256, 512, 1024) for warps in (4, 8)
                    if block_n * width <= 32768 and width <= k]
        times = tuner.time_calls([lambda config=config: matmul.skinny_matmul(x, weight, config) for config in configs])
        ranked = sorted(zip(times, configs))
        out[name] = [{"us": us, "GB/s": n * k / us / 1e3, "config": config._asdict()} for us, config in ranked[:6]]
        out[name].append({"rule_us": times[configs.index(rule)], "rule": rule._asdict()})
    return out


def timed(model, prompt, new_tokens):
    torch.cuda.synchronize()
    began = time.perf_counter()
    out = model.generate(**prompt, max_new_tokens=new_tokens, do_sample=False)
    torch.cuda.synchronize()
    assert out.shape[1] - prompt["input_ids"].shape[1] == new_tokens
    return out, time.perf_counter() - began


def decode(model, prompts, image):
    result = {}
    for batch, prompt in prompts.items():
        timed(model, prompt, 16)
        short, long = timed(model, prompt, 16)[1], timed(model, prompt, 80)[1]
        result[f"decode_ms_b{batch}"] = 1000 * (long - short) / 64
    timed(model, image, 1)
    result["ttft_ms"] = 1000 * min(timed(model, image, 1)[1] for _ in range(5))
    result["e2e_tok_s"] = 128 / min(timed(model, image, 128)[1] for _ in range(3))
    return result


def main():
    report = {"tilings_b1": tilings(1), "tilings_b8": tilings(8)}
    ours, stock = build_models(torch.device("cuda"), torch.bfloat16, static_cache_len=1024, max_batch_size=8)
    del stock
    generator = torch.Generator().manual_seed(0)
    prompts = {batch: text_prompt(ours.config, batch, 256, "cuda", generator) for batch in (1, 8)}
    image = image_prompt(ours.config, "cuda", generator)
    report["bf16"] = decode(ours, prompts, image)
    quantize_fp8(ours)
    torch.cuda.empty_cache()
    report["fp8"] = decode(ours, prompts, image)
    ours.set_cuda_graphs(False)
    eager = timed(ours, prompts[8], 64)[0]
    ours.set_cuda_graphs(True)
    report["fp8_graph_equals_eager_b8"] = bool(torch.equal(eager, timed(ours, prompts[8], 64)[0]))
    tuner = ours.graph_engine().tuner
    report["fp8_choices"] = {f"{op} {shape}": {"choice": tuner.choices[key], "us": [round(t, 2) for t in us]}
                             for key, us in tuner.timings.items() for op, shape, _ in [key] if "fp8" in shape}
    report["weights_gb"] = sum(p.numel() * p.element_size() for p in ours.parameters()) / 1e9
    report["peak_gb"] = torch.cuda.max_memory_allocated() / 1e9
    print(json.dumps({k: v for k, v in report.items() if not k.startswith(("tilings", "prefill"))}, indent=1))
    for rows in ("b1", "b8"):
        for name, ranked in report[f"tilings_{rows}"].items():
            print(rows, name, [(round(r["us"], 1), r["config"]["block_n"], r["config"]["num_warps"], r["config"]["num_stages"],
                                r["config"]["split_k"], "fma" if r["config"]["fma"] else "dot") for r in ranked[:5]],
                  "rule", round(ranked[-1]["rule_us"], 1))
    out = Path(os.environ.get("OUT", "bench/results"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "fp8_probe.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
