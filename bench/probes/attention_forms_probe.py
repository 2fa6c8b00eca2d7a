"""Does flash-decoding's first pass read the KV cache faster without its float32 detour? (H200 probe; JSON to $OUT.)

The splits kernel zeroed the slots a row does not attend to in registers after loading K and V (it now masks its
loads: this probe's finding), and takes P·V as a float32 `tl.dot` (V converted to float32, which Triton runs in TF32).
Two changes, each a flag of this probe's copy of the kernel as it was:
- MASK_IN_LOAD: the slots a row does not attend to are left out of the loads themselves (their attendable flags are
  loaded first), so K and V go from the copy to the MMA untouched;
- P_FORM: 0 P·V in float32 (shipped); 1 P as two bf16 terms (P's bf16 rounding, then the rest rounded) against V
  in bf16, about 16 bits of P (TF32 keeps 11); 2 P in bf16 alone (8 bits; for comparison).
Timed as the tuner times a candidate, with the shipped merge, on the shapes where the step spends most in attention,
at `split_tiles`' tiles and twice as many, 2 to 4 stages, 2 or 4 warps. Reports microseconds, K/V bandwidth, and each form's
largest difference from float32 attention over the same bf16 K/V (the package's reference ops; rows with left padding
included). Launched by `attention_launch_probe.py`'s `attention`.
Run: python bench/probes/attention_forms_probe.py
"""

import importlib.util
import json
import os
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

if not torch.cuda.is_available():
    sys.exit("attention_forms_probe.py needs a CUDA device.")

from qwen3vl_static.ops_attention_qwen3vl_graph import (
    CHUNK,
    attention_context_reference,
    decode_attention,
    decode_attention_reference,
    split_tiles,
)
from qwen3vl_static.triton_qwen3vl_graph import _wait_then_release
from qwen3vl_static.tuner_qwen3vl_graph import KernelTuner

# The launcher of the splits kernel at given settings, then the shipped merge.
spec = importlib.util.spec_from_file_location("attention_launch_probe", Path(__file__).with_name("attention_launch_probe.py"))
launch_probe = importlib.util.module_from_spec(spec)
spec.loader.exec_module(launch_probe)

HEADS, KV_HEADS, DIM = 16, 8, 128
SHAPES = [(64, 512, 336), (32, 1024, 700), (8, 4096, 4080), (1, 8192, 7880)]


@triton.jit
def _splits_kernel(
    q, keys, values, cache_lens, attendable, cache_rows, part_out, part_max, part_sum, scale,
    stride_cache_row, stride_cache_head, stride_cache_slot, stride_attendable,
    SPLITS, CHUNK: tl.constexpr, TILES: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, MASK_IN_LOAD: tl.constexpr, P_FORM: tl.constexpr,
    PDL: tl.constexpr,
):
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
    for tile in range(tl.minimum(TILES, tl.cdiv(length + 1 - first, CHUNK))):
        slots = first + tile * CHUNK + tl.arange(0, CHUNK)
        written = slots <= length
        cache = (cache_row * stride_cache_row + kv_head * stride_cache_head + slots[:, None] * stride_cache_slot
                 + dims[None, :])
        readable = tl.load(attendable + row * stride_attendable + slots, mask=written, other=0) != 0
        if MASK_IN_LOAD:
            k = tl.load(keys + cache, mask=readable[:, None], other=0.0)
            v = tl.load(values + cache, mask=readable[:, None], other=0.0)
        else:
            k = tl.load(keys + cache, mask=written[:, None], other=0.0)
            v = tl.load(values + cache, mask=written[:, None], other=0.0)
            k = tl.where(readable[:, None], k, 0.0)
            v = tl.where(readable[:, None], v, 0.0)
        scores = tl.dot(queries, tl.trans(k)).to(tl.float32) * scale
        scores = tl.where(readable[None, :], scores, float("-inf"))
        new_best = tl.maximum(best, tl.max(scores, axis=1))
        base = tl.where(new_best == float("-inf"), 0.0, new_best)
        weights = tl.exp(scores - base[:, None])
        correction = tl.exp(best - base)
        total = total * correction + tl.sum(weights, axis=1)
        acc = acc * correction[:, None]
        if P_FORM == 0:
            acc += tl.dot(weights, v.to(tl.float32))
        elif P_FORM == 1:
            high = weights.to(v.dtype)
            low = (weights - high.to(tl.float32)).to(v.dtype)
            acc = tl.dot(low, v, tl.dot(high, v, acc))
        else:
            acc = tl.dot(weights.to(v.dtype), v, acc)
        best = new_best
    part = ((row * KV_HEADS + kv_head) * SPLITS + split) * GROUP + group
    live = group < GROUP
    tl.store(part_out + part[:, None] * HEAD_DIM + dims[None, :], acc, mask=live[:, None])
    tl.store(part_max + part, best, mask=live)
    tl.store(part_sum + part, total, mask=live)


def measure(rows, kv_len, length, generator) -> dict:
    def randn(*shape):
        return torch.randn(*shape, generator=generator, device="cuda", dtype=torch.bfloat16)

    attendable = torch.ones(rows, kv_len, dtype=torch.bool, device="cuda")
    attendable[::2, :7] = False  # left padding in every other row
    operands = (randn(rows, HEADS, DIM) * 4, randn(rows, KV_HEADS, kv_len, DIM), randn(rows, KV_HEADS, kv_len, DIM),
                torch.full((rows,), length - 1, device="cuda"), attendable, torch.arange(rows, device="cuda"))
    tiles = split_tiles(rows, KV_HEADS, kv_len)
    forms = {"shipped": lambda: decode_attention(*operands, kv_len, DIM**-0.5)}
    variants = [(tiles, False, 0, 3, 4), (tiles, True, 0, 3, 4), (tiles, False, 1, 3, 4), (tiles, True, 1, 3, 4),
                (tiles, True, 1, 2, 4), (tiles, True, 1, 4, 4), (tiles, True, 1, 3, 2), (tiles, True, 1, 2, 2),
                (2 * tiles, True, 1, 3, 4), (2 * tiles, True, 1, 2, 4), (tiles, True, 2, 3, 4)]
    for form_tiles, mask_in_load, p_form, stages, warps in variants:
        name = f"tiles {form_tiles} mask_in_load {int(mask_in_load)} p_form {p_form} stages {stages} warps {warps}"
        forms[name] = (lambda form_tiles=form_tiles, mask_in_load=mask_in_load, p_form=p_form, stages=stages,
                       warps=warps: launch_probe.attention(*operands, kv_len, CHUNK, form_tiles, warps, stages,
                                                           _splits_kernel, MASK_IN_LOAD=mask_in_load, P_FORM=p_form))
    mask, cache_rows = attention_context_reference(attendable, operands[-1], operands[3], kv_len, torch.float32)
    reference = decode_attention_reference(*(tensor.float() for tensor in operands[:3]), mask, cache_rows, kv_len,
                                           DIM**-0.5)
    errors = {name: (call().float() - reference).abs().max().item() for name, call in forms.items()}
    times = dict(zip(forms, KernelTuner().time_calls(list(forms.values()))))
    gigabytes = 2 * rows * KV_HEADS * length * DIM * 2 / 1e9
    return {"rows": rows, "kv_len": kv_len, "length": length, "kv_gb": gigabytes, "us": times,
            "tb_per_s": {name: gigabytes / us * 1e3 for name, us in times.items()},
            "max_abs_error_vs_float32": errors}


def main() -> None:
    generator = torch.Generator(device="cuda").manual_seed(0)
    rows_out = []
    for shape in SHAPES:
        row = measure(*shape, generator)
        rows_out.append(row)
        for name, us in row["us"].items():
            print(f"{shape} {name:45s} {us:7.1f} us {row['tb_per_s'][name]:5.2f} TB/s "
                  f"err {row['max_abs_error_vs_float32'][name]:.2e}", flush=True)
    out = Path(os.environ.get("OUT", "bench/results")) / "attention-forms-probe.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                               "command": "python bench/probes/attention_forms_probe.py", "rows": rows_out},
                              indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
