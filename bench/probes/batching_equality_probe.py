"""Why continuous batching's graphs and its eager static path can part (H200, 2B shapes, 8 rows): the CUDA test's 12
requests (text and 448x448-image prompts, uneven answer lengths) run with graphs twice (graphs captured on the way,
then all captured), without the vision tower run ahead, and eagerly; per request, its row, and where each run's tokens
first differ from the first graph run's. Then plain `generate` of 8 rows, graphs twice and eagerly.

Run: `python bench/probes/batching_equality_probe.py` (writes $OUT/batching-equality-probe.json).
"""

import json
import os
from pathlib import Path

import torch

from qwen3vl_static.batching_qwen3vl_graph import GraphBatchingManager
from qwen3vl_static.workloads import build_models, image_prompt, text_prompt


def first_difference(a, b):
    differ = (index for index, (x, y) in enumerate(zip(a, b)) if x != y)
    return next(differ, None if len(a) == len(b) else min(len(a), len(b)))


def main():
    out = Path(os.environ.get("OUT", "bench/results"))
    ours, _ = build_models(torch.device("cuda"), torch.bfloat16, static_cache_len=1024, max_batch_size=8)
    generator = torch.Generator().manual_seed(9)
    requests = [{**(image_prompt(ours.config, "cuda", generator) if index % 3 == 0
                    else text_prompt(ours.config, 1, 40 + 23 * index, "cuda", generator)),
                 "max_new_tokens": 6 + 13 * index} for index in range(12)]
    rows = {}
    admit = GraphBatchingManager._admit

    def recording_admit(self, request, row, engine):
        rows[request.output.request_id] = row
        return admit(self, request, row, engine)

    GraphBatchingManager._admit = recording_admit
    runs = {}
    vision = ours.graph_engine().vision
    for name, graphs, ahead in (("graphs", True, True), ("graphs again", True, True), ("no run-ahead", True, False),
                                ("eager", False, True)):
        ours.set_cuda_graphs(graphs)
        if not ahead:
            vision.encode_ahead = lambda *args, **kwargs: None
        try:
            results = ours.generate_batch(requests, progress_bar=False)
        finally:
            ours.set_cuda_graphs(True)
            vision.__dict__.pop("encode_ahead", None)
        runs[name] = [result.generated_tokens for result in results.values()]
        print(name, "errors:", [result.error for result in results.values() if result.error])
    report = {"rows": rows, "requests": []}
    for index, request in enumerate(requests):
        entry = {"index": index, "image": "pixel_values" in request, "prompt": request["input_ids"].shape[1],
                 "new_tokens": request["max_new_tokens"], "row": rows.get(f"req_{index}")}
        for name in list(runs)[1:]:
            entry[name] = first_difference(runs["graphs"][index], runs[name][index])
        report["requests"].append(entry)
        print(entry)
    prompt = text_prompt(ours.config, 8, 120, "cuda", generator)
    plain = {}
    for name, graphs in (("graphs", True), ("graphs again", True), ("eager", False)):
        ours.set_cuda_graphs(graphs)
        plain[name] = ours.generate(**prompt, max_new_tokens=150, do_sample=False)[:, 120:].tolist()
    ours.set_cuda_graphs(True)
    report["plain_8_rows"] = {name: [first_difference(a, b) for a, b in zip(plain["graphs"], tokens)]
                              for name, tokens in plain.items()}
    print("plain generate, 8 rows:", report["plain_8_rows"])
    out.mkdir(parents=True, exist_ok=True)
    (out / "batching-equality-probe.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
