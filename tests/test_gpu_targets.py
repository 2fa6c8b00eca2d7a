"""Which kernels run on which GPU, decided from its compute capability (CPU): programmatic dependent launch from sm90,
the FP8 kernels where Triton has float8 e4m3 (sm89 and later). On an A100 (sm80) FP8 weights take the torch ops with
one notice, and the model still generates; a tiling the GPU lacks the shared memory for is never chosen.
`tests/test_compile_for_gpus.py` compiles what each target runs."""

import logging
import math
import sys
from contextlib import ExitStack
from unittest import mock

import pytest
import torch
from conftest import build
from ops_checks import needs_triton
from test_fp8_model import CASES, fp8_pair

from qwen3vl_static import triton_qwen3vl_graph
from qwen3vl_static.ops_qwen3vl_graph import TorchOps, TritonOps, make_ops
from qwen3vl_static.triton_qwen3vl_graph import takes_e4m3, takes_pdl
from qwen3vl_static.tuner_qwen3vl_graph import KernelTuner, OutOfResources

# capability: (PDL, FP8 kernels), for the GPUs users run.
GPUS = {
    "A100": ((8, 0), (False, False)),
    "A10 / RTX 3090": ((8, 6), (False, False)),
    "L4 / L40S / RTX 4090": ((8, 9), (False, True)),
    "H100 / H200": ((9, 0), (True, True)),
    "B200": ((10, 0), (True, True)),
}
# The op files, each holding `launch` under its own name.
LAUNCHING_MODULES = [module for name, module in sys.modules.items() if name.startswith("qwen3vl_static.ops_")
                     and getattr(module, "launch", None) is triton_qwen3vl_graph.launch]


@pytest.mark.parametrize("capability, expected", GPUS.values(), ids=GPUS.keys())
def test_kernels_by_capability(capability, expected):
    assert (takes_pdl(capability), takes_e4m3(capability)) == expected


@needs_triton
@pytest.mark.parametrize("capability, expected", GPUS.values(), ids=GPUS.keys())
def test_make_ops_takes_fp8_kernels_only_where_the_gpu_has_e4m3(capability, expected):
    with mock.patch("torch.cuda.get_device_capability", return_value=capability):
        ops = make_ops(torch.device("cuda", 0), torch.bfloat16, True, KernelTuner())
    assert type(ops) is TritonOps and ops.fp8_kernels == expected[1]
    assert type(make_ops(torch.device("cuda", 0), torch.bfloat16, False, KernelTuner())) is TorchOps


def refuse_fp8(launch):
    """`launch` that raises, as Triton's compiler does for an sm80 target, when an argument is a float8 tensor."""
    def guarded(kernel, grid, *args, **kwargs):
        if any(isinstance(arg, torch.Tensor) and arg.dtype == torch.float8_e4m3fn for arg in args):
            raise RuntimeError(f"{kernel.fn.__name__}: type fp8e4nv not supported in this architecture")
        return launch(kernel, grid, *args, **kwargs)
    return guarded


@needs_triton
@pytest.mark.slow
def test_fp8_model_without_fp8_kernels_generates_like_stock(caplog):
    """FP8 weights on a GPU without e4m3 kernels: the projections run as torch ops (no FP8 tensor reaches a kernel
    launch), every other op as its kernel, and greedy output equals stock on the dequantized weights."""
    assert {module.__name__ for module in LAUNCHING_MODULES} >= {
        "qwen3vl_static.ops_matmul_qwen3vl_graph", "qwen3vl_static.ops_fp8_matmul_qwen3vl_graph"}
    ours, stock = fp8_pair()
    ops = TritonOps(KernelTuner(), fp8_kernels=False)
    for runner in ours.graph_engine().runners:
        runner.ops = ops
    model_inputs = build(CASES["image"])
    expected = stock.generate(**model_inputs, max_new_tokens=3, do_sample=False)
    with ExitStack() as patches, caplog.at_level(logging.WARNING):
        for module in LAUNCHING_MODULES:
            patches.enter_context(mock.patch.object(module, "launch", refuse_fp8(module.launch)))
        got = ours.generate(**model_inputs, max_new_tokens=3, do_sample=False)
    assert got.tolist() == expected.tolist()
    notices = [record for record in caplog.records if "no float8 e4m3" in record.getMessage()]
    assert len(notices) == 1


@pytest.mark.cuda
def test_a_candidate_the_gpu_cannot_run_is_never_chosen():
    """A tiling that needs more shared memory than the GPU has (the skinny matmul's 6-stage ones on an sm89 GPU)
    raises at its first launch: the tuner times it as `inf` and runs another."""
    tuner = KernelTuner()
    x = torch.randn(4, 64, device="cuda")

    def too_large():
        raise OutOfResources(163_840, 101_376, "shared memory")

    assert torch.equal(tuner.measured("op", "4x64", x.device, [lambda: x * 2, too_large]), x * 2)
    assert tuner.timings[("op", "4x64", x.device)][1] == math.inf
