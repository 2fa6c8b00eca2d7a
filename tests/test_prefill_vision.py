"""The prefill and vision runners: their padded, graph-shaped path (what CUDA runs) equals stock on the CPU."""

from collections import OrderedDict
from functools import partial
from types import SimpleNamespace

import pytest
import torch

from conftest import bucketed_pair, build, chat, image, right_padded
from qwen3vl_static.compat_qwen3vl_graph import vision_features

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


def test_warmup_keys_cover_padding_and_chunks(padded_pair):
    """Prefill: several rows get the unpadded and the padded graph. Vision: a graph per count of images (1 and each
    batch size) of each size, as the chunks of at most `vision_graph_patches` (128 here) that the call runs as;
    an image over the limit none; no sizes, none."""
    ours, _ = padded_pair
    assert ours._engine.prefill.warmup_keys([1, 3], [50]) == [(4, 64, 64, True), (4, 64, 64, False), (1, 64, 64, False)]
    runner = ours._engine.vision
    assert runner.warmup_keys(None, [1, 4]) == []
    assert runner.warmup_keys([24], [1, 3]) == [(3, 24), (1, 24)]
    assert runner.warmup_keys([24, 200], [1, 8]) == [(4, 24), (1, 24)]  # 8 x 24 patches: two chunks of 4


def test_vision_chunks_group_one_size_and_split_at_the_limit(padded_pair):
    runner = padded_pair[0]._engine.vision  # at most 128 patches per graph
    assert runner.keys([(1, 4, 6)]) == [(1, 24)]
    assert runner.keys([(1, 4, 4), (1, 4, 6), (1, 4, 4)]) == [(2, 16), (1, 24)]  # by size, first seen first
    assert runner.keys([(6, 4, 6)]) == [(3, 24), (3, 24)]  # 6 frames of 24 patches: 5 fit, split evenly
    assert runner.keys([(7, 4, 6)]) == [(4, 24), (3, 24)]
    assert runner.keys([(1, 12, 12)]) == [None]  # one image over the limit: eager, at its size


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


VISION_CASES = {
    "two-sizes": ([[chat("image", "and", "image", "image", "compare them")]],
                  {"images": [image(64, 64), image(32, 64, "blue"), image(64, 64, "green")]}),
    "video-split": ([[chat("video", "What happens?")]], {"video_grids": [(6, 4, 6)]}),
    "over-the-limit": ([[chat("image", "What is it?")]], {"images": [image(192, 192)]}),
}


@pytest.mark.parametrize("name", VISION_CASES)
def test_vision_chunks_equal_stock(padded_pair, name, monkeypatch):
    """Images of two sizes (two chunks, outputs gathered back in order), a video split into chunks of frames, one
    image over `vision_graph_patches` (eager): merged and DeepStack features match stock, with one batched SDPA
    call per block and chunk."""
    ours, stock = padded_pair
    model_inputs = build(VISION_CASES[name])
    kind = "pixel_values_videos" if name == "video-split" else "pixel_values"
    pixels, grid = model_inputs[kind], model_inputs["video_grid_thw" if name == "video-split" else "image_grid_thw"]
    runner = ours._engine.vision
    chunks = runner.keys([tuple(row) for row in grid.tolist()])
    assert len(chunks) == {"two-sizes": 2, "video-split": 2, "over-the-limit": 1}[name]
    assert (None in chunks) == (name == "over-the-limit")
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda *a, **k: calls.append(a[0].shape[0]) or sdpa(*a, **k))
    with torch.no_grad():
        got = ours.model.visual(pixels, grid_thw=grid)
        assert calls == [count or 1 for count, _ in (key or (None, None) for key in chunks)
                         for _ in ours.model.visual.blocks]
        expected = stock.model.visual(pixels, grid_thw=grid)
    (got_merged, got_deepstack), (merged, deepstack) = vision_features(got), vision_features(expected)
    # fp32 sums in another order (a chunk's frames in one attention call, stock's one by one), through every block:
    # differences near 1e-5 on features of up to ~14, which ones depending on the CPU's kernels
    close = partial(torch.testing.assert_close, rtol=1e-4, atol=5e-5)
    close(got_merged, merged)
    assert len(got_deepstack) == len(deepstack) == len(ours.config.vision_config.deepstack_visual_indexes) > 0
    for got_layer, layer in zip(got_deepstack, deepstack):
        close(got_layer, layer)


def test_vision_graphs_keep_the_most_recent_sizes(padded_pair, monkeypatch):
    """Graphs of at most `vision_table_cache_size` (2 here) image sizes are kept, every count of a size together,
    least recently used dropped. (A stand-in capturer: graphs need CUDA; the bookkeeping does not.)"""
    ours, _ = padded_pair
    runner = ours._engine.vision

    class Capturer:
        def capture(self, step, state=(), name=""):
            return SimpleNamespace(replay=lambda: None)

    for name, value in {"capturer": Capturer(), "use_graphs": True, "graphs": OrderedDict()}.items():
        monkeypatch.setattr(runner, name, value)
    for grid in [(1, 4, 4), (1, 4, 8), (1, 4, 4), (1, 8, 8), (1, 4, 4)]:
        runner.encode(torch.randn(grid[1] * grid[2], runner.pixels.shape[1]), torch.tensor([grid]))
    assert sorted(runner.graphs) == [(1, 16), (1, 64)]  # 32 patches: least recently used, dropped
    runner.encode(torch.randn(32, runner.pixels.shape[1]), torch.tensor([[1, 4, 4], [1, 4, 4]]))  # two images
    assert sorted(runner.graphs) == [(1, 16), (1, 64), (2, 16)]
    runner.encode(torch.randn(32, runner.pixels.shape[1]), torch.tensor([[1, 4, 8]]))
    assert sorted(runner.graphs) == [(1, 16), (1, 32), (2, 16)]
    monkeypatch.setattr(runner, "table_cache_size", 0)  # no graph kept: each call still runs
    runner.encode(torch.randn(16, runner.pixels.shape[1]), torch.tensor([[1, 4, 4]]))
    assert not runner.graphs


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
