"""Does flash-decoding read the KV cache faster at other launch settings? (H200; JSON to $OUT.)

The decode attention kernels alone (2B heads) on the shapes where the step spends most in attention (batch 64 at 336
of 512 slots: about a third of its 2.77 ms step; long contexts), at the shipped settings (`split_tiles`' tiles of
64 slots, 4 warps, 3 stages; a float8 cache's 128-slot tiles where `tile_slots` says) and at tiles of 128 or 256
slots, twice the tiles per program, 2 or 8 warps and 1 or 2 stages, timed as the tuner times a candidate. Reports microseconds, the K/V bandwidth and each form's largest difference from
the shipped form. `--shapes ROWS:KV_LEN:LENGTH ...` measures other shapes (e.g. the benchmark's decode, 512-token
prompts in the 1024-slot bucket: 1:1024:576 8:1024:576). `--kv-cache-dtype fp8` reads a float8 cache (the opt-in
`kv_cache_dtype`), half the bytes: the bandwidth counts the bytes read.
Run: python bench/probes/attention_launch_probe.py [--shapes ...] [--kv-cache-dtype fp8]
"""

import argparse
import itertools

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
SHAPES = [(64, 512, 336), (32, 1024, 700), (8, 4096, 4080), (1, 8192, 7880)]


def attention(q, keys, values, cache_lens, attendable, cache_rows, kv_len, chunk, tiles, num_warps, num_stages):
    """`decode_attention` at these launch settings (the same two kernels)."""
    rows, group = q.shape[0], HEADS // KV_HEADS
    splits = triton.cdiv(kv_len, chunk * tiles)
    part_out = torch.empty(rows * HEADS * splits, DIM, dtype=torch.float32, device=q.device)
    part_max = torch.empty(rows * HEADS * splits, dtype=torch.float32, device=q.device)
    part_sum = torch.empty_like(part_max)
    launch(_decode_attention_kernel, (rows, KV_HEADS, splits), q, keys, values, cache_lens, attendable, cache_rows,
           part_out, part_max, part_sum, DIM**-0.5, keys.stride(0), keys.stride(1), keys.stride(2),
           attendable.stride(0), splits, CHUNK=chunk, TILES=tiles, GROUP=group, GROUP_PAD=16, KV_HEADS=KV_HEADS,
           HEAD_DIM=DIM, num_warps=num_warps, num_stages=num_stages)
    out = torch.empty(rows, HEADS * DIM, dtype=q.dtype, device=q.device)
    launch(_merge_kernel, (rows * HEADS,), part_out, part_max, part_sum, out, splits, GROUP=group, HEAD_DIM=DIM,
           MERGE_BLOCK=MERGE_BLOCK)
    return out


def measure(rows, kv_len, length, generator, kv_dtype=torch.bfloat16) -> dict:
    """Every form on one shape: microseconds, K/V bandwidth, largest difference from the shipped form."""
    def randn(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=generator, device="cuda", dtype=torch.bfloat16).to(dtype)

    operands = (randn(rows, HEADS, DIM), randn(rows, KV_HEADS, kv_len, DIM, dtype=kv_dtype),
                randn(rows, KV_HEADS, kv_len, DIM, dtype=kv_dtype),
                torch.full((rows,), length - 1, device="cuda"),
                torch.ones(rows, kv_len, dtype=torch.bool, device="cuda"), torch.arange(rows, device="cuda"))
    tiles = split_tiles(rows, KV_HEADS, kv_len)
    forms = {"shipped": lambda: decode_attention(*operands, kv_len, DIM**-0.5)}
    for (chunk, form_tiles), warps, stages in itertools.product(
            ((CHUNK, tiles), (CHUNK, 2 * tiles), (2 * CHUNK, max(1, tiles // 2)), (2 * CHUNK, tiles),
             (4 * CHUNK, max(1, tiles // 4))), (2, 4, 8), (1, 2, 3)):
        forms[f"chunk {chunk} tiles {form_tiles} warps {warps} stages {stages}"] = (
            lambda chunk=chunk, form_tiles=form_tiles, warps=warps, stages=stages:
            attention(*operands, kv_len, chunk, form_tiles, warps, stages))
    outputs = {name: call().float() for name, call in forms.items()}
    times = dict(zip(forms, KernelTuner().time_calls(list(forms.values()))))
    gigabytes = 2 * rows * KV_HEADS * length * DIM * operands[1].element_size() / 1e9
    return {"rows": rows, "kv_len": kv_len, "length": length, "kv_dtype": str(kv_dtype), "kv_gb": gigabytes, "us": times,
            "tb_per_s": {name: gigabytes / us * 1e3 for name, us in times.items()},
            "max_abs_diff_vs_shipped": {name: (out - outputs["shipped"]).abs().max().item()
                                        for name, out in outputs.items()}}


def main() -> None:
    harness.require_cuda()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", metavar="ROWS:KV_LEN:LENGTH",
                        default=[":".join(map(str, shape)) for shape in SHAPES])
    parser.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto")
    args = parser.parse_args()
    kv_dtype = torch.float8_e4m3fn if args.kv_cache_dtype == "fp8" else torch.bfloat16
    generator = torch.Generator(device="cuda").manual_seed(0)
    rows_out = []
    for shape in [tuple(int(part) for part in text.split(":")) for text in args.shapes]:
        row = measure(*shape, generator, kv_dtype)
        rows_out.append(row)
        times = row["us"]
        best = min(times, key=times.get)
        print(f"{shape}: shipped {times['shipped']:.1f} us, best {best} {times[best]:.1f} us, "
              f"max diff {row['max_abs_diff_vs_shipped'][best]:.2e}", flush=True)
    harness.write_json({"rows": rows_out})


if __name__ == "__main__":
    main()
