"""Does flash-decoding gain from loading what it can before its PDL wait? (H200; JSON to $OUT.)

Each program of the shipped splits kernel waits for its predecessor (the QKV/RoPE/cache write) first, then loads its
row's length and cache row, then each tile's attendable flags, then the tile's K/V: three memory latencies in a row
before its first MMA, paid by every program of every wave. The predecessor writes none of the length, the cache row or
the flags, so the form here loads them before the wait (during the predecessor's tail), and each next tile's flags
while the current tile's K/V are read: one latency (the K/V) after the wait. Numerics are the shipped kernel's.

Timed alone (`KernelTuner().time_calls`: between two PDL neighbours, L2 flushed) on the shapes where the step spends
most in attention, and in the whole step (decode ms/step, each form in its own bf16 2B model; the shipped form first
and again last for the run-to-run spread).
A third form also does its products on the CUDA cores (FMA) instead of MMA tiles padded from the 2-head query group
to 16 rows, so K/V need no shared memory.
Run: python bench/probes/attention_prologue_probe.py [--step-forms prologue "prologue fma"]
On the CPU, `TRITON_INTERPRET=1 python bench/probes/attention_prologue_probe.py --check` compares the form with the
torch reference on small shapes with left padding and parked rows.
"""

import argparse
import itertools
from contextlib import contextmanager

import torch

import harness
from qwen3vl_static import ops_qwen3vl_graph
from qwen3vl_static.bench import LONG
from qwen3vl_static.ops_attention_qwen3vl_graph import (
    CHUNK,
    MERGE_BLOCK,
    _merge_kernel,
    attention_context_reference,
    decode_attention,
    decode_attention_reference,
    split_tiles,
)
from qwen3vl_static.triton_qwen3vl_graph import _wait_then_release, launch, tl, triton
from qwen3vl_static.tuner_qwen3vl_graph import KernelTuner

HEADS, KV_HEADS, DIM = 16, 8, 128
SHAPES = [(64, 512, 336), (256, 512, 336), (512, 512, 336), (32, 1024, 700), (8, 4096, 4080), (1, 8192, 7880),
          (1, 1024, 576), (8, 1024, 576)]  # (rows, kv_len, length)
STEP_SHAPES = [(64, 256), (256, 256), (1, 512)]  # (batch, prompt tokens)


@triton.jit
def _prologue_kernel(
    q, keys, values, cache_lens, attendable, cache_rows, part_out, part_max, part_sum, scale,
    stride_cache_row, stride_cache_head, stride_cache_slot, stride_attendable, kv_len,
    SPLITS, CHUNK: tl.constexpr, TILES: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, FMA: tl.constexpr, PDL: tl.constexpr,
):
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    group = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, HEAD_DIM)
    first = split * TILES * CHUNK
    slots = first + tl.arange(0, CHUNK)
    # Not written by the predecessor: loaded during its tail. The flags are read up to the bucket's end, in bounds.
    length = tl.load(cache_lens + row)
    cache_row = tl.load(cache_rows + row).to(tl.int64)
    flags = tl.load(attendable + row * stride_attendable + slots, mask=slots < kv_len, other=0)
    _wait_then_release(PDL)
    heads = kv_head * GROUP + group
    queries = tl.load(q + (row * KV_HEADS * GROUP + heads[:, None]) * HEAD_DIM + dims[None, :],
                      mask=group[:, None] < GROUP, other=0.0)
    best = tl.full((GROUP_PAD,), float("-inf"), tl.float32)
    total = tl.zeros((GROUP_PAD,), tl.float32)
    acc = tl.zeros((GROUP_PAD, HEAD_DIM), tl.float32)
    for tile in range(0, tl.minimum(TILES, tl.cdiv(length + 1 - first, CHUNK))):
        readable = (flags != 0) & (slots <= length)
        following = slots + CHUNK
        flags = tl.load(attendable + row * stride_attendable + following, mask=following < kv_len, other=0)
        cache = (cache_row * stride_cache_row + kv_head * stride_cache_head + slots[:, None] * stride_cache_slot
                 + dims[None, :])
        k = tl.load(keys + cache, mask=readable[:, None], other=0.0).to(queries.dtype)
        v = tl.load(values + cache, mask=readable[:, None], other=0.0)
        if FMA:  # on the CUDA cores, the query group unpadded: K/V go from global memory to registers, no MMA tiles
            scores = tl.sum(queries.to(tl.float32)[:, None, :] * k.to(tl.float32)[None, :, :], axis=2) * scale
        else:
            scores = tl.dot(queries, tl.trans(k)).to(tl.float32) * scale
        scores = tl.where(readable[None, :], scores, float("-inf"))
        new_best = tl.maximum(best, tl.max(scores, axis=1))
        base = tl.where(new_best == float("-inf"), 0.0, new_best)
        weights = tl.exp(scores - base[:, None])
        correction = tl.exp(best - base)
        total = total * correction + tl.sum(weights, axis=1)
        if FMA:
            acc = acc * correction[:, None] + tl.sum(weights[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)
        else:
            acc = acc * correction[:, None] + tl.dot(weights, v.to(tl.float32))
        best = new_best
        slots = following
    part = ((row * KV_HEADS + kv_head) * SPLITS + split) * GROUP + group
    live = group < GROUP
    tl.store(part_out + part[:, None] * HEAD_DIM + dims[None, :], acc, mask=live[:, None])
    tl.store(part_max + part, best, mask=live)
    tl.store(part_sum + part, total, mask=live)


def prologue_attention(q, keys, values, cache_lens, attendable, cache_rows, kv_len, scale, tiles=None, fma=False):
    """`decode_attention` with the prologue form of the splits kernel (the same split rule and merge); `fma`: its
    products on the CUDA cores in tiles of half the slots (twice as many a program: the same splits)."""
    rows, heads, head_dim = q.shape
    kv_heads = keys.shape[1]
    group = heads // kv_heads
    tiles = tiles or split_tiles(rows, kv_heads, kv_len)
    chunk, tiles = (CHUNK // 2, 2 * tiles) if fma else (CHUNK, tiles)
    splits = triton.cdiv(kv_len, chunk * tiles)
    part_out = torch.empty(rows * heads * splits, head_dim, dtype=torch.float32, device=q.device)
    part_max = torch.empty(rows * heads * splits, dtype=torch.float32, device=q.device)
    part_sum = torch.empty_like(part_max)
    launch(_prologue_kernel, (rows, kv_heads, splits),
           q, keys, values, cache_lens, attendable, cache_rows, part_out, part_max, part_sum, scale,
           keys.stride(0), keys.stride(1), keys.stride(2), attendable.stride(0), min(kv_len, attendable.shape[1]),
           splits, CHUNK=chunk, TILES=tiles, GROUP=group,
           GROUP_PAD=triton.next_power_of_2(group) if fma else max(16, triton.next_power_of_2(group)),
           KV_HEADS=kv_heads, HEAD_DIM=head_dim, FMA=fma)
    out = torch.empty(rows, heads * head_dim, dtype=q.dtype, device=q.device)
    launch(_merge_kernel, (rows * heads,), part_out, part_max, part_sum, out, splits, GROUP=group,
           HEAD_DIM=head_dim, MERGE_BLOCK=MERGE_BLOCK)
    return out


FORMS = {"shipped": decode_attention, "prologue": prologue_attention,
         "prologue fma": lambda *args, **kwargs: prologue_attention(*args, **kwargs, fma=True)}


def operands(rows, kv_len, length, device, generator, slots=None, dtype=torch.bfloat16):
    """Random q/K/V for `rows` rows of `length` written slots each in caches of `slots` (default `kv_len`)."""
    slots = slots or kv_len

    def randn(*shape):
        return torch.randn(*shape, generator=generator, device=device, dtype=torch.float32).to(dtype)

    return (randn(rows, HEADS, DIM), randn(rows, KV_HEADS, slots, DIM), randn(rows, KV_HEADS, slots, DIM),
            torch.full((rows,), length - 1, device=device), torch.ones(rows, slots, dtype=torch.bool, device=device),
            torch.arange(rows, device=device))


def check() -> None:
    """The prologue form against the torch reference (CPU, Triton's interpreter): uneven lengths, left padding, a
    parked row (its first slots not attendable), cache rows out of order, buckets shorter than the cache; in float32,
    which the interpreter computes as the GPU does (its bfloat16 dot does not)."""
    generator = torch.Generator().manual_seed(0)
    for rows, kv_len, slots in ((3, 64, 64), (5, 256, 320), (2, 1024, 1024)):
        q, keys, values, cache_lens, attendable, cache_rows = operands(rows, kv_len, 1, "cpu", generator, slots,
                                                                       torch.float32)
        cache_lens = torch.randint(0, kv_len, (rows,), generator=generator)
        attendable[0, : int(cache_lens[0]) // 2] = False  # left padding
        attendable[-1, : int(cache_lens[-1]) // 3] = False  # parked
        cache_rows = cache_rows.flip(0)
        mask, _ = attention_context_reference(attendable, cache_rows, cache_lens, kv_len, torch.float32)
        expected = decode_attention_reference(q, keys, values, mask, cache_rows, kv_len, DIM**-0.5)
        for row, length in enumerate(cache_lens.tolist()):  # unwritten slots hold NaN: a kernel that reads one shows
            keys[cache_rows[row], :, length + 1:] = float("nan")
            values[cache_rows[row], :, length + 1:] = float("nan")
        for (name, form), tiles in itertools.product(FORMS.items(), (1, 3)):
            got = form(q, keys, values, cache_lens, attendable, cache_rows, kv_len, DIM**-0.5, tiles)
            error = (got.float() - expected.float()).abs().max().item()
            print(f"rows {rows} kv_len {kv_len} slots {slots} tiles {tiles}: {name} max |diff| {error:.2e}")
            assert error < 1e-4, (name, tiles, error)


@contextmanager
def form_in_step(form):
    """The decode step's attention (`ops_qwen3vl_graph.decode_attention`) replaced by `form` while a model is built,
    captured and timed."""
    ops_qwen3vl_graph.decode_attention = form
    try:
        yield
    finally:
        ops_qwen3vl_graph.decode_attention = decode_attention


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with the torch reference and stop")
    parser.add_argument("--step-forms", nargs="*", default=["prologue"], choices=list(FORMS)[1:],
                        help="forms timed in the whole step beside the shipped one (none: only the kernels alone)")
    args = parser.parse_args()
    if args.check:
        return check()
    harness.require_cuda()
    generator = torch.Generator(device="cuda").manual_seed(0)
    alone, step = [], []
    for rows, kv_len, length in SHAPES:
        args_ = operands(rows, kv_len, length, "cuda", generator)
        calls = {name: (lambda form=form: form(*args_, kv_len, DIM**-0.5)) for name, form in FORMS.items()}
        outputs = {name: call().float() for name, call in calls.items()}
        times = dict(zip(calls, KernelTuner().time_calls(list(calls.values()))))
        gigabytes = 2 * rows * KV_HEADS * length * DIM * 2 / 1e9
        alone.append({"rows": rows, "kv_len": kv_len, "length": length, "us": times,
                      "tb_per_s": {name: gigabytes / us * 1e3 for name, us in times.items()},
                      "max_abs_diff_vs_shipped": {name: (out - outputs["shipped"]).abs().max().item()
                                                  for name, out in outputs.items()}})
        print(f"alone: {rows} rows at {length} of {kv_len} slots: "
              + ", ".join(f"{name} {us:.1f} us" for name, us in times.items()), flush=True)
    if args.step_forms:
        for batch, context in STEP_SHAPES:
            row = {"batch_size": batch, "context_tokens": context, "ms_per_step": {}}
            for name in ("shipped", *args.step_forms, "shipped again"):
                with form_in_step(FORMS[name.removesuffix(" again")]):
                    row["ms_per_step"][name] = harness.decode_ms(
                        batch, context, max_batch_size=max(8, batch),
                        static_cache_len=8192 if context > 1024 else 1 << (context + LONG - 1).bit_length())
                print(f"step: batch {batch} at {context}: {name} {row['ms_per_step'][name]:.3f} ms/step", flush=True)
            step.append(row)
    harness.write_json({"alone": alone, "step": step})


if __name__ == "__main__":
    main()
