"""The decode runner: one language-model step on static buffers, replayed until generation ends.

The runner owns every tensor a decode step touches: token ids `(B, 1)`, M-RoPE positions `(3, B, 1)`,
per-row cache lengths `(B,)` and a per-row "attendable slot" mask `(B, static_cache_len)` that is False on
left padding. Shapes are fixed at the model's `max_batch_size`, so a step for `b` rows works on the first `b`
rows of each buffer and the graph of a larger bucket simply carries dummy rows whose data keeps them inert
(token 0, position 0, a single attendable slot). Positions and cache lengths advance on the device inside the
step, so replaying it needs no host input except the tokens of the first step.
"""

import bisect

import torch
import torch.nn.functional as F
from transformers.models.qwen3_vl.modeling_qwen3_vl import apply_rotary_pos_emb


class DecodeRunner:
    def __init__(self, model, cache, batch_buckets: list[int], cache_buckets: list[int]):
        self.model = model
        self.cache = cache
        self.batch_buckets = batch_buckets
        self.cache_buckets = cache_buckets
        rows, slots = cache.rows, cache.capacity
        device = cache.full_keys[0].device
        self.input_ids = torch.zeros(rows, 1, dtype=torch.long, device=device)
        self.positions = torch.zeros(3, rows, 1, dtype=torch.long, device=device)
        self.cache_lens = torch.zeros(rows, dtype=torch.long, device=device)
        self.attendable = torch.ones(rows, slots, dtype=torch.bool, device=device)
        self.slot_ids = torch.arange(slots, device=device)
        self.row_ids = torch.arange(rows, device=device)
        self.batch_size = 0
        self.length = 0  # slots filled in every real row (rows advance in lockstep)

    def start(self, position_ids: torch.Tensor, attention_mask: torch.Tensor | None, prompt_len: int) -> None:
        """Load the state after prefill: the prompt's M-RoPE positions `(4, b, S)` and its 2D padding mask."""
        batch = position_ids.shape[1]
        self.batch_size, self.length = batch, prompt_len
        self.input_ids.zero_()
        self.positions.zero_()
        self.positions[:, :batch] = position_ids[1:, :, -1:] + 1  # T/H/W rows of the first generated token
        self.cache_lens.zero_()
        self.cache_lens[:batch] = prompt_len
        self.attendable.fill_(True)
        if attention_mask is not None:
            self.attendable[:batch, :prompt_len] = attention_mask.bool()

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Feed one token per row, return the next-token logits `(b, vocab)` and advance the state."""
        batch = self.batch_size
        self.input_ids[:batch, 0] = tokens
        rows = self.batch_buckets[bisect.bisect_left(self.batch_buckets, batch)]
        kv_len = self.cache_buckets[bisect.bisect_left(self.cache_buckets, self.length + 1)]
        logits = self.decode(rows, kv_len)
        self.length += 1
        return logits[:batch]

    def decode(self, rows: int, kv_len: int) -> torch.Tensor:
        """One decode step over the first `rows` rows, attending to the first `kv_len` cache slots."""
        text = self.model.model.language_model
        ids, positions, cache_lens = self.input_ids[:rows], self.positions[:, :rows], self.cache_lens[:rows]
        hidden = text.embed_tokens(ids)
        cos, sin = text.rotary_emb(hidden, positions)
        # A slot is read only if it is written (slot <= this row's length, the current token included) and not
        # left padding: never an unwritten or stale slot.
        mask = self.attendable[:rows, :kv_len] & (self.slot_ids[:kv_len] <= cache_lens[:, None])
        mask = mask[:, None, None, :]
        row_ids = self.row_ids[:rows]
        for layer, keys, values in zip(text.layers, self.cache.full_keys, self.cache.full_values):
            attn = layer.self_attn
            residual = hidden
            hidden = layer.input_layernorm(hidden)
            shape = (rows, 1, -1, attn.head_dim)
            q = attn.q_norm(attn.q_proj(hidden).view(shape)).transpose(1, 2)
            k = attn.k_norm(attn.k_proj(hidden).view(shape)).transpose(1, 2)
            v = attn.v_proj(hidden).view(shape).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            keys[row_ids, :, cache_lens] = k[:, :, 0]
            values[row_ids, :, cache_lens] = v[:, :, 0]
            # Grouped-query attention without repeating K/V: the query heads of one KV head form its query rows.
            kv_heads = keys.shape[1]
            out = F.scaled_dot_product_attention(
                q.reshape(rows, kv_heads, -1, attn.head_dim),
                keys[:rows, :, :kv_len],
                values[:rows, :, :kv_len],
                attn_mask=mask,
                scale=attn.scaling,
            )
            hidden = residual + attn.o_proj(out.reshape(rows, 1, -1))
            residual = hidden
            hidden = residual + layer.mlp(layer.post_attention_layernorm(hidden))
        logits = self.model.lm_head(text.norm(hidden))[:, 0]
        cache_lens += 1
        positions += 1
        return logits
