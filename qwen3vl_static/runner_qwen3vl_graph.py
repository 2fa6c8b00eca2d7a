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
"""GraphRunner: what the decode, prefill and vision runners share.

A runner computes one kind of step on static buffers. Each step shape it supports is a key (a tuple of bucketed
sizes and flags); `execute(key)` replays that key's CUDA graph, capturing it on first use, or runs the same step eagerly
when graphs are off, on the same padded shapes, so the two give the same numbers. Subclasses define `step(*key)`,
`describe(key)`, `state()` (the tensors a step advances, restored after warm-up runs) and `warmup_keys(...)`.
"""

import bisect

import torch


def to_device(tensor: torch.Tensor, device) -> torch.Tensor:
    """`tensor` on `device` without waiting for the device's queued work (through pinned memory: a copy from pageable
    memory waits for the stream); a tensor already on a CUDA device as is."""
    if torch.device(device).type != "cuda":
        return tensor.to(device)
    if tensor.is_cuda:
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)


def copy_to_host(*tensors):
    """A handle for `collected`: copies of `tensors` on the host, queued without waiting (pinned memory, an event) on a
    GPU; plain copies elsewhere. The copies are queued before later work overwrites the sources."""
    if not tensors[0].is_cuda:
        return *(tensor.clone() for tensor in tensors), None
    host = [torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True) for tensor in tensors]
    for target, source in zip(host, tensors):
        target.copy_(source, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()
    return *host, copied


def collected(handle):
    """Wait for a `copy_to_host` handle; the host copies."""
    *tensors, copied = handle
    if copied is not None:
        copied.synchronize()
    return tensors


def bucket_of(buckets: list[int], size: int) -> int | None:
    """The smallest of the sorted `buckets` that holds `size`, or None when none does."""
    index = bisect.bisect_left(buckets, size)
    return buckets[index] if index < len(buckets) else None


class GraphRunner:
    def __init__(self, capturer, use_graphs: bool, can_use_graphs: bool):
        self.capturer = capturer  # the model's one GraphCapturer: one memory pool, one side stream
        self.can_use_graphs = can_use_graphs
        self.use_graphs = use_graphs and can_use_graphs
        self.graphs = {}

    def step(self, *key) -> None:
        raise NotImplementedError

    def describe(self, key) -> str:
        """The graph's name in capture logs."""
        raise NotImplementedError

    def state(self) -> tuple:
        """The request state a step advances: none unless a subclass says so (it writes its outputs only)."""
        return ()

    def graph_step(self, key):
        """The step a graph of `key` captures, and the state its runs advance (which the capturer restores)."""
        return (lambda: self.step(*key)), self.state()

    def graph(self, key):
        """The captured graph of `key`, captured now if it is new."""
        return self.graphs.get(key) or self.capture(key)

    def capture(self, key):
        graph = self.capturer.capture(*self.graph_step(key), name=self.describe(key))
        self.graphs[key] = graph
        return graph

    def execute(self, key, times: int = 1) -> None:
        """The step of `key`, `times` times in a row: graph replays, or eager steps when graphs are off."""
        if self.use_graphs:
            graph = self.graph(key)
            for _ in range(times):
                graph.replay()
        else:
            for _ in range(times):
                self.step(*key)
