import os

import pytest
import torch

# Without a GPU, Triton kernels run in its interpreter; this must be set before they are defined (on import).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Each test process measures its kernel choices itself: choices stored by an earlier process would skip what the GPU
# tests check (tests/test_tuner.py stores them in folders of its own).
os.environ["QWEN3VL_STATIC_CACHE_DIR"] = ""
from PIL import Image
from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

from qwen3vl_static import Qwen3VLGraphForConditionalGeneration
from qwen3vl_static.engine_qwen3vl_graph import GraphEngine
from qwen3vl_static.presets import save_tiny_checkpoint, tiny_config, tiny_config_dict, tiny_inputs


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
    return new_pair()


def new_pair(**settings):
    """A fresh `tiny_pair` (config `settings` on top of its own)."""
    torch.manual_seed(0)
    ours = Qwen3VLGraphForConditionalGeneration(tiny_config(**{"static_cache_len": 160, "max_batch_size": 4, **settings}))
    ours.eval()
    stock = Qwen3VLForConditionalGeneration(Qwen3VLConfig(**tiny_config_dict())).eval()
    stock.load_state_dict(ours.state_dict())
    return ours, stock


def bucketed_pair(**settings):
    """(ours with prompts and images padded to buckets, as on CUDA but without graphs; stock), same weights, fp32."""
    ours, stock = new_pair(prefill_graph_tokens=512, **settings)
    ours._engine = GraphEngine(ours, bucketed=True)
    return ours, stock


def right_padded(model_inputs):
    """The same rows with their padding moved to the right."""
    inputs = dict(model_inputs)
    order = torch.sort(1 - model_inputs["attention_mask"], dim=1, stable=True).indices  # real tokens first, in order
    for key in ("input_ids", "attention_mask", "mm_token_type_ids"):
        if key in inputs:
            inputs[key] = model_inputs[key].gather(1, order)
    return inputs


def build(case):
    """Model inputs for a `(conversations, media)` case."""
    conversations, media = case
    return tiny_inputs(conversations, **media)


AUTO_MAP = {
    "AutoConfig": "configuration_qwen3vl_graph.Qwen3VLGraphConfig",
    "AutoModel": "modeling_qwen3vl_graph.Qwen3VLGraphModel",
    "AutoModelForImageTextToText": "modeling_qwen3vl_graph.Qwen3VLGraphForConditionalGeneration",
    "AutoModelForVision2Seq": "modeling_qwen3vl_graph.Qwen3VLGraphForConditionalGeneration",
}


save_stock_checkpoint = save_tiny_checkpoint  # a stock Qwen3-VL checkpoint as `save_pretrained` writes it


def assert_clean(info):
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
