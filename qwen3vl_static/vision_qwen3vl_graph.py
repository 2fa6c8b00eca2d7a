"""Vision-tower pieces that keep the stock parameters (same checkpoint keys) but run with fewer host stalls.

- The patch embedding is a Conv3d whose stride equals its kernel, i.e. one matrix product of the flattened
  patches `(N, C*T*P*P)` with the flattened kernel.
- The stock sdpa vision attention splits the sequence per image with `lengths.tolist()`: a host sync in each
  of the 24 blocks. Here one image (one segment) is one SDPA call, and several segments are one call with
  a block-diagonal mask, built once per vision forward and shared by every block.
"""

import torch
import torch.nn.functional as F
from transformers.models.qwen3_vl.modeling_qwen3_vl import (
    Qwen3VLVisionAttention,
    Qwen3VLVisionPatchEmbed,
    apply_rotary_pos_emb_vision,
)


class Qwen3VLGraphPatchEmbed(Qwen3VLVisionPatchEmbed):
    def __init__(self, config, mode: str = "gemm") -> None:
        super().__init__(config)
        self.mode = mode

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        weight, bias = self.proj.weight, self.proj.bias
        if self.mode == "gemm":
            patches = hidden_states.reshape(-1, weight[0].numel()).to(weight.dtype)
            return F.linear(patches, weight.reshape(self.embed_dim, -1), bias)
        if self.mode == "conv3d":
            return super().forward(hidden_states)
        # channels_last_3d: the layout cuDNN prefers for this Conv3d; the stored weight keeps its layout.
        patches = hidden_states.reshape(-1, self.in_channels, self.temporal_patch_size, self.patch_size, self.patch_size)
        patches = patches.to(weight.dtype).contiguous(memory_format=torch.channels_last_3d)
        out = F.conv3d(patches, weight.contiguous(memory_format=torch.channels_last_3d), bias, stride=self.proj.stride)
        return out.reshape(-1, self.embed_dim)


# Above this many patches a block-diagonal mask (length^2 booleans, and attention over all pairs) costs more than
# the stock per-segment split's host syncs save, e.g. for long videos (one segment per frame).
MAX_MASKED_LENGTH = 8192


class BlockDiagonalMask:
    """The attention mask of one vision forward, shared by its blocks (they all get the same `cu_seqlens`)."""

    def __init__(self):
        self.cu_seqlens = None
        self.mask = None

    def get(self, cu_seqlens: torch.Tensor, length: int) -> torch.Tensor | None:
        if cu_seqlens.shape[0] <= 2:  # a single segment attends to all of itself: no mask
            return None
        if self.cu_seqlens is not cu_seqlens:
            positions = torch.arange(length, device=cu_seqlens.device)
            segment = torch.searchsorted(cu_seqlens, positions, right=True)
            self.cu_seqlens, self.mask = cu_seqlens, segment[:, None] == segment[None, :]
        return self.mask


class Qwen3VLGraphVisionAttention(Qwen3VLVisionAttention):
    def __init__(self, config, mask: BlockDiagonalMask) -> None:
        super().__init__(config)
        self.block_mask = mask

    def forward(self, hidden_states, cu_seqlens, position_embeddings=None, **kwargs):
        length = hidden_states.shape[0]
        # Flash attention is already variable-length; very long multi-segment inputs keep the stock split.
        if self.config._attn_implementation != "sdpa" or (cu_seqlens.shape[0] > 2 and length > MAX_MASKED_LENGTH):
            return super().forward(hidden_states, cu_seqlens=cu_seqlens, position_embeddings=position_embeddings, **kwargs)
        q, k, v = self.qkv(hidden_states).reshape(length, 3, self.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
        q, k = apply_rotary_pos_emb_vision(q, k, *position_embeddings)
        q, k, v = (states.transpose(0, 1).unsqueeze(0) for states in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=self.block_mask.get(cu_seqlens, length), scale=self.scaling)
        return self.proj(out[0].transpose(0, 1).reshape(length, -1))
