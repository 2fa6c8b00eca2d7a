"""What else would turn a float8 KV cache's half bytes into time in decode attention? (GPU; JSON to $OUT.)

Over a float8 cache, flash-decoding reads 128-slot tiles where a program spans 4 or more of 64 (`tile_slots`): 18-20 %
faster than bf16 at 256-512 rows on an H100, not the half its bytes would allow. This times, on the shipped split
rule's slots a program, the shipped launch against forms of its splits kernel with one launch setting changed: tiles
of 256 slots, 2 or 4 pipeline stages, 8 warps; and the bf16 cache's shipped launch beside them. Each alone as the tuner
times a candidate (`KernelTuner().time_calls`: between two PDL neighbours, L2 flushed), splits and merge together.
Run: python bench/probes/kv_float8_probe.py [--shapes ROWS:KV_LEN:LENGTH ...]
"""

import argparse

import torch
import triton

import harness
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
FORMS = {"256-slot tiles": (4, {}), "2 stages": (2, {"num_stages": 2}), "4 stages": (2, {"num_stages": 4}),
         "8 warps": (2, {"num_warps": 8})}  # (slots a tile in CHUNKs, launch options)


def form(q, keys, values, cache_lens, attendable, cache_rows, kv_len, chunks, options):
    """The shipped launch with tiles of `chunks` x CHUNK slots (the split rule's slots a program) and `options`."""
    rows = q.shape[0]
    tiles = max(1, split_tiles(rows, KV_HEADS, kv_len) // chunks)
    splits = triton.cdiv(kv_len, chunks * CHUNK * tiles)
    part_out = torch.empty(rows * HEADS * splits, DIM, dtype=torch.float32, device=q.device)
    part_max = torch.empty(rows * HEADS * splits, dtype=torch.float32, device=q.device)
    part_sum = torch.empty_like(part_max)
    launch(_decode_attention_kernel, (rows, KV_HEADS, splits), q, keys, values, cache_lens, attendable, cache_rows,
           part_out, part_max, part_sum, DIM**-0.5, keys.stride(0), keys.stride(1), keys.stride(2),
           attendable.stride(0), splits, CHUNK=chunks * CHUNK, TILES=tiles, GROUP=HEADS // KV_HEADS, GROUP_PAD=16,
           KV_HEADS=KV_HEADS, HEAD_DIM=DIM, **options)
    out = torch.empty(rows, HEADS * DIM, dtype=q.dtype, device=q.device)
    launch(_merge_kernel, (rows * HEADS,), part_out, part_max, part_sum, out, splits, GROUP=HEADS // KV_HEADS,
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
        float8 = keys.to(torch.float8_e4m3fn), values.to(torch.float8_e4m3fn)
        calls = {"bf16 shipped": lambda: decode_attention(q, keys, values, *context, kv_len, DIM**-0.5),
                 "float8 shipped": lambda: decode_attention(q, *float8, *context, kv_len, DIM**-0.5),
                 **{f"float8 {name}": (lambda chunks=chunks, options=options:
                                       form(q, *float8, *context, kv_len, chunks, options))
                    for name, (chunks, options) in FORMS.items()}}
        outputs = {name: call().float() for name, call in calls.items()}
        times = dict(zip(calls, KernelTuner().time_calls(list(calls.values()))))
        results.append({
            "rows": rows, "kv_len": kv_len, "length": length, "split_tiles": split_tiles(rows, KV_HEADS, kv_len),
            "us": times, "float8_gb": 2 * rows * KV_HEADS * length * DIM / 1e9,
            "max_abs_diff_vs_float8_shipped": {name: (out - outputs["float8 shipped"]).abs().max().item()
                                               for name, out in outputs.items()}})
        print(f"{rows} rows at {length} of {kv_len} slots: " + ", ".join(f"{n} {us:.1f} us" for n, us in times.items()),
              flush=True)
    harness.write_json({"rows": results})


if __name__ == "__main__":
    main()
