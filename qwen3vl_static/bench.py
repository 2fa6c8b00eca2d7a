"""`python -m qwen3vl_static bench`: ours against stock transformers, in one process, on the same inputs.

Random bf16 weights with the exact shapes of a preset (`--model`: Qwen3-VL-2B, 4B or 8B; speed does not depend on
weight values); with `--fp8` also ours with the same weights in Qwen's FP8 format; with `--serving` also the shapes
users run (`serving`: sampled decoding, a batch of image prompts, long contexts, batch 64); with `--batching` many
requests by continuous batching as users run it (`batching`, bench_batching.py); with `--server` only the OpenAI
server under concurrent streaming clients over HTTP (`server`, bench_server.py). Every number comes from tokens
really generated: decode ms/step is the slope between two generation lengths (prefill cancels out), and every run's
token count is checked. EOS is disabled so all systems generate the same number of tokens.
"""

import gc
import json
import platform
import sys
import time
from datetime import date
from functools import partial
from pathlib import Path

import torch
import transformers

from .bench_batching import batching
from .bench_server import SPREAD, pass_spread, server_rows
from .compat_qwen3vl_graph import CACHE_KWARG, returned_cache
from .presets import real_generation_config
from .workloads import (
    build_fp8_model,
    build_models,
    build_ours,
    generate_exactly_as_asked,
    image_prompt,
    second_turn,
    text_prompt,
)

SHORT, LONG = 16, 80  # decode lengths whose time difference gives ms/step
SEED = 0  # of every call whose tokens a check reads (sampled runs repeat it)
SERVING_BATCHES = (1, 8)  # batch sizes of the --serving decoding-mode rows
# --serving decode at scale: (ours' settings, [(batch size, context tokens)]); each setting is a model of its own,
# built, warmed, measured and freed in turn (its KV cache must hold context + LONG tokens per row).
DECODE_AT_SCALE = [
    ({"static_cache_len": 8192}, [(1, 7800), (8, 4000)]),  # long contexts, at the default 8 rows
    ({"max_batch_size": 64, "static_cache_len": 512}, [(64, 256)]),  # many short requests
]


def timed_generate(model, prompt, new_tokens, **kwargs):
    torch.cuda.synchronize()
    began = time.perf_counter()
    out = model.generate(**prompt, max_new_tokens=new_tokens, **kwargs)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - began
    generated = out.shape[1] - prompt["input_ids"].shape[1]
    assert generated == new_tokens, f"asked for {new_tokens} tokens, got {generated}"
    return out, seconds


def decode_slope(model, prompt, **kwargs):
    """Decode ms/step, the slope between SHORT and LONG new tokens after an untimed call (prefill and per-call
    costs cancel out), and the LONG call's output; that call is seeded with SEED, so a sampled one can be repeated."""
    timed_generate(model, prompt, SHORT, **kwargs)  # warm caches / graphs / compile
    _, short = timed_generate(model, prompt, SHORT, **kwargs)
    torch.manual_seed(SEED)
    out, long = timed_generate(model, prompt, LONG, **kwargs)
    return 1000 * (long - short) / (LONG - SHORT), out


def equals_eager_static_path(model, prompt, tokens) -> bool:
    """Whether greedy `tokens`, a `generate` output of `prompt`, equal the same call on the eager static path."""
    model.set_cuda_graphs(False)
    try:
        eager = timed_generate(model, prompt, tokens.shape[1] - prompt["input_ids"].shape[1])[0]
    finally:
        model.set_cuda_graphs(True)
    return bool(torch.equal(tokens, eager))


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


def weight_gb(model) -> float:
    """GB of the model's parameters, each tensor counted once (tied or borrowed weights share memory)."""
    sizes = {(p.data_ptr(), p.numel()): p.numel() * p.element_size() for p in model.parameters()}
    return sum(sizes.values()) / 2**30


def measure(system, model, prompts, image, **kwargs):
    """Decode ms/step per batch size, TTFT and end-to-end throughput for one system."""
    rows = []
    for batch, prompt in prompts.items():
        ms_per_step, long_out = decode_slope(model, prompt, **kwargs)
        rows.append({"system": system, "batch_size": batch, "context_tokens": prompt["input_ids"].shape[1],
                     "new_tokens": LONG, "decode_ms_per_step": ms_per_step, "tokens": long_out})
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
    """Per image prompt: TTFT (`max_new_tokens=1`) of ours and stock, the vision tower alone (ours: graph replay
    and the whole call; stock), and whether ours' first token equals its eager static path's. Where ours spends its
    TTFT, stage by stage: bench/probes/ttft_probe.py."""
    rows = []
    engine = ours.graph_engine()
    for name, prompt in prompts.items():
        pixels, grid = prompt["pixel_values"].to(torch.bfloat16), prompt["image_grid_thw"]
        batch, length = prompt["input_ids"].shape
        row = {"image": name, "batch_size": batch, "patches": pixels.shape[0], "prompt_tokens": length,
               "vision_graphs": engine.vision.keys([tuple(row) for row in grid.tolist()]),  # (images, patches) each
               "prefill_bucket": engine.prefill.bucket(batch, length)}
        row["ttft_ms"] = best_ms(partial(timed_generate, ours, prompt, 1))
        first = timed_generate(ours, prompt, 1)[0]
        row["first_token_equals_eager_static_path"] = equals_eager_static_path(ours, prompt, first)
        with torch.no_grad():
            row["vision_tower_ms"] = best_ms(partial(ours.model.visual, pixels, grid_thw=grid))
            if len(row["vision_graphs"]) == 1:
                row.update(replay_times(engine.vision.graphs.get(row["vision_graphs"][0]), "vision_graph"))
            row["stock_vision_tower_ms"] = best_ms(partial(stock.model.visual, pixels, grid_thw=grid), repeats=3)
        row["stock_ttft_ms"] = best_ms(partial(timed_generate, stock, prompt, 1), repeats=3)
        rows.append(row)
    return rows


def graph_pool_gib(*pools) -> float:
    """GiB reserved in the CUDA graph memory pools `pools` (a model's `graph_engine().capturer.pool` and its prefill
    and vision runners'; None before a first capture: 0)."""
    ids = {tuple(pool) for pool in pools if pool is not None}
    return sum(segment["total_size"] for segment in torch.cuda.memory_snapshot()
               if tuple(segment["segment_pool_id"]) in ids) / 2**30


def measure_ours(system, model, args, prompts, image):
    """`warmup()` (greedy graphs for the measured sizes), then `measure`: the rows, and the engine's summary."""
    allocated = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    began = time.perf_counter()
    model.warmup(batch_sizes=args.batch_sizes, cache_lengths=[args.context + LONG, image["input_ids"].shape[1] + 128],
                 modes=("greedy",))
    warmup_s = time.perf_counter() - began
    engine = model.graph_engine()
    graph_pool_gb = graph_pool_gib(engine.capturer.pool, engine.prefill.capturer.pool, engine.vision.capturer.pool)
    rows = measure(system, model, prompts, image)
    for row in rows:
        row.update(warmup_s=warmup_s, peak_mem_gb=torch.cuda.max_memory_allocated() / 2**30,
                   allocated_gb_at_start=allocated / 2**30, weight_gb=weight_gb(model))
    engine = model.graph_engine()
    return rows, {
        "graphs_captured": {"decode": len(engine.decode.graphs), "prefill": len(engine.prefill.graphs),
                            "vision": len(engine.vision.graphs)},
        "decode_ops": type(engine.ops).__name__,
        # Which form each decode op took (0: cuBLAS / separate kernels, then the fused candidates), its candidates'
        # microseconds timed alone and, for near ties, the whole step's milliseconds with each.
        "measured_choices": {f"{op} {shape}": {"choice": tuner.choices[key], "us": us, "step_ms": tuner.step_timings.get(key)}
                             for tuner in [engine.tuner] for key, us in tuner.timings.items() for op, shape, _ in [key]},
        "kv_cache_gb": sum(t.numel() * t.element_size() for t in engine.cache.full_keys + engine.cache.full_values) / 2**30,
        "graph_pool_reserved_gb_after_warmup": graph_pool_gb,
        # Seconds of the warmup in its compile-ahead pass (compiling the Triton kernels, or loading them from
        # Triton's disk cache, plus one eager run of every step), in settling near-tied choices in the whole step and
        # in capturing. The compiling itself is the difference between a cold run (empty cache) and a warm one.
        "warmup_seconds": model.warmup_report,
    }


def graph_equals_eager_static_path(model, rows, prompts, image) -> bool:
    """Whether the graphs' tokens in `rows` equal the same calls run on the eager static path."""
    model.set_cuda_graphs(False)
    try:
        eager_static = measure_tokens(model, prompts, image)
    finally:
        model.set_cuda_graphs(True)
    return all(torch.equal(r["tokens"], eager_static[(r["batch_size"], r["new_tokens"])]) for r in rows)


def sampling_modes(model: str) -> dict:
    """`generate` kwargs of the --serving decoding modes: greedy; sampling at the checkpoint's generation_config
    (Qwen3-VL's: temperature 0.7, top-k 20, top-p 0.8); the same without top-k (for top_k=0 transformers adds no
    top-k warper)."""
    qwen = real_generation_config(model)
    defaults = {"do_sample": True, "temperature": qwen.temperature, "top_k": qwen.top_k, "top_p": qwen.top_p}
    return {"greedy": {"do_sample": False}, "qwen_defaults": defaults, "top_p_only": {**defaults, "top_k": 0}}


def serving_sampling(ours, stock, prompts, modes) -> list:
    """Per batch size and decoding mode: decode ms/step of ours and stock eager and, for a sampled mode, minus the
    greedy mode's. Checks of ours' LONG calls: greedy, against the eager static path; sampled, the seeded call run
    again gives the same tokens, and they differ from greedy's (every call's token count: `timed_generate`)."""
    rows = []
    for batch, prompt in prompts.items():
        greedy_row = greedy_tokens = None
        for mode, kwargs in modes.items():  # greedy first: the sampled modes subtract its ms/step
            ours_ms, tokens = decode_slope(ours, prompt, **kwargs)
            stock_ms = decode_slope(stock, prompt, **kwargs)[0]
            row = {"mode": mode, **{key: value for key, value in kwargs.items() if key != "do_sample"},
                   "batch_size": batch, "context_tokens": prompt["input_ids"].shape[1], "new_tokens": LONG,
                   "ours_decode_ms_per_step": ours_ms, "hf_eager_decode_ms_per_step": stock_ms}
            if not kwargs["do_sample"]:
                greedy_row, greedy_tokens = row, tokens
                row["tokens_equal_eager_static_path"] = equals_eager_static_path(ours, prompt, tokens)
            else:
                torch.manual_seed(SEED)
                repeated = timed_generate(ours, prompt, LONG, **kwargs)[0]
                row.update(ours_minus_greedy_ms_per_step=ours_ms - greedy_row["ours_decode_ms_per_step"],
                           hf_eager_minus_greedy_ms_per_step=stock_ms - greedy_row["hf_eager_decode_ms_per_step"],
                           seeded_run_reproduces=bool(torch.equal(tokens, repeated)),
                           sampled_tokens_differ_from_greedy=not torch.equal(tokens, greedy_tokens))
            rows.append(row)
    return rows


def serving_decode(args, stock, settings, generator) -> list:
    """Decode ms/step of ours and stock eager (text prompts, greedy) at the sizes of DECODE_AT_SCALE, each ours model
    built with its settings (and stock's weights and dtype) and freed after; ours' LONG tokens are checked against
    its eager static path."""
    device, dtype = stock.device, stock.dtype
    rows = []
    for model_settings, shapes in DECODE_AT_SCALE:
        model = build_ours(device, dtype, args.model, **settings, **model_settings)  # seed 0: stock's weights
        generate_exactly_as_asked(model)
        for batch, context in shapes:
            prompt = text_prompt(model.config, batch, context, device, generator)
            warmup_s = model.warmup(batch_sizes=[batch], cache_lengths=[context + LONG], modes=("greedy",),
                                    prompt_lengths=[context], image_patches=[])
            ours_ms, tokens = decode_slope(model, prompt)
            rows.append({"batch_size": batch, "context_tokens": context, "new_tokens": LONG,
                         "ours_settings": model_settings, "ours_warmup_s": warmup_s, "ours_decode_ms_per_step": ours_ms,
                         "hf_eager_decode_ms_per_step": decode_slope(stock, prompt)[0],
                         "tokens_equal_eager_static_path": equals_eager_static_path(model, prompt, tokens)})
        del model  # before the next one is built: its graphs and KV cache go with it
        gc.collect()
        torch.cuda.empty_cache()
    return rows


def serving(args, ours, stock, single_image_ttft, settings, generator) -> dict:
    """The --serving rows: decoding modes (`serving_sampling`) on the default model at SERVING_BATCHES and
    `--context` tokens; TTFT of one 448x448 image + 30 tokens (the `ttft_breakdown` row `single_image_ttft`) and of
    8 such rows in one batch; decode at long contexts and at batch 64 (`serving_decode`)."""
    device = ours.device
    modes = sampling_modes(args.model)
    prompts = {batch: text_prompt(ours.config, batch, args.context, device, generator) for batch in SERVING_BATCHES}
    ours.warmup(batch_sizes=list(SERVING_BATCHES), cache_lengths=[args.context + LONG],
                modes=("greedy", "sample", "sample_top_k"), prompt_lengths=[args.context], image_patches=[])
    sampling = serving_sampling(ours, stock, prompts, modes)
    batched = image_prompt(ours.config, device, generator, batch=8)
    batch, length = batched["input_ids"].shape
    # The first token takes no decode step: the decode graph warmed is the smallest that holds the prompt.
    ours.warmup(batch_sizes=[batch], cache_lengths=[length + 1], modes=("greedy",), prompt_lengths=[length],
                image_patches=[batched["pixel_values"].shape[0] // batch])
    ttft = [single_image_ttft, *ttft_breakdown(ours, stock, {"448x448 per row": batched})]
    return {"sampling": sampling, "ttft": ttft, "decode": serving_decode(args, stock, settings, generator)}


def run(args) -> dict:
    if not torch.cuda.is_available():
        raise SystemExit("bench needs a CUDA GPU; on a CPU run `python -m qwen3vl_static demo`")
    device, dtype = torch.device("cuda"), torch.bfloat16
    settings = {"use_triton_kernels": not args.torch_ops, "kv_cache_dtype": args.kv_cache_dtype}  # 8 x 4096 slots
    if args.prefill_graph_tokens is not None:
        settings["prefill_graph_tokens"] = args.prefill_graph_tokens
    about = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "transformers": transformers.__version__,
             "python": platform.python_version(), "date": date.today().isoformat(),
             "command": " ".join(["python -m qwen3vl_static bench"] + sys.argv[2:]), "model": args.model}
    if args.batching_only:
        return {**about, "batching": batching(args, settings, torch.Generator().manual_seed(0))}
    if args.speculative:
        from .bench_speculative import speculative_rows

        return {**about, "speculative": speculative_rows(args)}
    if args.server:
        return {**about, "server": server_rows(args)}  # needs the serve extra: serve runs in a process of its own
    ours, stock = build_models(device, dtype, args.model, **settings)
    generator = torch.Generator().manual_seed(0)
    prompts = {batch: text_prompt(ours.config, batch, args.context, device, generator) for batch in args.batch_sizes}
    image = image_prompt(ours.config, device, generator)
    ttft_prompts = {"448x448": image, "1024x1024": image_prompt(ours.config, device, generator, sides=(1024,)),
                    "4 x 448x448": image_prompt(ours.config, device, generator, sides=(448,) * 4)}

    results, engine_summary = measure_ours("ours", ours, args, prompts, image)
    ttft = ttft_breakdown(ours, stock, ttft_prompts)
    ttft_second_turn = second_turn_ttft(ours, image, generator)

    systems = [("hf_eager", {})]
    if args.with_compile:
        systems.append(("hf_static_compile", {"cache_implementation": "static"}))
    for system, kwargs in systems:
        allocated = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        began = time.perf_counter()
        timed_generate(stock, prompts[args.batch_sizes[0]], 2, **kwargs)  # first call: compile for static
        warmup = time.perf_counter() - began
        rows = measure(system, stock, prompts, image, **kwargs)
        for row in rows:
            row.update(warmup_s=warmup, peak_mem_gb=torch.cuda.max_memory_allocated() / 2**30,
                       allocated_gb_at_start=allocated / 2**30, weight_gb=weight_gb(stock))
        results += rows

    # Ours against the stock eager reference on identical inputs, and against our own eager static path.
    reference = {(r["batch_size"], r["new_tokens"]): r["tokens"] for r in results if r["system"] == "hf_eager"}
    for row in results:
        ref = reference[(row["batch_size"], row["new_tokens"])]
        row["tokens_match_reference"] = bool(torch.equal(row["tokens"], ref))
        row["first_divergence"] = None if row["tokens_match_reference"] else int(
            (row["tokens"] != ref).any(0).nonzero()[0])
    graph_equals_eager = graph_equals_eager_static_path(ours, [r for r in results if r["system"] == "ours"], prompts, image)
    serving_rows = {"serving": serving(args, ours, stock, ttft[0], settings, generator)} if args.serving else {}
    if args.batching:
        del ours  # its cache and graphs: the batching model sizes its cache from the memory left
        gc.collect()
        torch.cuda.empty_cache()
        serving_rows["batching"] = batching(args, settings, generator)

    fp8 = {}
    if args.fp8:
        # Stock transformers cannot run these weights offline: the FP8 rows have no stock reference, and their check
        # is their own eager static path.
        fp8_model = build_fp8_model(device, dtype, args.model, **settings)
        fp8_rows, fp8_engine = measure_ours("ours_fp8", fp8_model, args, prompts, image)
        for row in fp8_rows:
            row.update(tokens_match_reference=None, first_divergence=None)
        fp8 = {"graph_equals_eager_static_path_fp8": graph_equals_eager_static_path(fp8_model, fp8_rows, prompts, image),
               "ours_fp8_engine": fp8_engine}
        results += fp8_rows
    for row in results:
        del row["tokens"]
    return {
        **about,
        **engine_summary,
        "graph_equals_eager_static_path": graph_equals_eager,
        **fp8,
        "ttft_breakdown": ttft,
        "ttft_second_turn": ttft_second_turn,
        "results": results,
        **serving_rows,
    }


def measure_tokens(model, prompts, image):
    out = {(batch, LONG): timed_generate(model, prompt, LONG)[0] for batch, prompt in prompts.items()}
    out[(1, 128)] = timed_generate(model, image, 128)[0]
    return out


def print_table(rows, columns) -> None:
    print(" | ".join(columns))
    for row in rows:
        print(" | ".join(f"{row[c]:.3f}" if isinstance(row.get(c), float) else str(row.get(c, "")) for c in columns))


def report(summary, out_dir: Path) -> Path:
    if "results" in summary:
        report_decode(summary)
    if "batching" in summary:
        print("batching, useful tokens/s of many requests (answers of uneven lengths):")
        print_table(summary["batching"], ["workload", "system", "run", "rows", "static_cache_len", "useful_tokens_per_s",
                                          "requests_per_s", "ttft_ms_p50", "ttft_ms_p99", "peak_mem_gb", "seconds",
                                          "tokens_equal_eager_static_path"])
    if "server" in summary:
        server = summary["server"]
        print("OpenAI server, streaming clients (each a 448x448 image + 30-token question, 128 new tokens):")
        print_table(server["rows"], ["run", "concurrency", "requests", "output_tokens_per_s", "ttft_ms_p50",
                                     "ttft_ms_p99", "itl_ms_p50", "itl_ms_p99", "tpot_ms_p50", "tokens_per_chunk",
                                     "client_cores_busy", "server_cores_busy", "gpu_prefill_busy", "gpu_decode_busy",
                                     "requests_per_prefill", "prefill_beside_share", "prefill_gpu_ms_mean",
                                     "activation_wait_ms_per_prefill", "activation_slack_ms_per_prefill",
                                     "admit_host_ms_mean", "eager_prefill_share",
                                     "engine_cores_busy", "host_wait_share", "server_read_and_render_ms_p50",
                                     "engine_first_token_ms_p50", "server_first_text_ms_p50",
                                     "ttft_outside_server_ms", "answers_as_asked"])
        if "spread" in server:
            print(f"each concurrency over its {server['measured_passes']} measured passes, median (least-greatest):")
            print_table([{"concurrency": level["concurrency"],
                          **{key: f"{level[key + '_median']:.3f} ({level[key + '_min']:.3f}-{level[key + '_max']:.3f})"
                             for key in SPREAD}} for level in server["spread"]], ["concurrency", *SPREAD])
        for key, value in server.items():
            if "_generate" in key:
                print(f"{key}: {value}")
    if "speculative" in summary:
        speculative = summary["speculative"]
        print(f"speculative decoding, batch 1 (plain loop: {speculative['plain_ms_per_token']['median']:.3f} ms/token; "
              f"projected rows: the measured cycle time / acceptance length):")
        print_table([{**row, **{f"{name}_median": row[name]["median"] for name in
                                ("verify_ms", "draft_ms", "cycle_ms", "always_accepted_ms_per_token")},
                      "projected_at_2.5": row["projected_ms_per_token"].get("2.5")} for row in speculative["rows"]],
                    ["num_draft_tokens", "verify_ms_median", "draft_ms_median", "cycle_ms_median", "cycle_ms_end_to_end",
                     "always_accepted_ms_per_token_median", "projected_at_2.5", "graph_equals_eager",
                     "random_draft_tokens_equal_plain_before_first_difference"])
    out_dir.mkdir(parents=True, exist_ok=True)
    name = summary["device"].replace(" ", "-").lower() + ("" if summary["model"] == "2b" else f"-{summary['model']}")
    name += ("" if "results" in summary else "-server" if "server" in summary
             else "-speculative" if "speculative" in summary else "-batching")
    path = out_dir / f"{name}-{summary['date'].replace('-', '')}.json"
    path.write_text(json.dumps(summary, indent=2))
    plot(summary, path.with_suffix(".png"))
    return path


def report_decode(summary) -> None:
    print_table(summary["results"], ["system", "batch_size", "context_tokens", "new_tokens", "decode_ms_per_step",
                                     "ttft_ms", "e2e_tokens_per_s", "warmup_s", "weight_gb", "peak_mem_gb",
                                     "tokens_match_reference"])
    print("time to first token:", json.dumps(summary["ttft_breakdown"], indent=1))
    print("second turn:", json.dumps(summary["ttft_second_turn"], indent=1))
    print(f"kv cache {summary['kv_cache_gb']:.3f} GB, graph pool after warmup {summary['graph_pool_reserved_gb_after_warmup']:.3f} GB")
    print("warmup of ours, seconds:", {key: round(value, 3) for key, value in summary["warmup_seconds"].items()})
    print("graph == eager static path:", summary["graph_equals_eager_static_path"])
    if "ours_fp8_engine" in summary:
        fp8 = summary["ours_fp8_engine"]
        print(f"fp8: kv cache {fp8['kv_cache_gb']:.3f} GB, graph pool after warmup {fp8['graph_pool_reserved_gb_after_warmup']:.3f} GB")
        print("fp8: warmup, seconds:", {key: round(value, 3) for key, value in fp8["warmup_seconds"].items()})
        print("fp8: graph == eager static path:", summary["graph_equals_eager_static_path_fp8"])
    if "serving" in summary:
        serving = summary["serving"]
        print("serving, decode ms/step by decoding mode:")
        print_table(serving["sampling"], ["mode", "batch_size", "context_tokens", "ours_decode_ms_per_step",
                                          "ours_minus_greedy_ms_per_step", "hf_eager_decode_ms_per_step",
                                          "hf_eager_minus_greedy_ms_per_step", "tokens_equal_eager_static_path",
                                          "seeded_run_reproduces", "sampled_tokens_differ_from_greedy"])
        print("serving, TTFT of 448x448 image prompts:")
        print_table(serving["ttft"], ["image", "batch_size", "prompt_tokens", "patches", "ttft_ms", "stock_ttft_ms",
                                      "vision_tower_ms", "stock_vision_tower_ms", "first_token_equals_eager_static_path"])
        print("serving, decode ms/step at scale:")
        print_table(serving["decode"], ["batch_size", "context_tokens", "ours_decode_ms_per_step",
                                        "hf_eager_decode_ms_per_step", "ours_warmup_s", "tokens_equal_eager_static_path"])


def plot(summary, path) -> None:
    """Decode ms/step by batch size per system; beside it, with --batching, each system's useful tokens/s; with
    --server, output tokens/s and inter-token latency by concurrency (nothing without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    decode = [r for r in summary.get("results", []) if "decode_ms_per_step" in r]
    batching = [row for row in summary.get("batching", []) if "useful_tokens_per_s" in row]
    server = summary.get("server", {}).get("rows", [])
    speculative = summary.get("speculative", {}).get("rows", [])
    panels = [kind for kind, rows in (("decode", decode), ("batching", batching), ("server", server),
                                      ("speculative", speculative)) if rows]
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4), squeeze=False)
    axes = dict(zip(panels, axes[0]))
    title = f"{summary['device']}, Qwen3-VL-{summary['model'].upper()}"
    if decode:
        ax = axes["decode"]
        for system in dict.fromkeys(r["system"] for r in decode):
            rows = [r for r in decode if r["system"] == system]
            ax.plot([r["batch_size"] for r in rows], [r["decode_ms_per_step"] for r in rows], marker="o", label=system)
        ax.set(xlabel="batch size", ylabel="decode ms/step", yscale="log", title=title)
        ax.legend()
    if batching:
        ax = axes["batching"]
        ax.barh([f"{row['workload']}, {row['run']} run\n{row['system']} ({row['rows']} rows)" for row in batching],
                [row["useful_tokens_per_s"] for row in batching])
        ax.invert_yaxis()
        ax.set(xlabel="useful tokens/s", xscale="log", title="many requests, answers of uneven lengths")
    if server:
        # Each concurrency's median over the measured passes, bars from the least to the greatest.
        spread = pass_spread(server)
        ax, levels = axes["server"], [level["concurrency"] for level in spread]

        def bars(key):
            medians = [level[f"{key}_median"] for level in spread]
            return medians, [[m - level[f"{key}_min"] for m, level in zip(medians, spread)],
                             [level[f"{key}_max"] - m for m, level in zip(medians, spread)]]

        medians, extent = bars("output_tokens_per_s")
        ax.errorbar(levels, medians, yerr=extent, marker="o", color="C0", capsize=3)
        ax.set(xlabel="concurrent streaming clients", ylabel="output tokens/s", xscale="log",
               title=f"{title}: OpenAI server over HTTP")
        latency = ax.twinx()
        for key, style in (("itl_ms_p50", "--"), ("itl_ms_p99", ":")):
            medians, extent = bars(key)
            latency.errorbar(levels, medians, yerr=extent, fmt=style, marker=".", color="C1", capsize=3, label=key)
        latency.set(ylabel="inter-token latency, ms", yscale="log")
        latency.legend(loc="upper left")
    if speculative:
        ax, plain = axes["speculative"], summary["speculative"]["plain_ms_per_token"]["median"]
        ks = [row["num_draft_tokens"] for row in speculative]
        ax.axhline(plain, color="gray", linestyle="--", label="plain loop (measured)")
        ax.plot(ks, [row["always_accepted_ms_per_token"]["median"] for row in speculative], marker="o",
                label="every proposal kept (measured)")
        for acceptance, style in (("1.5", ":"), ("2.5", "-."), ("3.5", "--")):
            points = [(row["num_draft_tokens"], row["projected_ms_per_token"][acceptance]) for row in speculative
                      if acceptance in row["projected_ms_per_token"]]
            ax.plot(*zip(*points), style, marker=".", label=f"{acceptance} tokens a cycle (projected)")
        ax.set(xlabel="draft tokens a cycle (K)", ylabel="ms per generated token, batch 1", xticks=ks,
               title=f"{title}: speculative decoding")
        ax.legend(fontsize=8)
    fig.savefig(path, dpi=120, bbox_inches="tight")
