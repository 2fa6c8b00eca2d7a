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
"""Prefill ahead: a fresh prompt's prefill queued as `generate` begins, before transformers prepares its loop.

transformers' `generate` prepares the loop on the host (generation-config copies, signature checks, logits
processors, the M-RoPE index): on an H200 host that outlasts the vision tower, which the model queues first
(`VisionRunner.encode_ahead`), and the GPU would idle until the loop queued the prefill. For a call whose own
arguments show that it takes the static loop on a fresh prompt (`prefill_ahead`), the model queues the prompt's
prefill right after the tower instead, from the very tensors the loop then gets, and the loop takes its logits
(`PrefilledAhead.serves`). The prefill writes only slots the call would write anyway; a call that never reaches the
loop after all (transformers rejects a setting, ...) empties the cache, so no later turn reads what it wrote.

On a GPU the tower and the prefill are queued on the model's side stream: transformers' preparation reads values back
to the host (and creating a tensor from host values waits for the stream too), which on the default stream would
wait for them. The loop's stream waits for the prefill when it takes the logits (`PrefilledAhead.join`).
"""

from typing import NamedTuple

import torch

from .compat_qwen3vl_graph import generate_position_ids

# A call prefills ahead only when every argument it passes is one of these: the prompt's tensors, and settings that
# change neither which loop runs nor what the prefill computes. Anything else (a cache, beams, several sequences per
# prompt, videos, `max_length`, ...) leaves the prefill to the loop.
_PROMPT_TENSORS = ("attention_mask", "pixel_values", "image_grid_thw", "mm_token_type_ids")
_AHEAD_ARGUMENTS = frozenset((
    "input_ids", *_PROMPT_TENSORS, "generation_config", "max_new_tokens", "do_sample", "temperature", "top_k",
    "top_p", "min_p", "repetition_penalty", "eos_token_id", "pad_token_id", "logits_processor", "stopping_criteria",
    "streamer", "return_dict_in_generate", "output_scores", "output_logits",
))


class PrefilledAhead(NamedTuple):
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    logits: torch.Tensor  # float32 logits of the last position
    positions: torch.Tensor  # the prompt's M-RoPE positions
    done: torch.cuda.Event | None  # recorded after the prefill on the model's side stream (None: the CPU's one stream)

    def serves(self, input_ids, model_kwargs, start: int) -> bool:
        """Whether the loop's prompt is the one prefilled: the very tensors `generate` was given, nothing cached. (5.24
        drops a mask of ones before the loop, after reading it: this read waits for nothing more.)"""
        mask = model_kwargs.get("attention_mask")
        return start == 0 and input_ids is self.input_ids and (
            mask is self.attention_mask or (mask is None and bool((self.attention_mask == 1).all()))
        )

    def join(self) -> tuple:
        """`(logits, positions)`, once the current stream waits for the prefill. (Until then this holds the tensors
        the prefill reads: nothing frees them before it is done.)"""
        if self.done is not None:
            stream = torch.cuda.current_stream()
            stream.wait_event(self.done)
            self.logits.record_stream(stream)  # allocated on the side stream, read on this one
        return self.logits, self.positions


def prefill_ahead(model, args, kwargs) -> PrefilledAhead | None:
    """Queue the prefill of a `generate(*args, **kwargs)` call that will take the static loop on a fresh prompt, after
    `_check_generate_inputs` and before transformers' own preparation; None (nothing queued) for any other call."""
    input_ids = args[0] if args else kwargs.get("input_ids")
    attention_mask = kwargs.get("attention_mask")
    engine = model._engine
    if not (
        model._admission is None and len(args) <= 1 and (not args or "input_ids" not in kwargs)
        and _AHEAD_ARGUMENTS.issuperset(kwargs) and isinstance(attention_mask, torch.Tensor)
        and isinstance(input_ids, torch.Tensor) and input_ids.dim() == 2 and input_ids.device == engine.device
    ):
        return None
    config = kwargs.get("generation_config") or model.generation_config
    if model._static_loop_blocker(config, kwargs, config.get_generation_mode()) is not None:
        return None
    new_tokens = kwargs.get("max_new_tokens", config.max_new_tokens)
    batch, length = input_ids.shape
    cache = engine.cache
    if (config.num_return_sequences or 1) != 1 or not isinstance(new_tokens, int) or new_tokens < 1 or (
        batch > cache.rows or length + new_tokens - 1 > cache.capacity  # the loop's own capacity error, unwritten
    ):
        return None
    if input_ids.is_cuda and kwargs.get("pixel_values") is not None and engine.vision.ahead is None:
        # The tower did not run ahead: on the side stream it would compute (and keep) its tables, whose memory would
        # then belong to that stream's pool while the default stream reads them later.
        return None
    prompt = {key: kwargs[key] for key in _PROMPT_TENSORS if kwargs.get(key) is not None}
    stream = engine.capturer.side_stream() if input_ids.is_cuda else None
    try:
        with torch.no_grad():
            position_ids = generate_position_ids(model, input_ids, prompt)
            if position_ids is not None:
                prompt["position_ids"] = position_ids
            logits, positions = model._prefill_prompt(input_ids, prompt, 0, stream=stream)
    except BaseException:
        if stream is not None:
            torch.cuda.current_stream().wait_stream(stream)
        cache.clear()  # whatever the slots held is overwritten in part
        raise
    done = None
    if stream is not None:
        done = torch.cuda.Event()
        done.record(stream)
    return PrefilledAhead(input_ids, attention_mask, logits, positions, done)
