"""Prefill ahead: a fresh prompt's prefill, queued as `generate` begins (before transformers prepares its loop), is
the one the loop uses; a call that does not qualify prefills in its loop; a call rejected after its prefill ran
leaves no conversation behind. Tokens equal stock's throughout (CPU, fp32)."""

import pytest
import torch

from conftest import build, chat, image
from qwen3vl_static import modeling_qwen3vl_graph
from qwen3vl_static.compat_qwen3vl_graph import CACHE_KWARG, returned_cache
from qwen3vl_static.presets import tiny_inputs

GREEDY = dict(max_new_tokens=6, do_sample=False)
PROMPTS = {
    "text": ([[chat("Describe a cat in one line.")]], {}),
    "image and text, padded": ([[chat("image", "What is it?")], [chat("Hello there")]], {"images": [image(64, 64)]}),
}


@pytest.fixture
def events(tiny_pair, monkeypatch):
    """The order in which `generate` prefilled the prompt and prepared its loop's cache (transformers' last step
    before the loop)."""
    ours, _ = tiny_pair
    order = []
    for name, event in (("_prefill_prompt", "prefill"), ("_prepare_cache_for_generation", "loop prepared")):
        def spy(*args, method=getattr(ours, name), event=event, **kwargs):
            order.append(event)
            return method(*args, **kwargs)

        monkeypatch.setattr(ours, name, spy)
    return order


@pytest.mark.parametrize("prompt", list(PROMPTS))
def test_a_fresh_prompt_is_prefilled_once_before_the_loop_is_prepared(tiny_pair, events, prompt):
    ours, stock = tiny_pair
    model_inputs = build(PROMPTS[prompt])
    assert ours.generate(**model_inputs, **GREEDY).tolist() == stock.generate(**model_inputs, **GREEDY).tolist()
    assert events == ["prefill", "loop prepared"]


def test_sampling_after_prefilling_ahead_draws_as_after_the_loops_own_prefill(tiny_pair, events, monkeypatch):
    ours, _ = tiny_pair
    model_inputs = build(PROMPTS["image and text, padded"])
    settings = dict(max_new_tokens=6, do_sample=True, top_k=5, temperature=0.8)
    torch.manual_seed(1)
    ahead = ours.generate(**model_inputs, **settings)
    monkeypatch.setattr(modeling_qwen3vl_graph, "prefill_ahead", lambda *_: None)
    torch.manual_seed(1)
    assert ours.generate(**model_inputs, **settings).tolist() == ahead.tolist()
    assert events == ["prefill", "loop prepared", "loop prepared", "prefill"]


@pytest.mark.parametrize("settings", [dict(max_length=40, do_sample=False), dict(**GREEDY, min_length=2)],
                         ids=["max_length", "min_length"])
def test_a_call_that_does_not_qualify_prefills_in_its_loop(tiny_pair, events, settings):
    ours, stock = tiny_pair
    model_inputs = build(PROMPTS["image and text, padded"])
    assert ours.generate(**model_inputs, **settings).tolist() == stock.generate(**model_inputs, **settings).tolist()
    assert events == ["loop prepared", "prefill"]


class FailingStreamer:
    def put(self, value):
        raise RuntimeError("the client went away")

    def end(self):
        pass


@pytest.mark.parametrize("rejected, error, reached", [
    (dict(streamer=FailingStreamer()), "went away", ["prefill"]),  # before the loop's cache is prepared
    (dict(do_sample=True, temperature=-1.0), "temperature", ["prefill", "loop prepared"]),  # warpers come after it
], ids=["a streamer failing on the prompt", "a temperature transformers rejects"])
def test_a_call_failing_after_prefilling_ahead_leaves_the_cache_empty(tiny_pair, events, rejected, error, reached):
    """A first turn fills the cache; a fresh call prefills ahead, then fails in transformers' preparation; the first
    turn's cache, passed back, continues as stock continues (through transformers' loop: it holds nothing now)."""
    ours, stock = tiny_pair
    first = tiny_inputs([[chat("Describe a cat in one line.")]])
    got_first = ours.generate(**first, **GREEDY, return_dict_in_generate=True)
    expected_first = stock.generate(**first, **GREEDY, return_dict_in_generate=True)
    assert got_first.sequences.tolist() == expected_first.sequences.tolist()
    events.clear()
    with pytest.raises((ValueError, RuntimeError), match=error):
        ours.generate(**build(PROMPTS["image and text, padded"]), max_new_tokens=6, **rejected)
    assert events == reached
    assert ours.static_cache().tokens is None
    turn = tiny_inputs([[chat("And why?")]])["input_ids"]
    input_ids = torch.cat([got_first.sequences, turn], dim=1)
    second = {"input_ids": input_ids, "attention_mask": input_ids.new_ones(input_ids.shape)}
    got = ours.generate(**second, **GREEDY, **{CACHE_KWARG: returned_cache(got_first)})
    assert got.tolist() == stock.generate(**second, **GREEDY, **{CACHE_KWARG: returned_cache(expected_first)}).tolist()


def test_the_rope_index_is_kept_for_the_very_same_tensors_only(tiny_pair):
    """Within a call, `generate`'s own M-RoPE index of a prompt prefilled ahead is the one computed ahead; any other
    tensors are computed anew, and outside a call nothing is kept."""
    ours, stock = tiny_pair
    model_inputs = build(PROMPTS["image and text, padded"])
    input_ids = model_inputs["input_ids"]
    kwargs = {key: model_inputs[key] for key in ("mm_token_type_ids", "image_grid_thw", "attention_mask")
              if key in model_inputs}
    expected = stock.model.get_rope_index(input_ids, **kwargs)
    with ours.model.rope_index_kept():
        first = ours.model.get_rope_index(input_ids, **kwargs)
        assert ours.model.get_rope_index(input_ids, **kwargs) is first
        other = ours.model.get_rope_index(input_ids.clone(), **kwargs)
        assert other is not first
    assert ours.model.get_rope_index(input_ids, **kwargs) is not first
    for got in (first, other):
        assert all(torch.equal(a, b) for a, b in zip(got, expected))
