"""The opt-in float8 KV cache (`kv_cache_dtype="fp8"`): the cache stores K and V as float8 e4m3, and every path
attends to them as stored. Its greedy output must equal stock transformers whose cache rounds K and V the same way
(fp32, CPU): our prefill, decode step, transformers' own loop on our cache and continuous batching alike."""

import pytest
import torch
from conftest import build, chat, image, new_pair
from ops_checks import DEVICE, needs_triton
from test_speculative import ScriptedDraft
from transformers import DynamicCache

from qwen3vl_static.batching_qwen3vl_graph import kv_bytes_per_slot
from qwen3vl_static.cache_qwen3vl_graph import cache_values
from qwen3vl_static.compat_qwen3vl_graph import CACHE_KWARG, returned_cache
from qwen3vl_static.presets import tiny_config, tiny_inputs
from qwen3vl_static.triton_qwen3vl_graph import _cache_value, tl, triton

GREEDY = dict(max_new_tokens=10, do_sample=False)
CASES = {
    "text batch, padded": ([[chat("Hi")], [chat("a longer question here")]], {}),
    "image": ([[chat("image", "What is it?")]], {"images": [image(64, 48)]}),
}


class Float8RoundingCache(DynamicCache):
    """Stock's own cache, K and V rounded to float8 and back as they are stored: what the float8 cache attends to."""

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        rounded = [cache_values(states, torch.float8_e4m3fn).to(states.dtype) for states in (key_states, value_states)]
        return super().update(*rounded, layer_idx, *args, **kwargs)


@pytest.fixture(scope="module")
def fp8_pair():
    return new_pair(kv_cache_dtype="fp8")


def stock_rounded(stock, inputs, **kwargs):
    return stock.generate(**inputs, **GREEDY, **{CACHE_KWARG: Float8RoundingCache()}, **kwargs)


if triton is not None:

    @triton.jit
    def _stored_kernel(states, cache, SIZE: tl.constexpr):
        offsets = tl.arange(0, SIZE)
        tl.store(cache + offsets, _cache_value(tl.load(states + offsets), cache))


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernels_store_float8_as_torch_casts(dtype):
    """`_cache_value`, through which every kernel writes the cache, equals `cache_values` bit for bit: values across
    float8's range and below it (subnormals), ties, signed zeros and beyond 448 (compiled on a GPU, interpreted here)."""
    torch.manual_seed(0)
    edges = torch.tensor([0.0, -0.0, -0.0009, 0.0009, 2**-10, 3 * 2**-10, 15.5, 17.0, 19.0, 448, 449, 464, 465, -1e9])
    spread = 2**16 - len(edges)  # magnitudes from 1e-4 to 1e4 (the kernel takes a power of two)
    states = torch.cat([torch.randn(spread) * 10 ** torch.empty(spread).uniform_(-4, 4), edges])
    states = states.to(dtype).to(DEVICE)
    cache = torch.empty(states.numel(), dtype=torch.float8_e4m3fn, device=DEVICE)
    _stored_kernel[(1,)](states, cache, SIZE=states.numel())
    expected = cache_values(states, torch.float8_e4m3fn)
    assert torch.equal(cache.view(torch.uint8), expected.view(torch.uint8))


def test_cache_values_saturate_and_round_to_nearest():
    states = torch.tensor([1000.0, -1000.0, 448.0, 17.0, 0.3, -0.0])
    stored = cache_values(states, torch.float8_e4m3fn)
    assert stored.dtype == torch.float8_e4m3fn
    assert stored.float().tolist() == [448.0, -448.0, 448.0, 16.0, 0.3125, -0.0]  # 17 ties to even
    assert cache_values(states, torch.float32) is states


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_equals_stock_attending_to_float8_rounded_keys_and_values(fp8_pair, case):
    ours, stock = fp8_pair
    inputs = build(CASES[case])
    got = ours.generate(**inputs, **GREEDY)
    assert ours._engine.cache.full_keys[0].dtype == torch.float8_e4m3fn
    assert got.tolist() == stock_rounded(stock, inputs).tolist()


def test_rounding_changes_the_answer_here():
    """The test above could not pass on an unrounded cache: on these weights the rounding changes the tokens."""
    ours, stock = new_pair()
    inputs = build(CASES["image"])
    assert ours.generate(**inputs, **GREEDY).tolist() != stock_rounded(stock, inputs).tolist()


def test_transformers_loop_on_the_float8_cache_stores_and_reads_it_rounded(fp8_pair):
    """A prompt that does not extend what the returned cache holds continues on it in transformers' own loop (its
    layers write through `ASStaticCache.update`)."""
    ours, stock = fp8_pair
    first = tiny_inputs([[chat("Describe a cat in one line.")]])
    got_first = ours.generate(**first, **GREEDY, return_dict_in_generate=True)
    other = tiny_inputs([[chat("Describe a dog in a few more words, please.")]])
    expected_first = stock.generate(**first, **GREEDY, return_dict_in_generate=True,
                                    **{CACHE_KWARG: Float8RoundingCache()})
    reused = stock.generate(**other, **GREEDY, **{CACHE_KWARG: returned_cache(expected_first)})
    got = ours.generate(**other, **GREEDY, **{CACHE_KWARG: returned_cache(got_first)})
    assert got.tolist() == reused.tolist()
    assert returned_cache(got_first).full_keys[0].dtype == torch.float8_e4m3fn


@pytest.mark.parametrize("miss", [None, 1], ids=["proposals-right", "second-proposal-wrong"])
def test_the_speculative_loop_verifies_on_the_float8_cache(fp8_pair, miss):
    """The speculative loop's verify step (K + 1 positions of one row, written then read) on the float8 cache: a draft
    proposing stock's rounded answer (or wrong at its second proposal) gives that answer."""
    ours, stock = fp8_pair
    inputs = build(CASES["image"])
    expected = stock_rounded(stock, inputs, eos_token_id=None)
    try:
        ours.use_draft(ScriptedDraft(expected, miss), 3)
        assert ours.generate(**inputs, **GREEDY, eos_token_id=None).tolist() == expected.tolist()
        assert len(ours.speculative_stats["kept_per_cycle"]) > 1
    finally:
        ours.use_draft(None)


def test_continuous_batching_equals_generate_alone(fp8_pair):
    ours, _ = fp8_pair
    prompts = [tiny_inputs([[chat(text)]]) for text in ("Hi", "a longer question here", "and a third one")]
    alone = [ours.generate(**prompt, **GREEDY)[0, prompt["input_ids"].shape[1]:].tolist() for prompt in prompts]
    requests = [{**prompt, "max_new_tokens": GREEDY["max_new_tokens"]} for prompt in prompts]
    results = ours.init_continuous_batching().generate_all(requests, progress_bar=False)
    assert [result.generated_tokens for result in results.values()] == alone


def test_half_the_bytes_a_slot():
    config = tiny_config(kv_cache_dtype="fp8_e4m3")
    assert 2 * kv_bytes_per_slot(config, config.kv_dtype(torch.bfloat16)) == kv_bytes_per_slot(config, torch.bfloat16)
    assert tiny_config().kv_dtype(torch.bfloat16) == torch.bfloat16


def test_an_unknown_kv_cache_dtype_is_refused_by_name():
    from qwen3vl_static.cli import KV_CACHE_DTYPES as FLAG_CHOICES  # restated there: help must not import torch
    from qwen3vl_static.configuration_qwen3vl_graph import KV_CACHE_DTYPES

    assert FLAG_CHOICES == tuple(KV_CACHE_DTYPES)
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of \['auto', 'fp8', 'fp8_e4m3'\], got 'int8'"):
        new_pair(kv_cache_dtype="int8")
