"""How fast does flash-decoding read the KV cache, by split size? (H200 probe; JSON to $OUT.)

The decode attention kernels alone (2B shapes: 16 query heads, 8 KV heads of 128) over each row's `length` written
slots of a `kv_len` graph bucket, for programs of every tile count from 1 to 16 (64 slots a tile; `split_tiles` takes
powers of two), timed as the tuner times a candidate (its own CUDA graph between two small kernels, L2 flushed, median
of 20). Reports microseconds, the bandwidth of the K/V bytes read, each form's programs that have slots to read (how
full their last wave is on the SMs may matter more than the tile count: batch 1 at 7,880 slots has 248 at 4 tiles, 336
at 3), and each form's largest difference from the 1-tile form.
Run: python bench/probes/attention_probe.py
"""

import json
import os
import sys

import torch

if not torch.cuda.is_available():
    sys.exit("attention_probe.py needs a CUDA device.")

from qwen3vl_static.ops_attention_qwen3vl_graph import decode_attention
from qwen3vl_static.tuner_qwen3vl_graph import KernelTuner

HEADS, KV_HEADS, DIM = 16, 8, 128
SHAPES = [(1, 1024, 592), (4, 1024, 592), (8, 1024, 592), (64, 512, 336), (1, 8192, 7880), (8, 4096, 4080),
          (8, 8192, 4080), (32, 1024, 700)]
TILES = list(range(1, 17))

generator = torch.Generator(device="cuda").manual_seed(0)
rows_out = []
for rows, kv_len, length in SHAPES:
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
    row = {"rows": rows, "kv_len": kv_len, "length": length, "kv_gb": gigabytes,
           "us": dict(zip(TILES, times)), "tb_per_s": {tiles: gigabytes / us * 1e3 for tiles, us in zip(TILES, times)},
           "programs_with_slots": {tiles: rows * KV_HEADS * -(-length // (64 * tiles)) for tiles in TILES},
           "max_abs_diff_vs_1_tile": {tiles: (out - outputs[0]).abs().max().item() for tiles, out in zip(TILES, outputs)}}
    rows_out.append(row)
    print(json.dumps(row), flush=True)
out = os.environ.get("OUT", "bench/results")
os.makedirs(out, exist_ok=True)
with open(os.path.join(out, "attention-probe.json"), "w") as file:
    json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows_out}, file, indent=1)
