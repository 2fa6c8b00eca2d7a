"""Vision-tower pieces: the patch embedding without cuDNN's Conv3d.

The patch embedding is a Conv3d whose stride equals its kernel, i.e. one matrix product of the flattened
patches `(N, C*T*P*P)` with the flattened kernel. Same parameters (`proj.weight`, `proj.bias`), so the
checkpoint layout is unchanged.
"""

import torch
import torch.nn.functional as F
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionPatchEmbed


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
