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
"""A linear layer's weights as the kernels take them, and which quantized formats the fast path runs.

Qwen's fine-grained FP8 checkpoints (and `FineGrainedFP8Config` at load) give transformers' `FP8Linear` modules: a
float8_e4m3fn `weight` and one float32 `weight_scale_inv` per 128 x 128 block (dequantized = weight x scale). The
runners compute on those bytes directly (`Fp8Weight`): the kernels dequantize each tile in registers, so no 16-bit
copy of a quantized weight exists. Any other quantized linear (other block sizes or scale formats, static activation
scales, bitsandbytes, compressed-tensors, ...) is named by `unsupported_weights`, and the model then runs
transformers' own modules.
"""

import copy
import math
from typing import NamedTuple

import torch
from torch import nn

SCALE_COLS = 128  # inputs per scale: the block width of the format the kernels take
SUPPORTED_BLOCK = (128, 128)


class Fp8Weight(NamedTuple):
    """An FP8 matrix and its block scales: `data` `(N, K)` float8_e4m3fn, `scale` `(ceil(N / scale_rows), ceil(K /
    128))` float32; output row n, input k stands for `data[n, k] * scale[n // scale_rows, k // 128]`. `scale_rows` is
    the block height, 128, or less in a fused matrix whose parts are narrower (their scales then repeat)."""

    data: torch.Tensor
    scale: torch.Tensor
    scale_rows: int

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def device(self) -> torch.device:
        return self.data.device

    def stride(self, dim: int) -> int:
        return self.data.stride(dim)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """The matrix in `dtype` (float32 products, one rounding), for the torch reference ops."""
        rows, cols = self.data.shape
        scale = self.scale.repeat_interleave(self.scale_rows, 0)[:rows].repeat_interleave(SCALE_COLS, 1)[:, :cols]
        return (self.data.float() * scale).to(dtype)


def fp8_module_format(module) -> str | None:
    """The FP8 format of a transformers `FP8Linear`-like module ("block 128x128 e4m3, float32 scales, dynamic
    activations"), or None for a module without FP8 weights."""
    weight, scale = module.weight, getattr(module, "weight_scale_inv", None)
    if weight.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2) or scale is None:
        return None
    block = tuple(module.block_size) if getattr(module, "block_size", None) is not None else "per-tensor"
    activation = getattr(module, "activation_scheme", "dynamic")
    return f"FP8 {str(weight.dtype).removeprefix('torch.')} weights, block {block}, {scale.dtype} scales, {activation} activations"


SUPPORTED_FP8 = f"FP8 float8_e4m3fn weights, block {SUPPORTED_BLOCK}, torch.float32 scales, dynamic activations"


def linear_weight(module: nn.Linear):
    """`module`'s weight as the ops take it: the tensor itself, or an `Fp8Weight` of its FP8 bytes and scales (an
    engine exists only where every FP8 linear is in the supported format: `unsupported_weights`)."""
    if module.weight.dtype != torch.float8_e4m3fn:
        return module.weight
    return Fp8Weight(module.weight, module.weight_scale_inv, SUPPORTED_BLOCK[0])


def fused_fp8_scales(linears) -> tuple:
    """The scales of FP8 linears stacked by output rows, as one matrix's: `(scale, scale_rows)`. Parts whose heights
    are not multiples of the block get their scales repeated at the common finer height."""
    rows = math.gcd(SUPPORTED_BLOCK[0], *(linear.out_features for linear in linears))
    repeat = SUPPORTED_BLOCK[0] // rows
    scales = [linear.weight_scale_inv.detach().repeat_interleave(repeat, 0)[: -(-linear.out_features // rows)]
              for linear in linears]
    return torch.cat(scales), rows


def untileable_linears(model, block) -> list:
    """The names of `model`'s plain linears whose weights do not divide into `block`s (rows, inputs), as the 8B's
    vision MLP (4,304 wide) does not into 128 x 128."""
    return [name for name, module in model.named_modules()
            if type(module) is nn.Linear and (module.out_features % block[0] or module.in_features % block[1])]


def _setting(quantization_config, name, default=None):
    """A field of a quantization config, given as a transformers config object or as its dict."""
    if isinstance(quantization_config, dict):
        return quantization_config.get(name, default)
    return getattr(quantization_config, name, default)


def quantizes_fp8_at_load(quantization_config) -> bool:
    """Whether `from_pretrained(..., quantization_config=...)` asks transformers for fine-grained FP8 weights."""
    method = _setting(quantization_config, "quant_method")
    return getattr(method, "value", method) == "fp8" and not _setting(quantization_config, "dequantize", False)


def fp8_at_load_config(quantization_config, model):
    """`quantization_config` (a `FineGrainedFP8Config` or its dict, to quantize an unquantized checkpoint at load) with
    `model`'s linears that do not divide into its blocks added to `modules_to_not_convert` (to transformers' default,
    the output embeddings, where it names none): they keep the checkpoint's dtype, as Qwen's FP8 checkpoints keep
    what they do not convert. transformers cannot scale them: 5.x leaves their `weight_scale_inv` uninitialized
    ("MISSING" in the load report; 5.17 also casts their weights to e4m3 unscaled) and 4.57 refuses them."""
    block = _setting(quantization_config, "weight_block_size")
    skipped = _setting(quantization_config, "modules_to_not_convert")
    if skipped is None:
        output = model.get_output_embeddings()
        skipped = [name for name, module in model.named_modules() if module is output]
    kept = [*skipped, *(name for name in untileable_linears(model, block) if name not in skipped)] if block else skipped
    if isinstance(quantization_config, dict):
        return {**quantization_config, "modules_to_not_convert": kept}
    quantization_config = copy.deepcopy(quantization_config)
    quantization_config.modules_to_not_convert = kept
    return quantization_config


def unsupported_weights(model) -> str | None:
    """Why the fast path cannot compute with `model`'s linear layers (naming the format and a module), or None."""
    config = getattr(model.config, "quantization_config", None)
    method = config.get("quant_method") if isinstance(config, dict) else getattr(config, "quant_method", None)
    method = getattr(method, "value", method)
    if method not in (None, "fp8"):
        return f"weights quantized with quant_method={method!r}"
    for name, module in model.named_modules():
        if type(module) is nn.Linear or not isinstance(module, nn.Linear):
            continue
        found = fp8_module_format(module)
        if found is None:
            return f"{name} is a {type(module).__name__}, not a plain or fine-grained FP8 linear"
        if found != SUPPORTED_FP8:
            return f"{name} holds {found} (the kernels take {SUPPORTED_FP8})"
    return None
