"""How much does bucket padding cost the graphed vision tower? (H200 probe; JSON to $OUT.)

One 448x448 image (784 patches) through the vision graph padded to different buckets: 1024 (powers of two), 896
(the default four-per-octave series), 832 (eight per octave) - all with the block-diagonal mask - and 784 itself,
which the image fills exactly: no mask (what the runner now does for every single image). Wall time of the tower call (fastest of 5), and the GPU time and host launch
time of the replay. Real Qwen3-VL-2B shapes, random bf16 weights. Run: python bench/probes/vision_bucket_probe.py
"""

import json
import os
import sys

import torch

if not torch.cuda.is_available():
    sys.exit("vision_bucket_probe.py needs a CUDA device.")

from qwen3vl_static.bench import best_ms, replay_times
from qwen3vl_static.workloads import build_models, image_prompt

ours, _ = build_models(torch.device("cuda"), torch.bfloat16)
prompt = image_prompt(ours.config, "cuda", torch.Generator().manual_seed(0))
pixels, grid = prompt["pixel_values"].to(torch.bfloat16), prompt["image_grid_thw"]
runner = ours.graph_engine().vision
rows = []
with torch.no_grad():
    for bucket in (1024, 896, 832, 784):
        runner.shape = lambda patches, segments, bucket=bucket: (bucket, bucket > patches)  # force this graph
        wall = best_ms(lambda: ours.model.visual(pixels, grid_thw=grid))
        rows.append({"bucket": bucket, "masked": bucket > pixels.shape[0], "tower_ms": wall,
                     **replay_times(runner.graphs[(bucket, bucket > pixels.shape[0])], "graph")})
        print(rows[-1], flush=True)
out = os.environ.get("OUT", "bench/results")
os.makedirs(out, exist_ok=True)
with open(os.path.join(out, "vision-bucket-probe.json"), "w") as file:
    json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "patches": pixels.shape[0], "rows": rows},
              file, indent=1)
