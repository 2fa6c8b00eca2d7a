import pytest
import torch
from PIL import Image
from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

from qwen3vl_static import Qwen3VLGraphForConditionalGeneration
from qwen3vl_static.presets import tiny_config, tiny_config_dict, tiny_inputs


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


def chat(*parts, role="user"):
    """One message; strings become text parts, "image"/"video" become media parts."""
    content = [{"type": part} if part in ("image", "video") else {"type": "text", "text": part} for part in parts]
    return {"role": role, "content": content}


def image(width, height, color="red"):
    return Image.new("RGB", (width, height), color)


@pytest.fixture(scope="session")
def tiny_pair():
    """(ours, stock): the tiny model in both classes with identical random weights, fp32, eval mode."""
    torch.manual_seed(0)
    ours = Qwen3VLGraphForConditionalGeneration(tiny_config(static_cache_len=160, max_batch_size=4)).eval()
    stock = Qwen3VLForConditionalGeneration(Qwen3VLConfig(**tiny_config_dict())).eval()
    stock.load_state_dict(ours.state_dict())
    return ours, stock


def build(case):
    """Model inputs for a `(conversations, media)` case."""
    conversations, media = case
    return tiny_inputs(conversations, **media)
