"""Does programmatic dependent launch (PDL) shorten the decode step's kernel boundaries? (H200 probe; JSON to $OUT.)

The decode step is ~300 small kernels; each boundary costs a launch and a ramp-up of the next kernel's loads. With
PDL (sm90+) a kernel may start while its predecessor drains, load what does not depend on it (its weights), then
wait (`griddepcontrol.wait`) for the predecessor's results. Timed here in one CUDA graph of 28 x (RMSNorm -> skinny
GEMV) on Qwen3-VL-2B's QKV and gate/up shapes (distinct weights: read from HBM), bf16, 1 row:
- "cublas": the torch RMSNorm and F.linear;
- "triton": the same Triton kernels without PDL;
- "pdl-wait": launched with PDL, each kernel waiting before any load;
- "pdl-prefetch": the GEMV loads its first weight tile before waiting;
- "pdl-prefetch-trigger": as above, and each kernel lets its successor launch at once.
Run: python bench/probes/pdl_probe.py
"""

import json
import os
import sys

import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    sys.exit("pdl_probe.py needs a CUDA device.")

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

LAYERS, K = 28, 2048


@triton.jit
def norm_kernel(x, weight, out, n_cols, eps, BLOCK: tl.constexpr, WAIT: tl.constexpr, TRIGGER: tl.constexpr):
    if TRIGGER:
        gdc_launch_dependents()
    cols = tl.arange(0, BLOCK)
    w = tl.load(weight + cols).to(tl.float32)
    if WAIT:
        gdc_wait()
    v = tl.load(x + cols).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(v * v, axis=0) / n_cols + eps)
    tl.store(out + cols, (v * rstd * w).to(out.dtype.element_ty))


@triton.jit
def gemv_kernel(x, weight, out, n_cols, k_len, stride_w, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                WAIT: tl.constexpr, PREFETCH: tl.constexpr, TRIGGER: tl.constexpr):
    if TRIGGER:
        gdc_launch_dependents()
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ids = tl.arange(0, ROWS)
    acc = tl.zeros((BLOCK_N, ROWS), tl.float32)
    start = 0
    if PREFETCH:  # the first weight tile does not depend on the previous kernel
        ks = tl.arange(0, BLOCK_K)
        w = tl.load(weight + cols[:, None] * stride_w + ks[None, :])
        if WAIT:
            gdc_wait()
        acc = tl.dot(w, tl.load(x + row_ids[None, :] * k_len + ks[:, None], mask=row_ids[None, :] < 1, other=0.0), acc)
        start = BLOCK_K
    elif WAIT:
        gdc_wait()
    for k0 in range(start, k_len, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(weight + cols[:, None] * stride_w + ks[None, :])
        acc = tl.dot(w, tl.load(x + row_ids[None, :] * k_len + ks[:, None], mask=row_ids[None, :] < 1, other=0.0), acc)
    tl.store(out + row_ids[None, :] * n_cols + cols[:, None], acc.to(out.dtype.element_ty), mask=row_ids[None, :] < 1)


def chain(variant, x, norm_weight, weights, outs, normed):
    pdl = variant.startswith("pdl")
    flags = dict(WAIT=pdl, TRIGGER=variant.endswith("trigger"), **({"launch_pdl": True} if pdl else {}))
    for weight, out in zip(weights, outs):
        if variant == "cublas":
            F.linear(F.rms_norm(x, (K,), norm_weight, 1e-6), weight, out=out)
            continue
        norm_kernel[(1,)](x, norm_weight, normed, K, 1e-6, BLOCK=K, **flags)
        n = weight.shape[0]
        gemv_kernel[(triton.cdiv(n, 32),)](normed, weight, out, n, K, weight.stride(0), ROWS=16, BLOCK_N=32, BLOCK_K=128,
                                          PREFETCH=variant.startswith("pdl-prefetch"), num_warps=4, num_stages=4, **flags)


def time_us(variant, n):
    x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
    norm_weight = torch.randn(K, device="cuda", dtype=torch.bfloat16)
    weights = [0.02 * torch.randn(n, K, device="cuda", dtype=torch.bfloat16) for _ in range(LAYERS)]
    outs = [torch.empty(1, n, device="cuda", dtype=torch.bfloat16) for _ in range(LAYERS)]
    normed = torch.empty(1, K, device="cuda", dtype=torch.bfloat16)
    chain(variant, x, norm_weight, weights, outs, normed)  # compile
    expected = F.linear(F.rms_norm(x, (K,), norm_weight, 1e-6), weights[-1]).float()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain(variant, x, norm_weight, weights, outs, normed)
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    error = ((outs[-1].float() - expected).abs().max() / expected.abs().max()).item()
    return {"us_per_norm_and_gemv": 1000 * start.elapsed_time(end) / 20 / LAYERS, "relative_error": error}


results = {"device": torch.cuda.get_device_name(), "capability": torch.cuda.get_device_capability(),
           "triton": triton.__version__, "torch": torch.__version__, "rows": {}}
for name, n in (("qkv", 4096), ("gate_up", 12288)):
    for variant in ("cublas", "triton", "pdl-wait", "pdl-prefetch", "pdl-prefetch-trigger"):
        try:
            results["rows"][f"{name}/{variant}"] = time_us(variant, n)
        except Exception as error:  # a Triton without PDL, an unsupported device
            results["rows"][f"{name}/{variant}"] = {"error": f"{type(error).__name__}: {str(error)[:300]}"}
        print(name, variant, results["rows"][f"{name}/{variant}"], flush=True)
out = os.environ.get("OUT", "bench/results")
os.makedirs(out, exist_ok=True)
with open(os.path.join(out, "pdl-probe.json"), "w") as handle:
    json.dump(results, handle, indent=1)
