"""A later turn passes the returned cache back, as with stock transformers: the same tokens as stock reusing its own
cache and as stock starting fresh; when the prompt extends what our cache holds, only its new tokens are prefilled
(CPU, fp32)."""

import pytest
import torch

from conftest import bucketed_pair, chat, image
from qwen3vl_static.compat_qwen3vl_graph import CACHE_KWARG, TAKES_MM_TOKEN_TYPE_IDS, returned_cache
from qwen3vl_static.presets import TINY_IDS, tiny_inputs

FIRST_TURNS = {
    "text": ([chat("Describe a cat in one line.")], []),
    "image": ([chat("image", "What colour is it?")], [image(64, 64)]),
}
GREEDY = dict(max_new_tokens=8, do_sample=False)


def next_turn(first_inputs, sequences, images=()):
    """`(resumed, fresh)` inputs of a second turn: the first turn's sequences, then a user turn with `images`.
    Resumed, as a chat client passes them with the cache: the cached images' pixels are not passed again (the cache
    holds their tokens), the new ones are. Fresh: every image's pixels, as for a new request."""
    turn = tiny_inputs([[chat(*(["image"] * len(images)), "And why?")]], images=list(images))
    input_ids = torch.cat([sequences, turn["input_ids"]], dim=1)
    resumed = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}
    if images:
        resumed.update(pixel_values=turn["pixel_values"], image_grid_thw=turn["image_grid_thw"])
    fresh = dict(resumed)
    if "pixel_values" in first_inputs:
        for key in ("pixel_values", "image_grid_thw"):
            fresh[key] = torch.cat([first_inputs[key], *([turn[key]] if images else [])])
    if TAKES_MM_TOKEN_TYPE_IDS:
        for inputs in (resumed, fresh):
            inputs["mm_token_type_ids"] = (input_ids == TINY_IDS["<|image_pad|>"]).int()
    return resumed, fresh


@pytest.mark.parametrize("first", list(FIRST_TURNS))
def test_second_turn_with_the_returned_cache_matches_stock(tiny_pair, first):
    ours, stock = tiny_pair
    conversation, images = FIRST_TURNS[first]
    first_inputs = tiny_inputs([conversation], images=images)
    expected_first = stock.generate(**first_inputs, **GREEDY, return_dict_in_generate=True)
    got_first = ours.generate(**first_inputs, **GREEDY, return_dict_in_generate=True)
    assert got_first.sequences.tolist() == expected_first.sequences.tolist()
    resumed, fresh = next_turn(first_inputs, got_first.sequences)
    # Stock continues with the M-RoPE offsets of the model's last call (`rope_deltas`): its reuse runs first.
    reused = stock.generate(**resumed, **GREEDY, **{CACHE_KWARG: returned_cache(expected_first)})
    got = ours.generate(**resumed, **GREEDY, **{CACHE_KWARG: returned_cache(got_first)})
    assert got.tolist() == reused.tolist() == stock.generate(**fresh, **GREEDY).tolist()


def test_new_image_in_the_second_turn_behaves_as_stock_reusing_its_cache(tiny_pair):
    """Releases differ in how they place new images after a cache (and 5.24 refuses this input): whatever stock
    does with its cache, ours does with its own."""
    ours, stock = tiny_pair
    conversation, images = FIRST_TURNS["image"]
    first_inputs = tiny_inputs([conversation], images=images)
    expected_first = stock.generate(**first_inputs, **GREEDY, return_dict_in_generate=True)
    got_first = ours.generate(**first_inputs, **GREEDY, return_dict_in_generate=True)
    resumed, _ = next_turn(first_inputs, got_first.sequences, images=[image(96, 64, "green")])
    try:
        reused = stock.generate(**resumed, **GREEDY, **{CACHE_KWARG: returned_cache(expected_first)})
    except Exception as stock_error:
        with pytest.raises(type(stock_error)):
            ours.generate(**resumed, **GREEDY, **{CACHE_KWARG: returned_cache(got_first)})
    else:
        assert ours.generate(**resumed, **GREEDY, **{CACHE_KWARG: returned_cache(got_first)}).tolist() == reused.tolist()


@pytest.fixture(scope="module")
def bucketed():
    return bucketed_pair(graph_cache_lengths=[96])


@pytest.mark.parametrize("pair", ["tiny_pair", "bucketed"], ids=["exact", "bucketed"])
def test_a_batch_resumes_prefilling_only_its_new_tokens(request, pair, monkeypatch):
    """Two left-padded rows, three turns: each later turn prefills only its new tokens (into the slots after the
    cached ones, bucketed to a KV-length bucket or at their exact size) and equals stock reusing its cache."""
    ours, stock = request.getfixturevalue(pair)
    prefill = ours._engine.prefill
    starts = []
    run = prefill.run
    monkeypatch.setattr(prefill, "run", lambda *args, **kwargs: starts.append((args[0].shape[1], args[-1])) or run(*args, **kwargs))
    # The first row left-padded: on 4.57 its zero pad embeddings leave zero keys, which the layers' own count skips.
    inputs = tiny_inputs([[chat("Hi")], [chat("image", "What is it?")]], images=[image(64, 64)])
    got = ours.generate(**inputs, **GREEDY, return_dict_in_generate=True)
    expected = stock.generate(**inputs, **GREEDY, return_dict_in_generate=True)
    assert got.sequences.tolist() == expected.sequences.tolist()
    for turn in range(2):
        turn_ids = tiny_inputs([[chat("Why" + "?" * turn)], [chat("And then?")]])
        resumed = {
            "input_ids": torch.cat([got.sequences, turn_ids["input_ids"]], dim=1),
            "attention_mask": torch.cat([inputs["attention_mask"], torch.ones_like(got.sequences[:, inputs["input_ids"].shape[1]:]),
                                         turn_ids["attention_mask"]], dim=1),
        }
        if TAKES_MM_TOKEN_TYPE_IDS:
            resumed["mm_token_type_ids"] = (resumed["input_ids"] == TINY_IDS["<|image_pad|>"]).int()
            resumed["image_grid_thw"] = inputs["image_grid_thw"]
        expected = stock.generate(**resumed, **GREEDY, return_dict_in_generate=True, **{CACHE_KWARG: returned_cache(expected)})
        got = ours.generate(**resumed, **GREEDY, return_dict_in_generate=True, **{CACHE_KWARG: returned_cache(got)})
        assert got.sequences.tolist() == expected.sequences.tolist()
        held = resumed["input_ids"].shape[1] - turn_ids["input_ids"].shape[1] - 1
        assert starts[-1] == (turn_ids["input_ids"].shape[1] + 1, held)  # the last answer token and the new turn
        inputs = resumed
    assert prefill.use_graphs is False


def test_a_prompt_that_does_not_extend_the_cache_continues_it_as_stock_does(tiny_pair):
    ours, stock = tiny_pair
    first = tiny_inputs([[chat("Describe a cat in one line.")]])
    got_first = ours.generate(**first, **GREEDY, return_dict_in_generate=True)
    expected_first = stock.generate(**first, **GREEDY, return_dict_in_generate=True)
    other = tiny_inputs([[chat("Describe a dog in a few more words, please.")]])
    reused = stock.generate(**other, **GREEDY, **{CACHE_KWARG: returned_cache(expected_first)})
    assert ours.generate(**other, **GREEDY, **{CACHE_KWARG: returned_cache(got_first)}).tolist() == reused.tolist()
    # The next plain call starts afresh on the same cache.
    assert ours.generate(**other, **GREEDY).tolist() == stock.generate(**other, **GREEDY).tolist()


def test_a_cache_emptied_since_it_was_returned_serves_a_new_request(tiny_pair, monkeypatch):
    """`warmup()` and continuous batching run steps on the cache's rows and leave it empty (`clear`): a turn passing
    it back then prefills its whole prompt on the fast path, the tokens of a fresh request, and never reads what the
    cache held."""
    ours, stock = tiny_pair
    first_inputs = tiny_inputs([FIRST_TURNS["text"][0]])
    got_first = ours.generate(**first_inputs, **GREEDY, return_dict_in_generate=True)
    resumed, fresh = next_turn(first_inputs, got_first.sequences)
    ours.graph_engine().cache.clear()
    starts = []
    prefill = type(ours)._prefill_prompt
    monkeypatch.setattr(type(ours), "_prefill_prompt",
                        lambda self, input_ids, model_kwargs, start, *args, **kwargs: (
                            starts.append(start), prefill(self, input_ids, model_kwargs, start, *args, **kwargs))[1])
    got = ours.generate(**resumed, **GREEDY, **{CACHE_KWARG: returned_cache(got_first)})
    assert starts == [0]
    assert got.tolist() == stock.generate(**fresh, **GREEDY).tolist()


def test_an_image_turn_on_a_cache_emptied_since_it_was_returned_is_refused(tiny_pair):
    """Its image tokens are in the prompt but its pixels only were in the cache: a clear error before anything runs,
    and the model answers the conversation passed as a new request."""
    ours, stock = tiny_pair
    conversation, images = FIRST_TURNS["image"]
    first_inputs = tiny_inputs([conversation], images=images)
    got_first = ours.generate(**first_inputs, **GREEDY, return_dict_in_generate=True)
    resumed, fresh = next_turn(first_inputs, got_first.sequences)
    ours.graph_engine().cache.clear()
    with pytest.raises(ValueError, match="holds nothing .* 4 image tokens have no images"):
        ours.generate(**resumed, **GREEDY, **{CACHE_KWARG: returned_cache(got_first)})
    assert ours.generate(**fresh, **GREEDY).tolist() == stock.generate(**fresh, **GREEDY).tolist()
