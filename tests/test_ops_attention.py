"""Decode attention (ops_attention_qwen3vl_graph.py, after the QKV composition of the op sets) against the torch
reference ops."""

import pytest
import torch

from qwen3vl_static import ops_attention_qwen3vl_graph
from ops_checks import (
    DEVICE,
    DTYPES,
    Torch,
    Triton,
    assert_close_at_scale,
    needs_triton,
    poisoned_empty,
    randn,
)

pytestmark = needs_triton


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kv_len", [64, 160])
@pytest.mark.parametrize("tiles", [1, 2, 3, 4])
@pytest.mark.parametrize("kv_dtype", [None, torch.float8_e4m3fn], ids=["model-dtype-cache", "float8-cache"])
def test_decode_attention_writes_the_new_token_and_reads_only_written_slots(dtype, kv_len, tiles, kv_dtype,
                                                                            monkeypatch):
    """Decode attention (QK-norm, RoPE, cache write, flash-decoding and its merge) against the reference ops. Every
    slot it must not read (unwritten, the new token's own slot included until it is written) or attend to (left
    padding) holds NaN, so using one poisons the output; only each row's new slot may change. Rows read and write the
    cache rows they are given (a permutation with a row left out), not their own. Programs of 1 to 4 tiles of 64
    slots (a split past the new token's slot has nothing to read; a float8 cache's 4 are 2 of 128, `tile_slots`). The
    cache holds the model's dtype or float8 (`kv_cache_dtype="fp8"`: the new K/V rounded to it, every slot widened as
    it is read)."""
    monkeypatch.setattr(ops_attention_qwen3vl_graph, "split_tiles", lambda rows, kv_heads, kv_len: tiles)
    rows, heads, kv_heads, dim, capacity, hidden = 3, 4, 2, 32, 160, 64
    x, qkv_weight = randn(rows, hidden, dtype=dtype), randn((heads + 2 * kv_heads) * dim, hidden, dtype=dtype) / 8
    qk_norms = randn(dim, dtype=dtype), randn(dim, dtype=dtype), 1e-6
    cos, sin = randn(rows, 1, dim, dtype=dtype), randn(rows, 1, dim, dtype=dtype)
    cache_lens = torch.tensor([0, 30, kv_len - 1], device=DEVICE)
    cache_rows = torch.tensor([2, 0, 3], device=DEVICE)  # cache row 1 is no row's: it must stay as it is
    attendable = torch.ones(rows, capacity, dtype=torch.bool, device=DEVICE)
    attendable[1, :9] = False  # left padding of row 1
    attendable[2, :kv_len // 2] = False
    slots = torch.arange(capacity, device=DEVICE)
    unreadable = torch.ones(rows + 1, capacity, dtype=torch.bool, device=DEVICE)  # per cache row
    unreadable[cache_rows] = (slots >= cache_lens[:, None]) | ~attendable
    kv_dtype = kv_dtype or dtype
    keys, values = randn(rows + 1, kv_heads, capacity, dim, dtype=dtype), randn(rows + 1, kv_heads, capacity, dim, dtype=dtype)
    poisoned = keys.clone(), values.clone()
    for cache in poisoned:
        cache.transpose(1, 2)[unreadable] = float("nan")
    keys, values, *poisoned = (cache.to(kv_dtype) for cache in (keys, values, *poisoned))
    # The reference runs in float32 (a float8 cache stays one: it rounds the new K/V as the kernel does) and masks with
    # -inf scores; as 0 * NaN is NaN, it gets the random values where the kernel gets NaN.
    k_ref, v_ref = (cache.clone() if kv_dtype == torch.float8_e4m3fn else cache.float() for cache in (keys, values))
    context = Torch.attention_context(attendable, cache_rows, cache_lens, kv_len, torch.float32)
    out_ref = Torch.decode_attention(x.float(), qkv_weight.float(), heads, tuple(w.float() for w in qk_norms[:2]) + qk_norms[2:],
                                     Torch.rotary(cos.float(), sin.float()), k_ref, v_ref, cache_lens, context, kv_len,
                                     dim**-0.5)
    k, v = (tensor.clone() for tensor in poisoned)
    context = Triton.attention_context(attendable, cache_rows, cache_lens, kv_len, dtype)
    with poisoned_empty():  # the partial results and the output
        out = Triton.decode_attention(x, qkv_weight, heads, qk_norms, Triton.rotary(cos, sin), k, v, cache_lens, context, kv_len,
                                      dim**-0.5)
    # A float8 cache: the new K/V computed in the model's dtype here and in float32 there may round a unit apart.
    assert_close_at_scale(out, out_ref, through_float8=kv_dtype == torch.float8_e4m3fn)
    new = torch.zeros(rows + 1, capacity, dtype=torch.bool, device=DEVICE)
    new[cache_rows, cache_lens] = True
    for got, expected, before in zip((k, v), (k_ref, v_ref), poisoned):
        assert got.dtype == kv_dtype
        assert_close_at_scale(got.transpose(1, 2)[new], expected.transpose(1, 2)[new].float())
        torch.testing.assert_close(got.transpose(1, 2)[~new].float(), before.transpose(1, 2)[~new].float(), rtol=0,
                                   atol=0, equal_nan=True)


def test_split_tiles_follow_the_cache_and_batch():
    """One tile per program for short caches and small batches (at most 512 such programs); more for long rows (at
    most 32 splits each) and large launches (at most 2048 programs); never more tiles than the bucket has."""
    from qwen3vl_static.ops_attention_qwen3vl_graph import split_tiles

    assert [split_tiles(rows, 8, kv_len) for rows, kv_len in [(1, 1024), (4, 1024), (1, 2048)]] == [1, 1, 1]
    # More than ONE_TILE_PROGRAMS programs of one tile: two tiles each.
    assert [split_tiles(rows, 8, kv_len) for rows, kv_len in [(8, 1024), (16, 1024), (4, 2048)]] == [2, 2, 2]
    assert [split_tiles(rows, 8, kv_len) for rows, kv_len in [(1, 8192), (8, 4096), (64, 512), (8, 8192)]] == [4, 2, 2, 4]
    assert split_tiles(64, 8, 64) == 1 and split_tiles(4096, 8, 256) == 4


def test_a_float8_cache_reads_tiles_of_twice_the_slots_where_a_program_spans_four_or_more():
    """The same slots a program: a float8 cache's programs of 4 or more 64-slot tiles read half as many of 128 slots;
    shorter programs, and every program over a 16-bit cache, keep 64-slot tiles."""
    from qwen3vl_static.ops_attention_qwen3vl_graph import tile_slots

    assert [tile_slots(tiles, 1) for tiles in (1, 2, 3, 4, 8, 16)] == [(64, 1), (64, 2), (64, 3), (128, 2), (128, 4),
                                                                      (128, 8)]
    assert [tile_slots(tiles, 2) for tiles in (1, 4, 8)] == [(64, 1), (64, 4), (64, 8)]
