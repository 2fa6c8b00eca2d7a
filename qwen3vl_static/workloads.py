"""The benchmark's models and prompts, shared by `bench`, `demo` and the CUDA tests (not uploaded to the Hub).

Random bf16 weights with the exact Qwen3-VL-2B shapes (speed does not depend on weight values), ours and stock
transformers over one set of tensors, and prompts laid out as Qwen3VLProcessor lays them out.
"""

import json

import torch
from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

from .compat_qwen3vl_graph import TAKES_MM_TOKEN_TYPE_IDS
from .modeling_qwen3vl_graph import Qwen3VLGraphForConditionalGeneration
from .presets import REAL_2B_DIR, real_2b_config


def build_models(device, dtype, **settings):
    """Ours (with these config settings) and the stock class over one set of weights (the stock model borrows
    our tensors)."""
    config = real_2b_config(**settings)
    torch.manual_seed(0)
    with torch.device(device):
        ours = Qwen3VLGraphForConditionalGeneration._from_config(config, dtype=dtype).eval()
        stock_config = Qwen3VLConfig(**{k: v for k, v in json.loads((REAL_2B_DIR / "config.json").read_text()).items() if k != "model_type"})
        # Built on the device (not meta) so its non-persistent buffers (rotary tables) exist; then it borrows
        # our parameters and its own random ones are freed.
        stock = Qwen3VLForConditionalGeneration._from_config(stock_config, dtype=dtype).eval()
    ours.static_cache()  # fuses the projection weights first, so the stock model borrows the fused views
    stock.load_state_dict(ours.state_dict(), assign=True)
    stock.tie_weights()
    for model in (ours, stock):  # random weights: no EOS, so every system generates exactly what was asked
        model.generation_config.eos_token_id = None
        model.generation_config.do_sample = False
    return ours, stock


def text_prompt(config, batch, length, device, generator):
    ids = torch.randint(0, 150000, (batch, length), generator=generator).to(device)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def image_prompt(config, device, generator, sides=(448,), question=30):
    """Square images of these sides + a `question`-token text, laid out as Qwen3VLProcessor lays them out."""
    vision = config.vision_config
    grids = [side // vision.patch_size for side in sides]
    parts = []
    for grid in grids:
        tokens = grid * grid // vision.spatial_merge_size**2
        parts += [torch.tensor([config.vision_start_token_id]), torch.full((tokens,), config.image_token_id),
                  torch.tensor([config.vision_end_token_id])]
    ids = torch.cat(parts + [torch.randint(0, 150000, (question,), generator=generator)])[None]
    patch_dim = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    patches = sum(grid * grid for grid in grids)
    return {
        "input_ids": ids.to(device),
        "attention_mask": torch.ones_like(ids).to(device),
        **({"mm_token_type_ids": (ids == config.image_token_id).int().to(device)} if TAKES_MM_TOKEN_TYPE_IDS else {}),
        "pixel_values": torch.randn(patches, patch_dim, generator=generator).to(device),
        "image_grid_thw": torch.tensor([[1, grid, grid] for grid in grids], device=device),
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
