"""The prefill runner: the prompt through the language model into the static cache, and the first token's logits.

The stock prefill builds masks, splits multimodal features and scatters DeepStack features with boolean
indexing: host work and syncs around each of ~30 module calls per layer. Here the whole prompt forward is a
function of fixed-shape tensors, so it can be captured as a CUDA graph per (batch bucket, token bucket):
- image/video placeholder tokens take their features by a gather whose index is a running count of image
  (video) tokens, row-major as stock `masked_scatter` fills them; DeepStack features are added the same way
  after the first decoder layers, and text tokens get exactly zero;
- a prompt without padding (every batch row full) needs causality only: bucket padding comes after the real
  tokens, which never look ahead, and grouped-query attention reads each K/V head once (no repeated K/V);
- a padded batch builds its attention mask in the graph from a per-token "valid" flag (left padding and bucket
  padding are invalid) and causality; every token also sees itself, so a padding token never has an empty
  softmax. Graphs are keyed by (rows, tokens, padded);
- K/V of all bucket slots are written to the cache: slots past the prompt hold padding values that the decode
  step overwrites before anything reads them (it attends to written slots only).
A prompt larger than the graph budget runs the same function eagerly at its exact size.
"""

import bisect

import torch
import torch.nn.functional as F


class PrefillRunner:
    def __init__(
        self, model, cache, ops, fused_weights, batch_buckets, token_buckets, max_tokens: int, capturer,
        use_graphs: bool, bucketed: bool,
    ):
        self.model = model
        self.cache = cache
        self.ops = ops
        self.qkv_weights, self.gate_up_weights = fused_weights
        self.batch_buckets = batch_buckets
        # A bucket never exceeds the cache (its padding slots are written too) nor `max_tokens` with its rows.
        self.token_buckets = [size for size in token_buckets if size <= min(cache.capacity, max_tokens)]
        self.capturer = capturer
        device = cache.full_keys[0].device
        # Padded to buckets (the model does this on CUDA, graphs or not, so the eager step computes on exactly the
        # shapes the graphs do), or run at exact sizes.
        self.bucketed = bucketed and bool(self.token_buckets)
        self.can_use_graphs = self.bucketed
        self.use_graphs = use_graphs and self.can_use_graphs
        self.graphs = {}
        text = model.model.language_model
        hidden, deepstack = text.config.hidden_size, len(model.model.visual.deepstack_visual_indexes)
        self.max_tokens = max_tokens if self.bucketed else 0
        dtype = cache.full_keys[0].dtype

        def buffer(*shape, dtype=torch.long):
            return torch.zeros(*shape, dtype=dtype, device=device)

        # Flat per-token buffers; a (rows, size) bucket uses the first rows * size entries.
        tokens = self.max_tokens
        self.input_ids = buffer(tokens)
        self.positions = buffer(3, tokens)
        self.valid = buffer(tokens, dtype=torch.bool)
        self.modality = buffer(tokens)  # 0 text, 1 image, 2 video
        self.visual = buffer(max(tokens, 1), hidden, dtype=dtype)
        self.deepstack = buffer(deepstack, max(tokens, 1), hidden, dtype=dtype)
        self.last = buffer(1)
        self.logits = buffer(cache.rows if self.bucketed else 0, model.lm_head.out_features, dtype=torch.float32)

    def run(self, input_ids, attention_mask, positions, visual=None, deepstack=(), padded=True) -> torch.Tensor:
        """Prefill `input_ids` `(b, s)` with M-RoPE `positions` `(3, b, s)`. `visual` `(n, hidden)` and each of
        `deepstack` hold the features of the prompt's image tokens in order, then those of its video tokens
        (None for a text prompt). `padded`: whether `attention_mask` has any zero (the caller knows it without
        another host read). Returns float32 logits of the last position `(b, vocab)`."""
        padded = padded and attention_mask is not None
        batch, length = input_ids.shape
        valid = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        image_token, video_token = self.model.config.image_token_id, self.model.config.video_token_id
        modality = (input_ids == image_token).long() + 2 * (input_ids == video_token).long()
        key = self.bucket(batch, length)
        if key is None:
            if visual is None:  # zero features: the same ops as a multimodal prompt, adding exact zeros
                visual = self.visual[:1].new_zeros(1, self.visual.shape[1])
                deepstack = [visual] * self.deepstack.shape[0]
            last = torch.full((1,), length - 1, dtype=torch.long, device=input_ids.device)
            return self.forward(input_ids, positions, valid, modality, visual, deepstack, last, padded)
        rows, size = key
        for buffer, value in zip((self.input_ids, self.valid, self.modality), (input_ids, valid, modality)):
            view = buffer[: rows * size].view(rows, size)
            view.zero_()
            view[:batch, :length] = value
        view = self.positions[:, : rows * size].view(3, rows, size)
        view.zero_()
        view[:, :batch, :length] = positions
        if visual is not None:
            self.visual[: visual.shape[0]] = visual
            for buffer, features in zip(self.deepstack, deepstack):
                buffer[: features.shape[0]] = features
        self.last.fill_(length - 1)
        if self.use_graphs:
            (self.graphs.get((*key, padded)) or self.capture(*key, padded)).replay()
        else:
            self.step(*key, padded)
        return self.logits[:batch].clone()

    def idle(self) -> None:
        """Inputs for warm-up steps, in bounds for every bucket: text token 0 at position 0, each token padding (it still
        sees itself), the output read at token 0 (a previous, longer prompt's last token lies past a smaller bucket)."""
        for buffer in (self.input_ids, self.positions, self.valid, self.modality, self.last):
            buffer.zero_()

    def bucket(self, batch: int, length: int):
        """(rows, tokens) bucket of a prompt, or None when it runs at its exact size (CPU, or over the budget)."""
        if not self.bucketed or length > self.token_buckets[-1]:
            return None
        rows = self.batch_buckets[bisect.bisect_left(self.batch_buckets, batch)]
        size = self.token_buckets[bisect.bisect_left(self.token_buckets, length)]
        return (rows, size) if rows * size <= self.max_tokens else None

    def step(self, rows: int, size: int, padded: bool) -> None:
        tokens = rows * size
        self.logits[:rows] = self.forward(
            self.input_ids[:tokens].view(rows, size), self.positions[:, :tokens].view(3, rows, size),
            self.valid[:tokens].view(rows, size), self.modality[:tokens].view(rows, size),
            self.visual, self.deepstack, self.last, padded,
        )

    def graph_step(self, rows: int, size: int, padded: bool):
        """The step a graph captures, and the state its runs advance: none (it writes its outputs only)."""
        return lambda: self.step(rows, size, padded), ()

    def capture(self, rows: int, size: int, padded: bool) -> torch.cuda.CUDAGraph:
        name = f"prefill ({rows} rows x {size} tokens{', padded' if padded else ''})"
        graph = self.capturer.capture(*self.graph_step(rows, size, padded), name=name)
        self.graphs[(rows, size, padded)] = graph
        return graph

    def forward(self, input_ids, positions, valid, modality, visual, deepstack, last, padded) -> torch.Tensor:
        """The prompt forward on tensors of one fixed shape `(rows, size)`; writes K/V of slots [0, size).
        `padded`: some row has left padding or padding inside (else causality is the whole mask)."""
        ops, text = self.ops, self.model.model.language_model
        rows, size = input_ids.shape
        hidden = text.embed_tokens(input_ids)
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
        slots = torch.arange(size, device=input_ids.device)
        cache_rows, cache_slots = torch.arange(rows, device=slots.device).repeat_interleave(size), slots.repeat(rows)
        if padded:
            causal = slots[:, None] >= slots[None, :]
            mask = (causal & valid[:, None, :]) | (slots[:, None] == slots[None, :])
            mask = mask[:, None]  # (rows, 1, size, size)
        hidden = hidden.view(tokens, -1)
        norms = [layer.input_layernorm for layer in text.layers[1:]] + [text.norm]
        first = text.layers[0].input_layernorm
        x = ops.rms_norm(hidden, first.weight, first.variance_epsilon)
        layers = zip(text.layers, norms, self.cache.full_keys, self.cache.full_values, self.qkv_weights, self.gate_up_weights)
        for index, (layer, next_norm, keys, values, qkv_weight, gate_up_weight) in enumerate(layers):
            attn, norm = layer.self_attn, layer.post_attention_layernorm
            heads, kv_heads = attn.config.num_attention_heads, keys.shape[1]
            # The same fused QK-norm / rotary / cache-write op as a decode step, over every token of the prompt.
            q = ops.qk_norm_rope_write(
                F.linear(x, qkv_weight), heads, attn.q_norm.weight, attn.k_norm.weight, attn.q_norm.variance_epsilon,
                rotary, keys, values, cache_rows, cache_slots,
            )
            q = q.view(rows, size, heads, -1).transpose(1, 2)
            k, v = keys[:rows, :, :size], values[:rows, :, :size]
            if padded:  # K/V heads repeated for the query heads, as stock `repeat_kv` does (masked kernels lack GQA)
                group = heads // kv_heads
                k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=attn.scaling)
            else:
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=attn.scaling, enable_gqa=True)
            out = out.transpose(1, 2).reshape(tokens, -1)
            hidden, x = ops.add_rms_norm(hidden, attn.o_proj(out), norm.weight, norm.variance_epsilon)
            mlp_out = layer.mlp.down_proj(ops.silu_mul(F.linear(x, gate_up_weight)))
            if index < len(deepstack):  # DeepStack: visual features of a vision layer join the residual stream
                hidden = hidden + mlp_out
                added = torch.where(is_visual, deepstack[index][order], 0).view(tokens, -1)
                hidden = hidden + added
                x = ops.rms_norm(hidden, next_norm.weight, next_norm.variance_epsilon)
            else:
                hidden, x = ops.add_rms_norm(hidden, mlp_out, next_norm.weight, next_norm.variance_epsilon)
        x = x.view(rows, size, -1).index_select(1, last)[:, 0]
        return self.model.lm_head(x).float()

    def warmup_keys(self, batch_sizes, prompt_lengths) -> list:
        """The graphs these sizes use, largest first (for `model.warmup` to capture): (rows, tokens, padded), a batch
        of several rows both without and with padding."""
        buckets = {self.bucket(batch, length) for batch in batch_sizes for length in prompt_lengths} - {None}
        keys = {(rows, size, padded) for rows, size in buckets for padded in ((False, True) if rows > 1 else (False,))}
        return sorted(keys, reverse=True)
