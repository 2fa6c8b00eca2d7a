"""Which attention suits the padded vision graphs? (H200 probe; JSON to $OUT.)

Qwen3-VL-2B's vision attention (16 heads x 64, bf16) over `patches` real patches padded to a bucket: SDPA at the exact
size (no mask), SDPA over the bucket with the additive block-diagonal mask the graphs use, and torch's variable-length
flash attention over the bucket (`torch.nn.attention.varlen`, where this torch has it), which needs no mask.
Run: python bench/probes/vision_attention_probe.py
"""

import json
import os
import sys

import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    sys.exit("vision_attention_probe.py needs a CUDA device.")

HEADS, DIM = 16, 64


def time_ms(call, repeats=20):
    for _ in range(3):
        call()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        call()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def probe(segments, bucket):
    patches = sum(segments)
    q, k, v = (torch.randn(bucket, HEADS, DIM, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    ids = torch.cat([torch.full((n,), i) for i, n in enumerate(segments)] + [torch.full((bucket - patches,), -1)]).cuda()
    mask = torch.zeros(bucket, bucket, device="cuda", dtype=torch.bfloat16).masked_fill_(ids[:, None] != ids[None, :], float("-inf"))
    heads_first = [t.transpose(0, 1)[None] for t in (q, k, v)]
    row = {"segments": segments, "bucket": bucket,
           "sdpa_exact_ms": time_ms(lambda: [F.scaled_dot_product_attention(*(t[:, :, a:a + n] for t in heads_first))
                                              for a, n in zip([0] + list(torch.tensor(segments).cumsum(0)[:-1].tolist()), segments)]),
           "sdpa_masked_bucket_ms": time_ms(lambda: F.scaled_dot_product_attention(*heads_first, attn_mask=mask))}
    try:
        from torch.nn.attention.varlen import varlen_attn

        lengths = torch.tensor(segments + ([bucket - patches] if bucket > patches else []))
        cu = F.pad(lengths.cumsum(0), (1, 0)).to(device="cuda", dtype=torch.int32)
        row["varlen_bucket_ms"] = time_ms(lambda: varlen_attn(q, k, v, cu, cu, bucket, bucket))
    except Exception as error:  # older torch, or an unsupported shape
        row["varlen_bucket_ms"] = repr(error)[:200]
    return row


rows = [probe([784], 1024), probe([784, 196, 784], 2048), probe([784] * 4, 4096), probe([4096], 4096)]
for row in rows:
    print(row)
out = os.environ.get("OUT", "bench/results")
os.makedirs(out, exist_ok=True)
with open(os.path.join(out, "vision-attention-probe.json"), "w") as file:
    json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, file, indent=1)
