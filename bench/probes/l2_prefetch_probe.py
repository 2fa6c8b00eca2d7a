"""Does prefetching a projection's FP8 weights into L2 during the small kernels before it make the step faster? (H200
probe; JSON to $OUT.)

In the decode step the weights stream from HBM only while a projection runs: during the kernels between projections
(QK-norm/RoPE, attention, merge, the add-and-norms, SwiGLU sums; about 14 µs a layer for the 8B at batch 1) HBM idles.
A `cp.async.bulk.prefetch.L2` asks the copy engine of an SM for a range of bytes into L2 and returns at once.

Each measurement is a CUDA graph of a chain, as the step: R times a "window" kernel (it spins `spin` ns, standing in
for the small kernels) then the projection (`skinny_matmul`, float32 partial products) of its own weight, R distinct
weights of the shape (more than L2 together), all under PDL. Variants of the window:
- `none`: spins only;
- `whole gG`: first prefetches the whole weight of the projection after it, from G programs;
- `next8MB`: first prefetches the first 8 MB of the weight of the projection after the next (a prefetch that overlaps
  the projection before it, as a projection prefetching its successor's weights would).
Every projection tiling the tuner offers at these rows is run in each chain; the fastest per variant is reported (a
preloaded tiling already loads its first tiles during the window).

Usage (H200): python bench/probes/l2_prefetch_probe.py
"""

import json
import os
import statistics
from pathlib import Path

import torch
import triton
import triton.language as tl

from qwen3vl_static import ops_matmul_qwen3vl_graph as matmul
from qwen3vl_static.fp8_qwen3vl_graph import Fp8Weight
from qwen3vl_static.triton_qwen3vl_graph import _wait_then_release, launch

SHAPES = {"8b": {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (24576, 4096), "down_proj": (4096, 12288)},
          "2b": {"qkv": (4096, 2048), "o_proj": (2048, 2048), "gate_up": (12288, 2048), "down_proj": (2048, 6144)}}
CASES = (("8b", 1, (2000, 8000)), ("2b", 8, (4000, 13000)))  # model, rows, window spins (ns)
CHUNK = 256 * 1024  # bytes per prefetch instruction
CHAIN_BYTES = 300 << 20  # R weights of a shape hold at least this many bytes


@triton.jit
def _globaltimer(dummy):
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [dummy], dtype=tl.int64, is_pure=False,
                                     pack=1)


@triton.jit
def _prefetch_l2(pointers, sizes):
    return tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [pointers, sizes], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _window_kernel(base, total_bytes, chunk_bytes, spin_ns, sink, CHUNKS: tl.constexpr, PREFETCH: tl.constexpr,
                   PDL: tl.constexpr):
    _wait_then_release(PDL)
    if PREFETCH:
        chunk = (tl.program_id(0) * CHUNKS + tl.arange(0, CHUNKS)).to(tl.int64)
        start = chunk * chunk_bytes
        size = tl.minimum(total_bytes - start, chunk_bytes).to(tl.int32)
        tl.store(sink + tl.program_id(0) * CHUNKS + tl.arange(0, CHUNKS), _prefetch_l2(base + start, size))
    dummy = tl.zeros((1,), tl.int32)
    t0 = tl.max(_globaltimer(dummy), 0)
    now = t0
    while now - t0 < spin_ns:
        now = tl.max(_globaltimer(dummy), 0)


def window(spin_ns, target=None, nbytes=0, programs=1, sink=None):
    """A window kernel: spins; first prefetches `nbytes` of `target` (a uint8 view) from `programs` programs."""
    chunks = triton.cdiv(nbytes, CHUNK) if target is not None else 1
    per_program = triton.next_power_of_2(max(1, triton.cdiv(chunks, programs)))
    base = target if target is not None else sink.view(torch.uint8)
    launch(_window_kernel, (programs,), base, nbytes, CHUNK, spin_ns, sink, CHUNKS=per_program,
           PREFETCH=target is not None, num_warps=4)


def chain_ms(steps, replays=20):
    """Milliseconds per replay of a graph of `steps()` (median), after two eager runs."""
    for _ in range(2):
        steps()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        steps()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main():
    device = torch.device("cuda")
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    sink = torch.zeros(1 << 20, dtype=torch.int32, device=device)
    report = {"device": torch.cuda.get_device_name(device), "torch": torch.__version__, "chunk_bytes": CHUNK,
              "results": []}
    for model, rows, spins in CASES:
        for name, (n, k) in SHAPES[model].items():
            nbytes = n * k
            count = max(4, triton.cdiv(CHAIN_BYTES, nbytes))
            weights = [Fp8Weight((torch.randn(n, k, device=device) * 32).to(torch.float8_e4m3fn),
                                 torch.rand(triton.cdiv(n, 128), triton.cdiv(k, 128), device=device) * 0.01, 128)
                       for _ in range(count)]
            raw = [w.data.view(torch.uint8).view(-1) for w in weights]
            x = torch.randn(rows, k, dtype=torch.bfloat16, device=device)
            expected = x.float() @ weights[0].dequantize(torch.float32).T
            configs = matmul.stage_configs(matmul.rule_config(weights[0]), weights[0], rows=rows)
            for spin in spins:
                variants = {"none": lambda r: window(spin, sink=sink)}
                for programs in (sms, 8, 1):
                    variants[f"whole g{programs}"] = (
                        lambda r, programs=programs: window(spin, raw[r], nbytes, programs, sink))
                variants["next8MB"] = lambda r: window(spin, raw[(r + 1) % count], min(nbytes, 8 << 20), sms, sink)
                alone = chain_ms(lambda: [window(spin, sink=sink) for _ in range(count)]) / count
                row = {"model": model, "projection": name, "rows": rows, "mbytes": nbytes / 1e6, "chain": count,
                       "spin_ns": spin, "window_alone_us": 1000 * alone, "variants": {}}
                for label, prefetch in variants.items():
                    per_config = {}
                    for config in configs:
                        def steps(config=config, prefetch=prefetch):
                            for r in range(count):
                                prefetch(r)
                                matmul.skinny_matmul(x, weights[r], config, partials=True)
                        per_config[str(tuple(config))] = 1000 * chain_ms(steps) / count
                    best = min(per_config, key=per_config.get)
                    row["variants"][label] = {"us_per_link": per_config[best], "config": best,
                                              "projection_us": per_config[best] - 1000 * alone,
                                              "all": per_config}
                parts = matmul.skinny_matmul(x, weights[0], configs[0], partials=True).sum(0)
                row["max_abs_error"] = (parts - expected).abs().max().item()
                report["results"].append(row)
                print(model, name, rows, spin, f"window {1000 * alone:.2f} us;",
                      ", ".join(f"{label} {v['projection_us']:.2f}" for label, v in row["variants"].items()),
                      flush=True)
    out = Path(os.environ.get("OUT", "bench/results"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "l2_prefetch_probe.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
