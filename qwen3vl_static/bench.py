"""`python -m qwen3vl_static bench`: ours against stock transformers, in one process, on the same inputs.

Random bf16 weights with the exact Qwen3-VL-2B shapes (speed does not depend on weight values). Every
number comes from tokens really generated: decode ms/step is the slope between two generation lengths
(prefill cancels out), and every run's token count is checked. EOS is disabled so all systems generate
the same number of tokens.
"""

import cProfile
import json
import platform
import pstats
import sys
import time
from contextlib import contextmanager
from datetime import date
from pathlib import Path

import torch
import transformers
from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

from .compat_qwen3vl_graph import CACHE_KWARG, TAKES_MM_TOKEN_TYPE_IDS, returned_cache
from .modeling_qwen3vl_graph import Qwen3VLGraphForConditionalGeneration
from .presets import REAL_2B_DIR, real_2b_config

SHORT, LONG = 16, 80  # decode lengths whose time difference gives ms/step


def build_models(device, dtype, **settings):
    """Ours (with these config settings) and the stock class over one set of weights (the stock model borrows
    our tensors)."""
    config = real_2b_config(**settings)
    torch.manual_seed(0)
    with torch.device(device):
        ours = Qwen3VLGraphForConditionalGeneration._from_config(config, dtype=dtype).eval()
        stock_config = Qwen3VLConfig(**{k: v for k, v in json.loads((REAL_2B_DIR / "config.json").read_text()).items() if k != "model_type"})
        # Built on the device (not meta) so its non-persistent buffers (rotary tables) exist; then it borrows
        # our parameters and its own random ones are freed.
        stock = Qwen3VLForConditionalGeneration._from_config(stock_config, dtype=dtype).eval()
    ours.static_cache()  # fuses the projection weights first, so the stock model borrows the fused views
    stock.load_state_dict(ours.state_dict(), assign=True)
    stock.tie_weights()
    for model in (ours, stock):  # random weights: no EOS, so every system generates exactly what was asked
        model.generation_config.eos_token_id = None
        model.generation_config.do_sample = False
    return ours, stock


def text_prompt(config, batch, length, device, generator):
    ids = torch.randint(0, 150000, (batch, length), generator=generator).to(device)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def image_prompt(config, device, generator, sides=(448,), question=30):
    """Square images of these sides + a `question`-token text, laid out as Qwen3VLProcessor lays them out."""
    vision = config.vision_config
    grids = [side // vision.patch_size for side in sides]
    parts = []
    for grid in grids:
        tokens = grid * grid // vision.spatial_merge_size**2
        parts += [torch.tensor([config.vision_start_token_id]), torch.full((tokens,), config.image_token_id),
                  torch.tensor([config.vision_end_token_id])]
    ids = torch.cat(parts + [torch.randint(0, 150000, (question,), generator=generator)])[None]
    patch_dim = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    patches = sum(grid * grid for grid in grids)
    return {
        "input_ids": ids.to(device),
        "attention_mask": torch.ones_like(ids).to(device),
        **({"mm_token_type_ids": (ids == config.image_token_id).int().to(device)} if TAKES_MM_TOKEN_TYPE_IDS else {}),
        "pixel_values": torch.randn(patches, patch_dim, generator=generator).to(device),
        "image_grid_thw": torch.tensor([[1, grid, grid] for grid in grids], device=device),
    }


def timed_generate(model, prompt, new_tokens, **kwargs):
    torch.cuda.synchronize()
    began = time.perf_counter()
    out = model.generate(**prompt, max_new_tokens=new_tokens, **kwargs)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - began
    generated = out.shape[1] - prompt["input_ids"].shape[1]
    assert generated == new_tokens, f"asked for {new_tokens} tokens, got {generated}"
    return out, seconds


def second_turn(model, image, generator, answer=128, question=30):
    """A chat's second turn after the first turn's `image` prompt and `answer` tokens: `(first turn's output, resumed
    inputs, fresh inputs)`. Resumed: a `question`-token user turn after the first turn's sequences, to pass with the
    returned cache (the image's pixels are in the cache). Fresh: the same prompt with the pixels, for a new request."""
    first = model.generate(**image, max_new_tokens=answer, do_sample=False, return_dict_in_generate=True)
    device = image["input_ids"].device
    ids = torch.cat([first.sequences, torch.randint(0, 150000, (1, question), generator=generator).to(device)], dim=1)
    resumed = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if TAKES_MM_TOKEN_TYPE_IDS:  # 5.x places the cached image's tokens by their type ids and grid
        resumed.update(mm_token_type_ids=(ids == model.config.image_token_id).int(), image_grid_thw=image["image_grid_thw"])
    fresh = {**resumed, "pixel_values": image["pixel_values"], "image_grid_thw": image["image_grid_thw"]}
    return first, resumed, fresh


def second_turn_ttft(model, image, generator, repeats=5) -> dict:
    """TTFT of a second turn (`second_turn`), ms: passing back the returned cache (only the new tokens are prefilled)
    and as a new request (the whole conversation prefilled); each timed call follows its own first turn. Its tokens
    with the cache are checked against the same call without graphs."""
    def ttft(resume: bool, graphs: bool = True):
        best, token = float("inf"), None
        for _ in range(repeats):
            first, resumed, fresh = second_turn(model, image, torch.Generator().manual_seed(7))
            model.set_cuda_graphs(graphs)
            try:
                out, seconds = timed_generate(model, resumed if resume else fresh, 1, do_sample=False,
                                              **({CACHE_KWARG: returned_cache(first)} if resume else {}))
            finally:
                model.set_cuda_graphs(True)
            best, token = min(best, seconds), out[:, -1]
        return 1000 * best, token

    reused_ms, reused_token = ttft(True)
    fresh_ms, fresh_token = ttft(False)
    _, eager_token = ttft(True, graphs=False)
    return {"prompt_tokens": second_turn(model, image, generator)[1]["input_ids"].shape[1],
            "ttft_ms_with_returned_cache": reused_ms, "ttft_ms_fresh": fresh_ms,
            "token_with_cache_equals_eager": bool(torch.equal(reused_token, eager_token)),
            "token_with_cache_equals_fresh": bool(torch.equal(reused_token, fresh_token))}


def measure(system, model, prompts, image, **kwargs):
    """Decode ms/step per batch size, TTFT and end-to-end throughput for one system."""
    rows = []
    for batch, prompt in prompts.items():
        timed_generate(model, prompt, SHORT, **kwargs)  # warm caches / graphs / compile
        _, short = timed_generate(model, prompt, SHORT, **kwargs)
        long_out, long = timed_generate(model, prompt, LONG, **kwargs)
        rows.append({"system": system, "batch_size": batch, "context_tokens": prompt["input_ids"].shape[1],
                     "new_tokens": LONG, "decode_ms_per_step": 1000 * (long - short) / (LONG - SHORT),
                     "tokens": long_out})
    timed_generate(model, image, 1, **kwargs)
    ttft = min(timed_generate(model, image, 1, **kwargs)[1] for _ in range(5))
    image_out, e2e = min((timed_generate(model, image, 128, **kwargs) for _ in range(3)), key=lambda run: run[1])
    rows.append({"system": system, "batch_size": 1, "context_tokens": image["input_ids"].shape[1],
                 "new_tokens": 128, "ttft_ms": 1000 * ttft, "e2e_tokens_per_s": 128 / e2e, "tokens": image_out})
    return rows


def best_ms(call, repeats=5) -> float:
    """Fastest of `repeats` synchronized runs of `call()`, after one untimed run (captures, caches)."""
    call()
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        began = time.perf_counter()
        call()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - began)
    return 1000 * min(times)


@contextmanager
def instrumented(stages: dict):
    """Wrap methods `{name: (owner, attribute)}` for the duration: each call's synchronized wall time is added up
    under `times[name]` (ms) and its arguments kept as `arguments[name]`."""
    times, arguments = {}, {}
    for name, (owner, attribute) in stages.items():
        def timed(*args, _call=getattr(owner, attribute), _name=name, **kwargs):
            torch.cuda.synchronize()
            began = time.perf_counter()
            result = _call(*args, **kwargs)
            torch.cuda.synchronize()
            times[_name] = times.get(_name, 0.0) + 1000 * (time.perf_counter() - began)
            arguments[_name] = (args, kwargs)
            return result

        setattr(owner, attribute, timed)  # an instance attribute over the method, removed below
    try:
        yield times, arguments
    finally:
        for owner, attribute in stages.values():
            delattr(owner, attribute)


def generate_stages(model) -> dict:
    """The parts of a `generate` call that TTFT is split into."""
    return {"vision_ms": (model.model.visual.runner, "encode"), "prefill_ms": (model._prefill_runner, "run"),
            "rope_index_ms": (model.model, "get_rope_index")}


def host_profile(call, top=20) -> dict:
    """Host (Python) time of one `call()` by function, the `top` largest by own time, in ms."""
    profiler = cProfile.Profile()
    profiler.runcall(call)
    stats = pstats.Stats(profiler).stats  # {(file, line, name): (calls, primitive calls, own s, cumulative s, callers)}
    rows = sorted(stats.items(), key=lambda item: -item[1][2])[:top]
    return {f"{Path(file).name}:{line}({name}) x{calls}": round(1000 * own, 3) for (file, line, name), (calls, _, own, _, _) in rows}


def replay_times(graph, name) -> dict:
    """Host time of one `graph.replay()` call (the launch) and the GPU time of the replay, in ms (fastest of 5)."""
    if graph is None:
        return {}
    host, gpu = [], []
    for _ in range(5):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        began = time.perf_counter()
        graph.replay()
        host.append(1000 * (time.perf_counter() - began))
        end.record()
        end.synchronize()
        gpu.append(start.elapsed_time(end))
    return {f"{name}_launch_host_ms": min(host), f"{name}_replay_gpu_ms": min(gpu)}


def ttft_breakdown(ours, stock, prompts) -> list:
    """Per image prompt: TTFT (`max_new_tokens=1`) of ours and stock, and where ours spends it; the vision tower
    alone for ours (graphs; eager at exact size; Conv3d patch embedding) and stock."""
    rows = []
    runner = ours.model.visual.runner
    for name, prompt in prompts.items():
        pixels, grid = prompt["pixel_values"].to(torch.bfloat16), prompt["image_grid_thw"]
        row = {"image": name, "patches": pixels.shape[0], "prompt_tokens": prompt["input_ids"].shape[1],
               "vision_graph": runner.shape(pixels.shape[0], int(grid[:, 0].sum())),  # (patches computed, masked)
               "prefill_bucket": ours._prefill_runner.bucket(1, prompt["input_ids"].shape[1])}
        row["ttft_ms"] = best_ms(lambda: timed_generate(ours, prompt, 1))
        runner.encode_ahead = lambda *args, **kwargs: None  # an instance attribute over the method
        row["ttft_ms_tower_not_run_ahead"] = best_ms(lambda: timed_generate(ours, prompt, 1))
        del runner.encode_ahead
        with instrumented(generate_stages(ours)) as (spans, _):
            total = best_ms(lambda: timed_generate(ours, prompt, 1), repeats=1)
        spans = {key: value / 2 for key, value in spans.items()}  # best_ms made two calls
        row.update(spans)
        # generate's own host work, first token, syncs. The stages are synchronized: `vision_ms` is what is left of the
        # tower when `encode` takes what `encode_ahead` queued as generate began.
        row["other_ms"] = total - sum(spans.values())
        with torch.no_grad():
            row["vision_tower_ms"] = best_ms(lambda: ours.model.visual(pixels, grid_thw=grid))
            row.update(replay_times(runner.graphs.get(row["vision_graph"]), "vision_graph"))
            runner.bucketed = False
            row["vision_tower_eager_exact_ms"] = best_ms(lambda: ours.model.visual(pixels, grid_thw=grid))
            runner.bucketed = True
            ours.model.visual.patch_embed.mode, saved = "conv3d", runner.graphs
            runner.graphs = type(saved)()  # conv3d graphs of their own, dropped afterwards
            row["vision_tower_conv3d_ms"] = best_ms(lambda: ours.model.visual(pixels, grid_thw=grid))
            ours.model.visual.patch_embed.mode, runner.graphs = "gemm", saved
            row["stock_vision_tower_ms"] = best_ms(lambda: stock.model.visual(pixels, grid_thw=grid), repeats=3)
        row["stock_ttft_ms"] = best_ms(lambda: timed_generate(stock, prompt, 1), repeats=3)
        rows.append(row)
    return rows


KERNEL_CLASSES = {
    "gemv/gemm": ("gemv", "gemm", "xmma", "cutlass", "nvjet", "splitk", "skinny_matmul", "sum_splits", "qkv_norm_rope"),
    "attention": ("attention", "fmha", "flash", "sdpa", "softmax", "merge"),
    "indexing": ("index", "scatter", "gather"),
    "argmax/sampling": ("argmax", "argmin", "sort", "exponential", "finish_step"),
    "norm/rope/elementwise": ("elementwise", "vectorized", "reduce", "norm", "cat", "copy", "roll", "silu", "gelu"),
}


def kernel_profile(call, calls=1) -> dict:
    """GPU time of `call()` per call, by kernel class and for the top kernels. Under programmatic dependent launch
    a kernel starts before its predecessor ends and waits for it, so kernel times overlap: their sum ("gpu_ms_total")
    can exceed the call's time, and a kernel's time includes its wait."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    by_class, by_kernel = {}, {}
    for event in prof.key_averages():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        ms = event.device_time_total / 1000 / calls
        kind = next((label for label, keys in KERNEL_CLASSES.items() if any(key in event.key.lower() for key in keys)), "other")
        by_class[kind] = by_class.get(kind, 0.0) + ms
        by_kernel[f"{event.key[:90]} (x{event.count // calls})"] = ms
    top = dict(sorted(by_kernel.items(), key=lambda item: -item[1])[:15])
    return {"gpu_ms_total": sum(by_class.values()), "ms_by_class": by_class, "top_kernels_ms": top}


def kernel_breakdown(model, image) -> dict:
    """Where the GPU time goes: one greedy decode step (batch 1), and the vision tower and prefill of `image`."""
    runner = model._runner
    steps = runner.steps_per_sync
    decode = kernel_profile(lambda: runner.token_steps(runner.input_ids[:1, 0].clone(), steps, "greedy"), steps)
    with instrumented(generate_stages(model)) as (_, arguments):  # the runners' arguments in a real call
        timed_generate(model, image, 1)
    with torch.no_grad():
        profiles = {name: kernel_profile(lambda: getattr(owner, attribute)(*arguments[f"{name}_ms"][0]))
                    for name, (owner, attribute) in (("vision", (model.model.visual.runner, "encode")),
                                                     ("prefill", (model._prefill_runner, "run")))}
    return {"decode_step_batch1": decode, "vision_tower": profiles["vision"], "prefill": profiles["prefill"]}


def run(args) -> dict:
    if not torch.cuda.is_available():
        raise SystemExit("bench needs a CUDA GPU; on a CPU run `python -m qwen3vl_static demo`")
    device, dtype = torch.device("cuda"), torch.bfloat16
    ours, stock = build_models(device, dtype, use_triton_kernels=not args.torch_ops)  # default cache: 8 x 4096
    generator = torch.Generator().manual_seed(0)
    prompts = {batch: text_prompt(ours.config, batch, args.context, device, generator) for batch in args.batch_sizes}
    image = image_prompt(ours.config, device, generator)
    ttft_prompts = {"448x448": image, "1024x1024": image_prompt(ours.config, device, generator, sides=(1024,)),
                    "4 x 448x448": image_prompt(ours.config, device, generator, sides=(448,) * 4)}

    torch.cuda.empty_cache()  # capture empties the cache too; measure the pool against the same baseline
    reserved = torch.cuda.memory_reserved()
    torch.cuda.reset_peak_memory_stats()
    began = time.perf_counter()
    ours.warmup(batch_sizes=args.batch_sizes, cache_lengths=[args.context + LONG, image["input_ids"].shape[1] + 128],
                modes=("greedy",))
    warmup_s = time.perf_counter() - began
    warmup_report = ours.warmup_report
    graph_pool_gb = (torch.cuda.memory_reserved() - reserved) / 2**30  # graphs allocate from a private pool
    results = measure("ours", ours, prompts, image)
    for row in results:
        row.update(warmup_s=warmup_s, peak_mem_gb=torch.cuda.max_memory_allocated() / 2**30)
    cache_gb = sum(t.numel() * t.element_size() for t in ours._static_cache.full_keys + ours._static_cache.full_values) / 2**30
    buffers_gb = ours._runner.buffer_bytes() / 2**30
    # Before the profiler runs: in one run TTFT measured after it took 10.1 ms, against 7.6 ms measured before it.
    ttft = ttft_breakdown(ours, stock, ttft_prompts)
    ttft_second_turn = second_turn_ttft(ours, image, generator)
    breakdown = kernel_breakdown(ours, image)
    ttft_host = host_profile(lambda: timed_generate(ours, image, 1))

    systems = [("hf_eager", {})]
    if args.with_compile:
        systems.append(("hf_static_compile", {"cache_implementation": "static"}))
    for system, kwargs in systems:
        torch.cuda.reset_peak_memory_stats()
        began = time.perf_counter()
        timed_generate(stock, prompts[args.batch_sizes[0]], 2, **kwargs)  # first call: compile for static
        warmup = time.perf_counter() - began
        rows = measure(system, stock, prompts, image, **kwargs)
        for row in rows:
            row.update(warmup_s=warmup, peak_mem_gb=torch.cuda.max_memory_allocated() / 2**30)
        results += rows

    # Ours against the stock eager reference on identical inputs, and against our own eager static path.
    reference = {(r["batch_size"], r["new_tokens"]): r["tokens"] for r in results if r["system"] == "hf_eager"}
    for row in results:
        ref = reference[(row["batch_size"], row["new_tokens"])]
        row["tokens_match_reference"] = bool(torch.equal(row["tokens"], ref))
        row["first_divergence"] = None if row["tokens_match_reference"] else int(
            (row["tokens"] != ref).any(0).nonzero()[0])
    ours.set_cuda_graphs(False)
    eager_static = measure_tokens(ours, prompts, image)
    ours.set_cuda_graphs(True)
    graph_equals_eager_static = all(
        torch.equal(r["tokens"], eager_static[(r["batch_size"], r["new_tokens"])]) for r in results if r["system"] == "ours")
    for row in results:
        del row["tokens"]
    return {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "date": date.today().isoformat(),
        "command": " ".join(["python -m qwen3vl_static bench"] + sys.argv[2:]),
        "graphs_captured": {"decode": len(ours._runner.graphs), "prefill": len(ours._prefill_runner.graphs),
                            "vision": len(ours.model.visual.runner.graphs)},
        "decode_ops": ours._runner.ops.__name__,
        # Which form each decode op took (0: cuBLAS / separate kernels, then the fused candidates), its candidates'
        # microseconds timed alone and, for near ties, the whole step's milliseconds with each.
        "measured_choices": {f"{op} {shape}": {"choice": ops.choices[key], "us": us, "step_ms": ops.step_timings.get(key)}
                             for ops in [ours._runner.ops] for key, us in getattr(ops, "timings", {}).items()
                             for op, shape, _ in [key]},
        "kv_cache_gb": cache_gb,
        "static_buffers_gb": buffers_gb,
        "graph_pool_reserved_gb_after_warmup": graph_pool_gb,
        # Seconds of the warmup in its compile-ahead pass (compiling the Triton kernels, or loading them from
        # Triton's disk cache, plus one eager run of every step), in settling near-tied choices in the whole step and
        # in capturing. The compiling itself is the difference between a cold run (empty cache) and a warm one.
        "warmup_seconds": warmup_report,
        "graph_equals_eager_static_path": graph_equals_eager_static,
        "gpu_profile": breakdown,
        "ttft_breakdown": ttft,
        "ttft_second_turn": ttft_second_turn,
        "ttft_host_profile_448": ttft_host,
        "results": results,
    }


def measure_tokens(model, prompts, image):
    out = {(batch, LONG): timed_generate(model, prompt, LONG)[0] for batch, prompt in prompts.items()}
    out[(1, 128)] = timed_generate(model, image, 128)[0]
    return out


def report(summary, out_dir: Path) -> Path:
    columns = ["system", "batch_size", "context_tokens", "new_tokens", "decode_ms_per_step", "ttft_ms",
               "e2e_tokens_per_s", "warmup_s", "peak_mem_gb", "tokens_match_reference"]
    print(" | ".join(columns))
    for row in summary["results"]:
        print(" | ".join(f"{row[c]:.3f}" if isinstance(row.get(c), float) else str(row.get(c, "")) for c in columns))
    print("GPU profile (448x448 image prompt):", json.dumps(summary["gpu_profile"], indent=1))
    print("time to first token:", json.dumps(summary["ttft_breakdown"], indent=1))
    print("second turn:", json.dumps(summary["ttft_second_turn"], indent=1))
    print("host time of one TTFT call (448x448), by function:", json.dumps(summary["ttft_host_profile_448"], indent=1))
    print(f"kv cache {summary['kv_cache_gb']:.3f} GB, static buffers {summary['static_buffers_gb']:.3f} GB, "
          f"graph pool after warmup {summary['graph_pool_reserved_gb_after_warmup']:.3f} GB")
    print("warmup of ours, seconds:", {key: round(value, 3) for key, value in summary["warmup_seconds"].items()})
    print("graph == eager static path:", summary["graph_equals_eager_static_path"])
    out_dir.mkdir(parents=True, exist_ok=True)
    name = summary["device"].replace(" ", "-").lower()
    path = out_dir / f"{name}-{summary['date'].replace('-', '')}.json"
    path.write_text(json.dumps(summary, indent=2))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return path
    decode = [r for r in summary["results"] if "decode_ms_per_step" in r]
    fig, ax = plt.subplots(figsize=(6, 4))
    for system in dict.fromkeys(r["system"] for r in decode):
        rows = [r for r in decode if r["system"] == system]
        ax.plot([r["batch_size"] for r in rows], [r["decode_ms_per_step"] for r in rows], marker="o", label=system)
    ax.set(xlabel="batch size", ylabel="decode ms/step", yscale="log", title=summary["device"])
    ax.legend()
    fig.savefig(path.with_suffix(".png"), dpi=120, bbox_inches="tight")
    return path
