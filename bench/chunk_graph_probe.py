"""Does a graph of a whole chunk of decode steps beat one graph per step replayed `steps_per_sync` times? (H200
probe; JSON to $OUT.) Between two replays of a step graph the GPU finishes one graph and starts the next, outside
the programmatic-dependent-launch chain; inside one graph of 8 steps each step's first kernel follows the previous
step's last like any other. Real Qwen3-VL-2B shapes, random bf16 weights, KV bucket 1024, batch 1, 4 and 8: ms per
step of each form (fastest of 5 runs of 30 chunks), and whether both give the same tokens.
Run: python bench/chunk_graph_probe.py
"""

import json
import os

import torch

from qwen3vl_static.bench import build_models, text_prompt

START, CHUNKS = 520, 30
ours, _ = build_models(torch.device("cuda"), torch.bfloat16, static_cache_len=1024, max_batch_size=8)
runner = ours._runner
per_chunk = runner.steps_per_sync


def rewind(batch):
    runner.batch_size, runner.length = batch, START
    runner.cache_lens[:batch].fill_(START)
    runner.positions[:, :batch].fill_(START)
    runner.input_ids[:batch, 0].fill_(7)
    runner.unfinished[:batch] = True


def timed(replay_chunk, batch, reps=5):
    best, tokens = float("inf"), None
    for _ in range(reps):
        rewind(batch)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(CHUNKS):
            runner.chunk_step.zero_()
            replay_chunk()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / (CHUNKS * per_chunk))
        tokens = runner.out_tokens[:batch, :per_chunk].tolist()
    return best, tokens


results = {}
for batch in (1, 4, 8):
    ours.generate(**text_prompt(ours.config, batch, 512, "cuda", torch.Generator().manual_seed(batch)),
                  max_new_tokens=16, do_sample=False)  # a request of this size: measures the choices
    runner.settle_near_ties(batch, 1024, "greedy")
    rewind(batch)
    single = runner.capture(batch, 1024, "greedy")
    step, state = runner.graph_step(batch, 1024, "greedy")

    def chunk_step():
        for _ in range(per_chunk):
            step()

    rewind(batch)
    chunk = runner.capturer.capture(chunk_step, state, name=f"decode chunk ({batch} rows)")
    row = {}
    for _ in range(2):  # alternated, twice
        one_ms, one_tokens = timed(lambda: [single.replay() for _ in range(per_chunk)], batch)
        chunk_ms, chunk_tokens = timed(chunk.replay, batch)
        row.setdefault("per_step_graph_ms", []).append(one_ms)
        row.setdefault("chunk_graph_ms", []).append(chunk_ms)
        row["same_tokens"] = row.get("same_tokens", True) and one_tokens == chunk_tokens
    results[f"batch{batch}"] = row
    print(batch, json.dumps(row), flush=True)
    del chunk
    runner.graphs.clear()

out_dir = os.environ.get("OUT", "bench/results")
with open(os.path.join(out_dir, "chunk-graph-probe.json"), "w") as handle:
    json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, **results}, handle, indent=1)
