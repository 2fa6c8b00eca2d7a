"""Convert a stock Qwen3-VL checkpoint into a custom-code repo, load it back with trust_remote_code and generate.

A tiny random stock checkpoint is written to a temporary folder (offline, CPU, seconds); for a real model use
`python -m qwen3vl_static convert Qwen/Qwen3-VL-2B-Instruct ./qwen3-vl-2b-graph [--push-to-hub REPO_ID]`.

    python examples/convert_and_load.py
"""

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, Qwen3VLConfig, Qwen3VLForConditionalGeneration

from qwen3vl_static.convert import convert
from qwen3vl_static.presets import tiny_config_dict, tiny_image_processor, tiny_inputs, tiny_tokenizer

# What a user without this package runs: transformers alone, the model code comes from the folder.
FRESH_PROCESS = """
import sys, torch
from transformers import AutoModelForImageTextToText
model = AutoModelForImageTextToText.from_pretrained(sys.argv[1], trust_remote_code=True)
tokens = model.generate(**torch.load(sys.argv[2]), max_new_tokens=12, do_sample=False)
print(f"fresh process: {type(model).__name__} from {type(model).__module__};",
      "same tokens:", torch.equal(tokens, torch.load(sys.argv[3])))
"""

with tempfile.TemporaryDirectory() as work:
    src, dst = Path(work) / "stock", Path(work) / "graph"

    # A stock checkpoint as save_pretrained writes it: weights, config, tokenizer, image processor.
    torch.manual_seed(0)
    Qwen3VLForConditionalGeneration(Qwen3VLConfig(**tiny_config_dict())).save_pretrained(src)
    tiny_tokenizer().save_pretrained(src)
    tiny_image_processor().save_pretrained(src)

    convert(str(src), str(dst))  # same as: python -m qwen3vl_static convert SRC DST
    print("converted folder:", sorted(path.name for path in dst.iterdir()))

    # This process imported qwen3vl_static, which registered its classes: they are used instead of the folder's
    # copies (with or without trust_remote_code).
    model = AutoModelForImageTextToText.from_pretrained(dst, trust_remote_code=True)
    print(f"this process: {type(model).__name__} from {type(model).__module__}")

    chat = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is in the image?"}]}]
    inputs = tiny_inputs([chat], images=[Image.new("RGB", (64, 96), "teal")])
    ours = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    stock = Qwen3VLForConditionalGeneration.from_pretrained(src).generate(**inputs, max_new_tokens=12, do_sample=False)
    print("generated:", ours[0, inputs["input_ids"].shape[1]:].tolist())
    print("same tokens as the stock model on the stock checkpoint:", torch.equal(ours, stock))

    # A process that never imports qwen3vl_static runs the folder's own copy of the code (trust_remote_code).
    torch.save(inputs, Path(work) / "inputs.pt")
    torch.save(stock, Path(work) / "expected.pt")
    env = {**os.environ, "HF_MODULES_CACHE": str(Path(work) / "modules")}  # keep the user's module cache clean
    subprocess.run([sys.executable, "-c", FRESH_PROCESS, str(dst), str(Path(work) / "inputs.pt"),
                    str(Path(work) / "expected.pt")], check=True, env=env)
