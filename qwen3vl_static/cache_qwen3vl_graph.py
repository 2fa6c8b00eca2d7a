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
"""ASStaticCache: the one persistent KV cache of a model.

Allocated once for `max_batch_size` rows x `static_cache_len` slots, so the tensor addresses that CUDA graphs
bake in never change. A request activates the rows and slots it needs as views of the same storage; `reset()`
rewinds the write position and `set_length()` records the filled length (on transformers 4.57, which counts the
non-zero slots, by zeroing the slots past it): no path ever reads a slot that the current request has not
written. A later turn that passes the returned cache back `resume()`s it instead: wider views, what it holds
kept, and `tokens` says which token ids those slots hold.
"""

import torch
from transformers.cache_utils import StaticCache

from .compat_qwen3vl_graph import allocate_layer, record_length, rewind_layers, share_length_counters


def cache_values(states: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`states` as a KV cache of `dtype` stores them: float8 (an opt-in `kv_cache_dtype`) saturated at its largest
    finite value, where a plain cast would make NaN of what lies beyond."""
    if dtype == torch.float8_e4m3fn:
        finite = torch.finfo(dtype).max
        states = states.clamp(-finite, finite)
    return states.to(dtype)


def kv_heads_and_dim(config) -> tuple:
    """(KV heads, head dim) of each layer's cache: one slot of a layer holds a key and a value of this shape."""
    text_config = config.get_text_config(decoder=True)
    head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads
    return text_config.num_key_value_heads, head_dim


class ASStaticCache(StaticCache):
    def __init__(self, config, max_batch_size: int, static_cache_len: int, device, dtype: torch.dtype):
        super().__init__(config=config, max_cache_len=static_cache_len)
        kv_heads, head_dim = kv_heads_and_dim(config)
        shape = torch.empty(max_batch_size, kv_heads, 0, head_dim, device=device, dtype=dtype)
        for layer in self.layers:
            allocate_layer(layer, shape)  # the stock allocation, once, at full size
        self.length_counters = share_length_counters(self.layers, device)
        self.rows = max_batch_size
        self.capacity = static_cache_len
        self.kv_dtype = dtype  # what the slots store: the model's dtype, or float8 (`kv_cache_dtype`)
        self.full_keys = [layer.keys for layer in self.layers]
        self.full_values = [layer.values for layer in self.layers]
        self._views, self._views_shape = [], None  # `_view`'s
        # The token ids `(rows, n)` whose K/V fill the first n slots after the static loop, None after anything else.
        self.tokens = None
        self.resumed = False  # this request continues what the cache holds

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs) -> tuple:
        """The stock layers' write, for transformers' own loop on this cache: a cache narrower than the states (a
        float8 `kv_cache_dtype`) stores them as the decode step does and returns its slots widened again."""
        if key_states.dtype == self.kv_dtype:
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)
        stored = (cache_values(states, self.kv_dtype) for states in (key_states, value_states))
        keys, values = super().update(*stored, layer_idx, *args, **kwargs)
        return keys.to(key_states.dtype), values.to(value_states.dtype)

    def check_capacity(self, batch_size: int, needed_len: int) -> None:
        """Raise before anything is written when a request does not fit."""
        if batch_size > self.rows:
            raise ValueError(
                f"This generate call needs {batch_size} cache rows but the model's static cache has "
                f"{self.rows}. Raise `max_batch_size` in the config, e.g. "
                f"from_pretrained(..., max_batch_size={batch_size})."
            )
        if needed_len > self.capacity:
            raise ValueError(
                f"This generate call needs {needed_len} cache slots per sequence (prompt + max_new_tokens - 1) but "
                f"the model's static cache holds {self.capacity}. Raise `static_cache_len` in the config, e.g. "
                f"from_pretrained(..., static_cache_len={needed_len}), or ask for fewer new tokens."
            )

    def activate(self, batch_size: int, length: int) -> None:
        """Start a request of `batch_size` rows needing `length` slots: the layers see views of the persistent
        storage of exactly that size (what the cache returned by `generate` shows), write position 0."""
        self._view(batch_size, length)
        self.reset()
        self.tokens, self.resumed = None, False

    def resume(self, batch_size: int, length: int) -> None:
        """Continue a request from what the cache holds (it was passed back to `generate`): views of `length` slots,
        the filled ones kept, the ones past them empty."""
        held = self.filled()
        self._view(batch_size, length)
        self.set_length(held)
        self.resumed = True

    def hold_rows(self) -> None:
        """Views of no slots, length 0: continuous batching hands `generate` this cache to admit one request while the
        rows hold others (the request's prefill writes its own row; nothing reads these views)."""
        self._view(1, 0)
        self.reset()
        self.tokens, self.resumed = None, False

    def clear(self) -> None:
        """Every row empty again (after continuous batching, whose rows held requests of their own)."""
        self.activate(self.rows, self.capacity)
        self.set_length(0)

    def filled(self) -> int:
        """Slots that a later turn continues from: what the static loop recorded, else the layers' own count (4.57
        counts non-zero slots, which left padding with a zero pad embedding undercounts)."""
        return self.tokens.shape[1] if self.tokens is not None else int(self.get_seq_length())

    def _view(self, batch_size: int, length: int) -> None:
        # The last shape's views are kept: slicing every layer's K/V is host time on the way to the first token
        # (continuous batching takes the same shape for every request it admits).
        if self._views_shape != (batch_size, length):
            self._views = [(keys[:batch_size, :, :length], values[:batch_size, :, :length])
                           for keys, values in zip(self.full_keys, self.full_values)]
            self._views_shape = (batch_size, length)
        for layer, (keys, values) in zip(self.layers, self._views):
            layer.keys, layer.values = keys, values
            layer.batch_size = batch_size
            layer.max_cache_len = length

    def reset(self) -> None:
        rewind_layers(self.length_counters)

    def set_length(self, length: int) -> None:
        """Record that `length` slots are filled (after a decode loop that wrote the cache directly)."""
        record_length(self.layers, self.length_counters, length)
