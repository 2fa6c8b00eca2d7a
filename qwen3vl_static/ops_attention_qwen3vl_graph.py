# Copyright 2026 The qwen3vl-static Authors. All rights reserved.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
"""Decode attention of one new token per row over the static KV cache: the torch reference (an additive mask and
SDPA) and flash-decoding in two Triton launches (chunks of the cache, then their merge).

Grouped-query attention without repeating K/V: the query heads of one KV head form its query rows. The QKV
projection, QK-norm, RoPE and the cache write come before (`qkv_norm_rope_write`, a measured composition).
"""

import torch
import torch.nn.functional as F

from .triton_qwen3vl_graph import (
    _release_then_wait,
    _wait_then_release,
    launch,
    tl,
    triton,
)

CHUNK = 64  # KV slots per tile of a flash-decoding program
MERGE_BLOCK = 32  # splits merged per step of flash-decoding's merge
MAX_SPLITS_PER_ROW = 32
ONE_TILE_PROGRAMS = 512  # about 4 an SM on an H200
MAX_PROGRAMS = 2048
WIDE_TILES_FROM = 4  # a float8 cache's programs of this many tiles or more read tiles of 2 x CHUNK slots


def split_tiles(rows: int, kv_heads: int, kv_len: int) -> int:
    """Tiles of CHUNK slots per flash-decoding program over a `kv_len` bucket: the fewest (a power of two) that cut
    each row into at most MAX_SPLITS_PER_ROW splits and the whole launch into at most ONE_TILE_PROGRAMS programs of
    one tile, or MAX_PROGRAMS of more. Programs of one tile keep a short cache's launch wide, until there are so many
    that the launch runs in waves, each paying a program's whole latency; longer caches and larger batches read
    faster in fewer, longer programs (on an H200, per layer: batch 1 at 8192 slots 23.8 us with 4 tiles vs 29.6 with
    1; batch 8 at 4096 slots 55.2 vs 67.0 with 2; batch 64 at 512 slots 48.5 vs 55.3 with 2;
    `bench/probes/attention_probe.py`. In the whole step, `attention_split_step_probe.py`: at 1024 slots batch 8 1.525
    ms/step with 2 tiles vs 1.611-1.641 with 1, batch 16 1.834 vs 1.874-1.930; batch 4 with 2 tiles no faster; more
    tiles than this rule's slower at batch 64 at 512 slots and batch 8 at 4096)."""
    chunks, tiles = -(-kv_len // CHUNK), 1
    while tiles < chunks:
        splits = -(-chunks // tiles)
        most = ONE_TILE_PROGRAMS if tiles == 1 else MAX_PROGRAMS
        if splits <= MAX_SPLITS_PER_ROW and rows * kv_heads * splits <= most:
            break
        tiles *= 2
    return tiles


def tile_slots(tiles: int, cache_bytes: int) -> tuple[int, int]:
    """(slots a tile, tiles a program) for a flash-decoding program given `tiles` tiles of CHUNK slots over a cache of
    `cache_bytes`-byte values. A float8 cache's tile of CHUNK slots is half a 16-bit cache's bytes: where a program
    spans WIDE_TILES_FROM tiles or more, it reads the same slots in half as many tiles of twice the slots, as many
    bytes a load as a 16-bit tile (on an H100 at 336 of 512 slots, per layer: 256 rows 120 us against 138, 512 rows
    225 against 269, a 16-bit cache 150 and 274; batch 1 at 7,880 of 8,192 slots 22.1 against 23.0; at 64 rows, 2
    tiles, 43.5 against 41.6, so kept; a 16-bit cache's tiles of twice the slots are slower everywhere;
    `kv_dtype_probe.py` in git history)."""
    if cache_bytes == 1 and tiles >= WIDE_TILES_FROM:
        return 2 * CHUNK, tiles // 2
    return CHUNK, tiles


def attention_context_reference(attendable, cache_rows, cache_lens, kv_len, dtype):
    """What decode attention needs besides the cache, built once per step: here an additive mask `(rows, 1, 1,
    kv_len)`, and each row's cache row `cache_rows` (the runner's), where its K/V are written and read.

    A slot is read only if it is written (slot <= the row's length, the current token included) and is not
    left padding: never an unwritten or stale slot.
    """
    slots = torch.arange(kv_len, device=cache_lens.device)
    readable = attendable[:, :kv_len] & (slots <= cache_lens[:, None])
    mask = torch.zeros(readable.shape, dtype=dtype, device=readable.device)
    return mask.masked_fill(~readable, float("-inf"))[:, None, None, :], cache_rows


def decode_attention_reference(q, keys, values, mask, cache_rows, kv_len, scale):
    """Attention of the new queries `q` `(rows, Hq, D)` over the first `kv_len` slots of their cache rows
    `cache_rows` `(rows,)` (the new token's K/V already in them), `mask` from `attention_context_reference`; returns
    `(rows, Hq * D)`."""
    rows, kv_heads, head_dim = q.shape[0], keys.shape[1], keys.shape[-1]
    out = F.scaled_dot_product_attention(
        q.reshape(rows, kv_heads, -1, head_dim),
        keys[:, :, :kv_len].index_select(0, cache_rows).to(q.dtype),  # a float8 cache (`kv_cache_dtype`) widens
        values[:, :, :kv_len].index_select(0, cache_rows).to(q.dtype),
        attn_mask=mask,
        scale=scale,
    )
    return out.reshape(rows, -1)


if triton is not None:

    @triton.jit
    def _decode_attention_kernel(
        q, keys, values, cache_lens, attendable, cache_rows, part_out, part_max, part_sum, scale,
        stride_cache_row, stride_cache_head, stride_cache_slot, stride_attendable,
        SPLITS, CHUNK: tl.constexpr, TILES: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
        KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PDL: tl.constexpr,
    ):
        """Decode attention of one new token per row, flash-decoding's first pass: a program per (row, KV head, split
        of TILES x CHUNK slots) takes the softmax of the KV head's query group over its split, a tile of CHUNK slots
        at a time (row r's cache is cache row `cache_rows[r]`, the new token's K/V already in it).

        A program loops only over the tiles that hold written slots, and loads only the slots its row attends to:
        written (up to the new token's) and not left padding. The others load as zeros, so whatever they hold drops
        out; masking the loads, rather than zeroing K and V in registers after them, lets the tiles go from the copy
        to the MMA untouched (on an H200, 9-11% faster at batch 8-64: docs/experiments.md)."""
        _wait_then_release(PDL)
        row = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        group = tl.arange(0, GROUP_PAD)
        dims = tl.arange(0, HEAD_DIM)
        length = tl.load(cache_lens + row)  # the new token's slot
        cache_row = tl.load(cache_rows + row).to(tl.int64)
        heads = kv_head * GROUP + group
        queries = tl.load(q + (row * KV_HEADS * GROUP + heads[:, None]) * HEAD_DIM + dims[None, :],
                          mask=group[:, None] < GROUP, other=0.0)
        first = split * TILES * CHUNK
        best = tl.full((GROUP_PAD,), float("-inf"), tl.float32)
        total = tl.zeros((GROUP_PAD,), tl.float32)
        acc = tl.zeros((GROUP_PAD, HEAD_DIM), tl.float32)
        for tile in range(0, tl.minimum(TILES, tl.cdiv(length + 1 - first, CHUNK))):  # none past the new token
            slots = first + tile * CHUNK + tl.arange(0, CHUNK)
            written = slots <= length
            cache = (cache_row * stride_cache_row + kv_head * stride_cache_head + slots[:, None] * stride_cache_slot
                     + dims[None, :])
            readable = tl.load(attendable + row * stride_attendable + slots, mask=written, other=0) != 0
            k = tl.load(keys + cache, mask=readable[:, None], other=0.0).to(queries.dtype)  # a float8 cache widens
            v = tl.load(values + cache, mask=readable[:, None], other=0.0)
            scores = tl.dot(queries, tl.trans(k)).to(tl.float32) * scale
            scores = tl.where(readable[None, :], scores, float("-inf"))
            new_best = tl.maximum(best, tl.max(scores, axis=1))
            base = tl.where(new_best == float("-inf"), 0.0, new_best)  # nothing readable yet: no NaN
            weights = tl.exp(scores - base[:, None])
            correction = tl.exp(best - base)
            total = total * correction + tl.sum(weights, axis=1)
            # Probabilities stay in float32 (a 16-bit P would round them to 3 digits).
            acc = acc * correction[:, None] + tl.dot(weights, v.to(tl.float32))
            best = new_best
        part = ((row * KV_HEADS + kv_head) * SPLITS + split) * GROUP + group
        live = group < GROUP
        tl.store(part_out + part[:, None] * HEAD_DIM + dims[None, :], acc, mask=live[:, None])
        tl.store(part_max + part, best, mask=live)
        tl.store(part_sum + part, total, mask=live)

    @triton.jit
    def _merge_kernel(part_out, part_max, part_sum, out, SPLITS, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                      MERGE_BLOCK: tl.constexpr, PDL: tl.constexpr):
        """Flash-decoding's second pass: one program per (row, query head) merges its chunks' partial softmaxes. The
        next kernel (o_proj) launches first thing (`_release_then_wait`)."""
        _release_then_wait(PDL)
        pair, head = tl.program_id(0) // GROUP, tl.program_id(0) % GROUP  # pair: (row, KV head)
        dims = tl.arange(0, HEAD_DIM)
        top = tl.full((), float("-inf"), tl.float32)
        total = tl.zeros((), tl.float32)
        merged = tl.zeros((HEAD_DIM,), tl.float32)
        for first in range(0, SPLITS, MERGE_BLOCK):
            chunk = first + tl.arange(0, MERGE_BLOCK)
            index = (pair * SPLITS + chunk) * GROUP + head
            got = chunk < SPLITS
            # All three loads first: a load after the maximum's reduction would wait for it.
            chunk_max = tl.load(part_max + index, mask=got, other=float("-inf"))
            chunk_sum = tl.load(part_sum + index, mask=got, other=0.0)
            chunk_out = tl.load(part_out + index[:, None] * HEAD_DIM + dims[None, :], mask=got[:, None], other=0.0)
            new_top = tl.maximum(top, tl.max(chunk_max, axis=0))
            base = tl.where(new_top == float("-inf"), 0.0, new_top)
            weights = tl.where(got, tl.exp(chunk_max - base), 0.0)
            correction = tl.exp(top - base)
            total = total * correction + tl.sum(chunk_sum * weights, axis=0)
            merged = merged * correction + tl.sum(chunk_out * weights[:, None], axis=0)
            top = new_top
        tl.store(out + (pair * GROUP + head) * HEAD_DIM + dims, (merged / total).to(out.dtype.element_ty))


def attention_context(attendable, cache_rows, cache_lens, kv_len, dtype):
    """`attention_context_reference` for the kernels: the attendable slots as they are (the kernel bounds each row by
    its length), and each row's cache row."""
    return attendable, cache_rows


def decode_attention(q, keys, values, cache_lens, attendable, cache_rows, kv_len, scale, tiles: int | None = None):
    """`decode_attention_reference` as flash-decoding in two launches: splits of `tiles` chunks of CHUNK slots of the
    cache (by default `split_tiles`; a float8 cache's as `tile_slots` says), then their merge; `attendable` and
    `cache_rows` from `attention_context`. (Fusing QK-norm/RoPE/KV write into the splits' launch, and the merge into
    their last programs, makes the whole step slower at every batch size on an H200; so do, under PDL, the write
    inside the splits' launch and, at batch 1, the merge inside o_proj's matmul, merging each head as its K step loads
    it.)"""
    rows, heads, head_dim = q.shape
    kv_heads = keys.shape[1]
    group = heads // kv_heads
    chunk, tiles = tile_slots(tiles or split_tiles(rows, kv_heads, kv_len), keys.element_size())
    splits = triton.cdiv(kv_len, chunk * tiles)
    part_out = torch.empty(rows * heads * splits, head_dim, dtype=torch.float32, device=q.device)
    part_max = torch.empty(rows * heads * splits, dtype=torch.float32, device=q.device)
    part_sum = torch.empty_like(part_max)
    launch(_decode_attention_kernel, (rows, kv_heads, splits),
        q, keys, values, cache_lens, attendable, cache_rows, part_out, part_max, part_sum, scale,
        keys.stride(0), keys.stride(1), keys.stride(2), attendable.stride(0),
        splits, CHUNK=chunk, TILES=tiles, GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)),
        KV_HEADS=kv_heads, HEAD_DIM=head_dim,
    )
    out = torch.empty(rows, heads * head_dim, dtype=q.dtype, device=q.device)
    launch(_merge_kernel, (rows * heads,), part_out, part_max, part_sum, out, splits, GROUP=group,
           HEAD_DIM=head_dim, MERGE_BLOCK=MERGE_BLOCK)
    return out
