"""Which flash-decoding tile makes the decode step fastest? (H200 probe; JSON to $OUT.)

Attention timed alone misleads (its cost in the step depends on the kernels around it), so for each
(`TritonDecodeOps.CHUNK`, `ATTENTION_WARPS`) setting this recaptures the decode graphs, lets `decode_attention`
measure its candidates again, and times greedy decode of the real Qwen3-VL-2B shapes (random bf16 weights,
512-token prompt, KV bucket 1024) at batch 1, 4 and 8 as the benchmark does: the slope between 16 and 80 new
tokens, best of 3. Every setting must generate the same tokens as the first. Run: python bench/attention_probe.py
"""

import json
import os
import time

import torch

from qwen3vl_static import kernels_qwen3vl_graph as kernels
from qwen3vl_static.bench import LONG, SHORT, build_models, text_prompt

Triton = kernels.TritonDecodeOps
SETTINGS = [(64, 4), (32, 4), (32, 2), (64, 2), (128, 4), (128, 8), (64, 4)]  # (CHUNK, ATTENTION_WARPS)

ours, _ = build_models(torch.device("cuda"), torch.bfloat16, static_cache_len=1024, max_batch_size=8)
assert ours._runner.ops is Triton
prompts = {batch: text_prompt(ours.config, batch, 512, "cuda", torch.Generator().manual_seed(batch)) for batch in (1, 4, 8)}


def run(prompt, new_tokens):
    torch.cuda.synchronize()
    began = time.perf_counter()
    out = ours.generate(**prompt, max_new_tokens=new_tokens, do_sample=False)
    torch.cuda.synchronize()
    assert out.shape[1] - prompt["input_ids"].shape[1] == new_tokens
    return out, time.perf_counter() - began


results, reference = [], {}
for chunk, warps in SETTINGS:
    Triton.CHUNK, Triton.ATTENTION_WARPS = chunk, warps
    for key in [key for key in Triton.choices if key[0] == "decode_attention"]:
        del Triton.choices[key]
    ours._runner.graphs.clear()
    row = {"chunk": chunk, "warps": warps}
    for batch, prompt in prompts.items():
        run(prompt, SHORT)
        slopes = []
        for _ in range(3):
            _, short = run(prompt, SHORT)
            out, long = run(prompt, LONG)
            slopes.append(1000 * (long - short) / (LONG - SHORT))
        reference.setdefault(batch, out)
        row[f"batch{batch}_ms_per_step"] = min(slopes)
        row[f"batch{batch}_same_tokens"] = bool(torch.equal(out, reference[batch]))
    row["attention_choices"] = {key[1]: {"choice": Triton.choices[key], "us": Triton.timings[key]}
                                for key in Triton.choices if key[0] == "decode_attention"}
    results.append(row)
    print(json.dumps(row), flush=True)
out_dir = os.environ.get("OUT", "bench/results")
with open(os.path.join(out_dir, "attention-probe.json"), "w") as handle:
    json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": kernels.triton.__version__,
               "settings": results}, handle, indent=1)
