"""FP8 weights in the kernels (fp8_qwen3vl_graph.py, ops_fp8_matmul_qwen3vl_graph.py and the FP8 tiles of the skinny
matmul): every form against the torch reference on the dequantized matrix."""

import pytest
import torch
from ops_checks import (
    DEVICE,
    DTYPES,
    TOLERANCE,
    Torch,
    Triton,
    assert_close_at_scale,
    column_tickets,
    needs_triton,
    poisoned_empty,
    randn,
)
from torch import nn

from qwen3vl_static import ops_matmul_qwen3vl_graph as matmul
from qwen3vl_static.fp8_qwen3vl_graph import Fp8Weight, fused_fp8_scales, linear_weight
from qwen3vl_static.fp8_quantize import dequantize_blocks, fp8_linear, quantize_blocks
from qwen3vl_static.ops_fp8_matmul_qwen3vl_graph import dequantize, fp8_matmul
from qwen3vl_static.ops_norm_qwen3vl_graph import rms_norm_reference
from qwen3vl_static.ops_rotary_qwen3vl_graph import qk_norm_rope_write


def random_fp8(n, k, scale_rows=128, dtype=torch.float32) -> Fp8Weight:
    """An FP8 matrix of random bytes and random block scales (several scale rows and columns, partial edge blocks).
    The scales are followed in memory by NaNs: a kernel reading past them poisons its output."""
    data = (torch.randn(n, k, device=DEVICE) * 64).to(torch.float8_e4m3fn)
    shape = (-(-n // scale_rows), -(-k // 128))
    scales = torch.full((shape[0] * shape[1] + 256,), float("nan"), device=DEVICE)
    scales[: shape[0] * shape[1]] = torch.rand(shape[0] * shape[1], device=DEVICE) / 256 + 1 / 1024
    return Fp8Weight(data, scales[: shape[0] * shape[1]].view(shape), scale_rows)


def reference(x, weight, bias=None):
    """The projection on the float32 dequantized matrix."""
    return matmul.linear_reference(x.float(), weight.dequantize(torch.float32), None if bias is None else bias.float())


def assert_fp8_close(out, expected):
    """`assert_close_at_scale` for FP8 tiles: their `tl.dot` form meets x in float16 (`_float16_columns`), exact for
    16-bit x but 11 significant bits of a float32 x (the interpreter's checks)."""
    assert_close_at_scale(out, expected, float32_bound=2**-10)


def test_dequantize_matches_the_checkpoint_format():
    weight = torch.randn(200, 300, device=DEVICE)
    data, scale = quantize_blocks(weight)
    assert data.dtype == torch.float8_e4m3fn and scale.shape == (2, 3)
    torch.testing.assert_close(Fp8Weight(data, scale, 128).dequantize(torch.float32), dequantize_blocks(data, scale))
    torch.testing.assert_close(dequantize_blocks(data, scale), weight, rtol=0.07, atol=1e-4)  # 3 mantissa bits


def test_fused_parts_keep_their_scales():
    """q/k/v parts narrower than a block (64, 32, 32 rows): the fused matrix repeats each part's scales at 32-row
    height, so it dequantizes to the parts stacked."""
    linears = [fp8_linear(nn.Linear(160, rows, bias=False, device=DEVICE)) for rows in (64, 32, 32)]
    scale, scale_rows = fused_fp8_scales(linears)
    assert scale_rows == 32 and scale.shape == (4, 2)
    fused = Fp8Weight(torch.cat([linear.weight for linear in linears]), scale, scale_rows)
    parts = torch.cat([linear_weight(linear).dequantize(torch.float32) for linear in linears])
    torch.testing.assert_close(fused.dequantize(torch.float32), parts, rtol=0, atol=0)


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, scale_rows", [(1, 128), (5, 32)])
@pytest.mark.parametrize("form", ["one-pass", "split-k", "narrow-tiles", "two-blocks", "two-blocks-wide", "fma",
                                  "fma-split-k", "fma-preloaded"])
def test_skinny_matmul_on_fp8_tiles(dtype, rows, scale_rows, form):
    """K = 300: the last scale block is partial; N = 200: the last column tile is partial. The `tl.dot` form's tiles
    of 64 and 128 rows are reordered for the tensor cores (`_mma_rows`), narrower ones not; its ranges of two blocks
    (the second past K in the last) load both before either product; the FMA form's tiles span whole K ranges (one of
    512, or 3 of 128), loaded before the PDL wait or after it."""
    x, weight = randn(rows, 300, dtype=dtype), random_fp8(200, 300, scale_rows)
    block_n, block_k, split_k = {"one-pass": (64, 128, 1), "split-k": (128, 128, 2), "narrow-tiles": (32, 128, 2),
                                 "two-blocks": (64, 256, 2), "two-blocks-wide": (128, 256, 2),
                                 "fma": (32, 512, 1), "fma-split-k": (32, 128, 3), "fma-preloaded": (16, 128, 3)}[form]
    config = matmul.SkinnyConfig(block_n=block_n, block_k=block_k, split_k=split_k, num_warps=4, num_stages=2,
                                 preload=form == "fma-preloaded", fma=form.startswith("fma"))
    with poisoned_empty():
        out = matmul.skinny_matmul(x, weight, config, ticket=column_tickets())
    (assert_close_at_scale if config.fma else assert_fp8_close)(out, reference(x, weight))


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_n, block_k, split_k", [(32, 128, 1), (64, 128, 2), (128, 256, 2)],
                         ids=["one-pass", "split-k", "two-blocks"])
def test_skinny_matmul_on_fp8_tiles_of_many_rows(dtype, block_n, block_k, split_k):
    """40 rows (a `tl.dot` 64 rows wide, padding masked) in the `tl.dot` form (the FMA form takes a few rows only)."""
    x, weight = randn(40, 300, dtype=dtype), random_fp8(200, 300, 128)
    config = matmul.SkinnyConfig(block_n=block_n, block_k=block_k, split_k=split_k, num_warps=4, num_stages=2)
    with poisoned_empty():
        out = matmul.skinny_matmul(x, weight, config, ticket=column_tickets())
    assert_fp8_close(out, reference(x, weight))


@needs_triton
def test_fp8_tiles_take_x_beyond_float16s_range():
    """bfloat16 x past float16's range (1e6), below its normal range (1e-6) and all zero, row by row and within a
    block: each x column meets the FP8 tiles scaled into float16, so nothing overflows or flushes."""
    x, weight = randn(4, 300, dtype=torch.bfloat16), random_fp8(200, 300)
    x[0] *= 1e6
    x[1] *= 1e-6
    x[2] = 0
    x[3, :100] *= 1e6
    for config in (matmul.SkinnyConfig(32, 128, 2, 4, 2), *matmul.fma_configs(weight, 4)[:1]):
        with poisoned_empty():
            out = matmul.skinny_matmul(x, weight, config, ticket=column_tickets())
        expected = reference(x, weight)
        for row in range(4):
            assert_close_at_scale(out[row], expected[row])


@needs_triton
def test_fp8_tiles_stay_within_a_scale_block():
    x, weight = randn(1, 512, dtype=torch.float32), random_fp8(64, 512)
    for block_k in (64, 512):
        with pytest.raises(ValueError, match="or a program's whole K range of two"):
            matmul.skinny_matmul(x, weight, matmul.SkinnyConfig(32, block_k, 1, num_warps=4, num_stages=2))
    with pytest.raises(ValueError, match="whole K range"):  # two 256-input tiles per range of 512
        matmul.skinny_matmul(x, weight, matmul.SkinnyConfig(64, 256, 1, num_warps=4, num_stages=1))
    assert matmul.preload_config(weight) is None
    with pytest.raises(ValueError, match="FMA form only"):
        matmul.skinny_matmul(x, weight, matmul.SkinnyConfig(32, 128, 4, 4, 1, preload=True))
    with pytest.raises(ValueError, match="takes an Fp8Weight"):
        matmul.skinny_matmul(x, weight.dequantize(torch.float32), matmul.SkinnyConfig(32, 512, 1, 4, 2, fma=True))
    with pytest.raises(ValueError, match="whole K range"):  # two 256-input tiles per range
        matmul.skinny_matmul(x, weight, matmul.SkinnyConfig(32, 256, 1, 4, 2, fma=True))
    assert all(config.fma and config.block_k * config.split_k >= 512 for config in matmul.fma_configs(weight, 1))
    assert matmul.fma_configs(weight, matmul.FMA_MAX_ROWS + 1) == []


def test_fp8_tilings_offered_by_rows():
    """The tuner measures the `tl.dot` tilings from 2 rows and the FMA form's up to FMA_MAX_ROWS."""
    weight = random_fp8(256, 1024)
    for rows, dot, fma in ((1, False, True), (2, True, True), (matmul.FMA_MAX_ROWS, True, True),
                           (matmul.FMA_MAX_ROWS + 1, True, False), (matmul.DOT_ROWS, True, False)):
        configs = matmul.fp8_configs(weight, rows)
        assert any(config.fma for config in configs) == fma
        assert any(not config.fma for config in configs) == dot
        assert list(matmul.split_configs(weight, rows)[-len(configs):]) == configs
        assert list(matmul.stage_configs(matmul.rule_config(weight), weight, rows)[-len(configs):]) == configs


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_dequantize_kernel(dtype):
    weight = random_fp8(200, 300, scale_rows=64)
    with poisoned_empty():
        out = dequantize(weight, dtype)
    torch.testing.assert_close(out, weight.dequantize(dtype), rtol=0, atol=0)


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_epilogues(dtype):
    """SwiGLU and add-and-RMSNorm epilogues of the skinny matmul on FP8 tiles."""
    rows = 3
    x = randn(rows, 256, dtype=dtype)
    gate_up = random_fp8(2 * 96, 256, scale_rows=32)
    config = matmul.SkinnyConfig(block_n=64, block_k=128, split_k=1, num_warps=4, num_stages=2)
    for form in (config, config._replace(split_k=2), config._replace(block_k=256, fma=True),
                 config._replace(block_k=256, num_stages=1)):
        with poisoned_empty():
            out = matmul.skinny_matmul(x, gate_up, form, swiglu=True, ticket=column_tickets())
        (assert_close_at_scale if form.fma else assert_fp8_close)(out, matmul.silu_mul_reference(reference(x, gate_up)))
    weight, hidden, norm_weight = random_fp8(100, 256), randn(rows, 100, dtype=dtype), randn(100, dtype=dtype)
    with poisoned_empty():
        total, normed = matmul.skinny_matmul(x, weight, config._replace(split_k=2), add_rms_norm=(hidden, norm_weight, 1e-6),
                                             ticket=Triton.ticket(x.device))
    assert_fp8_close(total, hidden.float() + reference(x, weight))
    torch.testing.assert_close(normed, rms_norm_reference(total, norm_weight, 1e-6), **TOLERANCE[dtype])


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("form", ["fused", "summed-by-norm"])
@pytest.mark.parametrize("fma, preload, blocks",
                         [(False, False, 1), (False, False, 2), (True, False, 1), (True, True, 1)],
                         ids=["tl.dot", "tl.dot-two-blocks", "fma", "fma-preloaded"])
def test_fp8_qkv_norm_rope_write(dtype, form, fma, preload, blocks):
    rows, heads, kv_heads, dim, hidden, slots = 2, 4, 2, 64, 256, 8
    x, qkv = randn(rows, hidden, dtype=dtype), random_fp8((heads + 2 * kv_heads) * dim, hidden, scale_rows=64)
    qk_norms = randn(dim, dtype=dtype), randn(dim, dtype=dtype), 1e-6
    cos, sin = randn(rows, 1, dim, dtype=dtype), randn(rows, 1, dim, dtype=dtype)
    cache_rows, cache_slots = torch.arange(rows, device=DEVICE), torch.tensor([5, 0], device=DEVICE)
    keys = torch.zeros(rows, kv_heads, slots, dim, dtype=dtype, device=DEVICE)
    values = torch.zeros_like(keys)
    k_ref, v_ref = keys.float(), values.float()
    q_ref = Torch.qk_norm_rope_write(reference(x, qkv), heads, *(w.float() for w in qk_norms[:2]), qk_norms[2],
                                     Torch.rotary(cos.float(), sin.float()), k_ref, v_ref, cache_rows, cache_slots)
    config = matmul.SkinnyConfig(block_n=64, block_k=128 * blocks, split_k=2 // blocks, num_warps=4, num_stages=2,
                                 preload=preload, fma=fma)  # K = 2 x 128
    with poisoned_empty():
        if form == "fused":
            q = matmul.fused_qkv(x, qkv, heads, qk_norms, Triton.rotary(cos, sin), keys, values, cache_rows, cache_slots,
                                 config, Triton.ticket(x.device, heads + 2 * kv_heads))
        else:
            q = qk_norm_rope_write(matmul.skinny_matmul(x, qkv, config, partials=True), heads, *qk_norms,
                                   Triton.rotary(cos, sin), keys, values, cache_rows, cache_slots)
    check = assert_close_at_scale if fma else assert_fp8_close
    check(q, q_ref)
    check(keys, k_ref)
    check(values, v_ref)


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
def test_fp8_matmul(dtype, bias):
    """Many rows: the matrix dequantized (64-row scale blocks of a fused matrix, partial edge blocks), then cuBLAS."""
    x, weight = randn(40, 300, dtype=dtype), random_fp8(200, 300, scale_rows=64)
    b = randn(200, dtype=dtype) if bias else None
    with poisoned_empty():
        out = fp8_matmul(x, weight, b)
    assert_close_at_scale(out, reference(x, weight, b))


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [2, 40])
def test_op_sets_take_fp8_weights(dtype, rows):
    """The measured compositions of both op sets on an `Fp8Weight`: linear (with a bias too), SwiGLU, add-and-norm,
    the vision MLP's GELU projection."""
    x, weight, bias = randn(rows, 256, dtype=dtype), random_fp8(128, 256), randn(128, dtype=dtype)
    hidden, norm_weight = randn(rows, 128, dtype=dtype), randn(128, dtype=dtype)
    for ops in (Torch, Triton):
        assert_fp8_close(ops.linear(x, weight), reference(x, weight))
        assert_fp8_close(ops.linear(x, weight, bias), reference(x, weight, bias))
        assert_fp8_close(ops.linear_swiglu(x, weight), matmul.silu_mul_reference(reference(x, weight)))
        total, _ = ops.linear_add_rms_norm(x, weight, None, hidden, norm_weight, 1e-6)
        assert_fp8_close(total, hidden.float() + reference(x, weight))
        assert_fp8_close(ops.linear_gelu_tanh(x, weight, bias),
                         matmul.linear_gelu_tanh_reference(x.float(), weight.dequantize(torch.float32), bias.float()))
