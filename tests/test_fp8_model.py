"""FP8 linears (transformers' `FP8Linear`, Qwen's fine-grained format) on the fast path, and the formats it refuses.

On a CPU transformers dequantizes FP8 checkpoints at load (tests/test_fp8_loading.py); here the tiny model keeps its
`FP8Linear` modules (`quantize_fp8`), so the engine computes on the FP8 bytes: its greedy output must equal stock
transformers running the dequantized weights (fp32)."""

import pytest
import torch
from conftest import build, chat, image
from torch import nn
from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

from qwen3vl_static import Qwen3VLGraphForConditionalGeneration
from qwen3vl_static.engine_qwen3vl_graph import GraphEngine
from qwen3vl_static.fp8_qwen3vl_graph import Fp8Weight, unsupported_weights
from qwen3vl_static.fp8_quantize import dequantized_state_dict, fp8_linear, quantize_fp8
from qwen3vl_static.ops_qwen3vl_graph import TritonOps
from qwen3vl_static.presets import tiny_config, tiny_config_dict
from qwen3vl_static.triton_qwen3vl_graph import triton
from qwen3vl_static.tuner_qwen3vl_graph import KernelTuner

CASES = {
    "text batch, padded": ([[chat("Hi")], [chat("a longer question here")]], {}),
    "image": ([[chat("image", "What is it?")]], {"images": [image(64, 48)]}),
}


def fp8_pair(modules_to_not_convert=("lm_head",), bucketed=False):
    """(ours with FP8Linear modules, stock on the dequantized weights), fp32. Ours had built its engine on the
    unquantized weights first: replacing the modules rebuilds it."""
    torch.manual_seed(0)
    ours = Qwen3VLGraphForConditionalGeneration(tiny_config(static_cache_len=160, max_batch_size=4,
                                                            prefill_graph_tokens=512)).eval()
    ours.static_cache()
    quantize_fp8(ours, modules_to_not_convert)
    stock = Qwen3VLForConditionalGeneration(Qwen3VLConfig(**tiny_config_dict())).eval()
    stock.load_state_dict(dequantized_state_dict(ours, torch.float32))
    if bucketed:
        ours._engine = GraphEngine(ours, bucketed=True)
    for model in (ours, stock):
        model.generation_config.eos_token_id = None  # random weights: every row generates all it is asked
    return ours, stock


@pytest.mark.parametrize("not_converted", [("lm_head",), ("lm_head", "model.visual")], ids=["vision-fp8", "vision-bf16"])
@pytest.mark.parametrize("bucketed", [False, True], ids=["exact", "bucketed"])
def test_fp8_model_generates_like_stock_on_dequantized_weights(not_converted, bucketed):
    ours, stock = fp8_pair(not_converted, bucketed)
    assert isinstance(ours.graph_engine().text.layers[0].qkv, Fp8Weight)
    for case in CASES.values():
        model_inputs = build(case)
        expected = stock.generate(**model_inputs, max_new_tokens=8, do_sample=False)
        assert ours.generate(**model_inputs, max_new_tokens=8, do_sample=False).tolist() == expected.tolist()


def test_fused_fp8_parameters_are_views_and_no_dequantized_copy_stays():
    ours, _ = fp8_pair()
    layer = ours.model.language_model.layers[0]
    fused = ours.graph_engine().text.layers[0]
    assert fused.qkv.data.data_ptr() == layer.self_attn.q_proj.weight.data_ptr()
    assert fused.gate_up.data.dtype == torch.float8_e4m3fn and fused.gate_up.data.data_ptr() == layer.mlp.gate_proj.weight.data_ptr()
    sixteen_bit = [name for name, p in ours.named_parameters() if p.dim() == 2 and "layers" in name and p.dtype != torch.float8_e4m3fn
                   and "scale" not in name]
    assert not sixteen_bit


@pytest.mark.slow
@pytest.mark.skipif(triton is None or torch.cuda.is_available(), reason="the CUDA tests run the kernels natively")
def test_fp8_model_with_the_kernels_generates_like_stock():
    """Prefill and the decode loop with every Triton kernel on FP8 tiles (interpreted, fp32; the FP8 vision linears'
    kernel is covered by tests/test_ops_fp8.py)."""
    ours, stock = fp8_pair()
    runners = ours.graph_engine().runners
    ops = TritonOps(KernelTuner())
    for runner in runners:
        runner.ops = ops
    model_inputs = build(CASES["text batch, padded"])
    expected = stock.generate(**model_inputs, max_new_tokens=3, do_sample=False)
    assert ours.generate(**model_inputs, max_new_tokens=3, do_sample=False).tolist() == expected.tolist()


class OtherQuantizedLinear(nn.Linear):
    """Stands in for a linear of another quantization library (bitsandbytes, compressed-tensors, ...)."""


def test_other_formats_run_transformers_own_modules(caplog):
    """A linear the kernels do not take: `generate` warns, naming the module and format, and gives stock's output
    from the stock modules and loop; `graph_engine()` says why there is no fast path."""
    torch.manual_seed(0)
    ours = Qwen3VLGraphForConditionalGeneration(tiny_config()).eval()
    stock = Qwen3VLForConditionalGeneration(Qwen3VLConfig(**tiny_config_dict())).eval()
    stock.load_state_dict(ours.state_dict())
    projection = ours.model.language_model.layers[1].mlp.down_proj
    other = OtherQuantizedLinear(projection.in_features, projection.out_features, bias=False)
    other.weight = projection.weight
    ours.model.language_model.layers[1].mlp.down_proj = other
    model_inputs = build(CASES["image"])
    expected = stock.generate(**model_inputs, max_new_tokens=6, do_sample=False)
    assert ours.generate(**model_inputs, max_new_tokens=6, do_sample=False).tolist() == expected.tolist()
    assert ours._engine is None
    with pytest.raises(ValueError, match="layers.1.mlp.down_proj is a OtherQuantizedLinear"):
        ours.graph_engine()
    ours.model.language_model.layers[1].mlp.down_proj = projection  # plain again: the fast path comes back
    assert ours.generate(**model_inputs, max_new_tokens=6, do_sample=False).tolist() == expected.tolist()
    assert ours._engine is not None


@pytest.mark.parametrize("change, named", [
    (lambda linear: setattr(linear, "block_size", (64, 64)), "block (64, 64)"),
    (lambda linear: setattr(linear, "activation_scheme", "static"), "static activations"),
    (lambda linear: setattr(linear, "weight_scale_inv", nn.Parameter(linear.weight_scale_inv.to(torch.bfloat16))),
     "torch.bfloat16 scales"),
])
def test_fp8_formats_the_kernels_do_not_take_are_named(change, named):
    ours = Qwen3VLGraphForConditionalGeneration(tiny_config()).eval()
    attn = ours.model.language_model.layers[0].self_attn
    attn.o_proj = fp8_linear(attn.o_proj)
    assert unsupported_weights(ours) is None
    change(attn.o_proj)
    assert named in unsupported_weights(ours) and "layers.0.self_attn.o_proj" in unsupported_weights(ours)
    with pytest.raises(ValueError, match="no fast path"):
        ours.static_cache()


def test_other_quantization_methods_are_named():
    ours = Qwen3VLGraphForConditionalGeneration(tiny_config()).eval()
    ours.config.quantization_config = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    assert "quant_method='bitsandbytes'" in unsupported_weights(ours)


def test_fused_linears_must_agree_on_quantization():
    ours = Qwen3VLGraphForConditionalGeneration(tiny_config()).eval()
    attn = ours.model.language_model.layers[0].self_attn
    attn.k_proj = fp8_linear(attn.k_proj)  # q and v stay plain
    with pytest.raises(ValueError, match="all be quantized or all not"):
        ours.graph_engine()
