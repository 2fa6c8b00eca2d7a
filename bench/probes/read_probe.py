"""How fast can a Triton kernel read a decode weight matrix, by tile shape? (H200 probe; JSON to $OUT.)

The FP8 GEMVs read about 2.5 TB/s on the 8B shapes whatever their compute (the FMA form's 8 instructions per weight,
the float16 `tl.dot` form's 2), while bf16's reach 3.7. This reads the matrices alone: each program XORs its K
range of the matrix, viewed as int32 words (no conversion, one logic op per 4 bytes), in tiles of `rows` x `bytes`
per loop step, and writes one word. Tilings: rows x bytes per step, K split into ranges (`split`), pipeline stages;
FP8 (one byte per weight) and bf16 matrices of the 2B and 8B gate/up and down_proj shapes. Timed as the tuner times
candidates (L2 flushed, between two small kernels).

Usage (H200): python bench/probes/read_probe.py
"""

import json
import os
from pathlib import Path

import torch
import triton
import triton.language as tl

from qwen3vl_static.tuner_qwen3vl_graph import KernelTuner

SHAPES = {"2b gate_up": (12288, 2048), "2b down_proj": (2048, 6144), "8b gate_up": (24576, 4096),
          "8b down_proj": (4096, 12288)}
TILES = [(64, 128), (64, 256), (32, 256), (16, 512), (16, 1024), (8, 1024), (8, 2048), (4, 2048)]  # rows x bytes


@triton.jit
def _read_kernel(words, out, n_rows, row_words, range_words, ROWS: tl.constexpr, WORDS: tl.constexpr,
                 STAGES: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    start = tl.program_id(1) * range_words
    acc = tl.zeros((ROWS, WORDS), tl.int32)
    for k in tl.range(start, start + range_words, WORDS, num_stages=STAGES):
        cols = k + tl.arange(0, WORDS)
        acc ^= tl.load(words + rows[:, None] * row_words + cols[None, :],
                       mask=(rows[:, None] < n_rows) & (cols[None, :] < row_words), other=0)
    tl.store(out + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1), tl.xor_sum(tl.xor_sum(acc, 1), 0))


def main():
    device = torch.device("cuda")
    tuner = KernelTuner()
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    report = {}
    for name, (n, k) in SHAPES.items():
        for dtype in (torch.float8_e4m3fn, torch.bfloat16):
            matrix = torch.randint(-100, 100, (n, k), device=device).to(dtype)
            words = matrix.view(torch.int32)
            row_words = words.shape[1]
            calls, labels = [], []
            for rows, tile_bytes in TILES:
                tile_words = tile_bytes // 4
                if tile_words > row_words:
                    continue
                programs = triton.cdiv(n, rows)
                for split in dict.fromkeys((1, max(1, 2 * sms // programs), max(1, 4 * sms // programs))):
                    range_words = triton.cdiv(triton.cdiv(row_words, split), tile_words) * tile_words
                    splits = triton.cdiv(row_words, range_words)
                    out = torch.empty(programs * splits, dtype=torch.int32, device=device)
                    for stages in (1, 3):
                        calls.append(lambda programs=programs, rows=rows, tile_words=tile_words, range_words=range_words, splits=splits,
                                     out=out, stages=stages: _read_kernel[(programs, splits)](
                            words, out, n, row_words, range_words, ROWS=rows, WORDS=tile_words, STAGES=stages,
                            num_warps=4))
                        labels.append(f"{rows}x{tile_bytes}B split{splits} st{stages}")
            times = tuner.time_calls(calls)
            gb = matrix.numel() * matrix.element_size() / 1e9
            ranked = sorted(zip(times, labels))
            key = f"{name} {str(dtype).removeprefix('torch.')}"
            report[key] = {"gb": gb, "tilings": {label: {"us": us, "tb_per_s": gb / us * 1e3} for us, label in ranked}}
            print(f"{key} ({gb * 1e3:.0f} MB):", ", ".join(f"{label} {us:.1f} us ({gb / us * 1e3:.2f} TB/s)"
                                                        for us, label in ranked[:5]),
                  f"| slowest {ranked[-1][1]} {ranked[-1][0]:.1f} us", flush=True)
    out = Path(os.environ.get("OUT", "bench/results"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "read_probe.json").write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                                     "results": report}, indent=1))


if __name__ == "__main__":
    main()
