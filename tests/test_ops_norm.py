"""The RMSNorm and LayerNorm kernels (ops_norm_qwen3vl_graph.py) against their torch references."""

import pytest
import torch
from ops_checks import DEVICE, DTYPES, TOLERANCE, needs_triton, poisoned_empty, randn

from qwen3vl_static import ops_norm_qwen3vl_graph as norm

pytestmark = needs_triton


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_add_rms_norm_and_embed_rms_norm(dtype):
    hidden, delta, weight = randn(3, 200, dtype=dtype), randn(3, 200, dtype=dtype), randn(200, dtype=dtype)
    torch.testing.assert_close(norm.rms_norm(hidden, weight, 1e-6), norm.rms_norm_reference(hidden, weight, 1e-6),
                               **TOLERANCE[dtype])
    total, normed = norm.add_rms_norm(hidden, delta, weight, 1e-6)
    expected_total, expected_normed = norm.add_rms_norm_reference(hidden, delta, weight, 1e-6)
    torch.testing.assert_close(total, expected_total, rtol=0, atol=0)  # the sum is rounded like torch's add
    torch.testing.assert_close(normed, expected_normed, **TOLERANCE[dtype])
    table, ids = randn(50, 200, dtype=dtype), torch.tensor([7, 49, 7, 0], device=DEVICE)  # the step's first norm
    with poisoned_empty():
        embedded, normed_embedded = norm.embed_rms_norm(ids, table, weight, 1e-6)
    torch.testing.assert_close(embedded, table[ids], rtol=0, atol=0)
    torch.testing.assert_close(normed_embedded, norm.embed_rms_norm_reference(ids, table, weight, 1e-6)[1],
                               **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_norms_write_into_the_halves_of_a_wider_buffer(dtype):
    """An EAGLE-3 draft's input: [norm(embedding), norm(hidden)] side by side, each written in place."""
    hidden, weight, table = randn(3, 200, dtype=dtype), randn(200, dtype=dtype), randn(50, 200, dtype=dtype)
    ids = torch.tensor([7, 49, 0], device=DEVICE)
    expected = torch.cat([norm.embed_rms_norm_reference(ids, table, weight, 1e-6)[1],
                          norm.rms_norm_reference(hidden, weight, 1e-6)], dim=-1)
    for embed_rms_norm, rms_norm in ((norm.embed_rms_norm, norm.rms_norm),
                                     (norm.embed_rms_norm_reference, norm.rms_norm_reference)):
        wide = torch.full((3, 400), float("nan"), dtype=dtype, device=DEVICE)
        assert embed_rms_norm(ids, table, weight, 1e-6, out=wide[:, :200])[1].data_ptr() == wide.data_ptr()
        rms_norm(hidden, weight, 1e-6, out=wide[:, 200:])
        torch.testing.assert_close(wide, expected, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_layer_norm(dtype):
    hidden, delta = randn(5, 200, dtype=dtype), randn(5, 200, dtype=dtype)
    weight, bias = randn(200, dtype=dtype), randn(200, dtype=dtype)
    with poisoned_empty():
        total, normed = norm.add_layer_norm(hidden, delta, weight, bias, 1e-6)
    expected_total, expected_normed = norm.add_layer_norm_reference(hidden, delta, weight, bias, 1e-6)
    torch.testing.assert_close(total, expected_total, rtol=0, atol=0)
    torch.testing.assert_close(normed, expected_normed, **TOLERANCE[dtype])
