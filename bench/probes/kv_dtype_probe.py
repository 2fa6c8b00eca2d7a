"""Does a float8 KV cache turn half the bytes into less time in decode attention at many rows? (GPU; JSON to $OUT.)

Times the shipped flash-decoding launch (`decode_attention`: splits and merge, as in the step) over a bfloat16 cache
and over the same cache cast to float8_e4m3fn (`kv_cache_dtype`), at the default split tiles and at twice and half
as many, and with tiles of twice the slots (a float8 tile of CHUNK slots is half the bytes), each alone as the tuner
times a candidate (`KernelTuner().time_calls`).
Run: python bench/probes/kv_dtype_probe.py [--shapes ROWS:KV_LEN:LENGTH ...]
"""

import argparse

import torch

import harness
import triton

from qwen3vl_static.ops_attention_qwen3vl_graph import (
    CHUNK,
    MERGE_BLOCK,
    _decode_attention_kernel,
    _merge_kernel,
    decode_attention,
    split_tiles,
)
from qwen3vl_static.triton_qwen3vl_graph import launch
from qwen3vl_static.tuner_qwen3vl_graph import KernelTuner

HEADS, KV_HEADS, DIM = 16, 8, 128
SHAPES = [(64, 512, 336), (256, 512, 336), (512, 512, 336), (1, 8192, 7880)]


def wide_tiles(q, keys, values, cache_lens, attendable, cache_rows, kv_len, tiles):
    """The shipped launch with tiles of 2 x CHUNK slots, `tiles` of them a program."""
    rows, heads, _ = q.shape
    chunk = 2 * CHUNK
    splits = triton.cdiv(kv_len, chunk * tiles)
    part_out = torch.empty(rows * heads * splits, DIM, dtype=torch.float32, device=q.device)
    part_max = torch.empty(rows * heads * splits, dtype=torch.float32, device=q.device)
    part_sum = torch.empty_like(part_max)
    launch(_decode_attention_kernel, (rows, KV_HEADS, splits), q, keys, values, cache_lens, attendable, cache_rows,
           part_out, part_max, part_sum, DIM**-0.5, keys.stride(0), keys.stride(1), keys.stride(2),
           attendable.stride(0), splits, CHUNK=chunk, TILES=tiles, GROUP=HEADS // KV_HEADS, GROUP_PAD=16,
           KV_HEADS=KV_HEADS, HEAD_DIM=DIM)
    out = torch.empty(rows, heads * DIM, dtype=q.dtype, device=q.device)
    launch(_merge_kernel, (rows * heads,), part_out, part_max, part_sum, out, splits, GROUP=HEADS // KV_HEADS,
           HEAD_DIM=DIM, MERGE_BLOCK=MERGE_BLOCK)
    return out


def main() -> None:
    harness.require_cuda()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", metavar="ROWS:KV_LEN:LENGTH",
                        default=[":".join(map(str, shape)) for shape in SHAPES])
    args = parser.parse_args()
    generator = torch.Generator(device="cuda").manual_seed(0)
    results = []
    for rows, kv_len, length in (tuple(int(part) for part in text.split(":")) for text in args.shapes):
        def randn(*shape):
            return torch.randn(*shape, generator=generator, device="cuda", dtype=torch.bfloat16)

        q, keys, values = randn(rows, HEADS, DIM), randn(rows, KV_HEADS, kv_len, DIM), randn(rows, KV_HEADS, kv_len, DIM)
        context = (torch.full((rows,), length - 1, device="cuda"),
                   torch.ones(rows, kv_len, dtype=torch.bool, device="cuda"), torch.arange(rows, device="cuda"))
        caches = {"bf16": (keys, values),
                  "fp8": (keys.to(torch.float8_e4m3fn), values.to(torch.float8_e4m3fn))}
        default = split_tiles(rows, KV_HEADS, kv_len)
        tiles = sorted({max(1, default // 2), default, default * 2})
        calls = {f"{dtype} tiles {count}": (lambda cache=cache, count=count:
                                            decode_attention(q, *cache, *context, kv_len, DIM**-0.5, tiles=count))
                 for dtype, cache in caches.items() for count in tiles}
        calls |= {f"{dtype} wide tiles {count}": (lambda cache=cache, count=count:
                                                  wide_tiles(q, *cache, *context, kv_len, count))
                  for dtype, cache in caches.items() for count in sorted({max(1, default // 2), default})}
        outputs = {name: call().float() for name, call in calls.items()}
        times = dict(zip(calls, KernelTuner().time_calls(list(calls.values()))))
        reference = outputs[f"bf16 tiles {default}"]
        results.append({
            "rows": rows, "kv_len": kv_len, "length": length, "default_tiles": default, "us": times,
            "kv_gb": {dtype: 2 * rows * KV_HEADS * length * DIM * cache[0].element_size() / 1e9
                      for dtype, cache in caches.items()},
            "max_abs_diff_vs_bf16": {name: (out - reference).abs().max().item() for name, out in outputs.items()}})
        print(f"{rows} rows at {length} of {kv_len} slots: " + ", ".join(f"{n} {us:.1f} us" for n, us in times.items()),
              flush=True)
    harness.write_json({"rows": results})


if __name__ == "__main__":
    main()
