"""How fast does flash-decoding read the KV cache, by tiles per program? (H200; JSON to $OUT.)

The decode attention kernels alone (2B heads: 16 query heads, 8 KV heads of 128) over each row's `length` written
slots of a `kv_len` graph bucket, for programs of every tile count from 1 to 16 (64 slots a tile; `split_tiles` takes
powers of two), timed as the tuner times a candidate. Reports microseconds, the bandwidth of the K/V bytes read, each
form's programs that have slots to read (how full their last wave is on the SMs), and each form's largest difference
from the 1-tile form.
Run: python bench/probes/attention_probe.py
"""

import torch

import harness
from qwen3vl_static.ops_attention_qwen3vl_graph import decode_attention
from qwen3vl_static.tuner_qwen3vl_graph import KernelTuner

HEADS, KV_HEADS, DIM = 16, 8, 128
SHAPES = [(1, 1024, 592), (4, 1024, 592), (8, 1024, 592), (64, 512, 336), (1, 8192, 7880), (8, 4096, 4080),
          (8, 8192, 4080), (32, 1024, 700)]  # (rows, kv_len, length)
TILES = list(range(1, 17))


def measure(rows, kv_len, length, generator) -> dict:
    def randn(*shape):
        return torch.randn(*shape, generator=generator, device="cuda", dtype=torch.bfloat16)

    q, keys, values = randn(rows, HEADS, DIM), randn(rows, KV_HEADS, kv_len, DIM), randn(rows, KV_HEADS, kv_len, DIM)
    cache_lens = torch.full((rows,), length - 1, device="cuda")
    attendable = torch.ones(rows, kv_len, dtype=torch.bool, device="cuda")
    cache_rows = torch.arange(rows, device="cuda")
    calls = [lambda tiles=tiles: decode_attention(q, keys, values, cache_lens, attendable, cache_rows, kv_len, DIM**-0.5,
                                                  tiles) for tiles in TILES]
    outputs = [call().float() for call in calls]
    times = KernelTuner().time_calls(calls)
    gigabytes = rows * length * KV_HEADS * DIM * 2 * 2 / 1e9
    return {"rows": rows, "kv_len": kv_len, "length": length, "kv_gb": gigabytes,
            "us": dict(zip(TILES, times)), "tb_per_s": {tiles: gigabytes / us * 1e3 for tiles, us in zip(TILES, times)},
            "programs_with_slots": {tiles: rows * KV_HEADS * -(-length // (64 * tiles)) for tiles in TILES},
            "max_abs_diff_vs_1_tile": {tiles: (out - outputs[0]).abs().max().item() for tiles, out in zip(TILES, outputs)}}


def main() -> None:
    harness.require_cuda()
    generator = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for shape in SHAPES:
        rows.append(measure(*shape, generator))
        times = rows[-1]["us"]
        best = min(times, key=times.get)
        print(f"{shape}: 1 tile {times[1]:.1f} us, best {best} tiles {times[best]:.1f} us", flush=True)
    harness.write_json({"rows": rows})


if __name__ == "__main__":
    main()
