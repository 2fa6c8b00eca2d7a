"""The FP8 projection of many rows (prefill, the vision tower), in two forms the op sets measure against each other:
a tiled Triton matmul that dequantizes each FP8 weight tile in registers and multiplies on the 16-bit tensor cores,
and the matrix dequantized into a transient buffer for cuBLAS. Both compute `x @ dequantized(weight).T` (the weight
scaled per block and rounded to x's dtype, as transformers dequantizes FP8 checkpoints) with float32 accumulation;
activations are not quantized. (A few rows take the skinny matmul instead: `TritonOps.linear`. The torch reference
is `linear_reference`.)
"""

from collections import namedtuple

import torch

from .fp8_qwen3vl_graph import SCALE_COLS
from .triton_qwen3vl_graph import _wait_then_release, launch, tl, triton

Fp8MatmulConfig = namedtuple("Fp8MatmulConfig", "block_m block_n num_warps num_stages")
GROUP_M = 8  # row tiles that take consecutive column tiles, so a wave of programs reuses weight tiles from L2


if triton is not None:

    @triton.jit(do_not_specialize=["rows"])
    def _fp8_matmul_kernel(
        x, weight, scale, bias, out, rows, n_cols, k_len, stride_x, stride_w, stride_s, stride_out,
        SCALE_ROWS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr, GROUP: tl.constexpr, PDL: tl.constexpr,
    ):
        """`out = x @ dequantized(weight).T (+ bias)`: one program per (BLOCK_M rows, BLOCK_N columns) tile, K in
        steps of one scale block (BLOCK_K = 128)."""
        _wait_then_release(PDL)
        tiles_m, tiles_n = tl.cdiv(rows, BLOCK_M), tl.cdiv(n_cols, BLOCK_N)
        program = tl.program_id(0)
        group = program // (GROUP * tiles_n)
        first_m = group * GROUP
        group_size = tl.minimum(tiles_m - first_m, GROUP)
        tile_m = first_m + (program % (GROUP * tiles_n)) % group_size
        tile_n = (program % (GROUP * tiles_n)) // group_size
        row_ids = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
        live_rows, live_cols = row_ids < rows, cols < n_cols
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for start in range(0, k_len, BLOCK_K):
            ks = start + tl.arange(0, BLOCK_K)
            live_k = ks < k_len
            a = tl.load(x + row_ids[:, None] * stride_x + ks[None, :], mask=live_rows[:, None] & live_k[None, :],
                        other=0.0)
            w = tl.load(weight + cols[None, :] * stride_w + ks[:, None], mask=live_k[:, None] & live_cols[None, :],
                        other=0.0)
            s = tl.load(scale + cols // SCALE_ROWS * stride_s + start // BLOCK_K, mask=live_cols, other=0.0)
            acc = tl.dot(a, (w.to(tl.float32) * s[None, :]).to(a.dtype), acc)
        if HAS_BIAS:
            acc += tl.load(bias + cols, mask=live_cols, other=0.0).to(tl.float32)[None, :]
        tl.store(out + row_ids[:, None] * stride_out + cols[None, :], acc.to(out.dtype.element_ty),
                 mask=live_rows[:, None] & live_cols[None, :])


def fp8_matmul_configs(rows: int) -> list:
    """The tilings an FP8 projection of `rows` rows is measured at: 128 x 64 and 128 x 128 tiles (on an H200 the
    fastest of eight tilings for the 2B projections at 256 rows); narrow row tiles for a few rows."""
    if rows <= 64:
        return [Fp8MatmulConfig(max(16, triton.next_power_of_2(rows)), 64, 4, 4)]
    return [Fp8MatmulConfig(128, 64, 4, 4), Fp8MatmulConfig(128, 128, 8, 3)]


def fp8_matmul(x, weight, bias=None, config=None):
    """`x @ dequantized(weight).T (+ bias)` in x's dtype for `x` `(M, K)` (unit stride along K) and an `Fp8Weight`;
    `config` (an Fp8MatmulConfig) overrides the first of `fp8_matmul_configs`."""
    rows, k = x.shape
    n = weight.shape[0]
    config = config or fp8_matmul_configs(rows)[0]
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(rows, config.block_m) * triton.cdiv(n, config.block_n),)
    launch(_fp8_matmul_kernel, grid,
        x, weight.data, weight.scale, out if bias is None else bias, out, rows, n, k, x.stride(0),
        weight.data.stride(0), weight.scale.stride(0), out.stride(0),
        SCALE_ROWS=weight.scale_rows, HAS_BIAS=bias is not None, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        BLOCK_K=SCALE_COLS, GROUP=GROUP_M, num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out


if triton is not None:

    @triton.jit
    def _dequantize_kernel(weight, scale, out, n_cols, k_len, stride_w, stride_s, SCALE_ROWS: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
        _wait_then_release(PDL)
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        ks = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
        keep = (rows[:, None] < n_cols) & (ks[None, :] < k_len)
        w = tl.load(weight + rows[:, None] * stride_w + ks[None, :], mask=keep, other=0.0)
        s = tl.load(scale + rows // SCALE_ROWS * stride_s + tl.program_id(1), mask=rows < n_cols, other=0.0)
        tl.store(out + rows[:, None] * k_len + ks[None, :], (w.to(tl.float32) * s[:, None]).to(out.dtype.element_ty),
                 mask=keep)


def dequantize(weight, dtype) -> torch.Tensor:
    """`weight.dequantize(dtype)` in one launch, into a new (transient) matrix."""
    n, k = weight.shape
    out = torch.empty(n, k, dtype=dtype, device=weight.device)
    launch(_dequantize_kernel, (triton.cdiv(n, 64), triton.cdiv(k, SCALE_COLS)), weight.data, weight.scale, out, n, k,
           weight.data.stride(0), weight.scale.stride(0), SCALE_ROWS=weight.scale_rows, BLOCK_N=64, BLOCK_K=SCALE_COLS)
    return out
