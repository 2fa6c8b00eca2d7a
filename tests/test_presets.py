"""The real presets (2B, 4B, 8B) build with their shapes (CPU: on the meta device, without weights)."""

import math

import pytest
import torch
from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

from qwen3vl_static import Qwen3VLGraphForConditionalGeneration
from qwen3vl_static.presets import (
    MODELS,
    model_dir,
    real_config,
    real_config_dict,
    real_generation_config,
)

# Per model: text (hidden, intermediate, layers, q heads, kv heads, head dim), tied lm_head, vision (depth, hidden,
# intermediate, heads), DeepStack layers, parameters (stock's count, each tensor once).
SHAPES = {
    "2b": {"text": (2048, 6144, 28, 16, 8, 128), "tied": True, "vision": (24, 1024, 4096, 16),
           "deepstack": [5, 11, 17], "parameters": 2.1e9},
    "4b": {"text": (2560, 9728, 36, 32, 8, 128), "tied": True, "vision": (24, 1024, 4096, 16),
           "deepstack": [5, 11, 17], "parameters": 4.4e9},
    "8b": {"text": (4096, 12288, 36, 32, 8, 128), "tied": False, "vision": (27, 1152, 4304, 16),
           "deepstack": [8, 16, 24], "parameters": 8.7e9},
}
# What the 4B and 8B configs change of the 2B's; everything else (vocab, rope, token ids, ...) is the 2B's.
SIZE_KEYS = {
    "text_config": {"hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                    "num_key_value_heads", "head_dim", "tie_word_embeddings"},
    "vision_config": {"depth", "hidden_size", "intermediate_size", "num_heads", "out_hidden_size",
                      "deepstack_visual_indexes"},
}


def meta_model(model_class, config):
    with torch.device("meta"):
        return model_class._from_config(config, dtype=torch.bfloat16)


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("model_class", ["ours", "stock"])
def test_preset_builds_with_its_shapes(model, model_class):
    expected = SHAPES[model]
    if model_class == "ours":
        built = meta_model(Qwen3VLGraphForConditionalGeneration, real_config(model))
    else:
        built = meta_model(Qwen3VLForConditionalGeneration, Qwen3VLConfig(**real_config_dict(model)))
    hidden, intermediate, layers, q_heads, kv_heads, head_dim = expected["text"]
    text = built.model.language_model
    assert len(text.layers) == layers
    attention, mlp = text.layers[-1].self_attn, text.layers[-1].mlp
    assert attention.q_proj.weight.shape == (q_heads * head_dim, hidden)
    assert attention.k_proj.weight.shape == attention.v_proj.weight.shape == (kv_heads * head_dim, hidden)
    assert attention.o_proj.weight.shape == (hidden, q_heads * head_dim)
    assert mlp.gate_proj.weight.shape == mlp.up_proj.weight.shape == (intermediate, hidden)
    assert mlp.down_proj.weight.shape == (hidden, intermediate)
    assert built.lm_head.weight.shape == text.embed_tokens.weight.shape == (151936, hidden)
    assert (built.lm_head.weight is text.embed_tokens.weight) == expected["tied"]

    depth, width, vision_intermediate, vision_heads = expected["vision"]
    vision = built.model.visual
    assert len(vision.blocks) == depth
    assert vision.blocks[-1].attn.qkv.weight.shape == (3 * width, width)
    assert vision.blocks[-1].mlp.linear_fc1.weight.shape == (vision_intermediate, width)
    assert built.config.vision_config.num_heads == vision_heads
    assert built.config.vision_config.deepstack_visual_indexes == expected["deepstack"]
    assert len(vision.deepstack_merger_list) == len(expected["deepstack"])
    for merger in (vision.merger, *vision.deepstack_merger_list):  # vision features enter the text stream
        assert merger.linear_fc2.out_features == hidden

    parameters = sum(p.numel() for p in built.parameters())  # a tied matrix is one parameter
    assert math.isclose(parameters, expected["parameters"], rel_tol=0.1), parameters


@pytest.mark.parametrize("model", MODELS)
def test_preset_keeps_the_2b_settings_but_its_sizes(model):
    values, base = real_config_dict(model), real_config_dict("2b")
    assert values["tie_word_embeddings"] == values["text_config"]["tie_word_embeddings"] == SHAPES[model]["tied"]
    for section, sizes in SIZE_KEYS.items():
        assert {k: v for k, v in values.pop(section).items() if k not in sizes} == {
            k: v for k, v in base.pop(section).items() if k not in sizes}
    values.pop("tie_word_embeddings"), base.pop("tie_word_embeddings")
    assert values == base
    assert real_generation_config(model).eos_token_id == [151645, 151643]
    assert (model_dir(model) / "preprocessor_config.json").read_text() == (
        model_dir("2b") / "preprocessor_config.json").read_text()


def test_unknown_preset_is_refused():
    with pytest.raises(ValueError, match="unknown model '32b'; the presets are 2b, 4b, 8b"):
        real_config("32b")
