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
"""The one place that knows how transformers releases differ for this package (4.57 and 5.17 - 5.24).

Everything else asks this module instead of testing versions:
- 5.x: the static cache advances its own write position (`cumulative_length`), `generate` computes the
  M-RoPE position ids before prefill, the vision tower returns a `BaseModelOutputWithDeepstackFeatures`;
  5.2x's `generate` runs the vision tower before prefill (`mm_encoder_outputs`); 5.24 renamed the cache
  keyword from `past_key_values` to `cache` (forward arguments, generate's model kwargs and its output).
- 4.57: writes go to an explicit `cache_position`, the cache's length is the count of non-zero slots, the
  model computes M-RoPE positions inside its forward (keeping `rope_deltas`), there is no `mm_token_type_ids`
  input, the vision tower builds its position tables with its own methods, and `AutoModelForVision2Seq` still
  exists.
"""

import dataclasses
import inspect

import torch
import transformers
from transformers.cache_utils import StaticLayer
from transformers.generation.utils import GenerateDecoderOnlyOutput
from transformers.models.qwen3_vl import modeling_qwen3_vl
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLForConditionalGeneration

_FORWARD_ARGS = inspect.signature(Qwen3VLForConditionalGeneration.forward).parameters

# Keyword under which generate() hands the KV cache to forward() and keeps it in its model kwargs.
CACHE_KWARG = "cache" if "cache" in _FORWARD_ARGS else "past_key_values"

# Whether the model takes the processor's modality ids (5.x) or finds images and videos by token id (4.57).
TAKES_MM_TOKEN_TYPE_IDS = "mm_token_type_ids" in _FORWARD_ARGS

# Whether the cache tracks its own write position (5.x) or is told one (`cache_position`, 4.57).
_CACHE_COUNTS_ITSELF = hasattr(StaticLayer(max_cache_len=1), "cumulative_length")

# Field of GenerateDecoderOnlyOutput that returns the cache.
_OUTPUT_CACHE_FIELD = "cache" if "cache" in {f.name for f in dataclasses.fields(GenerateDecoderOnlyOutput)} else "past_key_values"

# Auto classes the package registers with / names in `auto_map` (Vision2Seq for transformers <= 4.57 users).
AUTO_MODEL_FOR_VISION2SEQ = getattr(transformers, "AutoModelForVision2Seq", None)


def allocate_layer(layer, keys_and_values_shape: torch.Tensor) -> None:
    """The stock allocation of one static layer, from a zero-length tensor of the full (rows, heads, 0, dim) shape."""
    if _CACHE_COUNTS_ITSELF:
        layer.lazy_initialization(keys_and_values_shape, keys_and_values_shape)
    else:
        layer.lazy_initialization(keys_and_values_shape)


def share_length_counters(layers, device) -> torch.Tensor | None:
    """5.x: make every layer's write position a view of one tensor (the layers advance it in place), so a request
    rewinds or records all layers in one kernel rather than one per layer. None on 4.57 (no counters)."""
    if not _CACHE_COUNTS_ITSELF:
        return None
    counters = torch.zeros(len(layers), dtype=torch.long, device=device)
    for layer, counter in zip(layers, counters):
        layer.cumulative_length = counter
    return counters


def rewind_layers(counters) -> None:
    """Make the activated layers empty for a new request. (4.57 counts the filled length as the non-zero slots;
    `record_length` zeroes what lies past a request's end instead, so a request rejected before prefill writes
    nothing at all.)"""
    if counters is not None:
        counters.zero_()


def record_length(layers, counters, length: int) -> None:
    """Tell the layers that `length` slots are filled after a loop that wrote them directly."""
    if counters is not None:
        counters.fill_(length)
        return
    for layer in layers:  # 4.57: whatever lies past the end (an earlier request, prefill padding) reads as empty
        layer.keys[:, :, length:].zero_()
        layer.values[:, :, length:].zero_()


def prompt_positions(model, input_ids, model_kwargs, start: int = 0) -> torch.Tensor:
    """M-RoPE T/H/W positions `(3, B, S - start)` of the prompt's tokens from `start` on (the ones not in the cache),
    as the stock forward would use them."""
    position_ids = model_kwargs.get("position_ids")
    if position_ids is not None:  # 5.x: computed by generate, `(4, B, S)` with text first, or text only `(1, B, S)`
        # when continuing a cache (text positions plus the `rope_deltas` of the call that filled it)
        return (position_ids[1:] if position_ids.shape[0] == 4 else position_ids.expand(3, -1, -1))[..., start:]
    if start:  # 4.57 continuing a cache: plain token indices plus the stored per-row offset
        offsets = model.model.rope_deltas.view(1, -1, 1)
        return torch.arange(start, input_ids.shape[1], device=input_ids.device).view(1, 1, -1) + offsets.expand(3, -1, -1)
    # 4.57: the stock forward computes them in prefill and keeps the per-row offset for the decode steps.
    positions, model.model.rope_deltas = model.model.get_rope_index(
        input_ids, model_kwargs.get("image_grid_thw"), model_kwargs.get("video_grid_thw"), model_kwargs.get("attention_mask")
    )
    return positions


def generate_position_ids(model, input_ids, model_kwargs) -> torch.Tensor | None:
    """The position ids that `generate` computes before its loop for a fresh prompt with these inputs (5.x), or None
    (4.57: the prefill computes them, `prompt_positions`)."""
    if not hasattr(model, "_prepare_position_ids_for_generation"):
        return None
    return model._prepare_position_ids_for_generation(input_ids, dict(model_kwargs))


def first_decode_positions(model, model_kwargs, positions, prompt_len: int) -> torch.Tensor:
    """M-RoPE T/H/W positions `(3, B, 1)` of the first generated token, after the prompt's `positions`."""
    if model_kwargs.get("position_ids") is not None:  # 5.x: one past the prompt's last
        return positions[:, :, -1:] + 1
    # 4.57: the forward kept the per-row offset of the prompt's positions from plain token indices.
    rope_deltas = model.model.rope_deltas
    return (prompt_len + rope_deltas.view(1, -1, 1)).expand(3, -1, -1)


def vision_tables(visual, grid_thw: torch.Tensor):
    """The vision tower's per-patch tables for the images of `grid_thw` `(n, 3)`: the interpolated learned
    position embeddings (added after the patch embedding, in the tower's dtype) and the rotary cos/sin."""
    dtype = visual.patch_embed.proj.weight.dtype
    if hasattr(visual, "fast_pos_embed_interpolate"):  # 4.57
        rotary = visual.rot_pos_emb(grid_thw)
        rotary = torch.cat((rotary, rotary), dim=-1)
        return visual.fast_pos_embed_interpolate(grid_thw).to(dtype), rotary.cos(), rotary.sin()
    from transformers.vision_utils import get_vision_interpolation_indices_and_weights, get_vision_position_ids

    indices, weights = get_vision_interpolation_indices_and_weights(
        grid_thw, num_grid_per_side=visual.num_grid_per_side, mode=visual.interpolation_mode,
        align_corners=visual.interpolation_align_corners, spatial_merge_size=visual.config.spatial_merge_size,
    )
    positions = (visual.pos_embed(indices) * weights[:, :, None]).sum(1).to(dtype)
    cos, sin = visual.rotary_pos_emb(positions, get_vision_position_ids(grid_thw, visual.spatial_merge_size))
    return positions, cos, sin


def vision_output(hidden, merged, deepstack):
    """What the stock vision tower's forward returns: a `BaseModelOutputWithDeepstackFeatures` (5.x) or the
    tuple `(merged, deepstack)` (4.57)."""
    output_class = getattr(modeling_qwen3_vl, "BaseModelOutputWithDeepstackFeatures", None)
    if output_class is None:
        return merged, deepstack
    return output_class(last_hidden_state=hidden, pooler_output=merged, deepstack_features=deepstack)


def vision_features(output):
    """`(merged tokens, DeepStack features)` from what the vision tower or `get_*_features` returned: an output object
    (5.x) or a tuple (4.57)."""
    return (output.pooler_output, output.deepstack_features) if hasattr(output, "pooler_output") else output


def media_features(model, model_kwargs) -> list:
    """`(kind, token id, features (n, hidden), DeepStack features [(n, hidden)])` of the prompt's images, then its
    videos: generate's pre-encoded outputs (5.2x encodes before prefill) or the tower run on the pixels. The tower
    is called directly, not through `get_*_features`, whose per-image split reads the grid back after the tower
    ran: a host stall before the prefill could be queued (the features are joined again anyway)."""
    encoded = model_kwargs.get("mm_encoder_outputs") or {}
    media = []
    for kind, pixels, token in (
        ("image", "pixel_values", model.config.image_token_id),
        ("video", "pixel_values_videos", model.config.video_token_id),
    ):
        output = encoded.get(kind)
        if output is None and model_kwargs.get(pixels) is not None:
            output = model.model.visual(model_kwargs[pixels], grid_thw=model_kwargs[f"{kind}_grid_thw"])
        if output is None:
            continue
        features, deepstack = vision_features(output)  # pre-encoded on 5.2x: split per image, so joined again
        media.append((kind, token, _joined(features), [_joined(layer) for layer in deepstack]))
    return media


def _joined(parts) -> torch.Tensor:
    return torch.cat(parts) if isinstance(parts, (tuple, list)) else parts


def portable_config_dict(config_dict: dict) -> dict:
    """A saved config that the stock class of every supported release can read.

    4.57 names the vision sub-config's type "qwen3_vl", and its `from_pretrained` answers a top-level type it
    does not know by loading the sub-config of its own type, i.e. the vision config as the whole model's
    config. The vision sub-config is saved under 5.x's name for it, which both releases accept.
    """
    vision = config_dict.get("vision_config")
    if isinstance(vision, dict) and vision.get("model_type") == "qwen3_vl":
        config_dict["vision_config"] = {**vision, "model_type": "qwen3_vl_vision"}
    return config_dict


def generate_output(sequences, scores, logits, cache) -> GenerateDecoderOnlyOutput:
    """`GenerateDecoderOnlyOutput` as the installed transformers spells it."""
    return GenerateDecoderOnlyOutput(sequences=sequences, scores=scores, logits=logits, **{_OUTPUT_CACHE_FIELD: cache})


def returned_cache(output):
    """The cache that a dict output of `generate` returns, under the installed transformers' field name."""
    return getattr(output, _OUTPUT_CACHE_FIELD)
