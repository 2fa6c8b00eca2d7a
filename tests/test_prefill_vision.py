"""The prefill and vision runners: their padded, graph-shaped path (what CUDA runs) equals stock on the CPU."""

from collections import OrderedDict
from types import SimpleNamespace

import pytest
import torch

from conftest import bucketed_pair, build, chat, image, right_padded
from qwen3vl_static.compat_qwen3vl_graph import vision_features
from qwen3vl_static.presets import tiny_config

ONE_IMAGE = ([[chat("image", "What is in the picture?")]], {"images": [image(64, 96)]})
TWO_IMAGES = ([[chat("image", "and", "image", "compare them")]], {"images": [image(64, 64), image(32, 64, "blue")]})
MIXED_BATCH = (
    [[chat("video", "What is it?")], [chat("Hi")], [chat("image", "Describe it, please.")]],
    {"images": [image(64, 32)], "video_grids": [(2, 4, 4)]},
)
TEXT = ([[chat("Describe a cat in one line.")]], {})
UNPADDED_BATCH = ([[chat("Describe a cat.")], [chat("Describe a dog.")]], {})  # two rows, no padding


@pytest.fixture(scope="module")
def padded_pair():
    """(ours with runners that pad to buckets, as on CUDA but without graphs; stock), same weights, fp32."""
    return bucketed_pair(vision_graph_patches=128, vision_table_cache_size=2)


def test_buckets_never_exceed_the_cache(padded_pair):
    ours, _ = padded_pair
    prefill = ours._engine.prefill
    assert prefill.token_buckets == [16, 32, 64, 128]  # 256 and 512 would write past the 160 slots
    assert prefill.bucket(1, 50) == (1, 64, 64) and prefill.bucket(3, 50) == (4, 64, 64)
    # After cached slots, the new tokens' bucket must end within a KV-length bucket (here the cache's 160 slots).
    assert prefill.bucket(1, 50, start=90) == (1, 64, 160) and prefill.bucket(1, 50, start=100) is None
    assert prefill.bucket(1, 129) is None  # longer prompts run at their exact size
    assert ours._engine.vision.bucket(24) == 128 and ours._engine.vision.bucket(129) is None


def test_warmup_keys_cover_padding_and_masks(padded_pair):
    """Prefill: several rows get the unpadded and the padded graph. Vision: every count its exact-size graph (one
    image) and its bucket's masked graph (several); counts over the limit none; by default the buckets."""
    ours, _ = padded_pair
    assert ours._engine.prefill.warmup_keys([1, 3], [50]) == [(4, 64, 64, True), (4, 64, 64, False), (1, 64, 64, False)]
    runner = ours._engine.vision
    assert runner.warmup_keys() == [(128, True)]
    assert runner.warmup_keys([24]) == [(128, True), (24, False)]
    assert runner.warmup_keys([24, 128, 200]) == [(128, True), (128, False), (24, False)]


def test_patch_buckets_are_four_per_octave():
    assert tiny_config(vision_graph_patches=4096).patch_buckets() == [
        256, 320, 384, 448, 512, 640, 768, 896, 1024, 1280, 1536, 1792, 2048, 2560, 3072, 3584, 4096]
    assert tiny_config(vision_graph_patches=1000).patch_buckets()[-3:] == [768, 896, 1000]  # the limit is a bucket
    assert tiny_config(vision_graph_patches=0).patch_buckets() == []


@pytest.mark.parametrize(
    "case", [TEXT, ONE_IMAGE, TWO_IMAGES, MIXED_BATCH, UNPADDED_BATCH], ids=["text", "image", "two-images", "mixed", "batch"]
)
def test_padded_prefill_and_vision_generate_like_stock(padded_pair, case):
    """Prompts padded to buckets; causal-only attention where no row has padding (all but "mixed")."""
    ours, stock = padded_pair
    model_inputs = build(case)
    assert bool(model_inputs["attention_mask"].all()) == (case is not MIXED_BATCH)
    expected = stock.generate(**model_inputs, max_new_tokens=12, do_sample=False, output_logits=True, return_dict_in_generate=True)
    got = ours.generate(**model_inputs, max_new_tokens=12, do_sample=False, output_logits=True, return_dict_in_generate=True)
    assert got.sequences.tolist() == expected.sequences.tolist()
    torch.testing.assert_close(got.logits[0], expected.logits[0], rtol=1e-4, atol=1e-4)  # the prefill's logits


def test_padded_vision_features_equal_stock(padded_pair):
    """Padding patches (a segment of their own) change nothing: merged and DeepStack features match stock."""
    ours, stock = padded_pair
    model_inputs = build(TWO_IMAGES)
    pixels, grid = model_inputs["pixel_values"], model_inputs["image_grid_thw"]
    runner = ours._engine.vision
    assert runner.bucket(pixels.shape[0]) > pixels.shape[0]  # really padded
    with torch.no_grad():
        got = ours.model.visual(pixels, grid_thw=grid)
        expected = stock.model.visual(pixels, grid_thw=grid)
    (got_merged, got_deepstack), (merged, deepstack) = vision_features(got), vision_features(expected)
    torch.testing.assert_close(got_merged, merged, rtol=1e-5, atol=1e-5)
    assert len(got_deepstack) == len(deepstack) == len(ours.config.vision_config.deepstack_visual_indexes) > 0
    for got_layer, layer in zip(got_deepstack, deepstack):
        torch.testing.assert_close(got_layer, layer, rtol=1e-5, atol=1e-5)


def test_a_single_image_runs_at_its_exact_size_without_a_mask(padded_pair, monkeypatch):
    """One image (one segment) needs no padding and no mask: its own size, the same features as stock."""
    ours, stock = padded_pair
    model_inputs = build(ONE_IMAGE)
    pixels, grid = model_inputs["pixel_values"], model_inputs["image_grid_thw"]
    runner = ours._engine.vision
    steps = []
    monkeypatch.setattr(runner, "step", lambda patches, masked, _step=runner.step: steps.append((patches, masked)) or _step(patches, masked))
    with torch.no_grad():
        got = vision_features(ours.model.visual(pixels, grid_thw=grid))
        expected = vision_features(stock.model.visual(pixels, grid_thw=grid))
    assert steps == [(pixels.shape[0], False)] and runner.bucket(pixels.shape[0]) > pixels.shape[0]
    torch.testing.assert_close(got[0], expected[0], rtol=1e-5, atol=1e-5)
    for got_layer, layer in zip(got[1], expected[1], strict=True):
        torch.testing.assert_close(got_layer, layer, rtol=1e-5, atol=1e-5)


def test_single_image_graphs_keep_the_most_recent_sizes(padded_pair, monkeypatch):
    """One graph per single-image size, at most `vision_table_cache_size` (2 here), least recently used dropped.
    (A stand-in capturer: graphs need CUDA; the bookkeeping does not.)"""
    ours, _ = padded_pair
    runner = ours._engine.vision

    class Capturer:
        def capture(self, step, state=(), name=""):
            return SimpleNamespace(replay=lambda: None)

    for name, value in {"capturer": Capturer(), "use_graphs": True, "graphs": OrderedDict()}.items():
        monkeypatch.setattr(runner, name, value)
    for grid in [(1, 4, 4), (1, 4, 8), (1, 4, 4), (1, 8, 8), (1, 4, 4)]:
        runner.encode(torch.randn(grid[1] * grid[2], runner.pixels.shape[1]), torch.tensor([grid]))
    assert sorted(runner.graphs) == [(16, False), (64, False)]  # 32 patches: least recently used, dropped
    runner.encode(torch.randn(48, runner.pixels.shape[1]), torch.tensor([[1, 4, 4], [1, 4, 8]]))  # two images
    assert sorted(runner.graphs) == [(16, False), (64, False), (128, True)]  # a bucket graph is not a single size
    monkeypatch.setattr(runner, "table_cache_size", 0)  # no single-image graph kept: each call still runs
    runner.encode(torch.randn(16, runner.pixels.shape[1]), torch.tensor([[1, 4, 4]]))
    assert sorted(runner.graphs) == [(128, True)]


def test_vision_tables_are_cached_with_a_bound(padded_pair):
    ours, _ = padded_pair
    runner = ours._engine.vision
    runner.tables.clear()
    for grid in [(1, 4, 4), (1, 4, 8), (1, 4, 4), (1, 8, 8)]:
        runner.table(grid)
    assert list(runner.tables) == [(1, 4, 4), (1, 8, 8)]  # bound 2, least recently used dropped


def test_pixels_not_matching_the_grid_raise_a_clear_error(padded_pair):
    ours, stock = padded_pair
    model_inputs = build(ONE_IMAGE)
    model_inputs["pixel_values"] = model_inputs["pixel_values"][:-4]
    with pytest.raises(ValueError, match="pixel values hold 20 patches but image_grid_thw describes 24"):
        ours.generate(**model_inputs, max_new_tokens=4, do_sample=False)
    model_inputs = build(ONE_IMAGE)  # and the model still generates like stock
    expected = stock.generate(**model_inputs, max_new_tokens=6, do_sample=False)
    assert ours.generate(**model_inputs, max_new_tokens=6, do_sample=False).tolist() == expected.tolist()


def test_padded_prefill_of_a_right_padded_batch_matches_stock(padded_pair):
    """The bucketed prefill's in-graph mask: right padding's queries see the real tokens before them, as in stock."""
    ours, stock = padded_pair
    model_inputs = right_padded(build(MIXED_BATCH))
    kwargs = dict(max_new_tokens=4, do_sample=False, return_dict_in_generate=True, output_logits=True)
    got, expected = ours.generate(**model_inputs, **kwargs), stock.generate(**model_inputs, **kwargs)
    assert got.sequences.tolist() == expected.sequences.tolist()
    torch.testing.assert_close(got.logits[0], expected.logits[0], rtol=1e-4, atol=1e-4)
