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
"""GraphCapturer: how every CUDA graph of a model is captured (vision tower, prefill, decode step).

The graphs of one capturer share its memory pool, so a model pays for the largest graph's scratch memory once, not per
graph. That is safe because they are replayed one at a time (on one stream, or `generate`'s lock between calls) and
no graph keeps an output in pool memory: each step writes its results into its runner's own static buffers. The
decode step's graphs have one capturer, the prefill's and the vision tower's one each (the same side stream, another
pool and another capture stream, whose cuBLAS workspace their graphs bake in), as continuous batching replays them on
the side stream while the decode step's run.
"""

import time
import weakref
from contextlib import contextmanager
from functools import partial

import torch
from transformers.utils import logging

logger = logging.get_logger(__name__)


class GraphCapturer:
    def __init__(self, streams_of: "GraphCapturer | None" = None):
        self.pool = None
        self.pool_graphs = weakref.WeakSet()  # the graphs captured into `pool` that are still alive
        self.streams = {}  # one stream per role, made once: each new stream would get its own cuBLAS workspace
        self.streams_of = streams_of  # the capturer whose streams this one shares
        # The stream its graphs are captured on, its own: cuBLAS bakes the workspace of the capturing stream into a
        # graph, and two capturers' graphs may replay at once (the tower's beside the decode step's).
        self.capture_stream = None

    def capture(self, step, state=(), name: str = "graph") -> torch.cuda.CUDAGraph:
        """Capture `step()` (no arguments, static buffers only) after two warm-up runs on the side stream.

        Warm-up runs execute for real: the tensors in `state` (what `step` advances) and the CUDA RNG are
        restored afterwards, so capturing leaves no trace in a request.
        """
        began = time.perf_counter()
        with self.restoring(state):
            stream = self.side_stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):
                    step()
            torch.cuda.current_stream().wait_stream(stream)
            # PyTorch releases a pool once its graphs are all gone, and asserts on a capture into it.
            if not self.pool_graphs:
                self.pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            # Thread-local: CUDA work of the process's other threads (a caller preparing its next request while
            # continuous batching captures) neither breaks the capture nor lands in the graph.
            if self.capture_stream is None:
                self.capture_stream = torch.cuda.Stream()
            with torch.cuda.graph(graph, pool=self.pool, stream=self.capture_stream,
                                  capture_error_mode="thread_local"):  # records; runs nothing
                step()
        self.pool_graphs.add(graph)
        seconds = time.perf_counter() - began
        message = f"Captured the {name} graph in {seconds:.2f} s"
        if seconds > 1:  # the first capture compiles the Triton kernels (Triton caches them on disk)
            logger.warning(f"{message}, kernel compilation included; model.warmup() does this ahead of requests.")
        else:
            logger.info(message)
        return graph

    def side_stream(self) -> torch.cuda.Stream:
        """The model's one stream beside the default one: captures warm up on it, and the vision tower runs ahead on
        it (`VisionRunner.encode_ahead`)."""
        return self._stream("side")

    def tower_stream(self) -> torch.cuda.Stream:
        """A second stream beside the default one: continuous batching runs the vision tower on it, so that its
        prefills on the side stream wait only for the features they take."""
        return self._stream("tower")

    def _stream(self, role: str) -> torch.cuda.Stream:
        """The model's stream for `role`, made once, shared with `streams_of`."""
        if self.streams_of is not None:
            return self.streams_of._stream(role)
        if role not in self.streams:
            self.streams[role] = torch.cuda.Stream()
        return self.streams[role]

    @staticmethod
    @contextmanager
    def restoring(state=()):
        """Steps run inside leave no trace in a request: the tensors in `state` (what they advance) and the CUDA RNG
        are restored on the way out."""
        saved = [tensor.clone() for tensor in state]
        rng = torch.cuda.get_rng_state()
        try:
            yield
        finally:
            for tensor, value in zip(state, saved):
                tensor.copy_(value)
            torch.cuda.set_rng_state(rng)

    def precompile(self, ops, steps) -> None:
        """Compile the Triton kernels of the graphs about to be captured, all at once (`ops.precompile`): `steps` are
        their (step, state) pairs, each run once with its state restored."""

        def run(step, state):
            with self.restoring(state):
                step()

        ops.precompile([partial(run, step, state) for step, state in steps])
