"""Decode-step building blocks with as few kernel launches as plain torch allows.

At batch 1 a decode step is launch-bound: the stock RMSNorm alone is eight kernels (upcast, square,
mean, add, rsqrt, multiply, downcast, scale), and it runs four times per layer. These functions compute
the same math as the stock modules with fused torch primitives; fused Triton kernels can replace them
one by one behind the same signatures.
"""

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Stock `Qwen3VLTextRMSNorm`: normalise with float32 statistics, round to x's dtype, then scale."""
    return weight * F.rms_norm(x, (x.shape[-1],), eps=eps)


def rotary_tables(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-step tables for `rope`: `rotate_half(x) * sin == x.roll(d/2) * signed_sin`."""
    half = sin.shape[-1] // 2
    return cos, torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)


def qk_norm_rope(q, k, q_weight, k_weight, eps, cos, signed_sin):
    """QK-norm and rotary embedding of one token's query `(B, Hq, D)` and key `(B, Hkv, D)` heads, together.

    Returns the rotated `(B, Hq + Hkv, D)` tensor; queries first.
    """
    heads = q.shape[1]
    qk = F.rms_norm(torch.cat([q, k], dim=1), (q.shape[-1],), eps=eps)
    qk[:, :heads] *= q_weight
    qk[:, heads:] *= k_weight
    return torch.addcmul(qk * cos, qk.roll(qk.shape[-1] // 2, dims=-1), signed_sin)
