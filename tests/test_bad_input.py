"""Bad input gets a clear error before anything is written, and the model keeps generating correctly."""

import pytest

from conftest import build, chat, image
from qwen3vl_static.compat_qwen3vl_graph import TAKES_MM_TOKEN_TYPE_IDS
from qwen3vl_static.presets import tiny_inputs

PROMPT = ([[chat("image", "What is it?")], [chat("Hello there")]], {"images": [image(64, 64)]})


def generate_matches_stock(ours, stock):
    model_inputs = build(PROMPT)
    expected = stock.generate(**model_inputs, max_new_tokens=10, do_sample=False)
    assert ours.generate(**model_inputs, max_new_tokens=10, do_sample=False).tolist() == expected.tolist()


def test_over_capacity_raises_before_writing(tiny_pair):
    ours, stock = tiny_pair
    model_inputs = build(PROMPT)
    cache = ours.static_cache()
    keys_before = cache.full_keys[0].clone()
    prompt_len = model_inputs["input_ids"].shape[1]
    too_many = ours.config.static_cache_len - prompt_len + 2
    with pytest.raises(ValueError, match=rf"needs {prompt_len + too_many - 1} cache slots.*holds 160.*static_cache_len"):
        ours.generate(**model_inputs, max_new_tokens=too_many, do_sample=False)
    assert cache.full_keys[0].equal(keys_before)
    generate_matches_stock(ours, stock)


def test_too_many_rows_raises(tiny_pair):
    ours, stock = tiny_pair
    model_inputs = tiny_inputs([[chat("a" * length)] for length in range(1, 6)])
    with pytest.raises(ValueError, match=r"needs 5 cache rows.*has 4.*max_batch_size"):
        ours.generate(**model_inputs, max_new_tokens=4, do_sample=False)
    generate_matches_stock(ours, stock)


@pytest.mark.skipif(not TAKES_MM_TOKEN_TYPE_IDS, reason="this transformers has no mm_token_type_ids input")
def test_images_without_mm_token_type_ids_behave_as_stock(tiny_pair):
    """Whatever the installed transformers does without them (an error, or text-only positions), we do too."""
    ours, stock = tiny_pair
    model_inputs = build(PROMPT)
    del model_inputs["mm_token_type_ids"]
    try:
        expected = stock.generate(**model_inputs, max_new_tokens=4, do_sample=False)
    except Exception as stock_error:
        with pytest.raises(type(stock_error)):
            ours.generate(**model_inputs, max_new_tokens=4, do_sample=False)
    else:
        assert ours.generate(**model_inputs, max_new_tokens=4, do_sample=False).tolist() == expected.tolist()
    generate_matches_stock(ours, stock)


def test_placeholder_tokens_not_matching_the_images_raise_before_prefill(tiny_pair):
    ours, stock = tiny_pair
    model_inputs = build(PROMPT)
    ids = model_inputs["input_ids"]
    first_image_token = (ids[0] == ours.config.image_token_id).nonzero()[0, 0]
    ids[0, first_image_token] = 40  # one placeholder fewer than the image's merged tokens
    cache = ours.static_cache()
    keys_before = cache.full_keys[0].clone()
    with pytest.raises(ValueError, match="Image features and image tokens do not match"):
        ours.generate(**model_inputs, max_new_tokens=4, do_sample=False)
    assert cache.full_keys[0].equal(keys_before)
    generate_matches_stock(ours, stock)


def assert_rejected_before_writing(ours, stock, model_inputs, match):
    cache = ours.static_cache()
    keys_before = cache.full_keys[0].clone()
    with pytest.raises(ValueError, match=match):
        ours.generate(**model_inputs, max_new_tokens=4, do_sample=False)
    assert cache.full_keys[0].equal(keys_before)
    generate_matches_stock(ours, stock)


def test_pixels_without_their_grid_raise(tiny_pair):
    ours, stock = tiny_pair
    model_inputs = build(PROMPT)
    del model_inputs["image_grid_thw"]
    assert_rejected_before_writing(ours, stock, model_inputs, r"image pixels were passed without `image_grid_thw`")


def test_image_tokens_not_matching_the_grid_name_both_counts(tiny_pair):
    """As a processor would produce them: `mm_token_type_ids` agrees with the edited `input_ids`."""
    ours, stock = tiny_pair
    model_inputs = build(PROMPT)
    ids = model_inputs["input_ids"]
    image_token = ours.config.image_token_id
    expected = int((ids == image_token).sum())
    ids[0, (ids[0] == image_token).nonzero()[0, 0]] = 40
    if TAKES_MM_TOKEN_TYPE_IDS:
        model_inputs["mm_token_type_ids"] = (ids == image_token).int()
    match = rf"the prompt has {expected - 1} image tokens to fill, image_grid_thw gives {expected} features"
    assert_rejected_before_writing(ours, stock, model_inputs, match)


def test_attention_mask_of_another_shape_raises(tiny_pair):
    ours, stock = tiny_pair
    model_inputs = build(PROMPT)
    model_inputs["attention_mask"] = model_inputs["attention_mask"][:, 1:]
    assert_rejected_before_writing(ours, stock, model_inputs, r"attention_mask has shape \(2, \d+\) but input_ids has")


@pytest.mark.parametrize("token", [-1, "vocab"])
def test_token_ids_outside_the_vocabulary_raise(tiny_pair, token):
    ours, stock = tiny_pair
    model_inputs = build(PROMPT)
    vocab = ours.config.text_config.vocab_size
    model_inputs["input_ids"][1, -2] = vocab if token == "vocab" else token
    assert_rejected_before_writing(ours, stock, model_inputs, rf"outside the vocabulary \[0, {vocab}\)")


@pytest.mark.parametrize("name", ["input_ids", "attention_mask", "pixel_values"])
def test_tensors_on_the_meta_device_raise_naming_the_argument(tiny_pair, name):
    """A meta tensor has a shape and no data: named before anything reads it (not "Cannot copy out of meta tensor")."""
    ours, stock = tiny_pair
    model_inputs = build(PROMPT)
    model_inputs[name] = model_inputs[name].to("meta")
    assert_rejected_before_writing(ours, stock, model_inputs,
                                   rf"^{name} is on the meta device.*Pass real tensors, on the model's device \(cpu\)")
