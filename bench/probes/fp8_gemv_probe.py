"""Which FP8 GEMV form reads FP8 weights near the bandwidth bf16 reaches? Every form here writes the float32 partial
products `(splits, rows, n)` of its K ranges and nothing else (the bf16 bar and the package's forms too, through
`skinny_matmul(..., partials=True)`), so they all pay the same around them. Timed as the tuner times candidates, on
the 2B (and 8B) decode shapes at 1 and 8 rows:

- `package dot` / `package fma`: the skinny matmul's FP8 forms (`ops_matmul_qwen3vl_graph.py`; its `tl.dot` form
  meets x in float16) at the rule's tiling and the measured ones (`fp8_dot_configs`);
- `convert`: the `tl.dot` form with the FP8 tile converted straight to bf16 (exact) and the float32 product scaled
  after it, under `tl.range(num_stages=...)` (the package's form before it moved to float16);
- `w8a8-1` / `w8a8-2`: x quantized in the kernel per row and 128-input block to e4m3 and a native FP8 `tl.dot`, so the
  weight loads feed the `tl.dot` directly (pipelined, no conversion per weight). With 1 term this is transformers'
  own FP8Linear numerics; with 2 the residual `x - hi` is quantized too (at 1/16 of the scale) and a second `tl.dot`
  takes it: about bf16's 8 significant bits per element. `tN`: N scale blocks per loop step (bytes per stage).
- `bf16`: the bf16 matrix through the package's bf16 skinny matmul at its measured tilings (the bar to reach).

Each form's output is checked against the float32 product of the dequantized matrix. JSON to $OUT.
Run (H200): python bench/probes/fp8_gemv_probe.py [--shapes 2b 8b] [--forms package convert w8a8]
"""

import argparse

import torch
import triton
import triton.language as tl

import harness
from qwen3vl_static import ops_matmul_qwen3vl_graph as matmul
from qwen3vl_static.fp8_qwen3vl_graph import Fp8Weight
from qwen3vl_static.triton_qwen3vl_graph import _wait_then_release, launch
from qwen3vl_static.tuner_qwen3vl_graph import KernelTuner

SHAPES = {"2b": {"qkv": (4096, 2048), "o_proj": (2048, 2048), "gate_up": (12288, 2048), "down_proj": (2048, 6144)},
          "8b": {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (24576, 4096), "down_proj": (4096, 12288)}}


@triton.jit
def _convert_kernel(x, weight, scale, parts, rows, n_cols, k_len, k_split, stride_x, stride_w, stride_s,
                    BLOCK_N: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr):
    _wait_then_release(PDL)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ids = tl.arange(0, 16)
    k_start = tl.program_id(1) * k_split
    k_end = tl.minimum(k_start + k_split, k_len)
    live = cols < n_cols
    acc = tl.zeros((BLOCK_N, 16), tl.float32)
    for start in tl.range(k_start, k_end, 128, num_stages=STAGES):
        ks = start + tl.arange(0, 128)
        w = tl.load(weight + cols[:, None] * stride_w + ks[None, :], mask=live[:, None] & (ks[None, :] < k_end), other=0.0)
        x_t = tl.load(x + row_ids[None, :] * stride_x + ks[:, None], mask=(row_ids[None, :] < rows) & (ks[:, None] < k_len),
                      other=0.0)
        s = tl.load(scale + cols // 128 * stride_s + start // 128, mask=live, other=0.0)
        acc += tl.dot(w.to(x_t.dtype), x_t) * s[:, None]
    tl.store(parts + (tl.program_id(1) * rows + row_ids[None, :]) * n_cols + cols[:, None], acc,
             mask=live[:, None] & (row_ids[None, :] < rows))


@triton.jit
def _w8a8_block(x, weight, scale, rows, cols, live, row_ids, start, k_len, stride_x, stride_w, stride_s,
                TERMS: tl.constexpr):
    """One 128-input block's float32 products `(BLOCK_N, 16)`: x quantized per row (1 or 2 e4m3 terms)."""
    ks = start + tl.arange(0, 128)
    w = tl.load(weight + cols[:, None] * stride_w + ks[None, :], mask=live[:, None] & (ks[None, :] < k_len), other=0.0)
    x_t = tl.load(x + row_ids[None, :] * stride_x + ks[:, None], mask=(row_ids[None, :] < rows) & (ks[:, None] < k_len),
                  other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x_t), axis=0)
    x_scale = tl.where(amax > 0, amax / 448.0, 1.0)
    hi = (x_t / x_scale[None, :]).to(tl.float8e4nv)
    product = tl.dot(w, hi)
    if TERMS == 2:
        lo = ((x_t - hi.to(tl.float32) * x_scale[None, :]) * (16.0 / x_scale[None, :])).to(tl.float8e4nv)
        product += tl.dot(w, lo) * 0.0625
    s = tl.load(scale + cols // 128 * stride_s + start // 128, mask=live, other=0.0)
    return product * s[:, None] * x_scale[None, :]


@triton.jit
def _w8a8_kernel(x, weight, scale, parts, rows, n_cols, k_len, k_split, stride_x, stride_w, stride_s,
                 BLOCK_N: tl.constexpr, TILES: tl.constexpr, TERMS: tl.constexpr, STAGES: tl.constexpr,
                 PDL: tl.constexpr):
    _wait_then_release(PDL)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ids = tl.arange(0, 16)
    k_start = tl.program_id(1) * k_split
    live = cols < n_cols
    acc = tl.zeros((BLOCK_N, 16), tl.float32)
    for start in tl.range(k_start, k_start + k_split, 128 * TILES, num_stages=STAGES):
        for tile in tl.static_range(TILES):
            acc += _w8a8_block(x, weight, scale, rows, cols, live, row_ids, start + tile * 128, k_len, stride_x,
                               stride_w, stride_s, TERMS)
    tl.store(parts + (tl.program_id(1) * rows + row_ids[None, :]) * n_cols + cols[:, None], acc,
             mask=live[:, None] & (row_ids[None, :] < rows))


def partial_products(kernel_call, rows, n, splits, device):
    parts = torch.empty(splits, rows, n, dtype=torch.float32, device=device)
    kernel_call(parts)
    return parts


def forms(x, weight, rule):
    """name -> call returning float32 partial products of `x @ dequantized(weight).T`, `(splits, rows, n)`."""
    rows, k = x.shape
    n = weight.shape[0]
    data, scale = weight.data, weight.scale
    out = {}

    def splits_of(k_split):
        return triton.cdiv(k, k_split)

    rule_split = triton.cdiv(triton.cdiv(k, rule.split_k), 128) * 128
    for k_split in dict.fromkeys((rule_split, max(128, rule_split // 2), max(256, rule_split // 4))):
        tag = f"split{splits_of(k_split)}"
        for block_n in (64, 128):
            for stages in (3, 4, 6):
                def convert(parts, block_n=block_n, stages=stages, k_split=k_split):
                    launch(_convert_kernel, (triton.cdiv(n, block_n), splits_of(k_split)), x, data, scale, parts, rows,
                           n, k, k_split, x.stride(0), data.stride(0), scale.stride(0), BLOCK_N=block_n, STAGES=stages,
                           num_warps=4)
                out[f"convert n{block_n} {tag} st{stages}"] = (
                    lambda call=convert, k_split=k_split: partial_products(call, rows, n, splits_of(k_split), x.device))
            for terms in (1, 2):
                for tiles, stages in ((1, 4), (1, 6), (1, 8), (2, 3), (2, 4)):
                    if k_split % (128 * tiles):
                        continue

                    def w8a8(parts, block_n=block_n, stages=stages, k_split=k_split, terms=terms, tiles=tiles):
                        launch(_w8a8_kernel, (triton.cdiv(n, block_n), splits_of(k_split)), x, data, scale, parts,
                               rows, n, k, k_split, x.stride(0), data.stride(0), scale.stride(0), BLOCK_N=block_n,
                               TILES=tiles, TERMS=terms, STAGES=stages, num_warps=4)
                    out[f"w8a8-{terms} n{block_n} {tag} t{tiles} st{stages}"] = (
                        lambda call=w8a8, k_split=k_split: partial_products(call, rows, n, splits_of(k_split), x.device))
    configs = {"package dot rule": rule._replace(num_stages=4)}
    for config in matmul.fp8_dot_configs(weight):
        configs[f"package dot n{config.block_n} k{config.block_k} split{config.split_k}"] = config
    for config in matmul.fma_configs(weight, rows):
        preloaded = " preloaded" if config.preload else ""
        configs[f"package fma n{config.block_n} k{config.block_k} w{config.num_warps}{preloaded}"] = config
    for name, config in configs.items():
        out[name] = lambda config=config: matmul.skinny_matmul(x, weight, config, partials=True)
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", choices=SHAPES, default=["2b"], help="model shapes (default 2b)")
    parser.add_argument("--forms", nargs="+", default=["package", "convert", "w8a8"],
                        help="forms whose names start with these (default all)")
    args = parser.parse_args()
    harness.require_cuda()
    device = torch.device("cuda")
    tuner = KernelTuner()
    report = {}
    for rows in (1, 8):
        for model, name, (n, k) in ((model, name, shape) for model in args.shapes for name, shape in SHAPES[model].items()):
            weight = Fp8Weight((torch.randn(n, k, device=device) * 32).to(torch.float8_e4m3fn),
                               torch.rand(n // 128, k // 128, device=device) / 256, 128)
            x = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
            dense = weight.dequantize(torch.bfloat16)
            expected = x.float() @ weight.dequantize(torch.float32).T
            rule = matmul.rule_config(weight)
            calls, errors = {}, {}
            for form, call in forms(x, weight, rule).items():
                if not form.startswith(tuple(args.forms)):
                    continue
                try:
                    errors[form] = ((call().sum(0) - expected).abs().max() / expected.abs().max()).item()
                    calls[form] = call
                except Exception as error:  # noqa: BLE001 - a form that does not compile is reported, not timed
                    print(f"{rows} rows {name}: {form} failed: {error!r:.300}")
            names = list(calls)
            bf16_configs = (rule._replace(num_stages=4), rule._replace(num_stages=6), matmul.preload_config(dense))
            bf16 = [lambda config=config, x=x, dense=dense: matmul.skinny_matmul(x, dense, config, partials=True)
                    for config in bf16_configs if config]
            times = tuner.time_calls([calls[form] for form in names] + bf16)
            bf16_us = min(times[len(names):])
            times = times[:len(names)]
            ranked = sorted(zip(times, names))
            report[f"{rows}x {model} {name}"] = {"bf16_us": bf16_us, "fp8_bytes": n * k,
                                         "forms": {form: {"us": us, "rel_error": errors[form]} for us, form in ranked}}
            print(f"{rows} rows {model} {name}: bf16 {bf16_us:.1f} us; best FP8:",
                  ", ".join(f"{form} {us:.1f} us ({n * k / us / 1e3:.0f} GB/s, err {errors[form]:.1e})"
                            for us, form in ranked[:6]))
    harness.write_json(report)


if __name__ == "__main__":
    main()
