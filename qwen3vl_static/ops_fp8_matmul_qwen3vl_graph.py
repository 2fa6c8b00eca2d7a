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
"""The FP8 projection of many rows (prefill, the vision tower): the matrix dequantized into a transient buffer in one
launch, then cuBLAS. The result is `x @ dequantized(weight).T`, the weight scaled per block and rounded to x's dtype
as transformers dequantizes FP8 checkpoints; activations are not quantized. (A few rows take the skinny matmul
instead: `TritonOps.linear`. The torch reference is `linear_reference`.)

On an H200 this beat a tiled Triton matmul that dequantizes each FP8 tile in registers at every 2B projection: 21 /
17 / 45 / 32 us against 25 / 26 / 59 / 63 us (QKV, o_proj, gate/up, down_proj at 256 rows; cuBLAS on bf16 weights
16 / 14 / 27 / 22 us). The buffer lives for one call: no 16-bit copy of a quantized weight stays resident.
"""

import torch
import torch.nn.functional as F

from .fp8_qwen3vl_graph import SCALE_COLS
from .triton_qwen3vl_graph import _wait_then_release, launch, tl, triton

if triton is not None:

    @triton.jit
    def _dequantize_kernel(weight, scale, out, n_cols, k_len, stride_w, stride_s, SCALE_ROWS: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
        """One (BLOCK_N rows, one scale block of inputs) tile: weight x its scale, rounded to `out`'s dtype."""
        _wait_then_release(PDL)
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        ks = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
        keep = (rows[:, None] < n_cols) & (ks[None, :] < k_len)
        w = tl.load(weight + rows[:, None] * stride_w + ks[None, :], mask=keep, other=0.0)
        s = tl.load(scale + rows // SCALE_ROWS * stride_s + tl.program_id(1), mask=rows < n_cols, other=0.0)
        tl.store(out + rows[:, None] * k_len + ks[None, :], (w.to(tl.float32) * s[:, None]).to(out.dtype.element_ty),
                 mask=keep)


def dequantize(weight, dtype) -> torch.Tensor:
    """`weight.dequantize(dtype)` of an `Fp8Weight` in one launch, into a new matrix."""
    n, k = weight.shape
    out = torch.empty(n, k, dtype=dtype, device=weight.device)
    launch(_dequantize_kernel, (triton.cdiv(n, 64), triton.cdiv(k, SCALE_COLS)), weight.data, weight.scale, out, n, k,
           weight.data.stride(0), weight.scale.stride(0), SCALE_ROWS=weight.scale_rows, BLOCK_N=64, BLOCK_K=SCALE_COLS)
    return out


def fp8_matmul(x, weight, bias=None):
    """`x @ dequantized(weight).T (+ bias)` in x's dtype for an `Fp8Weight`."""
    return F.linear(x, dequantize(weight, x.dtype), None if bias is None else bias.to(x.dtype))
