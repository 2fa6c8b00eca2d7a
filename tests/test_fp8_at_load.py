"""A bf16 checkpoint quantized at load (`from_pretrained(..., quantization_config=FineGrainedFP8Config())`) on shapes
like the 8B's, whose vision MLP (4,304 wide) does not divide into 128 x 128 blocks, and like the 2B's and 4B's, which
do: every linear holds FP8 weights with the scales of its own blocks or keeps the checkpoint's weights, the load
report is clean, and the model generates on the fast path what stock generates on those weights dequantized (CPU,
fp32). Unfixed, transformers 5.x left those vision linears' scales uninitialized (5.17 also cast the weights to e4m3
unscaled) and 4.57 refused them.

transformers quantizes at load only on a GPU; on a CPU the tests skip that check of its environment.
"""

from unittest import mock

import pytest
import torch
from conftest import assert_clean, build, chat, image
from test_generate import assert_same_generate, used_static_loop
from torch import nn
from transformers import FineGrainedFP8Config, Qwen3VLConfig, Qwen3VLForConditionalGeneration
from transformers.integrations.finegrained_fp8 import FP8Linear
from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer

from qwen3vl_static import Qwen3VLGraphForConditionalGeneration
from qwen3vl_static.fp8_qwen3vl_graph import untileable_linears
from qwen3vl_static.fp8_quantize import dequantize_blocks, dequantized_state_dict
from qwen3vl_static.presets import real_config, tiny_config_dict

BLOCK = (128, 128)  # FineGrainedFP8Config's default
IMAGES = ([[chat("image", "What is in the picture?")], [chat("Hi")]], {"images": [image(64, 96)]})


def small_config_dict(vision_intermediate):
    """The tiny model widened so that its text and vision linears divide into at least 2 x 2 blocks of 128 x 128
    (transformers 4.57 drops a scale dimension of one block), but for the vision MLP when `vision_intermediate` is
    not a multiple of 128."""
    values = tiny_config_dict()
    values["text_config"].update(
        hidden_size=256, intermediate_size=512, num_attention_heads=2, num_key_value_heads=2, head_dim=128,
        rope_scaling={"rope_type": "default", "mrope_section": [24, 20, 20], "mrope_interleaved": True})
    values["vision_config"].update(hidden_size=256, intermediate_size=vision_intermediate, num_heads=2,
                                   out_hidden_size=256)
    return values


SHAPES = {"like-8b": small_config_dict(400), "like-2b-4b": small_config_dict(512)}


def test_real_models_that_do_not_divide_into_blocks():
    vision_mlps = {f"model.visual.blocks.{block}.mlp.{linear}" for block in range(27)
                   for linear in ("linear_fc1", "linear_fc2")}
    for model, expected in (("2b", set()), ("4b", set()), ("8b", vision_mlps)):
        with torch.device("meta"):
            skeleton = Qwen3VLGraphForConditionalGeneration(real_config(model))
        assert set(untileable_linears(skeleton, BLOCK)) == expected, model


@pytest.fixture(scope="module", params=SHAPES.values(), ids=SHAPES.keys())
def quantized_at_load(request, tmp_path_factory):
    """(source model, ours quantized at load from its checkpoint, the load report), fp32."""
    torch.manual_seed(0)
    source = Qwen3VLForConditionalGeneration(Qwen3VLConfig(**request.param)).eval()
    folder = tmp_path_factory.mktemp("bf16")
    source.save_pretrained(folder)
    with mock.patch.object(FineGrainedFP8HfQuantizer, "validate_environment"):
        model, info = Qwen3VLGraphForConditionalGeneration.from_pretrained(
            folder, quantization_config=FineGrainedFP8Config(), dtype=torch.float32, output_loading_info=True)
    return source, model.eval(), info


def test_every_linear_is_quantized_with_its_scales_or_kept(quantized_at_load):
    source, model, info = quantized_at_load
    assert_clean(info)
    # lm_head: transformers' default keeps the output embeddings.
    kept = {*untileable_linears(source, BLOCK), "lm_head"}
    originals = dict(source.named_modules())
    quantized = 0
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        original = originals[name].weight
        if name in kept:
            assert type(module) is nn.Linear and torch.equal(module.weight, original), name
            continue
        assert isinstance(module, FP8Linear) and module.weight.dtype == torch.float8_e4m3fn, name
        # The original up to e4m3 rounding, twice over: transformers 5.17 casts the weight to e4m3 unscaled before it
        # quantizes it (2^-10 off among small weights, 1/16 relative above), then rounds to its blocks' scales.
        # Scales of no block or of another one land far off.
        torch.testing.assert_close(dequantize_blocks(module.weight, module.weight_scale_inv), original, rtol=2**-3,
                                   atol=2**-9, msg=lambda message: f"{name}: {message}")
        quantized += 1
    assert quantized == sum(isinstance(module, nn.Linear) for module in source.modules()) - len(kept)


def test_generates_like_stock_on_the_dequantized_weights(quantized_at_load):
    source, model, _ = quantized_at_load
    stock = Qwen3VLForConditionalGeneration(source.config).eval()
    stock.load_state_dict(dequantized_state_dict(model, torch.float32))
    assert_same_generate(model, stock, build(IMAGES), max_new_tokens=8, do_sample=False)
    assert used_static_loop(model)
