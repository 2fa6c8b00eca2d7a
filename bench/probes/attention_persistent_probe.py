"""Does flash-decoding read faster at many rows as a persistent launch? (GPU; JSON to $OUT.)

The shipped splits kernel launches a program per (row, KV head, split): at 64 rows over 512 slots 2,048 programs of
one or two 64-slot tiles, about three resident an SM (shared memory), so the launch runs in ~5 waves and each
program's loads start only when it does. Here a fixed grid (`--programs-per-sm` an SM) walks the same work items, each
program its share in turn: as one loop over (item, tile), which the compiler's software pipelining can load ahead
across items (every tile of an item computed, those past the token without effect), or item by item over its tiles
up to the token. Per tile the arithmetic and its order are the
shipped kernel's, and so are the splits and the merge, so the output is the shipped output bit for bit (checked).

Timed alone as the tuner times a candidate (`KernelTuner().time_calls`), and in the whole decode step (decode
ms/step, each form in its own bf16 2B model, the shipped form first and again last).
Run: python bench/probes/attention_persistent_probe.py [--programs-per-sm 2 4 8] [--no-step]
On the CPU, `TRITON_INTERPRET=1 python bench/probes/attention_persistent_probe.py --check` compares it with the
shipped kernel on small shapes with left padding, parked rows and unwritten slots holding NaN.
"""

import argparse
import itertools
from contextlib import contextmanager
from functools import partial

import torch

import harness
from qwen3vl_static import ops_qwen3vl_graph
from qwen3vl_static.bench import LONG
from qwen3vl_static.ops_attention_qwen3vl_graph import CHUNK, MERGE_BLOCK, _merge_kernel, decode_attention, split_tiles
from qwen3vl_static.triton_qwen3vl_graph import _wait_then_release, launch, tl, triton
from qwen3vl_static.tuner_qwen3vl_graph import KernelTuner

HEADS, KV_HEADS, DIM = 16, 8, 128
SHAPES = [(64, 512, 336), (256, 512, 336), (512, 512, 336), (32, 1024, 700), (8, 4096, 4080), (1, 8192, 7880),
          (8, 1024, 576)]  # (rows, kv_len, length)
STEP_SHAPES = [(64, 256), (256, 256), (8, 512)]  # (batch, prompt tokens)


@triton.jit
def _tile(q, keys, values, attendable, scale, row, kv_head, split, tile, length, cache_row, best, total, acc,
          stride_cache_row, stride_cache_head, stride_cache_slot, stride_attendable, CHUNK: tl.constexpr,
          TILES: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, KV_HEADS: tl.constexpr,
          HEAD_DIM: tl.constexpr):
    """One tile of a split as the shipped kernel computes it; a tile past the new token's slot loads nothing and
    changes nothing (the shipped kernel skips it)."""
    group = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, HEAD_DIM)
    heads = kv_head * GROUP + group
    queries = tl.load(q + (row * KV_HEADS * GROUP + heads[:, None]) * HEAD_DIM + dims[None, :],
                      mask=group[:, None] < GROUP, other=0.0)
    slots = (split * TILES + tile) * CHUNK + tl.arange(0, CHUNK)
    written = slots <= length
    cache = (cache_row * stride_cache_row + kv_head * stride_cache_head + slots[:, None] * stride_cache_slot
             + dims[None, :])
    readable = tl.load(attendable + row * stride_attendable + slots, mask=written, other=0) != 0
    k = tl.load(keys + cache, mask=readable[:, None], other=0.0).to(queries.dtype)
    v = tl.load(values + cache, mask=readable[:, None], other=0.0)
    scores = tl.dot(queries, tl.trans(k)).to(tl.float32) * scale
    scores = tl.where(readable[None, :], scores, float("-inf"))
    new_best = tl.maximum(best, tl.max(scores, axis=1))
    base = tl.where(new_best == float("-inf"), 0.0, new_best)
    weights = tl.exp(scores - base[:, None])
    correction = tl.exp(best - base)
    any_written = (split * TILES + tile) * CHUNK <= length
    total = tl.where(any_written, total * correction + tl.sum(weights, axis=1), total)
    acc = tl.where(any_written, acc * correction[:, None] + tl.dot(weights, v.to(tl.float32)), acc)
    return tl.where(any_written, new_best, best), total, acc


@triton.jit
def _persistent_kernel(
    q, keys, values, cache_lens, attendable, cache_rows, part_out, part_max, part_sum, scale,
    stride_cache_row, stride_cache_head, stride_cache_slot, stride_attendable, items,
    SPLITS, CHUNK: tl.constexpr, TILES: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, FLAT: tl.constexpr, PDL: tl.constexpr,
):
    """FLAT: one loop over (item, tile), every tile of every item (those past the token computed but without effect),
    which the compiler can pipeline across items; else a loop over items, each over its tiles up to the token."""
    _wait_then_release(PDL)
    program, programs = tl.program_id(0), tl.num_programs(0)
    group = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, HEAD_DIM)
    live = group < GROUP
    best = tl.full((GROUP_PAD,), float("-inf"), tl.float32)
    total = tl.zeros((GROUP_PAD,), tl.float32)
    acc = tl.zeros((GROUP_PAD, HEAD_DIM), tl.float32)
    if FLAT:
        for step in range(0, tl.cdiv(items - program, programs) * TILES):  # items program, program + programs, ...
            item = program + (step // TILES) * programs
            tile = step % TILES
            split, kv_head, row = item % SPLITS, (item // SPLITS) % KV_HEADS, item // (SPLITS * KV_HEADS)
            if tile == 0:
                best = tl.full((GROUP_PAD,), float("-inf"), tl.float32)
                total = tl.zeros((GROUP_PAD,), tl.float32)
                acc = tl.zeros((GROUP_PAD, HEAD_DIM), tl.float32)
            best, total, acc = _tile(q, keys, values, attendable, scale, row, kv_head, split, tile,
                                     tl.load(cache_lens + row), tl.load(cache_rows + row).to(tl.int64), best, total,
                                     acc, stride_cache_row, stride_cache_head, stride_cache_slot, stride_attendable,
                                     CHUNK, TILES, GROUP, GROUP_PAD, KV_HEADS, HEAD_DIM)
            if tile == TILES - 1:
                part = ((row * KV_HEADS + kv_head) * SPLITS + split) * GROUP + group
                tl.store(part_out + part[:, None] * HEAD_DIM + dims[None, :], acc, mask=live[:, None])
                tl.store(part_max + part, best, mask=live)
                tl.store(part_sum + part, total, mask=live)
    else:
        for item in range(program, items, programs):
            split, kv_head, row = item % SPLITS, (item // SPLITS) % KV_HEADS, item // (SPLITS * KV_HEADS)
            length = tl.load(cache_lens + row)
            cache_row = tl.load(cache_rows + row).to(tl.int64)
            best = tl.full((GROUP_PAD,), float("-inf"), tl.float32)
            total = tl.zeros((GROUP_PAD,), tl.float32)
            acc = tl.zeros((GROUP_PAD, HEAD_DIM), tl.float32)
            for tile in range(0, tl.minimum(TILES, tl.cdiv(length + 1 - split * TILES * CHUNK, CHUNK))):
                best, total, acc = _tile(q, keys, values, attendable, scale, row, kv_head, split, tile, length,
                                         cache_row, best, total, acc, stride_cache_row, stride_cache_head,
                                         stride_cache_slot, stride_attendable, CHUNK, TILES, GROUP, GROUP_PAD,
                                         KV_HEADS, HEAD_DIM)
            part = ((row * KV_HEADS + kv_head) * SPLITS + split) * GROUP + group
            tl.store(part_out + part[:, None] * HEAD_DIM + dims[None, :], acc, mask=live[:, None])
            tl.store(part_max + part, best, mask=live)
            tl.store(part_sum + part, total, mask=live)


def persistent_attention(q, keys, values, cache_lens, attendable, cache_rows, kv_len, scale, tiles=None,
                         programs_per_sm=4, flat=True):
    """`decode_attention` with the splits walked by a fixed grid of `programs_per_sm` programs an SM (the same split
    rule, partials and merge; `flat`: see `_persistent_kernel`)."""
    rows, heads, head_dim = q.shape
    kv_heads = keys.shape[1]
    group = heads // kv_heads
    tiles = tiles or split_tiles(rows, kv_heads, kv_len)
    splits = triton.cdiv(kv_len, CHUNK * tiles)
    items = rows * kv_heads * splits
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 3
    part_out = torch.empty(rows * heads * splits, head_dim, dtype=torch.float32, device=q.device)
    part_max = torch.empty(rows * heads * splits, dtype=torch.float32, device=q.device)
    part_sum = torch.empty_like(part_max)
    launch(_persistent_kernel, (min(items, sms * programs_per_sm),),
           q, keys, values, cache_lens, attendable, cache_rows, part_out, part_max, part_sum, scale,
           keys.stride(0), keys.stride(1), keys.stride(2), attendable.stride(0), items,
           splits, CHUNK=CHUNK, TILES=tiles, GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)),
           KV_HEADS=kv_heads, HEAD_DIM=head_dim, FLAT=flat)
    out = torch.empty(rows, heads * head_dim, dtype=q.dtype, device=q.device)
    launch(_merge_kernel, (rows * heads,), part_out, part_max, part_sum, out, splits, GROUP=group,
           HEAD_DIM=head_dim, MERGE_BLOCK=MERGE_BLOCK)
    return out


def operands(rows, kv_len, length, device, generator, slots=None, dtype=torch.bfloat16):
    """Random q/K/V for `rows` rows of `length` written slots each in caches of `slots` (default `kv_len`)."""
    slots = slots or kv_len

    def randn(*shape):
        return torch.randn(*shape, generator=generator, device=device, dtype=torch.float32).to(dtype)

    return (randn(rows, HEADS, DIM), randn(rows, KV_HEADS, slots, DIM), randn(rows, KV_HEADS, slots, DIM),
            torch.full((rows,), length - 1, device=device), torch.ones(rows, slots, dtype=torch.bool, device=device),
            torch.arange(rows, device=device))


def check() -> None:
    """The persistent form against the shipped kernel (CPU, Triton's interpreter, float32): uneven lengths, left
    padding, a parked row, cache rows out of order, unwritten slots holding NaN, 1 to 3 tiles a split, grids smaller
    and larger than the work."""
    generator = torch.Generator().manual_seed(0)
    for (rows, kv_len, slots), tiles, per_sm, flat in itertools.product(
            ((3, 64, 64), (5, 256, 320), (2, 1024, 1024)), (1, 3), (1, 8), (True, False)):
        q, keys, values, cache_lens, attendable, cache_rows = operands(rows, kv_len, 1, "cpu", generator, slots,
                                                                       torch.float32)
        cache_lens = torch.randint(0, kv_len, (rows,), generator=generator)
        attendable[0, : int(cache_lens[0]) // 2] = False  # left padding
        attendable[-1, : int(cache_lens[-1]) // 3] = False  # parked
        cache_rows = cache_rows.flip(0)
        for row, length in enumerate(cache_lens.tolist()):  # unwritten slots hold NaN: a kernel that reads one shows
            keys[cache_rows[row], :, length + 1:] = float("nan")
            values[cache_rows[row], :, length + 1:] = float("nan")
        args = (q, keys, values, cache_lens, attendable, cache_rows, kv_len, DIM**-0.5, tiles)
        expected, got = decode_attention(*args), persistent_attention(*args, programs_per_sm=per_sm, flat=flat)
        print(f"rows {rows} kv_len {kv_len} tiles {tiles} programs an SM {per_sm} flat {flat}: "
              f"equal {torch.equal(got, expected)}")
        assert torch.equal(got, expected)


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
    parser.add_argument("--check", action="store_true", help="compare with the shipped kernel on the CPU and stop")
    parser.add_argument("--programs-per-sm", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--no-step", action="store_true", help="only the kernels alone")
    args = parser.parse_args()
    if args.check:
        return check()
    harness.require_cuda()
    forms = {"shipped": decode_attention,
             **{f"persistent {'flat' if flat else 'by item'} {n} an SM":
                partial(persistent_attention, programs_per_sm=n, flat=flat)
                for flat, n in itertools.product((True, False), args.programs_per_sm)}}
    generator = torch.Generator(device="cuda").manual_seed(0)
    alone, step = [], []
    for rows, kv_len, length in SHAPES:
        operands_ = operands(rows, kv_len, length, "cuda", generator)
        calls = {name: (lambda form=form: form(*operands_, kv_len, DIM**-0.5)) for name, form in forms.items()}
        outputs = {name: call() for name, call in calls.items()}
        times = dict(zip(calls, KernelTuner().time_calls(list(calls.values()))))
        gigabytes = 2 * rows * KV_HEADS * length * DIM * 2 / 1e9
        alone.append({"rows": rows, "kv_len": kv_len, "length": length, "us": times,
                      "tb_per_s": {name: gigabytes / us * 1e3 for name, us in times.items()},
                      "equal_to_shipped": {name: torch.equal(out, outputs["shipped"]) for name, out in outputs.items()}})
        print(f"alone: {rows} rows at {length} of {kv_len} slots: "
              + ", ".join(f"{name} {us:.1f} us" for name, us in times.items()), flush=True)
    if not args.no_step:
        fastest = min(list(forms)[1:], key=lambda name: sum(row["us"][name] for row in alone))
        for batch, context in STEP_SHAPES:
            row = {"batch_size": batch, "context_tokens": context, "ms_per_step": {}}
            for name in ("shipped", fastest, "shipped again"):
                with form_in_step(forms[name.removesuffix(" again")]):
                    row["ms_per_step"][name] = harness.decode_ms(
                        batch, context, max_batch_size=max(8, batch),
                        static_cache_len=1 << (context + LONG - 1).bit_length())
                print(f"step: batch {batch} at {context}: {name} {row['ms_per_step'][name]:.3f} ms/step", flush=True)
            step.append(row)
    harness.write_json({"alone": alone, "step": step})


if __name__ == "__main__":
    main()
