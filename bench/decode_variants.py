"""Which SDPA backend makes the replayed decode step fastest? (H200 probe; numbers go to $OUT.)

Times 200 graph replays of the greedy decode step at batch 1 and 8, KV bucket 1024, for each SDPA
backend that accepts the step's inputs. Run: python bench/decode_variants.py
"""

import json
import os
import time

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from qwen3vl_static.bench import build_models, text_prompt

# The SDPA backend matters only for the torch ops (the Triton kernels have their own attention).
ours, _ = build_models(torch.device("cuda"), torch.bfloat16, static_cache_len=1024, max_batch_size=8, use_triton_kernels=False)
runner = ours._runner
results = {}
for name, backends in [("default", None), ("cudnn", [SDPBackend.CUDNN_ATTENTION]), ("flash", [SDPBackend.FLASH_ATTENTION]),
                       ("efficient", [SDPBackend.EFFICIENT_ATTENTION]), ("math", [SDPBackend.MATH])]:
    for batch in (1, 8):
        prompt = text_prompt(ours.config, batch, 512, "cuda", torch.Generator().manual_seed(0))
        ours.generate(**prompt, max_new_tokens=24, do_sample=False)  # sets up a request of this batch size
        runner.graphs.clear()
        runner.pool = None  # the pool goes with its last graph
        try:
            with sdpa_kernel(backends) if backends else torch.no_grad(), torch.no_grad():
                runner.batch_size = batch
                tokens = runner.input_ids[:batch, 0].clone()
                torch.cuda.synchronize()
                began = time.perf_counter()
                for _ in range(25):
                    runner.length = 520  # stay in the 1024 bucket; slots are rewritten, never read unwritten
                    runner.cache_lens[:batch] = 520
                    runner.token_steps(tokens, 8, "greedy")
                torch.cuda.synchronize()
                results[f"{name}/batch{batch}"] = 1000 * (time.perf_counter() - began) / 200
        except RuntimeError as error:
            results[f"{name}/batch{batch}"] = f"unsupported: {str(error)[:80]}"
print(json.dumps(results, indent=1))
out = os.environ.get("OUT", "bench/results")
with open(os.path.join(out, "decode_variants.json"), "w") as handle:
    json.dump(results, handle, indent=1)
