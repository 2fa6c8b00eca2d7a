"""The rotary kernels (ops_rotary_qwen3vl_graph.py) against their torch references and the stock modules."""

import pytest
import torch
from ops_checks import (
    DEVICE,
    DTYPES,
    TOLERANCE,
    Torch,
    Triton,
    needs_triton,
    poisoned_empty,
    randn,
)

from qwen3vl_static import ops_rotary_qwen3vl_graph as rotary

pytestmark = needs_triton


@pytest.fixture(params=[1, 1000], ids=["program-per-token", "program-per-kv-head"])
def programs(request, monkeypatch):
    """The two launch forms of `qk_norm_rope_write`: tokens at least one per SM (a prefill) take a program each, fewer
    (a decode step) a program per (token, KV head); the SM count decides which these few tokens get."""
    monkeypatch.setattr(rotary, "sm_count", lambda device: request.param)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cache_rows", [[0, 1, 2], [2, 0, 2]], ids=["one-per-row", "several-per-row"])
def test_qk_norm_rope_write_touches_only_each_tokens_slot(dtype, cache_rows, programs):
    """Prefill writes the prompt's tokens into the cache, several tokens to a row (any token -> (row, slot) map)."""
    rows, heads, kv_heads, dim, slots = 3, 8, 4, 32, 40
    qkv = randn(rows, (heads + 2 * kv_heads) * dim, dtype=dtype)
    q_weight, k_weight = randn(dim, dtype=dtype), randn(dim, dtype=dtype)
    cos, sin = randn(rows, 1, dim, dtype=dtype), randn(rows, 1, dim, dtype=dtype)
    cache_rows, cache_slots = torch.tensor(cache_rows, device=DEVICE), torch.tensor([0, 17, 39], device=DEVICE)
    results = []
    for ops in (Torch, Triton):
        keys = torch.full((rows + 1, kv_heads, slots, dim), float("nan"), dtype=dtype, device=DEVICE)
        values = torch.full_like(keys, float("nan"))
        tables = ops.rotary(cos, sin)
        with poisoned_empty():
            q = ops.qk_norm_rope_write(qkv, heads, q_weight, k_weight, 1e-6, tables, keys, values, cache_rows, cache_slots)
        results.append((q, keys, values))
    (q_ref, k_ref, v_ref), (q, k, v) = results
    torch.testing.assert_close(q, q_ref, **TOLERANCE[dtype])
    written = torch.zeros(rows + 1, slots, dtype=torch.bool, device=DEVICE)
    written[cache_rows, cache_slots] = True
    assert k.transpose(1, 2)[~written].isnan().all() and v.transpose(1, 2)[~written].isnan().all()  # nothing else written
    torch.testing.assert_close(k.transpose(1, 2)[written], k_ref.transpose(1, 2)[written], **TOLERANCE[dtype])
    torch.testing.assert_close(v.transpose(1, 2)[written], v_ref.transpose(1, 2)[written], rtol=0, atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kv_dtype", [None, torch.float8_e4m3fn], ids=["model-dtype-cache", "float8-cache"])
def test_qk_norm_rope_write_returns_the_kv_it_writes(dtype, kv_dtype, programs):
    """With `return_kv` (a fresh prompt's prefill attends to them there): q as without it, and K/V `(tokens, KV heads,
    D)` in the model's dtype equal to what went into the cache, bitwise (a float8 cache's widened); the reference's are
    the reference's. V is copied, so it is bitwise in both, float8's rounding and saturation included."""
    tokens, heads, kv_heads, dim, slots = 5, 4, 2, 32, 8
    qkv = randn(tokens, (heads + 2 * kv_heads) * dim, dtype=dtype)
    qkv[:, -dim:] *= 300  # beyond float8's 448 in places
    kv_dtype = kv_dtype or dtype
    norms = randn(dim, dtype=dtype), randn(dim, dtype=dtype), 1e-6
    cos, sin = randn(tokens, 1, dim, dtype=dtype), randn(tokens, 1, dim, dtype=dtype)
    cache_rows, cache_slots = torch.tensor([0, 0, 0, 1, 1], device=DEVICE), torch.tensor([0, 1, 2, 0, 1], device=DEVICE)
    returned = []
    for ops in (Torch, Triton):
        keys = torch.full((2, kv_heads, slots, dim), float("nan"), dtype=dtype, device=DEVICE).to(kv_dtype)
        values = keys.clone()
        tables = ops.rotary(cos, sin)
        q_alone = ops.qk_norm_rope_write(qkv, heads, *norms, tables, keys.clone(), values.clone(), cache_rows,
                                         cache_slots)
        with poisoned_empty():
            q, k, v = ops.qk_norm_rope_write(qkv, heads, *norms, tables, keys, values, cache_rows, cache_slots,
                                             return_kv=True)
        torch.testing.assert_close(q, q_alone, rtol=0, atol=0)
        assert k.shape == v.shape == (tokens, kv_heads, dim) and k.dtype == v.dtype == dtype
        torch.testing.assert_close(k, keys[cache_rows, :, cache_slots].to(dtype), rtol=0, atol=0)
        torch.testing.assert_close(v, values[cache_rows, :, cache_slots].to(dtype), rtol=0, atol=0)
        returned.append((k, v))
    (k_ref, v_ref), (k, v) = returned
    if kv_dtype == torch.float8_e4m3fn:  # K computed a rounding apart (the dtype's tolerance) may land a float8 unit
        torch.testing.assert_close(k, k_ref, rtol=TOLERANCE[dtype]["rtol"] + 2**-3,  # apart (2^-9 below 2^-6)
                                   atol=TOLERANCE[dtype]["atol"] + 2**-9)
        assert v.abs().max() == 448
    else:
        torch.testing.assert_close(k, k_ref, **TOLERANCE[dtype])
    torch.testing.assert_close(v, v_ref, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_rotary_matches_the_stock_module(dtype):
    """The step's rotary tables from one kernel equal the stock module's (Qwen3-VL-2B's M-RoPE sections), for positions
    whose T/H/W components differ (image tokens) or agree (text), bitwise on CUDA (the same float32 math)."""
    from transformers.models.qwen3_vl.modeling_qwen3_vl import (
        Qwen3VLTextRotaryEmbedding,
    )

    from qwen3vl_static.presets import real_config

    rotary_emb = Qwen3VLTextRotaryEmbedding(real_config("2b").text_config).to(DEVICE)
    components = rotary.rotary_components(rotary_emb, torch.device(DEVICE))
    assert components.tolist()[:6] == [0, 1, 2, 0, 1, 2] and components.tolist()[-4:] == [0, 0, 0, 0]  # interleaved
    positions = torch.randint(0, 100_000, (3, 5, 1), device=DEVICE)
    positions[:, 0] = positions[0, 0]
    hidden = randn(5, 16, dtype=dtype)
    got = Triton.decode_rotary(rotary_emb, hidden, positions, components)
    expected = rotary.rotary(*rotary_emb(hidden, positions))
    for table, reference in zip(got, expected):
        torch.testing.assert_close(table, reference, **({"rtol": 0, "atol": 0} if DEVICE == "cuda" else TOLERANCE[dtype]))


@pytest.mark.parametrize("dtype", DTYPES)
def test_vision_qkv_rope_matches_the_stock_rotary(dtype):
    length, heads, dim = 37, 3, 16
    qkv = randn(length, 3 * heads * dim, dtype=dtype)
    cos, sin = torch.randn(length, dim, device=DEVICE), torch.randn(length, dim, device=DEVICE)
    expected = rotary.vision_qkv_rope_reference(qkv, heads, cos, sin)
    got = rotary.vision_qkv_rope(qkv, heads, cos, sin)
    for tensor, reference in zip(got, expected, strict=True):
        assert tensor.shape == reference.shape == (1, heads, length, dim)
        torch.testing.assert_close(tensor, reference, **TOLERANCE[dtype])


def test_vision_qkv_rope_takes_heads_of_any_width():
    """The 8B tower's 72-wide heads (half a head is not a power of two) get the reference's numbers."""
    from qwen3vl_static.ops_rotary_qwen3vl_graph import vision_qkv_rope, vision_qkv_rope_reference

    qkv, cos, sin = torch.randn(5, 3 * 2 * 72), torch.randn(5, 72), torch.randn(5, 72)
    for got, expected in zip(vision_qkv_rope(qkv, 2, cos, sin), vision_qkv_rope_reference(qkv, 2, cos, sin)):
        torch.testing.assert_close(got, expected)
