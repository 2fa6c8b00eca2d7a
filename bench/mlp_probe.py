"""Does the persistent MLP kernel beat the separate gate/up and down launches? (H200 probe; JSON to $OUT.)

For 1, 4 and 8 rows (bf16, Qwen3-VL-2B's MLP: 2048 -> 2 x 6144 -> 2048, with the add and RMSNorm after it):
microseconds per MLP of the separate path (gate/up + SwiGLU, then down + add + norm, each in the form it measures
fastest) and of `TritonDecodeOps.persistent_mlp` at several tilings, each checked against the separate path. Timed
as in the step: 28 calls over distinct weight copies (read from HBM, not L2), one after another in one CUDA graph.
Run: python bench/mlp_probe.py
"""

import json
import os
import statistics
import sys

import torch

if not torch.cuda.is_available():
    sys.exit("mlp_probe.py measures GPU kernels: it needs a CUDA device (none found).")

from qwen3vl_static.kernels_qwen3vl_graph import MlpConfig, TritonDecodeOps, triton

if triton is None:
    sys.exit("mlp_probe.py needs Triton (not installed).")

HIDDEN, INTER, LAYERS, REPLAYS = 2048, 6144, 28, 10
CONFIGS = [MlpConfig(), MlpConfig(ranges=4), MlpConfig(ranges=16), MlpConfig(block_ka=128), MlpConfig(block_a=32),
           MlpConfig(block_a=32, block_ka=128), MlpConfig(block_b=32), MlpConfig(num_stages=3)]
device = torch.device("cuda")
generator = torch.Generator(device).manual_seed(0)


def randn(*shape):
    return (torch.randn(*shape, device=device, generator=generator) * shape[-1] ** -0.5).to(torch.bfloat16)


layers = [(randn(2 * INTER, HIDDEN), randn(HIDDEN, INTER), randn(HIDDEN)) for _ in range(LAYERS)]


def graph_us(call):
    """Microseconds per MLP: LAYERS calls, one per weight copy, in one graph (median of REPLAYS replays)."""
    for _ in range(2):
        call()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    times = []
    for _ in range(REPLAYS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(TritonDecodeOps.SPIN_CYCLES)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / LAYERS)
    return statistics.median(times)


results = {"device": torch.cuda.get_device_name(device), "torch": torch.__version__, "triton": triton.__version__,
           "layers": LAYERS, "rows": {}}
for rows in (1, 4, 8):
    x, hidden = randn(rows, HIDDEN), randn(rows, HIDDEN)
    separate = lambda gate_up, down, norm: super(TritonDecodeOps, TritonDecodeOps).mlp_add_rms_norm(  # noqa: E731
        x, gate_up, down, None, hidden, norm, 1e-6)
    expected = separate(*layers[0])
    row = {"separate_us": graph_us(lambda: [separate(*layer) for layer in layers])}
    for config in CONFIGS:
        fused = lambda gate_up, down, norm: TritonDecodeOps.persistent_mlp(x, gate_up, down, hidden, norm, 1e-6, config)  # noqa: E731
        total, normed = fused(*layers[0])
        errors = [((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
                  for got, want in zip((total, normed), expected)]
        row[str(config)] = {"us": graph_us(lambda: [fused(*layer) for layer in layers]), "relative_error": errors}
        print(rows, config, row[str(config)], flush=True)
    print(rows, "separate", row["separate_us"], flush=True)
    results["rows"][rows] = row

out = os.environ.get("OUT", "bench/results")
os.makedirs(out, exist_ok=True)
with open(os.path.join(out, "mlp-probe.json"), "w") as f:
    json.dump(results, f, indent=1)
