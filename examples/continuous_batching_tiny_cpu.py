"""Continuous batching and the dataset runner with a tiny random Qwen3-VL on the CPU.

Offline, a few seconds. Six requests (two with an image) share two cache rows: each finished row takes the next
request while the other keeps decoding, and every answer equals `generate` on that request alone. Then the same
model answers a JSONL file of chat requests, as `python -m qwen3vl_static run` does.

    python examples/continuous_batching_tiny_cpu.py
"""

import json
import tempfile
from pathlib import Path

import torch
from PIL import Image

from qwen3vl_static import Qwen3VLGraphForConditionalGeneration
from qwen3vl_static.dataset_runner import ImageChatProcessor, run_dataset
from qwen3vl_static.presets import tiny_config, tiny_image_processor, tiny_inputs, tiny_tokenizer

torch.manual_seed(0)
model = Qwen3VLGraphForConditionalGeneration(tiny_config(static_cache_len=256, max_batch_size=2)).eval()
tokenizer = tiny_tokenizer()

# One request per prompt: the processor's outputs for one chat (what Qwen3VLProcessor returns).
picture = Image.new("RGB", (96, 64), "orange")
chats = [[{"role": "user", "content": [*([{"type": "image"}] if index % 3 == 0 else []),
                                       {"type": "text", "text": f"Question {index}?"}]}] for index in range(6)]
requests = [tiny_inputs([chat], images=[picture] if index % 3 == 0 else []) for index, chat in enumerate(chats)]
lengths = [4, 12, 6, 16, 8, 10]  # uneven answers: rows free up at different steps

results = model.generate_batch([{**request, "max_new_tokens": length} for request, length in zip(requests, lengths)],
                               do_sample=False)
for (request_id, result), request, length in zip(results.items(), requests, lengths):
    alone = model.generate(**request, max_new_tokens=length, do_sample=False)[0, request["input_ids"].shape[1]:]
    print(f"{request_id}: {result.status.name.lower()}, {len(result.generated_tokens)} tokens "
          f"{tokenizer.decode(result.generated_tokens)!r} (as generate alone: {alone.tolist() == result.generated_tokens})")

# The dataset runner: a JSONL file in, answers out as they finish (then in input order).
with tempfile.TemporaryDirectory() as folder:
    folder = Path(folder)
    picture.save(folder / "orange.png")
    lines = [{"id": "q1", "messages": [{"role": "user", "content": [{"type": "image", "image": "orange.png"},
                                                                    {"type": "text", "text": "What colour?"}]}]},
             {"id": "q2", "messages": [{"role": "user", "content": [{"type": "text", "text": "Hello"}]}],
              "max_new_tokens": 5},
             {"id": "q3", "messages": "not a list"}]
    (folder / "requests.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    processor = ImageChatProcessor(tokenizer, tiny_image_processor())
    model.generation_config.do_sample = False
    counts = run_dataset(model, processor, folder / "requests.jsonl", folder / "answers.jsonl", progress=False,
                         max_new_tokens=8)
    print(f"runner: answered {counts['answered']}, failed {counts['failed']}")
    print((folder / "answers.jsonl").read_text(), end="")
