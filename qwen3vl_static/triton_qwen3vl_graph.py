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
"""What every Triton kernel of the model shares: the optional Triton import, programmatic dependent launch (PDL) and
`launch`, which compiles only while kernels compile ahead (`compiling_ahead`).

Triton is optional: without it `triton` and `tl` are None, no kernel is defined and the torch reference ops run.
"""

import functools
import os
from contextlib import contextmanager
from contextvars import ContextVar

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch ops cover every environment
    triton = tl = None
try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # a Triton without programmatic dependent launch: every kernel waits for the previous one
    gdc_launch_dependents = gdc_wait = None

# True while kernels compile ahead (in this thread): launches only compile.
_COMPILING = ContextVar("qwen3vl_static_compiling", default=False)

if triton is not None:

    @triton.jit
    def _wait_then_release(PDL: tl.constexpr):
        """Every decode kernel's first step. Under programmatic dependent launch (PDL) a kernel is launched while the
        previous one still runs: it waits for that kernel's results (all of them, flushed), then lets the next kernel
        launch, which waits in turn. So each kernel's launch and start overlap its predecessor's tail, and every
        kernel still sees the results of all before it (releasing only after the wait keeps one kernel waiting at a
        time, not a chain holding the SMs)."""
        if PDL:
            gdc_wait()
            gdc_launch_dependents()

    @triton.jit
    def _release_then_wait(PDL: tl.constexpr):
        """`_wait_then_release` the other way round: the successor launches while this kernel and its predecessor still
        run, and still waits for this kernel's results (its launch comes earlier, not its wait). The merge uses it so
        that a preloaded o_proj loads its weights during attention; the preloaded matmul, after its own loads."""
        if PDL:
            gdc_launch_dependents()
            gdc_wait()

    @triton.jit
    def _cache_value(y, cache):
        """`y` as the KV cache `cache` (a pointer) stores it: `cache_values` (of the cache file) in a kernel. Float8 is
        saturated at its largest finite value and rounded to nearest even here, as torch casts: the cast alone differs
        from torch's beyond 448, and rounds otherwise in Triton's interpreter."""
        if cache.dtype.element_ty == tl.float8e4nv:
            y = tl.clamp(y.to(tl.float32), -448.0, 448.0, propagate_nan=tl.PropagateNan.ALL)  # as torch's
            # The value of the last of e4m3's 3 mantissa bits at y's exponent (subnormal below 2^-6: steps of 2^-9),
            # and its inverse: powers of two, so scaling by them is exact.
            exponent = tl.maximum(((y.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)
            unit = ((exponent + 124) << 23).to(tl.float32, bitcast=True)
            inverse = ((130 - exponent) << 23).to(tl.float32, bitcast=True)
            # Adding and taking away 1.5 * 2^23 rounds a float32 below 2^22 to an integer, to nearest even.
            rounded = ((y * inverse + 12582912.0) - 12582912.0) * unit
            y = tl.where(rounded == 0, y * 0.0, rounded)  # keeps the sign of a zero
        return y.to(cache.dtype.element_ty)

else:
    _wait_then_release = _release_then_wait = _cache_value = None


def takes_pdl(capability: tuple) -> bool:
    """Whether a GPU of compute `capability` (major, minor) has programmatic dependent launch: sm90 and later."""
    return capability[0] >= 9


def takes_e4m3(capability: tuple) -> bool:
    """Whether Triton computes with float8 e4m3 on a GPU of compute `capability`: sm89 and later (Ada, Hopper,
    Blackwell). Before (sm80: A100) the FP8 kernels do not compile and FP8 weights take the torch ops."""
    return tuple(capability) >= (8, 9)


@functools.cache
def pdl_capable(device: torch.device) -> bool:
    """Whether kernels launch with programmatic dependent launch on `device`: `takes_pdl`, a Triton that has it,
    compiled kernels (not the interpreter)."""
    return (gdc_wait is not None and device.type == "cuda" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")
            and takes_pdl(torch.cuda.get_device_capability(device)))


def sm_count(device) -> int:
    """Streaming multiprocessors of `device` (1 off CUDA)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def compiling() -> bool:
    """Whether kernels compile ahead now (`compiling_ahead`): launches only compile and measured ops time nothing."""
    return _COMPILING.get()


@contextmanager
def compiling_ahead():
    """Within this context (in this thread) `launch` only compiles its kernel, and measured ops run every candidate."""
    token = _COMPILING.set(True)
    try:
        yield
    finally:
        _COMPILING.reset(token)


def launch(kernel, grid, *args, **kwargs):
    """`kernel[grid](*args, **kwargs)`; while compiling ahead, only the kernel's compilation. Kernels with a PDL
    argument launch with programmatic dependent launch where the device has it (`pdl_capable`)."""
    if "PDL" in kernel.arg_names:
        pdl = pdl_capable(next(arg.device for arg in args if isinstance(arg, torch.Tensor)))
        kwargs.update(PDL=pdl, **({"launch_pdl": True} if pdl else {}))
    if _COMPILING.get():
        kernel.warmup(*args, grid=grid, **kwargs)
    else:
        kernel[grid](*args, **kwargs)
