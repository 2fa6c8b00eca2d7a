"""The vision tower after `generate`: training like stock, and the runner's run-ahead and tables kept safe."""

from types import SimpleNamespace

import pytest
import torch
from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

from conftest import build, chat, image
from qwen3vl_static import Qwen3VLGraphForConditionalGeneration
from qwen3vl_static.compat_qwen3vl_graph import vision_features
from qwen3vl_static.presets import tiny_config, tiny_config_dict
from qwen3vl_static.vision_qwen3vl_graph import VisionRunner

ONE_IMAGE = ([[chat("image", "What is in the picture?")]], {"images": [image(64, 96)]})
OTHER_SIZE = ([[chat("image", "And this one?")]], {"images": [image(32, 64, "blue")]})


@pytest.fixture
def pair():
    """(ours, stock): the tiny model in both classes with identical random weights, fp32, eval mode; built for each
    test, which may train them."""
    torch.manual_seed(0)
    ours = Qwen3VLGraphForConditionalGeneration(tiny_config(static_cache_len=160, max_batch_size=4)).eval()
    stock = Qwen3VLForConditionalGeneration(Qwen3VLConfig(**tiny_config_dict())).eval()
    stock.load_state_dict(ours.state_dict())
    return ours, stock


def gradients(model, model_inputs) -> dict:
    model.zero_grad(set_to_none=True)
    model(**model_inputs, labels=model_inputs["input_ids"]).loss.backward()
    return {name: parameter.grad for name, parameter in model.named_parameters()}


def test_training_after_generate_is_stock_training(pair):
    """After a generate with an image, training steps (forward with labels, backward, optimizer step) give every
    parameter stock's gradient, `visual.pos_embed` included, again and again over the same image size and a new one;
    back in eval mode, generate still equals stock on the updated weights."""
    ours, stock = pair
    model_inputs = build(ONE_IMAGE)
    ours.generate(**model_inputs, max_new_tokens=4, do_sample=False)  # the runner and this size's tables
    optimizers = [torch.optim.SGD(model.parameters(), lr=0.5) for model in (ours, stock)]
    ours.train()
    stock.train()
    for case in (ONE_IMAGE, ONE_IMAGE, OTHER_SIZE, OTHER_SIZE):
        step_inputs = build(case)
        expected, got = gradients(stock, step_inputs), gradients(ours, step_inputs)
        assert expected["model.visual.pos_embed.weight"] is not None
        assert [name for name, grad in got.items() if grad is None] == [name for name, grad in expected.items() if grad is None]
        for name, grad in expected.items():
            if grad is not None:
                torch.testing.assert_close(got[name], grad, rtol=1e-5, atol=1e-5, msg=name)
        for optimizer in optimizers:
            optimizer.step()
    ours.eval()
    stock.eval()
    stock.load_state_dict(ours.state_dict())  # the very same trained weights (our gemm patch embedding rounds differently)
    kwargs = dict(max_new_tokens=8, do_sample=False, output_logits=True, return_dict_in_generate=True)
    for case in (ONE_IMAGE, OTHER_SIZE):
        model_inputs = build(case)
        expected, got = stock.generate(**model_inputs, **kwargs), ours.generate(**model_inputs, **kwargs)
        assert got.sequences.tolist() == expected.sequences.tolist()
        torch.testing.assert_close(got.logits[0], expected.logits[0], rtol=1e-4, atol=1e-4)  # the prefill's logits
        pixels, grid = model_inputs["pixel_values"], model_inputs["image_grid_thw"]
        with torch.no_grad():  # the runner's path, on tables of the trained position embedding
            got, expected = (vision_features(model.model.visual(pixels, grid_thw=grid)) for model in (ours, stock))
        torch.testing.assert_close(got[0], expected[0], rtol=1e-5, atol=1e-5)


def test_with_grad_enabled_the_tower_is_stock(pair, monkeypatch):
    """With grad enabled the tower runs the stock forward and attention (no runner, no fused kernels): stock's features,
    with autograd state."""
    ours, stock = pair
    model_inputs = build(ONE_IMAGE)
    ours.generate(**model_inputs, max_new_tokens=2, do_sample=False)
    runner = ours._engine.vision

    def unexpected(*args, **kwargs):
        raise AssertionError("a runner path ran with grad enabled")

    monkeypatch.setattr(runner, "encode", unexpected)
    monkeypatch.setattr(runner.ops, "vision_qkv_rope", unexpected)
    pixels, grid = model_inputs["pixel_values"], model_inputs["image_grid_thw"]
    got = vision_features(ours.model.visual(pixels, grid_thw=grid))
    expected = vision_features(stock.model.visual(pixels, grid_thw=grid))
    assert got[0].grad_fn is not None
    torch.testing.assert_close(got[0], expected[0], rtol=1e-5, atol=1e-5)
    for got_layer, layer in zip(got[1], expected[1], strict=True):
        torch.testing.assert_close(got_layer, layer, rtol=1e-5, atol=1e-5)


def test_cached_vision_tables_hold_no_autograd_state(pair):
    """Tables computed with grad enabled are still plain tensors: a cached one never ties calls to one graph."""
    ours, _ = pair
    ours.static_cache()
    runner = ours._engine.vision
    assert torch.is_grad_enabled()
    for tensor in runner.table((1, 4, 6)):
        assert not tensor.requires_grad and tensor.grad_fn is None


def test_vision_tables_follow_weight_updates(pair):
    """A cached table is recomputed once the position embedding changes in place (an optimizer step, a
    `load_state_dict`)."""
    ours, _ = pair
    ours.static_cache()
    runner = ours._engine.vision
    before = runner.table((1, 4, 6))[0]
    with torch.no_grad():
        ours.model.visual.pos_embed.weight.mul_(2)
    after = runner.table((1, 4, 6))[0]
    torch.testing.assert_close(after, 2 * before)


def test_no_run_ahead_for_calls_with_videos(pair, monkeypatch):
    """The run-ahead is matched by grids and pixel shape only, which a video of an image's grid shares: a call with
    videos never starts one. (A runner that pads as on CUDA, with a stand-in graph; a started run-ahead looks up its
    tables first, which stops it here before anything CUDA-only.)"""
    ours, _ = pair
    visual = ours.model.visual
    runner = VisionRunner(visual, ours.graph_engine().ops, ours.config.vision_graph_patches, 2, None, use_graphs=True,
                          bucketed=True)
    runner.use_graphs = True  # graphs need CUDA; the bookkeeping does not
    runner.graphs[(1, 16)] = SimpleNamespace(replay=lambda: None)

    class Started(Exception):
        pass

    def started(grid):
        raise Started

    monkeypatch.setattr(runner, "table", started)
    pixels, grid = torch.randn(16, runner.pixels.shape[1]), torch.tensor([[1, 4, 4]])
    runner.encode_ahead(pixels, grid, videos=True)
    assert runner.ahead is None
    with pytest.raises(Started):  # the same images in a call without videos
        runner.encode_ahead(pixels, grid, videos=False)
