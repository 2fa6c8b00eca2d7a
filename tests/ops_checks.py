"""What the op tests share: the device and dtypes they run in, random inputs, tolerances and poisoned buffers. The
fused Triton ops run on the CPU through TRITON_INTERPRET=1 (tests/conftest.py sets it), natively on CUDA. Inputs are
fresh random values (never zeros) and every output buffer is poisoned before the call."""

from contextlib import contextmanager

import pytest
import torch

from qwen3vl_static.ops_qwen3vl_graph import TorchOps, TritonOps
from qwen3vl_static.triton_qwen3vl_graph import triton
from qwen3vl_static.tuner_qwen3vl_graph import KernelTuner

needs_triton = pytest.mark.skipif(triton is None, reason="needs triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Triton's interpreter mishandles bfloat16 (tl.dot on it returns garbage, float32 -> bfloat16 truncates), so the CPU
# checks the kernels' logic in float32 and the GPU checks them in the dtype they run in.
DTYPES = [torch.bfloat16] if DEVICE == "cuda" else [torch.float32]
TOLERANCE = {torch.float32: {"rtol": 1e-5, "atol": 1e-5}, torch.bfloat16: {"rtol": 2e-2, "atol": 2e-2}}
# The op sets under test, each with a tuner of its own.
Torch, Triton = TorchOps(), TritonOps(KernelTuner())


def column_tickets() -> torch.Tensor:
    """The test device's counters, as many as a split projection may take (one per column tile)."""
    return Triton.column_tickets(torch.device(DEVICE))


def randn(*shape, dtype):
    return torch.randn(*shape, device=DEVICE).to(dtype)


def assert_close_at_scale(out, expected, float32_bound=1e-5, through_float8=False):
    """`out` against a float32 `expected`. Sums of terms of both signs land some outputs near zero, where elementwise
    relative bounds fail on rounding alone, so the bound is on the error relative to the output's scale (a wrong row,
    column, head or activation is off by that whole scale). A float32 `out` differs by summation order only, unless
    the op rounds on the way (`float32_bound`); a float8 one (a float8 KV cache) by one of its units at that scale.
    `through_float8`: `out` was computed from values that both sides rounded to float8 from inputs a rounding apart
    (a new token's K/V in a float8 cache), which may land a float8 unit apart: one more such unit is allowed."""
    bound = float32_bound if out.dtype == torch.float32 else 2**-3 if out.element_size() == 1 else 2**-6
    bound += 2**-3 if through_float8 else 0
    assert (out.float() - expected).abs().max() <= bound * expected.abs().max()


def assert_matmul_close(out, inputs, reference_op):
    """A (fused) matmul's output against `reference_op` on float32 copies of `inputs`."""
    expected = reference_op(*(x.float() if isinstance(x, torch.Tensor) else x for x in inputs))
    assert_close_at_scale(out, expected[-1] if isinstance(expected, tuple) else expected)


@contextmanager
def poisoned_empty():
    """`torch.empty` returns NaN inside (deterministic mode), for the buffers a launcher allocates itself."""
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(previous)
