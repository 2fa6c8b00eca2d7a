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
"""The vision tower without host stalls: modules on the stock parameters (same checkpoint keys) and a runner.

- The patch embedding is a Conv3d whose stride equals its kernel, i.e. one matrix product of the flattened
  patches `(N, C*T*P*P)` with the flattened kernel.
- The stock sdpa vision attention splits the sequence per image with `lengths.tolist()`: a host sync in each
  of the 24 blocks, and one SDPA call per image. The runner groups a call's segments (images, video frames) by
  size into chunks (`chunks_of`): the segments of a chunk have one length, so its attention is one batched SDPA
  call over `(segments, heads, length, head_dim)` views, with no mask and no padding.
- `Qwen3VLGraphVisionModel` is the stock tower whose forward hands over to the model's `VisionRunner` once
  the model's engine attached one. The runner keeps each image size's position tables, and on CUDA
  replays each chunk as a CUDA graph of its `(segments, length)`, captured on first use; the graphs of the
  `table_cache_size` most recently used lengths are kept. A size's segments beyond `vision_graph_patches` split
  evenly into several chunks; a chunk's results are copied back to its segments' places in the call.
  Every caller of the tower (generate's pre-encoding on 5.2x, the stock forward, `get_image_features`) gets
  the fast path (with grad disabled; training, and calls recording attentions or hidden states, get the stock
  tower). `generate` also starts a call's images on the side stream as it begins (`encode_ahead`, calls of one
  chunk without videos), so the tower runs while transformers prepares the inputs; the call's first encode takes
  that result.
- The runner's blocks fuse each residual add with the LayerNorm after it, q/k rotary in one kernel, and (CUDA) the
  MLP's GELU with its first projection, on the stock parameters.
"""

from collections import OrderedDict
from typing import NamedTuple

import torch
import torch.nn.functional as F
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel, Qwen3VLVisionPatchEmbed

from .compat_qwen3vl_graph import vision_output, vision_tables
from .fp8_qwen3vl_graph import linear_weight
from .runner_qwen3vl_graph import GraphRunner


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


class Segment(NamedTuple):
    """One attention segment of a vision call: an image, or one frame of a video."""
    start: int  # its first patch among the call's patches
    length: int  # its patches
    grid: int  # the index of its image or video in the call
    frame: int  # its frame in that video (0 for an image)


def segments_of(grids) -> list:
    """The call's segments, in patch order, for its `grids` `[(t, h, w)]`."""
    segments, start = [], 0
    for index, (t, h, w) in enumerate(grids):
        for frame in range(t):
            segments.append(Segment(start, h * w, index, frame))
            start += h * w
    return segments


def chunks_of(segments, limit) -> list:
    """The call's segments grouped by length (in order of first appearance, each group in patch order), and each group
    split evenly into chunks of at most `limit` patches (a segment longer than that alone); `limit` None: no split.
    A chunk runs as one tower call: segments of one length attend as one batched SDPA call, with no mask."""
    groups = {}
    for segment in segments:
        groups.setdefault(segment.length, []).append(segment)
    chunks = []
    for length, members in groups.items():
        most = max(1, limit // length) if limit else len(members)
        count = -(-len(members) // most)  # chunks
        size = -(-len(members) // count)  # segments per chunk, as even as the count allows
        chunks += [members[start : start + size] for start in range(0, len(members), size)]
    return chunks


def runs_of(chunk) -> list:
    """`(first patch in the call, first row in the chunk, patches)` of each run of the chunk's segments that lie next
    to each other among the call's patches: one copy each."""
    runs, row = [], 0
    for segment in chunk:
        if runs and runs[-1][0] + runs[-1][2] == segment.start:
            start, first, patches = runs[-1]
            runs[-1] = (start, first, patches + segment.length)
        else:
            runs.append((segment.start, row, segment.length))
        row += segment.length
    return runs


def cloned(outputs):
    """Copies of a tower's `(hidden, merged, deepstack)` (results in the buffers, which the next call reuses)."""
    hidden, merged, deepstack = outputs
    return hidden.clone(), merged.clone(), [part.clone() for part in deepstack]


class EncodedAhead(NamedTuple):
    """What `encode_ahead` queued: for the call's `grid_thw` tensor, its grids read on the host, the pixels' shape,
    and the event its tower run records."""

    grid_thw: torch.Tensor
    grids: list
    pixel_shape: tuple
    done: torch.cuda.Event


class Qwen3VLGraphVisionModel(Qwen3VLVisionModel):
    """The stock vision tower; with a `runner` attached and grad disabled, its forward runs on the runner (same
    outputs). With grad enabled (training) it is the stock forward: the runner's tables and buffers carry no autograd
    state, and its fused kernels have no backward."""

    def __init__(self, config) -> None:
        super().__init__(config)
        self.runner = None

    def tables(self, grid_thw: torch.Tensor):
        """The per-patch tables of the images of `grid_thw` `(n, 3)`: position embeddings, rotary cos and sin."""
        return vision_tables(self, grid_thw)

    def forward(self, hidden_states, grid_thw, **kwargs):
        runner = self.runner
        recording = kwargs.get("output_attentions") or kwargs.get("output_hidden_states")
        if runner is None or recording or torch.is_grad_enabled() or not runner.current():
            return super().forward(hidden_states, grid_thw, **kwargs)
        output = vision_output(*runner.encode(hidden_states, grid_thw))
        return output.to_tuple() if kwargs.get("return_dict") is False and hasattr(output, "to_tuple") else output


class VisionRunner(GraphRunner):
    """Images or videos -> the tower's last hidden states, merged visual tokens and DeepStack features.

    A call's segments (images, video frames) run in chunks of one segment length (`chunks_of`), a graph per
    `(segments, length)` key: no padding, no mask, and attention over each segment's own patches only."""

    def __init__(self, visual, ops, graph_patches: int, table_cache_size: int, capturer, use_graphs: bool,
                 bucketed: bool):
        config = visual.config
        self.sdpa = config._attn_implementation == "sdpa"
        # As for prefill, on the graphs' shapes (chunks of at most `graph_patches`, computed in the buffers) or
        # eagerly at the call's own. The chunks' batched attention needs sdpa (other implementations split the call
        # by `cu_seqlens` in each block).
        bucketed = bucketed and bool(graph_patches) and self.sdpa
        weight = visual.patch_embed.proj.weight
        super().__init__(capturer, use_graphs, can_use_graphs=bucketed and weight.is_cuda)
        # The tower's parts the runner computes with (the tower itself only hands calls over to the runner).
        self.patch_embed, self.blocks, self.merger = visual.patch_embed, visual.blocks, visual.merger
        self.deepstack_mergers = dict(zip(visual.deepstack_visual_indexes, visual.deepstack_merger_list))
        self.pos_embed = visual.pos_embed
        self.tables_of = visual.tables  # grid_thw -> (position embeddings, cos, sin)
        self.ops = ops
        device, self.dtype = weight.device, weight.dtype
        self.weight_address = weight.data_ptr()
        self.gelu_tanh = config.hidden_act == "gelu_pytorch_tanh"  # the MLP activation that has a fused form
        self.unit = config.spatial_merge_size**2  # patches per merged token
        self.limit = graph_patches if bucketed else None  # the chunks' patches at most
        self.graphs = OrderedDict()  # (segments, length) -> graph, least recently used length first
        self.tables = OrderedDict()  # (t, h, w) -> tables, least recently used first
        self.tables_weight = None  # (address, version) of the position embedding the tables were computed from
        self.table_cache_size = table_cache_size
        patches = self.limit or 0
        head_dim = config.hidden_size // config.num_heads
        merged = patches // self.unit

        def buffer(*shape, dtype=self.dtype):
            return torch.zeros(*shape, dtype=dtype, device=device)

        self.pixels = buffer(patches, weight[0].numel())
        self.positions = buffer(patches, config.hidden_size)
        self.cos = buffer(patches, head_dim, dtype=torch.float32)
        self.sin = buffer(patches, head_dim, dtype=torch.float32)
        self.hidden = buffer(patches, config.hidden_size)
        self.merged = buffer(merged, config.out_hidden_size)
        self.deepstack = buffer(len(self.deepstack_mergers), merged, config.out_hidden_size)
        self.ahead = None  # `encode_ahead`'s pending `EncodedAhead`

    def current(self) -> bool:
        """False once the tower's weights were replaced or moved (graphs hold their addresses)."""
        return self.patch_embed.proj.weight.data_ptr() == self.weight_address

    def table(self, grid: tuple):
        """Position embeddings and rotary cos/sin of one image size `(t*h*w, ...)`, computed once per value of the
        position embedding, without autograd state (a cached table outlives the call that made it)."""
        weight = self.pos_embed.weight
        # The version counter moves with every in-place update (an optimizer step, `load_state_dict`); inference
        # tensors have none, and cannot be updated outside inference mode.
        current = (weight.data_ptr(), None if weight.is_inference() else weight._version)
        if current != self.tables_weight:
            self.tables.clear()
            self.tables_weight = current
        if grid in self.tables:
            self.tables.move_to_end(grid)
            return self.tables[grid]
        with torch.no_grad():
            self.tables[grid] = entry = self.tables_of(torch.tensor([grid], device=self.positions.device))
        if len(self.tables) > self.table_cache_size:
            self.tables.popitem(last=False)
        return entry

    def chunks(self, grids) -> list:
        return chunks_of(segments_of(grids), self.limit)

    def key(self, chunk):
        """The graph key `(segments, length)` of a chunk in the buffers, or None where it runs eagerly at its own
        size (no buffers: not on the graphs' shapes, or one segment longer than `graph_patches`)."""
        length = chunk[0].length
        return (len(chunk), length) if self.limit is not None and len(chunk) * length <= self.limit else None

    def keys(self, grids) -> list:
        """The graph key (or None: eager) of each chunk a call of `grids` `[(t, h, w)]` runs as."""
        return [self.key(chunk) for chunk in self.chunks(grids)]

    @torch.no_grad()  # the buffers and graphs outlive the call: no autograd state in them
    def encode(self, pixel_values, grid_thw):
        """`(last hidden states (patches, hidden), merged tokens (n, out_hidden), DeepStack features
        [(n, out_hidden)])` for all images of the call, in order; new tensors (the next call reuses the buffers)."""
        ahead = self.ahead
        if ahead is not None and grid_thw is ahead.grid_thw:  # read already: a read now would wait for the tower
            grids = ahead.grids
        else:
            grids = [tuple(grid) for grid in grid_thw.tolist()]  # the one host read of a vision call
        patches = pixel_values.shape[0]
        if ahead is not None and (ahead.grids, ahead.pixel_shape) == (grids, tuple(pixel_values.shape)):
            torch.cuda.current_stream().wait_event(ahead.done)
            return cloned(self.outputs(patches))
        self.join_ahead()  # its buffers are overwritten next
        if patches != sum(t * h * w for t, h, w in grids):
            raise ValueError(
                f"The pixel values hold {patches} patches but grid_thw {grids} describes "
                f"{sum(t * h * w for t, h, w in grids)}."
            )
        tables = [self.table(grid) for grid in grids]
        if not self.sdpa:  # the stock attention, split by segment
            lengths = [h * w for t, h, w in grids for _ in range(t)]
            cu_seqlens = torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32)
            positions, cos, sin = (torch.cat(parts) for parts in zip(*tables))
            return self.tower(pixel_values.to(self.dtype), positions, cos, sin, cu_seqlens=cu_seqlens.to(cos.device))
        chunks = self.chunks(grids)
        if len(chunks) == 1:  # one image, or images and frames of one size: in order, nothing to gather
            outputs = self.run(pixel_values, tables, chunks[0])
            return outputs if self.key(chunks[0]) is None else cloned(outputs)
        unit = self.unit
        outputs = (self.hidden.new_empty(patches, self.hidden.shape[1]),
                   self.merged.new_empty(patches // unit, self.merged.shape[1]),
                   [self.merged.new_empty(patches // unit, self.merged.shape[1]) for _ in self.deepstack_mergers])
        for chunk in chunks:
            hidden, merged, deepstack = self.run(pixel_values, tables, chunk)
            for start, row, length in runs_of(chunk):
                outputs[0][start : start + length] = hidden[row : row + length]
                for output, result in zip((outputs[1], *outputs[2]), (merged, *deepstack)):
                    output[start // unit : (start + length) // unit] = result[row // unit : (row + length) // unit]
        return outputs

    def run(self, pixel_values, tables, chunk):
        """The tower over one chunk of the call's segments: in the buffers (a graph, or its step eagerly), or eagerly
        at the chunk's size. Returns views of the buffers, or new tensors."""
        key = self.key(chunk)
        if key is None:
            pixels, positions, cos, sin = (torch.cat(parts) for parts in self.parts(pixel_values, tables, chunk))
            return self.tower(pixels.to(self.dtype), positions, cos, sin, segments=len(chunk))
        self.load(pixel_values, tables, chunk)
        self.execute(key)
        return self.outputs(key[0] * key[1])

    def parts(self, pixel_values, tables, chunk):
        """A chunk's pixels, position embeddings, cos and sin, as lists of slices to join in chunk order."""
        pixels = [pixel_values[start : start + length] for start, _, length in runs_of(chunk)]
        rows = [(tables[segment.grid], slice(segment.frame * segment.length, (segment.frame + 1) * segment.length))
                for segment in chunk]
        return [pixels] + [[table[part][where] for table, where in rows] for part in range(3)]

    @torch.no_grad()
    def encode_ahead(self, pixel_values, grid_thw, videos: bool = False) -> None:
        """Start encoding a `generate` call's images on the side stream as the call begins, so that the tower runs
        while `generate` prepares its inputs: that is host work, with host reads that would wait for a tower queued
        on the default stream. Each `encode` of the call takes the result when it gets the same grids and pixel shape
        (the call's images: a prompt prefilled ahead, then 5.2x's `generate` itself, encode them), until one that does
        not waits for it and encodes anew, or `join_ahead` ends the call.
        Only a call that is one chunk, whose graph is already captured, runs ahead; anything else is left to `encode`.
        A call that also has `videos` does not run ahead: the tower cannot tell an image from a video, so a video of
        the same grid and pixel shape encoded first would take the images' features."""
        tensors = isinstance(pixel_values, torch.Tensor) and isinstance(grid_thw, torch.Tensor)
        if videos or not (
            self.use_graphs and tensors and pixel_values.device == self.pixels.device and grid_thw.shape[1:] == (3,)
        ):
            return
        grids = [tuple(grid) for grid in grid_thw.tolist()]  # the default stream is idle: no wait
        chunks = self.chunks(grids)
        if len(chunks) != 1 or self.key(chunks[0]) not in self.graphs or pixel_values.shape[0] != sum(
            t * h * w for t, h, w in grids
        ):
            return
        tables = [self.table(grid) for grid in grids]  # on the default stream: cached tables outlive this call
        stream = self.capturer.side_stream()
        stream.wait_stream(torch.cuda.current_stream())  # the pixels, and any graph still running on that stream
        with torch.cuda.stream(stream):
            self.load(pixel_values, tables, chunks[0])
            self.execute(self.key(chunks[0]))
            done = torch.cuda.Event()
            done.record()
        # The side stream reads tensors allocated on the default stream, which may be freed before it is done (a
        # table evicted by the lookups above, the caller's pixels): without this, the allocator could hand their
        # memory to the default stream's next kernels while `load` still copies from it.
        for tensor in (pixel_values, *(part for entry in tables for part in entry)):
            tensor.record_stream(stream)
        # One left untaken ran before it on the same stream.
        self.ahead = EncodedAhead(grid_thw, grids, tuple(pixel_values.shape), done)

    def join_ahead(self) -> None:
        """The current stream waits for the encoding run ahead, if any (its buffers are overwritten next), which then
        serves no later `encode`."""
        ahead, self.ahead = self.ahead, None
        if ahead is not None:
            torch.cuda.current_stream().wait_event(ahead.done)

    def load(self, pixel_values, tables, chunk) -> None:
        """A chunk's pixels and position tables into the buffers (one copy each)."""
        patches = len(chunk) * chunk[0].length
        buffers = (self.pixels, self.positions, self.cos, self.sin)
        for buffer, parts in zip(buffers, self.parts(pixel_values, tables, chunk)):
            torch.cat(parts, out=buffer[:patches])

    def graph(self, key):
        graph = super().graph(key)
        # A graph dropped here may still be running, on either stream (a run ahead is joined on the GPU, not the host):
        # CUDA frees an in-flight executable graph once it completes, and its memory stays in the graphs' pool, which
        # ordinary allocations never get.
        self.graphs.move_to_end(key)
        lengths = list(dict.fromkeys(length for _, length in reversed(self.graphs)))  # most recently used first
        for other in [other for other in self.graphs if other[1] in lengths[self.table_cache_size :]]:
            del self.graphs[other]
        return graph

    def outputs(self, patches: int):
        """The buffers' results for the first `patches` rows (views: the next call overwrites them)."""
        merged = patches // self.unit
        return self.hidden[:patches], self.merged[:merged], [part[:merged] for part in self.deepstack]

    def step(self, segments: int, length: int) -> None:
        """The tower over the first `segments * length` buffer rows: `segments` images or frames of `length` patches."""
        patches = segments * length
        hidden, merged, deepstack = self.tower(
            self.pixels[:patches], self.positions[:patches], self.cos[:patches], self.sin[:patches], segments=segments
        )
        rows = patches // self.unit
        self.hidden[:patches] = hidden
        self.merged[:rows] = merged
        for buffer, features in zip(self.deepstack, deepstack):
            buffer[:rows] = features

    def describe(self, key) -> str:
        segments, length = key
        return f"vision ({segments} x {length} patches)"

    def tower(self, pixels, positions, cos, sin, segments=1, cu_seqlens=None):
        """The stock vision forward after its table lookups: patch embedding, blocks, DeepStack mergers, merger.
        Returns (last hidden states, merged tokens, DeepStack features). Attention is within each of `segments`
        equal parts of the patches; `cu_seqlens` (the segments) is set where the stock attention runs instead (not
        sdpa). Each block is the stock block's math with its residual adds fused into the LayerNorm that follows
        (the next block's `norm1` for the second one). Linears run through the ops on their weights as
        `linear_weight` gives them (FP8 ones on their FP8 bytes)."""
        ops, blocks = self.ops, self.blocks

        def linear(module, x):
            return ops.linear(x, linear_weight(module), module.bias)

        def merge(merger, hidden):  # the stock patch merger's math
            x = merger.norm(hidden.view(-1, merger.hidden_size) if merger.use_postshuffle_norm else hidden)
            x = x.view(-1, merger.hidden_size)
            return linear(merger.linear_fc2, merger.act_fn(linear(merger.linear_fc1, x)))

        hidden = self.patch_embed(pixels) + positions
        x = blocks[0].norm1(hidden)
        deepstack = []
        for index, block in enumerate(blocks):
            attn, norm, mlp = block.attn, block.norm2, block.mlp
            if cu_seqlens is not None:
                attn_out = attn(x, cu_seqlens=cu_seqlens, position_embeddings=(cos, sin))
            else:  # q/k rotary in one kernel: the stock rotary is a dozen elementwise passes in float32 per block
                q, k, v = ops.vision_qkv_rope(linear(attn.qkv, x), attn.num_heads, cos, sin)
                # (1, H, N, D) -> (segments, H, N / segments, D): a batch of segments, views of the same memory
                q, k, v = (states[0].unflatten(1, (segments, -1)).transpose(0, 1) for states in (q, k, v))
                out = F.scaled_dot_product_attention(q, k, v, scale=attn.scaling)
                attn_out = linear(attn.proj, out.transpose(1, 2).reshape(x.shape[0], -1))
            hidden, x = ops.add_layer_norm(hidden, attn_out, norm.weight, norm.bias, norm.eps)
            if self.gelu_tanh:
                up = ops.linear_gelu_tanh(x, linear_weight(mlp.linear_fc1), mlp.linear_fc1.bias)
            else:
                up = mlp.act_fn(linear(mlp.linear_fc1, x))
            mlp_out = linear(mlp.linear_fc2, up)
            if index + 1 < len(blocks):
                norm = blocks[index + 1].norm1
                hidden, x = ops.add_layer_norm(hidden, mlp_out, norm.weight, norm.bias, norm.eps)
            else:
                hidden = hidden + mlp_out
            if index in self.deepstack_mergers:
                deepstack.append(merge(self.deepstack_mergers[index], hidden))
        return hidden, merge(self.merger, hidden), deepstack

    def warmup_keys(self, image_patches, images_per_call) -> list:
        """The graphs of calls of `images_per_call` images (each count; a batch's rows with one image each) of each
        of `image_patches` patches, largest first; none by default (images of sizes not known in advance get theirs
        on first use)."""
        keys = {key for patches in image_patches or () for count in images_per_call
                for key in self.keys([(1, 1, patches)] * count) if key}
        return sorted(keys, key=lambda key: (key[0] * key[1], key), reverse=True)
