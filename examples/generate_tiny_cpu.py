"""Generate from an image prompt with a tiny random Qwen3-VL on the CPU: greedy, sampled, streamed.

Offline, a few seconds. The weights are random, so the text is gibberish; what matters is that the plain
`model.generate` call runs the static-cache decode loop (on a CUDA device the same call replays CUDA graphs).

    python examples/generate_tiny_cpu.py
"""

import torch
from PIL import Image
from transformers import TextStreamer

from qwen3vl_static import Qwen3VLGraphForConditionalGeneration
from qwen3vl_static.presets import tiny_config, tiny_inputs, tiny_tokenizer

torch.manual_seed(0)
# Settings of the static path are config fields: here a small cache (prompt + max_new_tokens - 1 must fit).
model = Qwen3VLGraphForConditionalGeneration(tiny_config(static_cache_len=512, max_batch_size=2)).eval()
tokenizer = tiny_tokenizer()

# What Qwen3VLProcessor would return for these chats (the tiny model has no Hub processor).
chats = [
    [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is in the image?"}]}],
    [{"role": "user", "content": [{"type": "text", "text": "Say hello."}]}],
]
inputs = tiny_inputs(chats, images=[Image.new("RGB", (96, 64), "orange")])  # two rows, left padded
prompt_len = inputs["input_ids"].shape[1]
print(f"prompt: {tuple(inputs['input_ids'].shape)} tokens (batch, length)")

greedy = model.generate(**inputs, max_new_tokens=16, do_sample=False)
for row, tokens in enumerate(greedy[:, prompt_len:]):
    print(f"greedy  row {row}: {tokenizer.decode(tokens)!r}")

# Temperature / top-k / top-p run inside the decode step; a seed makes the draws reproducible.
torch.manual_seed(1234)
sampled = model.generate(**inputs, max_new_tokens=16, do_sample=True, temperature=0.8, top_k=50, top_p=0.95)
torch.manual_seed(1234)
again = model.generate(**inputs, max_new_tokens=16, do_sample=True, temperature=0.8, top_k=50, top_p=0.95)
print(f"sampled row 0: {tokenizer.decode(sampled[0, prompt_len:])!r} (same with the same seed: {torch.equal(sampled, again)})")

# Streaming: the streamer receives tokens as the host reads them (every `steps_per_sync` steps on the device loop).
one = tiny_inputs(chats[:1], images=[Image.new("RGB", (96, 64), "orange")])
print("streamed:", end=" ", flush=True)
model.generate(**one, max_new_tokens=16, do_sample=False, streamer=TextStreamer(tokenizer, skip_prompt=True))
