"""Flash-decoding's first pass in the whole decode step, two forms (H200 probe; JSON to $OUT): the shipped kernel
(the slots a row does not attend to left out of its loads) against the form before it (K and V zeroed in registers
after loading; `attention_forms_probe.py`'s kernel with MASK_IN_LOAD off), each in a model built for the shape,
decode ms/step as the benchmark's slope, at the long-context rows of `bench --serving` (batch 1 at 7,800 tokens,
batch 8 at 4,000). The shipped form runs first and again last (run-to-run spread).
Run: python bench/probes/attention_step_probe.py
"""

import gc
import importlib.util
import json
import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    sys.exit("attention_step_probe.py needs a CUDA device.")

from qwen3vl_static import ops_attention_qwen3vl_graph
from qwen3vl_static.bench import LONG, decode_slope
from qwen3vl_static.workloads import build_ours, generate_exactly_as_asked, text_prompt

spec = importlib.util.spec_from_file_location("attention_forms_probe", Path(__file__).with_name("attention_forms_probe.py"))
forms = importlib.util.module_from_spec(spec)
spec.loader.exec_module(forms)
SHIPPED = ops_attention_qwen3vl_graph._decode_attention_kernel


class ZeroedAfterLoading:
    """The probe's kernel with K/V zeroed after loading, launched where `decode_attention` launches the shipped one."""

    arg_names = forms._splits_kernel.arg_names

    def __getitem__(self, grid):
        return lambda *args, **kwargs: forms._splits_kernel[grid](*args, **kwargs, MASK_IN_LOAD=False, P_FORM=0)

    def warmup(self, *args, **kwargs):
        return forms._splits_kernel.warmup(*args, **kwargs, MASK_IN_LOAD=False, P_FORM=0)


def decode_ms(batch, context, static_cache_len=8192, **settings) -> float:
    """Greedy decode ms/step (the benchmark's slope) of a bf16 model built for `batch` rows of `context`-token text
    prompts, warmed for that shape and freed afterwards (`attention_split_step_probe.py` measures with it too)."""
    model = build_ours(torch.device("cuda"), torch.bfloat16, static_cache_len=static_cache_len, **settings)
    generate_exactly_as_asked(model)
    prompt = text_prompt(model.config, batch, context, "cuda", torch.Generator().manual_seed(0))
    model.warmup(batch_sizes=[batch], cache_lengths=[context + LONG], modes=("greedy",), prompt_lengths=[context],
                 image_patches=[])
    ms, _ = decode_slope(model, prompt)
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return ms


def measure(kernel, batch, context) -> float:
    ops_attention_qwen3vl_graph._decode_attention_kernel = kernel
    try:
        return decode_ms(batch, context)
    finally:
        ops_attention_qwen3vl_graph._decode_attention_kernel = SHIPPED


def main() -> None:
    rows = []
    for batch, context in [(1, 7800), (8, 4000)]:
        row = {"batch_size": batch, "context_tokens": context}
        for name, kernel in [("mask_in_load", SHIPPED), ("zeroed_after_loading", ZeroedAfterLoading()),
                             ("mask_in_load_again", SHIPPED)]:
            row[name] = measure(kernel, batch, context)
            print(f"batch {batch} at {context}: {name} {row[name]:.3f} ms/step", flush=True)
        rows.append(row)
    out = Path(os.environ.get("OUT", "bench/results")) / "attention-step-probe.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                               "command": "python bench/probes/attention_step_probe.py", "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
