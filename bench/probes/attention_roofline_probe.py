"""What holds flash-decoding below the KV cache's bandwidth at many rows? (GPU; JSON to $OUT.)

At 64 rows over 336 of 512 slots the splits kernel reads 88 MB a layer in ~48 µs (H100: 1.85 TB/s of 3.35; H200:
~1.8 of 4.8), and no launch setting, tile count or pre-wait prologue moved it (`attention_launch_probe.py`,
`attention_probe.py`, experiments.md). This times, on the same grid and tiles as the shipped launch, forms that each
take one part of a program's work away:
- `read only`: each tile's K and V loaded as the shipped kernel loads them (the same masks) and summed, no softmax
  and no dot: the floor of this launch shape's reads;
- `no flags`: the shipped kernel without the attendable flags' loads (every written slot read): what they cost;
- `bf16 P`: the probabilities rounded to bfloat16 for the P·V dot instead of a float32 (TF32) dot on V widened
  (numerics change: the largest difference is reported);
- `no P·V`: the scores' softmax without the P·V dot (the output is the row sums only): what that dot costs.
Each is timed alone as the tuner times a candidate (`KernelTuner().time_calls`: between two PDL neighbours, L2
flushed), splits and merge together as in the step; the merge alone is timed too.
Run: python bench/probes/attention_roofline_probe.py [--shapes ROWS:KV_LEN:LENGTH ...]
"""

import argparse

import torch
import triton

import harness
from qwen3vl_static.ops_attention_qwen3vl_graph import CHUNK, MERGE_BLOCK, _merge_kernel, decode_attention, split_tiles
from qwen3vl_static.triton_qwen3vl_graph import _wait_then_release, launch, tl
from qwen3vl_static.tuner_qwen3vl_graph import KernelTuner

HEADS, KV_HEADS, DIM = 16, 8, 128
SHAPES = [(64, 512, 336), (256, 512, 336), (512, 512, 336), (32, 1024, 700), (1, 8192, 7880)]
MODES = {"read only": 1, "no flags": 2, "bf16 P": 3, "no P·V": 4}


@triton.jit
def _splits_kernel(
    q, keys, values, cache_lens, attendable, cache_rows, part_out, part_max, part_sum, scale,
    stride_cache_row, stride_cache_head, stride_cache_slot, stride_attendable,
    SPLITS, CHUNK: tl.constexpr, TILES: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, MODE: tl.constexpr, PDL: tl.constexpr,
):
    """The shipped splits kernel with one part taken away (MODE, see the module docstring)."""
    _wait_then_release(PDL)
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    group = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, HEAD_DIM)
    length = tl.load(cache_lens + row)
    cache_row = tl.load(cache_rows + row).to(tl.int64)
    heads = kv_head * GROUP + group
    queries = tl.load(q + (row * KV_HEADS * GROUP + heads[:, None]) * HEAD_DIM + dims[None, :],
                      mask=group[:, None] < GROUP, other=0.0)
    first = split * TILES * CHUNK
    best = tl.full((GROUP_PAD,), float("-inf"), tl.float32)
    total = tl.zeros((GROUP_PAD,), tl.float32)
    acc = tl.zeros((GROUP_PAD, HEAD_DIM), tl.float32)
    for tile in range(0, tl.minimum(TILES, tl.cdiv(length + 1 - first, CHUNK))):
        slots = first + tile * CHUNK + tl.arange(0, CHUNK)
        written = slots <= length
        cache = (cache_row * stride_cache_row + kv_head * stride_cache_head + slots[:, None] * stride_cache_slot
                 + dims[None, :])
        if MODE == 2:
            readable = written
        else:
            readable = tl.load(attendable + row * stride_attendable + slots, mask=written, other=0) != 0
        k = tl.load(keys + cache, mask=readable[:, None], other=0.0).to(queries.dtype)
        v = tl.load(values + cache, mask=readable[:, None], other=0.0)
        if MODE == 1:
            acc += tl.sum(k.to(tl.float32) + v.to(tl.float32), axis=0)[None, :]
        else:
            scores = tl.dot(queries, tl.trans(k)).to(tl.float32) * scale
            scores = tl.where(readable[None, :], scores, float("-inf"))
            new_best = tl.maximum(best, tl.max(scores, axis=1))
            base = tl.where(new_best == float("-inf"), 0.0, new_best)
            weights = tl.exp(scores - base[:, None])
            correction = tl.exp(best - base)
            total = total * correction + tl.sum(weights, axis=1)
            if MODE == 3:
                acc = acc * correction[:, None] + tl.dot(weights.to(v.dtype), v).to(tl.float32)
            elif MODE == 4:
                acc = acc * correction[:, None] + tl.sum(v.to(tl.float32), axis=0)[None, :]
            else:
                acc = acc * correction[:, None] + tl.dot(weights, v.to(tl.float32))
            best = new_best
    part = ((row * KV_HEADS + kv_head) * SPLITS + split) * GROUP + group
    live = group < GROUP
    tl.store(part_out + part[:, None] * HEAD_DIM + dims[None, :], acc, mask=live[:, None])
    tl.store(part_max + part, best, mask=live)
    tl.store(part_sum + part, total, mask=live)


def partials(q, kv_len):
    rows, tiles = q.shape[0], split_tiles(q.shape[0], KV_HEADS, kv_len)
    splits = triton.cdiv(kv_len, CHUNK * tiles)
    return tiles, splits, (torch.empty(rows * HEADS * splits, DIM, dtype=torch.float32, device=q.device),
                           torch.zeros(rows * HEADS * splits, dtype=torch.float32, device=q.device),
                           torch.ones(rows * HEADS * splits, dtype=torch.float32, device=q.device))


def form(mode, q, keys, values, cache_lens, attendable, cache_rows, kv_len):
    """The shipped launch (split rule, grid, merge) with the splits kernel in `mode`."""
    rows = q.shape[0]
    tiles, splits, (part_out, part_max, part_sum) = partials(q, kv_len)
    launch(_splits_kernel, (rows, KV_HEADS, splits), q, keys, values, cache_lens, attendable, cache_rows,
           part_out, part_max, part_sum, DIM**-0.5, keys.stride(0), keys.stride(1), keys.stride(2),
           attendable.stride(0), splits, CHUNK=CHUNK, TILES=tiles, GROUP=HEADS // KV_HEADS, GROUP_PAD=16,
           KV_HEADS=KV_HEADS, HEAD_DIM=DIM, MODE=mode)
    out = torch.empty(rows, HEADS * DIM, dtype=q.dtype, device=q.device)
    launch(_merge_kernel, (rows * HEADS,), part_out, part_max, part_sum, out, splits, GROUP=HEADS // KV_HEADS,
           HEAD_DIM=DIM, MERGE_BLOCK=MERGE_BLOCK)
    return out


def merge_only(q, kv_len, buffers):
    """The merge alone over partials of this launch shape."""
    _, splits, (part_out, part_max, part_sum) = buffers
    out = torch.empty(q.shape[0], HEADS * DIM, dtype=q.dtype, device=q.device)
    launch(_merge_kernel, (q.shape[0] * HEADS,), part_out, part_max, part_sum, out, splits, GROUP=HEADS // KV_HEADS,
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

        operands = (randn(rows, HEADS, DIM), randn(rows, KV_HEADS, kv_len, DIM), randn(rows, KV_HEADS, kv_len, DIM),
                    torch.full((rows,), length - 1, device="cuda"),
                    torch.ones(rows, kv_len, dtype=torch.bool, device="cuda"), torch.arange(rows, device="cuda"))
        buffers = partials(operands[0], kv_len)
        calls = {"shipped": lambda: decode_attention(*operands, kv_len, DIM**-0.5),
                 **{name: (lambda mode=mode: form(mode, *operands, kv_len)) for name, mode in MODES.items()},
                 "merge alone": lambda: merge_only(operands[0], kv_len, buffers)}
        outputs = {name: call().float() for name, call in calls.items()}
        times = dict(zip(calls, KernelTuner().time_calls(list(calls.values()))))
        gigabytes = 2 * rows * KV_HEADS * length * DIM * 2 / 1e9
        results.append({"rows": rows, "kv_len": kv_len, "length": length, "kv_gb": gigabytes,
                        "tiles": buffers[0], "programs": rows * KV_HEADS * buffers[1], "us": times,
                        "tb_per_s": {name: gigabytes / us * 1e3 for name, us in times.items() if name != "merge alone"},
                        "max_abs_diff_vs_shipped": {name: (outputs[name] - outputs["shipped"]).abs().max().item()
                                                    for name in ("no flags", "bf16 P")}})
        print(f"{rows} rows at {length} of {kv_len} slots ({gigabytes * 1e3:.0f} MB): "
              + ", ".join(f"{name} {us:.1f} us" for name, us in times.items()), flush=True)
    harness.write_json({"rows": results})


if __name__ == "__main__":
    main()
