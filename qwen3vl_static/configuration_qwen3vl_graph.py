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
"""Configuration of the CUDA-graph Qwen3-VL model.

A subclass of the stock `Qwen3VLConfig` with its own `model_type`, so a checkpoint converted for this
package can never load silently into the stock class when `trust_remote_code=True` is forgotten.
"""

import dataclasses

import torch
from transformers import GenerationConfig
from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLConfig

from .compat_qwen3vl_graph import portable_config_dict

PATCH_EMBED_MODES = ("gemm", "conv3d", "channels_last_3d")
# `kv_cache_dtype` values (vLLM's names) and what the cache stores for each; "auto": the model's dtype.
KV_CACHE_DTYPES = {"auto": None, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn}


class Qwen3VLGraphConfig(Qwen3VLConfig):
    r"""
    Everything of [`Qwen3VLConfig`] plus the settings of the static-cache / CUDA-graph decode path.

    Args:
        use_cuda_graphs (`bool`, defaults to `True`):
            Replay the decode step as captured CUDA graphs when the model is on a CUDA device. When `False` (or on
            the CPU) the same static-cache step runs eagerly.
        use_triton_kernels (`bool`, defaults to `True`):
            Run the decode step's norms, rotary embedding, cache writes, attention and SwiGLU as fused Triton
            kernels on CUDA (bf16/fp16 models, when Triton is installed). Otherwise, or when `False`, the same
            math runs as torch ops.
        max_batch_size (`int`, defaults to 8):
            Rows of the one persistent KV cache. A `generate` call with more sequences raises a `ValueError`.
        static_cache_len (`int`, defaults to 4096):
            Tokens per row of the persistent KV cache: prompt + `max_new_tokens` - 1 must fit.
        graph_batch_sizes (`list[int]`, *optional*):
            Batch sizes captured as graphs; a batch is padded up to the next one. Defaults to powers of two up to
            `max_batch_size`.
        graph_cache_lengths (`list[int]`, *optional*):
            KV-length buckets ("milestones"): a graph attends to the first `n` cache slots only. Defaults to
            powers of two from 256 up to `static_cache_len`.
        kv_cache_dtype (`str`, defaults to `"auto"`):
            What the KV cache stores: `"auto"`, the model's dtype; `"fp8"` (or `"fp8_e4m3"`, the same), opt-in:
            float8 e4m3 values, saturated at +-448 with no scale (vLLM's `kv_cache_dtype="fp8"` without scales), half
            the bytes of bf16: twice the slots in the same memory and half the reads of decode attention. Answers then
            differ from stock's, as with FP8 weights; attention still computes in the model's dtype.
        steps_per_sync (`int`, defaults to 8):
            Decode steps the device runs (sampling and EOS checks included) before the host reads their tokens.
            The next chunk is queued before the host reads one, so the GPU does not wait for the host; up to
            `2 * steps_per_sync - 1` steps past the last EOS are computed and dropped.
        prefill_graph_tokens (`int`, defaults to 2048):
            Largest prompt (batch bucket x token bucket, in tokens) whose language-model prefill is padded to a
            token bucket (powers of two from 16 to 256, then four per octave: 320, 384, 448, 512, 640, ...) and
            replayed as a CUDA graph; larger prompts run the same prefill eagerly at their exact size. 0 turns
            prefill graphs off.
        vision_graph_patches (`int`, defaults to 8192):
            Most patches one vision CUDA graph computes. A call's images and video frames run in chunks of one size
            (a graph per number of images and size, captured on first use, no padding, attention within each image
            or frame only); a size's images beyond this many patches split into several chunks, and one image or
            frame above it runs eagerly. A 448x448 image has 784 patches, a 1024x1024 one 4096. 0 turns vision
            graphs off. Must be a multiple of `spatial_merge_size**2`.
        vision_table_cache_size (`int`, defaults to 16):
            Image sizes whose vision position tables (interpolated position embeddings, rotary cos/sin) and vision
            graphs are kept for reuse.
        patch_embed_mode (`str`, defaults to `"gemm"`):
            How the vision patch embedding runs: `"gemm"` (the stride-equals-kernel Conv3d as one matrix product on
            the same weights), `"conv3d"` (stock) or `"channels_last_3d"` (Conv3d in channels-last-3d layout).
        allow_tf32 (`bool`, defaults to `False`):
            Opt-in: allow TF32 for float32 matmuls and cuDNN convolutions (changes float32 numerics) while the model
            runs `generate` or `warmup`; torch's global flags are restored afterwards.
        cudnn_benchmark (`bool`, defaults to `False`):
            Opt-in: `torch.backends.cudnn.benchmark = True` while the model runs `generate` or `warmup`, restored
            afterwards.
    """

    model_type = "qwen3_vl_graph"

    use_cuda_graphs: bool = True
    use_triton_kernels: bool = True
    max_batch_size: int = 8
    static_cache_len: int = 4096
    graph_batch_sizes: list[int] | None = None
    graph_cache_lengths: list[int] | None = None
    kv_cache_dtype: str = "auto"
    steps_per_sync: int = 8
    prefill_graph_tokens: int = 2048
    vision_graph_patches: int = 8192
    vision_table_cache_size: int = 16
    patch_embed_mode: str = "gemm"
    allow_tf32: bool = False
    cudnn_benchmark: bool = False

    @classmethod
    def get_config_dict(cls, pretrained_model_name_or_path, **kwargs) -> tuple[dict, dict]:
        """A stock Qwen3-VL config reads as this class's own: loading a stock checkpoint into this class is supported,
        so `from_pretrained` must not warn about a foreign model type. Any other model type is refused: transformers
        would only warn, then build a default-size Qwen3-VL (GBs) around weights that do not fit it."""
        config_dict, kwargs = super().get_config_dict(pretrained_model_name_or_path, **kwargs)
        model_type = config_dict.get("model_type")
        if model_type == Qwen3VLConfig.model_type:
            config_dict = {**config_dict, "model_type": cls.model_type}
        elif model_type not in (cls.model_type, None):
            raise ValueError(f"{pretrained_model_name_or_path} holds a {model_type!r} checkpoint, not a Qwen3-VL one "
                             f"(model_type {Qwen3VLConfig.model_type!r} or {cls.model_type!r})")
        return config_dict, kwargs

    def __post_init__(self, **kwargs):  # transformers 5.x; on 4.57 the model calls `validate_graph_settings`
        super().__post_init__(**kwargs)
        self.validate_graph_settings()

    def validate_graph_settings(self) -> None:
        if self.patch_embed_mode not in PATCH_EMBED_MODES:
            raise ValueError(f"patch_embed_mode must be one of {PATCH_EMBED_MODES}, got {self.patch_embed_mode!r}")
        self.kv_dtype(torch.bfloat16)
        if self.steps_per_sync < 1:
            raise ValueError(f"steps_per_sync must be at least 1, got {self.steps_per_sync}")
        for name in ("prefill_graph_tokens", "vision_graph_patches", "vision_table_cache_size"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must not be negative, got {getattr(self, name)}")
        unit = self.vision_config.spatial_merge_size**2
        if self.vision_graph_patches % unit:
            raise ValueError(
                f"vision_graph_patches must be a multiple of spatial_merge_size**2 = {unit} (whole merged tokens), "
                f"got {self.vision_graph_patches}"
            )

    def _get_generation_parameters(self) -> dict:
        """Generation settings left in the model config (generate refuses them), found as transformers 5.24 finds them:
        from the declared fields. 5.17 - 5.23 instead build a whole default config, sub-configs included, on every
        `generate` call: several milliseconds of a short request's latency. (4.57 does not call this.)"""
        declared = {field.name for field in dataclasses.fields(self)}
        return {
            key: getattr(self, key)
            for key in GenerationConfig._get_default_generation_params()
            if key != "use_cache" and getattr(self, key, None) is not None and key not in declared
        }

    def to_dict(self) -> dict:
        return portable_config_dict(super().to_dict())

    def kv_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The dtype the KV cache stores for a model computing in `model_dtype` (`kv_cache_dtype`)."""
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        return KV_CACHE_DTYPES[self.kv_cache_dtype] or model_dtype

    # Buckets are derived when used, not stored: `from_pretrained(..., static_cache_len=N)` sets fields after
    # `__post_init__`, and a stored default would then be stale.
    def batch_buckets(self) -> list[int]:
        """Sorted batch sizes that get a graph; the last one is `max_batch_size`."""
        return _buckets(self.graph_batch_sizes, 1, self.max_batch_size, "graph_batch_sizes", "max_batch_size")

    def cache_buckets(self) -> list[int]:
        """Sorted KV lengths that get a graph; the last one is `static_cache_len`."""
        return _buckets(self.graph_cache_lengths, 256, self.static_cache_len, "graph_cache_lengths", "static_cache_len")

    def prompt_buckets(self) -> list[int]:
        """Sorted prompt lengths that get a prefill graph (empty when prefill graphs are off)."""
        if not self.prefill_graph_tokens:
            return []
        return _buckets(_prompt_sizes(self.prefill_graph_tokens), 16, self.prefill_graph_tokens, "prompt buckets",
                        "prefill_graph_tokens")


def _prompt_sizes(top: int) -> list[int]:
    """Token buckets below `top`: powers of two from 16 to 256, then four per octave (320, 384, 448, 512, 640, ...).
    Up to about 256 tokens a prefill's matmuls are bound by reading the weights (on an H200, 2 x 256 flops per
    bf16 weight read is about its ratio of compute to bandwidth), so padding there costs little time; past that
    their time grows with the tokens, and four buckets per octave bound the padding to a quarter (a 1056-token
    prompt pads to 1280, not 2048) for a few more graphs."""
    sizes, size = [], 16
    while size < top:
        sizes.append(size)
        size += size if size < 256 else (1 << (size.bit_length() - 1)) // 4
    return sizes


def _buckets(chosen, start, top, name, top_name) -> list[int]:
    if top < 1:
        raise ValueError(f"{top_name} must be positive, got {top}")
    if chosen is None:
        # Powers of two from `start` below `top`, then `top` itself: every size up to `top` has a bucket.
        chosen = []
        size = start
        while size < top:
            chosen.append(size)
            size *= 2
    sizes = sorted({int(size) for size in chosen} | {top})
    if sizes[0] < 1 or sizes[-1] > top:
        raise ValueError(f"{name}={chosen} must lie between 1 and {top_name}={top}")
    return sizes
