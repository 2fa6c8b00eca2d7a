"""GPU checks of FP8 weights (Qwen's fine-grained format) on the real 2B shapes, and of the 4B / 8B architectures
(random weights; skipped without CUDA)."""

import json

import pytest
import torch
from test_cuda import generate, left_padded, teacher_forced_agreement

from qwen3vl_static import Qwen3VLGraphForConditionalGeneration
from qwen3vl_static.fp8_qwen3vl_graph import Fp8Weight
from qwen3vl_static.fp8_quantize import dequantized_state_dict, save_fp8_checkpoint
from qwen3vl_static.presets import real_config
from qwen3vl_static.workloads import build_fp8_model, build_models, build_ours, image_prompt, text_prompt

pytestmark = pytest.mark.cuda


@pytest.fixture(scope="module")
def fp8_models():
    """Ours with FP8 linears (vision and lm_head bf16, as Qwen's checkpoints), and stock on the dequantized weights."""
    ours = build_fp8_model(torch.device("cuda"), torch.bfloat16, static_cache_len=1024, max_batch_size=8)
    _, stock = build_models(torch.device("cuda"), torch.bfloat16)
    stock.load_state_dict(dequantized_state_dict(ours), assign=True)
    stock.tie_weights()
    return ours, stock


def test_fp8_graph_equals_eager_static_path(fp8_models):
    ours, _ = fp8_models
    engine = ours.graph_engine()
    assert isinstance(engine.text.layers[0].qkv, Fp8Weight) and isinstance(engine.text.layers[0].down_proj[0], Fp8Weight)
    generator = torch.Generator().manual_seed(3)
    for prompt in (text_prompt(ours.config, 1, 200, "cuda", generator),
                   left_padded(text_prompt(ours.config, 8, 150, "cuda", generator), [0, 3, 9, 40, 0, 1, 77, 120]),
                   image_prompt(ours.config, "cuda", generator)):
        assert generate(ours, prompt, 128).tolist() == generate(ours, prompt, 128, graphs=False).tolist()
    assert engine.decode.graphs and engine.prefill.graphs


def test_fp8_teacher_forced_logits_agree_with_stock_on_dequantized_weights(fp8_models):
    ours, stock = fp8_models
    agreement = teacher_forced_agreement(ours, stock, image_prompt(ours.config, "cuda", torch.Generator().manual_seed(2)))
    print("FP8", agreement["report"])
    assert agreement["decisive"] >= 0.99, agreement["report"]
    assert agreement["overall"] >= agreement["stock_overall"] - 0.05, agreement["report"]


def test_fp8_weights_hold_no_sixteen_bit_copy(fp8_models):
    ours, _ = fp8_models
    text = ours.model.language_model
    fp8_bytes = sum(p.numel() for name, p in text.named_parameters() if p.dtype == torch.float8_e4m3fn)
    linear_params = sum(m.weight.numel() for m in text.modules() if isinstance(m, torch.nn.Linear))
    assert fp8_bytes == linear_params  # every text linear is FP8 ...
    sixteen_bit = {p.data_ptr() for p in ours.parameters() if p.dtype == torch.bfloat16}
    engine = ours.graph_engine()
    assert all(layer.qkv.data.data_ptr() not in sixteen_bit for layer in engine.text.layers)  # ... and so is what runs


def test_transformers_quantizes_at_load_and_the_checkpoint_round_trips(tmp_path):
    """`FineGrainedFP8Config()` at load (vision quantized too), a checkpoint in Qwen's format, and what this class saves:
    each runs its graphs equal to its eager path; the saved checkpoint holds the same FP8 bytes."""
    from transformers import FineGrainedFP8Config

    small = {"text_config": {**real_config().text_config.to_dict(), "num_hidden_layers": 2},
             "vision_config": {**real_config().vision_config.to_dict(), "depth": 3, "deepstack_visual_indexes": [0, 1]}}
    bf16 = build_ours(torch.device("cuda"), torch.bfloat16, **small)
    bf16.save_pretrained(tmp_path / "bf16")
    save_fp8_checkpoint(bf16, tmp_path / "fp8")
    prompt = image_prompt(bf16.config, "cuda", torch.Generator().manual_seed(4))
    loaded = {
        "on the fly": Qwen3VLGraphForConditionalGeneration.from_pretrained(
            tmp_path / "bf16", dtype=torch.bfloat16, device_map="cuda", quantization_config=FineGrainedFP8Config()),
        "checkpoint": Qwen3VLGraphForConditionalGeneration.from_pretrained(tmp_path / "fp8", dtype=torch.bfloat16,
                                                                            device_map="cuda"),
    }
    for name, model in loaded.items():
        model.generation_config.eos_token_id = None
        assert type(model.model.language_model.layers[0].mlp.down_proj).__name__ == "FP8Linear", name
        assert generate(model, prompt, 32).tolist() == generate(model, prompt, 32, graphs=False).tolist(), name
    saved = loaded["checkpoint"]
    saved.save_pretrained(tmp_path / "saved")
    again = Qwen3VLGraphForConditionalGeneration.from_pretrained(tmp_path / "saved", dtype=torch.bfloat16, device_map="cuda")
    reloaded = again.state_dict()
    for key, value in saved.state_dict().items():  # FP8 bytes compared as bytes
        raw = (lambda t: t.view(torch.uint8)) if value.dtype == torch.float8_e4m3fn else (lambda t: t)
        assert torch.equal(raw(reloaded[key]), raw(value)), key
    written = json.loads((tmp_path / "saved" / "config.json").read_text())["quantization_config"]
    assert written["quant_method"] == "fp8" and written["weight_block_size"] == [128, 128]


@pytest.mark.parametrize("model, fp8", [("4b", False), ("8b", False), ("8b", True)], ids=["4b", "8b", "8b-fp8"])
def test_larger_models_graph_equals_eager(model, fp8):
    build = build_fp8_model if fp8 else build_ours
    ours = build(torch.device("cuda"), torch.bfloat16, model, static_cache_len=512, max_batch_size=4)
    ours.generation_config.eos_token_id = None
    generator = torch.Generator().manual_seed(5)
    for prompt in (text_prompt(ours.config, 4, 100, "cuda", generator), image_prompt(ours.config, "cuda", generator)):
        assert generate(ours, prompt, 64).tolist() == generate(ours, prompt, 64, graphs=False).tolist()
    del ours
    torch.cuda.empty_cache()
