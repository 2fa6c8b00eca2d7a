"""Fused Triton decode kernels against the torch reference ops: on the CPU through TRITON_INTERPRET=1, natively
on CUDA. Inputs are fresh random values (never zeros) and every output buffer is poisoned before the call."""

import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from qwen3vl_static import kernels_qwen3vl_graph as kernels

pytestmark = pytest.mark.skipif(kernels.triton is None, reason="needs triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Triton's interpreter mishandles bfloat16 (tl.dot on it returns garbage, float32 -> bfloat16 truncates), so the CPU
# checks the kernels' logic in float32 and the GPU checks them in the dtype they run in.
DTYPES = [torch.bfloat16] if DEVICE == "cuda" else [torch.float32]
TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}
Torch, Triton = kernels.TorchDecodeOps, kernels.TritonDecodeOps


def randn(*shape, dtype):
    return torch.randn(*shape, device=DEVICE).to(dtype)


def assert_close_at_scale(out, expected):
    """`out` against a float32 `expected`. Sums of terms of both signs land some outputs near zero, where elementwise
    relative bounds fail on rounding alone, so the bound is on the error relative to the output's scale (a wrong row,
    column, head or activation is off by that whole scale)."""
    bound = 1e-5 if out.dtype == torch.float32 else 2**-6  # float32: summation order only
    assert (out.float() - expected).abs().max() <= bound * expected.abs().max()


def assert_matmul_close(out, inputs, reference_op):
    """A (fused) matmul's output against `reference_op` on float32 copies of `inputs`."""
    expected = reference_op(*(x.float() if isinstance(x, torch.Tensor) else x for x in inputs))
    assert_close_at_scale(out, expected[-1] if isinstance(expected, tuple) else expected)


@contextmanager
def poisoned_empty():
    """`torch.empty` returns NaN inside (deterministic mode), for the buffers a launcher allocates itself."""
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(previous)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_add_rms_norm_and_embed_rms_norm(dtype):
    hidden, delta, weight = randn(3, 200, dtype=dtype), randn(3, 200, dtype=dtype), randn(200, dtype=dtype)
    torch.testing.assert_close(Triton.rms_norm(hidden, weight, 1e-6), Torch.rms_norm(hidden, weight, 1e-6), **TOLERANCE[dtype])
    total, normed = Triton.add_rms_norm(hidden, delta, weight, 1e-6)
    expected_total, expected_normed = Torch.add_rms_norm(hidden, delta, weight, 1e-6)
    torch.testing.assert_close(total, expected_total, rtol=0, atol=0)  # the sum is rounded like torch's add
    torch.testing.assert_close(normed, expected_normed, **TOLERANCE[dtype])
    table, ids = randn(50, 200, dtype=dtype), torch.tensor([7, 49, 7, 0], device=DEVICE)  # the step's first norm
    with poisoned_empty():
        embedded, normed_embedded = Triton.embed_rms_norm(ids, table, weight, 1e-6)
    torch.testing.assert_close(embedded, table[ids], rtol=0, atol=0)
    torch.testing.assert_close(normed_embedded, Torch.embed_rms_norm(ids, table, weight, 1e-6)[1], **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cache_rows", [[0, 1, 2], [2, 0, 2]], ids=["one-per-row", "several-per-row"])
def test_qk_norm_rope_write_touches_only_each_tokens_slot(dtype, cache_rows):
    """Prefill writes the prompt's tokens into the cache, several tokens to a row (any token -> (row, slot) map)."""
    rows, heads, kv_heads, dim, slots = 3, 4, 2, 32, 40
    qkv = randn(rows, (heads + 2 * kv_heads) * dim, dtype=dtype)
    q_weight, k_weight = randn(dim, dtype=dtype), randn(dim, dtype=dtype)
    cos, sin = randn(rows, 1, dim, dtype=dtype), randn(rows, 1, dim, dtype=dtype)
    cache_rows, cache_slots = torch.tensor(cache_rows, device=DEVICE), torch.tensor([0, 17, 39], device=DEVICE)
    results = []
    for ops in (Torch, Triton):
        keys = torch.full((rows + 1, kv_heads, slots, dim), float("nan"), dtype=dtype, device=DEVICE)
        values = torch.full_like(keys, float("nan"))
        rotary = ops.rotary(cos, sin)
        with poisoned_empty():
            q = ops.qk_norm_rope_write(qkv, heads, q_weight, k_weight, 1e-6, rotary, keys, values, cache_rows, cache_slots)
        results.append((q, keys, values))
    (q_ref, k_ref, v_ref), (q, k, v) = results
    torch.testing.assert_close(q, q_ref, **TOLERANCE[dtype])
    written = torch.zeros(rows + 1, slots, dtype=torch.bool, device=DEVICE)
    written[cache_rows, cache_slots] = True
    assert k.transpose(1, 2)[~written].isnan().all() and v.transpose(1, 2)[~written].isnan().all()  # nothing else written
    torch.testing.assert_close(k.transpose(1, 2)[written], k_ref.transpose(1, 2)[written], **TOLERANCE[dtype])
    torch.testing.assert_close(v.transpose(1, 2)[written], v_ref.transpose(1, 2)[written], rtol=0, atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("split_k", [1, 3], ids=["one-pass", "split-k"])
@pytest.mark.parametrize("form", ["fused", "summed-by-norm"])
def test_qkv_norm_rope_write_fused_and_chosen(dtype, rows, split_k, form):
    """The QKV projection with QK-norm/RoPE/KV write in its epilogue (each head's last program; column tiles of half a
    head), or its partial products summed by the QK-norm/RoPE/write kernel, against the projection then the reference
    ops. Only each row's slot is written."""
    heads, kv_heads, dim, hidden, slots = 4, 2, 32, 96, 20
    x, qkv_weight = randn(rows, hidden, dtype=dtype), randn((heads + 2 * kv_heads) * dim, hidden, dtype=dtype) / 8
    qk_norms = randn(dim, dtype=dtype), randn(dim, dtype=dtype), 1e-6
    cos, sin = randn(rows, 1, dim, dtype=dtype), randn(rows, 1, dim, dtype=dtype)
    cache_rows, cache_slots = torch.arange(rows, device=DEVICE), torch.tensor([4, 19, 0], device=DEVICE)[:rows]
    keys = torch.full((rows + 1, kv_heads, slots, dim), float("nan"), dtype=dtype, device=DEVICE)
    values = torch.full_like(keys, float("nan"))
    k_ref, v_ref = keys.float(), values.float()
    q_ref = Torch.qkv_norm_rope_write(x.float(), qkv_weight.float(), heads, tuple(w.float() for w in qk_norms[:2]) + qk_norms[2:],
                                      Torch.rotary(cos.float(), sin.float()), k_ref, v_ref, cache_rows, cache_slots)
    config = kernels.SkinnyConfig(block_n=16, block_k=32, split_k=split_k, num_warps=4, num_stages=2)
    with poisoned_empty():
        if form == "fused":
            q = Triton.fused_qkv(x, qkv_weight, heads, qk_norms, Triton.rotary(cos, sin), keys, values, cache_rows,
                                 cache_slots, config)
        else:
            parts = Triton.skinny_matmul(x, qkv_weight, config, partials=True)
            assert parts.shape == (config.split_k, rows, qkv_weight.shape[0]) and parts.dtype == torch.float32
            q = Triton.qk_norm_rope_write(parts, heads, *qk_norms, Triton.rotary(cos, sin), keys, values, cache_rows,
                                          cache_slots)
    assert_close_at_scale(q, q_ref)
    written = torch.zeros(rows + 1, slots, dtype=torch.bool, device=DEVICE)
    written[cache_rows, cache_slots] = True
    assert keys.transpose(1, 2)[~written].isnan().all() and values.transpose(1, 2)[~written].isnan().all()
    for got, expected in ((keys, k_ref), (values, v_ref)):
        assert_close_at_scale(got.transpose(1, 2)[written], expected.transpose(1, 2)[written])
    assert not Triton.ticket(torch.device(DEVICE), heads + 2 * kv_heads).any()  # back at zero for the next launch


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kv_len", [64, 160])
def test_decode_attention_writes_the_new_token_and_reads_only_written_slots(dtype, kv_len):
    """Decode attention (QK-norm, RoPE, cache write, flash-decoding and its merge) against the reference ops. Every
    slot it must not read (unwritten, the new token's own slot included until it is written) or attend to (left
    padding) holds NaN, so using one poisons the output; only each row's new slot may change."""
    rows, heads, kv_heads, dim, capacity, hidden = 3, 4, 2, 32, 160, 64
    x, qkv_weight = randn(rows, hidden, dtype=dtype), randn((heads + 2 * kv_heads) * dim, hidden, dtype=dtype) / 8
    qk_norms = randn(dim, dtype=dtype), randn(dim, dtype=dtype), 1e-6
    cos, sin = randn(rows, 1, dim, dtype=dtype), randn(rows, 1, dim, dtype=dtype)
    cache_lens = torch.tensor([0, 30, kv_len - 1], device=DEVICE)
    attendable = torch.ones(rows + 1, capacity, dtype=torch.bool, device=DEVICE)
    attendable[1, :9] = False  # left padding of row 1
    attendable[2, :kv_len // 2] = False
    slots = torch.arange(capacity, device=DEVICE)
    lens = torch.cat([cache_lens, cache_lens[:1]])[:, None]
    unreadable = (slots >= lens) | ~attendable
    keys, values = randn(rows + 1, kv_heads, capacity, dim, dtype=dtype), randn(rows + 1, kv_heads, capacity, dim, dtype=dtype)
    poisoned = keys.clone(), values.clone()
    for cache in poisoned:
        cache.transpose(1, 2)[unreadable] = float("nan")
    # The reference runs in float32 and masks with -inf scores; as 0 * NaN is NaN, it gets the random values where
    # the kernel gets NaN.
    k_ref, v_ref = keys.float(), values.float()
    context = Torch.attention_context(attendable[:rows], torch.arange(rows, device=DEVICE), cache_lens, kv_len, torch.float32)
    out_ref = Torch.decode_attention(x.float(), qkv_weight.float(), heads, tuple(w.float() for w in qk_norms[:2]) + qk_norms[2:],
                                     Torch.rotary(cos.float(), sin.float()), k_ref, v_ref, cache_lens, context, kv_len,
                                     dim**-0.5)
    k, v = (tensor.clone() for tensor in poisoned)
    context = Triton.attention_context(attendable[:rows], torch.arange(rows, device=DEVICE), cache_lens, kv_len, dtype)
    with poisoned_empty():  # the partial results and the output
        out = Triton.decode_attention(x, qkv_weight, heads, qk_norms, Triton.rotary(cos, sin), k, v, cache_lens, context, kv_len,
                                      dim**-0.5)
    assert_close_at_scale(out, out_ref)
    new = torch.zeros(rows + 1, capacity, dtype=torch.bool, device=DEVICE)
    new[torch.arange(rows, device=DEVICE), cache_lens] = True
    for got, expected, before in zip((k, v), (k_ref, v_ref), poisoned):
        assert_close_at_scale(got.transpose(1, 2)[new], expected.transpose(1, 2)[new])
        torch.testing.assert_close(got.transpose(1, 2)[~new], before.transpose(1, 2)[~new], rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_rotary_matches_the_stock_module(dtype):
    """The step's rotary tables from one kernel equal the stock module's (Qwen3-VL-2B's M-RoPE sections), for positions
    whose T/H/W components differ (image tokens) or agree (text), bitwise on CUDA (the same float32 math)."""
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding

    from qwen3vl_static.presets import real_2b_config

    rotary_emb = Qwen3VLTextRotaryEmbedding(real_2b_config().text_config).to(DEVICE)
    components = Triton.rotary_components(rotary_emb, torch.device(DEVICE))
    assert components.tolist()[:6] == [0, 1, 2, 0, 1, 2] and components.tolist()[-4:] == [0, 0, 0, 0]  # interleaved
    positions = torch.randint(0, 100_000, (3, 5, 1), device=DEVICE)
    positions[:, 0] = positions[0, 0]
    hidden = randn(5, 16, dtype=dtype)
    got = Triton.decode_rotary(rotary_emb, hidden, positions, components)
    expected = Triton.rotary(*rotary_emb(hidden, positions))
    for table, reference in zip(got, expected):
        torch.testing.assert_close(table, reference, **(dict(rtol=0, atol=0) if DEVICE == "cuda" else TOLERANCE[dtype]))


@pytest.mark.parametrize("dtype", DTYPES)
def test_vision_qkv_rope_matches_the_stock_rotary(dtype):
    length, heads, dim = 37, 3, 16
    qkv = randn(length, 3 * heads * dim, dtype=dtype)
    cos, sin = torch.randn(length, dim, device=DEVICE), torch.randn(length, dim, device=DEVICE)
    expected, got = Torch.vision_qkv_rope(qkv, heads, cos, sin), Triton.vision_qkv_rope(qkv, heads, cos, sin)
    for tensor, reference in zip(got, expected, strict=True):
        assert tensor.shape == reference.shape == (1, heads, length, dim)
        torch.testing.assert_close(tensor, reference, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul(dtype):
    gate_up = randn(3, 2 * 1500, dtype=dtype)
    torch.testing.assert_close(Triton.silu_mul(gate_up), Torch.silu_mul(gate_up), **TOLERANCE[dtype])


SKINNY_CONFIGS = {
    "one-pass": kernels.SkinnyConfig(block_n=32, block_k=32, split_k=1, num_warps=4, num_stages=2),
    # 3 splits of K = 200 in 32-wide steps leave a short last range.
    "split-k": kernels.SkinnyConfig(block_n=32, block_k=32, split_k=3, num_warps=4, num_stages=2),
    # Each program's whole K range (64 inputs; the last one 8) in one tile loaded before the wait.
    "preloaded": kernels.SkinnyConfig(block_n=32, block_k=64, split_k=4, num_warps=4, num_stages=1, preload=True),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("form", SKINNY_CONFIGS)
def test_skinny_matmul(dtype, rows, form):
    # N and K are not multiples of the blocks.
    x, weight = randn(rows, 200, dtype=dtype), randn(100, 200, dtype=dtype)
    with poisoned_empty():  # the output and the split-K partials
        out = Triton.skinny_matmul(x, weight, SKINNY_CONFIGS[form])
    assert_matmul_close(out, (x, weight), Torch.linear)


@pytest.mark.parametrize("dtype", DTYPES)
def test_preloaded_tiles_span_whole_k_ranges(dtype):
    x, weight = randn(1, 200, dtype=dtype), randn(100, 200, dtype=dtype)
    with pytest.raises(ValueError, match="whole K range"):  # 2 ranges of 128 inputs: not one 64-input tile each
        Triton.skinny_matmul(x, weight, SKINNY_CONFIGS["preloaded"]._replace(split_k=2))


def test_preloaded_tiling_rule(monkeypatch):
    """64 KB tiles (64 columns x 512 bfloat16 inputs), offered where they take at most two programs per SM."""
    monkeypatch.setattr(Triton, "sm_count", lambda device: 132)
    weight = lambda n, k: torch.empty(n, k, dtype=torch.bfloat16, device="meta")  # noqa: E731
    preloaded = kernels.SkinnyConfig(64, 512, 4, num_warps=8, num_stages=1, preload=True)
    assert Triton.preload_config(weight(2048, 2048)) == preloaded  # o_proj: 128 programs
    assert Triton.preload_config(weight(4096, 2048)) == preloaded  # QKV: 256
    assert Triton.preload_config(weight(2048, 6144)) is None  # down_proj: 384


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_takes_the_kernel_or_cublas_by_shape(dtype):
    x, weight = randn(5, 96, dtype=dtype), randn(80, 96, dtype=dtype)
    # The kernel (CPU), or whichever measured faster (CUDA; not under poisoned_empty: deterministic mode rejects cuBLAS).
    torch.testing.assert_close(Triton.linear(x, weight), Torch.linear(x, weight), **TOLERANCE[dtype])
    many, bias = randn(Triton.SKINNY_ROWS + 1, 96, dtype=dtype), randn(80, dtype=dtype)  # cuBLAS: too many rows, a bias
    torch.testing.assert_close(Triton.linear(many, weight), Torch.linear(many, weight), **TOLERANCE[dtype])
    torch.testing.assert_close(Triton.linear(x, weight, bias), Torch.linear(x, weight, bias), **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5])
def test_linear_swiglu_fused_and_chosen(dtype, rows):
    """SwiGLU as the gate/up matmul's epilogue (the up columns of each gate column in the same program) equals the
    matmul then the SwiGLU kernel."""
    x, gate_up_weight = randn(rows, 200, dtype=dtype), randn(2 * 100, 200, dtype=dtype)
    config = kernels.SkinnyConfig(block_n=32, block_k=64, split_k=1, num_warps=4, num_stages=2)
    with poisoned_empty():
        out = Triton.skinny_matmul(x, gate_up_weight, config, swiglu=True)
    assert out.shape == (rows, 100)
    assert_matmul_close(out, (x, gate_up_weight), Torch.linear_swiglu)
    assert_matmul_close(Triton.linear_swiglu(x, gate_up_weight), (x, gate_up_weight), Torch.linear_swiglu)  # either form
    with pytest.raises(ValueError, match="whole sums"):
        Triton.skinny_matmul(x, gate_up_weight, config._replace(split_k=2), swiglu=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("form", SKINNY_CONFIGS)
def test_linear_add_rms_norm_fused_and_chosen(dtype, rows, form):
    """The residual add and RMSNorm done by the skinny matmul's last program equal the matmul then the add-and-norm
    kernel; the ticket is back at zero afterwards."""
    x, weight = randn(rows, 200, dtype=dtype), randn(100, 200, dtype=dtype)
    hidden, norm_weight = randn(rows, 100, dtype=dtype), randn(100, dtype=dtype)
    config = SKINNY_CONFIGS[form]
    with poisoned_empty():  # the partials, the sum and the normed output
        total, normed = Triton.skinny_matmul(x, weight, config, add_rms_norm=(hidden, norm_weight, 1e-6))
    assert_matmul_close(total, (x, weight, hidden), lambda x, weight, hidden: hidden + x @ weight.T)
    torch.testing.assert_close(normed, Torch.rms_norm(total, norm_weight, 1e-6), **TOLERANCE[dtype])
    assert not Triton.ticket(x.device).any()
    with poisoned_empty():  # the partials summed by the add-and-norm kernel instead
        parts = Triton.skinny_matmul(x, weight, config, partials=True)
        assert parts.shape == (config.split_k, rows, 100) and parts.dtype == torch.float32
        summed = Triton.add_rms_norm(hidden, parts, norm_weight, 1e-6)
    for got, expected in zip(summed, (total, normed)):  # the same sums, rounded once, as the fused form
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
    either = Triton.linear_add_rms_norm(x, weight, None, hidden, norm_weight, 1e-6)  # whichever form measured faster
    for got, expected in zip(either, Torch.linear_add_rms_norm(x, weight, None, hidden, norm_weight, 1e-6)):
        torch.testing.assert_close(got, expected, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_layer_norm(dtype):
    hidden, delta = randn(5, 200, dtype=dtype), randn(5, 200, dtype=dtype)
    weight, bias = randn(200, dtype=dtype), randn(200, dtype=dtype)
    with poisoned_empty():
        total, normed = Triton.add_layer_norm(hidden, delta, weight, bias, 1e-6)
    expected_total, expected_normed = Torch.add_layer_norm(hidden, delta, weight, bias, 1e-6)
    torch.testing.assert_close(total, expected_total, rtol=0, atol=0)
    torch.testing.assert_close(normed, expected_normed, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_gelu_tanh(dtype):
    """cuBLASLt's GELU epilogue on CUDA is the tanh form the vision MLP uses (elsewhere: the torch ops)."""
    x, weight, bias = randn(37, 64, dtype=dtype), randn(96, 64, dtype=dtype), randn(96, dtype=dtype)
    expected = Torch.linear_gelu_tanh(x.float(), weight.float(), bias.float()).to(dtype)
    torch.testing.assert_close(Triton.linear_gelu_tanh(x, weight, bias), expected, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "drawn"])
def test_finish_step(dtype, greedy):
    """The greedy token is the first of equal maxima, also when a later one comes first in the kernel's scan or lies
    in another part of the vocabulary; finished rows emit the pad token, EOS finishes a row, the token is fed and
    recorded in the current column."""
    rows, vocab = 4, 140000  # 64 parts of 3 blocks of 1024
    logits = randn(rows, vocab, dtype=dtype)
    logits[0, [1027, 5, 3100]] = 50.0  # 1027 is in lane 3 of part 0's second block; 5 in lane 5 of its first
    logits[1, [3071, 3072]] = 50.0  # the last of part 0, the first of part 1
    drawn = torch.tensor([7, 9, 11, 13], device=DEVICE)
    eos_ids = torch.tensor([11, 3072, 13, -1, -1, -1, -1, -1], device=DEVICE)
    states = []
    for ops in (Torch, Triton):
        unfinished = torch.tensor([True, True, False, True], device=DEVICE)
        input_ids = torch.full((rows, 1), -5, device=DEVICE)
        out_tokens = torch.full((rows, 4), -5, device=DEVICE)
        out_unfinished = torch.zeros(rows, 4, dtype=torch.bool, device=DEVICE)
        chunk_step = torch.tensor([2], device=DEVICE)
        positions = torch.arange(3 * 6, device=DEVICE).view(3, 6, 1)  # the runner's buffer has more rows than the step
        cache_lens = torch.tensor([40, 41, 7, 40, 9, 9], device=DEVICE)
        ops.finish_step(logits, None if greedy else drawn, unfinished, torch.tensor(3, device=DEVICE), eos_ids, input_ids,
                        out_tokens, out_unfinished, chunk_step, cache_lens[:rows], positions[:, :rows])
        states.append((unfinished, input_ids, out_tokens, out_unfinished, chunk_step, cache_lens, positions))
    for got, expected in zip(*reversed(states)):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
    unfinished, input_ids, out_tokens, _, chunk_step, cache_lens, positions = states[1]
    assert cache_lens.tolist() == [41, 42, 8, 41, 9, 9]  # every row of the step moved on, finished ones too
    assert positions[:, :, 0].tolist() == [[1, 2, 3, 4, 4, 5], [7, 8, 9, 10, 10, 11], [13, 14, 15, 16, 16, 17]]
    assert chunk_step.item() == 3 and (out_tokens[:, 2] == input_ids[:, 0]).all() and (out_tokens[:, [0, 1, 3]] == -5).all()
    if greedy:
        assert input_ids[:2, 0].tolist() == [5, 3071] and input_ids[2, 0] == 3  # row 2 was finished: pad
    else:
        assert input_ids[:, 0].tolist() == [7, 9, 3, 13] and unfinished.tolist() == [True, True, False, False]


@pytest.mark.cuda
def test_linear_measures_outside_graph_capture_only():
    """A shape first met during capture runs cuBLAS in that graph; its next use outside capture measures it."""
    x, weight = randn(3, 320, dtype=torch.bfloat16), randn(192, 320, dtype=torch.bfloat16)  # a shape no other test uses
    key = ("linear", "3x320->192 bfloat16", x.device)
    expected = Torch.linear(x, weight)  # also warms cuBLAS up before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = Triton.linear(x, weight)
    assert key not in Triton.choices
    graph.replay()
    torch.testing.assert_close(out, expected, **TOLERANCE[torch.bfloat16])
    torch.testing.assert_close(Triton.linear(x, weight), expected, **TOLERANCE[torch.bfloat16])
    assert key in Triton.choices


@pytest.mark.cuda
@pytest.mark.skipif(DEVICE != "cuda" or not Triton.pdl(torch.device(DEVICE, 0)), reason="needs programmatic dependent launch")
def test_dependent_launches_see_their_inputs():
    """Under programmatic dependent launch a kernel is launched before the previous one ends. A graph of MLP blocks
    in which each kernel reads the previous one's output gives the same bits as the same kernels launched the usual
    way, replay after replay."""
    width, hidden_width, blocks = 1024, 3072, 6
    weights = [(randn(2 * hidden_width, width, dtype=torch.bfloat16) / 32, randn(width, hidden_width, dtype=torch.bfloat16) / 64,
                randn(width, dtype=torch.bfloat16)) for _ in range(blocks)]
    hidden = randn(2, width, dtype=torch.bfloat16)

    def mlp_blocks():
        h, x = hidden, Triton.rms_norm(hidden, weights[0][2], 1e-6)
        for gate_up, down, norm_weight in weights:
            activation = Triton.silu_mul(Triton.skinny_matmul(x, gate_up))
            h, x = Triton.skinny_matmul(activation, down, add_rms_norm=(h, norm_weight, 1e-6))
        return h, x

    Triton.PDL = False
    try:
        expected = mlp_blocks()  # the usual launches, eagerly: a reference that no graph computed
    finally:
        Triton.PDL = True
    assert expected[1].isfinite().all()
    outputs, graphs = {}, {}
    for pdl in (False, True):
        Triton.PDL = pdl
        try:
            mlp_blocks()  # compiles
            graphs[pdl] = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graphs[pdl]):
                outputs[pdl] = mlp_blocks()
            for _ in range(20):
                graphs[pdl].replay()
                assert all(torch.equal(a, b) for a, b in zip(outputs[pdl], expected))
        finally:
            Triton.PDL = True


@pytest.mark.skipif(not hasattr(kernels.triton, "AsyncCompileMode"), reason="needs triton.AsyncCompileMode")
def test_precompile_compiles_instead_of_running():
    """While kernels compile ahead, a launch only compiles (the interpreter has nothing to compile) and a measured op
    runs every candidate; afterwards launches run again."""
    x, weight = randn(2, 64, dtype=torch.float32), randn(64, dtype=torch.float32)
    outputs, ran = [], []

    def step():
        outputs.append(Triton.rms_norm(x, weight, 1e-6))
        Triton.measured("probe", "2 rows", x.device, (lambda: ran.append("first"), lambda: ran.append("last")))

    with poisoned_empty():
        Triton.precompile([step])
    assert outputs[0].isnan().all() and ran == ["first", "last"]
    assert ("probe", "2 rows", x.device) not in Triton.choices  # nothing was timed
    torch.testing.assert_close(Triton.rms_norm(x, weight, 1e-6), Torch.rms_norm(x, weight, 1e-6))


def test_skinny_config_splits_narrow_matrices_only():
    wide, narrow = Triton.skinny_config(151936, 2048, sms=132), Triton.skinny_config(2048, 6144, sms=132)
    assert wide.split_k == 1 and narrow.split_k > 1
    assert 6144 // narrow.split_k >= 2 * narrow.block_k  # every K range takes at least two steps
    assert 2048 // narrow.block_n * narrow.split_k <= 132 < 2048 // narrow.block_n * narrow.split_k * 2  # one per SM
    whole_sums = Triton.skinny_config(6144, 2048, sms=132, can_split=False)  # SwiGLU epilogue: narrower tiles instead
    assert whole_sums.split_k == 1 and whole_sums.block_n == 32


def test_near_ties_are_the_unsettled_choices_of_that_batch_size(monkeypatch):
    device = torch.device("cuda", 7)  # keys only: nothing runs
    timings = {("linear", "2x64->32 bfloat16", device): [10.0, 10.9],  # within 10%
               ("linear", "2x64->48 bfloat16", device): [10.2, 11.5, 10.0],
               ("linear", "2x64->96 bfloat16", device): [10.0, 11.2],  # a clear winner
               ("linear", "2x64->128 bfloat16", device): [10.0, 10.1],  # settled already
               ("linear", "12x64->32 bfloat16", device): [10.0, 10.1],  # another batch size
               ("linear", "2x64->32 bfloat16", torch.device("cuda", 6)): [10.0, 10.1],  # another device
               ("linear", "2x64->64 bfloat16", device): [10.0, 12.0, 13.0]}  # candidate 2 is timed in the step anyway
    monkeypatch.setattr(Triton, "timings", timings)
    monkeypatch.setattr(Triton, "step_timings", {("linear", "2x64->128 bfloat16", device): [1.0, 1.1]})
    monkeypatch.setattr(Triton, "in_step", {("linear", "2x64->64 bfloat16", device): (2,)})
    assert Triton.near_ties(device, 2) == {("linear", "2x64->32 bfloat16", device): [0, 1],
                                           ("linear", "2x64->48 bfloat16", device): [0, 2],
                                           ("linear", "2x64->64 bfloat16", device): [0, 2]}
    assert Torch.near_ties(device, 2) == {}


def test_ops_selection():
    assert not Triton.pdl(torch.device("cpu"))
    assert kernels.decode_ops(torch.device("cpu"), torch.bfloat16, True) is Torch
    assert kernels.decode_ops(torch.device("cuda"), torch.float32, True) is Torch  # tl.dot would round to TF32
    assert kernels.decode_ops(torch.device("cuda"), torch.bfloat16, False) is Torch
    assert kernels.decode_ops(torch.device("cuda"), torch.bfloat16, True) is Triton


@pytest.mark.skipif(DEVICE == "cuda", reason="the CUDA tests cover the kernels in the real model")
def test_tiny_model_generates_like_stock_with_the_kernels(tiny_pair):
    """Prefill and the whole decode loop with every Triton kernel (interpreted, fp32) still equal stock generate."""
    from conftest import build, chat, image

    ours, stock = tiny_pair
    model_inputs = build(([[chat("image", "What is it?")], [chat("Hi")]], {"images": [image(64, 64)]}))
    expected = stock.generate(**model_inputs, max_new_tokens=10, do_sample=False)
    ours.static_cache()
    runners = (ours._runner, ours._prefill_runner, ours.model.visual.runner)
    for runner in runners:
        runner.ops = Triton
    try:
        assert ours.generate(**model_inputs, max_new_tokens=10, do_sample=False).tolist() == expected.tolist()
    finally:
        for runner in runners:
            runner.ops = Torch


def test_kernel_sources_parse_as_compiling_triton_parses_them():
    """The interpreter runs a kernel's Python; compiling Triton first parses its source for the cache key, and older
    releases reject constructs that newer ones accept (Triton 3.6, the H200's, rejected a nested tuple assignment
    that 3.9 parsed: bench/results/*session12-triton36-parse*). So a process without the interpreter (no GPU needed)
    builds every kernel's cache key; CI runs this under Triton 3.6 in one leg."""
    source = Path(kernels.__file__)
    script = ("import triton; from qwen3vl_static import kernels_qwen3vl_graph as k; "
              "jitted = [f for f in vars(k).values() if isinstance(f, triton.runtime.jit.JITFunction)]; "
              "[f.cache_key for f in jitted]; print(len(jitted))")
    result = subprocess.run([sys.executable, "-c", script], env={**os.environ, "TRITON_INTERPRET": "0"},
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert int(result.stdout.split()[-1]) == source.read_text().count("@triton.jit")
