"""The benchmark's models and prompts, shared by `bench`, `demo` and the CUDA tests (not uploaded to the Hub).

Random weights with the exact shapes of a preset (`presets.MODELS`; speed does not depend on weight values), ours
and stock transformers over one set of tensors, ours with the same weights in Qwen's FP8 format, and prompts laid
out as Qwen3VLProcessor lays them out.
"""

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

from .compat_qwen3vl_graph import TAKES_MM_TOKEN_TYPE_IDS
from .fp8_quantize import quantize_fp8
from .modeling_qwen3vl_graph import Qwen3VLGraphForConditionalGeneration
from .presets import real_config, real_config_dict


def build_ours(device, dtype, model="2b", **settings):
    """Ours with the `model` preset's shapes, these config settings and random weights (seed 0: the same weights in
    every build)."""
    torch.manual_seed(0)
    with torch.device(device):
        return Qwen3VLGraphForConditionalGeneration._from_config(real_config(model, **settings), dtype=dtype).eval()


def generate_exactly_as_asked(model):
    """Random weights: no EOS, so every system generates exactly the tokens asked for; greedy."""
    model.generation_config.eos_token_id = None
    model.generation_config.do_sample = False


def build_models(device, dtype, model="2b", **settings):
    """Ours (`build_ours`) and the stock class over one set of weights (the stock model borrows our tensors)."""
    ours = build_ours(device, dtype, model, **settings)
    with torch.device(device):
        # Built on the device (not meta) so its non-persistent buffers (rotary tables) exist; then it borrows
        # our parameters and its own random ones are freed.
        stock = Qwen3VLForConditionalGeneration._from_config(Qwen3VLConfig(**real_config_dict(model)), dtype=dtype).eval()
    ours.static_cache()  # fuses the projection weights first, so the stock model borrows the fused views
    stock.load_state_dict(ours.state_dict(), assign=True)
    stock.tie_weights()
    for each in (ours, stock):
        generate_exactly_as_asked(each)
    return ours, stock


def build_fp8_model(device, dtype, model="2b", **settings):
    """`build_models`' ours (same weights and settings) with its text linears in Qwen's FP8 format (`quantize_fp8`:
    e4m3 weights with a float32 scale per 128 x 128 block; vision and `lm_head` stay in `dtype`)."""
    ours = quantize_fp8(build_ours(device, dtype, model, **settings))
    generate_exactly_as_asked(ours)
    return ours


def text_prompt(config, batch, length, device, generator):
    ids = torch.randint(0, 150000, (batch, length), generator=generator).to(device)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def image_prompt(config, device, generator, sides=(448,), question=30, batch=1):
    """`batch` rows, each of square images of these sides + a `question`-token text, laid out as Qwen3VLProcessor
    lays them out: every row has its own pixels and question, the pixel patches of all images follow each other in
    row order, with one `image_grid_thw` row per image."""
    vision = config.vision_config
    grids = [side // vision.patch_size for side in sides]
    patch_dim = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    rows, pixels = [], []
    for _ in range(batch):
        parts = []
        for grid in grids:
            tokens = grid * grid // vision.spatial_merge_size**2
            parts += [torch.tensor([config.vision_start_token_id]), torch.full((tokens,), config.image_token_id),
                      torch.tensor([config.vision_end_token_id])]
        rows.append(torch.cat(parts + [torch.randint(0, 150000, (question,), generator=generator)]))
        pixels.append(torch.randn(sum(grid * grid for grid in grids), patch_dim, generator=generator))
    ids = torch.stack(rows)
    return {
        "input_ids": ids.to(device),
        "attention_mask": torch.ones_like(ids).to(device),
        **({"mm_token_type_ids": (ids == config.image_token_id).int().to(device)} if TAKES_MM_TOKEN_TYPE_IDS else {}),
        "pixel_values": torch.cat(pixels).to(device),
        "image_grid_thw": torch.tensor([[1, grid, grid] for grid in grids] * batch, device=device),
    }


def second_turn(model, image, generator, answer=128, question=30):
    """A chat's second turn after the first turn's `image` prompt and `answer` tokens: `(first turn's output, resumed
    inputs, fresh inputs)`. Resumed: a `question`-token user turn after the first turn's sequences, to pass with the
    returned cache (the image's pixels are in the cache). Fresh: the same prompt with the pixels, for a new request."""
    first = model.generate(**image, max_new_tokens=answer, do_sample=False, return_dict_in_generate=True)
    device = image["input_ids"].device
    ids = torch.cat([first.sequences, torch.randint(0, 150000, (1, question), generator=generator).to(device)], dim=1)
    resumed = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if TAKES_MM_TOKEN_TYPE_IDS:  # 5.x places the cached image's tokens by their type ids and grid
        resumed.update(mm_token_type_ids=(ids == model.config.image_token_id).int(), image_grid_thw=image["image_grid_thw"])
    fresh = {**resumed, "pixel_values": image["pixel_values"], "image_grid_thw": image["image_grid_thw"]}
    return first, resumed, fresh


def eagle3_config(config, draft_vocab_size=32000, intermediate_size=None, layer_ids=None) -> dict:
    """The `config.json` of an EAGLE-3 draft for `config`'s text model in the published format (AngelSlim's
    Qwen3-VL-2B draft config: one Llama layer of the target's width and heads, interleaved M-RoPE, a draft vocabulary
    of `draft_vocab_size`; `layer_ids`: the target layers it reads, where not the default three)."""
    text = config.get_text_config(decoder=True)
    rope = dict(text.rope_parameters if hasattr(text, "rope_parameters") else text.rope_scaling)
    return {
        "architectures": ["Eagle3LlamaForCausalLM"], "model_type": "llama", "target_model_type": "qwen3_vl",
        "hidden_size": text.hidden_size, "intermediate_size": intermediate_size or 3 * text.hidden_size,
        "num_attention_heads": text.num_attention_heads, "num_key_value_heads": text.num_key_value_heads,
        "head_dim": text.head_dim, "num_hidden_layers": 1, "hidden_act": "silu", "rms_norm_eps": text.rms_norm_eps,
        "vocab_size": text.vocab_size, "draft_vocab_size": draft_vocab_size,
        "rope_theta": rope.get("rope_theta", getattr(text, "rope_theta", None)),
        "rope_scaling": {"rope_type": "default", "mrope_interleaved": True, "mrope_section": rope["mrope_section"]},
        **({"eagle_config": {"eagle_aux_hidden_state_layer_ids": list(layer_ids)}} if layer_ids else {}),
    }


def eagle3_matrix_shapes(draft_config: dict) -> dict:
    """The shape of each matrix of an EAGLE-3 draft's `model.safetensors` under its published name, from its
    `config.json` (the norms, the vocabulary maps and an own embedding aside)."""
    hidden, heads, kv_heads, intermediate = (draft_config[key] for key in (
        "hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size"))
    head_dim = draft_config.get("head_dim") or hidden // heads
    return {
        "fc.weight": (hidden, 3 * draft_config.get("target_hidden_size", hidden)),
        "midlayer.self_attn.q_proj.weight": (heads * head_dim, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": (kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": (kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": (hidden, heads * head_dim),
        "midlayer.mlp.gate_proj.weight": (intermediate, hidden),
        "midlayer.mlp.up_proj.weight": (intermediate, hidden),
        "midlayer.mlp.down_proj.weight": (hidden, intermediate),
        "lm_head.weight": (draft_config.get("draft_vocab_size") or draft_config["vocab_size"], hidden),
    }


def save_random_draft(config, folder, generator, draft_vocab_size=32000, intermediate_size=None, layer_ids=None):
    """An EAGLE-3 draft for `config`'s text model (`eagle3_config`) with random weights and the target's embedding
    shared, written to `folder`; returns the folder. Token 0 is in the draft vocabulary, so with the heads' norms at
    zero both models pick it every time."""
    draft_config = eagle3_config(config, draft_vocab_size, intermediate_size, layer_ids)
    hidden, vocab = draft_config["hidden_size"], draft_config["vocab_size"]
    tensors = {name: (torch.randn(shape, generator=generator) / shape[1] ** 0.5).bfloat16()
               for name, shape in eagle3_matrix_shapes(draft_config).items()}
    for name in ("midlayer.hidden_norm", "midlayer.input_layernorm", "midlayer.post_attention_layernorm", "norm"):
        tensors[f"{name}.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
    used = torch.cat([torch.zeros(1, dtype=torch.long),
                      1 + torch.randperm(vocab - 1, generator=generator)[: draft_vocab_size - 1]]).sort().values
    tensors["d2t"] = used - torch.arange(draft_vocab_size)
    tensors["t2d"] = torch.zeros(vocab, dtype=torch.bool)
    tensors["t2d"][used] = True
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(draft_config))
    save_file(tensors, str(folder / "model.safetensors"))
    return folder
