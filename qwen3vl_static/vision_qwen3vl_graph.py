"""The vision tower without host stalls: modules on the stock parameters (same checkpoint keys) and a runner.

- The patch embedding is a Conv3d whose stride equals its kernel, i.e. one matrix product of the flattened
  patches `(N, C*T*P*P)` with the flattened kernel.
- The stock sdpa vision attention splits the sequence per image with `lengths.tolist()`: a host sync in each
  of the 24 blocks. The runner's attention runs one image (one segment) as one SDPA call, and several segments as
  one call with a block-diagonal mask, built once per vision forward and shared by every block.
- `Qwen3VLGraphVisionModel` is the stock tower whose forward hands over to the model's `VisionRunner` once
  the model's engine attached one. The runner keeps each image size's position tables, and on CUDA
  replays the tower as a CUDA graph. A single image (one segment) runs at its exact patch count with no mask:
  one graph per image size, captured on first use, the `table_cache_size` most recent sizes kept. Several
  images or frames are padded to a patch-count bucket: padding patches form a segment of their own in the
  block-diagonal mask, so real patches never see them. (On an H200, a 448x448 image took 1.99 ms at its exact
  size against 2.32 ms padded to the 896 bucket with the mask.)
  Every caller of the tower (generate's pre-encoding on 5.2x, the stock forward, `get_image_features`) gets
  the fast path (with grad disabled; training, and calls recording attentions or hidden states, get the stock tower). `generate` also starts a call's images on the
  side stream as it begins (`encode_ahead`, calls without videos), so the tower runs while transformers prepares the
  inputs; the call's first encode takes that result.
- The runner's blocks fuse each residual add with the LayerNorm after it, q/k rotary in one kernel, and (CUDA) the
  MLP's GELU with its first projection, on the stock parameters.
"""

from collections import OrderedDict

import torch
import torch.nn.functional as F
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel, Qwen3VLVisionPatchEmbed

from .compat_qwen3vl_graph import vision_output, vision_tables
from .fp8_qwen3vl_graph import linear_weight
from .runner_qwen3vl_graph import GraphRunner, bucket_of


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


def block_diagonal_mask(cu_seqlens: torch.Tensor, length: int) -> torch.Tensor:
    """`(length, length)` booleans: patches attend within their own segment of `cu_seqlens`."""
    segment = torch.searchsorted(cu_seqlens, torch.arange(length, device=cu_seqlens.device), right=True)
    return segment[:, None] == segment[None, :]


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
    """Images or videos -> the tower's last hidden states, merged visual tokens and DeepStack features."""

    def __init__(
        self, visual, ops, patch_buckets, table_cache_size: int, capturer, use_graphs: bool, bucketed: bool,
    ):
        config = visual.config
        self.sdpa = config._attn_implementation == "sdpa"
        # As for prefill, padded to buckets or run at exact sizes. The padded mask needs the sdpa attention (other
        # implementations split by `cu_seqlens`, which padding would break).
        bucketed = bucketed and bool(patch_buckets) and self.sdpa
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
        self.buckets = patch_buckets
        self.bucketed = bucketed
        self.graphs = OrderedDict()  # (patches, masked) -> graph; single-image ones least recently used first
        self.tables = OrderedDict()  # (t, h, w) -> tables, least recently used first
        self.tables_weight = None  # (address, version) of the position embedding the tables were computed from
        self.table_cache_size = table_cache_size
        patches = patch_buckets[-1] if self.bucketed else 0
        head_dim = config.hidden_size // config.num_heads
        merged = patches // self.unit

        def buffer(*shape, dtype=self.dtype):
            return torch.zeros(*shape, dtype=dtype, device=device)

        self.pixels = buffer(patches, weight[0].numel())
        self.positions = buffer(patches, config.hidden_size)
        self.cos = buffer(patches, head_dim, dtype=torch.float32)
        self.sin = buffer(patches, head_dim, dtype=torch.float32)
        self.segments = buffer(patches, dtype=torch.long)
        self.hidden = buffer(patches, config.hidden_size)
        self.merged = buffer(merged, config.out_hidden_size)
        self.deepstack = buffer(len(self.deepstack_mergers), merged, config.out_hidden_size)
        self.ahead = None  # `encode_ahead`'s pending result

    def current(self) -> bool:
        """False once the tower's weights were replaced or moved (graphs hold their addresses)."""
        return self.patch_embed.proj.weight.data_ptr() == self.weight_address

    def table(self, grid: tuple):
        """Position embeddings, rotary cos/sin and frame index `(t*h*w,)` of one image size, computed once per
        value of the position embedding, without autograd state (a cached table outlives the call that made it)."""
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
        device = self.positions.device
        with torch.no_grad():
            positions, cos, sin = self.tables_of(torch.tensor([grid], device=device))
        t, h, w = grid
        frames = torch.arange(t, device=device).repeat_interleave(h * w)
        self.tables[grid] = entry = (positions, cos, sin, frames)
        if len(self.tables) > self.table_cache_size:
            self.tables.popitem(last=False)
        return entry

    def bucket(self, patches: int):
        return bucket_of(self.buckets, patches) if self.bucketed else None

    def shape(self, patches: int, segments: int):
        """(patches computed, masked) of a call: a single segment at its exact size without a mask, several
        padded to their bucket with the block-diagonal mask; None when the call runs eagerly at its exact size."""
        bucket = self.bucket(patches)
        if bucket is None:
            return None
        return (patches, False) if segments == 1 else (bucket, True)

    @torch.no_grad()  # the buffers and graphs outlive the call: no autograd state in them
    def encode(self, pixel_values, grid_thw):
        """`(last hidden states (patches, hidden), merged tokens (n, out_hidden), DeepStack features
        [(n, out_hidden)])` for all images of the call, in order; new tensors (the next call reuses the buffers)."""
        grids = [tuple(grid) for grid in grid_thw.tolist()]  # the one host read of a vision call
        patches = pixel_values.shape[0]
        ahead = self.join_ahead()
        if ahead is not None and ahead[:2] == (grids, tuple(pixel_values.shape)):
            return self.outputs(patches)
        if patches != sum(t * h * w for t, h, w in grids):
            raise ValueError(
                f"The pixel values hold {patches} patches but grid_thw {grids} describes "
                f"{sum(t * h * w for t, h, w in grids)}."
            )
        tables = [self.table(grid) for grid in grids]
        shape = self.shape(patches, sum(t for t, _, _ in grids))
        if shape is None:
            lengths = [h * w for t, h, w in grids for _ in range(t)]  # one attention segment per frame
            cu_seqlens = torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(pixel_values.device)
            positions, cos, sin, _ = (torch.cat(parts) for parts in zip(*tables))
            pixels = pixel_values.to(self.dtype)
            if not self.sdpa or (len(lengths) > 1 and patches > MAX_MASKED_LENGTH):
                return self.tower(pixels, positions, cos, sin, None, cu_seqlens)
            mask = block_diagonal_mask(cu_seqlens, patches) if len(lengths) > 1 else None
            return self.tower(pixels, positions, cos, sin, mask)
        self.load(pixel_values, grids, tables, shape)
        self.execute(shape)
        return self.outputs(patches)

    @torch.no_grad()
    def encode_ahead(self, pixel_values, grid_thw, videos: bool = False) -> None:
        """Start encoding a `generate` call's images on the side stream as the call begins, so that the tower runs
        while `generate` prepares its inputs: that is host work, with host reads that would wait for a tower queued
        on the default stream. The next `encode` takes the result when it gets the same grids and pixel shape (the
        call's images are encoded first, in every supported release), else it waits for it and encodes anew.
        Only the replay of an already captured graph runs ahead; anything else is left to `encode`.
        A call that also has `videos` does not run ahead: the tower cannot tell an image from a video, so a video of
        the same grid and pixel shape encoded first would take the images' features."""
        tensors = isinstance(pixel_values, torch.Tensor) and isinstance(grid_thw, torch.Tensor)
        if videos or not (
            self.use_graphs and tensors and pixel_values.device == self.pixels.device and grid_thw.shape[1:] == (3,)
        ):
            return
        grids = [tuple(grid) for grid in grid_thw.tolist()]  # the default stream is idle: no wait
        shape = self.shape(pixel_values.shape[0], sum(t for t, _, _ in grids))
        if shape not in self.graphs or pixel_values.shape[0] != sum(t * h * w for t, h, w in grids):
            return
        tables = [self.table(grid) for grid in grids]  # on the default stream: cached tables outlive this call
        stream = self.capturer.side_stream()
        stream.wait_stream(torch.cuda.current_stream())  # the pixels, and any graph still running on that stream
        with torch.cuda.stream(stream):
            self.load(pixel_values, grids, tables, shape)
            self.execute(shape)
            done = torch.cuda.Event()
            done.record()
        # The side stream reads tensors allocated on the default stream, which may be freed before it is done (a
        # table evicted by the lookups above, the caller's pixels): without this, the allocator could hand their
        # memory to the default stream's next kernels while `load` still copies from it.
        for tensor in (pixel_values, *(part for entry in tables for part in entry)):
            tensor.record_stream(stream)
        self.ahead = (grids, tuple(pixel_values.shape), done)  # one left untaken ran before it on the same stream

    def join_ahead(self):
        """The encoding run ahead, `(grids, pixel shape, event)`, or None; the current stream waits for it (its
        buffers are read or overwritten next). Clears it: it serves one `encode`."""
        ahead, self.ahead = self.ahead, None
        if ahead is not None:
            torch.cuda.current_stream().wait_event(ahead[2])
        return ahead

    def load(self, pixel_values, grids, tables, shape) -> None:
        """The call's pixels and position tables into the buffers of a `shape` step."""
        (size, masked), patches = shape, pixel_values.shape[0]
        start, segment = 0, 0
        for (t, _, _), (positions, cos, sin, frames) in zip(grids, tables):
            end = start + frames.shape[0]
            self.positions[start:end] = positions
            self.cos[start:end] = cos
            self.sin[start:end] = sin
            if masked:  # only the mask reads the segments (each launch here delays the graph's)
                self.segments[start:end] = frames + segment
            start, segment = end, segment + t
        if masked:
            self.segments[patches:size] = -1  # padding: a segment of its own
        self.pixels[:patches] = pixel_values

    def graph(self, key):
        graph = super().graph(key)
        # A graph dropped here may still be running, on either stream (a run ahead is joined on the GPU, not the host):
        # CUDA frees an in-flight executable graph once it completes, and its memory stays in the graphs' pool, which
        # ordinary allocations never get.
        if not key[1]:  # one graph per image size: keep the most recently used sizes
            self.graphs.move_to_end(key)
            singles = [other for other in self.graphs if not other[1]]
            for other in singles[: max(0, len(singles) - self.table_cache_size)]:
                del self.graphs[other]
        return graph

    def outputs(self, patches: int):
        merged = patches // self.unit
        return self.hidden[:patches].clone(), self.merged[:merged].clone(), [part[:merged].clone() for part in self.deepstack]

    def step(self, patches: int, masked: bool) -> None:
        """The tower over the first `patches` buffer rows; `masked`: several segments, or padding (else one image
        fills them all and attends to all of itself)."""
        mask = None
        if masked:
            segments = self.segments[:patches]
            # Additive, built once per call: SDPA would convert a boolean mask again in each of the blocks.
            same = segments[:, None] == segments[None, :]
            mask = torch.zeros(same.shape, dtype=self.dtype, device=same.device).masked_fill_(~same, float("-inf"))
        hidden, merged, deepstack = self.tower(
            self.pixels[:patches], self.positions[:patches], self.cos[:patches], self.sin[:patches], mask
        )
        rows = patches // self.unit
        self.hidden[:patches] = hidden
        self.merged[:rows] = merged
        for buffer, features in zip(self.deepstack, deepstack):
            buffer[:rows] = features

    def describe(self, key) -> str:
        patches, masked = key
        return f"vision ({patches} patches{'' if masked else ', one image'})"

    def tower(self, pixels, positions, cos, sin, mask, cu_seqlens=None):
        """The stock vision forward after its table lookups: patch embedding, blocks, DeepStack mergers, merger.
        Returns (last hidden states, merged tokens, DeepStack features). Attention follows `mask` (None: every patch
        sees every patch); `cu_seqlens` (the segments) is set where the stock attention runs instead (not sdpa, or
        too many patches for a mask). Each block is the stock block's math with its residual adds fused into the
        LayerNorm that follows (the next block's `norm1` for the second one). Linears run through the ops on their
        weights as `linear_weight` gives them (FP8 ones on their FP8 bytes)."""
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
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=attn.scaling)
                attn_out = linear(attn.proj, out[0].transpose(0, 1).reshape(x.shape[0], -1))
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

    def warmup_keys(self, patch_counts=None) -> list:
        """The (patches, masked) graphs for these patch counts, largest first: for each count, its exact size (one
        image) and its bucket (several images of that many patches in all). Without counts: every bucket (single
        images of sizes not known in advance get theirs on first use)."""
        if patch_counts is None:
            return sorted(((bucket, True) for bucket in self.buckets if self.bucketed), reverse=True)
        keys = {shape for patches in patch_counts for shape in (self.shape(patches, 1), self.shape(patches, 2)) if shape}
        return sorted(keys, reverse=True)
