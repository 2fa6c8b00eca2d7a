"""Where a prefill's time goes, kernel by kernel, and how near it comes to the compute floor, the vision tower's too
(GPU; JSON to $OUT).

The continuous batch prefills its prompts as graph pieces of at most `prefill_graph_tokens` (2,048) tokens, and its
prefill GPU time is ~2.5x the floor of its FLOPs (docs/design.md, the 2,048-request table). Here a fresh text prompt
batch of ROWS x TOKENS (default 8 x 256, the benchmark's piece, and 16 x 256, 32 x 256: a larger graph budget) runs
as a CUDA graph of the prefill's forward on the bf16 2B: its replay timed (median of 10), then one replay under
torch.profiler with each kernel grouped into a kind by its name (matmuls, attention, the fused QK-norm/RoPE/write,
norms and SwiGLU, other). Per shape: ms, µs a token, the matmuls' TFLOPS (their FLOPs from the weights' shapes: 2 per
weight per token), and the floor at the device's dense bf16 peak (`--peak-tflops`, 989 for H100/H200 SXM).
The same for the vision tower over N 448x448 images in one call (`--images`, default 1 4 8: a server's tower calls
group 4, `MEDIA_AHEAD_GROUP`), the vision runner's own graph replayed: ms, ms an image, and its floor (the tower's
FLOPs an image as `batching_floor_probe.py` counts them: projections, attention over each image's patches, mergers).

Run: python bench/probes/prefill_kernels_probe.py [--shapes 8x256 16x256 32x256] [--images 1 4 8] [--peak-tflops 989].
`--check` runs the forwards eagerly on the CPU's tiny model (shapes and calls only, no timing).
"""

import argparse
import json
import statistics
from collections import defaultdict

import torch

import harness
from batching_floor_probe import model_counts

# Kinds of kernel, by name: the first whose words the name holds (lower case).
KINDS = {
    "attention": ("flash", "fmha", "attention", "attn"),
    "QK-norm, RoPE, K/V write": ("qk_norm_rope_write",),
    "matmuls": ("nvjet", "gemm", "cutlass", "sm90_xmma", "splitk", "matmul"),
    "vision q/k RoPE": ("vision_qkv_rope",),
    "norms, SwiGLU": ("rms_norm", "layer_norm", "silu", "swiglu"),
}


class PromptForward:
    """The prefill forward of `rows` fresh text prompts of `tokens` tokens each (cache rows 0..rows-1) on `model`'s
    engine, on static tensors as a prefill graph's buffers hold them."""

    def __init__(self, model, rows: int, tokens: int, generator):
        engine = model.graph_engine()
        self.prefill, text, device = engine.prefill, engine.text, engine.device
        self.ids = torch.randint(0, text.embed.shape[0], (rows, tokens), generator=generator).to(device)
        self.positions = torch.arange(tokens, device=device).expand(3, rows, tokens).contiguous()
        self.modality = torch.zeros_like(self.ids)
        self.visual = torch.zeros(1, text.embed.shape[1], device=device, dtype=engine.dtype)
        self.deepstack = [self.visual] * len(model.config.vision_config.deepstack_visual_indexes)
        self.attendable = torch.ones(rows, tokens, dtype=torch.bool, device=device)
        self.start = torch.zeros(1, dtype=torch.long, device=device)
        self.last = torch.full((1,), tokens - 1, dtype=torch.long, device=device)
        self.rows = torch.arange(rows, device=device)
        self.logits = None

    def __call__(self):
        self.logits = self.prefill.forward(self.ids, self.positions, self.attendable, self.modality, self.visual,
                                           self.deepstack, self.start, self.last, self.rows, False)


class TowerForward:
    """The vision tower over `images` 448x448 images in one call, on `model`'s vision runner (a graph of its own on
    CUDA, captured by the first call)."""

    def __init__(self, model, images: int, generator):
        from qwen3vl_static.workloads import image_prompt

        engine = model.graph_engine()
        self.vision = engine.vision
        prompt = image_prompt(model.config, engine.device, generator, batch=images)
        self.pixels = prompt["pixel_values"].to(engine.dtype)
        self.grids = prompt["image_grid_thw"]
        self.merged = None

    def __call__(self):
        self.merged = self.vision.encode(self.pixels, self.grids)[1]

    def graph(self):
        (key,) = self.vision.keys(self.grids.tolist())
        return self.vision.graphs[key]


def linear_flops_per_token(model) -> int:
    """2 FLOPs per weight of the decoder layers' projections, per prompt token (the lm_head runs on the last only)."""
    text = model.config.text_config
    heads, kv_heads, head_dim = text.num_attention_heads, text.num_key_value_heads, text.head_dim
    per_layer = (text.hidden_size * (heads + 2 * kv_heads) * head_dim + heads * head_dim * text.hidden_size
                 + 3 * text.hidden_size * text.intermediate_size)
    return 2 * per_layer * text.num_hidden_layers


def kind(name: str) -> str:
    lowered = name.lower()
    return next((label for label, words in KINDS.items() if any(word in lowered for word in words)), "other")


def profiled_kinds(graph) -> tuple:
    """One replay of `graph` under torch.profiler: (µs of kernel time per kind, the 12 longest kernel groups)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        graph.replay()
        torch.cuda.synchronize()
    kinds, groups = defaultdict(float), defaultdict(lambda: [0, 0.0])
    for event in harness.trace_events(profile):
        if event.get("cat") == "kernel":
            kinds[kind(event["name"])] += event["dur"]
            group = groups[(event["name"][:70], str(event["args"].get("grid")))]
            group[0] += 1
            group[1] += event["dur"]
    longest = sorted(groups.items(), key=lambda item: -item[1][1])[:12]
    return dict(kinds), [{"kernel": name, "grid": grid, "count": count, "us": us} for (name, grid), (count, us) in longest]


def measure(args) -> None:
    from qwen3vl_static.workloads import build_ours

    harness.require_cuda()
    shapes = [tuple(int(part) for part in shape.split("x")) for shape in args.shapes]
    most_tokens = max(rows * tokens for rows, tokens in shapes)
    model = build_ours(torch.device("cuda"), torch.bfloat16, max_batch_size=max(rows for rows, _ in shapes),
                       static_cache_len=max(512, max(tokens for _, tokens in shapes)), prefill_graph_tokens=most_tokens)
    flops_per_token = linear_flops_per_token(model)
    results = []
    with torch.no_grad():
        for rows, tokens in shapes:
            forward = PromptForward(model, rows, tokens, torch.Generator().manual_seed(rows))
            graph = harness.capture(forward)
            replays = [harness.replay_us(graph) for _ in range(args.repeats)]
            kinds, longest = profiled_kinds(graph)
            total = rows * tokens
            ms = statistics.median(replays) / 1000
            matmul_ms = kinds.get("matmuls", 0.0) / 1000
            row = {"rows": rows, "tokens": tokens, "ms": ms, "ms_range": [min(replays) / 1000, max(replays) / 1000],
                   "us_per_token": 1000 * ms / total,
                   "floor_ms": total * flops_per_token / (args.peak_tflops * 1e9),
                   "kernel_ms_by_kind": {name: us / 1000 for name, us in sorted(kinds.items(), key=lambda kv: -kv[1])},
                   "matmul_tflops": total * flops_per_token / (matmul_ms * 1e9) if matmul_ms else None,
                   "longest_kernels": longest}
            row["of_floor"] = row["floor_ms"] / ms
            print(json.dumps({key: row[key] for key in row if key != "longest_kernels"}), flush=True)
            results.append(row)
            del graph, forward
            torch.cuda.empty_cache()
        tower_flops = model_counts(model.config)["tower_flops_per_image"]
        tower = []
        for images in args.images:
            forward = TowerForward(model, images, torch.Generator().manual_seed(images))
            forward()  # captures the tower's graph for this many images
            graph = forward.graph()
            replays = [harness.replay_us(graph) for _ in range(args.repeats)]
            kinds, longest = profiled_kinds(graph)
            ms = statistics.median(replays) / 1000
            row = {"images": images, "ms": ms, "ms_range": [min(replays) / 1000, max(replays) / 1000],
                   "ms_per_image": ms / images, "floor_ms": images * tower_flops / (args.peak_tflops * 1e9),
                   "kernel_ms_by_kind": {name: us / 1000 for name, us in sorted(kinds.items(), key=lambda kv: -kv[1])},
                   "longest_kernels": longest}
            row["of_floor"] = row["floor_ms"] / ms
            print(json.dumps({key: row[key] for key in row if key != "longest_kernels"}), flush=True)
            tower.append(row)
    harness.write_json({"rows": results, "tower": tower, "peak_tflops": args.peak_tflops,
                        "linear_gflop_per_token": flops_per_token / 1e9,
                        "tower_gflop_per_image": tower_flops / 1e9})


def check() -> None:
    from qwen3vl_static import Qwen3VLGraphForConditionalGeneration
    from qwen3vl_static.presets import tiny_config

    torch.manual_seed(0)
    model = Qwen3VLGraphForConditionalGeneration(tiny_config(static_cache_len=64, max_batch_size=4)).eval()
    with torch.no_grad():
        forward = PromptForward(model, rows=3, tokens=16, generator=torch.Generator().manual_seed(1))
        forward()
        tower = TowerForward(model, images=2, generator=torch.Generator().manual_seed(2))
        tower()
    vocab = model.config.text_config.vocab_size
    assert tuple(forward.logits.shape) == (3, vocab) and forward.logits.isfinite().all()
    assert kind("nvjet_tst_128x256_64x4") == "matmuls" and kind("pytorch_flash::flash_fwd_kernel") == "attention"
    assert kind("_vision_qkv_rope_kernel") == "vision q/k RoPE" and kind("_add_layer_norm_kernel") == "norms, SwiGLU"
    tokens = 2 * (448 // model.config.vision_config.patch_size) ** 2 // model.config.vision_config.spatial_merge_size**2
    assert tuple(tower.merged.shape) == (tokens, model.config.vision_config.out_hidden_size)
    print("forward runs: logits", tuple(forward.logits.shape), "; GFLOP a token",
          linear_flops_per_token(model) / 1e9, "; tower tokens", tuple(tower.merged.shape))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--shapes", nargs="+", default=["8x256", "16x256", "32x256"], metavar="ROWSxTOKENS")
    parser.add_argument("--images", type=int, nargs="*", default=[1, 4, 8], metavar="N")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--peak-tflops", type=float, default=989.0)
    args = parser.parse_args()
    check() if args.check else measure(args)


if __name__ == "__main__":
    main()
