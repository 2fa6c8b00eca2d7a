"""The decode step's building blocks: plain-torch reference ops and fused Triton kernels.

At small batch a decode step is launch-bound: the stock RMSNorm alone is eight kernels and runs four
times per layer. `TorchDecodeOps` computes the stock math with the fewest torch primitives (and runs
everywhere, the CPU included); `TritonDecodeOps` fuses each block into one kernel. Both take and return
the same tensors, so the runner picks one set and the step does not change. Triton is optional: without
it (or without a GPU) the torch ops run.

The step's matmuls have a few rows, so they are GEMVs bound by reading the weights; `TritonDecodeOps.linear` runs
cuBLAS or a skinny Triton matmul, whichever measured faster on the device for that shape.
"""

import functools
import os
import statistics
from collections import namedtuple
from concurrent.futures import ThreadPoolExecutor
from contextvars import ContextVar

import torch
import torch.nn.functional as F
from transformers.models.qwen3_vl.modeling_qwen3_vl import apply_rotary_pos_emb_vision
from transformers.utils import logging

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch ops cover every environment
    triton = None
try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # a Triton without programmatic dependent launch: every kernel waits for the previous one
    gdc_launch_dependents = gdc_wait = None

logger = logging.get_logger(__name__)

# The skinny matmul's tiling: `block_n` output columns x `block_k` inputs per step, K cut into `split_k` ranges.
# `preload`: each program's whole K range is one tile (`block_k` inputs), loaded before the PDL wait.
SkinnyConfig = namedtuple("SkinnyConfig", "block_n block_k split_k num_warps num_stages preload", defaults=(False,))


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


class TorchDecodeOps:
    """Reference decode ops in plain torch (same math as the stock modules)."""

    @staticmethod
    def linear(x, weight, bias=None):
        """`x @ weight.T (+ bias)`: the step's projections."""
        return F.linear(x, weight, bias)

    @staticmethod
    def rotary(cos, sin):
        """Per-step rotary tables from `rotary_emb` `(rows, 1, D)`: `rotate_half(x) * sin == x.roll(D/2) * signed_sin`."""
        half = sin.shape[-1] // 2
        return cos, torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)

    @staticmethod
    def precompile(calls) -> None:
        """Compile ahead what `calls` would launch: the torch ops have nothing to compile."""

    @staticmethod
    def near_ties(device, rows) -> dict:
        """Measured choices to time again in the whole step (`TritonDecodeOps.near_ties`): the torch ops make none."""
        return {}

    @staticmethod
    def rotary_components(rotary_emb, device):
        """What `decode_rotary` needs to compute a step's rotary tables itself; the torch ops take the stock module's."""
        return None

    @classmethod
    def decode_rotary(cls, rotary_emb, hidden, positions, components):
        """The step's rotary tables for M-RoPE `positions` `(3, rows, 1)`, as `rotary` returns them."""
        return cls.rotary(*rotary_emb(hidden, positions))

    @staticmethod
    def attention_context(attendable, cache_rows, cache_lens, kv_len, dtype):
        """What decode attention needs besides the cache, built once per step: here an additive mask `(rows, 1, 1,
        kv_len)`, and each row's cache row `cache_rows` (the runner's static `arange`) for the KV write.

        A slot is read only if it is written (slot <= the row's length, the current token included) and is not
        left padding: never an unwritten or stale slot.
        """
        slots = torch.arange(kv_len, device=cache_lens.device)
        readable = attendable[:, :kv_len] & (slots <= cache_lens[:, None])
        mask = torch.zeros(readable.shape, dtype=dtype, device=readable.device)
        return mask.masked_fill(~readable, float("-inf"))[:, None, None, :], cache_rows

    @staticmethod
    def rms_norm(x, weight, eps):
        """Stock `Qwen3VLTextRMSNorm` (float32 statistics) as one kernel; the scale is applied before rounding."""
        return F.rms_norm(x, (x.shape[-1],), weight, eps)

    @classmethod
    def embed_rms_norm(cls, ids, table, weight, eps):
        """The embeddings of token `ids` `(rows,)` (rows of `table`), then their RMSNorm: returns (embeddings, normed)."""
        hidden = F.embedding(ids, table)
        return hidden, cls.rms_norm(hidden, weight, eps)

    @classmethod
    def add_rms_norm(cls, hidden, delta, weight, eps):
        """Residual add, then RMSNorm of the sum: returns (sum, normed sum)."""
        hidden = hidden + delta
        return hidden, cls.rms_norm(hidden, weight, eps)

    @classmethod
    def linear_add_rms_norm(cls, x, weight, bias, hidden, norm_weight, eps):
        """A projection into the residual stream, then the add and the RMSNorm that follow it: returns
        `add_rms_norm(hidden, linear(x, weight, bias), norm_weight, eps)`."""
        return cls.add_rms_norm(hidden, cls.linear(x, weight, bias), norm_weight, eps)

    @staticmethod
    def qk_norm_rope_write(qkv, heads, q_weight, k_weight, eps, rotary, keys, values, cache_rows, cache_slots):
        """QK-norm and rotary embedding of the fused QKV output `(rows, (Hq + 2 Hkv) * D)`, one token per row; writes
        each row's K and V into the cache at `[cache_rows[row], :, cache_slots[row]]` and returns the queries
        `(rows, Hq, D)`. Decoding writes one token of each sequence; prefill writes all tokens of the prompt."""
        rows, kv_heads, head_dim = qkv.shape[0], keys.shape[1], keys.shape[-1]
        qkv = qkv.view(rows, -1, head_dim)
        qk = F.rms_norm(qkv[:, : heads + kv_heads], (head_dim,), eps=eps)
        qk[:, :heads] *= q_weight
        qk[:, heads:] *= k_weight
        cos, signed_sin = rotary
        qk = torch.addcmul(qk * cos, qk.roll(head_dim // 2, dims=-1), signed_sin)
        keys[cache_rows, :, cache_slots] = qk[:, heads:]
        values[cache_rows, :, cache_slots] = qkv[:, heads + kv_heads :]
        return qk[:, :heads]

    @staticmethod
    def vision_qkv_rope(qkv, heads, cos, sin):
        """The vision attention's fused QKV output `(N, 3 H D)` -> q, k, v `(1, H, N, D)` for SDPA, q and k rotated
        in float32 and rounded once (stock `apply_rotary_pos_emb_vision`); `cos`/`sin` are `(N, D)`. Stored
        patch-major `(N, H, D)`, so SDPA's output is patch-major too and the output projection reads it without a
        transposing copy."""
        length = qkv.shape[0]
        q, k, v = qkv.reshape(length, 3, heads, -1).permute(1, 0, 2, 3).unbind(0)
        q, k = apply_rotary_pos_emb_vision(q, k, cos, sin)
        return tuple(states.transpose(0, 1).unsqueeze(0) for states in (q, k, v))

    @classmethod
    def qkv_norm_rope_write(cls, x, qkv_weight, heads, qk_norms, rotary, keys, values, cache_rows, cache_slots):
        """The fused QKV projection of `x` `(rows, hidden)`, then `qk_norm_rope_write` (`qk_norms`: q weight, k weight,
        eps); returns q `(rows, Hq, D)`."""
        qkv = cls.linear(x, qkv_weight)
        return cls.qk_norm_rope_write(qkv, heads, *qk_norms, rotary, keys, values, cache_rows, cache_slots)

    @classmethod
    def decode_attention(cls, x, qkv_weight, heads, qk_norms, rotary, keys, values, cache_lens, context, kv_len, scale):
        """Attention of one new token per row from the layer's normed input `x`: the QKV projection, QK-norm and rotary
        embedding, the new K/V written into the row's cache row at slot `cache_lens[row]` (row r's cache row is r),
        then attention over the first `kv_len` slots; returns `(rows, Hq * D)`.

        Grouped-query attention without repeating K/V: the query heads of one KV head form its query rows.
        """
        mask, cache_rows = context
        q = cls.qkv_norm_rope_write(x, qkv_weight, heads, qk_norms, rotary, keys, values, cache_rows, cache_lens)
        rows, kv_heads, head_dim = q.shape[0], keys.shape[1], keys.shape[-1]
        out = F.scaled_dot_product_attention(
            q.reshape(rows, kv_heads, -1, head_dim),
            keys[:rows, :, :kv_len],
            values[:rows, :, :kv_len],
            attn_mask=mask,
            scale=scale,
        )
        return out.reshape(rows, -1)

    @staticmethod
    def silu_mul(gate_up):
        """SwiGLU of the fused gate/up output `(rows, 2 I)`: silu(gate) * up."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    @classmethod
    def linear_swiglu(cls, x, gate_up_weight):
        """The fused gate/up projection, then SwiGLU: `silu_mul(x @ gate_up_weight.T)`, `(rows, I)`."""
        return cls.silu_mul(cls.linear(x, gate_up_weight))

    @staticmethod
    def advance(cache_lens, positions):
        """The step's end for its rows: each row's cache length `(b,)` and M-RoPE positions `(3, b, 1)` move one on."""
        cache_lens += 1
        positions += 1

    @classmethod
    def finish_step(cls, logits, tokens, unfinished, pad_id, eos_ids, input_ids, out_tokens, out_unfinished, chunk_step,
                    cache_lens, positions):
        """The end of a sampling step, for rows `(b,)`: the greedy token (`tokens` None: argmax of `logits`, the first
        of equal maxima) or the drawn `tokens`; finished rows emit `pad_id` (as stock generate pads them) and an EOS
        token (`eos_ids`, -1 where unused) finishes its row. Feeds the token to the next step (`input_ids`), records
        it and the flags in column `chunk_step` of `out_tokens` / `out_unfinished`, advances `chunk_step` and
        `advance`s the rows' cache lengths and positions."""
        if tokens is None:
            tokens = logits.float().argmax(dim=-1)
        tokens = torch.where(unfinished, tokens, pad_id)
        unfinished &= ~(tokens[:, None] == eos_ids).any(dim=-1)
        input_ids[:, 0] = tokens
        out_tokens.index_copy_(1, chunk_step, tokens[:, None])
        out_unfinished.index_copy_(1, chunk_step, unfinished[:, None])
        chunk_step += 1
        cls.advance(cache_lens, positions)

    @staticmethod
    def add_layer_norm(hidden, delta, weight, bias, eps):
        """The vision blocks' residual add, then LayerNorm of the sum: returns (sum, normed sum)."""
        hidden = hidden + delta
        return hidden, F.layer_norm(hidden, (hidden.shape[-1],), weight, bias, eps)

    @staticmethod
    def linear_gelu_tanh(x, weight, bias):
        """The vision MLP's first projection and its tanh-approximated GELU (`gelu_pytorch_tanh`)."""
        return F.gelu(F.linear(x, weight, bias), approximate="tanh")


if triton is not None:

    @triton.jit
    def _wait_then_release(PDL: tl.constexpr):
        """Every decode kernel's first step. Under programmatic dependent launch (PDL) a kernel is launched while the
        previous one still runs: it waits for that kernel's results (all of them, flushed), then lets the next kernel
        launch, which waits in turn. So each kernel's launch and start overlap its predecessor's tail, and every
        kernel still sees the results of all before it (releasing only after the wait keeps one kernel waiting at a
        time, not a chain holding the SMs)."""
        if PDL:
            gdc_wait()
            gdc_launch_dependents()

    @triton.jit
    def _release_then_wait(PDL: tl.constexpr):
        """`_wait_then_release` the other way round: the successor launches while this kernel and its predecessor still
        run, and still waits for this kernel's results (its launch comes earlier, not its wait). The merge uses it so
        that a preloaded o_proj loads its weights during attention; the preloaded matmul, after its own loads."""
        if PDL:
            gdc_launch_dependents()
            gdc_wait()

    @triton.jit
    def _store_rms_norm(x, cols, keep, w, out, n_cols, eps):
        """RMSNorm of one row `x` by the norm's weights `w` (float32 statistics, the scale applied before rounding),
        stored at `out`. Callers load `w` early: a load after the sum's reduction would wait for it."""
        x = x.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)
        tl.store(out + cols, (x * rstd * w).to(out.dtype.element_ty), mask=keep)

    @triton.jit
    def _load_summed(source, offsets, keep, splits, split_stride, dtype, CACHE: tl.constexpr):
        """A projection's output at `source + offsets` from its `splits` float32 partial products (a split-K skinny
        matmul's, `split_stride` apart; or the output itself, splits == 1), rounded to `dtype` as the projection
        rounds it; returned in float32. So the kernel after a split-K matmul sums its partials as it loads them, and
        a matmul's last program sums the others' (CACHE ".cg": past L1, which may hold stale lines of them)."""
        total = tl.load(source + offsets, mask=keep, other=0.0, cache_modifier=CACHE).to(tl.float32)
        for split in range(1, splits):
            total += tl.load(source + split * split_stride + offsets, mask=keep, other=0.0, cache_modifier=CACHE)
        return total.to(dtype).to(tl.float32)

    @triton.jit
    def _add_rms_norm_kernel(hidden, delta, weight, sum_out, norm_out, n_cols, eps, splits, split_stride, ids,
                             HAS_DELTA: tl.constexpr, GATHER: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
        """RMSNorm of each row of `hidden` (HAS_DELTA: of `hidden + delta`, the sum stored to `sum_out`); GATHER: of row
        `ids[row]` of `hidden` (an embedding table), the gathered row stored to `sum_out`."""
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        keep = cols < n_cols
        # Norm weights never change during a step, so they load before the PDL wait, during the previous kernel.
        w = tl.load(weight + cols, mask=keep, other=0.0).to(tl.float32)
        _wait_then_release(PDL)
        if GATHER:
            x = tl.load(hidden + tl.load(ids + row) * n_cols + cols, mask=keep, other=0.0)
            tl.store(sum_out + row * n_cols + cols, x, mask=keep)
        else:
            x = tl.load(hidden + row * n_cols + cols, mask=keep, other=0.0)
        if HAS_DELTA:
            # The sum is rounded to storage precision first, exactly as `hidden + delta` would be.
            delta_x = _load_summed(delta, row * n_cols + cols, keep, splits, split_stride, x.dtype, "")
            x = (x.to(tl.float32) + delta_x).to(x.dtype)
            tl.store(sum_out + row * n_cols + cols, x, mask=keep)
        _store_rms_norm(x, cols, keep, w, norm_out + row * n_cols, n_cols, eps)

    @triton.jit
    def _add_layer_norm_kernel(hidden, delta, weight, bias, sum_out, norm_out, n_cols, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        keep = cols < n_cols
        x = tl.load(hidden + row * n_cols + cols, mask=keep, other=0.0)
        x = (x.to(tl.float32) + tl.load(delta + row * n_cols + cols, mask=keep, other=0.0).to(tl.float32)).to(x.dtype)
        tl.store(sum_out + row * n_cols + cols, x, mask=keep)  # rounded as `hidden + delta` is, then normed
        x = x.to(tl.float32)
        centered = tl.where(keep, x - tl.sum(x, axis=0) / n_cols, 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(centered * centered, axis=0) / n_cols + eps)
        y = centered * rstd * tl.load(weight + cols, mask=keep, other=0.0).to(tl.float32)
        y += tl.load(bias + cols, mask=keep, other=0.0).to(tl.float32)
        tl.store(norm_out + row * n_cols + cols, y.to(norm_out.dtype.element_ty), mask=keep)

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
    def _norm_rope(x, x_rolled, weights, tables, eps, HEAD_DIM: tl.constexpr):
        """RMSNorm of each head (a row of `x`, float32) then the rotary embedding (`rotate_half` convention), float32
        throughout. `x_rolled`: the heads rolled by HEAD_DIM / 2; `weights`, `tables`: `_head_weights`, `_rope_tables`,
        loaded by the caller before the sum's reduction (a load after it would wait for it)."""
        w, w_rolled = weights
        cos, signed_sin = tables
        rstd = (1.0 / tl.sqrt(tl.sum(x * x, axis=1) / HEAD_DIM + eps))[:, None]
        return x * rstd * w * cos + x_rolled * rstd * w_rolled * signed_sin

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
        qkv, q_weight, k_weight, cos, sin, q_out, keys, values, cache_rows, cache_slots, eps, splits, split_stride,
        stride_cache_row, stride_cache_head, stride_cache_slot,
        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PDL: tl.constexpr,
    ):
        """One (token, KV head) per program: its query heads, normed and rotated, to `q_out`; its key, normed and
        rotated, and its value into the cache. q and k are rounded once to the storage dtype. `qkv` is the projection's
        output or its `splits` float32 partials (`_load_summed`)."""
        # Norm weights never change during a step, so they load before the PDL wait, during the previous kernel.
        q_weights, k_weights = _head_weights(q_weight, HEAD_DIM), _head_weights(k_weight, HEAD_DIM)
        _wait_then_release(PDL)
        row = tl.program_id(0)
        kv_head = tl.program_id(1)
        base = qkv + row * (KV_HEADS * GROUP + 2 * KV_HEADS) * HEAD_DIM
        tables = _rope_tables(cos + row * HEAD_DIM, sin + row * HEAD_DIM, HEAD_DIM)
        group = tl.arange(0, GROUP_PAD)[:, None]
        one = tl.arange(0, 1)[:, None]
        dims = tl.arange(0, HEAD_DIM)[None, :]
        dtype = q_out.dtype.element_ty
        # Every load first: a load after a reduction would wait for it.
        q, q_rolled = _load_heads(base, kv_head * GROUP + group, group < GROUP, splits, split_stride, dtype, HEAD_DIM)
        k, k_rolled = _load_heads(base, KV_HEADS * GROUP + kv_head + one, one == 0, splits, split_stride, dtype, HEAD_DIM)
        v = _load_summed(base, (KV_HEADS * GROUP + KV_HEADS + kv_head + one) * HEAD_DIM + dims, one == 0, splits,
                         split_stride, dtype, "")
        slot = (tl.load(cache_rows + row) * stride_cache_row + kv_head * stride_cache_head
                + tl.load(cache_slots + row) * stride_cache_slot + dims)
        q = _norm_rope(q, q_rolled, q_weights, tables, eps, HEAD_DIM)
        tl.store(q_out + ((row * KV_HEADS + kv_head) * GROUP + group) * HEAD_DIM + dims, q.to(dtype), mask=group < GROUP)
        tl.store(keys + slot, _norm_rope(k, k_rolled, k_weights, tables, eps, HEAD_DIM).to(dtype))
        tl.store(values + slot, v.to(dtype))

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

    @triton.jit
    def _decode_attention_kernel(
        q, keys, values, cache_lens, attendable, part_out, part_max, part_sum, scale,
        stride_cache_row, stride_cache_head, stride_cache_slot, stride_attendable,
        SPLITS, CHUNK: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, KV_HEADS: tl.constexpr,
        HEAD_DIM: tl.constexpr, PDL: tl.constexpr,
    ):
        """Decode attention of one new token per row, flash-decoding's first pass: a program per (row, KV head, chunk
        of CHUNK slots) takes the softmax of the KV head's query group over its chunk, one tile (row r's cache is
        cache row r, the new token's K/V already in it).

        The cache loads come first and depend on the row's length alone: slots up to the new token's were all
        written (the prefill writes left padding too), and the ones the row does not attend to (left padding) are
        zeroed after loading, so whatever they hold drops out. Slots past the new token are never read."""
        _wait_then_release(PDL)
        row = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        group = tl.arange(0, GROUP_PAD)
        dims = tl.arange(0, HEAD_DIM)
        slots = split * CHUNK + tl.arange(0, CHUNK)
        written = slots <= tl.load(cache_lens + row)
        cache = row * stride_cache_row + kv_head * stride_cache_head + slots[:, None] * stride_cache_slot + dims[None, :]
        k = tl.load(keys + cache, mask=written[:, None], other=0.0)
        v = tl.load(values + cache, mask=written[:, None], other=0.0)
        readable = tl.load(attendable + row * stride_attendable + slots, mask=written, other=0) != 0
        k = tl.where(readable[:, None], k, 0.0)
        v = tl.where(readable[:, None], v, 0.0)
        heads = kv_head * GROUP + group
        queries = tl.load(q + (row * KV_HEADS * GROUP + heads[:, None]) * HEAD_DIM + dims[None, :],
                          mask=group[:, None] < GROUP, other=0.0)
        scores = tl.dot(queries, tl.trans(k)).to(tl.float32) * scale
        scores = tl.where(readable[None, :], scores, float("-inf"))
        best = tl.max(scores, axis=1)
        weights = tl.exp(scores - tl.where(best == float("-inf"), 0.0, best)[:, None])  # an empty chunk: no NaN
        # Probabilities stay in float32 (a 16-bit P would round them to 3 digits).
        acc = tl.dot(weights, v.to(tl.float32))
        part = ((row * KV_HEADS + kv_head) * SPLITS + split) * GROUP + group
        live = group < GROUP
        tl.store(part_out + part[:, None] * HEAD_DIM + dims[None, :], acc, mask=live[:, None])
        tl.store(part_max + part, best, mask=live)
        tl.store(part_sum + part, tl.sum(weights, axis=1), mask=live)

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

    @triton.jit
    def _silu_mul_kernel(gate_up, out, n_cols, BLOCK: tl.constexpr, PDL: tl.constexpr):
        _wait_then_release(PDL)
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        keep = cols < n_cols
        gate = tl.load(gate_up + row * 2 * n_cols + cols, mask=keep, other=0.0).to(tl.float32)
        up = tl.load(gate_up + row * 2 * n_cols + n_cols + cols, mask=keep, other=0.0).to(tl.float32)
        tl.store(out + row * n_cols + cols, (gate / (1.0 + tl.exp(-gate)) * up).to(out.dtype.element_ty), mask=keep)

    @triton.jit
    def _gemv_tile(x, weight, rows, weight_rows, live_rows, k_len, k_start, k_split, stride_x, stride_w,
                   ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """`weight[weight_rows] @ x.T` over K in [k_start, k_start + k_split), float32 `(BLOCK_N, ROWS)`, for at most
        ROWS rows of x (`live_rows` masks the weight rows): each weight tile is read once, coalesced along K, and serves
        every row (the narrow side of a `tl.dot`, padded to ROWS, its minimum)."""
        row_ids = tl.arange(0, ROWS)
        acc = tl.zeros((BLOCK_N, ROWS), tl.float32)
        # Ranges start at multiples of BLOCK_K and the mask compares with K itself, so weight loads stay vectorized.
        for start in range(k_start, k_start + k_split, BLOCK_K):
            ks = start + tl.arange(0, BLOCK_K)
            tile = weight_rows[:, None] * stride_w + ks[None, :]
            live = live_rows[:, None] & (ks[None, :] < k_len)
            x_t = tl.load(x + row_ids[None, :] * stride_x + ks[:, None], mask=(row_ids[None, :] < rows) & (ks[:, None] < k_len),
                          other=0.0)
            acc = tl.dot(tl.load(weight + tile, mask=live, other=0.0), x_t, acc)
        return acc

    @triton.jit(do_not_specialize=["rows", "splits"])  # one compiled variant for every row count (Triton would single out 1)
    def _skinny_matmul_kernel(
        x, weight, out, rows, n_cols, k_len, k_split, stride_x, stride_w,
        hidden, norm_weight, sum_out, norm_out, eps, ticket, splits,
        ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SWIGLU: tl.constexpr,
        ADD_RMS_NORM: tl.constexpr, BLOCK_ROW: tl.constexpr, PRELOAD: tl.constexpr, PDL: tl.constexpr,
    ):
        """`x @ weight.T` for at most ROWS rows: one program per (BLOCK_N columns, K range), `_gemv_tile`. `out` is y
        itself, or this K range's float32 partial `(splits, rows, n_cols)`.

        SWIGLU: `weight` is the fused gate/up matrix `(2 n_cols, K)`; each program's tile is BLOCK_N / 2 gate rows and
        the up rows of the same columns, one `tl.dot` as wide as a plain projection's, and it stores silu(gate) * up
        for those BLOCK_N / 2 columns, rounded as the separate ops round (one K range).

        ADD_RMS_NORM: `out` takes the float32 partials and the last program to finish (a ticket counts them) sums
        them, rounds y, adds it to `hidden` (the residual stream) and stores the sum and its RMSNorm, rounded as the
        separate ops round: the residual add and the norm after a projection cost no launch of their own.

        PRELOAD: the program's whole K range (BLOCK_K == k_split) is one weight tile, loaded before the PDL wait (and
        staged in shared memory for the `tl.dot`, also before it, as compiled for sm90): weights never depend on an
        earlier kernel, so they stream in while earlier kernels run. The merge releases o_proj before its own wait
        (`_release_then_wait`), so o_proj's programs load during attention and the merge.

        PDL: see `_wait_then_release`. (Measured slower on an H200, bench/results/*session7*: asking L2 for the first
        weights before the wait, loading the first weight tile before the wait, and releasing the next kernel only
        after the loop's loads.)"""
        split = tl.program_id(1)
        row_ids = tl.arange(0, ROWS)
        if PRELOAD:
            cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
            ks = split * k_split + tl.arange(0, BLOCK_K)
            tile = tl.load(weight + cols[:, None] * stride_w + ks[None, :],
                           mask=(cols[:, None] < n_cols) & (ks[None, :] < k_len), other=0.0)
            _release_then_wait(PDL)
            acc = tl.dot(tile, tl.load(x + row_ids[None, :] * stride_x + ks[:, None],
                                       mask=(row_ids[None, :] < rows) & (ks[:, None] < k_len), other=0.0))
        elif SWIGLU:
            _wait_then_release(PDL)
            tile_rows = tl.arange(0, BLOCK_N)
            cols = tl.program_id(0) * (BLOCK_N // 2) + tile_rows % (BLOCK_N // 2)
            acc = _gemv_tile(x, weight, rows, cols + tile_rows // (BLOCK_N // 2) * n_cols, cols < n_cols, k_len,
                             split * k_split, k_split, stride_x, stride_w, ROWS, BLOCK_N, BLOCK_K)
            gate, up = tl.split(tl.permute(tl.reshape(acc, (2, BLOCK_N // 2, ROWS)), (1, 2, 0)))
            gate = gate.to(out.dtype.element_ty).to(tl.float32)
            acc = gate / (1.0 + tl.exp(-gate)) * up.to(out.dtype.element_ty).to(tl.float32)
            cols = tl.program_id(0) * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        else:
            _wait_then_release(PDL)
            cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
            acc = _gemv_tile(x, weight, rows, cols, cols < n_cols, k_len, split * k_split, k_split, stride_x, stride_w,
                             ROWS, BLOCK_N, BLOCK_K)
        keep = (cols[:, None] < n_cols) & (row_ids[None, :] < rows)
        tl.store(out + (split * rows + row_ids[None, :]) * n_cols + cols[:, None], acc.to(out.dtype.element_ty), mask=keep)
        if ADD_RMS_NORM:
            # The barrier puts all of this program's stores before the ticket's release; the ticket's acquire puts
            # every other program's stores before the last program's reads (which bypass L1).
            tl.debug_barrier()
            if tl.atomic_add(ticket, 1, sem="acq_rel") == tl.num_programs(0) * tl.num_programs(1) - 1:
                row_cols = tl.arange(0, BLOCK_ROW)
                row_keep = row_cols < n_cols
                w = tl.load(norm_weight + row_cols, mask=row_keep, other=0.0).to(tl.float32)
                for row in range(rows):
                    h = tl.load(hidden + row * n_cols + row_cols, mask=row_keep, other=0.0)
                    # y rounded as the projection's output, the sum as `hidden + y`.
                    y = _load_summed(out, row * n_cols + row_cols, row_keep, splits, rows * n_cols, h.dtype, ".cg")
                    h = (h.to(tl.float32) + y).to(h.dtype)
                    tl.store(sum_out + row * n_cols + row_cols, h, mask=row_keep)
                    _store_rms_norm(h, row_cols, row_keep, w, norm_out + row * n_cols, n_cols, eps)
                tl.store(ticket, 0)  # ready for the next launch

    @triton.jit
    def _finish_step_kernel(
        logits, n_vocab, stride_logits, part_value, part_index, tokens, unfinished, pad_id, eos_ids, input_ids,
        stride_input_ids, out_tokens, stride_out_tokens, out_unfinished, stride_out_unfinished, chunk_step, ticket, rows,
        cache_lens, positions, stride_positions, ARGMAX: tl.constexpr, PARTS: tl.constexpr, BLOCK: tl.constexpr,
        ROWS_PAD: tl.constexpr, EOS_IDS: tl.constexpr, EOS_PAD: tl.constexpr, PDL: tl.constexpr,
    ):
        """`TorchDecodeOps.finish_step` in one launch instead of a dozen. ARGMAX: a program per (row, part of the
        vocabulary) finds the part's largest logit and its first index, and the last program to finish (a ticket
        counts them) picks each row's token from the parts; else one program takes the drawn `tokens`. That last
        program alone finishes the step, for every row, lengths and positions included."""
        _wait_then_release(PDL)
        if ARGMAX:
            row, part = tl.program_id(0), tl.program_id(1)
            width = tl.cdiv(tl.cdiv(n_vocab, PARTS), BLOCK) * BLOCK
            # Per lane, the largest value and its first index; then the first index of the largest over lanes.
            best = tl.full((BLOCK,), float("-inf"), tl.float32)
            best_index = tl.zeros((BLOCK,), tl.int32)
            for start in range(part * width, part * width + width, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                x = tl.load(logits + row * stride_logits + cols, mask=cols < n_vocab, other=float("-inf")).to(tl.float32)
                better = x > best
                best = tl.where(better, x, best)
                best_index = tl.where(better, cols, best_index)
            top = tl.max(best, axis=0)
            tl.store(part_value + row * PARTS + part, top)
            tl.store(part_index + row * PARTS + part, tl.min(tl.where(best == top, best_index, n_vocab), axis=0))
            # The barrier puts this program's stores before the ticket's release; the last program's acquire puts
            # every program's stores before its reads (which bypass L1).
            tl.debug_barrier()
            last = tl.atomic_add(ticket, 1, sem="acq_rel") == rows * PARTS - 1
        else:
            last = True
        if last:
            row_ids = tl.arange(0, ROWS_PAD)
            real = row_ids < rows
            if ARGMAX:
                parts = row_ids[:, None] * PARTS + tl.arange(0, PARTS)[None, :]
                values = tl.load(part_value + parts, mask=real[:, None], other=float("-inf"), cache_modifier=".cg")
                indices = tl.load(part_index + parts, mask=real[:, None], other=0, cache_modifier=".cg")
                row_top = tl.max(values, axis=1)
                token = tl.min(tl.where(values == row_top[:, None], indices, n_vocab), axis=1).to(tl.int64)
                tl.store(ticket, 0)  # ready for the next launch
            else:
                token = tl.load(tokens + row_ids, mask=real, other=0)
            live = tl.load(unfinished + row_ids, mask=real, other=0) != 0
            token = tl.where(live, token, tl.load(pad_id))
            eos = tl.load(eos_ids + tl.arange(0, EOS_PAD), mask=tl.arange(0, EOS_PAD) < EOS_IDS, other=-1)
            live = live & (tl.sum((eos[None, :] == token[:, None]).to(tl.int32), axis=1) == 0)
            step = tl.load(chunk_step)
            tl.store(unfinished + row_ids, live, mask=real)
            tl.store(input_ids + row_ids * stride_input_ids, token, mask=real)
            tl.store(out_tokens + row_ids * stride_out_tokens + step, token, mask=real)
            tl.store(out_unfinished + row_ids * stride_out_unfinished + step, live, mask=real)
            tl.store(chunk_step, step + 1)
            # Every earlier kernel of the step has finished (each waited for its predecessor): lengths and positions
            # move on here, not in launches of their own.
            tl.store(cache_lens + row_ids, tl.load(cache_lens + row_ids, mask=real) + 1, mask=real)
            component = tl.arange(0, 4)[:, None] * stride_positions + row_ids[None, :]
            in_positions = (tl.arange(0, 4)[:, None] < 3) & real[None, :]
            tl.store(positions + component, tl.load(positions + component, mask=in_positions) + 1, mask=in_positions)

    @triton.jit(do_not_specialize=["rows", "splits"])
    def _qkv_norm_rope_write_kernel(
        x, weight, parts, rows, k_len, k_split, stride_x, stride_w, splits, q_weight, k_weight, cos, sin, eps,
        q_out, keys, values, cache_rows, cache_slots, stride_cache_row, stride_cache_head, stride_cache_slot, tickets,
        ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HEADS: tl.constexpr,
        KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PDL: tl.constexpr,
    ):
        """The fused QKV projection of a few rows then `qk_norm_rope_write`, in one launch: programs as the skinny
        matmul's store float32 partials; the last program of each head (a ticket per head counts them) sums them,
        rounds them as the projection's output, norms and rotates q and k, and stores q to `q_out` `(rows, HEADS,
        D)` and k and v into the cache (row `cache_rows[r]`, slot `cache_slots[r]`)."""
        _wait_then_release(PDL)
        n_cols = (HEADS + 2 * KV_HEADS) * HEAD_DIM
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        split = tl.program_id(1)
        acc = _gemv_tile(x, weight, rows, cols, cols < n_cols, k_len, split * k_split, k_split, stride_x, stride_w,
                         ROWS, BLOCK_N, BLOCK_K)
        row_ids = tl.arange(0, ROWS)
        tl.store(parts + (split * rows + row_ids[None, :]) * n_cols + cols[:, None], acc, mask=row_ids[None, :] < rows)
        head = tl.program_id(0) * BLOCK_N // HEAD_DIM
        # The barrier puts this program's stores before the ticket's release; the ticket's acquire puts every other
        # program's stores before the last program's reads (which bypass L1).
        tl.debug_barrier()
        if tl.atomic_add(tickets + head, 1, sem="acq_rel") == HEAD_DIM // BLOCK_N * splits - 1:
            row = tl.arange(0, ROWS)[:, None]
            dims = tl.arange(0, HEAD_DIM)[None, :]
            keep = row < rows
            dtype = q_out.dtype.element_ty
            base = parts + row * n_cols + head * HEAD_DIM
            y = _load_summed(base, dims, keep, splits, rows * n_cols, dtype, ".cg")
            y_rolled = _load_summed(base, (dims + HEAD_DIM // 2) % HEAD_DIM, keep, splits, rows * n_cols, dtype, ".cg")
            if head < HEADS + KV_HEADS:  # q or k: normed and rotated
                weights = _head_weights(tl.where(head < HEADS, q_weight, k_weight), HEAD_DIM)
                table = tl.minimum(row, rows - 1) * HEAD_DIM  # padding rows read a real row's table
                y = _norm_rope(y, y_rolled, weights, _rope_tables(cos + table, sin + table, HEAD_DIM), eps, HEAD_DIM)
            y = y.to(dtype)
            if head < HEADS:
                tl.store(q_out + (row * HEADS + head) * HEAD_DIM + dims, y, mask=keep)
            else:
                kv_head = (head - HEADS) % KV_HEADS
                slot = (tl.load(cache_rows + row, mask=keep, other=0) * stride_cache_row + kv_head * stride_cache_head
                        + tl.load(cache_slots + row, mask=keep, other=0) * stride_cache_slot + dims)
                tl.store(tl.where(head < HEADS + KV_HEADS, keys, values) + slot, y, mask=keep)
            tl.store(tickets + head, 0)  # ready for the next launch

    @triton.jit
    def _sum_splits_kernel(parts, out, numel, splits, BLOCK: tl.constexpr, PDL: tl.constexpr):
        """Split-K, pass 2: add the float32 partials and round once."""
        _wait_then_release(PDL)
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        keep = offsets < numel
        total = tl.zeros((BLOCK,), tl.float32)
        for split in range(splits):
            total += tl.load(parts + split * numel + offsets, mask=keep, other=0.0)
        tl.store(out + offsets, total.to(out.dtype.element_ty), mask=keep)


# True while `TritonDecodeOps.precompile` runs its steps (in this thread): launches only compile.
_COMPILING = ContextVar("qwen3vl_static_compiling", default=False)


@functools.cache
def _pdl_capable(device: torch.device) -> bool:
    return (gdc_wait is not None and device.type == "cuda" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")
            and torch.cuda.get_device_capability(device)[0] >= 9)


def _launch(kernel, grid, *args, **kwargs):
    """`kernel[grid](*args, **kwargs)`; while `TritonDecodeOps.precompile` runs, only the kernel's compilation. Kernels
    with a PDL argument launch with programmatic dependent launch where the device has it (`TritonDecodeOps.pdl`)."""
    if "PDL" in kernel.arg_names:
        pdl = TritonDecodeOps.pdl(next(arg.device for arg in args if isinstance(arg, torch.Tensor)))
        kwargs.update(PDL=pdl, **({"launch_pdl": True} if pdl else {}))
    if _COMPILING.get():
        kernel.warmup(*args, grid=grid, **kwargs)
    else:
        kernel[grid](*args, **kwargs)


class TritonDecodeOps(TorchDecodeOps):
    """The same ops as fused Triton kernels (CUDA). Float32 inside each kernel, one rounding per output."""

    CHUNK = 64  # KV slots per flash-decoding program (one tile)
    MERGE_BLOCK = 32  # chunks merged per step of flash-decoding's merge
    SKINNY_ROWS = 16  # rows the skinny matmul takes (tl.dot pads them to 16 anyway)
    # GPU cycles (~0.5 ms) of busy wait before each timed call: longer than the host takes to launch the call's kernels
    # (0.1 ms, with each kernel launched from the host, let a slow host's launches into the timings on an H200).
    SPIN_CYCLES = 1_000_000
    choices = {}  # (op, shape description, device) -> index of the candidate that measured fastest
    timings = {}  # the same keys -> each candidate's microseconds (reported by the benchmark)
    # Candidates timed alone within this factor of the fastest are timed again in the whole step (`near_ties`).
    NEAR_TIE = 1.10
    step_timings = {}  # the keys settled that way -> each candidate's ms per step (None: not a near tie)
    in_step = {}  # the same keys -> candidates timed in the step however they time alone (`measured`)
    tickets = {}  # device -> the counters `ticket` returns
    TICKETS = 256
    PDL = True  # programmatic dependent launch where the device has it (bench/step_probe.py times it off and on)

    @classmethod
    def linear(cls, x, weight, bias=None):
        """cuBLAS or the skinny Triton matmul, whichever measured faster on this device for these (M, N, K, dtype).
        The skinny matmul runs at the rule's tiling and with a 6-stage pipeline: on an H200, 6 stages won for the
        split projections (o_proj, down_proj, QKV) and 4 for gate/up (bench/results/*session8-final-ab7f33d.json).
        A bias (no Qwen3-VL checkpoint has one) keeps cuBLAS, which adds it."""
        if bias is not None or not cls.skinny(x, weight):
            return F.linear(x, weight, bias)
        candidates = (lambda: F.linear(x, weight), *(lambda config=config: cls.skinny_matmul(x, weight, config)
                                                      for config in cls.stage_configs(cls.rule_config(weight))))
        return cls.measured("linear", cls.matmul_shape(x, weight), x.device, candidates)

    @classmethod
    def linear_swiglu(cls, x, gate_up_weight):
        """The gate/up projection then the SwiGLU kernel, or one skinny matmul with SwiGLU as its epilogue (4 or 6
        stages): whichever measured fastest."""
        separate = lambda: super(TritonDecodeOps, cls).linear_swiglu(x, gate_up_weight)  # noqa: E731
        if not cls.skinny(x, gate_up_weight):
            return separate()
        fused = [lambda config=config: cls.skinny_matmul(x, gate_up_weight, config, swiglu=True)
                 for config in cls.stage_configs(cls.rule_config(gate_up_weight, can_split=False))]
        return cls.measured("linear_swiglu", cls.matmul_shape(x, gate_up_weight), x.device, (separate, *fused))

    @classmethod
    def linear_add_rms_norm(cls, x, weight, bias, hidden, norm_weight, eps):
        """Whichever measured fastest of: the projection then the add-and-norm kernel; the skinny matmul's partial
        products, summed by the add-and-norm kernel (4 or 6 stages, or preloaded where it fits); one skinny matmul
        whose last program adds and norms (at the rule's split of K, or half of it).

        The preloaded form is always timed in the step too: there (o_proj after the merge, which releases it early) it
        loads its weights during attention. On an H200 it was 0.011, 0.023 and 0.015 ms/step faster in the step at
        batch 1, 4 and 8, and 10-11% slower alone (bench/results/*session11-merge-release-8bc787d-step-probe.json)."""
        separate = lambda: super(TritonDecodeOps, cls).linear_add_rms_norm(x, weight, bias, hidden, norm_weight, eps)  # noqa: E731
        if bias is not None or not cls.skinny(x, weight):
            return separate()
        preload = cls.preload_config(weight)
        tilings = cls.stage_configs(cls.rule_config(weight)) + ((preload,) if preload else ())
        summed_by_norm = [lambda config=config: cls.add_rms_norm(hidden, cls.skinny_matmul(x, weight, config, partials=True),
                                                                 norm_weight, eps)
                          for config in tilings]
        fused = [lambda config=config: cls.skinny_matmul(x, weight, config, add_rms_norm=(hidden, norm_weight, eps))
                 for config in cls.split_configs(weight)]
        return cls.measured("linear_add_rms_norm", cls.matmul_shape(x, weight), x.device,
                            (separate, *summed_by_norm, *fused), in_step=(len(tilings),) if preload else ())

    @classmethod
    def qkv_norm_rope_write(cls, x, qkv_weight, heads, qk_norms, rotary, keys, values, cache_rows, cache_slots):
        """Whichever measured fastest of: the QKV projection then the QK-norm/RoPE/write kernel; the skinny matmul's
        partial products, summed by that kernel (4 or 6 stages); one launch of both (`fused_qkv`, at the rule's split
        of K or half of it)."""
        separate = lambda: super(TritonDecodeOps, cls).qkv_norm_rope_write(  # noqa: E731
            x, qkv_weight, heads, qk_norms, rotary, keys, values, cache_rows, cache_slots)
        if not cls.skinny(x, qkv_weight):
            return separate()
        summed_by_norm = [lambda config=config: cls.qk_norm_rope_write(cls.skinny_matmul(x, qkv_weight, config, partials=True),
                                                                       heads, *qk_norms, rotary, keys, values, cache_rows,
                                                                       cache_slots)
                          for config in cls.stage_configs(cls.rule_config(qkv_weight))]
        fused = [lambda config=config: cls.fused_qkv(x, qkv_weight, heads, qk_norms, rotary, keys, values, cache_rows,
                                                     cache_slots, config)
                 for config in cls.split_configs(qkv_weight)]
        return cls.measured("qkv_norm_rope_write", cls.matmul_shape(x, qkv_weight), x.device,
                            (separate, *summed_by_norm, *fused))

    @classmethod
    def fused_qkv(cls, x, qkv_weight, heads, qk_norms, rotary, keys, values, cache_rows, cache_slots, config):
        """`qkv_norm_rope_write` in one launch, tiled by `config` (column tiles no wider than a head)."""
        rows, k = x.shape
        n, (kv_heads, head_dim) = qkv_weight.shape[0], keys.shape[1::2]
        block_n = min(config.block_n, head_dim)
        k_split = triton.cdiv(triton.cdiv(k, config.split_k), config.block_k) * config.block_k
        splits = triton.cdiv(k, k_split)
        parts = torch.empty(splits, rows, n, dtype=torch.float32, device=x.device)
        q = torch.empty(rows, heads, head_dim, dtype=x.dtype, device=x.device)
        (q_weight, k_weight, eps), (cos, sin) = qk_norms, rotary
        _launch(_qkv_norm_rope_write_kernel, (n // block_n, splits),
            x, qkv_weight, parts, rows, k, k_split, x.stride(0), qkv_weight.stride(0), splits, q_weight, k_weight, cos,
            sin, eps, q, keys, values, cache_rows, cache_slots, keys.stride(0), keys.stride(1), keys.stride(2),
            cls.ticket(x.device, heads + 2 * kv_heads), ROWS=cls.SKINNY_ROWS, BLOCK_N=block_n, BLOCK_K=config.block_k,
            HEADS=heads, KV_HEADS=kv_heads, HEAD_DIM=head_dim, num_warps=config.num_warps, num_stages=config.num_stages,
        )
        return q

    @staticmethod
    def stage_configs(rule) -> tuple:
        """A skinny matmul tiling with a 4- and a 6-stage pipeline: the tilings a projection is measured at."""
        return rule._replace(num_stages=4), rule._replace(num_stages=6)

    @classmethod
    def preload_config(cls, weight, block_n=64, tile_bytes=64 * 1024):
        """A preloaded tiling for `weight` on its device (see `_skinny_matmul_kernel`): `block_n` x (K range) tiles of
        `tile_bytes` (staged in shared memory: two programs fit an SM), or None where they would take more than two
        programs per SM (then some would load after the wait anyway)."""
        n, k = weight.shape
        block_k = tile_bytes // (block_n * weight.element_size())
        split = triton.cdiv(k, block_k)
        if triton.cdiv(n, block_n) * split > 2 * cls.sm_count(weight.device):
            return None
        return SkinnyConfig(block_n, block_k, split, num_warps=8, num_stages=1, preload=True)

    @classmethod
    def split_configs(cls, weight) -> list:
        """The skinny matmul's rule for `weight` on its device, and the same with half the K split: the tilings a
        fused epilogue is measured at."""
        rule = cls.rule_config(weight)
        return list(dict.fromkeys([rule, rule._replace(split_k=max(1, rule.split_k // 2))]))

    @classmethod
    def rule_config(cls, weight, can_split=True) -> SkinnyConfig:
        """`skinny_config`'s rule for `weight` on its device."""
        return cls.skinny_config(*weight.shape, cls.sm_count(weight.device), can_split=can_split)

    @classmethod
    def pdl(cls, device) -> bool:
        """Whether kernels launch with programmatic dependent launch on `device`: sm90 and later, a Triton that has it,
        compiled kernels (not the interpreter)."""
        return cls.PDL and _pdl_capable(device)

    @staticmethod
    def sm_count(device) -> int:
        return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1

    @classmethod
    def skinny(cls, x, weight) -> bool:
        """Whether the skinny matmul takes these operands: a few rows, unit stride along K."""
        return x.dim() == 2 and x.shape[0] <= cls.SKINNY_ROWS and x.stride(1) == 1 and weight.stride(1) == 1

    @classmethod
    def measured(cls, op, shape, device, candidates, in_step=()):
        """Run whichever of `candidates` (calls of no arguments, the first the cuBLAS / unfused one) measured fastest
        for `op` on operands described by `shape` (a string: rows, sizes, dtype) on this device. `in_step`: indices of
        candidates timed in the whole step however they time alone (`near_ties`).

        Each shape is measured once, on first use: in the runner that is a warm-up step, which the graph capturer
        runs twice on a side stream before capturing. Timing needs a sync, which capture forbids, so a shape first
        met during capture runs the first candidate in that graph and is measured the next time it runs outside
        capture. Off CUDA (the interpreter tests) the last (most fused) candidate always runs, so the CPU tests
        take it through the whole decode loop.
        """
        if _COMPILING.get():  # compiling ahead: every candidate's kernels, none timed
            for candidate in candidates[:-1]:
                candidate()
            return candidates[-1]()
        if device.type != "cuda":
            return candidates[-1]()
        key = (op, shape, device)
        choice = cls.choices.get(key)
        if choice is None:
            if torch.cuda.is_current_stream_capturing():
                return candidates[0]()
            times = cls.timings[key] = cls.time_calls(candidates)
            cls.in_step[key] = in_step
            choice = cls.choices[key] = times.index(min(times))
            logger.info(f"{op} {shape}: " + ", ".join(f"candidate {index} {us:.1f} us" for index, us in enumerate(times))
                        + f"; using {choice}")
        return candidates[choice]()

    @classmethod
    def near_ties(cls, device, rows) -> dict:
        """The measured choices for `rows`-row operands on `device`, not yet settled in the step, whose candidates
        timed alone came within NEAR_TIE of the fastest or are timed in the step anyway (`measured`'s `in_step`):
        {key: those candidates' indices}, for two or more. Alone, a call misses how it overlaps its real neighbours
        under PDL: on an H200 the fused QKV form was 0.16 µs slower alone and 0.017 ms/step faster in the step at
        batch 1 (bench/results/*session7-final*step-probe.json), 9% slower alone and 0.066 ms/step faster at batch 4
        (*session9-summed-by-norm*step-probe.json), so `DecodeRunner.settle_near_ties` times the whole step."""
        ties = {key: [index for index, us in enumerate(times)
                      if us <= cls.NEAR_TIE * min(times) or index in cls.in_step.get(key, ())]
                for key, times in cls.timings.items()
                if key[2] == device and key[1].startswith(f"{rows}x") and key not in cls.step_timings}
        return {key: indices for key, indices in ties.items() if len(indices) > 1}

    @classmethod
    def precompile(cls, calls) -> None:
        """Compile the kernels that `calls` (each runs steps eagerly, no arguments) launch, on a pool of threads,
        before anything times or captures them: each launch only queues its kernel's compilation (outputs stay
        unwritten) and each measured op runs all its candidates. Triton releases the GIL for most of a compilation, so
        this takes a fraction of compiling kernel after kernel at first launch. Where it cannot (a Triton before 3.4,
        without `AsyncCompileMode`; a failure), kernels compile at first launch as before."""
        if not hasattr(triton, "AsyncCompileMode"):
            return
        compiling = _COMPILING.set(True)
        try:
            with ThreadPoolExecutor(os.cpu_count() or 1) as pool, triton.AsyncCompileMode(pool):
                for call in calls:
                    call()
        except Exception as error:  # noqa: BLE001 - the kernels still compile at first launch
            logger.warning(f"Compiling the Triton kernels ahead failed ({error!r}); they compile at first launch instead.")
        finally:
            _COMPILING.reset(compiling)

    @staticmethod
    def matmul_shape(x, weight) -> str:
        return f"{x.shape[0]}x{weight.shape[1]}->{weight.shape[0]} {str(x.dtype).removeprefix('torch.')}"

    @classmethod
    def time_calls(cls, candidates, reps=20) -> list:
        """Median microseconds of each call (with its two neighbours, below), as in the decode graph: each call is
        captured as a CUDA graph of its own (its kernels then follow each other as closely as in the step; launched
        one by one from the host, a call of several kernels would also pay the gaps between launches), the GPU
        replays it without waiting for the host (a spin kernel covers the launch) and reads the weights from HBM, as
        the step does with weights far larger than L2 (reading twice L2's size first evicts it, leaving no dirty
        lines to write back). In the step a call sits between other kernels, which under programmatic dependent
        launch overlap its start and its end (Triton kernels do, cuBLAS does not): each graph puts the call between
        two small Triton kernels, so that overlap counts.
        Synchronizes the device: each capture does, and the timings are read at the end."""
        device = torch.cuda.current_device()
        neighbour = torch.randn(1, 2048, dtype=torch.bfloat16, device=device)  # the step's SwiGLU kernel, compiled

        def between_neighbours(candidate):
            cls.silu_mul(neighbour)
            candidate()
            cls.silu_mul(neighbour)

        graphs = []
        for candidate in candidates:
            for _ in range(3):  # compiles the kernels, warms cuBLAS, measures the ops a candidate itself dispatches
                between_neighbours(candidate)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                between_neighbours(candidate)
            graphs.append(graph)
        flush = torch.empty(torch.cuda.get_device_properties(device).L2_cache_size // 2, dtype=torch.float32, device=device)
        events = [[(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
                  for _ in candidates]
        for rep in range(reps):
            for graph, pairs in zip(graphs, events):
                flush.sum()
                torch.cuda._sleep(cls.SPIN_CYCLES)
                start, end = pairs[rep]
                start.record()
                graph.replay()
                end.record()
        events[-1][-1][1].synchronize()
        return [1000 * statistics.median(start.elapsed_time(end) for start, end in pairs) for pairs in events]

    @staticmethod
    def skinny_config(n, k, sms, block_n=64, block_k=128, can_split=True):
        """The skinny matmul's tiling for an (N, K) weight on `sms` SMs: one rule, so few compiled variants.

        A GEMV is as fast as the weight bytes it keeps in flight. Each program streams `block_n` x `block_k` tiles
        through a 4-stage pipeline; a matrix with fewer column tiles than SMs also splits K (doubling, while each
        range keeps at least two K steps and there is at most one program per SM), its float32 partials summed by a
        second kernel. Measured on an H200 (bench/results/*gemv-probe*.json), up to two programs per SM split too
        far: in chains of 28 calls under PDL, o_proj took 5.0 µs at one per SM against 5.9, down_proj 8.9 against
        9.7, the QKV projection 6.6 against 6.9 (session 8). Where K cannot be split (an epilogue needs whole sums),
        narrower column tiles fill the SMs.
        """
        tiles, split = triton.cdiv(n, block_n), 1
        while can_split and 2 * tiles * split <= sms and k >= 4 * split * block_k:
            split *= 2
        while not can_split and tiles < sms and block_n > 32:
            block_n //= 2
            tiles = triton.cdiv(n, block_n)
        return SkinnyConfig(block_n, block_k, split, num_warps=4, num_stages=4)

    @classmethod
    def skinny_matmul(cls, x, weight, config=None, swiglu=False, add_rms_norm=None, partials=False):
        """`x @ weight.T` in x's dtype (float32 accumulation) for `x` (M <= SKINNY_ROWS, K), `weight` (N, K), both
        unit-stride along K; `config` (a SkinnyConfig) overrides the rule. `swiglu`: `weight` is a fused gate/up
        matrix and the result is SwiGLU of the product, `(M, N / 2)` (`config.block_n` counts a tile's weight rows,
        half of them gate rows). `add_rms_norm`: (hidden, norm weight, eps); returns `add_rms_norm(hidden, x @
        weight.T, ...)` instead, from the same launch. `partials`: returns the K ranges' float32 partial products
        `(splits, M, N)` unsummed, for the next kernel to sum as it loads them (`add_rms_norm`, `qk_norm_rope_write`):
        no launch of their own to sum them."""
        rows, k = x.shape
        n = weight.shape[0] // 2 if swiglu else weight.shape[0]
        if config is None:
            config = cls.rule_config(weight, can_split=not swiglu)
        k_split = triton.cdiv(triton.cdiv(k, config.split_k), config.block_k) * config.block_k
        splits = triton.cdiv(k, k_split)
        if swiglu and splits > 1:
            raise ValueError("the SwiGLU epilogue needs whole sums: split_k must be 1")
        if config.preload and (swiglu or k_split != config.block_k):
            raise ValueError(f"a preloaded tile spans a program's whole K range: block_k must be {k_split}, "
                             "without SwiGLU")
        out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
        fused_norm = add_rms_norm is not None
        parts = (out if splits == 1 and not (fused_norm or partials)
                 else torch.empty(splits, rows, n, dtype=torch.float32, device=x.device))
        hidden, norm_weight, eps = add_rms_norm if fused_norm else (out, out, 0.0)
        sums = torch.empty_like(hidden) if fused_norm else out
        ticket = cls.ticket(x.device) if fused_norm else out
        _launch(_skinny_matmul_kernel, (triton.cdiv(n, config.block_n // 2 if swiglu else config.block_n), splits),
            x, weight, parts, rows, n, k, k_split, x.stride(0), weight.stride(0),
            hidden, norm_weight, sums, out, eps, ticket, splits,
            ROWS=cls.SKINNY_ROWS, BLOCK_N=config.block_n, BLOCK_K=config.block_k, SWIGLU=swiglu,
            ADD_RMS_NORM=fused_norm, BLOCK_ROW=triton.next_power_of_2(n), PRELOAD=config.preload,
            num_warps=config.num_warps, num_stages=config.num_stages,
        )
        if fused_norm:
            return sums, out
        if partials:
            return parts
        if splits > 1:
            block = 1024
            _launch(_sum_splits_kernel, (triton.cdiv(rows * n, block),), parts, out, rows * n, splits, BLOCK=block)
        return out

    @classmethod
    def ticket(cls, device, count=1) -> torch.Tensor:
        """`count` of the device's counters of finished programs, for kernels whose last program (of all, or of each
        group) finishes the job. Launches on one stream run in order and each leaves them at zero; created outside
        graph capture by the first (measuring) run."""
        if count > cls.TICKETS:
            raise ValueError(f"a launch can use at most {cls.TICKETS} counters, not {count}")
        if device not in cls.tickets:
            cls.tickets[device] = torch.zeros(cls.TICKETS, dtype=torch.int32, device=device)
        return cls.tickets[device][:count]

    @staticmethod
    def rotary(cos, sin):
        return cos.reshape(cos.shape[0], -1).contiguous(), sin.reshape(sin.shape[0], -1).contiguous()

    @staticmethod
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

    @classmethod
    def decode_rotary(cls, rotary_emb, hidden, positions, components):
        # One launch for the dozen small kernels of the stock module.
        if components is None:
            return super().decode_rotary(rotary_emb, hidden, positions, components)
        rows, dim = hidden.shape[0], components.shape[0]
        cos, sin = torch.empty(2, rows, dim, dtype=hidden.dtype, device=hidden.device)
        _launch(_decode_rotary_kernel, (rows,), positions, positions.stride(0), positions.stride(1), components,
                rotary_emb.inv_freq, rotary_emb.attention_scaling, cos, sin, HEAD_DIM=dim)
        return cos, sin

    @staticmethod
    def attention_context(attendable, cache_rows, cache_lens, kv_len, dtype):
        # The attendable slots as they are (the kernel bounds each row by its length).
        return attendable, cache_rows

    @staticmethod
    def rms_norm(x, weight, eps):
        out = torch.empty_like(x)
        _launch(_add_rms_norm_kernel, (x.shape[0],), x, x, weight, x, out, x.shape[1], eps, 1, 0, x, HAS_DELTA=False,
                GATHER=False, BLOCK=triton.next_power_of_2(x.shape[1]))
        return out

    @staticmethod
    def embed_rms_norm(ids, table, weight, eps):
        # The gather inside the norm's launch: the step's first kernel is then one of the PDL chain, not torch's.
        ids, (rows, width) = ids.contiguous(), (ids.shape[0], table.shape[1])  # the runner's ids are: no copy
        hidden, out = torch.empty(2, rows, width, dtype=table.dtype, device=table.device)
        _launch(_add_rms_norm_kernel, (rows,), table, table, weight, hidden, out, width, eps, 1, 0, ids, HAS_DELTA=False,
                GATHER=True, BLOCK=triton.next_power_of_2(width))
        return hidden, out

    @staticmethod
    def add_rms_norm(hidden, delta, weight, eps):
        """`delta` is the projection's output, or its float32 partial products `(splits, rows, N)`
        (`skinny_matmul(..., partials=True)`), summed and rounded here."""
        total, out = torch.empty_like(hidden), torch.empty_like(hidden)
        _launch(_add_rms_norm_kernel, (hidden.shape[0],), hidden, delta, weight, total, out, hidden.shape[1], eps,
                delta.numel() // hidden.numel(), hidden.numel(), hidden, HAS_DELTA=True, GATHER=False,
                BLOCK=triton.next_power_of_2(hidden.shape[1]))
        return total, out

    @staticmethod
    def qk_norm_rope_write(qkv, heads, q_weight, k_weight, eps, rotary, keys, values, cache_rows, cache_slots):
        """`qkv` is the projection's output `(rows, N)`, or its float32 partial products `(splits, rows, N)`
        (`skinny_matmul(..., partials=True)`), summed and rounded here."""
        rows, n = qkv.shape[-2:]
        kv_heads, head_dim = keys.shape[1], keys.shape[-1]
        q = torch.empty(rows, heads, head_dim, dtype=keys.dtype, device=qkv.device)
        cos, sin = rotary
        group = heads // kv_heads
        _launch(_qk_norm_rope_write_kernel, (rows, kv_heads),
            qkv, q_weight, k_weight, cos, sin, q, keys, values, cache_rows, cache_slots, eps, qkv.numel() // (rows * n),
            rows * n, keys.stride(0), keys.stride(1), keys.stride(2),
            GROUP=group, GROUP_PAD=triton.next_power_of_2(group), KV_HEADS=kv_heads, HEAD_DIM=head_dim,
        )
        return q

    @staticmethod
    def vision_qkv_rope(qkv, heads, cos, sin):
        length, head_dim = qkv.shape[0], qkv.shape[1] // (3 * heads)
        q, k, v = torch.empty(3, length, heads, head_dim, dtype=qkv.dtype, device=qkv.device)
        _launch(_vision_qkv_rope_kernel, (length,),
            qkv, cos.float().contiguous(), sin.float().contiguous(), q, k, v,
            HEADS=heads, HEADS_PAD=triton.next_power_of_2(heads), HEAD_DIM=head_dim,
        )
        return tuple(states.transpose(0, 1).unsqueeze(0) for states in (q, k, v))

    @classmethod
    def decode_attention(cls, x, qkv_weight, heads, qk_norms, rotary, keys, values, cache_lens, context, kv_len, scale):
        """`qkv_norm_rope_write`, then flash-decoding in two launches: chunks, then their merge. (Fusing QK-norm/RoPE/KV
        write into the chunks' launch, and the merge into their last programs, made the whole step slower at every
        batch size on an H200: bench/results/*7fc70f2-step-probe.json; under PDL, the write inside the chunks' launch
        again, *session10-probe-3397fd5-step-probe.json, and at batch 1 the merge inside o_proj's matmul, merging each
        head as its K step loads it, *session10-probe-66f7336-step-probe.json.)"""
        attendable, cache_rows = context
        rows, kv_heads, head_dim = x.shape[0], keys.shape[1], keys.shape[-1]
        group = heads // kv_heads
        q = cls.qkv_norm_rope_write(x, qkv_weight, heads, qk_norms, rotary, keys, values, cache_rows, cache_lens)
        splits = triton.cdiv(kv_len, cls.CHUNK)
        part_out = torch.empty(rows * heads * splits, head_dim, dtype=torch.float32, device=x.device)
        part_max = torch.empty(rows * heads * splits, dtype=torch.float32, device=x.device)
        part_sum = torch.empty_like(part_max)
        _launch(_decode_attention_kernel, (rows, kv_heads, splits),
            q, keys, values, cache_lens, attendable, part_out, part_max, part_sum, scale,
            keys.stride(0), keys.stride(1), keys.stride(2), attendable.stride(0),
            splits, CHUNK=cls.CHUNK, GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)),
            KV_HEADS=kv_heads, HEAD_DIM=head_dim,
        )
        out = torch.empty(rows, heads * head_dim, dtype=x.dtype, device=x.device)
        _launch(_merge_kernel, (rows * heads,), part_out, part_max, part_sum, out, splits, GROUP=group,
                HEAD_DIM=head_dim, MERGE_BLOCK=cls.MERGE_BLOCK)
        return out

    @classmethod
    def finish_step(cls, logits, tokens, unfinished, pad_id, eos_ids, input_ids, out_tokens, out_unfinished, chunk_step,
                    cache_lens, positions):
        rows, vocab = logits.shape
        greedy = tokens is None
        parts = 64 if greedy else 1  # of the vocabulary per row: the argmax reads it with many SMs
        part_value = torch.empty(rows * parts, dtype=torch.float32, device=logits.device)
        part_index = torch.empty(rows * parts, dtype=torch.int32, device=logits.device)
        _launch(_finish_step_kernel, (rows if greedy else 1, parts),
            logits, vocab, logits.stride(0), part_value, part_index, logits if greedy else tokens, unfinished, pad_id,
            eos_ids, input_ids, input_ids.stride(0), out_tokens, out_tokens.stride(0), out_unfinished,
            out_unfinished.stride(0), chunk_step, cls.ticket(logits.device), rows, cache_lens, positions,
            positions.stride(0), ARGMAX=greedy, PARTS=parts, BLOCK=1024,
            ROWS_PAD=max(2, triton.next_power_of_2(rows)), EOS_IDS=len(eos_ids), EOS_PAD=triton.next_power_of_2(len(eos_ids)),
        )

    @staticmethod
    def add_layer_norm(hidden, delta, weight, bias, eps):
        total, out = torch.empty_like(hidden), torch.empty_like(hidden)
        _launch(_add_layer_norm_kernel, (hidden.shape[0],), hidden, delta, weight, bias, total, out, hidden.shape[1],
                eps, BLOCK=triton.next_power_of_2(hidden.shape[1]))
        return total, out

    @staticmethod
    def linear_gelu_tanh(x, weight, bias):
        # On CUDA, cuBLASLt's GELU epilogue (the tanh form) on the float32 result: no separate activation pass.
        # (The CPU kernel of this op uses the exact erf GELU, hence CUDA only.)
        if x.is_cuda and x.dim() == 2:
            return torch._addmm_activation(bias, x, weight.t(), use_gelu=True)
        return TorchDecodeOps.linear_gelu_tanh(x, weight, bias)

    @staticmethod
    def silu_mul(gate_up):
        rows, width = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty(rows, width, dtype=gate_up.dtype, device=gate_up.device)
        block = 1024
        _launch(_silu_mul_kernel, (rows, triton.cdiv(width, block)), gate_up, out, width, BLOCK=block)
        return out


def decode_ops(device: torch.device, dtype: torch.dtype, allow_triton: bool):
    """The fused kernels where they run (CUDA, Triton, 16-bit weights; when allowed), else the torch reference.

    Float32 models keep the torch ops: `tl.dot` would round float32 inputs to TF32.
    """
    if allow_triton and triton is not None and device.type == "cuda" and dtype in (torch.bfloat16, torch.float16):
        return TritonDecodeOps
    return TorchDecodeOps
