"""Where does a decode step's time go beyond its kernels? (H200 probe; JSON to $OUT.)

Real Qwen3-VL-2B shapes, random bf16 weights, a 512-token prompt, KV bucket 1024, batch 1, 4 and 8:
- "device_ms": the greedy step's graph replayed back to back (8 replays per chunk, as `steps_per_sync`, with no
  host read between chunks): the GPU's time per step;
- "chunked_ms": the same steps through `runner.token_steps`, which reads each chunk's tokens on the host: the
  difference is the host turnaround between chunks, per step;
- "settled": the near-tied choices (`runner.settle_near_ties`, as `model.warmup` runs it) and each candidate's ms/step;
- "forced": device_ms with each measured choice of this batch size forced to each of its candidates (do the choices,
  timed alone or settled in the step, agree with the step?);
- "pdl": device_ms with programmatic dependent launch off and on, the measured choices as they are;
- "kernels_batch1": every kernel of one batch-1 step in launch order, with its microseconds.
Run: python bench/step_probe.py
"""

import json
import os

import torch

from qwen3vl_static import kernels_qwen3vl_graph as kernels
from qwen3vl_static.bench import build_models, text_prompt

Triton = kernels.TritonDecodeOps
START, CHUNKS = 520, 30
ours, _ = build_models(torch.device("cuda"), torch.bfloat16, static_cache_len=1024, max_batch_size=8)
runner = ours._runner
per_chunk = runner.steps_per_sync


def rewind(batch):
    runner.batch_size, runner.length = batch, START
    runner.cache_lens[:batch].fill_(START)  # slots up to START + CHUNKS * per_chunk were written by earlier steps


def device_ms(batch, reps=2):
    rewind(batch)
    runner.token_steps(runner.input_ids[:batch, 0].clone(), per_chunk, "greedy")  # captures if needed
    graph = runner.graphs[(batch, 1024, "greedy")]
    best = float("inf")
    for _ in range(reps):
        rewind(batch)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(CHUNKS):
            runner.chunk_step.zero_()
            for _ in range(per_chunk):
                graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / (CHUNKS * per_chunk))
    return best


def chunked_ms(batch, reps=3):
    best = float("inf")
    for _ in range(reps):
        rewind(batch)
        tokens = runner.input_ids[:batch, 0].clone()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(CHUNKS):
            runner.length = START
            chunk, _ = runner.token_steps(tokens, per_chunk, "greedy")
            tokens = chunk[:, -1].to("cuda")
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / (CHUNKS * per_chunk))
    return best


results = {}
for batch in (1, 4, 8):
    ours.generate(**text_prompt(ours.config, batch, 512, "cuda", torch.Generator().manual_seed(batch)),
                  max_new_tokens=16, do_sample=False)  # a request of this size: measures the choices
    runner.settle_near_ties(batch, 1024, "greedy")
    runner.graphs.clear()  # captured before the settling
    runner.unfinished[:batch] = True
    settled = {f"{op} {shape}": per_step for (op, shape, _), per_step in Triton.step_timings.items()
               if shape.startswith(f"{batch}x")}
    row = {"device_ms": device_ms(batch), "chunked_ms": chunked_ms(batch), "settled": settled, "forced": {}}
    keys = [key for key in Triton.choices
            if key[1].startswith(f"{batch}x") or key[1].startswith(f"{batch} rows x 1024 slots")]
    for key in keys:
        chosen = Triton.choices[key]
        timings = {}
        for index in range(len(Triton.timings[key])):
            Triton.choices[key] = index
            runner.graphs.clear()
            timings[index] = device_ms(batch)
        Triton.choices[key] = chosen
        runner.graphs.clear()
        row["forced"][f"{key[0]} {key[1]}"] = {"chosen": chosen, "isolated_us": Triton.timings[key], "step_ms": timings}
    row["pdl"] = {}
    for pdl in (False, True):
        Triton.PDL = pdl
        runner.graphs.clear()
        row["pdl"][f"pdl={pdl}"] = device_ms(batch)
    runner.graphs.clear()
    results[f"batch{batch}"] = row
    print(batch, json.dumps(row), flush=True)

rewind(1)
runner.token_steps(runner.input_ids[:1, 0].clone(), per_chunk, "greedy")
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
    rewind(1)
    runner.chunk_step.zero_()
    runner.graphs[(1, 1024, "greedy")].replay()
    torch.cuda.synchronize()
events = sorted((event for event in profile.events() if event.device_type == torch.autograd.DeviceType.CUDA),
                key=lambda event: event.time_range.start)
results["kernels_batch1"] = [[event.name[:80], round(event.time_range.elapsed_us(), 2),
                              round(event.time_range.start - events[0].time_range.start, 2)] for event in events]
print("kernels in one batch-1 step:", len(events))
out_dir = os.environ.get("OUT", "bench/results")
with open(os.path.join(out_dir, "step-probe.json"), "w") as handle:
    json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, **results}, handle, indent=1)
