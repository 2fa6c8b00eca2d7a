"""Which FP8 projections pay off inside the decode step? (H200 probe; JSON to $OUT.)

The 2B decode step (ms/step as `bench` measures it: the slope between two generation lengths, 512-token prompt) at
batch 1 and 8, with every text linear in Qwen's FP8 format, with one kind of projection (QKV, o_proj, gate/up,
down_proj) left in bf16, and with none in FP8. Alone, each FP8 GEMV beats its bf16 form by a little
(`fp8_gemv_probe.py`), yet the all-FP8 step is barely faster than the bf16 one: a kind whose bf16 variant steps
faster than all-FP8 loses its byte savings in the step (among its neighbours, under PDL). Each row also gives the
weight bytes the kind's FP8 form saves, and the step time those bytes would take at 3.3 TB/s.

Run: python bench/probes/fp8_step_probe.py (writes $OUT/fp8-step-probe.json, or bench/results/fp8-step-probe.json).
"""

import gc
import json
import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    sys.exit("fp8_step_probe.py needs a CUDA device.")

from qwen3vl_static.bench import LONG, decode_slope
from qwen3vl_static.fp8_quantize import NOT_CONVERTED, quantize_fp8
from qwen3vl_static.workloads import build_ours, generate_exactly_as_asked, text_prompt

CONTEXT = 512
BATCHES = (1, 8)
KINDS = {"qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "o_proj": ("self_attn.o_proj",),
         "gate_up": ("mlp.gate_proj", "mlp.up_proj"), "down_proj": ("mlp.down_proj",)}
BANDWIDTH = 3.3e12  # bytes/s the FP8 forms read at past their fixed cost (`fp8_gemv_probe.py`)


def text_linears(model, suffixes) -> list:
    return [name for name, _ in model.named_modules()
            if ".language_model.layers." in name and name.endswith(suffixes)]


def measure(variant: str, kept_bf16) -> dict:
    """One variant: the model built, quantized except `kept_bf16`, warmed and timed at each batch size."""
    model = build_ours(torch.device("cuda"), torch.bfloat16)
    names = text_linears(model, kept_bf16) if kept_bf16 else []
    saved = sum(model.get_submodule(name).weight.numel() for name in text_linears(model, sum(KINDS.values(), ())))
    saved -= sum(model.get_submodule(name).weight.numel() for name in names)  # bf16 -> e4m3: one byte per weight
    if variant != "bf16":
        quantize_fp8(model, (*NOT_CONVERTED, *names))
    generate_exactly_as_asked(model)
    model.warmup(batch_sizes=list(BATCHES), cache_lengths=[CONTEXT + LONG], modes=("greedy",))
    generator = torch.Generator().manual_seed(0)
    row = {"variant": variant, "bytes_saved_gb": 0.0 if variant == "bf16" else saved / 1e9}
    for batch in BATCHES:
        prompt = text_prompt(model.config, batch, CONTEXT, torch.device("cuda"), generator)
        row[f"ms_per_step_batch{batch}"] = decode_slope(model, prompt)[0]
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return row


def main() -> None:
    variants = {"all_fp8": (), **{f"{kind}_bf16": suffixes for kind, suffixes in KINDS.items()}, "bf16": ()}
    rows = []
    for variant, kept in variants.items():
        rows.append(measure(variant, kept))
        print(json.dumps(rows[-1]), flush=True)
    base = rows[0]
    for row in rows[1:]:
        for batch in BATCHES:
            key = f"ms_per_step_batch{batch}"
            row[f"{key}_minus_all_fp8"] = row[key] - base[key]
        # What the kind's FP8 form should save per step at BANDWIDTH: the bytes all-FP8 saves beyond this variant.
        row["expected_fp8_saving_ms"] = 1000 * (base["bytes_saved_gb"] - row["bytes_saved_gb"]) * 1e9 / BANDWIDTH
    out = Path(os.environ.get("OUT", "bench/results")) / "fp8-step-probe.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows},
                              indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
