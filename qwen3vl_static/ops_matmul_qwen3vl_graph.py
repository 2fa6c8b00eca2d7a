# Copyright 2026 The qwen3vl-static Authors. All rights reserved.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
"""The step's projections: a skinny Triton matmul for a few rows (with SwiGLU, add-and-RMSNorm or QK-norm/RoPE/KV-write
epilogues, or float32 partial products for the next kernel to sum), its tiling rule, SwiGLU, and the vision MLP's
projection with GELU; the torch references beside them.

The step's matmuls have a few rows, so they are GEMVs bound by reading the weights. Which form runs (cuBLAS, the
skinny matmul at some tiling, an epilogue) is measured per shape on the device (`KernelTuner.measured`).
"""

from collections import namedtuple

import torch
import torch.nn.functional as F

from .fp8_qwen3vl_graph import SCALE_COLS, Fp8Weight
from .ops_norm_qwen3vl_graph import _load_summed, _store_rms_norm
from .ops_rotary_qwen3vl_graph import _head_weights, _norm_rope, _rope_tables
from .triton_qwen3vl_graph import (
    _cache_value,
    _release_then_wait,
    _wait_then_release,
    launch,
    sm_count,
    tl,
    triton,
)

DOT_ROWS = 16  # the fewest rows of x a `tl.dot` takes: fewer are padded to it
SKINNY_ROWS = 64  # the most rows the skinny matmul takes (whether it runs instead of cuBLAS is measured per shape)
FMA_MAX_ROWS = 4  # the most rows the FMA form of an FP8 projection is measured at (`fp8_configs`)

# The skinny matmul's tiling: `block_n` output columns x `block_k` inputs per step, K cut into `split_k` ranges.
# `preload`: each program's whole K range is one tile (`block_k` inputs), loaded before the PDL wait. `fma`: each
# program's whole K range of an FP8 weight is one tile (`block_k` inputs, whole scale blocks), multiplied and added in
# float32 on the CUDA cores row by row of x instead of meeting x in a `tl.dot` (with `preload`, the tile and its scales
# are loaded before the wait).
SkinnyConfig = namedtuple("SkinnyConfig", "block_n block_k split_k num_warps num_stages preload fma",
                          defaults=(False, False))


def linear_reference(x, weight, bias=None):
    """`x @ weight.T (+ bias)`: the step's projections (an `Fp8Weight` dequantized to x's dtype for the call)."""
    if isinstance(weight, Fp8Weight):
        weight, bias = weight.dequantize(x.dtype), None if bias is None else bias.to(x.dtype)
    return F.linear(x, weight, bias)


def silu_mul_reference(gate_up):
    """SwiGLU of the fused gate/up output `(rows, 2 I)`: silu(gate) * up."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def linear_gelu_tanh_reference(x, weight, bias):
    """The vision MLP's first projection and its tanh-approximated GELU (`gelu_pytorch_tanh`)."""
    return F.gelu(linear_reference(x, weight, bias), approximate="tanh")


if triton is not None:

    @triton.jit
    def _swiglu(gate, up):
        """silu(gate) * up in float32, of float32 values already rounded as the projection's output."""
        return gate / (1.0 + tl.exp(-gate)) * up

    @triton.jit
    def _silu_mul_kernel(gate_up, out, n_cols, splits, split_stride, BLOCK: tl.constexpr, PDL: tl.constexpr):
        _wait_then_release(PDL)
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        keep = cols < n_cols
        dtype = out.dtype.element_ty
        gate = _load_summed(gate_up, row * 2 * n_cols + cols, keep, splits, split_stride, dtype, "")
        up = _load_summed(gate_up, row * 2 * n_cols + n_cols + cols, keep, splits, split_stride, dtype, "")
        tl.store(out + row * n_cols + cols, _swiglu(gate, up).to(dtype), mask=keep)

    @triton.jit
    def _float16_columns(x):
        """`x` `(K, ROWS)` in float16, each column scaled by the power of two that puts its largest magnitude in [2^14,
        2^15); returns it and the scales that undo it. Exact for 16-bit values within 2^28 of their column's largest
        (smaller ones weigh less than that in the product), and never past float16's range."""
        x = x.to(tl.float32)
        largest = tl.max(tl.abs(x), axis=0)
        power = (largest.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)  # 2^floor(log2)
        power = tl.maximum(power, 7.888609052210118e-31)  # 2^-100: an all-zero (or tiny) column, no overflow below
        return (x * (16384.0 / power)[None, :]).to(tl.float16), power * (1.0 / 16384.0)

    @triton.jit
    def _mma_inputs(t, LEAD: tl.constexpr):
        """`t` `(LEAD, 128)` with its inputs reordered so that input k' of the result is input
        k6*64 + k2*32 + k1*16 + k5*8 + k4*4 + k3*2 + k0 of `t` (k6..k0 the bits of k'). A Hopper `tl.dot` takes from
        each thread, per row, inputs {2q, 2q+1, 2q+8, 2q+9} of every 16 (q = lane % 4); in this order those are the
        32 consecutive bytes at 32q that the thread loads (`_fp8_mma_tile`). Sums over K do not depend on the order,
        so x's inputs take the same order and the weight tile goes from registers to the tensor cores as loaded."""
        t = tl.permute(tl.reshape(t, (LEAD, 2, 2, 2, 2, 2, 2, 2)), (0, 1, 4, 5, 6, 2, 3, 7))
        return tl.reshape(t, (LEAD, 128))

    @triton.jit
    def _mma_rows(t, BLOCK_N: tl.constexpr, WIDTH: tl.constexpr):
        """`t` `(BLOCK_N, WIDTH)` with its rows in the order the tensor cores hold a tile whose rows were loaded 8 to
        a warp, 32 to the 4 warps and then the next 32 to the same threads: row r5 r4 r3 r2..0 of the result is row
        r3 r5 r4 r2..0 of `t` (bits, per 64 rows; tiles of fewer rows stay as they are). `_physical_rows` undoes it."""
        if BLOCK_N % 64 == 0:
            t = tl.permute(tl.reshape(t, (BLOCK_N // 64, 2, 2, 2, 8, WIDTH)), (0, 2, 3, 1, 4, 5))
            t = tl.reshape(t, (BLOCK_N, WIDTH))
        return t

    @triton.jit
    def _physical_rows(t, BLOCK_N: tl.constexpr, WIDTH: tl.constexpr):
        """The inverse of `_mma_rows`."""
        if BLOCK_N % 64 == 0:
            t = tl.permute(tl.reshape(t, (BLOCK_N // 64, 2, 2, 2, 8, WIDTH)), (0, 3, 1, 2, 4, 5))
            t = tl.reshape(t, (BLOCK_N, WIDTH))
        return t

    @triton.jit
    def _fp8_mma_tile(weight, weight_rows, live_rows, start, k_len, stride_w, BLOCK_N: tl.constexpr):
        """The FP8 tile of `weight_rows` x inputs [start, start + 128) as float16, rows in `_mma_rows` order and
        inputs in `_mma_inputs` order: each half of the 128 inputs is one load (16 bytes a thread, 4 threads a row),
        so each thread holds 32 bytes of a row; reordered, they are what it hands the tensor cores. (On an H200 the
        loaded layout then equals the `tl.dot` operand's: no trip through shared memory.)"""
        half = tl.arange(0, 64)
        pointers = weight + weight_rows[:, None] * stride_w + start + half[None, :]
        low = tl.load(pointers, mask=live_rows[:, None] & (start + half[None, :] < k_len), other=0.0)
        high = tl.load(pointers + 64, mask=live_rows[:, None] & (start + 64 + half[None, :] < k_len), other=0.0)
        tile = tl.reshape(tl.permute(tl.join(low, high), (0, 2, 1)), (BLOCK_N, 128))
        return _mma_inputs(_mma_rows(tile, BLOCK_N, 128), BLOCK_N).to(tl.float16)

    @triton.jit
    def _x_float16_block(x, start, rows, k_len, stride_x, ROWS: tl.constexpr):
        """x's inputs [start, start + 128) for a `tl.dot` with an FP8 tile (`_fp8_mma_tile`): in its input order, each
        row scaled into float16 (`_float16_columns`); returns them and the scales that undo it."""
        row_ids = tl.arange(0, ROWS)
        ks = start + tl.arange(0, 128)
        x_rows = tl.load(x + row_ids[:, None] * stride_x + ks[None, :],
                         mask=(row_ids[:, None] < rows) & (ks[None, :] < k_len), other=0.0)
        return _float16_columns(tl.trans(_mma_inputs(x_rows, ROWS)))

    @triton.jit
    def _block_scales(scale_rows, start, k_len, live_rows):
        """The weight rows' scales of the scale block at input `start`. A block past K (the last range's tail) reads
        the last block's scale, not past the row: its weights are masked to zero, which would not cancel a NaN read
        there."""
        return tl.load(scale_rows + tl.minimum(start, k_len - 1) // 128, mask=live_rows, other=0.0)

    @triton.jit
    def _gemv_tile(x, weight, scale, rows, weight_rows, live_rows, k_len, k_start, k_split, stride_x, stride_w,
                   stride_s, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SCALE_ROWS: tl.constexpr,
                   FMA_ROWS: tl.constexpr, PRELOAD: tl.constexpr, PDL: tl.constexpr):
        """`weight[weight_rows] @ x.T` over K in [k_start, k_start + k_split), float32 `(BLOCK_N, ROWS)`, for at most
        ROWS rows of x (`live_rows` masks the weight rows): each weight tile is read once, coalesced along K, and serves
        every row (the narrow side of a `tl.dot`, padded to ROWS: `padded_rows`). It waits for the previous kernel
        (`_wait_then_release`) first, or (PRELOAD, the FMA form) after its weight loads: no kernel writes weights.

        SCALE_ROWS > 0: `weight` is FP8 with one float32 `scale` per SCALE_ROWS rows x 128 inputs (`Fp8Weight`). In
        the `tl.dot` form a tile is one block column (BLOCK_K 128; with BLOCK_K 256 a program's range is two, both
        loaded before either product): its FP8 values, exact in float16, meet x's columns scaled into float16
        (`_float16_columns`) in a float16 `tl.dot`, and the float32 product is scaled per weight row and x row. (FP8
        to float16 takes one instruction per two values on an H200, to bfloat16 four.) The tile's rows and inputs,
        and x's inputs, are reordered in registers (`_fp8_mma_tile`) so that it reaches the tensor cores as loaded: on
        an H200 8B gate/up at 8 rows took 37.4 µs against 40.4 through shared memory (the fastest tiling of each).
        FMA_ROWS > 0 (at least `rows`): the whole range is one tile of whole scale blocks, all its loads in flight at
        once; its FP8 values (exact in float32) are multiplied and added with each row of x on the CUDA cores, each
        block's sums scaled. PRELOAD loads the tile before the wait: alone on an H200 at 1 row 0.3-1.2 µs faster per
        projection (8B down_proj 19.2 against 20.4 µs), while in the step its loads also slow the kernels it overlaps
        (attention, under o_proj's), so the tuner times both in the step."""
        row_ids = tl.arange(0, ROWS)
        acc = tl.zeros((BLOCK_N, ROWS), tl.float32)
        if FMA_ROWS:
            # The whole range in one load (each warp reads along a row), its scale blocks by reshaping: on an H200 8B
            # gate/up at 1 row took 31.7 µs against 37.6 with one load per scale block.
            if not PRELOAD:
                _wait_then_release(PDL)
            ks = k_start + tl.arange(0, BLOCK_K)
            w = tl.load(weight + weight_rows[:, None] * stride_w + ks[None, :],
                        mask=live_rows[:, None] & (ks[None, :] < k_len), other=0.0)
            # A block past K (the last range's) reads the last scale, and rows past `rows` the last row: their weights
            # are masked to zero, their columns never stored.
            block_cols = tl.minimum(k_start // 128 + tl.arange(0, BLOCK_K // 128), (k_len - 1) // 128)
            s = tl.load(scale + (weight_rows // SCALE_ROWS * stride_s)[:, None] + block_cols[None, :],
                        mask=live_rows[:, None], other=0.0)
            if PRELOAD:
                _wait_then_release(PDL)
            w = w.to(tl.float32)
            for row in tl.static_range(FMA_ROWS):
                x_row = tl.load(x + tl.minimum(row, rows - 1) * stride_x + ks, mask=ks < k_len, other=0.0)
                products = tl.reshape(w * x_row.to(tl.float32)[None, :], (BLOCK_N, BLOCK_K // 128, 128))
                part = tl.sum(tl.sum(products, axis=2) * s, axis=1)
                acc = tl.where(row_ids[None, :] == row, acc + part[:, None], acc)
        elif SCALE_ROWS:
            # The rows (and their scales) in the tensor cores' order.
            mma_scale_rows = tl.reshape(_mma_rows(tl.reshape(weight_rows // SCALE_ROWS, (BLOCK_N, 1)), BLOCK_N, 1),
                                        (BLOCK_N,))
            mma_live_rows = tl.reshape(_mma_rows(tl.reshape(live_rows, (BLOCK_N, 1)), BLOCK_N, 1), (BLOCK_N,))
            scale_rows = scale + mma_scale_rows * stride_s
            _wait_then_release(PDL)
            if BLOCK_K == 2 * 128:
                # The range's two scale blocks loaded before either product, both tiles in flight at once. Named, not
                # looped: ptxas does not move a later block's loads above an earlier block's `tl.dot`.
                w0 = _fp8_mma_tile(weight, weight_rows, live_rows, k_start, k_len, stride_w, BLOCK_N)
                w1 = _fp8_mma_tile(weight, weight_rows, live_rows, k_start + 128, k_len, stride_w, BLOCK_N)
                s0 = _block_scales(scale_rows, k_start, k_len, mma_live_rows)
                s1 = _block_scales(scale_rows, k_start + 128, k_len, mma_live_rows)
                x16, x_scale = _x_float16_block(x, k_start, rows, k_len, stride_x, ROWS)
                acc += tl.dot(w0, x16) * (s0[:, None] * x_scale[None, :])
                x16, x_scale = _x_float16_block(x, k_start + 128, rows, k_len, stride_x, ROWS)
                acc += tl.dot(w1, x16) * (s1[:, None] * x_scale[None, :])
            else:
                # Ranges start at multiples of BLOCK_K and the mask compares with K itself, so weight loads stay
                # vectorized.
                for start in range(k_start, k_start + k_split, BLOCK_K):
                    x16, x_scale = _x_float16_block(x, start, rows, k_len, stride_x, ROWS)
                    s = _block_scales(scale_rows, start, k_len, mma_live_rows)
                    w = _fp8_mma_tile(weight, weight_rows, live_rows, start, k_len, stride_w, BLOCK_N)
                    acc += tl.dot(w, x16) * (s[:, None] * x_scale[None, :])
            acc = _physical_rows(acc, BLOCK_N, ROWS)
        else:
            _wait_then_release(PDL)
            for start in range(k_start, k_start + k_split, BLOCK_K):
                ks = start + tl.arange(0, BLOCK_K)
                w = tl.load(weight + weight_rows[:, None] * stride_w + ks[None, :],
                            mask=live_rows[:, None] & (ks[None, :] < k_len), other=0.0)
                x_t = tl.load(x + row_ids[None, :] * stride_x + ks[:, None],
                              mask=(row_ids[None, :] < rows) & (ks[:, None] < k_len), other=0.0)
                acc = tl.dot(w, x_t, acc)
        return acc

    @triton.jit
    def _store_tile(y, out, rows, n_cols, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, SWIGLU: tl.constexpr):
        """This program's finished tile, `y` float32 `(BLOCK_N, ROWS)` rounded as the projection's output, to `out`
        `(rows, n_cols)`: y itself, or SWIGLU (gate rows, then up rows) silu(gate) * up for BLOCK_N / 2 columns."""
        row_ids = tl.arange(0, ROWS)
        if SWIGLU:
            gate, up = tl.split(tl.permute(tl.reshape(y, (2, BLOCK_N // 2, ROWS)), (1, 2, 0)))
            y = _swiglu(gate, up)
            cols = tl.program_id(0) * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        else:
            cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        tl.store(out + row_ids[None, :] * n_cols + cols[:, None], y.to(out.dtype.element_ty),
                 mask=(cols[:, None] < n_cols) & (row_ids[None, :] < rows))

    @triton.jit(do_not_specialize=["rows", "splits"])  # one compiled variant for every row count (Triton would single out 1)
    def _skinny_matmul_kernel(
        x, weight, scale, parts, out, rows, n_cols, k_len, k_split, stride_x, stride_w, stride_s,
        hidden, norm_weight, sum_out, eps, ticket, splits,
        ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SCALE_ROWS: tl.constexpr,
        FMA_ROWS: tl.constexpr, SWIGLU: tl.constexpr, PARTIALS: tl.constexpr, SUM_SPLITS: tl.constexpr,
        ADD_RMS_NORM: tl.constexpr, BLOCK_ROW: tl.constexpr, PRELOAD: tl.constexpr, PDL: tl.constexpr,
    ):
        """`x @ weight.T` for at most ROWS rows: one program per (BLOCK_N columns, K range), `_gemv_tile`. It stores y
        to `out`; PARTIALS, its K range's float32 partial to `parts` `(splits, rows, weight rows)` instead.

        SUM_SPLITS (K split): each program stores its partial and the last of a column tile's programs to finish (a
        ticket per column tile counts them) sums the tile's partials in split order and finishes it (y, or SwiGLU):
        the split costs no launch of its own to sum them.

        SWIGLU: `weight` is the fused gate/up matrix `(2 n_cols, K)`; each program's tile is BLOCK_N / 2 gate rows and
        the up rows of the same columns, one `tl.dot` as wide as a plain projection's, and it stores silu(gate) * up
        for those BLOCK_N / 2 columns, rounded as the separate ops round.

        ADD_RMS_NORM (with PARTIALS): the last program to finish (a ticket counts them) sums the partials, rounds y,
        adds it to `hidden` (the residual stream) and stores the sum to `sum_out` and its RMSNorm to `out`, rounded as
        the separate ops round: the residual add and the norm after a projection cost no launch of their own.

        PRELOAD: the program's whole K range (BLOCK_K == k_split) is one weight tile, loaded before the PDL wait (and,
        16-bit, staged in shared memory for the `tl.dot`, also before it, as compiled for sm90; FP8, the FMA form's
        tile, `_gemv_tile`): weights never depend on an earlier kernel, so they stream in while earlier kernels run.
        The merge releases o_proj before its own wait (`_release_then_wait`), so o_proj's programs load during
        attention and the merge.

        PDL: see `_wait_then_release`. (Slower on an H200 for the pipelined 16-bit tiles: asking L2 for the first
        weights before the wait, loading the first weight tile before the wait, and releasing the next kernel only
        after the loop's loads.)"""
        split = tl.program_id(1)
        row_ids = tl.arange(0, ROWS)
        tile_rows = tl.arange(0, BLOCK_N)
        if SWIGLU:  # gate rows, then the up rows of the same columns
            cols = tl.program_id(0) * (BLOCK_N // 2) + tile_rows % (BLOCK_N // 2)
            weight_rows = cols + tile_rows // (BLOCK_N // 2) * n_cols
        else:
            cols = tl.program_id(0) * BLOCK_N + tile_rows
            weight_rows = cols
        if PRELOAD and not FMA_ROWS:
            ks = split * k_split + tl.arange(0, BLOCK_K)
            tile = tl.load(weight + weight_rows[:, None] * stride_w + ks[None, :],
                           mask=(cols[:, None] < n_cols) & (ks[None, :] < k_len), other=0.0)
            _release_then_wait(PDL)
            acc = tl.dot(tile, tl.load(x + row_ids[None, :] * stride_x + ks[:, None],
                                       mask=(row_ids[None, :] < rows) & (ks[:, None] < k_len), other=0.0))
        else:
            acc = _gemv_tile(x, weight, scale, rows, weight_rows, cols < n_cols, k_len, split * k_split, k_split,
                             stride_x, stride_w, stride_s, ROWS, BLOCK_N, BLOCK_K, SCALE_ROWS, FMA_ROWS, PRELOAD, PDL)
        width = 2 * n_cols if SWIGLU else n_cols
        live = (cols[:, None] < n_cols) & (row_ids[None, :] < rows)
        if PARTIALS or SUM_SPLITS:
            tl.store(parts + (split * rows + row_ids[None, :]) * width + weight_rows[:, None], acc, mask=live)
        if SUM_SPLITS:
            # The barrier puts all of this program's stores before the ticket's release; the ticket's acquire puts
            # the tile's other programs' stores before the last one's reads (which bypass L1).
            tl.debug_barrier()
            if tl.atomic_add(ticket + tl.program_id(0), 1, sem="acq_rel") == splits - 1:
                y = _load_summed(parts, row_ids[None, :] * width + weight_rows[:, None], live, splits, rows * width,
                                 out.dtype.element_ty, ".cg")
                _store_tile(y, out, rows, n_cols, ROWS, BLOCK_N, SWIGLU)
                tl.store(ticket + tl.program_id(0), 0)  # ready for the next launch
        elif not PARTIALS:
            _store_tile(acc.to(out.dtype.element_ty).to(tl.float32), out, rows, n_cols, ROWS, BLOCK_N, SWIGLU)
        if ADD_RMS_NORM:
            # The barrier puts all of this program's stores before the ticket's release; the ticket's acquire puts
            # every other program's stores before the last program's reads (which bypass L1).
            tl.debug_barrier()
            if tl.atomic_add(ticket, 1, sem="acq_rel") == tl.num_programs(0) * tl.num_programs(1) - 1:
                row_cols = tl.arange(0, BLOCK_ROW)
                row_keep = row_cols < n_cols
                w = tl.load(norm_weight + row_cols, mask=row_keep, other=0.0).to(tl.float32)
                for row in range(rows):
                    h = tl.load(hidden + row * n_cols + row_cols, mask=row_keep, other=0.0)
                    # y rounded as the projection's output, the sum as `hidden + y`.
                    y = _load_summed(parts, row * n_cols + row_cols, row_keep, splits, rows * n_cols, h.dtype, ".cg")
                    h = (h.to(tl.float32) + y).to(h.dtype)
                    tl.store(sum_out + row * n_cols + row_cols, h, mask=row_keep)
                    _store_rms_norm(h, row_cols, row_keep, w, out + row * n_cols, n_cols, eps)
                tl.store(ticket, 0)  # ready for the next launch

    @triton.jit(do_not_specialize=["rows", "splits"])
    def _qkv_norm_rope_write_kernel(
        x, weight, scale, parts, rows, k_len, k_split, stride_x, stride_w, stride_s, splits, q_weight, k_weight, cos, sin,
        eps, q_out, keys, values, cache_rows, cache_slots, stride_cache_row, stride_cache_head, stride_cache_slot, tickets,
        ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SCALE_ROWS: tl.constexpr,
        FMA_ROWS: tl.constexpr, PRELOAD: tl.constexpr, HEADS: tl.constexpr,
        KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, NORM: tl.constexpr, PDL: tl.constexpr,
    ):
        """The fused QKV projection of a few rows then `qk_norm_rope_write` (QK-norm with NORM), in one launch: programs as the skinny
        matmul's store float32 partials; the last program of each head (a ticket per head counts them) sums them,
        rounds them as the projection's output, norms and rotates q and k, and stores q to `q_out` `(rows, HEADS,
        D)` and k and v into the cache (row `cache_rows[r]`, slot `cache_slots[r]`)."""
        n_cols = (HEADS + 2 * KV_HEADS) * HEAD_DIM
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        split = tl.program_id(1)
        acc = _gemv_tile(x, weight, scale, rows, cols, cols < n_cols, k_len, split * k_split, k_split, stride_x, stride_w,
                         stride_s, ROWS, BLOCK_N, BLOCK_K, SCALE_ROWS, FMA_ROWS, PRELOAD, PDL)
        row_ids = tl.arange(0, ROWS)
        tl.store(parts + (split * rows + row_ids[None, :]) * n_cols + cols[:, None], acc, mask=row_ids[None, :] < rows)
        head = tl.program_id(0) * BLOCK_N // HEAD_DIM
        # The barrier puts this program's stores before the ticket's release; the ticket's acquire puts every other
        # program's stores before the last program's reads (which bypass L1).
        tl.debug_barrier()
        if tl.atomic_add(tickets + head, 1, sem="acq_rel") == HEAD_DIM // BLOCK_N * splits - 1:
            row = tl.arange(0, ROWS)[:, None]
            dims = tl.arange(0, HEAD_DIM)[None, :]
            keep = row < rows
            dtype = q_out.dtype.element_ty
            base = parts + row * n_cols + head * HEAD_DIM
            y = _load_summed(base, dims, keep, splits, rows * n_cols, dtype, ".cg")
            y_rolled = _load_summed(base, (dims + HEAD_DIM // 2) % HEAD_DIM, keep, splits, rows * n_cols, dtype, ".cg")
            if head < HEADS + KV_HEADS:  # q or k: normed and rotated
                weights = _head_weights(tl.where(head < HEADS, q_weight, k_weight), HEAD_DIM)
                table = tl.minimum(row, rows - 1) * HEAD_DIM  # padding rows read a real row's table
                y = _norm_rope(y, y_rolled, weights, _rope_tables(cos + table, sin + table, HEAD_DIM), eps, HEAD_DIM,
                               NORM)
            y = y.to(dtype)
            if head < HEADS:
                tl.store(q_out + (row * HEADS + head) * HEAD_DIM + dims, y, mask=keep)
            else:
                kv_head = (head - HEADS) % KV_HEADS
                slot = (tl.load(cache_rows + row, mask=keep, other=0) * stride_cache_row + kv_head * stride_cache_head
                        + tl.load(cache_slots + row, mask=keep, other=0) * stride_cache_slot + dims)
                cache = tl.where(head < HEADS + KV_HEADS, keys, values)
                tl.store(cache + slot, _cache_value(y, cache), mask=keep)
            tl.store(tickets + head, 0)  # ready for the next launch


def skinny(x, weight) -> bool:
    """Whether the skinny matmul takes these operands: at most SKINNY_ROWS rows, unit stride along K."""
    return x.dim() == 2 and x.shape[0] <= SKINNY_ROWS and x.stride(1) == 1 and weight.stride(1) == 1


def matmul_shape(x, weight) -> str:
    """A measured choice's shape description: rows x K -> N, dtype (and the weight's, where it differs)."""
    dtypes = [str(x.dtype).removeprefix("torch.")] + (["fp8 blocks"] if isinstance(weight, Fp8Weight) else [])
    return f"{x.shape[0]}x{weight.shape[1]}->{weight.shape[0]} {' x '.join(dtypes)}"


def weight_operands(weight) -> tuple:
    """A weight as the kernels take it: (matrix, scales, scales' row stride, SCALE_ROWS); SCALE_ROWS is 0 for a 16-bit
    matrix (the scale arguments are then unused)."""
    if isinstance(weight, Fp8Weight):
        return weight.data, weight.scale, weight.scale.stride(0), weight.scale_rows
    return weight, weight, 0, 0


def check_fp8_tiling(weight, config, k_split) -> None:
    if not isinstance(weight, Fp8Weight):
        if config.fma:
            raise ValueError("the FMA form multiplies FP8 tiles: it takes an Fp8Weight")
        return
    if config.fma and (config.block_k % SCALE_COLS or k_split != config.block_k):
        raise ValueError(f"the FMA form's tile is a program's whole K range of whole {SCALE_COLS}-input scale blocks: "
                         f"block_k {config.block_k} must be {k_split} and a multiple of {SCALE_COLS}")
    if config.preload and not config.fma:
        raise ValueError("an FP8 weight's tiles are preloaded in the FMA form only")
    if not config.fma and config.block_k == 2 * SCALE_COLS and k_split != config.block_k:
        raise ValueError(f"an FP8 `tl.dot` tile of two scale blocks is a program's whole K range: block_k must be "
                         f"{k_split}")
    if not config.fma and config.block_k not in (SCALE_COLS, 2 * SCALE_COLS):
        raise ValueError(f"an FP8 weight's `tl.dot` tiles are one scale block ({SCALE_COLS} inputs) or a program's "
                         f"whole K range of two: block_k {config.block_k} is neither")


def fma_configs(weight, rows) -> list:
    """The FMA form's tilings an FP8 projection of `rows` rows is measured at, K cut into ranges of the tile's width:
    16 columns x 512 inputs, 8 x 1024 and 4 x 2048 on 4 warps, each loaded after the PDL wait and before it
    (`preload`). On an H200 at 1 row one of these was the fastest, or within 0.2 µs of it, at every 2B and 8B shape
    (`fp8_gemv_probe.py`; 16 x 256 and 16 x 1024 on 8 warps never gained more). None above FMA_MAX_ROWS rows
    (`fp8_configs`)."""
    if rows > FMA_MAX_ROWS:
        return []
    return [SkinnyConfig(block_n, width, triton.cdiv(weight.shape[1], width), num_warps=4, num_stages=1,
                         preload=preload, fma=True)
            for block_n, width in ((16, 512), (8, 1024), (4, 2048)) if width <= triton.next_power_of_2(weight.shape[1])
            for preload in (False, True)]


def fp8_configs(weight, rows) -> list:
    """The FP8 tilings a projection of `rows` rows is measured at besides the rule's: `fp8_dot_configs` from 2 rows,
    `fma_configs` up to FMA_MAX_ROWS. In the benchmark's warmup on an H200 (2B and 8B) every 1-row projection ran 16% or
    more slower at those `tl.dot` tilings than at the fastest FMA one, and from 8 rows the FMA form ran 23% or more
    slower than the fastest; at 4 rows each form won some (2B o_proj: the FMA form). Offering each only where it can
    win leaves a quarter fewer kernels to compile (the FMA form compiles once per power of two of rows: it unrolls its
    loop over them)."""
    return (fp8_dot_configs(weight) if rows > 1 else []) + fma_configs(weight, rows)


def fp8_dot_configs(weight) -> list:
    """The `tl.dot` form's tilings an FP8 projection is measured at besides the rule's: K ranges of 2, 4 and 8 scale
    blocks, tiles of 64 or 128 rows, without pipeline stages. An FP8 tile holds half a 16-bit tile's bytes, so more
    programs keep loads in flight (on an H200 1.3-1.6x faster than the rule's split, 2B shapes, 8 rows). Without
    stages the tile goes from registers to the tensor cores as loaded (`_fp8_mma_tile`; staged, it would pass through
    shared memory); a 128-row tile takes x (scaled, through shared memory) once per 128 weight rows instead of 64. At
    8 rows on an H200 128-row tiles were the fastest for gate/up and down_proj (2B and 8B; 8B gate/up 36.5 µs against
    37.5) and the 8B QKV, 64-row tiles for o_proj and the 2B QKV (`fp8_gemv_probe.py`). Also ranges of 2 blocks
    whose tiles both load before either product (`block_k` 256): at 8 rows on an H200 the 2B QKV (9.6 µs against
    10.1) and o_proj (9.1 against 9.4) ran faster so, the 8B projections and every 1-row one slower."""
    k = weight.shape[1]
    splits = dict.fromkeys(triton.cdiv(k, blocks * SCALE_COLS) for blocks in (2, 4, 8))
    return ([SkinnyConfig(block_n, SCALE_COLS, split, num_warps=4, num_stages=1)
             for split in splits for block_n in (64, 128)]
            + [SkinnyConfig(block_n, 2 * SCALE_COLS, triton.cdiv(k, 2 * SCALE_COLS), num_warps=4, num_stages=1)
               for block_n in (64, 128)])


def padded_rows(rows) -> int:
    """The rows of x that the skinny matmul's `tl.dot` computes: at least DOT_ROWS, a power of two (few compiled
    variants); the padding rows are masked."""
    return max(DOT_ROWS, triton.next_power_of_2(rows))


def fma_rows(config, rows) -> int:
    """The FMA form's unrolled row count (a power of two, so few variants compile), or 0 for the `tl.dot` form."""
    return triton.next_power_of_2(rows) if config.fma else 0


def skinny_config(n, k, sms, block_n=64, block_k=128) -> SkinnyConfig:
    """The skinny matmul's tiling for an (N, K) weight on `sms` SMs: one rule, so few compiled variants.

    A GEMV is as fast as the weight bytes it keeps in flight. Each program streams `block_n` x `block_k` tiles
    through a 4-stage pipeline; a matrix with fewer column tiles than SMs also splits K (doubling, while each
    range keeps at least two K steps and there is at most one program per SM), its float32 partials summed by the
    last program of each column tile. On an H200, up to two programs per SM split too far: in chains of 28 calls under
    PDL, o_proj takes 5.0 µs at one per SM against 5.9, down_proj 8.9 against 9.7, the QKV projection 6.6 against 6.9.
    """
    tiles, split = triton.cdiv(n, block_n), 1
    while 2 * tiles * split <= sms and k >= 4 * split * block_k:
        split *= 2
    return SkinnyConfig(block_n, block_k, split, num_warps=4, num_stages=4)


def rule_config(weight) -> SkinnyConfig:
    """`skinny_config`'s rule for `weight` on its device."""
    return skinny_config(*weight.shape, sm_count(weight.device))


def stage_configs(rule, weight=None, rows=1) -> tuple:
    """A skinny matmul tiling with a 4- and a 6-stage pipeline: the tilings a projection of `rows` rows is measured at
    (for an `Fp8Weight`, `fp8_configs` too)."""
    stages = rule._replace(num_stages=4), rule._replace(num_stages=6)
    if isinstance(weight, Fp8Weight):
        return stages + tuple(fp8_configs(weight, rows))
    return stages


def preload_config(weight, rows=1, block_n=64, tile_bytes=64 * 1024):
    """A preloaded tiling for `weight` on its device (see `_skinny_matmul_kernel`) and `rows` rows of x: `block_n` x
    (K range) tiles of `tile_bytes` (staged in shared memory: two programs fit an SM), or None where they would take
    more than two programs per SM (then some would load after the wait anyway), or where x has more than DOT_ROWS
    rows (its tile, loaded after the wait, as large as the weight's at 64 rows)."""
    if isinstance(weight, Fp8Weight) or rows > DOT_ROWS:  # FP8: a tile spans one scale block, K steps of 128
        return None
    n, k = weight.shape
    block_k = tile_bytes // (block_n * weight.element_size())
    split = triton.cdiv(k, block_k)
    if triton.cdiv(n, block_n) * split > 2 * sm_count(weight.device):
        return None
    return SkinnyConfig(block_n, block_k, split, num_warps=8, num_stages=1, preload=True)


def split_configs(weight, rows=1) -> list:
    """The skinny matmul's rule for `weight` on its device, and the same with half the K split: the tilings a
    fused epilogue of `rows` rows is measured at (for an `Fp8Weight`, `fp8_configs` too)."""
    rule = rule_config(weight)
    configs = list(dict.fromkeys([rule, rule._replace(split_k=max(1, rule.split_k // 2))]))
    if isinstance(weight, Fp8Weight):
        return configs + fp8_configs(weight, rows)
    return configs


def skinny_matmul(x, weight, config=None, swiglu=False, add_rms_norm=None, partials=False, ticket=None):
    """`x @ weight.T` in x's dtype (float32 accumulation) for `x` (M <= SKINNY_ROWS, K), `weight` (N, K), both
    unit-stride along K (or an `Fp8Weight`); `config` (a SkinnyConfig) overrides the rule. `swiglu`: `weight` is a fused gate/up
    matrix and the result is SwiGLU of the product, `(M, N / 2)` (`config.block_n` counts a tile's weight rows,
    half of them gate rows). `add_rms_norm`: (hidden, norm weight, eps); returns `add_rms_norm(hidden, x @
    weight.T, ...)` instead, from the same launch, whose last program `ticket` (a counter at zero, left at zero)
    finds. `partials`: returns the K ranges' float32 partial products `(splits, M, N)` unsummed, for the next kernel
    to sum as it loads them (`add_rms_norm`, `qk_norm_rope_write`). Otherwise a split K is summed in the same launch,
    by the last program of each column tile: `ticket` then holds a counter (at zero, left at zero) per column tile."""
    rows, k = x.shape
    n = weight.shape[0] // 2 if swiglu else weight.shape[0]
    if config is None:
        config = rule_config(weight)
    k_split = triton.cdiv(triton.cdiv(k, config.split_k), config.block_k) * config.block_k
    splits = triton.cdiv(k, k_split)
    if config.preload and not config.fma and (swiglu or k_split != config.block_k):
        raise ValueError(f"a preloaded tile spans a program's whole K range: block_k must be {k_split}, "
                         "without SwiGLU")
    check_fp8_tiling(weight, config, k_split)
    fused_norm = add_rms_norm is not None
    if swiglu and (fused_norm or partials):
        raise ValueError("the SwiGLU epilogue returns the activation, not partial products or a norm")
    partials = partials or fused_norm
    sum_splits = splits > 1 and not partials
    tiles = triton.cdiv(n, config.block_n // 2 if swiglu else config.block_n)
    counters = tiles if sum_splits else 1 if fused_norm else 0
    if counters and (ticket is None or ticket.numel() < counters):
        raise ValueError(f"this launch needs a ticket of {counters} counters (finished programs), at zero")
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    parts = (torch.empty(splits, rows, weight.shape[0], dtype=torch.float32, device=x.device)
             if partials or sum_splits else out)
    hidden, norm_weight, eps = add_rms_norm if fused_norm else (out, out, 0.0)
    sums = torch.empty_like(hidden) if fused_norm else out
    matrix, scale, stride_s, scale_rows = weight_operands(weight)
    launch(_skinny_matmul_kernel, (tiles, splits),
        x, matrix, scale, parts, out, rows, n, k, k_split, x.stride(0), matrix.stride(0), stride_s,
        hidden, norm_weight, sums, eps, ticket if counters else out, splits,
        ROWS=padded_rows(rows), BLOCK_N=config.block_n, BLOCK_K=config.block_k, SCALE_ROWS=scale_rows,
        FMA_ROWS=fma_rows(config, rows), SWIGLU=swiglu, PARTIALS=partials, SUM_SPLITS=sum_splits,
        ADD_RMS_NORM=fused_norm, BLOCK_ROW=triton.next_power_of_2(n), PRELOAD=config.preload,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    if fused_norm:
        return sums, out
    return parts if partials else out


def fused_qkv(x, qkv_weight, heads, qk_norms, rotary, keys, values, cache_rows, cache_slots, config, tickets):
    """The QKV projection then `qk_norm_rope_write` in one launch, tiled by `config` (column tiles no wider than a
    head); `tickets`: a counter per head (Hq + 2 Hkv), at zero and left at zero. Returns q `(rows, Hq, D)`."""
    rows, k = x.shape
    n, (kv_heads, head_dim) = qkv_weight.shape[0], keys.shape[1::2]
    block_n = min(config.block_n, head_dim)
    k_split = triton.cdiv(triton.cdiv(k, config.split_k), config.block_k) * config.block_k
    check_fp8_tiling(qkv_weight, config, k_split)
    splits = triton.cdiv(k, k_split)
    parts = torch.empty(splits, rows, n, dtype=torch.float32, device=x.device)
    q = torch.empty(rows, heads, head_dim, dtype=x.dtype, device=x.device)
    (q_weight, k_weight, eps), (cos, sin) = qk_norms, rotary
    norm = q_weight is not None  # else no QK-norm: any valid pointer stands in for the weights
    q_weight, k_weight = (q_weight, k_weight) if norm else (cos, cos)
    matrix, scale, stride_s, scale_rows = weight_operands(qkv_weight)
    launch(_qkv_norm_rope_write_kernel, (n // block_n, splits),
        x, matrix, scale, parts, rows, k, k_split, x.stride(0), matrix.stride(0), stride_s, splits, q_weight, k_weight,
        cos, sin, eps, q, keys, values, cache_rows, cache_slots, keys.stride(0), keys.stride(1), keys.stride(2),
        tickets, ROWS=padded_rows(rows), BLOCK_N=block_n, BLOCK_K=config.block_k, SCALE_ROWS=scale_rows,
        FMA_ROWS=fma_rows(config, rows), PRELOAD=config.preload,
        HEADS=heads, KV_HEADS=kv_heads, HEAD_DIM=head_dim, NORM=norm, num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return q


def silu_mul(gate_up, dtype=None):
    """`silu_mul_reference` in one launch. `gate_up` may also be a split-K skinny matmul's float32 partial products
    `(splits, rows, 2 I)`: summed as they load and rounded to `dtype` as the projection rounds its output, so the
    split projection costs no launch of its own to sum them."""
    parts = gate_up if gate_up.dim() == 3 else gate_up[None]
    splits, rows, width = parts.shape[0], parts.shape[1], parts.shape[2] // 2
    out = torch.empty(rows, width, dtype=dtype or gate_up.dtype, device=gate_up.device)
    block = 1024
    launch(_silu_mul_kernel, (rows, triton.cdiv(width, block)), parts, out, width, splits, rows * 2 * width,
           BLOCK=block)
    return out


def linear_gelu_tanh(x, weight, bias):
    """`linear_gelu_tanh_reference`; on CUDA, cuBLASLt's GELU epilogue (the tanh form) on the float32 result: no
    separate activation pass. (The CPU kernel of this op uses the exact erf GELU, hence CUDA only.)"""
    if x.is_cuda and x.dim() == 2:
        return torch._addmm_activation(bias, x, weight.t(), use_gelu=True)
    return linear_gelu_tanh_reference(x, weight, bias)
