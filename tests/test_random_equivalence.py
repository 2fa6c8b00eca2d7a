"""Randomized equivalence: seeded random tiny Qwen3-VL configs x prompts x deterministic generation settings.

Each seed draws one case with `random.Random(seed)`; our greedy output must equal stock transformers' token for token
(fp32, CPU). A failure names its seed and the drawn case; `pytest tests/test_random_equivalence.py -k seed007`
repeats it.
"""

import random

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList, Qwen3VLConfig, Qwen3VLForConditionalGeneration

from conftest import chat, image
from qwen3vl_static import Qwen3VLGraphForConditionalGeneration
from qwen3vl_static.configuration_qwen3vl_graph import Qwen3VLGraphConfig
from qwen3vl_static.presets import TINY_IDS, tiny_config_dict, tiny_inputs, tiny_tokenizer

SEEDS = range(80)
WORDS = ["cat", "sky", "why", "two", "red", "a", "is", "the", "box", "run", "over", "zebra"]
COLORS = ["red", "green", "blue", "white", "black", "yellow"]
EOS = TINY_IDS["<|im_end|>"]  # tiny_config_dict's


def draw_config(rng):
    """A Qwen3-VL config dict: varied text/vision shapes; patch, merge and temporal sizes stay the tiny processor's."""
    head_dim = rng.choice([8, 16, 32])
    half = head_dim // 2
    # Interleaved M-RoPE: H and W take every third rotary frequency (from 1 and 2) up to 3 x their section.
    height, width = rng.randint(1, half // 3), rng.randint(1, half // 3)
    kv_heads = rng.choice([1, 2])
    hidden = rng.choice([32, 48, 64])
    depth = rng.randint(1, 3)
    vision_heads = rng.choice([1, 2])
    tie = rng.random() < 0.5
    base = tiny_config_dict()
    text = {
        **base["text_config"],
        "hidden_size": hidden,
        "intermediate_size": rng.choice([32, 96, 160]),
        "num_hidden_layers": rng.randint(1, 3),
        "num_attention_heads": kv_heads * rng.choice([1, 2, 3]),  # GQA ratios 1 to 3
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rope_theta": rng.choice([10000.0, 5000000.0]),
        "rope_scaling": {
            "rope_type": "default", "mrope_section": [half - height - width, height, width], "mrope_interleaved": True,
        },
        "tie_word_embeddings": tie,
    }
    vision = {
        **base["vision_config"],
        "depth": depth,
        "hidden_size": vision_heads * rng.choice([16, 32]),
        "intermediate_size": rng.choice([32, 64, 128]),
        "num_heads": vision_heads,
        "out_hidden_size": hidden,
        "num_position_embeddings": rng.choice([16, 36, 64]),  # a square grid
        "deepstack_visual_indexes": sorted(rng.sample(range(depth), rng.randint(0, depth))),
    }
    return {**base, "text_config": text, "vision_config": vision, "tie_word_embeddings": tie}


def draw_prompt(rng):
    """1-3 chat rows, each text with none, one or two images or a video; the padding side of the batch."""
    conversations, images, video_grids = [], [], []
    for _ in range(rng.randint(1, 3)):
        parts = [" ".join(rng.choices(WORDS, k=rng.randint(1, 5)))]
        media = rng.choice([[], [], ["image"], ["image", "image"], ["video"]])
        for part in media:
            parts.insert(rng.randint(0, len(parts)), part)
            if part == "image":
                images.append((rng.randint(32, 160), rng.randint(32, 160), rng.choice(COLORS)))
            else:  # (frames after temporal merging, height, width) in patches; sides are whole merge units
                video_grids.append((rng.randint(1, 3), 2 * rng.randint(1, 3), 2 * rng.randint(1, 3)))
        conversations.append([chat(*parts)])
    return {"conversations": conversations, "images": images, "video_grids": video_grids,
            "padding": rng.choice(["left", "right"])}


def draw_settings(rng):
    """Greedy generate kwargs; `eos_count` / `stop_string` are resolved from a free run of the stock model."""
    settings = {"max_new_tokens": rng.randint(1, 24)}
    if rng.random() < 0.3:
        settings["repetition_penalty"] = round(rng.uniform(1.05, 1.6), 2)
    if rng.random() < 0.25:
        settings["no_repeat_ngram_size"] = rng.randint(2, 3)
    if rng.random() < 0.25:
        settings["min_new_tokens"] = rng.randint(1, settings["max_new_tokens"])
    if rng.random() < 0.25:
        settings["no_immediate_repeat"] = True
    if rng.random() < 0.5:
        settings["pad_token_id"] = TINY_IDS["<|endoftext|>"]
    # 0: the config's EOS; 9 is more than the device loop takes (MAX_EOS_IDS), so the host loop runs.
    settings["eos_count"] = rng.choice([0, 0, 1, 2, 3, 9])
    settings["stop_string"] = rng.random() < 0.25
    return settings


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny matmuls gain nothing from threads; on a busy CPU their synchronisation multiplied the time by ~10."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class NoImmediateRepeat(LogitsProcessor):
    """A processor the device loop does not know, reading `input_ids`: bans each row's last token."""

    def __call__(self, input_ids, scores):
        return scores.scatter(1, input_ids[:, -1:], float("-inf"))


def generate_kwargs(settings, tokenizer):
    kwargs = {key: value for key, value in settings.items() if key not in ("eos_count", "stop_string", "no_immediate_repeat")}
    if settings.get("no_immediate_repeat"):
        kwargs["logits_processor"] = LogitsProcessorList([NoImmediateRepeat()])
    if "stop_strings" in kwargs:
        kwargs["tokenizer"] = tokenizer
    return {**kwargs, "do_sample": False}


def right_padded(model_inputs):
    """The same rows with their padding moved to the end (every per-token tensor shifted alike)."""
    pads = (model_inputs["attention_mask"] == 0).sum(1).tolist()
    moved = dict(model_inputs)
    for key in ("input_ids", "attention_mask", "mm_token_type_ids"):
        if key in model_inputs:
            moved[key] = torch.stack([row.roll(-pad) for row, pad in zip(model_inputs[key], pads)])
    return moved


def resolve_stops(rng, settings, stock, model_inputs, tokenizer):
    """EOS ids and a stop string drawn from what this case's stock model really generates without them."""
    if not (settings["eos_count"] or settings["stop_string"]):
        return
    free_run = stock.generate(**model_inputs, **generate_kwargs(settings, tokenizer))
    # Each row up to the config's EOS: past it stock only pads.
    generated = [row[:row.index(EOS) + 1] if EOS in row else row
                 for row in free_run[:, model_inputs["input_ids"].shape[1]:].tolist()]
    if settings["eos_count"]:
        produced = sorted({token for row in generated for token in row})
        settings["eos_token_id"] = rng.sample(produced, min(settings["eos_count"], len(produced)))
    if settings["stop_string"]:
        # One or two consecutive tokens that decode to plain ASCII (random byte tokens are often partial UTF-8).
        texts = sorted({tokenizer.decode(row[start:start + length]) for row in generated
                        for start in range(len(row)) for length in (1, 2)})
        texts = [text for text in texts if text.isascii() and text.isprintable() and text.strip()]
        if texts:
            settings["stop_strings"] = [rng.choice(texts)]


@pytest.mark.parametrize("seed", SEEDS, ids=lambda seed: f"seed{seed:03d}")
def test_random_case_matches_stock(seed):
    rng = random.Random(seed)
    config, prompt, settings = draw_config(rng), draw_prompt(rng), draw_settings(rng)
    tokenizer = tiny_tokenizer()
    torch.manual_seed(seed)
    ours = Qwen3VLGraphForConditionalGeneration(
        Qwen3VLGraphConfig(**config, static_cache_len=256, max_batch_size=4, steps_per_sync=rng.choice([1, 3, 8]))
    ).eval()
    stock = Qwen3VLForConditionalGeneration(Qwen3VLConfig(**config)).eval()
    stock.load_state_dict(ours.state_dict())
    model_inputs = tiny_inputs(
        prompt["conversations"], images=[image(*spec) for spec in prompt["images"]],
        video_grids=prompt["video_grids"], tokenizer=tokenizer, seed=seed,
    )
    if prompt["padding"] == "right":
        model_inputs = right_padded(model_inputs)
    resolve_stops(rng, settings, stock, model_inputs, tokenizer)
    kwargs = generate_kwargs(settings, tokenizer)
    case = (f"seed {seed}\nconfig text={config['text_config']}\nvision={config['vision_config']}\n"
            f"tie={config['tie_word_embeddings']} steps_per_sync={ours.config.steps_per_sync}\nprompt={prompt}\n"
            f"attention_mask={model_inputs['attention_mask'].tolist()}\nsettings={settings}")

    expected = stock.generate(**model_inputs, **kwargs)
    ours.static_cache()
    ours._engine.decode.length = -1  # to see below that the static loop (not the stock fallback) ran
    got = ours.generate(**model_inputs, **kwargs)
    new = model_inputs["input_ids"].shape[1]
    assert got.tolist() == expected.tolist(), f"{case}\nnew tokens ours ={got[:, new:].tolist()}\nstock={expected[:, new:].tolist()}"
    assert ours._engine.decode.length >= 0, case
