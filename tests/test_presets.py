"""The real presets (2B, 4B, 8B) build with their shapes, their FP8 builds swap the text linears, and the bench's
command line and report know the options (CPU: the real shapes on the meta device, without weights)."""

import json
import math

import pytest
import torch
from torch import nn
from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration
from transformers.integrations.finegrained_fp8 import FP8Linear

from qwen3vl_static import Qwen3VLGraphForConditionalGeneration
from qwen3vl_static.bench import report, weight_gb
from qwen3vl_static.cli import main
from qwen3vl_static.presets import (
    MODELS,
    model_dir,
    real_config,
    real_config_dict,
    real_generation_config,
    tiny_config,
    tiny_config_dict,
)
from qwen3vl_static.workloads import build_fp8_model

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


@pytest.mark.parametrize("model", ["2b", "8b"])
def test_fp8_build_swaps_the_text_linears(model):
    built = build_fp8_model("meta", torch.bfloat16, model)
    hidden, intermediate, _, q_heads, kv_heads, head_dim = SHAPES[model]["text"]
    for layer in built.model.language_model.layers:
        attention, mlp = layer.self_attn, layer.mlp
        for linear, shape in [(attention.q_proj, (q_heads * head_dim, hidden)),
                              (attention.k_proj, (kv_heads * head_dim, hidden)),
                              (attention.v_proj, (kv_heads * head_dim, hidden)),
                              (attention.o_proj, (hidden, q_heads * head_dim)),
                              (mlp.gate_proj, (intermediate, hidden)), (mlp.up_proj, (intermediate, hidden)),
                              (mlp.down_proj, (hidden, intermediate))]:
            assert isinstance(linear, FP8Linear)
            assert linear.weight.shape == shape and linear.weight.dtype == torch.float8_e4m3fn
            assert linear.weight_scale_inv.shape == (-(-shape[0] // 128), -(-shape[1] // 128))
            assert linear.weight_scale_inv.dtype == torch.float32
    assert type(built.lm_head) is nn.Linear and built.lm_head.weight.dtype == torch.bfloat16
    assert not any(isinstance(module, FP8Linear) for module in built.model.visual.modules())
    assert built.config.quantization_config["quant_method"] == "fp8"
    assert built.generation_config.eos_token_id is None and not built.generation_config.do_sample


def test_weight_gb_counts_each_tensor_once():
    ours = Qwen3VLGraphForConditionalGeneration(tiny_config()).eval()  # float32, lm_head tied
    assert weight_gb(ours) == 4 * sum(p.numel() for p in ours.parameters()) / 2**30
    borrowed = Qwen3VLForConditionalGeneration(Qwen3VLConfig(**tiny_config_dict())).eval()
    borrowed.load_state_dict(ours.state_dict(), assign=True)  # two parameters over the tied matrix, as in the bench
    assert borrowed.lm_head.weight is not borrowed.model.language_model.embed_tokens.weight
    assert weight_gb(borrowed) == weight_gb(ours)


def test_bench_help_names_the_model_and_fp8_options(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--help"])
    assert exit_info.value.code == 0
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--model {2b,4b,8b}" in help_text and "--fp8" in help_text


@pytest.mark.parametrize("model, name", [("2b", "nvidia-h200-20261201.json"), ("8b", "nvidia-h200-8b-20261201.json")])
def test_bench_report_names_the_file_by_model_and_prints_the_fp8_rows(model, name, tmp_path, capsys):
    engine = {"kv_cache_gb": 4.5, "graph_pool_reserved_gb_after_warmup": 0.4, "warmup_seconds": {"capture": 2.0}}
    row = {"batch_size": 1, "context_tokens": 512, "new_tokens": 80, "decode_ms_per_step": 2.0, "weight_gb": 9.0}
    summary = {
        "device": "NVIDIA H200", "date": "2026-12-01", "model": model, **engine,
        "graph_equals_eager_static_path": True, "graph_equals_eager_static_path_fp8": True, "ours_fp8_engine": engine,
        "ttft_breakdown": [], "ttft_second_turn": {},
        "results": [{**row, "system": "ours", "tokens_match_reference": False},
                    {**row, "system": "ours_fp8", "weight_gb": 5.0, "tokens_match_reference": None}],
    }
    path = report(summary, tmp_path)
    assert path == tmp_path / name and json.loads(path.read_text()) == summary
    table = capsys.readouterr().out
    assert "ours_fp8 | 1 | 512 | 80 | 2.000 |" in table and "fp8: graph == eager static path: True" in table
