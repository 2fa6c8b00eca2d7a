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
"""The prefill runner: the prompt through the language model into the static cache, and the first token's logits.

The stock prefill builds masks, splits multimodal features and scatters DeepStack features with boolean
indexing: host work and syncs around each of ~30 module calls per layer. Here the whole prompt forward is a
function of fixed-shape tensors, so it can be captured as a CUDA graph per (batch bucket, token bucket):
- image/video placeholder tokens take their features by a gather whose index is a running count of image
  (video) tokens, row-major as stock `masked_scatter` fills them; DeepStack features are added the same way
  after the first decoder layers, and text tokens get exactly zero;
- a prompt without padding (every batch row full) needs causality only: bucket padding comes after the real
  tokens, which never look ahead, and grouped-query attention reads each K/V head once (no repeated K/V);
- a padded batch builds its attention mask in the graph from a per-slot "attendable" flag (left, right and
  bucket padding are not attendable) and causality, as stock masks padding: a padding query sees the real tokens
  before it (a right-padded row's last position gives its first token, as in stock), and one with none before it
  sees itself, so no softmax is empty;
- a prompt that extends what the cache already holds (a later turn passing back the returned cache) prefills only
  its new tokens: they are written from slot `start` on and attend to the cached slots the attention mask allows,
  through a graph keyed by the KV-length bucket that covers them. Graphs are keyed by (rows, tokens, KV slots,
  masked); a fresh prompt's KV slots are its own tokens;
- K/V of all bucket slots are written to the cache: slots past the prompt hold padding values that the decode
  step overwrites before anything reads them (it attends to written slots only);
- the prompt's rows go to the cache rows of a buffer like `start` (by default rows 0, 1, ...): continuous batching
  prefills requests into free rows while the other rows hold theirs, through the same graphs (its batches fill
  their bucket exactly: a bucket's padding rows would write into the rows they point to).
A prompt larger than the graph budget runs the same function eagerly at its exact size.
"""

import torch
import torch.nn.functional as F

from .decoder_qwen3vl_graph import decoder_layers, recording
from .runner_qwen3vl_graph import GraphRunner, bucket_of


class PrefillRunner(GraphRunner):
    def __init__(
        self, text, cache, ops, deepstack_layers: int, batch_buckets, token_buckets, cache_buckets, max_tokens: int,
        capturer, use_graphs: bool, bucketed: bool,
    ):
        # A bucket never exceeds the cache (its padding slots are written too) nor `max_tokens` with its rows.
        token_buckets = [size for size in token_buckets if size <= min(cache.capacity, max_tokens)]
        # Padded to buckets (the model does this on CUDA, graphs or not, so the eager step computes on exactly the
        # shapes the graphs do), or run at exact sizes.
        bucketed = bucketed and bool(token_buckets)
        device, dtype = text.embed.device, text.embed.dtype
        super().__init__(capturer, use_graphs, can_use_graphs=bucketed and device.type == "cuda")
        self.text = text  # TextWeights
        self.cache = cache
        self.ops = ops
        self.batch_buckets = batch_buckets
        self.token_buckets = token_buckets
        self.cache_buckets = cache_buckets  # KV lengths of a prompt that extends the cache (the decode step's)
        self.bucketed = bucketed
        hidden = text.embed.shape[1]
        self.max_tokens = max_tokens if self.bucketed else 0

        def buffer(*shape, dtype=torch.long):
            return torch.zeros(*shape, dtype=dtype, device=device)

        # Flat per-token buffers; a (rows, size) bucket uses the first rows * size entries.
        tokens = self.max_tokens
        self.input_ids = buffer(tokens)
        self.positions = buffer(3, tokens)
        self.modality = buffer(tokens)  # 0 text, 1 image, 2 video
        self.visual = buffer(max(tokens, 1), hidden, dtype=dtype)
        self.deepstack = buffer(deepstack_layers, max(tokens, 1), hidden, dtype=dtype)
        # Per row and cache slot: whether a query may attend to it (the attention mask over cached and new tokens).
        self.attendable = buffer(cache.rows if self.bucketed else 0, cache.capacity, dtype=torch.bool)
        self.start = buffer(1)  # the first slot the prompt writes (what the cache already holds)
        self.cache_rows = buffer(cache.rows)  # the cache row of each of the prompt's rows
        self.default_rows = torch.arange(cache.rows, device=device)
        self.eager_runs = 0  # prompts run eagerly although graphs are on (no bucket fits them): launched from Python
        self.last = buffer(1)
        self.logits = buffer(cache.rows if self.bucketed else 0, text.lm_head.shape[0], dtype=torch.float32)
        self.recorded_layers = ()  # layers whose outputs an EAGLE-3 draft reads (`record_layers`)
        self._taps = self.visual.new_zeros(self.max_tokens, 0)  # their outputs, per bucket token
        self.taps = None  # their outputs for every prompt token of the last `run`, side by side `(tokens, n * hidden)`

    def record_layers(self, layer_ids) -> None:
        """From now on every prompt's forward also keeps the outputs of layers `layer_ids` (`taps`). Graphs captured
        without them are dropped."""
        layer_ids = tuple(layer_ids)
        if layer_ids != self.recorded_layers:
            self.recorded_layers = layer_ids
            self._taps = self.visual.new_zeros(self.max_tokens, len(layer_ids) * self.visual.shape[1])
            self.graphs = {}

    def run(self, input_ids, attention_mask, positions, modality, visual=None, deepstack=(), padded=True, start: int = 0,
            rows=None):
        """Prefill `input_ids` `(b, s)` with M-RoPE `positions` `(3, b, s)` into cache slots [start, start + s) of
        cache rows `rows` (a `(b,)` tensor; None: rows 0 to b - 1), after the `start` slots the cache already holds.
        `attention_mask` `(b, start + s)` covers both (None: all ones). `modality` `(b, s)`: 0 for a token embedded as
        text, 1 (2) for one that takes the next image (video) feature; `visual` `(n, hidden)` and each of `deepstack`
        hold those features, the images' first (None for text). `padded`: whether `attention_mask` has any zero (the
        caller knows it without another host read). Returns float32 logits of the last position `(b, vocab)`."""
        batch, length = input_ids.shape
        kv_len = start + length
        if attention_mask is None:
            attendable = torch.ones(batch, kv_len, dtype=torch.bool, device=input_ids.device)
        else:
            attendable = attention_mask.bool()
        masked = (padded and attention_mask is not None) or start > 0
        key = self.bucket(batch, length, start)
        if rows is None:
            rows = self.default_rows[:batch]
        elif key is not None and key[0] != batch:
            key = None  # the bucket's padding rows would write into other requests' rows: the exact size, eagerly
        if key is None:
            if self.use_graphs:
                self.eager_runs += 1
            if visual is None:  # zero features: the same ops as a multimodal prompt, adding exact zeros
                visual = self.visual[:1].new_zeros(1, self.visual.shape[1])
                deepstack = [visual] * self.deepstack.shape[0]
            first, last = (torch.full((1,), value, dtype=torch.long, device=input_ids.device)
                           for value in (start, length - 1))
            taps = self.visual.new_empty(batch * length, len(self.recorded_layers) * self.visual.shape[1])
            logits = self.forward(input_ids, positions, attendable, modality, visual, deepstack, first, last, rows,
                                  masked, recording(self.recorded_layers, taps))
            self.taps = taps if self.recorded_layers else None
            return logits
        self.cache_rows[:batch] = rows
        self.cache_rows[batch : key[0]] = self.default_rows[batch : key[0]]  # padding rows: rows the call leaves free
        rows, size, kv_slots = key
        for buffer, value in zip((self.input_ids, self.modality), (input_ids, modality)):
            view = buffer[: rows * size].view(rows, size)
            view.zero_()
            view[:batch, :length] = value
        view = self.positions[:, : rows * size].view(3, rows, size)
        view.zero_()
        view[:, :batch, :length] = positions
        self.attendable[:rows, :kv_slots] = False  # dummy rows and bucket padding: attendable by none
        self.attendable[:batch, :kv_len] = attendable
        if visual is not None:
            self.visual[: visual.shape[0]] = visual
            for buffer, features in zip(self.deepstack, deepstack):
                buffer[: features.shape[0]] = features
        self.start.fill_(start)
        self.last.fill_(length - 1)
        self.execute((*key, masked))
        # Row-major: the first row's tokens first.
        self.taps = self._taps[: key[0] * key[1]].view(key[0], key[1], -1)[:batch, :length].flatten(0, 1) \
            if self.recorded_layers else None
        return self.logits[:batch].clone()

    def idle(self) -> None:
        """Inputs for warm-up steps, in bounds for every bucket: text token 0 at position 0 written to slot 0 on, each
        slot unattendable (a token still sees itself), the output read at token 0 (a previous, longer prompt's last
        token lies past a smaller bucket)."""
        for buffer in (self.input_ids, self.positions, self.modality, self.attendable, self.start, self.last):
            buffer.zero_()
        self.cache_rows.copy_(self.default_rows)

    def bucket(self, batch: int, length: int, start: int = 0):
        """(rows, tokens, KV slots) bucket of a prompt written from slot `start` on, or None when it runs at its exact
        size (CPU, over the budget, or no KV-length bucket holds it)."""
        if not self.bucketed or length > self.token_buckets[-1]:
            return None
        rows, size = bucket_of(self.batch_buckets, batch), bucket_of(self.token_buckets, length)
        if rows * size > self.max_tokens:
            return None
        if not start:
            return rows, size, size
        # The bucket's padding tokens are written too: every written slot lies within the KV slots, and those
        # within the cache.
        kv_slots = bucket_of(self.cache_buckets, start + size)
        return None if kv_slots is None else (rows, size, kv_slots)

    def graph_pieces(self, lengths: list) -> list | None:
        """How prompts of `lengths` (shortest first), fresh prompts bound for rows that other requests' rows surround
        (continuous batching), split into prefills that each replay a graph: the pieces' sizes, in order, each a batch
        bucket whose rows of its longest prompt fit the graph's tokens, the largest first. None when prompts are not
        padded to buckets (CPU) or one is longer than any graph's. A whole batch of a size between buckets would run
        eagerly (a bucket's padding rows would write into other requests' rows), launched kernel by kernel from
        Python. With graphs off the pieces are the same, run at the graphs' shapes: the eager static path's tokens
        are the graphs'."""
        if not self.bucketed:
            return None
        pieces, start = [], 0
        while start < len(lengths):
            rows = next((rows for rows in reversed(self.batch_buckets) if start + rows <= len(lengths)
                         and self.bucket(rows, lengths[start + rows - 1]) is not None), None)
            if rows is None:
                return None
            pieces.append(rows)
            start += rows
        return pieces

    def step(self, rows: int, size: int, kv_slots: int, masked: bool) -> None:
        tokens = rows * size
        self.logits[:rows] = self.forward(
            self.input_ids[:tokens].view(rows, size), self.positions[:, :tokens].view(3, rows, size),
            self.attendable[:rows, :kv_slots], self.modality[:tokens].view(rows, size),
            self.visual, self.deepstack, self.start, self.last, self.cache_rows[:rows], masked,
            recording(self.recorded_layers, self._taps[:tokens]),
        )

    def describe(self, key) -> str:
        rows, size, kv_slots, masked = key
        after = f" after the cache, {kv_slots} slots" if kv_slots != size else ""
        return f"prefill ({rows} rows x {size} tokens{after}{', masked' if masked else ''})"

    def forward(self, input_ids, positions, attendable, modality, visual, deepstack, start, last, row_ids,
                masked, record=()) -> torch.Tensor:
        """The prompt forward on tensors of one fixed shape `(rows, size)`; writes K/V of slots [start, start + size)
        of cache rows `row_ids` `(rows,)` and attends to the slots of `attendable` `(rows, KV slots)`. `masked`: some
        slot is not attendable or the prompt follows cached slots (else causality within the prompt is the whole
        mask). `record`: layer outputs to keep, row-major (`decoder_layers`)."""
        ops, text = self.ops, self.text
        rows, size = input_ids.shape
        hidden, attend, added = self.layer_inputs(input_ids, positions, attendable, modality, visual, deepstack, start,
                                                  row_ids, masked)
        x = ops.rms_norm(hidden, *text.first_norm)
        x = decoder_layers(ops, text.layers, self.cache.full_keys, self.cache.full_values, hidden, x, attend, added,
                           record)
        x = x.view(rows, size, -1).index_select(1, last)[:, 0]
        return ops.linear(x, text.lm_head).float()

    def layer_inputs(self, input_ids, positions, attendable, modality, visual, deepstack, start, row_ids,
                     masked) -> tuple:
        """What `decoder_layers` takes for the prompt tokens `(rows, size)` (`forward`'s arguments): the residual
        stream `(rows * size, hidden)` row-major, how a layer attends, and the DeepStack features to add."""
        ops, text = self.ops, self.text
        rows, size = input_ids.shape
        kv_slots = attendable.shape[1]
        hidden = F.embedding(input_ids, text.embed)
        # The k-th image token (row-major) takes feature row k, the k-th video token row (image tokens + k); the
        # index of a text token is unused.
        is_image, is_video = (modality == 1).flatten(), (modality == 2).flatten()
        image_rank, video_rank = is_image.cumsum(0) - 1, is_video.cumsum(0) - 1 + is_image.sum()
        order = torch.where(is_video, video_rank, image_rank).clamp(min=0).view(rows, size)
        is_visual = (modality != 0)[..., None]
        hidden = torch.where(is_visual, visual[order], hidden)
        cos, sin = text.rotary_emb(hidden, positions)
        tokens = rows * size
        rotary = ops.rotary(cos.view(tokens, 1, -1), sin.view(tokens, 1, -1))  # shared by all layers
        slots = start + torch.arange(size, device=input_ids.device)
        cache_rows, cache_slots = row_ids.repeat_interleave(size), slots.repeat(rows)
        if masked:
            # Stock's padding mask: causal over attendable slots; a query with no such slot sees itself instead.
            key_slots = torch.arange(kv_slots, device=slots.device)
            mask = (slots[:, None] >= key_slots[None, :]) & attendable[:, None, :]
            mask = mask | ((slots[:, None] == key_slots[None, :]) & ~mask.any(-1, keepdim=True))
            mask = mask[:, None]  # (rows, 1, size, KV slots)

        def attend(layer, keys, values, x):
            # The same fused QK-norm / rotary / cache-write op as a decode step, over every token of the prompt. A
            # fresh prompt's K/V slots are its own tokens: it reads them as the op returns them, not by gathering its
            # cache rows (two launches a layer).
            fresh = kv_slots == size
            written = ops.qk_norm_rope_write(ops.linear(x, layer.qkv), layer.heads, *layer.qk_norms, rotary, keys,
                                             values, cache_rows, cache_slots, return_kv=fresh)
            if fresh:
                q, k, v = written
                k, v = (states.view(rows, size, *states.shape[1:]).transpose(1, 2) for states in (k, v))
            else:
                q = written
                k, v = (cache[:, :, :kv_slots].index_select(0, row_ids).to(q.dtype) for cache in (keys, values))
            q = q.view(rows, size, layer.heads, -1).transpose(1, 2)
            if masked:  # K/V heads repeated for the query heads, as stock `repeat_kv` does (masked kernels lack GQA)
                group = layer.heads // keys.shape[1]
                k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=layer.scaling)
            else:
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=layer.scaling, enable_gqa=True)
            return out.transpose(1, 2).reshape(tokens, -1)

        # DeepStack: visual features of the first vision layers join the residual stream after the first decoder layers.
        added = [torch.where(is_visual, features[order], 0).view(tokens, -1) for features in deepstack]
        return hidden.view(tokens, -1), attend, added

    def warmup_keys(self, batch_sizes, prompt_lengths) -> list:
        """The graphs these sizes use, largest first (for `model.warmup` to capture): (rows, tokens, KV slots, masked),
        a batch of several rows both without and with padding. (A prompt that extends the cache gets its graph on
        first use.)"""
        buckets = {self.bucket(batch, length) for batch in batch_sizes for length in prompt_lengths} - {None}
        keys = {(*bucket, masked) for bucket in buckets for masked in ((False, True) if bucket[0] > 1 else (False,))}
        return sorted(keys, reverse=True)
