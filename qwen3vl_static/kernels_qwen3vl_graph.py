"""Decode-step building blocks with as few kernel launches as plain torch allows.

At batch 1 a decode step is launch-bound: the stock RMSNorm alone is eight kernels (upcast, square,
mean, add, rsqrt, multiply, downcast, scale), and it runs four times per layer. These functions compute
the same math as the stock modules with fused torch primitives; fused Triton kernels can replace them
one by one behind the same signatures.
"""

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Stock `Qwen3VLTextRMSNorm` (float32 statistics) as one kernel; the scale is applied before rounding."""
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def fuse_weights(linears) -> torch.Tensor:
    """Put the weights of bias-free linears that share an input into one matrix, one GEMV instead of several.

    The parameters become row views of the fused matrix, so no second copy exists and the modules (and
    their state dict) are unchanged; the previous storages are freed.
    """
    fused = torch.cat([linear.weight.detach() for linear in linears])
    start = 0
    for linear in linears:
        linear.weight.data = fused[start : start + linear.out_features]
        start += linear.out_features
    return fused


def is_fused(fused: torch.Tensor, linears) -> bool:
    """Whether the linears still read their weights from `fused` (a `.to()` or a new state dict may replace them)."""
    start = 0
    for linear in linears:
        if linear.weight.data_ptr() != fused[start].data_ptr():
            return False
        start += linear.out_features
    return True


def rotary_tables(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-step tables for `rope`: `rotate_half(x) * sin == x.roll(d/2) * signed_sin`."""
    half = sin.shape[-1] // 2
    return cos, torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)


def qk_norm_rope(qk, heads, q_weight, k_weight, eps, cos, signed_sin):
    """QK-norm and rotary embedding of one token's query and key heads, together.

    `qk` is `(B, Hq + Hkv, D)` with the `heads` query heads first (adjacent in the fused QKV output).
    """
    qk = F.rms_norm(qk, (qk.shape[-1],), eps=eps)
    qk[:, :heads] *= q_weight
    qk[:, heads:] *= k_weight
    return torch.addcmul(qk * cos, qk.roll(qk.shape[-1] // 2, dims=-1), signed_sin)
