"""Would prefills beside the decode chunks pay (docs/design.md, the 64-client analysis)? B decoding rows of P-token
contexts step N times while a prefill of R fresh prompts of T tokens runs (today's admission piece: 8 x 256), each a
CUDA graph of its own pool and capture stream:

- `sequential`: the prefill, then the N steps, on one stream (how an admission holds decoding rows up today);
- `beside`: the N steps on a stream of the device's greatest priority, the prefill on one of the least, both let go
  at once (`beside_equal`: both streams of one priority);
- `beside_prefill_<S>_sms` (`--prefill-sms S ...`): the prefill on the stream of a CUDA green context of S SMs, the
  steps on one of the whole device: the prefill cannot take every SM, so the steps, bound by memory, keep some
  (`_captured_there`: the prefill's graph captured on that stream, in case a graph's kernels keep the context of their
  capture).

Reported per form: the wall time of the whole, the decode steps' durations (p50, max: what a stream's tokens wait
for) and when the prefill ended, beside the decode step and the prefill timed alone; and whether the decoding rows'
logits and the prompts' logits equal those of the two run apart, bit for bit (the graphs share only the weights and
the cache, in rows of their own). Decoding is bound by memory and prefill by compute, so beside each other they could
take less than one after the other; the tower beside the chunks cost offline images 2 s of 8.5 (design.md).

H200, bf16 2B; JSON to $OUT. Run: `python bench/probes/prefill_beside_probe.py [--rows 64 256] [--context 300]
[--prompts 8] [--prompt-tokens 256] [--steps 16] [--prefill-sms 64 96]`. `--check` runs the setup eagerly on the CPU's tiny model (shapes
and calls only, no timing).
"""

import argparse
import statistics

import torch

from qwen3vl_static.capture_qwen3vl_graph import GraphCapturer


class Setup:
    """`rows` decoding rows of `context` cached tokens each (cache rows 0..rows-1) and `prompts` fresh prompts of
    `tokens` tokens for the rows after them, on `model`'s engine."""

    def __init__(self, model, rows: int, context: int, prompts: int, tokens: int, generator):
        engine = model.graph_engine()
        self.engine, self.generator = engine, generator
        self.decode, self.prefill, self.text = engine.decode, engine.prefill, engine.text
        device = engine.device
        ids, positions = self.text_prompt(rows, context)
        cache_rows = torch.arange(rows, device=device)
        self.prefill.run(ids, None, positions, torch.zeros_like(ids), rows=cache_rows)  # the contexts, eagerly
        decode = self.decode
        decode.open_slots(0)
        decode.admit(cache_rows, ids[:, -1], torch.full((3, rows), context, device=device),
                     torch.ones(rows, context, dtype=torch.long, device=device))
        decode.continue_rows(rows, context)
        self.rows, self.kv_len = rows, next(size for size in decode.cache_buckets if size > context)
        # The prompts: static tensors, as a prefill graph's buffers hold them.
        self.ids, self.positions = self.text_prompt(prompts, tokens)
        self.modality = torch.zeros_like(self.ids)
        self.visual = torch.zeros(1, self.text.embed.shape[1], device=device, dtype=engine.dtype)
        self.deepstack = [self.visual] * len(model.config.vision_config.deepstack_visual_indexes)
        self.attendable = torch.ones(prompts, tokens, dtype=torch.bool, device=device)
        self.start = torch.zeros(1, dtype=torch.long, device=device)
        self.last = torch.full((1,), tokens - 1, dtype=torch.long, device=device)
        self.prompt_rows = torch.arange(rows, rows + prompts, device=device)
        self.decode_logits = self.prompt_logits = None

    def text_prompt(self, batch: int, length: int) -> tuple:
        """Random token ids `(batch, length)` and their text M-RoPE positions, on the device."""
        device, vocab = self.engine.device, self.text.embed.shape[0]
        ids = torch.randint(0, vocab, (batch, length), generator=self.generator).to(device)
        return ids, torch.arange(length, device=device).expand(3, batch, length).contiguous()

    def decode_step(self):
        self.decode_logits = self.decode.forward(self.rows, self.kv_len)

    def prefill_step(self):
        self.prompt_logits = self.prefill.forward(self.ids, self.positions, self.attendable, self.modality, self.visual,
                                                  self.deepstack, self.start, self.last, self.prompt_rows, False)


def timed(decode_graph, prefill_graph, steps: int, form: str, streams: dict) -> dict:
    """One run of `form`; CUDA events around each decode step and the prefill, from a common start."""
    start = torch.cuda.Event(enable_timing=True)
    step_events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(steps)]
    prefill_end = torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000)  # the launches queue up behind it: none waits for the host
    start.record()
    decode_stream, prefill_stream = streams[form]
    for stream in {decode_stream, prefill_stream}:
        stream.wait_event(start)
    with torch.cuda.stream(prefill_stream):
        prefill_graph.replay()
        prefill_end.record()
    with torch.cuda.stream(decode_stream):
        for before, after in step_events:
            before.record()
            decode_graph.replay()
            after.record()
    torch.cuda.synchronize()
    steps_ms = [before.elapsed_time(after) for before, after in step_events]
    return {"wall_ms": max(start.elapsed_time(step_events[-1][1]), start.elapsed_time(prefill_end)),
            "decode_step_ms_p50": statistics.median(steps_ms), "decode_step_ms_max": max(steps_ms),
            "prefill_end_ms": start.elapsed_time(prefill_end)}


def alone_ms(graph, stream, repeats: int) -> float:
    """`graph`'s replay on `stream` with nothing beside it, ms (median of `repeats`)."""
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        with torch.cuda.stream(stream):
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            graph.replay()
            end.record()
        torch.cuda.synchronize()
        times.append(begin.elapsed_time(end))
    return statistics.median(times)


def measure(args) -> None:
    import harness
    from qwen3vl_static.workloads import build_ours

    harness.require_cuda()
    model = build_ours(torch.device("cuda"), torch.bfloat16, max_batch_size=max(args.rows) + args.prompts,
                       static_cache_len=max(512, args.prompt_tokens, args.context + 64))
    least, greatest = torch.cuda.Stream.priority_range()
    high, low, one, other = (torch.cuda.Stream(priority=greatest), torch.cuda.Stream(priority=least),
                             torch.cuda.Stream(), torch.cuda.Stream())
    streams = {"sequential": (one, one), "beside": (high, low), "beside_equal": (one, other)}
    unsupported, contexts = {}, []  # a green context freed takes its streams' work down with it
    for sms in args.prefill_sms:
        try:
            contexts.append(green_context(sms))
            streams[f"beside_prefill_{sms}_sms"] = streams[f"beside_prefill_{sms}_sms_captured_there"] = (
                one, contexts[-1].Stream())
        except Exception as error:  # noqa: BLE001 - this torch, driver or device has none: said in the JSON
            unsupported[f"beside_prefill_{sms}_sms"] = f"{type(error).__name__}: {error}"
    results, graphs = [], []  # every graph kept: a pool whose graphs are all gone cannot take a new capture
    with torch.no_grad():
        for rows in args.rows:
            setup = Setup(model, rows, args.context, args.prompts, args.prompt_tokens,
                          torch.Generator().manual_seed(rows))
            engine = setup.engine
            decode_graph = engine.capturer.capture(setup.decode_step, name=f"decode {rows}")
            prefill_graph = GraphCapturer(streams_of=engine.capturer).capture(
                setup.prefill_step, name=f"prefill {args.prompts} x {args.prompt_tokens}")
            graphs += [decode_graph, prefill_graph]
            decode_graph.replay()
            prefill_graph.replay()
            torch.cuda.synchronize()
            apart = setup.decode_logits.clone(), setup.prompt_logits.clone()
            alone = timed(decode_graph, prefill_graph, args.steps, "sequential", streams)
            row = {"decode_rows": rows, "context": args.context, "prompts": args.prompts,
                   "prompt_tokens": args.prompt_tokens, "steps": args.steps}
            for form in streams:
                try:
                    form_prefill = prefill_graph
                    if form.endswith("_captured_there"):  # kernel nodes may keep the context they were captured in
                        form_prefill = torch.cuda.CUDAGraph()
                        with torch.cuda.graph(form_prefill, stream=streams[form][1]):
                            setup.prefill_step()
                        graphs.append(form_prefill)
                    runs = [timed(decode_graph, form_prefill, args.steps, form, streams) for _ in range(args.repeats)]
                except RuntimeError as error:  # a green context's stream the graphs or events cannot use
                    unsupported[form] = f"{type(error).__name__}: {error}"
                    torch.cuda.synchronize()
                    continue
                row[form] = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
                if form.startswith("beside_prefill_"):  # what the SMs it has give the prefill alone
                    row[form]["prefill_alone_ms"] = alone_ms(form_prefill, streams[form][1], args.repeats)
                row[form]["wall_ms_range"] = [min(run["wall_ms"] for run in runs), max(run["wall_ms"] for run in runs)]
                row[form]["logits_equal_apart"] = bool(torch.equal(setup.decode_logits, apart[0])
                                                       and torch.equal(setup.prompt_logits, apart[1]))
            # Each alone: the prefill's time in the sequential form, a step's median there.
            row["prefill_alone_ms"], row["decode_step_alone_ms"] = alone["prefill_end_ms"], alone["decode_step_ms_p50"]
            print(row, flush=True)
            results.append(row)
            del setup
            torch.cuda.empty_cache()
    harness.write_json({"rows": results, "sm_count": torch.cuda.get_device_properties(0).multi_processor_count,
                        "unsupported": unsupported})


def green_context(sms: int):
    """A new CUDA green context of `sms` SMs (kernels launched on its streams run on those alone)."""
    from torch.cuda.green_contexts import GreenContext

    return GreenContext.create(num_sms=sms, device_id=torch.cuda.current_device())


def check() -> None:
    from qwen3vl_static import Qwen3VLGraphForConditionalGeneration
    from qwen3vl_static.presets import tiny_config

    torch.manual_seed(0)
    model = Qwen3VLGraphForConditionalGeneration(tiny_config(static_cache_len=64, max_batch_size=8)).eval()
    with torch.no_grad():
        setup = Setup(model, rows=3, context=20, prompts=2, tokens=16, generator=torch.Generator().manual_seed(1))
        setup.decode_step()
        setup.prefill_step()
    vocab = model.config.text_config.vocab_size
    assert tuple(setup.decode_logits.shape) == (3, vocab) and tuple(setup.prompt_logits.shape) == (2, vocab)
    assert setup.decode_logits.isfinite().all() and setup.prompt_logits.isfinite().all()
    print("setup runs: decode logits", tuple(setup.decode_logits.shape), "prompt logits",
          tuple(setup.prompt_logits.shape))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--prefill-sms", type=int, nargs="*", default=[],
                        help="also run the prefill on a green context of each many SMs (the device's SM count: in the JSON)")
    args = parser.parse_args()
    check() if args.check else measure(args)


if __name__ == "__main__":
    main()
