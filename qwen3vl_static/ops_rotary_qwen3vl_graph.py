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
"""Rotary embeddings: the decode step's M-RoPE tables, QK-norm + RoPE + KV-cache write of the fused QKV output, and
the vision attention's q/k rotation; the torch references and the fused Triton kernels.

Tables follow the `rotate_half` convention: `rotate_half(x) * sin == x.roll(D / 2) * signed_sin`.
"""

import torch
import torch.nn.functional as F
from transformers.models.qwen3_vl.modeling_qwen3_vl import apply_rotary_pos_emb_vision

from .ops_norm_qwen3vl_graph import _load_summed
from .cache_qwen3vl_graph import cache_values
from .triton_qwen3vl_graph import _cache_value, _wait_then_release, launch, sm_count, tl, triton


def rotary_reference(cos, sin):
    """Per-step rotary tables from `rotary_emb` `(rows, 1, D)`: `rotate_half(x) * sin == x.roll(D/2) * signed_sin`."""
    half = sin.shape[-1] // 2
    return cos, torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)


def qk_norm_rope_write_reference(qkv, heads, q_weight, k_weight, eps, rotary, keys, values, cache_rows, cache_slots,
                                 return_kv: bool = False):
    """QK-norm and rotary embedding of the fused QKV output `(rows, (Hq + 2 Hkv) * D)`, one token per row; writes
    each row's K and V into the cache at `[cache_rows[row], :, cache_slots[row]]` and returns the queries
    `(rows, Hq, D)`. Decoding writes one token of each sequence; prefill writes all tokens of the prompt. `q_weight`
    None: no QK-norm, the rotary embedding only.
    `return_kv`: returns `(q, k, v)`, with the K and V written `(rows, Hkv, D)`, as the cache holds them (a fresh
    prompt's attention reads them there instead of gathering its cache rows)."""
    rows, kv_heads, head_dim = qkv.shape[0], keys.shape[1], keys.shape[-1]
    qkv = qkv.view(rows, -1, head_dim)
    if q_weight is None:  # no QK-norm (an EAGLE-3 draft's Llama layer)
        qk = qkv[:, : heads + kv_heads]
    else:
        qk = F.rms_norm(qkv[:, : heads + kv_heads], (head_dim,), eps=eps)
        qk[:, :heads] *= q_weight
        qk[:, heads:] *= k_weight
    cos, signed_sin = rotary
    qk = torch.addcmul(qk * cos, qk.roll(head_dim // 2, dims=-1), signed_sin)
    k, v = cache_values(qk[:, heads:], keys.dtype), cache_values(qkv[:, heads + kv_heads :], values.dtype)
    keys[cache_rows, :, cache_slots] = k
    values[cache_rows, :, cache_slots] = v
    if return_kv:  # as the cache holds them, in the queries' dtype
        return qk[:, :heads], k.to(qk.dtype), v.to(qk.dtype)
    return qk[:, :heads]


def vision_qkv_rope_reference(qkv, heads, cos, sin):
    """The vision attention's fused QKV output `(N, 3 H D)` -> q, k, v `(1, H, N, D)` for SDPA, q and k rotated
    in float32 and rounded once (stock `apply_rotary_pos_emb_vision`); `cos`/`sin` are `(N, D)`. Stored
    patch-major `(N, H, D)`, so SDPA's output is patch-major too and the output projection reads it without a
    transposing copy."""
    length = qkv.shape[0]
    q, k, v = qkv.reshape(length, 3, heads, -1).permute(1, 0, 2, 3).unbind(0)
    q, k = apply_rotary_pos_emb_vision(q, k, cos, sin)
    return tuple(states.transpose(0, 1).unsqueeze(0) for states in (q, k, v))


if triton is not None:

    @triton.jit
    def _head_weights(weight, HEAD_DIM: tl.constexpr):
        """A per-head norm's weights, float32, and the same rolled by HEAD_DIM / 2 (rotate_half(x) == sign *
        x.roll(HEAD_DIM / 2)); `(1, HEAD_DIM)` each, for `_norm_rope`."""
        dims = tl.arange(0, HEAD_DIM)[None, :]
        return tl.load(weight + dims).to(tl.float32), tl.load(weight + (dims + HEAD_DIM // 2) % HEAD_DIM).to(tl.float32)

    @triton.jit
    def _rope_tables(cos, sin, HEAD_DIM: tl.constexpr):
        """One token's rotary tables at `cos`, `sin`, float32, the sine signed for `rotate_half`; for `_norm_rope`."""
        dims = tl.arange(0, HEAD_DIM)[None, :]
        sign = tl.where(dims < HEAD_DIM // 2, -1.0, 1.0)
        return tl.load(cos + dims).to(tl.float32), sign * tl.load(sin + dims).to(tl.float32)

    @triton.jit
    def _norm_rope(x, x_rolled, weights, tables, eps, HEAD_DIM: tl.constexpr, NORM: tl.constexpr):
        """RMSNorm of each head (a row of `x`, float32; with NORM) then the rotary embedding (`rotate_half`
        convention), float32 throughout. `x_rolled`: the heads rolled by HEAD_DIM / 2; `weights`, `tables`:
        `_head_weights`, `_rope_tables`, loaded by the caller before the sum's reduction (a load after it would wait
        for it)."""
        w, w_rolled = weights
        cos, signed_sin = tables
        if NORM:
            rstd = (1.0 / tl.sqrt(tl.sum(x * x, axis=1) / HEAD_DIM + eps))[:, None]
            x = x * rstd * w
            x_rolled = x_rolled * rstd * w_rolled
        return x * cos + x_rolled * signed_sin

    @triton.jit
    def _load_heads(base, heads, keep, splits, split_stride, dtype, HEAD_DIM: tl.constexpr):
        """The heads `heads` (a column of head indices, `keep` masking it) of one token at `base` (its `splits`
        partials, `_load_summed`) and the same rolled by HEAD_DIM / 2: `_norm_rope`'s x and x_rolled."""
        dims = tl.arange(0, HEAD_DIM)[None, :]
        rolled = (dims + HEAD_DIM // 2) % HEAD_DIM
        return (_load_summed(base, heads * HEAD_DIM + dims, keep, splits, split_stride, dtype, ""),
                _load_summed(base, heads * HEAD_DIM + rolled, keep, splits, split_stride, dtype, ""))

    @triton.jit
    def _rope_store(
        source, out, stride_out_head, c1, c2, s1, s2, HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr
    ):
        """Rotate all heads of one patch by float32 tables (`rotate_half` convention); store them rounded once."""
        heads = tl.arange(0, HEADS_PAD)[:, None]
        half = tl.arange(0, HEAD_DIM // 2)[None, :]
        keep = heads < HEADS
        x1 = tl.load(source + heads * HEAD_DIM + half, mask=keep).to(tl.float32)
        x2 = tl.load(source + heads * HEAD_DIM + HEAD_DIM // 2 + half, mask=keep).to(tl.float32)
        target = out + heads * stride_out_head + half
        tl.store(target, (x1 * c1 - x2 * s1).to(out.dtype.element_ty), mask=keep)
        tl.store(target + HEAD_DIM // 2, (x2 * c2 + x1 * s2).to(out.dtype.element_ty), mask=keep)

    @triton.jit
    def _vision_qkv_rope_kernel(
        qkv, cos, sin, q_out, k_out, v_out, HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr
    ):
        """One patch, all heads: q and k rotated in float32 and rounded once, v copied; all three to `(N, H, D)`."""
        row = tl.program_id(0)
        half = tl.arange(0, HEAD_DIM // 2)[None, :]
        c1 = tl.load(cos + row * HEAD_DIM + half)
        c2 = tl.load(cos + row * HEAD_DIM + HEAD_DIM // 2 + half)
        s1 = tl.load(sin + row * HEAD_DIM + half)
        s2 = tl.load(sin + row * HEAD_DIM + HEAD_DIM // 2 + half)
        source = qkv + row * 3 * HEADS * HEAD_DIM
        target = row * HEADS * HEAD_DIM
        _rope_store(source, q_out + target, HEAD_DIM, c1, c2, s1, s2, HEADS, HEADS_PAD, HEAD_DIM)
        _rope_store(source + HEADS * HEAD_DIM, k_out + target, HEAD_DIM, c1, c2, s1, s2, HEADS, HEADS_PAD, HEAD_DIM)
        heads = tl.arange(0, HEADS_PAD)[:, None]
        dims = tl.arange(0, HEAD_DIM)[None, :]
        keep = heads < HEADS
        value = tl.load(source + (2 * HEADS + heads) * HEAD_DIM + dims, mask=keep)
        tl.store(v_out + target + heads * HEAD_DIM + dims, value, mask=keep)

    @triton.jit
    def _qk_norm_rope_write_kernel(
        qkv, q_weight, k_weight, cos, sin, q_out, keys, values, cache_rows, cache_slots, k_out, v_out, eps, splits,
        split_stride, stride_cache_row, stride_cache_head, stride_cache_slot,
        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, KV_HEADS: tl.constexpr, KV_BLOCK: tl.constexpr,
        HEAD_DIM: tl.constexpr, RETURN_KV: tl.constexpr, NORM: tl.constexpr, PDL: tl.constexpr,
    ):
        """One token and KV_BLOCK of its KV heads per program: their query heads, normed (NORM) and rotated, to `q_out`;
        their keys, normed and rotated, and values into the cache (and as it holds them to `k_out`, `v_out` `(tokens,
        KV heads, D)` with RETURN_KV). q and k are rounded once to `q_out`'s dtype, then K and V to the cache's. `qkv`
        is the projection's output or its `splits` float32 partials (`_load_summed`)."""
        # Norm weights never change during a step, so they load before the PDL wait, during the previous kernel.
        q_weights, k_weights = _head_weights(q_weight, HEAD_DIM), _head_weights(k_weight, HEAD_DIM)
        _wait_then_release(PDL)
        row = tl.program_id(0)
        kv_heads = tl.program_id(1) * KV_BLOCK + tl.arange(0, KV_BLOCK)[:, None]
        members = tl.arange(0, KV_BLOCK * GROUP_PAD)[:, None]  # each KV head's query group, padded
        q_heads = (tl.program_id(1) * KV_BLOCK + members // GROUP_PAD) * GROUP + members % GROUP_PAD
        q_kept = members % GROUP_PAD < GROUP
        every = kv_heads < KV_HEADS
        base = qkv + row * (KV_HEADS * GROUP + 2 * KV_HEADS) * HEAD_DIM
        tables = _rope_tables(cos + row * HEAD_DIM, sin + row * HEAD_DIM, HEAD_DIM)
        dims = tl.arange(0, HEAD_DIM)[None, :]
        dtype = q_out.dtype.element_ty
        # Every load first: a load after a reduction would wait for it.
        q, q_rolled = _load_heads(base, q_heads, q_kept, splits, split_stride, dtype, HEAD_DIM)
        k, k_rolled = _load_heads(base, KV_HEADS * GROUP + kv_heads, every, splits, split_stride, dtype, HEAD_DIM)
        v = _load_summed(base, (KV_HEADS * GROUP + KV_HEADS + kv_heads) * HEAD_DIM + dims, every, splits,
                         split_stride, dtype, "")
        slot = (tl.load(cache_rows + row) * stride_cache_row + kv_heads * stride_cache_head
                + tl.load(cache_slots + row) * stride_cache_slot + dims)
        q = _norm_rope(q, q_rolled, q_weights, tables, eps, HEAD_DIM, NORM)
        tl.store(q_out + (row * KV_HEADS * GROUP + q_heads) * HEAD_DIM + dims, q.to(dtype), mask=q_kept)
        k = _cache_value(_norm_rope(k, k_rolled, k_weights, tables, eps, HEAD_DIM, NORM).to(dtype), keys)
        v = _cache_value(v.to(dtype), values)
        tl.store(keys + slot, k)
        tl.store(values + slot, v)
        if RETURN_KV:
            written = (row * KV_HEADS + kv_heads) * HEAD_DIM + dims
            tl.store(k_out + written, k.to(dtype))
            tl.store(v_out + written, v.to(dtype))

    @triton.jit
    def _decode_rotary_kernel(positions, stride_component, stride_row, components, inv_freq, scaling, cos, sin,
                              HEAD_DIM: tl.constexpr, PDL: tl.constexpr):
        """One row's rotary tables: column j turns by (its T/H/W position component) x inv_freq[j mod D/2], in float32
        as the stock module computes it, rounded once."""
        _wait_then_release(PDL)
        row = tl.program_id(0)
        dims = tl.arange(0, HEAD_DIM)
        position = tl.load(positions + tl.load(components + dims) * stride_component + row * stride_row)
        angle = position.to(tl.float32) * tl.load(inv_freq + dims % (HEAD_DIM // 2))
        tl.store(cos + row * HEAD_DIM + dims, (tl.cos(angle) * scaling).to(cos.dtype.element_ty))
        tl.store(sin + row * HEAD_DIM + dims, (tl.sin(angle) * scaling).to(sin.dtype.element_ty))

else:
    _head_weights = _rope_tables = _norm_rope = None


def rotary(cos, sin):
    """The kernels' form of the tables from `rotary_emb` `(rows, 1, D)`: `(rows, D)`, contiguous, the sine unsigned
    (each kernel signs it for `rotate_half`)."""
    return cos.reshape(cos.shape[0], -1).contiguous(), sin.reshape(sin.shape[0], -1).contiguous()


def rotary_components(rotary_emb, device):
    """Which T/H/W position component turns each rotary column, read off the stock module itself (its layout of
    the M-RoPE sections is not restated here): with only component c at 1, exactly c's columns have a nonzero
    sin. None where the module's tables are not a fixed function of the positions (dynamic RoPE types)."""
    if getattr(rotary_emb, "rope_type", None) != "default":
        return None
    probe = torch.eye(3, dtype=torch.long, device=device)[:, :, None]  # row r: component r at 1
    _, sin = rotary_emb(torch.empty(0, device=device), probe)
    turned = sin[:, 0] != 0  # (rows = components, D)
    if not (turned.sum(dim=0) == 1).all():
        return None
    return turned.int().argmax(dim=0).to(torch.int32)


def decode_rotary(rotary_emb, hidden, positions, components):
    """The step's rotary tables for M-RoPE `positions` `(3, rows, 1)`, as `rotary` returns them, in one launch for
    the dozen small kernels of the stock module; `components`: `rotary_components` (not None)."""
    rows, dim = hidden.shape[0], components.shape[0]
    cos, sin = torch.empty(2, rows, dim, dtype=hidden.dtype, device=hidden.device)
    launch(_decode_rotary_kernel, (rows,), positions, positions.stride(0), positions.stride(1), components,
           rotary_emb.inv_freq, rotary_emb.attention_scaling, cos, sin, HEAD_DIM=dim)
    return cos, sin


def qk_norm_rope_write(qkv, heads, q_weight, k_weight, eps, rotary, keys, values, cache_rows, cache_slots,
                       return_kv: bool = False):
    """`qk_norm_rope_write_reference` in one launch. `qkv` is the projection's output `(rows, N)`, or its float32
    partial products `(splits, rows, N)` (`skinny_matmul(..., partials=True)`), summed and rounded here. A decode
    step's few rows take a program per (token, KV head), which keeps the launch wide; where the tokens alone are at
    least one per SM (a prefill), a program takes all KV heads of its token: programs of one head there are mostly
    launch and addressing (an H200 prefill of 2048 tokens spent 24 us a layer in this kernel with them)."""
    rows, n = qkv.shape[-2:]
    kv_heads, head_dim = keys.shape[1], keys.shape[-1]
    dtype = rotary[0].dtype  # the model's (the cache's may be narrower)
    q = torch.empty(rows, heads, head_dim, dtype=dtype, device=qkv.device)
    k, v = torch.empty(2, rows, kv_heads, head_dim, dtype=dtype, device=qkv.device) if return_kv else (q, q)
    cos, sin = rotary
    group = heads // kv_heads
    per_token = rows >= sm_count(qkv.device) and kv_heads & (kv_heads - 1) == 0  # `tl.arange` needs a power of two
    kv_block = kv_heads if per_token else 1
    norm = q_weight is not None
    launch(_qk_norm_rope_write_kernel, (rows, kv_heads // kv_block),
        qkv, q_weight if norm else cos, k_weight if norm else cos, cos, sin, q, keys, values, cache_rows, cache_slots,
        k, v, eps, qkv.numel() // (rows * n), rows * n, keys.stride(0), keys.stride(1), keys.stride(2),
        GROUP=group, GROUP_PAD=triton.next_power_of_2(group), KV_HEADS=kv_heads, KV_BLOCK=kv_block,
        HEAD_DIM=head_dim, RETURN_KV=return_kv, NORM=norm,
    )
    return (q, k, v) if return_kv else q


def vision_qkv_rope(qkv, heads, cos, sin):
    """`vision_qkv_rope_reference` in one launch (the stock rotary is a dozen elementwise passes in float32); the
    reference itself where half a head is not a power of two (the 8B tower's 72-wide heads), which the kernel's
    `tl.arange` needs."""
    length, head_dim = qkv.shape[0], qkv.shape[1] // (3 * heads)
    if (head_dim // 2) & (head_dim // 2 - 1):
        return vision_qkv_rope_reference(qkv, heads, cos, sin)
    q, k, v = torch.empty(3, length, heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    launch(_vision_qkv_rope_kernel, (length,),
        qkv, cos.float().contiguous(), sin.float().contiguous(), q, k, v,
        HEADS=heads, HEADS_PAD=triton.next_power_of_2(heads), HEAD_DIM=head_dim,
    )
    return tuple(states.transpose(0, 1).unsqueeze(0) for states in (q, k, v))
