"""What does the in-graph sampler cost, per form? (H200; JSON to $OUT.)

The sampler alone on random bf16 logits of the 2B's vocabulary (151,936) at 1 and 8 rows, Qwen's default settings
(temperature 0.7, top-k 20, top-p 0.8) and top-p alone: the torch reference (`sample_tokens`) on the logits as the
step hands them over, the same after `.float()` (the order the step used before: every pass over float32 scores),
and the Triton forms (`sample_candidates` / `sample_sorted`); beside them greedy's argmax, and for the top-k setting
torch's top-k alone (the selection the Triton form replaces), other chunk and list sizes (4096-logit chunks are
fewer than 64: every list overflows), a list too short (the exact slow path), and logits rounded to integers. Timed
as the tuner times a candidate (its own CUDA graph between two small kernels, L2 flushed, median of 20). Each form's
tokens are checked against the reference's with the same seed (ties at the selection's edge may part them: the
rounded logits). Run: python bench/probes/sampler_probe.py
"""

import json

import torch

import harness
from qwen3vl_static.loops_qwen3vl_graph import TOP_K_CANDIDATES
from qwen3vl_static.ops_sample_qwen3vl_graph import sample_candidates, sample_sorted, sample_tokens
from qwen3vl_static.tuner_qwen3vl_graph import KernelTuner

VOCAB = 151_936
SETTINGS = {"qwen_defaults": (0.7, 20, 0.8), "top_p_only": (0.7, VOCAB, 0.8)}
CHUNK_FORMS = [(512, 512), (1024, 512), (2048, 256), (4096, 512)]  # besides the default (2048, 512)


def measure(rows, logits, temperature, top_k, top_p) -> dict:
    """Every form at one setting: microseconds and whether its tokens equal the reference's."""
    t = torch.full((rows,), temperature, device="cuda")
    k = torch.full((rows,), top_k, dtype=torch.long, device="cuda")
    p = torch.full((rows,), top_p, device="cuda")
    m = torch.zeros(rows, device="cuda")  # min-p 0: none (the Triton forms take it as a tensor)
    count = TOP_K_CANDIDATES if top_k <= TOP_K_CANDIDATES else None
    forms = {
        "reference": lambda: sample_tokens(logits, t, k, p, count),
        "reference_float32_scores": lambda: sample_tokens(logits.float(), t, k, p, count),
        "triton": (lambda: sample_candidates(logits, t, k, p, m, count)) if count else
                  (lambda: sample_sorted(logits, t, k, p, m)),
        "argmax": lambda: logits.argmax(dim=-1),  # what greedy decoding pays instead (inside its step's end)
    }
    if count:
        forms["torch_topk_alone"] = lambda: logits.topk(count, dim=-1)[1][:, 0]  # the selection replaced
        for chunk, listed in CHUNK_FORMS:
            forms[f"triton_chunk_{chunk}_list_{listed}"] = (
                lambda chunk=chunk, listed=listed:
                sample_candidates(logits, t, k, p, m, count, chunk=chunk, listed=listed))
        # A list of only `count` keys overflows: the last launch selects exactly (the slow path).
        forms["triton_exact_selection"] = lambda: sample_candidates(logits, t, k, p, m, count, listed=count)
        tied = logits.round()  # few distinct values: many ties at the threshold
        forms["triton_tied_logits"] = lambda: sample_candidates(tied, t, k, p, m, count)
        forms["reference_tied_logits"] = lambda: sample_tokens(tied, t, k, p, count)
    tokens = {}
    for form, call in forms.items():
        torch.manual_seed(0)
        tokens[form] = call()
    times = KernelTuner().time_calls(list(forms.values()))
    reference = {form: tokens["reference_tied_logits" if "tied" in form else "reference"] for form in forms}
    return {"rows": rows, "us": dict(zip(forms, times)),
            "tokens_equal_reference": {form: bool(torch.equal(tokens[form], reference[form])) for form in forms}}


def main() -> None:
    harness.require_cuda()
    rows_out = []
    for rows in (1, 8):
        logits = torch.randn(rows, VOCAB, device="cuda", dtype=torch.bfloat16) * 4
        for name, settings in SETTINGS.items():
            rows_out.append({"settings": name, **measure(rows, logits, *settings)})
            print(json.dumps(rows_out[-1]), flush=True)
    harness.write_json({"rows": rows_out})


if __name__ == "__main__":
    main()
