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
"""The op sets the runners call: `TorchOps` (plain-torch references, the same math as the stock modules, runs
everywhere, the CPU included) and `TritonOps` (fused Triton kernels on CUDA, and the measured compositions that pick
among them). Both take and return the same tensors, so a runner picks one set (`make_ops`) and its step does not
change. Triton is optional: without it (or without a GPU) the torch ops run.

Each op lives in its own file, its Triton kernels, launcher and torch reference together; in the classes below a
bare op name is that file's function. Compositions go through `self`, so `TritonOps` composes its own ops: the
separate form of a fused op runs the measured `linear` and the kernels after it.
"""

import os
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.nn.functional as F
from transformers.utils import logging

from .ops_accept_qwen3vl_graph import accept, accept_reference
from .ops_argmax_qwen3vl_graph import argmax, argmax_reference
from .ops_attention_qwen3vl_graph import (
    attention_context,
    attention_context_reference,
    decode_attention,
    decode_attention_reference,
)
from .fp8_qwen3vl_graph import Fp8Weight
from .ops_fp8_matmul_qwen3vl_graph import fp8_matmul
from .ops_matmul_qwen3vl_graph import (
    DOT_ROWS,
    fused_qkv,
    linear_gelu_tanh,
    linear_gelu_tanh_reference,
    linear_reference,
    matmul_shape,
    preload_config,
    rule_config,
    silu_mul,
    silu_mul_reference,
    skinny,
    skinny_matmul,
    split_configs,
    stage_configs,
)
from .ops_norm_qwen3vl_graph import (
    add_layer_norm,
    add_layer_norm_reference,
    add_rms_norm,
    add_rms_norm_reference,
    embed_rms_norm,
    embed_rms_norm_reference,
    rms_norm,
    rms_norm_reference,
)
from .ops_rotary_qwen3vl_graph import (
    decode_rotary,
    qk_norm_rope_write,
    qk_norm_rope_write_reference,
    rotary,
    rotary_components,
    rotary_reference,
    vision_qkv_rope,
    vision_qkv_rope_reference,
)
from .ops_sample_qwen3vl_graph import sample_candidates, sample_sorted, sample_tokens
from .ops_step_end_qwen3vl_graph import advance, finish_step, finish_step_reference
from .triton_qwen3vl_graph import compiling_ahead, takes_e4m3, triton
from .tuner_qwen3vl_graph import KernelTuner

logger = logging.get_logger(__name__)


class TorchOps:
    """Reference decode, prefill and vision ops in plain torch (same math as the stock modules). `tuner` never
    measures here (no op has candidates), so its `near_ties` are empty."""

    def __init__(self, tuner: KernelTuner | None = None):
        self.tuner = KernelTuner() if tuner is None else tuner

    linear = staticmethod(linear_reference)
    rotary = staticmethod(rotary_reference)
    attention_context = staticmethod(attention_context_reference)
    rms_norm = staticmethod(rms_norm_reference)
    embed_rms_norm = staticmethod(embed_rms_norm_reference)
    add_rms_norm = staticmethod(add_rms_norm_reference)
    qk_norm_rope_write = staticmethod(qk_norm_rope_write_reference)
    vision_qkv_rope = staticmethod(vision_qkv_rope_reference)
    silu_mul = staticmethod(silu_mul_reference)
    advance = staticmethod(advance)
    finish_step = staticmethod(finish_step_reference)
    accept = staticmethod(accept_reference)
    argmax = staticmethod(argmax_reference)
    sample = staticmethod(sample_tokens)
    add_layer_norm = staticmethod(add_layer_norm_reference)
    linear_gelu_tanh = staticmethod(linear_gelu_tanh_reference)

    def precompile(self, calls) -> None:
        """Compile ahead what `calls` would launch: the torch ops have nothing to compile."""

    def rotary_components(self, rotary_emb, device):
        """What `decode_rotary` needs to compute a step's rotary tables itself: None, the torch ops take the stock
        module's."""

    def decode_rotary(self, rotary_emb, hidden, positions, components):
        """The step's rotary tables for M-RoPE `positions` `(3, rows, 1)`, as `rotary` returns them."""
        return self.rotary(*rotary_emb(hidden, positions))

    def linear_add_rms_norm(self, x, weight, bias, hidden, norm_weight, eps):
        """A projection into the residual stream, then the add and the RMSNorm that follow it: returns
        `add_rms_norm(hidden, linear(x, weight, bias), norm_weight, eps)`."""
        return self.add_rms_norm(hidden, self.linear(x, weight, bias), norm_weight, eps)

    def qkv_norm_rope_write(self, x, qkv_weight, heads, qk_norms, rotary, keys, values, cache_rows, cache_slots):
        """The fused QKV projection of `x` `(rows, hidden)`, then `qk_norm_rope_write` (`qk_norms`: q weight, k weight,
        eps); returns q `(rows, Hq, D)`."""
        qkv = self.linear(x, qkv_weight)
        return self.qk_norm_rope_write(qkv, heads, *qk_norms, rotary, keys, values, cache_rows, cache_slots)

    def decode_attention(self, x, qkv_weight, heads, qk_norms, rotary, keys, values, cache_lens, context, kv_len, scale):
        """Attention of one new token per row from the layer's normed input `x`: the QKV projection, QK-norm and rotary
        embedding, the new K/V written into the row's cache row (the context's) at slot `cache_lens[row]`, then
        attention over the first `kv_len` slots; returns `(rows, Hq * D)`."""
        mask, cache_rows = context
        q = self.qkv_norm_rope_write(x, qkv_weight, heads, qk_norms, rotary, keys, values, cache_rows, cache_lens)
        return decode_attention_reference(q, keys, values, mask, cache_rows, kv_len, scale)

    def linear_swiglu(self, x, gate_up_weight):
        """The fused gate/up projection, then SwiGLU: `silu_mul(x @ gate_up_weight.T)`, `(rows, I)`."""
        return self.silu_mul(self.linear(x, gate_up_weight))


class TritonOps(TorchOps):
    """The same ops as fused Triton kernels (CUDA). Float32 inside each kernel, one rounding per output. The measured
    choices are `tuner`'s; the counters of finished programs that some kernels use (`ticket`) are this set's.
    `fp8_kernels`: whether the device runs the FP8 kernels (`takes_e4m3`); without them projections of an `Fp8Weight`
    take the torch reference (its matrix dequantized per call) and the other ops stay fused."""

    TICKETS = 1 << 16  # counters per device (a split projection takes one per column tile: 8B gate/up 6,144)

    def __init__(self, tuner: KernelTuner, fp8_kernels: bool = True):
        super().__init__(tuner)
        self.tickets = {}  # device -> the counters `ticket` returns
        self.fp8_kernels = fp8_kernels

    rotary = staticmethod(rotary)
    rotary_components = staticmethod(rotary_components)
    attention_context = staticmethod(attention_context)
    rms_norm = staticmethod(rms_norm)
    embed_rms_norm = staticmethod(embed_rms_norm)
    add_rms_norm = staticmethod(add_rms_norm)
    qk_norm_rope_write = staticmethod(qk_norm_rope_write)
    vision_qkv_rope = staticmethod(vision_qkv_rope)
    silu_mul = staticmethod(silu_mul)
    add_layer_norm = staticmethod(add_layer_norm)
    accept = staticmethod(accept)

    def ticket(self, device, count=1) -> torch.Tensor:
        """`count` of the device's counters of finished programs, for kernels whose last program (of all, or of each
        group) finishes the job. Launches on one stream run in order and each leaves them at zero; created outside
        graph capture by the first (measuring) run."""
        if count > self.TICKETS:
            raise ValueError(f"a launch can use at most {self.TICKETS} counters, not {count}")
        if device not in self.tickets:
            self.tickets[device] = torch.zeros(self.TICKETS, dtype=torch.int32, device=device)
        return self.tickets[device][:count]

    def column_tickets(self, device) -> torch.Tensor:
        """All the device's counters, for a split projection (`skinny_matmul`'s one per column tile)."""
        return self.ticket(device, self.TICKETS)

    def fp8_in_torch(self, weight) -> bool:
        """Whether a projection of `weight` takes the torch reference: an `Fp8Weight` without the FP8 kernels (said
        once)."""
        if not isinstance(weight, Fp8Weight) or self.fp8_kernels:
            return False
        logger.warning_once("This GPU has no float8 e4m3 in Triton (sm89 and later have it): the FP8 projections run "
                            "as torch ops, each matrix dequantized per call; the other kernels stay fused.")
        return True

    def linear(self, x, weight, bias=None):
        """cuBLAS or the skinny Triton matmul (up to SKINNY_ROWS rows), whichever measured faster on this device for
        these (M, N, K, dtype). The skinny matmul runs at the rule's tiling with a 4- or a 6-stage pipeline: on an
        H200, 6 stages win for the split projections (o_proj, down_proj, QKV) and 4 for gate/up. A bias (the text
        model has none) keeps cuBLAS, which adds it. An `Fp8Weight` without bias takes the skinny matmul (its `tl.dot`
        or FMA form, at their measured tilings; cuBLAS has no FP8-weight x 16-bit-activation product), measured
        against `fp8_matmul` past DOT_ROWS rows; else `fp8_matmul`."""
        rows = x.shape[0]

        def tiled(config):
            return lambda: skinny_matmul(x, weight, config, ticket=self.column_tickets(x.device))

        if self.fp8_in_torch(weight):
            return linear_reference(x, weight, bias)
        if isinstance(weight, Fp8Weight):
            if bias is not None or not skinny(x, weight):
                return fp8_matmul(x, weight, bias)
            dequantized = [lambda: fp8_matmul(x, weight)] if rows > DOT_ROWS else []
            candidates = [*dequantized, *map(tiled, stage_configs(rule_config(weight), weight, rows=rows))]
            return self.tuner.measured("linear", matmul_shape(x, weight), x.device, candidates)
        if bias is not None or not skinny(x, weight):
            return F.linear(x, weight, bias)
        candidates = (lambda: F.linear(x, weight), *map(tiled, stage_configs(rule_config(weight), weight, rows=rows)))
        return self.tuner.measured("linear", matmul_shape(x, weight), x.device, candidates)

    def linear_gelu_tanh(self, x, weight, bias):
        """`linear_gelu_tanh` (cuBLASLt's GELU epilogue); for an `Fp8Weight`, the measured projection then GELU."""
        if isinstance(weight, Fp8Weight):
            return F.gelu(self.linear(x, weight, bias), approximate="tanh")
        return linear_gelu_tanh(x, weight, bias)

    def linear_swiglu(self, x, gate_up_weight):
        """Whichever measured fastest of: the gate/up projection then the SwiGLU kernel; the skinny matmul's partial
        products, summed by the SwiGLU kernel; one skinny matmul with SwiGLU as its epilogue (a split K summed in the
        same launch). The skinny forms run at `stage_configs`' tilings."""
        def separate():
            return super(TritonOps, self).linear_swiglu(x, gate_up_weight)

        if self.fp8_in_torch(gate_up_weight) or not skinny(x, gate_up_weight):
            return separate()
        tilings = stage_configs(rule_config(gate_up_weight), gate_up_weight, rows=x.shape[0])
        summed_by_swiglu = [lambda config=config: silu_mul(skinny_matmul(x, gate_up_weight, config, partials=True),
                                                           x.dtype)
                            for config in tilings]
        fused = [lambda config=config: skinny_matmul(x, gate_up_weight, config, swiglu=True,
                                                     ticket=self.column_tickets(x.device))
                 for config in tilings]
        return self.tuner.measured("linear_swiglu", matmul_shape(x, gate_up_weight), x.device,
                                   (separate, *summed_by_swiglu, *fused))

    def linear_add_rms_norm(self, x, weight, bias, hidden, norm_weight, eps):
        """Whichever measured fastest of: the projection then the add-and-norm kernel; the skinny matmul's partial
        products, summed by the add-and-norm kernel (4 or 6 stages, or preloaded where it fits); one skinny matmul
        whose last program adds and norms (at the rule's split of K, or half of it; for at most DOT_ROWS rows, which
        that program takes one by one).

        The preloaded form is always timed in the step too: there (o_proj after the merge, which releases it early) it
        loads its weights during attention. On an H200 it is 0.011, 0.023 and 0.015 ms/step faster in the step at
        batch 1, 4 and 8, and 10-11% slower alone."""
        def separate():
            return super(TritonOps, self).linear_add_rms_norm(x, weight, bias, hidden, norm_weight, eps)

        if bias is not None or self.fp8_in_torch(weight) or not skinny(x, weight):
            return separate()
        rows = x.shape[0]
        preload = preload_config(weight, rows)
        tilings = stage_configs(rule_config(weight), weight, rows=rows) + ((preload,) if preload else ())
        summed_by_norm = [lambda config=config: self.add_rms_norm(hidden, skinny_matmul(x, weight, config, partials=True),
                                                                  norm_weight, eps)
                          for config in tilings]
        fused = [lambda config=config: skinny_matmul(x, weight, config, add_rms_norm=(hidden, norm_weight, eps),
                                                     ticket=self.ticket(x.device))
                 for config in split_configs(weight, rows)] if rows <= DOT_ROWS else []
        return self.tuner.measured("linear_add_rms_norm", matmul_shape(x, weight), x.device,
                                   (separate, *summed_by_norm, *fused), in_step=(len(tilings),) if preload else ())

    def qkv_norm_rope_write(self, x, qkv_weight, heads, qk_norms, rotary, keys, values, cache_rows, cache_slots):
        """Whichever measured fastest of: the QKV projection then the QK-norm/RoPE/write kernel; the skinny matmul's
        partial products, summed by that kernel (4 or 6 stages); one launch of both (`fused_qkv`, at the rule's split
        of K or half of it)."""
        def separate():
            return super(TritonOps, self).qkv_norm_rope_write(
                x, qkv_weight, heads, qk_norms, rotary, keys, values, cache_rows, cache_slots)

        if self.fp8_in_torch(qkv_weight) or not skinny(x, qkv_weight):
            return separate()
        summed_by_norm = [lambda config=config: self.qk_norm_rope_write(skinny_matmul(x, qkv_weight, config, partials=True),
                                                                        heads, *qk_norms, rotary, keys, values, cache_rows,
                                                                        cache_slots)
                          for config in stage_configs(rule_config(qkv_weight), qkv_weight, rows=x.shape[0])]
        fused = [lambda config=config: fused_qkv(x, qkv_weight, heads, qk_norms, rotary, keys, values, cache_rows,
                                                 cache_slots, config, self.ticket(x.device, heads + 2 * keys.shape[1]))
                 for config in split_configs(qkv_weight, x.shape[0])]
        return self.tuner.measured("qkv_norm_rope_write", matmul_shape(x, qkv_weight), x.device,
                                   (separate, *summed_by_norm, *fused))

    def decode_attention(self, x, qkv_weight, heads, qk_norms, rotary, keys, values, cache_lens, context, kv_len, scale):
        """`qkv_norm_rope_write`, then flash-decoding in two launches (`decode_attention` of the attention file)."""
        attendable, cache_rows = context
        q = self.qkv_norm_rope_write(x, qkv_weight, heads, qk_norms, rotary, keys, values, cache_rows, cache_lens)
        return decode_attention(q, keys, values, cache_lens, attendable, cache_rows, kv_len, scale)

    def argmax(self, logits, offsets=None, out=None):
        """`argmax_reference` in one launch."""
        return argmax(logits, offsets, out, self.ticket(logits.device))

    def decode_rotary(self, rotary_emb, hidden, positions, components):
        """One launch for the dozen small kernels of the stock module, where `rotary_components` read them off it."""
        if components is None:
            return super().decode_rotary(rotary_emb, hidden, positions, components)
        return decode_rotary(rotary_emb, hidden, positions, components)

    def sample(self, logits, temperature, top_k, top_p, candidates=None, min_p=None, noise=None):
        """`sample_tokens` in Triton launches: a top-k within `candidates` selected and drawn by them
        (`sample_candidates`); otherwise drawn by them after torch sorts the vocabulary (`sample_sorted`)."""
        if min_p is None:
            min_p = temperature.new_zeros(temperature.shape)
        if candidates is None:
            return sample_sorted(logits, temperature, top_k, top_p, min_p, noise)
        return sample_candidates(logits, temperature, top_k, top_p, min_p, candidates, noise)

    def finish_step(self, logits, tokens, unfinished, pad_id, eos_ids, input_ids, out_tokens, out_unfinished,
                    chunk_step, cache_lens, positions):
        """`finish_step` in one launch, lengths and positions advanced in it."""
        finish_step(logits, tokens, unfinished, pad_id, eos_ids, input_ids, out_tokens, out_unfinished, chunk_step,
                    cache_lens, positions, self.ticket(logits.device))

    def precompile(self, calls) -> None:
        """Compile the kernels that `calls` (each runs steps eagerly, no arguments) launch, on a pool of threads,
        before anything times or captures them: each launch only queues its kernel's compilation (outputs stay
        unwritten) and each measured op runs all its candidates. Triton releases the GIL for most of a compilation, so
        this takes a fraction of compiling kernel after kernel at first launch. Where it cannot (a Triton before 3.4,
        without `AsyncCompileMode`; a failure), kernels compile at first launch instead."""
        if not hasattr(triton, "AsyncCompileMode"):
            return
        try:
            with compiling_ahead(), ThreadPoolExecutor(os.cpu_count() or 1) as pool, triton.AsyncCompileMode(pool):
                for call in calls:
                    call()
        except Exception as error:  # noqa: BLE001 - the kernels still compile at first launch
            logger.warning(f"Compiling the Triton kernels ahead failed ({error!r}); they compile at first launch instead.")


def make_ops(device: torch.device, dtype: torch.dtype, allow_triton: bool, tuner: KernelTuner) -> TorchOps:
    """The fused kernels where they run (CUDA, Triton, 16-bit weights; when allowed; the FP8 ones where the GPU has
    e4m3: `takes_e4m3`), else the torch reference; both with `tuner` (the engine's measured choices).

    Float32 models keep the torch ops: `tl.dot` would round float32 inputs to TF32.
    """
    if allow_triton and triton is not None and device.type == "cuda" and dtype in (torch.bfloat16, torch.float16):
        return TritonOps(tuner, fp8_kernels=takes_e4m3(torch.cuda.get_device_capability(device)))
    return TorchOps(tuner)
