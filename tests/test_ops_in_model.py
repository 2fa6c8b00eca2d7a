"""The fused Triton ops in the whole model: prefill and the decode loop against stock generate."""

import pytest
from ops_checks import DEVICE, needs_triton

from qwen3vl_static.ops_qwen3vl_graph import TritonOps
from qwen3vl_static.tuner_qwen3vl_graph import KernelTuner


@needs_triton
@pytest.mark.slow
@pytest.mark.skipif(DEVICE == "cuda", reason="the CUDA tests cover the kernels in the real model")
def test_tiny_model_generates_like_stock_with_the_kernels(tiny_pair):
    """Prefill and the whole decode loop with every Triton kernel (interpreted, fp32) still equal stock generate."""
    from conftest import build, chat, image

    ours, stock = tiny_pair
    model_inputs = build(([[chat("image", "What is it?")], [chat("Hi")]], {"images": [image(64, 64)]}))
    expected = stock.generate(**model_inputs, max_new_tokens=4, do_sample=False)
    runners = ours.graph_engine().runners
    saved = [runner.ops for runner in runners]
    ops = TritonOps(KernelTuner())
    for runner in runners:
        runner.ops = ops
    try:
        assert ours.generate(**model_inputs, max_new_tokens=4, do_sample=False).tolist() == expected.tolist()
    finally:
        for runner, original in zip(runners, saved):
            runner.ops = original
