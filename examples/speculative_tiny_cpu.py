"""Speculative decoding with an EAGLE-3 draft, on a tiny random Qwen3-VL on the CPU.

Offline, a few seconds. The draft is written in the published format (as AngelSlim and SpecForge save theirs) with
random weights, so it is rarely right and the loop keeps about one token a cycle; what matters is that `generate`
with a draft gives the same greedy tokens as without it. With a trained draft on a GPU the same calls keep several
tokens a cycle, each cycle one CUDA graph.

    python examples/speculative_tiny_cpu.py
"""

import tempfile

import torch
from PIL import Image

from qwen3vl_static import Qwen3VLGraphForConditionalGeneration
from qwen3vl_static.presets import tiny_config, tiny_inputs, tiny_tokenizer
from qwen3vl_static.workloads import save_random_draft

torch.manual_seed(0)
model = Qwen3VLGraphForConditionalGeneration(tiny_config(static_cache_len=512)).eval()
tokenizer = tiny_tokenizer()
chat = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is in the image?"}]}]
inputs = tiny_inputs([chat], images=[Image.new("RGB", (96, 64), "orange")])
prompt_len = inputs["input_ids"].shape[1]

plain = model.generate(**inputs, max_new_tokens=24, do_sample=False)

# A draft in the published format: config.json and model.safetensors in a folder (or a Hub repo id).
folder = save_random_draft(model.config, tempfile.mkdtemp(), torch.Generator().manual_seed(1),
                           draft_vocab_size=100, intermediate_size=96, layer_ids=[0, 1, 2])
model.load_draft(folder, num_draft_tokens=4)
speculative = model.generate(**inputs, max_new_tokens=24, do_sample=False)
print(f"greedy with the draft: {tokenizer.decode(speculative[0, prompt_len:])!r}")
print(f"the same tokens as without it: {torch.equal(speculative, plain)}")
print(f"tokens kept per cycle: {model.speculative_stats['kept_per_cycle']}")

# Sampling draws every checked position from the model, so the output follows the model's own distribution.
torch.manual_seed(1234)
sampled = model.generate(**inputs, max_new_tokens=24, do_sample=True, temperature=0.8, top_k=50)
print(f"sampled with the draft: {tokenizer.decode(sampled[0, prompt_len:])!r}")
model.use_draft(None)
