"""Does prefetching the next projections' weights into L2, beside each layer's attention, shorten the decode step?
(H200 probe; JSON to $OUT.)

For each `TritonDecodeOps.L2_PREFETCH` setting (fractions of each row of o_proj, gate/up and down), recaptures the
decode graphs and times greedy decode of the real Qwen3-VL-2B shapes (random bf16 weights, 512-token prompt, KV
bucket 1024) at batch 1, 4 and 8 as the benchmark does: the slope between 16 and 80 new tokens, best of 3. Every
setting must generate the same tokens as the first (a prefetch is only a hint). "per-line" uses one prefetch
instruction per 128-byte line instead of TMA bulk prefetches. Run: python bench/prefetch_probe.py
"""

import json
import os
import time

import torch

from qwen3vl_static import kernels_qwen3vl_graph as kernels
from qwen3vl_static.bench import LONG, SHORT, build_models, text_prompt

Triton = kernels.TritonDecodeOps
SETTINGS = {
    "none": {},
    "o": {"o_proj": 1.0},
    "o+gu25": {"o_proj": 1.0, "gate_up": 0.25},
    "o+gu50": {"o_proj": 1.0, "gate_up": 0.5},
    "o+gu75": {"o_proj": 1.0, "gate_up": 0.75},
    "o+gu50+d25": {"o_proj": 1.0, "gate_up": 0.5, "down": 0.25},
    "o+gu50+d50": {"o_proj": 1.0, "gate_up": 0.5, "down": 0.5},
    "gu50": {"gate_up": 0.5},
    "o+gu50 per-line": {"o_proj": 1.0, "gate_up": 0.5},
    "none again": {},
}
bulk_prefetch = Triton.prefetch_l2


def per_line_prefetch(weight, fraction):
    row_bytes = weight.shape[1] * weight.element_size()
    prefix = min(row_bytes, -(-int(fraction * row_bytes) // 128) * 128)
    kernels._prefetch_l2_kernel[(-(-weight.shape[0] // 128),)](
        weight, weight.shape[0], weight.stride(0) * weight.element_size(), prefix, ROWS=128,
        LINES=kernels.triton.next_power_of_2(-(-prefix // 128)), BULK=False)


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


results, reference = {}, {}
for name, fractions in SETTINGS.items():
    Triton.L2_PREFETCH = fractions
    Triton.prefetch_l2 = staticmethod(per_line_prefetch if "per-line" in name else bulk_prefetch)
    ours._runner.graphs.clear()
    row = {}
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
    results[name] = {"fractions": fractions, **row}
    print(name, json.dumps(row), flush=True)
out_dir = os.environ.get("OUT", "bench/results")
with open(os.path.join(out_dir, "prefetch-probe.json"), "w") as handle:
    json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": kernels.triton.__version__,
               "settings": results}, handle, indent=1)
