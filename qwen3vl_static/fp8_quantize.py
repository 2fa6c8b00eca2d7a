"""Fine-grained FP8 models and checkpoints without a download (not uploaded to the Hub): Qwen's FP8 format
(`quant_method: fp8`, e4m3 weights, one float32 `weight_scale_inv` per 128 x 128 block, dequantized = weight x
scale) made from a model's bf16 / fp32 weights, as transformers' `FineGrainedFP8Config` quantizes at load.

`quantize_fp8(model)` swaps the model's linears for transformers' own `FP8Linear` modules in place (random-weight
benchmarks and GPU tests); `save_fp8_checkpoint(model, directory)` writes a checkpoint in exactly the published
format (the CPU tests load it). Vision and `lm_head` stay unquantized by default, as in Qwen's checkpoints.
"""

import inspect
import json
from pathlib import Path

import torch
from torch import nn

FP8_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448
BLOCK = (128, 128)
# What Qwen's FP8 checkpoints keep in bf16 (prefix patterns, as transformers' `modules_to_not_convert` reads them).
NOT_CONVERTED = ("lm_head", "model.visual")


def quantization_config_dict(modules_to_not_convert=NOT_CONVERTED, block=BLOCK) -> dict:
    """The `quantization_config` of Qwen's FP8 checkpoints."""
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": list(block), "modules_to_not_convert": list(modules_to_not_convert)}


def quantize_blocks(weight: torch.Tensor, block=BLOCK):
    """`(float8_e4m3fn weight, float32 weight_scale_inv)` of a 2D weight: one scale per `block` (edge blocks are
    partial), the block's largest magnitude mapped to 448, as transformers' `Fp8Quantize` does."""
    rows, cols = weight.shape
    grid = (-(-rows // block[0]), -(-cols // block[1]))
    padded = weight.new_zeros(grid[0] * block[0], grid[1] * block[1], dtype=torch.float32)
    padded[:rows, :cols] = weight.float()
    tiles = padded.view(grid[0], block[0], grid[1], block[1])
    max_abs = tiles.abs().amax(dim=(1, 3))
    scale_inv = torch.where(max_abs > 0, max_abs / FP8_MAX, torch.ones_like(max_abs))
    quantized = (tiles / scale_inv[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return quantized.view_as(padded)[:rows, :cols].contiguous(), scale_inv


def dequantize_blocks(weight: torch.Tensor, scale_inv: torch.Tensor, dtype=torch.float32, block=BLOCK) -> torch.Tensor:
    """The matrix an FP8 weight stands for: weight x its block's scale, in `dtype`."""
    rows, cols = weight.shape
    scale = scale_inv.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    return (weight.float() * scale).to(dtype)


def skipped(name: str, modules_to_not_convert) -> bool:
    return any(name == pattern or name.startswith(pattern + ".") for pattern in modules_to_not_convert)


def fp8_linear(linear: nn.Linear, block=BLOCK) -> nn.Module:
    """transformers' `FP8Linear` holding `linear`'s weights quantized (its constructor differs across releases)."""
    from transformers.integrations.finegrained_fp8 import FP8Linear

    has_bias = linear.bias is not None
    takes = inspect.signature(FP8Linear.__init__).parameters
    bias_arg = {"has_bias": has_bias} if "has_bias" in takes else {"bias": has_bias}
    with torch.device("meta"):
        module = FP8Linear(linear.in_features, linear.out_features, block_size=tuple(block),
                           activation_scheme="dynamic", **bias_arg)
    weight, scale_inv = quantize_blocks(linear.weight.detach(), block)
    module.weight = nn.Parameter(weight, requires_grad=False)
    module.weight_scale_inv = nn.Parameter(scale_inv, requires_grad=False)
    if has_bias:
        module.bias = nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
    return module


def quantize_fp8(model, modules_to_not_convert=NOT_CONVERTED, block=BLOCK):
    """Swap every plain `nn.Linear` of `model` outside `modules_to_not_convert` for an `FP8Linear` of its weights, in
    place, and record the `quantization_config` (what `from_pretrained(..., quantization_config=
    FineGrainedFP8Config(...))` leaves). Returns the model."""
    names = [name for name, module in model.named_modules()
             if type(module) is nn.Linear and not skipped(name, modules_to_not_convert)]
    for name in names:
        model.set_submodule(name, fp8_linear(model.get_submodule(name), block))
    model.config.quantization_config = quantization_config_dict(modules_to_not_convert, block)
    return model


def save_fp8_checkpoint(model, directory, modules_to_not_convert=NOT_CONVERTED, block=BLOCK) -> Path:
    """Write `model` (unquantized) as an FP8 checkpoint in Qwen's format: `config.json` with its `quantization_config`,
    one safetensors file where each converted linear has a float8_e4m3fn `weight` and a float32 `weight_scale_inv`."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    linears = {name for name, module in model.named_modules()
               if type(module) is nn.Linear and not skipped(name, modules_to_not_convert)}
    tensors = {}
    for key, value in model.state_dict().items():
        module, _, leaf = key.rpartition(".")
        if module in linears and leaf == "weight":
            tensors[key], tensors[f"{module}.weight_scale_inv"] = quantize_blocks(value, block)
        else:
            tensors[key] = value
    if getattr(model.config, "tie_word_embeddings", False):
        tensors.pop("lm_head.weight", None)
    save_file({key: value.detach().contiguous() for key, value in tensors.items()}, directory / "model.safetensors",
              metadata={"format": "pt"})
    config = model.config.to_dict()
    config["quantization_config"] = quantization_config_dict(modules_to_not_convert, block)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return directory


def dequantized_state_dict(model, dtype=None) -> dict:
    """`model`'s state dict with each FP8 weight replaced by the matrix it stands for (in `dtype`, default the model's)
    and the scales dropped: what stock transformers loads to run an FP8 checkpoint dequantized."""
    state = model.state_dict()
    dtype = dtype or model.dtype
    out = {}
    for key, value in state.items():
        if key.endswith("weight_scale_inv"):
            continue
        if value.dtype == torch.float8_e4m3fn:
            value = dequantize_blocks(value, state[key.removesuffix("weight") + "weight_scale_inv"], dtype)
        out[key] = value
    return out
