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
"""RMSNorm (alone, after a residual add, after an embedding gather) and the vision blocks' add-and-LayerNorm: the
torch references and the fused Triton kernels, one launch each.

At small batch a decode step is launch-bound: the stock RMSNorm alone is eight kernels and runs four times per layer.
The add-and-norm kernel also sums a split-K projection's float32 partial products as it loads them, so the
projection before it needs no launch of its own to sum them.
"""

import torch
import torch.nn.functional as F

from .triton_qwen3vl_graph import _wait_then_release, launch, tl, triton


def rms_norm_reference(x, weight, eps, out=None):
    """Stock `Qwen3VLTextRMSNorm` (float32 statistics) as one kernel; the scale is applied before rounding. `out`: where
    to write it (rows may be strided: a column range of a wider buffer), or None."""
    normed = F.rms_norm(x, (x.shape[-1],), weight, eps)
    return normed if out is None else out.copy_(normed)


def embed_rms_norm_reference(ids, table, weight, eps, out=None):
    """The embeddings of token `ids` `(rows,)` (rows of `table`), then their RMSNorm (written to `out` as
    `rms_norm_reference` does): returns (embeddings, normed)."""
    hidden = F.embedding(ids, table)
    return hidden, rms_norm_reference(hidden, weight, eps, out)


def add_rms_norm_reference(hidden, delta, weight, eps):
    """Residual add, then RMSNorm of the sum: returns (sum, normed sum)."""
    hidden = hidden + delta
    return hidden, rms_norm_reference(hidden, weight, eps)


def add_layer_norm_reference(hidden, delta, weight, bias, eps):
    """The vision blocks' residual add, then LayerNorm of the sum: returns (sum, normed sum)."""
    hidden = hidden + delta
    return hidden, F.layer_norm(hidden, (hidden.shape[-1],), weight, bias, eps)


if triton is not None:

    @triton.jit
    def _store_rms_norm(x, cols, keep, w, out, n_cols, eps):
        """RMSNorm of one row `x` by the norm's weights `w` (float32 statistics, the scale applied before rounding),
        stored at `out`. Callers load `w` early: a load after the sum's reduction would wait for it."""
        x = x.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)
        tl.store(out + cols, (x * rstd * w).to(out.dtype.element_ty), mask=keep)

    @triton.jit
    def _load_summed(source, offsets, keep, splits, split_stride, dtype, CACHE: tl.constexpr):
        """A projection's output at `source + offsets` from its `splits` float32 partial products (a split-K skinny
        matmul's, `split_stride` apart; or the output itself, splits == 1), rounded to `dtype` as the projection
        rounds it; returned in float32. So the kernel after a split-K matmul sums its partials as it loads them, and
        a matmul's last program sums the others' (CACHE ".cg": past L1, which may hold stale lines of them)."""
        total = tl.load(source + offsets, mask=keep, other=0.0, cache_modifier=CACHE).to(tl.float32)
        for split in range(1, splits):
            total += tl.load(source + split * split_stride + offsets, mask=keep, other=0.0, cache_modifier=CACHE)
        return total.to(dtype).to(tl.float32)

    @triton.jit
    def _add_rms_norm_kernel(hidden, delta, weight, sum_out, norm_out, stride_norm_out, n_cols, eps, splits,
                             split_stride, ids, HAS_DELTA: tl.constexpr, GATHER: tl.constexpr, BLOCK: tl.constexpr,
                             PDL: tl.constexpr):
        """RMSNorm of each row of `hidden` (HAS_DELTA: of `hidden + delta`, the sum stored to `sum_out`); GATHER: of row
        `ids[row]` of `hidden` (an embedding table), the gathered row stored to `sum_out`."""
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        keep = cols < n_cols
        # Norm weights never change during a step, so they load before the PDL wait, during the previous kernel.
        w = tl.load(weight + cols, mask=keep, other=0.0).to(tl.float32)
        _wait_then_release(PDL)
        if GATHER:
            x = tl.load(hidden + tl.load(ids + row) * n_cols + cols, mask=keep, other=0.0)
            tl.store(sum_out + row * n_cols + cols, x, mask=keep)
        else:
            x = tl.load(hidden + row * n_cols + cols, mask=keep, other=0.0)
        if HAS_DELTA:
            # The sum is rounded to storage precision first, exactly as `hidden + delta` would be.
            delta_x = _load_summed(delta, row * n_cols + cols, keep, splits, split_stride, x.dtype, "")
            x = (x.to(tl.float32) + delta_x).to(x.dtype)
            tl.store(sum_out + row * n_cols + cols, x, mask=keep)
        _store_rms_norm(x, cols, keep, w, norm_out + row * stride_norm_out, n_cols, eps)

    @triton.jit
    def _add_layer_norm_kernel(hidden, delta, weight, bias, sum_out, norm_out, n_cols, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        keep = cols < n_cols
        x = tl.load(hidden + row * n_cols + cols, mask=keep, other=0.0)
        x = (x.to(tl.float32) + tl.load(delta + row * n_cols + cols, mask=keep, other=0.0).to(tl.float32)).to(x.dtype)
        tl.store(sum_out + row * n_cols + cols, x, mask=keep)  # rounded as `hidden + delta` is, then normed
        x = x.to(tl.float32)
        centered = tl.where(keep, x - tl.sum(x, axis=0) / n_cols, 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(centered * centered, axis=0) / n_cols + eps)
        y = centered * rstd * tl.load(weight + cols, mask=keep, other=0.0).to(tl.float32)
        y += tl.load(bias + cols, mask=keep, other=0.0).to(tl.float32)
        tl.store(norm_out + row * n_cols + cols, y.to(norm_out.dtype.element_ty), mask=keep)

else:
    _store_rms_norm = _load_summed = None


def rms_norm(x, weight, eps, out=None):
    """`rms_norm_reference` in one launch (`out`'s columns contiguous)."""
    out = torch.empty_like(x) if out is None else out
    launch(_add_rms_norm_kernel, (x.shape[0],), x, x, weight, x, out, out.stride(0), x.shape[1], eps, 1, 0, x,
           HAS_DELTA=False, GATHER=False, BLOCK=triton.next_power_of_2(x.shape[1]))
    return out


def embed_rms_norm(ids, table, weight, eps, out=None):
    """`embed_rms_norm_reference` in one launch: the gather inside the norm's launch, so the step's first kernel is
    one of the PDL chain, not torch's."""
    ids, (rows, width) = ids.contiguous(), (ids.shape[0], table.shape[1])  # the runner's ids are: no copy
    hidden, normed = torch.empty(2, rows, width, dtype=table.dtype, device=table.device)
    out = normed if out is None else out
    launch(_add_rms_norm_kernel, (rows,), table, table, weight, hidden, out, out.stride(0), width, eps, 1, 0, ids,
           HAS_DELTA=False, GATHER=True, BLOCK=triton.next_power_of_2(width))
    return hidden, out


def add_rms_norm(hidden, delta, weight, eps):
    """`add_rms_norm_reference` in one launch. `delta` is the projection's output, or its float32 partial products
    `(splits, rows, N)` (`skinny_matmul(..., partials=True)`), summed and rounded here."""
    total, out = torch.empty_like(hidden), torch.empty_like(hidden)
    launch(_add_rms_norm_kernel, (hidden.shape[0],), hidden, delta, weight, total, out, out.stride(0), hidden.shape[1],
           eps, delta.numel() // hidden.numel(), hidden.numel(), hidden, HAS_DELTA=True, GATHER=False,
           BLOCK=triton.next_power_of_2(hidden.shape[1]))
    return total, out


def add_layer_norm(hidden, delta, weight, bias, eps):
    """`add_layer_norm_reference` in one launch."""
    total, out = torch.empty_like(hidden), torch.empty_like(hidden)
    launch(_add_layer_norm_kernel, (hidden.shape[0],), hidden, delta, weight, bias, total, out, hidden.shape[1],
           eps, BLOCK=triton.next_power_of_2(hidden.shape[1]))
    return total, out
