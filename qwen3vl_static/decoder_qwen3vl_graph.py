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
"""The language model's decoder as the runners see it: its weights, and the one walk over its layers.

`TextWeights` reads the stock modules once: per layer the fused QKV and gate/up matrices (one GEMV each instead of
three and two; the module parameters become row views of them, so no second copy exists and the state dict is
unchanged; FP8 linears fuse their FP8 bytes the same way and stack their scales), the norms, projections and attention
shapes. `decoder_layers` is the layer walk that prefill and decode
share: they differ only in how a layer attends (`attend`), and prefill adds DeepStack features after the first layers.
Each projection into the residual stream comes with the add and the RMSNorm that follow it (the post-attention norm,
the next layer's input norm or the final one).
"""

from contextlib import contextmanager
from typing import NamedTuple

import torch

from .fp8_qwen3vl_graph import Fp8Weight, fused_fp8_scales, linear_weight


class DecoderLayer(NamedTuple):
    # Weights are tensors or `Fp8Weight`s (FP8 checkpoints).
    qkv: torch.Tensor  # q, k and v projections fused, (Hq + 2 Hkv) * D rows
    heads: int
    qk_norms: tuple  # (q_norm weight, k_norm weight, eps)
    scaling: float
    o_proj: tuple  # (weight, bias)
    post_norm: tuple  # (weight, eps)
    gate_up: torch.Tensor  # gate and up projections fused, 2 I rows
    down_proj: tuple  # (weight, bias)
    next_norm: tuple  # (weight, eps): the next layer's input norm, or the final norm


def fuse_weights(linears):
    """One matrix of the weights of bias-free linears that share an input; the parameters become its row views (the
    previous storages are freed). FP8 linears give an `Fp8Weight` of their fused bytes and stacked scales (the scale
    parameters stay the modules' own: they are small)."""
    if len({linear.weight.dtype for linear in linears}) > 1:
        raise ValueError("linears that share an input must all be quantized or all not, got "
                         + ", ".join(f"{type(linear).__name__} ({linear.weight.dtype})" for linear in linears))
    fused = torch.cat([linear.weight.detach() for linear in linears])
    start = 0
    for linear in linears:
        linear.weight.data = fused[start : start + linear.out_features]
        start += linear.out_features
    if fused.dtype == torch.float8_e4m3fn:
        return Fp8Weight(fused, *fused_fp8_scales(linears))
    return fused


_LINEARS = (("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj")), ("mlp", ("gate_proj", "up_proj", "down_proj")))


def projections(text_model, lm_head) -> list:
    """Every linear layer of the language model, lm_head last. (Every `generate` checks their addresses, so this reads
    the module dicts directly: nn.Module's attribute lookup made the check cost 0.5 ms for the 2B on a CPU core.)"""
    return [layer._modules[block]._modules[name] for layer in text_model.layers for block, names in _LINEARS
            for name in names] + [lm_head]


def linear_addresses(text_model, lm_head) -> list:
    weights = [linear._parameters.get("weight") for linear in projections(text_model, lm_head)]
    return [None if weight is None else weight.data_ptr() for weight in weights]


class TextWeights:
    def __init__(self, text_model, lm_head):
        layers = text_model.layers
        self.embed = text_model.embed_tokens.weight
        first = layers[0].input_layernorm
        self.first_norm = (first.weight, first.variance_epsilon)
        self.rotary_emb = text_model.rotary_emb
        self.lm_head = linear_weight(lm_head)
        self.fused_linears = [
            linears
            for layer in layers
            for linears in (
                (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj),
                (layer.mlp.gate_proj, layer.mlp.up_proj),
            )
        ]
        fused = [fuse_weights(linears) for linears in self.fused_linears]
        next_norms = [layer.input_layernorm for layer in layers[1:]] + [text_model.norm]
        self.layers = []
        for layer, qkv, gate_up, next_norm in zip(layers, fused[0::2], fused[1::2], next_norms):
            attn, mlp, post = layer.self_attn, layer.mlp, layer.post_attention_layernorm
            self.layers.append(DecoderLayer(
                qkv=qkv, heads=attn.config.num_attention_heads,
                qk_norms=(attn.q_norm.weight, attn.k_norm.weight, attn.q_norm.variance_epsilon), scaling=attn.scaling,
                o_proj=(linear_weight(attn.o_proj), attn.o_proj.bias), post_norm=(post.weight, post.variance_epsilon),
                gate_up=gate_up, down_proj=(linear_weight(mlp.down_proj), mlp.down_proj.bias),
                next_norm=(next_norm.weight, next_norm.variance_epsilon),
            ))
        self.addresses = linear_addresses(text_model, lm_head)

    def current(self, text_model, lm_head) -> bool:
        """False once the model's weights or linear modules were replaced (moved, quantized): the engine must be
        rebuilt. (Checked on every `generate`, so by address: the fused views and the graphs both hold these
        addresses.)"""
        return linear_addresses(text_model, lm_head) == self.addresses

    @contextmanager
    def separate_weights(self):
        """Give each fused parameter storage of its own while saving (views of one matrix look shared)."""
        views = [(linear.weight, linear.weight.data) for linears in self.fused_linears for linear in linears]
        for parameter, view in views:
            parameter.data = view.clone()
        try:
            yield
        finally:
            for parameter, view in views:
                parameter.data = view


def recording(layer_ids, outputs) -> tuple:
    """`decoder_layers`' `record` pairs that write the outputs of layers `layer_ids` side by side into `outputs`
    `(tokens, len(layer_ids) * hidden)`."""
    width = outputs.shape[1] // max(len(layer_ids), 1)
    return tuple((layer, outputs[:, i * width:(i + 1) * width]) for i, layer in enumerate(layer_ids))


def decoder_layers(ops, layers, keys, values, hidden, x, attend, deepstack=(), record=()) -> torch.Tensor:
    """The decoder layers over the residual stream `hidden` `(tokens, hidden)`, whose first RMSNorm is `x`; returns the
    final norm of the result. `attend(layer, keys, values, x)` is a layer's attention `(tokens, Hq * D)` (it writes the
    tokens' K/V into the layer's cache `keys` / `values`); `deepstack[i]` `(tokens, hidden)` joins the residual stream
    after layer i's MLP. `record`: (layer index, buffer) pairs; each buffer gets that layer's output (what a forward
    hook on the stock layer sees: before DeepStack's addition), as an EAGLE-3 draft reads it."""
    for index, (layer, layer_keys, layer_values) in enumerate(zip(layers, keys, values)):
        out = attend(layer, layer_keys, layer_values, x)
        hidden, x = ops.linear_add_rms_norm(out, *layer.o_proj, hidden, *layer.post_norm)
        hidden, x = ops.linear_add_rms_norm(ops.linear_swiglu(x, layer.gate_up), *layer.down_proj, hidden,
                                            *layer.next_norm)
        for recorded, buffer in record:
            if recorded == index:
                buffer.copy_(hidden)
        if index < len(deepstack):
            hidden = hidden + deepstack[index]
            x = ops.rms_norm(hidden, *layer.next_norm)
    return x
