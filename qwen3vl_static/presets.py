"""Model definitions that need no download: the real dense Qwen3-VL architectures (2B, 4B, 8B) and tiny test models.

Not uploaded to the Hub. The real configs (architecture only; no weights exist offline) drive GPU demos and
benchmarks with random weights of the exact shapes; the tiny config and processor drive CPU demos and tests.
The 4B and 8B configs are the 2B's with those models' text and vision sizes (widths, depths, heads, DeepStack
layers, tied embeddings or not); they were written offline and not checked against the published config.json files.
Torch and transformers are imported where used: the command line reads `MODELS` before it imports them.
"""

import json
from pathlib import Path

ASSETS = Path(__file__).with_name("assets")
MODELS = ("2b", "4b", "8b")  # Qwen/Qwen3-VL-<size>-Instruct, each in assets/qwen3-vl-<size>/

# Qwen's special tokens, in the order they get ids after the 256 byte tokens of the tiny tokenizer.
SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
TINY_VOCAB = 256 + len(SPECIAL_TOKENS)
TINY_IDS = {token: 256 + index for index, token in enumerate(SPECIAL_TOKENS)}
# Their ids in Qwen's own tokenizer (every dense Qwen3-VL).
QWEN_IDS = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645, "<|vision_start|>": 151652,
            "<|vision_end|>": 151653, "<|image_pad|>": 151655, "<|video_pad|>": 151656}

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% else %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def model_dir(model: str) -> Path:
    """The folder of a real model's config.json, generation_config.json and preprocessor_config.json."""
    if model not in MODELS:
        raise ValueError(f"unknown model {model!r}; the presets are {', '.join(MODELS)}")
    return ASSETS / f"qwen3-vl-{model}"


def real_config_dict(model: str = "2b") -> dict:
    """The stock config.json of Qwen/Qwen3-VL-<model>-Instruct, without its model type (for either config class)."""
    values = json.loads((model_dir(model) / "config.json").read_text())
    values.pop("model_type")
    return values


def real_config(model: str = "2b", **overrides):
    """The Qwen/Qwen3-VL-<model>-Instruct architecture (with `overrides`) as this package's config."""
    from .configuration_qwen3vl_graph import Qwen3VLGraphConfig

    return Qwen3VLGraphConfig(**{**real_config_dict(model), **overrides})


def real_generation_config(model: str = "2b"):
    from transformers import GenerationConfig

    return GenerationConfig.from_pretrained(model_dir(model))


def tiny_config_dict() -> dict:
    """A few-layer Qwen3-VL with every feature of the real one (GQA, QK-norm, interleaved M-RoPE, DeepStack)."""
    return {
        "text_config": {
            "vocab_size": TINY_VOCAB,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 3,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "max_position_embeddings": 4096,
            # The Hub checkpoints' spelling, which every supported transformers reads.
            "rope_theta": 10000.0,
            "rope_scaling": {"rope_type": "default", "mrope_section": [4, 2, 2], "mrope_interleaved": True},
            "tie_word_embeddings": True,
            "bos_token_id": TINY_IDS["<|endoftext|>"],
            "eos_token_id": TINY_IDS["<|im_end|>"],
            "pad_token_id": TINY_IDS["<|endoftext|>"],
            "initializer_range": 0.2,
        },
        "vision_config": {
            "depth": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "patch_size": 16,
            "temporal_patch_size": 2,
            "spatial_merge_size": 2,
            "out_hidden_size": 64,
            "num_position_embeddings": 64,
            "deepstack_visual_indexes": [0, 1],
            "initializer_range": 0.2,
        },
        "image_token_id": TINY_IDS["<|image_pad|>"],
        "video_token_id": TINY_IDS["<|video_pad|>"],
        "vision_start_token_id": TINY_IDS["<|vision_start|>"],
        "vision_end_token_id": TINY_IDS["<|vision_end|>"],
        "tie_word_embeddings": True,
    }


def tiny_config(**overrides):
    from .configuration_qwen3vl_graph import Qwen3VLGraphConfig

    return Qwen3VLGraphConfig(**{**tiny_config_dict(), **overrides})


def tiny_tokenizer():
    """A byte-level tokenizer that knows Qwen's special tokens and chat format (built offline)."""
    return _byte_level_tokenizer(TINY_IDS, TINY_VOCAB)


def real_ids_tokenizer(model: str = "2b"):
    """`tiny_tokenizer` with Qwen's special-token ids and the `model` preset's vocabulary size: every id that is
    neither a byte nor a special token is a three-letter filler token. A random-weight model of the real shapes then
    runs through a processor (the server benchmark), and every token it draws decodes to visible text."""
    return _byte_level_tokenizer(QWEN_IDS, real_config_dict(model)["text_config"]["vocab_size"])


def _byte_level_tokenizer(special_ids: dict, vocab_size: int):
    """Byte tokens at ids 0..255, `special_ids`' tokens at their ids, fillers at the others up to `vocab_size`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {symbol: index for index, symbol in enumerate(sorted(alphabet))}
    letters = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"  # bytes that decode to themselves
    taken = set(special_ids.values())
    for index in range(len(vocab), vocab_size):
        if index not in taken:  # never produced by encoding (no merges): decoding only
            vocab[letters[index // 62**2 % 62] + letters[index // 62 % 62] + letters[index % 62]] = index
    vocab.update(special_ids)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(SPECIAL_TOKENS)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>", padding_side="left"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def pil_image_processor_class():
    """transformers' Qwen2-VL image processor on PIL, which needs no torchvision: 5.x's `Qwen2VLImageProcessorPil`
    (there the plain name needs torchvision, and without it falls back to this class with a warning), 4.57's plain
    `Qwen2VLImageProcessor`."""
    try:
        from transformers import Qwen2VLImageProcessorPil
    except ImportError:
        from transformers import Qwen2VLImageProcessor as Qwen2VLImageProcessorPil
    return Qwen2VLImageProcessorPil


def tiny_image_processor():
    return pil_image_processor_class()(
        patch_size=16, merge_size=2, temporal_patch_size=2, min_pixels=32 * 32, max_pixels=256 * 256,
        image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5],
    )


def save_tiny_checkpoint(folder: Path, seed: int = 0) -> Path:
    """Write a stock Qwen3-VL checkpoint of the tiny config to `folder`, as `save_pretrained` writes one: random
    weights (seeded), tokenizer and image processor. Returns `folder`."""
    import torch
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    torch.manual_seed(seed)
    Qwen3VLForConditionalGeneration(Qwen3VLConfig(**tiny_config_dict())).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    tiny_image_processor().save_pretrained(folder)
    return folder


def tiny_inputs(conversations, images=(), video_grids=(), tokenizer=None, image_processor=None, seed=0):
    """What `Qwen3VLProcessor(...)` returns for these chats, without its torchvision-only video processor.

    `conversations`: one chat (a list of messages with `{"type": "image" | "video" | "text"}` parts) per row.
    `images`: PIL images in order of appearance. `video_grids`: one `(frames, h, w)` patch grid per video in
    order of appearance (`frames` counted after temporal merging); videos get random pixels. Rows are left
    padded. Returns `input_ids`, `attention_mask`, the pixel inputs and, where the installed transformers takes
    them, `mm_token_type_ids`.
    """
    import torch

    from .compat_qwen3vl_graph import TAKES_MM_TOKEN_TYPE_IDS

    tokenizer = tokenizer or tiny_tokenizer()
    image_processor = image_processor or tiny_image_processor()
    merge = image_processor.merge_size**2
    batch = {}
    image_counts = []
    if images:
        encoded = image_processor(images=list(images), return_tensors="pt")
        batch.update(pixel_values=encoded["pixel_values"], image_grid_thw=encoded["image_grid_thw"])
        image_counts = (encoded["image_grid_thw"].prod(-1) // merge).tolist()
    if video_grids:
        grids = torch.tensor(video_grids, dtype=torch.long)
        patch_dim = 3 * image_processor.temporal_patch_size * image_processor.patch_size**2
        generator = torch.Generator().manual_seed(seed)
        batch.update(
            pixel_values_videos=torch.randn(int(grids.prod(-1).sum()), patch_dim, generator=generator),
            video_grid_thw=grids,
        )
    frames = [(int(t), int(h * w) // merge) for t, h, w in video_grids]
    rows = []
    for chat in conversations:
        text = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        pieces = []
        for index, piece in enumerate(text.split("<|image_pad|>")):
            if index:
                pieces.append("<|image_pad|>" * image_counts.pop(0))
            pieces.append(piece)
        text = "".join(pieces)
        pieces = []
        for index, piece in enumerate(text.split("<|vision_start|><|video_pad|><|vision_end|>")):
            if index:
                count, tokens = frames.pop(0)
                # Qwen3-VL separates video frames by a timestamp: one vision block per frame.
                pieces.append(
                    "".join(f"<{second}.0 seconds><|vision_start|>{'<|video_pad|>' * tokens}<|vision_end|>"
                            for second in range(count))
                )
            pieces.append(piece)
        rows.append(tokenizer("".join(pieces), add_special_tokens=False)["input_ids"])
    width = max(len(row) for row in rows)
    pad = tokenizer.pad_token_id
    input_ids = torch.tensor([[pad] * (width - len(row)) + row for row in rows])
    attention_mask = torch.tensor([[0] * (width - len(row)) + [1] * len(row) for row in rows])
    if TAKES_MM_TOKEN_TYPE_IDS:  # what the installed processor returns with return_mm_token_type_ids=True
        image, video = input_ids == TINY_IDS["<|image_pad|>"], input_ids == TINY_IDS["<|video_pad|>"]
        batch["mm_token_type_ids"] = image.int() + 2 * video.int()
    return {"input_ids": input_ids, "attention_mask": attention_mask, **batch}
