"""Command line: `python -m qwen3vl_static <command> ...`. Not uploaded to the Hub.

Torch and transformers are imported only once the arguments are checked (`python -m qwen3vl_static` does not import
them with the package), so `--help` and argument mistakes answer in a moment, not after seconds of imports or a model
load."""

import argparse
import os
import sys
import time
from pathlib import Path

from . import __version__
from .checkpoints import qwen3vl_config_file
from .presets import MODELS


def positive_int(text: str) -> int:
    """argparse type: an integer of at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


TINY_MAX_NEW_TOKENS = 32  # the `tiny` checkpoint's generation config
DEVICE_HELP = "torch device to run on (default: cuda when there is one, else cpu)"
SLOTS_HELP = ("requests decoded at once: the static cache's rows (max_batch_size; default: as many as fit in the GPU's "
              "memory, the config's on the CPU)")
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")  # the config's (importing it here would import torch for --help)
KV_CACHE_DTYPE_HELP = ("what the KV cache stores: auto (the model's dtype, default) or fp8 (float8 e4m3, opt-in: half "
                       "the memory and attention reads; answers differ from stock's)")


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.check(args)
        from . import auto_classes  # noqa: F401 - registers the classes: AutoProcessor reads a converted config.json

        return args.run(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130  # 128 + SIGINT, as a shell reports it
    except Exception as error:  # a command line reports any failure as one line, not a traceback
        print(f"error: {' '.join(str(error).split())}", file=sys.stderr)
        return 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m qwen3vl_static")
    parser.add_argument("--version", action="version", version=f"qwen3vl-static {__version__}")
    parser.set_defaults(check=lambda args: None)
    commands = parser.add_subparsers(dest="command", required=True)

    converter = commands.add_parser(
        "convert",
        help="turn a stock Qwen3-VL checkpoint into a custom-code repo",
        description="Copy a stock Qwen3-VL checkpoint to DST as a ready custom-code repo for this package "
        "(same weights; new config.json, module files and model card).",
    )
    converter.add_argument("src", metavar="SRC", help="checkpoint folder or Hub repo id")
    converter.add_argument("dst", metavar="DST", help="output folder: new, empty or a previous conversion")
    converter.add_argument("--push-to-hub", metavar="REPO_ID", help="upload DST to this Hub repo when done")
    converter.add_argument("--private", action="store_true", help="create the Hub repo as private")
    converter.set_defaults(run=_convert)

    demo = commands.add_parser(
        "demo",
        help="generate end to end with a random-weight model (offline)",
        description="CPU: a tiny random Qwen3-VL generates from an image prompt through the static loop and is "
        "checked against stock transformers. CUDA: the real Qwen3-VL-2B shapes with random bf16 weights, "
        "decode graphs captured ahead of time, checked against the same steps run eagerly (bf16).",
    )
    demo.add_argument("--new-tokens", type=positive_int, default=32, help="tokens to generate (default 32)")
    demo.add_argument("--device", help=DEVICE_HELP)
    demo.set_defaults(run=_demo)

    tiny = commands.add_parser(
        "tiny",
        help="write a tiny random-weight converted checkpoint to try the other commands on (offline)",
        description="Write to DIR a tiny Qwen3-VL with random weights, its byte-level tokenizer and image processor, "
        "converted as `convert` writes a checkpoint: `run` and `serve` take it "
        f"as MODEL, offline. Its answers are gibberish (random weights), {TINY_MAX_NEW_TOKENS} tokens unless a "
        "request asks for more.",
    )
    tiny.add_argument("dst", metavar="DIR", help="output folder: new, empty or a previous conversion")
    tiny.set_defaults(run=_tiny)

    runner = commands.add_parser(
        "run",
        help="answer a JSONL file of chat requests by continuous batching",
        description="Answer every chat request of INPUT (one JSON object per line: id, messages with image paths, "
        "URLs or base64, optional per-request settings such as max_new_tokens / temperature / seed) by continuous batching "
        "on the graph engine, appending each answer to OUTPUT as it finishes; a rerun skips ids OUTPUT holds. Exit "
        "status: 0 when every request was answered, 1 when any failed (its error record is in OUTPUT), 130 after "
        "Ctrl-C.",
    )
    runner.add_argument("model", metavar="MODEL", help="checkpoint folder or Hub repo id (stock or converted)")
    runner.add_argument("--input", type=Path, required=True,
                        help="requests, JSONL (image paths relative to its folder)")
    runner.add_argument("--output", type=Path, required=True, help="answers, JSONL (appended to)")
    runner.add_argument("--max-new-tokens", type=positive_int, help="per request, unless its line says (default: "
                        "the checkpoint's generation config, else as many as the request's cache row holds)")
    runner.add_argument("--greedy", action="store_true", help="greedy decoding (default: the checkpoint's "
                        "generation config, which samples for Qwen's checkpoints)")
    runner.add_argument("--slots", type=positive_int, help=SLOTS_HELP)
    runner.add_argument("--cache-len", type=positive_int, help="cache slots per request (static_cache_len)")
    runner.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto", help=KV_CACHE_DTYPE_HELP)
    runner.add_argument("--device", help=DEVICE_HELP)
    runner.set_defaults(check=_check_run, run=_run)

    server = commands.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API (pip install -e \".[serve]\")",
        description="Answer OpenAI-style chat and completion requests (text and images, streaming) over HTTP by "
        "continuous batching on the graph engine: POST /v1/chat/completions, POST /v1/completions, GET /v1/models, "
        "GET /health, GET /metrics. The model runs in an engine process of its own, the HTTP work in "
        "--api-server-count processes beside it. Ctrl-C or SIGTERM lets the requests in flight finish, then exits.",
    )
    server.add_argument("model", metavar="MODEL", help="checkpoint folder or Hub repo id (stock or converted)")
    server.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default 127.0.0.1: this machine only; 0.0.0.0: every interface)")
    server.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000; 0: any free one)")
    server.add_argument("--served-model-name", help="the model name requests give (default: MODEL as written)")
    server.add_argument("--api-key", default=os.environ.get("QWEN3VL_STATIC_API_KEY"),
                        help="require 'Authorization: Bearer KEY' on /v1 (default: $QWEN3VL_STATIC_API_KEY, else none)")
    server.add_argument("--api-server-count", type=positive_int,
                        help="HTTP processes, each parsing, rendering and streaming its share of the requests beside "
                        "the one engine process (default: one per four CPU cores, one to four)")
    server.add_argument("--slots", type=positive_int, help=SLOTS_HELP)
    server.add_argument("--cache-len", type=positive_int,
                        help="cache slots per request, prompt and answer (static_cache_len)")
    server.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto", help=KV_CACHE_DTYPE_HELP)
    server.add_argument("--max-prefill-tokens", type=positive_int,
                        help="prompt tokens admitted per turn of the batch (prefilled beside its decode chunks): "
                        "more admit waiting ones sooner, fewer slow the decoding rows' steps less (default 8192)")
    server.add_argument("--warmup", action="store_true",
                        help="capture the batch's CUDA graphs (every batch size, cache length and sampling mode) and "
                        "measure its kernels before taking requests, so that the first ones wait for neither")
    server.add_argument("--max-waiting", type=positive_int, default=256,
                        help="requests waiting for a free row; more get 503 (default 256)")
    server.add_argument("--max-request-mb", type=float, default=50, help="largest request body, MiB (default 50)")
    server.add_argument("--max-images", type=positive_int, default=8, help="images per request (default 8)")
    server.add_argument("--max-image-pixels", type=int, default=4096 * 4096,
                        help="pixels of an image, width x height (default 4096 x 4096)")
    server.add_argument("--max-image-mb", type=float, default=20, help="an image's encoded size, MiB (default 20)")
    server.add_argument("--media-timeout", type=float, default=10, help="seconds to fetch an image URL (default 10)")
    server.add_argument("--allowed-local-media-path", type=Path,
                        help="a folder whose images requests may name by file:// URL (default: none)")
    server.add_argument("--device", help=DEVICE_HELP)
    server.set_defaults(check=_check_serve, run=_serve)

    bench = commands.add_parser(
        "bench",
        help="benchmark against stock transformers (CUDA)",
        description="Decode ms/step at several batch sizes, TTFT and end-to-end tokens/s with a 448x448 image, "
        "for ours and stock transformers in one process, over random bf16 weights of a dense Qwen3-VL's shapes; "
        "writes JSON (and a PNG with matplotlib).",
    )
    bench.add_argument("--model", choices=MODELS, default="2b",
                       help="the dense Qwen3-VL whose shapes the random weights take (default: 2b)")
    bench.add_argument("--fp8", action="store_true",
                       help="also measure ours with the same weights in Qwen's FP8 format (system ours_fp8)")
    bench.add_argument("--batch-sizes", type=positive_int, nargs="+", default=[1, 4, 8],
                       help="batch sizes of the decode measurements (default: 1 4 8)")
    bench.add_argument("--context", type=int, default=512, help="prompt tokens of the decode measurements")
    bench.add_argument("--with-compile", action="store_true",
                       help="also measure stock cache_implementation='static' (auto-compile, ~45 s per shape)")
    bench.add_argument("--torch-ops", action="store_true", help="run our decode step on torch ops, not Triton kernels")
    bench.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                       help="what our KV cache stores in the decode, --batching and --server measurements: auto (the "
                       "model's dtype, default) or fp8 (float8 e4m3)")
    bench.add_argument("--prefill-graph-tokens", type=int,
                       help="our config's prefill_graph_tokens in the decode, --serving and --batching measurements "
                       "(default: the config's, 2048): the largest prefill replayed as a CUDA graph, in tokens")
    bench.add_argument("--serving", action="store_true",
                       help="also measure where users run it: sampling at Qwen's defaults and top-p alone against "
                       "greedy, TTFT of 8 image prompts in one batch, decode at 7800 / 4000 tokens of context and at "
                       "batch 64 (JSON key serving; a few minutes more)")
    bench.add_argument("--batching", action="store_true",
                       help="also measure 2,048 requests of uneven answer lengths (text, and an image each) by "
                       "continuous batching as generate_batch sizes it and at hand-set row counts, first and second "
                       "run (JSON key batching; a few minutes more)")
    bench.add_argument("--batching-only", action="store_true",
                       help="only the --batching measurement (its own JSON, *-batching-DATE.json)")
    bench.add_argument("--batching-workloads", nargs="+", choices=("text", "image"), default=["text", "image"],
                       help="the --batching workloads to run (default: both)")
    bench.add_argument("--batching-slots", type=int, nargs="*", default=[256, 512],
                       help="rows set by hand for the --batching text workload, beside the defaults (default: 256 512)")
    bench.add_argument("--server", action="store_true",
                       help="only the OpenAI server's measurement: `serve` in a process of its own, 1 / 16 / 64 / 256 "
                       "streaming clients over HTTP, each a 448x448 image + 30-token question and 128 new tokens "
                       "(its own JSON, *-server-DATE.json; needs the serve extra)")
    bench.add_argument("--server-concurrency", type=int, nargs="+", default=[1, 16, 64, 256],
                       help="the --server concurrencies (default: 1 16 64 256)")
    bench.add_argument("--server-requests-per-client", type=positive_int, default=4,
                       help="requests each --server client sends, one after another (default: 4; each concurrency "
                            "sends at least 16 in all)")
    bench.add_argument("--server-passes", type=positive_int, default=1,
                       help="--server passes over the concurrencies after the first (which meets graph captures and "
                            "kernel measurements); past 1, each concurrency's median and range over them (default: 1)")
    bench.add_argument("--server-client-processes", type=positive_int,
                       help="processes the --server clients run in (default: one per 16 clients, at most half the "
                            "cores; 1: every client in the bench's own process)")
    bench.add_argument("--server-api-server-count", type=positive_int,
                       help="the --server server's HTTP processes (default: serve's)")
    bench.add_argument("--server-max-prefill-tokens", type=positive_int,
                       help="the --server server's --max-prefill-tokens (default: serve's)")
    bench.add_argument("--server-warmup", action="store_true", help="start the --server server with --warmup")
    bench.add_argument("--speculative", action="store_true",
                       help="only speculative decoding's parts (a random EAGLE-3 draft of the published format) beside "
                            "the plain decode step, at K = 1..7 draft tokens")
    bench.add_argument("--out", type=Path, default=Path("bench/results"),
                       help="folder for the JSON (and PNG) results (default: bench/results)")
    bench.set_defaults(check=_check_bench, run=_bench)
    return parser


def _device(args):
    import torch

    return torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))


def _convert(args) -> int:
    from .convert import convert

    dst = convert(args.src, args.dst, push_to_hub=args.push_to_hub, private=args.private)
    print(f"converted {args.src} to {dst}" + (f" and pushed it to {args.push_to_hub}" if args.push_to_hub else ""))
    return 0


def _demo(args) -> int:
    import torch
    from PIL import Image
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    from .workloads import build_models, image_prompt
    from .modeling_qwen3vl_graph import Qwen3VLGraphForConditionalGeneration
    from .presets import tiny_config, tiny_config_dict, tiny_inputs, tiny_tokenizer

    device = _device(args)
    if device.type == "cuda":
        model, _ = build_models(device, torch.bfloat16)
        inputs = image_prompt(model.config, device, torch.Generator().manual_seed(0))
        print("model: real Qwen3-VL-2B shapes, random bf16 weights;", f"prompt: {inputs['input_ids'].shape[1]} tokens")
        print(f"captured CUDA graphs in {model.warmup(batch_sizes=[1], modes=('greedy',)):.2f} s")
        decode = None
    else:
        torch.manual_seed(0)
        model = Qwen3VLGraphForConditionalGeneration(tiny_config()).eval()
        stock = Qwen3VLForConditionalGeneration(Qwen3VLConfig(**tiny_config_dict())).eval()
        stock.load_state_dict(model.state_dict())
        chat = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is in the image?"}]}]
        inputs = tiny_inputs([chat], images=[Image.new("RGB", (96, 64), "orange")])
        decode = tiny_tokenizer().decode
        print(f"model: tiny random Qwen3-VL on the CPU; prompt: {inputs['input_ids'].shape[1]} tokens")
    kwargs = dict(max_new_tokens=args.new_tokens, do_sample=False)
    model.generate(**inputs, **kwargs)  # first call allocates the cache (and on CUDA warms the kernels)
    if device.type == "cuda":
        torch.cuda.synchronize()
    began = time.perf_counter()
    ours = model.generate(**inputs, **kwargs)
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - began
    new = ours[0, inputs["input_ids"].shape[1]:]
    print(f"generated {len(new)} tokens in {1000 * seconds:.1f} ms ({len(new) / seconds:.1f} tokens/s in one run, "
          "prefill included; `python -m qwen3vl_static bench` measures speed)")
    print("tokens:", new.tolist() if decode is None else repr(decode(new)))
    print("(random weights: the tokens are gibberish, as expected; the check is that they are the same tokens)")
    if device.type == "cuda":
        # In bf16 the contract is graphs == the eager static path; stock bf16 kernels round differently, and random
        # weights leave near-ties that flip on such rounding.
        model.set_cuda_graphs(False)
        expected = model.generate(**inputs, **kwargs)
        model.set_cuda_graphs(True)
        reference = "the same steps run eagerly (no CUDA graphs)"
    else:
        expected = stock.generate(**inputs, **kwargs)
        reference = "stock transformers generate"
    same = torch.equal(ours, expected)
    print(f"same tokens as {reference}:", same)
    return 0 if same else 1


def _check_run(args) -> None:
    qwen3vl_config_file(args.model, "MODEL")
    if not args.input.is_file():
        raise ValueError(f"--input {args.input}: no such file")
    if not any(line.strip() for line in args.input.read_text().splitlines()):
        raise ValueError(f"--input {args.input} holds no requests (one JSON object per line)")
    if not args.output.parent.is_dir():
        raise ValueError(f"--output {args.output}: no folder {args.output.parent}")


def _run(args) -> int:
    import torch

    from .dataset_runner import load_processor, merge_in_input_order, read_records, run_dataset
    from .modeling_qwen3vl_graph import Qwen3VLGraphForConditionalGeneration

    # Under torchrun: one process (and model) per GPU, requests shared out by cost, the answers merged by rank 0.
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    device = _device(args)
    if world > 1:
        import torch.distributed as dist

        if device.type == "cuda":
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    overrides = cache_overrides(args.cache_len, args.kv_cache_dtype)
    failure, counts = None, None
    try:
        model = Qwen3VLGraphForConditionalGeneration.from_pretrained(
            args.model, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32, **overrides).to(device).eval()
        if args.greedy:
            model.generation_config.update(do_sample=False, temperature=None, top_k=None, top_p=None)
        settings = {} if args.max_new_tokens is None else {"max_new_tokens": args.max_new_tokens}
        counts = run_dataset(model, load_processor(args.model), args.input, args.output, rank=rank, world=world,
                             max_batch_size=args.slots, **settings)
    except KeyboardInterrupt:
        answered = sum(record["error"] is None for _, record in read_records(args.output))
        print(f"interrupted; answers in {args.output} so far: {answered}" + (" (and in its part files)" if world > 1
              else "") + "; the same command again answers the rest", file=sys.stderr)
        return 130
    except Exception as error:  # noqa: BLE001 - every rank learns which failed; what they wrote stays
        if world == 1:
            raise
        failure = f"rank {rank} of {world}: {type(error).__name__}: {error}"
    outcomes = [(failure, counts)]
    if world > 1:
        outcomes = [None] * world
        dist.all_gather_object(outcomes, (failure, counts))
        dist.destroy_process_group()
    failures = [failure for failure, _ in outcomes if failure is not None]
    if failures:
        raise RuntimeError("; ".join(failures) + f" (what was answered stays in {args.output} and its part files: "
                           "run again to finish)")
    if world > 1 and rank == 0:
        merge_in_input_order(args.input, args.output)
    where = f"rank {rank} of {world}: " if world > 1 else ""
    print(f"{where}answered {counts['answered']}, failed {counts['failed']}, skipped {counts['skipped']} (already "
          f"answered); {counts['generated_tokens']} tokens in {counts['seconds']:.1f} s")
    failed = sum(each["failed"] for _, each in outcomes)
    if failed and rank == 0:  # rank 0 alone: torchrun stops every rank when one exits non-zero, maybe mid-merge
        answered = sum(each["answered"] for _, each in outcomes)
        raise RuntimeError(f"requests failed: {failed}, answered: {answered}; the error records are in {args.output} "
                           "and the same command again retries them")
    return 0


def _check_bench(args) -> None:
    """`--batching-only`, `--server` and `--speculative` each measure only their own part: one at a time, and without
    the flags of the measurements they leave out; and a measurement's own flags (`--server-passes`) only with it.
    Otherwise those flags would be ignored without a word."""
    alone = [flag for flag, given in (("--batching-only", args.batching_only), ("--server", args.server),
                                      ("--speculative", args.speculative)) if given]
    if len(alone) > 1:
        raise ValueError(f"{' and '.join(alone)} each measure only their own part: choose one")
    unused = [flag for flag, given in (("--fp8", args.fp8), ("--with-compile", args.with_compile),
                                       ("--serving", args.serving)) if given]
    if alone and unused:
        raise ValueError(f"{', '.join(unused)}: not measured with {alone[0]}, which measures only its own part "
                         f"(drop it, or leave out {alone[0]} for the full benchmark)")
    defaults = vars(build_parser().parse_args(["bench"]))
    for prefix, owner, given in (("server_", "--server", args.server),
                                 ("batching_", "--batching or --batching-only", args.batching or args.batching_only)):
        stray = [f"--{name.replace('_', '-')}" for name, value in vars(args).items()
                 if name.startswith(prefix) and name != "batching_only" and value != defaults[name]]
        if stray and not given:
            raise ValueError(f"{', '.join(stray)}: read only by {owner} (add it, or drop them)")


def _check_serve(args) -> None:
    qwen3vl_config_file(args.model, "MODEL")


def cache_overrides(cache_len: int | None, kv_cache_dtype: str = "auto") -> dict:
    """The config settings `--cache-len` and `--kv-cache-dtype` give `from_pretrained`."""
    return {**({} if cache_len is None else {"static_cache_len": cache_len}),
            **({} if kv_cache_dtype == "auto" else {"kv_cache_dtype": kv_cache_dtype})}


def load_for_serving(path: str, device: str, cache_len: int | None, kv_cache_dtype: str = "auto"):
    """The converted model at `path` on `device` (bfloat16 on CUDA, else float32): what `serve`'s engine process
    builds."""
    import torch

    from .modeling_qwen3vl_graph import Qwen3VLGraphForConditionalGeneration

    device = torch.device(device)
    return Qwen3VLGraphForConditionalGeneration.from_pretrained(
        path, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32,
        **cache_overrides(cache_len, kv_cache_dtype)).to(device).eval()


def _serve(args) -> int:
    from functools import partial

    from .dataset_runner import load_processor
    from .media import MediaLimits
    from .server import ServerLimits, serve

    mib = 2**20
    serve(partial(load_for_serving, args.model, str(_device(args)), args.cache_len, args.kv_cache_dtype),
          partial(load_processor, args.model), args.served_model_name or args.model, host=args.host, port=args.port,
          api_servers=args.api_server_count, max_batch_size=args.slots, max_prefill_tokens=args.max_prefill_tokens,
          warmup=args.warmup, api_key=args.api_key,
          limits=ServerLimits(max_waiting=args.max_waiting, max_body_bytes=int(args.max_request_mb * mib),
                              max_images=args.max_images),
          media=MediaLimits(max_bytes=int(args.max_image_mb * mib), max_pixels=args.max_image_pixels,
                            timeout_s=args.media_timeout, allowed_local_path=args.allowed_local_media_path))
    return 0


def _tiny(args) -> int:
    import tempfile

    from .convert import convert
    from .presets import save_tiny_checkpoint

    from transformers import GenerationConfig

    with tempfile.TemporaryDirectory() as stock:
        dst = convert(save_tiny_checkpoint(Path(stock)), args.dst)
    # Random weights seldom draw EOS: answers as long as a row holds (4,000 tokens) would take minutes on a CPU.
    generation_config = GenerationConfig.from_pretrained(dst)
    generation_config.max_new_tokens = TINY_MAX_NEW_TOKENS
    generation_config.save_pretrained(dst)
    print(f"wrote a tiny random-weight Qwen3-VL checkpoint to {dst} (e.g. python -m qwen3vl_static run {args.dst} "
          "--input requests.jsonl --output answers.jsonl)")
    return 0


def _bench(args) -> int:
    from .bench import report, run

    path = report(run(args), args.out)
    print(f"wrote {path}")
    return 0
