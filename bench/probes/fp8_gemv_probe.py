"""Which FP8 GEMV form reads FP8 weights near the bandwidth bf16 reaches? The package's forms read the 2B projections'
FP8 weights at about a third of the bf16 rate (loads that feed a conversion are not software-pipelined like loads
that feed a `tl.dot`). This probe times, on the 2B decode shapes at 1 and 8 rows, as the tuner times candidates:

- `package dot` / `package fma`: the skinny matmul's two FP8 forms (`ops_matmul_qwen3vl_graph.py`);
- `prefetch`: the `tl.dot` form with the next tile loaded into registers before the current one is converted;
- `tl.range`: the `tl.dot` form with its loop under `tl.range(num_stages=...)`;
- `bits`: the `tl.dot` form with FP8 -> bf16 by integer ops (the exponent bias folded into the scale);
- `w8a8`: activations quantized per row and 128-input block to e4m3, native FP8 `tl.dot` (the weight loads feed the
  `tl.dot` directly; changes the numbers to those of transformers' own FP8Linear);
- `bf16`: the bf16 matrix through the package's bf16 skinny matmul (the bar to reach).

Each form's output is checked against the float32 product of the dequantized matrix. Writes $OUT/fp8_gemv_probe.json.
Usage (H200): python bench/probes/fp8_gemv_probe.py
"""

import json
import os
from pathlib import Path

import torch
import triton
import triton.language as tl

from qwen3vl_static import ops_matmul_qwen3vl_graph as matmul
from qwen3vl_static.fp8_qwen3vl_graph import Fp8Weight
from qwen3vl_static.tuner_qwen3vl_graph import KernelTuner

SHAPES = {"qkv": (4096, 2048), "o_proj": (2048, 2048), "gate_up": (12288, 2048), "down_proj": (2048, 6144)}
ROWS = 16


@triton.jit
def _dot_forms_kernel(x, weight, scale, parts, rows, n_cols, k_len, k_split, stride_x, stride_w, stride_s,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FORM: tl.constexpr, STAGES: tl.constexpr):
    """Float32 partial products `(splits, rows, n)` of one (BLOCK_N columns, K range) program. FORM 0: prefetch,
    1: tl.range, 2: bits (BLOCK_K = 128: one scale per row and tile)."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(1)
    row_ids = tl.arange(0, 16)
    k_start = split * k_split
    k_end = tl.minimum(k_start + k_split, k_len)
    live = cols < n_cols
    acc = tl.zeros((BLOCK_N, 16), tl.float32)
    if FORM == 0:
        ks = k_start + tl.arange(0, BLOCK_K)
        w_next = tl.load(weight + cols[:, None] * stride_w + ks[None, :], mask=live[:, None] & (ks[None, :] < k_end),
                         other=0.0)
        for start in range(k_start, k_end, BLOCK_K):
            w = w_next
            ks = start + BLOCK_K + tl.arange(0, BLOCK_K)
            w_next = tl.load(weight + cols[:, None] * stride_w + ks[None, :],
                             mask=live[:, None] & (ks[None, :] < k_end), other=0.0)
            kx = start + tl.arange(0, BLOCK_K)
            x_t = tl.load(x + row_ids[None, :] * stride_x + kx[:, None], mask=(row_ids[None, :] < rows) & (kx[:, None] < k_len),
                          other=0.0)
            s = tl.load(scale + cols // 128 * stride_s + start // 128, mask=live, other=0.0)
            acc = tl.dot((w.to(tl.float32) * s[:, None]).to(x_t.dtype), x_t, acc)
    elif FORM == 1:
        for start in tl.range(k_start, k_end, BLOCK_K, num_stages=STAGES):
            ks = start + tl.arange(0, BLOCK_K)
            w = tl.load(weight + cols[:, None] * stride_w + ks[None, :], mask=live[:, None] & (ks[None, :] < k_end),
                        other=0.0)
            x_t = tl.load(x + row_ids[None, :] * stride_x + ks[:, None], mask=(row_ids[None, :] < rows) & (ks[:, None] < k_len),
                          other=0.0)
            s = tl.load(scale + cols // 128 * stride_s + start // 128, mask=live, other=0.0)
            acc = tl.dot((w.to(tl.float32) * s[:, None]).to(x_t.dtype), x_t, acc)
    else:
        for start in range(k_start, k_end, BLOCK_K):
            ks = start + tl.arange(0, BLOCK_K)
            raw = tl.load(weight + cols[:, None] * stride_w + ks[None, :], mask=live[:, None] & (ks[None, :] < k_end),
                          other=0).to(tl.int16)
            # e4m3 bits in bf16's places: the value times 2**-120 (bias 7 against 127), denormals included.
            bits = ((raw & 0x80) << 8) | ((raw & 0x7F) << 4)
            w = bits.to(tl.bfloat16, bitcast=True)
            x_t = tl.load(x + row_ids[None, :] * stride_x + ks[:, None], mask=(row_ids[None, :] < rows) & (ks[:, None] < k_len),
                          other=0.0)
            s = tl.load(scale + cols // 128 * stride_s + start // 128, mask=live, other=0.0) * 1.329227995784916e36
            acc += tl.dot(w, x_t.to(tl.bfloat16)) * s[:, None]
    tl.store(parts + (split * rows + row_ids[None, :]) * n_cols + cols[:, None], acc,
             mask=live[:, None] & (row_ids[None, :] < rows))


@triton.jit
def _quantize_rows_kernel(x, out, scales, k_len, stride_x, BLOCK_K: tl.constexpr):
    """One (row, 128-input block) of x to e4m3: the block's largest magnitude maps to 448."""
    row, block = tl.program_id(0), tl.program_id(1)
    ks = block * BLOCK_K + tl.arange(0, BLOCK_K)
    v = tl.load(x + row * stride_x + ks, mask=ks < k_len, other=0.0).to(tl.float32)
    s = tl.maximum(tl.max(tl.abs(v)), 1e-12) / 448.0
    tl.store(out + row * k_len + ks, (v / s).to(tl.float8e4nv), mask=ks < k_len)
    tl.store(scales + row * tl.cdiv(k_len, BLOCK_K) + block, s)


@triton.jit
def _w8a8_kernel(xq, x_scales, weight, scale, parts, rows, n_cols, k_len, k_split, stride_w, stride_s,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(1)
    row_ids = tl.arange(0, 16)
    k_start = split * k_split
    k_end = tl.minimum(k_start + k_split, k_len)
    live = cols < n_cols
    blocks = tl.cdiv(k_len, BLOCK_K)
    acc = tl.zeros((BLOCK_N, 16), tl.float32)
    for start in tl.range(k_start, k_end, BLOCK_K, num_stages=STAGES):
        ks = start + tl.arange(0, BLOCK_K)
        w = tl.load(weight + cols[:, None] * stride_w + ks[None, :], mask=live[:, None] & (ks[None, :] < k_end), other=0.0)
        x_t = tl.load(xq + row_ids[None, :] * k_len + ks[:, None], mask=(row_ids[None, :] < rows) & (ks[:, None] < k_len),
                      other=0.0)
        sw = tl.load(scale + cols // 128 * stride_s + start // 128, mask=live, other=0.0)
        sx = tl.load(x_scales + row_ids * blocks + start // 128, mask=row_ids < rows, other=0.0)
        acc += tl.dot(w, x_t) * sw[:, None] * sx[None, :]
    tl.store(parts + (split * rows + row_ids[None, :]) * n_cols + cols[:, None], acc,
             mask=live[:, None] & (row_ids[None, :] < rows))


def partial_products(kernel_call, rows, n, splits, device):
    parts = torch.empty(splits, rows, n, dtype=torch.float32, device=device)
    kernel_call(parts)
    return parts.sum(0)


def forms(x, weight, rule):
    """name -> call returning float32 `x @ dequantized(weight).T`."""
    rows, k = x.shape
    n = weight.shape[0]
    data, scale = weight.data, weight.scale
    out = {}
    for split in dict.fromkeys((rule.split_k, max(1, rule.split_k // 2), 2 * rule.split_k)):
        k_split = triton.cdiv(triton.cdiv(k, split), 128) * 128
        splits = triton.cdiv(k, k_split)
        for block_n in (64, 128):
            for form, name in ((0, "prefetch"), (1, "tl.range"), (2, "bits")):
                for stages in ((2, 3, 4) if form == 1 else (1,)):
                    def call(parts, form=form, block_n=block_n, stages=stages, k_split=k_split, splits=splits):
                        _dot_forms_kernel[(triton.cdiv(n, block_n), splits)](
                            x, data if form != 2 else data.view(torch.uint8), scale, parts, rows, n, k, k_split,
                            x.stride(0), data.stride(0), scale.stride(0), BLOCK_N=block_n, BLOCK_K=128, FORM=form,
                            STAGES=stages, num_warps=4, num_stages=4)
                    out[f"{name} n{block_n} split{splits} st{stages}"] = (
                        lambda call=call, splits=splits: partial_products(call, rows, n, splits, x.device))

            def w8a8(parts, block_n=block_n, k_split=k_split, splits=splits):
                xq = torch.empty(rows, k, dtype=torch.float8_e4m3fn, device=x.device)
                x_scales = torch.empty(rows, triton.cdiv(k, 128), dtype=torch.float32, device=x.device)
                _quantize_rows_kernel[(rows, triton.cdiv(k, 128))](x, xq, x_scales, k, x.stride(0), BLOCK_K=128)
                _w8a8_kernel[(triton.cdiv(n, block_n), splits)](
                    xq, x_scales, data, scale, parts, rows, n, k, k_split, data.stride(0), scale.stride(0),
                    BLOCK_N=block_n, BLOCK_K=128, STAGES=4, num_warps=4)
            out[f"w8a8 n{block_n} split{splits}"] = (
                lambda call=w8a8, splits=splits: partial_products(call, rows, n, splits, x.device))
    out["package dot"] = lambda: matmul.skinny_matmul(x, weight, rule._replace(num_stages=4)).float()
    for config in matmul.fma_configs(weight):
        out[f"package fma n{config.block_n} k{config.block_k}"] = (
            lambda config=config: matmul.skinny_matmul(x, weight, config).float())
    return out


def main():
    device = torch.device("cuda")
    tuner = KernelTuner()
    report = {}
    for rows in (1, 8):
        for name, (n, k) in SHAPES.items():
            weight = Fp8Weight((torch.randn(n, k, device=device) * 32).to(torch.float8_e4m3fn),
                               torch.rand(n // 128, k // 128, device=device) / 256, 128)
            x = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
            dense = weight.dequantize(torch.bfloat16)
            expected = x.float() @ weight.dequantize(torch.float32).T
            rule = matmul.rule_config(weight)
            calls = forms(x, weight, rule)
            errors = {form: ((call() - expected).abs().max() / expected.abs().max()).item() for form, call in calls.items()}
            names = list(calls)
            times = tuner.time_calls([calls[form] for form in names] + [lambda: matmul.skinny_matmul(x, dense)])
            bf16_us = times.pop()
            ranked = sorted(zip(times, names))
            report[f"{rows}x {name}"] = {"bf16_us": bf16_us, "fp8_bytes": n * k,
                                         "forms": {form: {"us": us, "rel_error": errors[form]} for us, form in ranked}}
            print(f"{rows} rows {name}: bf16 {bf16_us:.1f} us; best FP8:",
                  ", ".join(f"{form} {us:.1f} us ({n * k / us / 1e3:.0f} GB/s, err {errors[form]:.1e})"
                            for us, form in ranked[:5]))
    out = Path(os.environ.get("OUT", "bench/results"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "fp8_gemv_probe.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
