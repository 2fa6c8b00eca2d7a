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
"""GraphEngine: everything the fast path of one model holds, for its weights' device and dtype.

It owns the persistent KV cache, the op sets (fused Triton kernels or their torch references) with their own kernel
tuner (measured choices are per engine: two models in one process never share them), the graph capturers (one side
stream; a memory pool each for the decode step's, the prefill's and the tower's graphs) and the three runners, each
given the weights and modules it computes with. The model builds an engine on first use and again once its weights move or are replaced (`current`).
"""

import time

import torch
from transformers.utils import logging
from transformers.utils.logging import tqdm

from .cache_qwen3vl_graph import ASStaticCache
from .capture_qwen3vl_graph import GraphCapturer
from .decode_qwen3vl_graph import DecodeRunner
from .decoder_qwen3vl_graph import TextWeights
from .ops_qwen3vl_graph import TritonOps, make_ops
from .prefill_qwen3vl_graph import PrefillRunner
from .speculative_qwen3vl_graph import SpeculativeRunner
from .tuner_qwen3vl_graph import KernelTuner
from .vision_qwen3vl_graph import VisionRunner

logger = logging.get_logger(__name__)


class GraphEngine:
    def __init__(self, model, bucketed: bool | None = None):
        """`bucketed`: pad prompts and images to the graphs' buckets (default: on CUDA, with or without graphs, so the
        eager path computes on the graphs' shapes and the two give the same numbers; the CPU tests ask for it to
        check those shapes against stock)."""
        config = model.config
        weight = model.model.language_model.embed_tokens.weight
        self.device, self.dtype = weight.device, weight.dtype
        kv_dtype = config.kv_dtype(self.dtype)
        self.tuner = KernelTuner()
        self.ops = make_ops(self.device, self.dtype, config.use_triton_kernels, self.tuner)
        if kv_dtype == torch.float8_e4m3fn and isinstance(self.ops, TritonOps) and not self.ops.fp8_kernels:
            raise ValueError(f"kv_cache_dtype={config.kv_cache_dtype!r} needs a GPU whose Triton computes with float8 "
                             f"e4m3 (compute capability 8.9 or later: Ada, Hopper); this one is "
                             f"{torch.cuda.get_device_name(self.device)}. Use kv_cache_dtype='auto', or "
                             "use_triton_kernels=False for the torch ops.")
        self.cache = ASStaticCache(config, config.max_batch_size, config.static_cache_len, self.device, kv_dtype)
        self.capturer = GraphCapturer()
        graphs = config.use_cuda_graphs
        bucketed = self.device.type == "cuda" if bucketed is None else bucketed
        self.text = TextWeights(model.model.language_model, model.lm_head)
        rotary = self.ops.rotary_components(self.text.rotary_emb, self.device)
        self.decode = DecodeRunner(self.text, self.cache, self.ops, rotary, config.batch_buckets(),
                                   config.cache_buckets(), config.steps_per_sync, self.capturer, graphs)
        visual = model.model.visual
        # The prefill's graphs and kernel counters of their own too: continuous batching runs prefills beside the
        # decode step's (two graphs of one pool, or kernels of one set of counters, must not run at once).
        self.prefill = PrefillRunner(
            self.text, self.cache, make_ops(self.device, self.dtype, config.use_triton_kernels, self.tuner),
            len(visual.deepstack_visual_indexes), config.batch_buckets(), config.prompt_buckets(),
            config.cache_buckets(), config.prefill_graph_tokens, GraphCapturer(streams_of=self.capturer), graphs,
            bucketed,
        )
        vision_weight = visual.patch_embed.proj.weight
        vision_ops = make_ops(vision_weight.device, vision_weight.dtype, config.use_triton_kernels, self.tuner)
        # The tower's graphs in a pool of their own: continuous batching replays them beside the decode step's.
        self.vision = VisionRunner(visual, vision_ops, config.vision_graph_patches, config.vision_table_cache_size,
                                   GraphCapturer(streams_of=self.capturer), graphs, bucketed)
        visual.runner = self.vision  # every caller of the tower gets the runner
        self.speculative = None  # `use_draft`'s

    @property
    def runners(self) -> tuple:
        return self.decode, self.prefill, self.vision

    def use_draft(self, draft, num_draft_tokens: int) -> SpeculativeRunner:
        """The speculative loop with `draft` proposing `num_draft_tokens` tokens a cycle (built on first use); from
        then on prefills keep the outputs of the layers the draft reads."""
        runner = self.speculative
        if runner is None or runner.draft is not draft or runner.k != num_draft_tokens:
            self.prefill.record_layers(draft.layer_ids)
            self.speculative = runner = SpeculativeRunner(self.decode, draft, num_draft_tokens)
        return runner

    def current(self, model) -> bool:
        """Whether the engine still matches the model's weights (device, dtype, the very tensors)."""
        weight = model.model.language_model.embed_tokens.weight
        return ((weight.device, weight.dtype) == (self.device, self.dtype) and self.text.current(model.model.language_model, model.lm_head)
                and self.vision.current())

    def set_graphs(self, enabled: bool) -> None:
        for runner in (*self.runners, self.speculative):
            if runner is not None:
                runner.use_graphs = enabled and runner.can_use_graphs

    def warmup(self, batch_sizes, cache_lengths, modes, prompt_lengths, image_patches) -> dict:
        """Capture the graphs of these sizes (None: every configured bucket) that are not captured yet; returns the
        seconds spent compiling the kernels ahead, settling near-tied kernel choices and capturing, and the graph
        count. Nothing happens where graphs are not used. The warm-up steps write K/V into the cache's rows, so a
        conversation the cache held is dropped (`ASStaticCache.clear`): a turn passing it back starts afresh."""
        decode, prefill, vision = self.runners
        batch_sizes = batch_sizes or decode.batch_buckets
        pending = [(decode, key) for key in decode.warmup_keys(batch_sizes, cache_lengths or decode.cache_buckets, modes)]
        pending += [(prefill, key) for key in prefill.warmup_keys(batch_sizes, prompt_lengths or prefill.token_buckets)]
        pending += [(vision, key) for key in vision.warmup_keys(image_patches, sorted({1, *batch_sizes}))]
        pending = [(runner, key) for runner, key in pending if runner.use_graphs and key not in runner.graphs]
        if not decode.use_graphs:
            return {}
        if pending and self.cache.filled():
            logger.warning_once("warmup() runs its steps on the cache's rows: what the cache holds is dropped, and a "
                                "turn passing that cache back is prefilled from the start.")
        try:
            return self._capture(pending)
        finally:
            if pending:
                self.cache.clear()

    def _capture(self, pending) -> dict:
        """`warmup`'s work on the `(runner, key)` graphs it found missing."""
        decode, prefill, _ = self.runners
        decode.idle()
        prefill.idle()
        began = time.perf_counter()
        # Every kernel these graphs launch, compiled at once on a thread pool rather than one by one as captures
        # first meet them.
        self.capturer.precompile(self.ops, [runner.graph_step(key) for runner, key in pending])
        compiled = time.perf_counter()
        # Near-tied measured choices are settled in the whole step, before a batch size's graphs bake them in. One
        # choice serves every KV length, so each batch size settles at the middle of its KV buckets (at 256 slots
        # an H200 picked a QKV form 0.066 ms/step slower at 1024).
        decode_keys = sorted(key for runner, key in pending if runner is decode)
        for rows in dict.fromkeys(key[0] for key in decode_keys):
            keys = [key for key in decode_keys if key[0] == rows]
            decode.settle_near_ties(*keys[len(keys) // 2])
        settled = time.perf_counter()
        for runner, key in tqdm(pending, desc="Capturing CUDA graphs"):
            runner.capture(key)
        torch.cuda.synchronize()
        done = time.perf_counter()
        logger.info(f"Compiled ahead the kernels of {len(pending)} CUDA graphs in {compiled - began:.2f} s (one "
                    f"eager run of each step included; Triton caches the kernels on disk for later processes), "
                    f"settled near-tied kernel choices in the whole step in {settled - compiled:.2f} s and "
                    f"captured the graphs in {done - settled:.2f} s")
        return {"compile": compiled - began, "settle": settled - compiled, "capture": done - settled,
                "graphs": len(pending)}
