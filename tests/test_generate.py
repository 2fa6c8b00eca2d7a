"""Greedy/sampled output of the static decode loop equals stock transformers token for token (fp32, CPU)."""

import pytest
import torch
from transformers import (
    CompileConfig, DynamicCache, GenerationConfig, LogitsProcessor, LogitsProcessorList, Qwen3VLForConditionalGeneration, TextIteratorStreamer,
)
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from conftest import build, chat, image, new_pair
from qwen3vl_static.compat_qwen3vl_graph import CACHE_KWARG
from qwen3vl_static.ops_sample_qwen3vl_graph import sample_tokens
from qwen3vl_static.presets import TINY_IDS, tiny_inputs, tiny_tokenizer

TEXT = [[chat("Describe a cat in one line.")]]
ONE_IMAGE = ([[chat("image", "What is in the picture?")]], {"images": [image(64, 96)]})
TWO_IMAGES = ([[chat("image", "and", "image", "compare them")]], {"images": [image(64, 64), image(128, 96, "blue")]})
VIDEO = ([[chat("video", "What happens?")]], {"video_grids": [(2, 4, 6)]})
MIXED_BATCH = (
    [[chat("image", "What is it?")], [chat("Hi")], [chat("video", "Summarise the clip, please.")]],
    {"images": [image(96, 64)], "video_grids": [(3, 4, 4)]},
)


def assert_same_generate(ours, stock, model_inputs, **kwargs):
    expected = stock.generate(**model_inputs, **kwargs)
    if ours._engine is not None:
        ours._engine.decode.length = -1  # `used_static_loop` sees whether a request started since
    got = ours.generate(**model_inputs, **kwargs)
    sequences = got.sequences if hasattr(got, "sequences") else got
    reference = expected.sequences if hasattr(expected, "sequences") else expected
    assert sequences.tolist() == reference.tolist()
    return got, expected


def used_static_loop(model):
    """The static loop (not the stock fallback) ran since `assert_same_generate` reset the runner's fill level."""
    return model._engine is not None and model._engine.decode.length >= 0


@pytest.mark.parametrize(
    "case",
    [(TEXT, {}), ONE_IMAGE, TWO_IMAGES, VIDEO, MIXED_BATCH],
    ids=["text", "one-image", "two-images", "video", "batch3-left-padded-mixed"],
)
def test_greedy_matches_stock(tiny_pair, case):
    ours, stock = tiny_pair
    conversations, media = case
    model_inputs = tiny_inputs(conversations, **media)
    assert_same_generate(ours, stock, model_inputs, max_new_tokens=24, do_sample=False)
    assert used_static_loop(ours)


def test_two_calls_in_a_row_and_multi_turn(tiny_pair):
    ours, stock = tiny_pair
    tokenizer = tiny_tokenizer()
    first = [chat("image", "What colour?")]
    model_inputs = tiny_inputs([first], images=[image(64, 64)])
    answer = assert_same_generate(ours, stock, model_inputs, max_new_tokens=10, do_sample=False)[0]
    reply = tokenizer.decode(answer[0, model_inputs["input_ids"].shape[1]:])
    # Second turn: the first exchange plus a new image, a longer prompt on the same persistent cache.
    second = first + [chat(reply, role="assistant"), chat("image", "And this one?")]
    model_inputs = tiny_inputs([second], images=[image(64, 64), image(96, 64, "green")])
    got, _ = assert_same_generate(ours, stock, model_inputs, max_new_tokens=12, do_sample=False)
    assert used_static_loop(ours)


def test_max_new_tokens_fills_capacity_exactly(tiny_pair):
    ours, stock = tiny_pair
    model_inputs = build(MIXED_BATCH)
    capacity = ours.config.static_cache_len
    # The last generated token is never fed back, so prompt + max_new_tokens - 1 slots are written.
    new_tokens = capacity - model_inputs["input_ids"].shape[1] + 1
    no_eos = ours.config.text_config.vocab_size  # an id no step can produce: every row runs to the end
    got, _ = assert_same_generate(
        ours, stock, model_inputs, max_new_tokens=new_tokens, do_sample=False, eos_token_id=no_eos
    )
    assert got.shape[1] == capacity + 1 and ours._engine.decode.length == capacity


class Identity(LogitsProcessor):
    """A processor the device loop does not know: forces the host loop (stock loop body, graph-replayed step)."""

    def __call__(self, input_ids, scores):
        return scores


def test_host_loop_seeded_sampling_matches_stock(tiny_pair):
    ours, stock = tiny_pair
    model_inputs = build(ONE_IMAGE)
    kwargs = dict(max_new_tokens=20, do_sample=True, temperature=0.9, top_k=50, top_p=0.95)
    torch.manual_seed(1234)
    expected = stock.generate(**model_inputs, **kwargs, logits_processor=LogitsProcessorList([Identity()]))
    torch.manual_seed(1234)
    got = ours.generate(**model_inputs, **kwargs, logits_processor=LogitsProcessorList([Identity()]))
    assert got.tolist() == expected.tolist()
    assert used_static_loop(ours)


def test_device_sampling_is_seeded_and_honours_warpers(tiny_pair):
    ours, _ = tiny_pair
    model_inputs = build(MIXED_BATCH)
    kwargs = dict(max_new_tokens=16, do_sample=True, temperature=1.3, top_p=0.9)
    runs = []
    for seed in (7, 7, 8):
        torch.manual_seed(seed)
        runs.append(ours.generate(**model_inputs, **kwargs).tolist())
    assert runs[0] == runs[1] and runs[0] != runs[2]
    greedy = ours.generate(**model_inputs, max_new_tokens=16, do_sample=False)
    # top_k=1 and a tiny top_p leave one candidate: sampling must reproduce greedy decoding.
    for warper in ({"top_k": 1}, {"top_p": 1e-6}):
        assert ours.generate(**model_inputs, max_new_tokens=16, do_sample=True, **warper).tolist() == greedy.tolist()


def test_sample_tokens_follows_transformers_warpers():
    """The device sampler's distribution equals softmax of transformers' warped scores."""
    torch.manual_seed(0)
    logits = torch.randn(1, 12) * 2
    processors = LogitsProcessorList([TemperatureLogitsWarper(0.7), TopKLogitsWarper(6), TopPLogitsWarper(0.8)])
    expected = processors(None, logits.clone()).softmax(-1)[0]
    draws = 40000
    tokens = sample_tokens(
        logits.expand(draws, -1), torch.full((draws,), 0.7), torch.full((draws,), 6), torch.full((draws,), 0.8)
    )
    frequencies = torch.bincount(tokens, minlength=12).float() / draws
    assert torch.all(frequencies[expected == 0] == 0)
    torch.testing.assert_close(frequencies, expected, atol=0.012, rtol=0)


def test_eos_list_pads_finished_rows_like_stock(tiny_pair):
    ours, stock = tiny_pair
    model_inputs = build(MIXED_BATCH)
    # Pick EOS ids that the greedy continuation really produces, so rows stop at different steps.
    free_run = stock.generate(**model_inputs, max_new_tokens=20, do_sample=False)
    generated = free_run[:, model_inputs["input_ids"].shape[1]:]
    eos = [int(generated[0, 3]), int(generated[2, 8])]
    got, expected = assert_same_generate(
        ours, stock, model_inputs, max_new_tokens=20, do_sample=False, eos_token_id=eos, pad_token_id=TINY_IDS["<|endoftext|>"]
    )
    assert (expected[:, -1] == TINY_IDS["<|endoftext|>"]).any()


def test_stop_strings_and_streamer(tiny_pair):
    ours, stock = tiny_pair
    tokenizer = tiny_tokenizer()
    model_inputs = build((TEXT, {}))
    prompt_len = model_inputs["input_ids"].shape[1]
    free_run = stock.generate(**model_inputs, max_new_tokens=20, do_sample=False)
    # A generated token that decodes to plain ASCII (random byte tokens are often partial UTF-8).
    texts = [tokenizer.decode(token) for token in free_run[0, prompt_len:-1]]
    stop = next(text for text in texts[2:] if text.isascii() and text.isprintable() and text.strip())
    got, expected = assert_same_generate(
        ours, stock, model_inputs, max_new_tokens=20, do_sample=False, stop_strings=[stop], tokenizer=tokenizer
    )
    assert expected.shape[1] < free_run.shape[1]

    streamer = TextIteratorStreamer(tokenizer, skip_prompt=True)
    ours.generate(**model_inputs, max_new_tokens=20, do_sample=False, streamer=streamer)
    assert "".join(streamer) == tokenizer.decode(free_run[0, prompt_len:])


def test_scores_and_logits_in_dict_output(tiny_pair):
    ours, stock = tiny_pair
    model_inputs = build(MIXED_BATCH)
    kwargs = dict(max_new_tokens=8, do_sample=False, return_dict_in_generate=True, output_scores=True, output_logits=True)
    got, expected = assert_same_generate(ours, stock, model_inputs, **kwargs)
    assert len(got.scores) == len(expected.scores) == 8
    for ours_step, stock_step in zip(got.logits, expected.logits):
        torch.testing.assert_close(ours_step, stock_step, rtol=1e-4, atol=1e-4)
    assert used_static_loop(ours)


def test_hidden_state_outputs_run_the_stock_loop(tiny_pair):
    ours, stock = tiny_pair
    model_inputs = build((TEXT, {}))
    ours._engine.decode.length = -1
    kwargs = dict(max_new_tokens=5, do_sample=False, return_dict_in_generate=True, output_hidden_states=True)
    got, expected = assert_same_generate(ours, stock, model_inputs, **kwargs)
    assert len(got.hidden_states) == 5
    assert ours._engine.decode.length == -1  # the static loop did not run


def test_beam_search_falls_back_with_one_warning(tiny_pair, caplog):
    ours, stock = tiny_pair
    model_inputs = build((TEXT, {}))
    with caplog.at_level("WARNING"):
        for _ in range(2):
            assert_same_generate(ours, stock, model_inputs, max_new_tokens=6, do_sample=False, num_beams=3)
    messages = [record.getMessage() for record in caplog.records if "stock generation loop" in record.getMessage()]
    assert len(messages) == 1 and "beam_search" in messages[0]


def test_compile_config_compiles_transformers_loop_only(monkeypatch, caplog):
    """`compile_config` compiles the decode step of transformers' own loop: where that loop runs on its own cache
    (here `output_hidden_states`) it compiles as stock does; where our decode step runs instead, or transformers' loop
    runs on our persistent cache, one notice says it is not used. Without a compile_config nothing compiles, even
    where stock compiles on its own (a static cache on CUDA)."""
    ours, stock = new_pair()
    compiled = []  # the forwards handed to torch.compile
    monkeypatch.setattr(torch, "compile", lambda function, **options: compiled.append(function) or function)
    compile_config = CompileConfig()
    compile_config._compile_all_devices = True  # compile on the CPU too
    model_inputs = build((TEXT, {}))
    kwargs = dict(max_new_tokens=4, do_sample=False, cache_implementation="static", compile_config=compile_config)

    def ours_compiled():
        return any(getattr(function, "__self__", None) is ours for function in compiled)

    def notices(text):
        return [record for record in caplog.records if text in record.getMessage()]

    with caplog.at_level("WARNING"):
        for _ in range(2):
            first, _ = assert_same_generate(ours, stock, model_inputs, return_dict_in_generate=True, **kwargs)
            assert used_static_loop(ours)
    assert not ours_compiled()
    assert len(notices("compile_config is not used: this model's own decode step runs instead")) == 1
    assert any(getattr(function, "__self__", None) is stock for function in compiled)

    # transformers' loop on our persistent cache, passed back: not compiled, said once.
    input_ids = torch.cat([first.sequences, model_inputs["input_ids"][:, -3:]], dim=1)
    with caplog.at_level("WARNING"):
        ours.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), output_hidden_states=True,
                      return_dict_in_generate=True, **{CACHE_KWARG: first.past_key_values}, **kwargs)
    assert not ours_compiled()
    assert len(notices("compile_config is not used with this model's persistent cache")) == 1

    # transformers' loop on its own static cache: compiled, as stock, same tokens.
    assert_same_generate(ours, stock, model_inputs, output_hidden_states=True, return_dict_in_generate=True, **kwargs)
    assert ours_compiled() and not used_static_loop(ours)

    # No compile_config: stock would compile on a GPU; we do not.
    monkeypatch.setattr(Qwen3VLForConditionalGeneration, "device", property(lambda model: torch.device("cuda")))
    static = {CACHE_KWARG: ours.static_cache()}
    assert stock._valid_auto_compile_criteria(static, GenerationConfig())
    assert not ours._valid_auto_compile_criteria(static, GenerationConfig())


def test_returned_cache_is_the_persistent_static_cache_and_a_dynamic_cache_is_kept(tiny_pair):
    """`generate` returns the model's `ASStaticCache` (a `StaticCache`) where stock returns a `DynamicCache`; code that
    needs the latter passes one and gets it back, filled by transformers' loop with stock's tokens."""
    ours, stock = tiny_pair
    model_inputs = build((TEXT, {}))
    kwargs = dict(max_new_tokens=4, do_sample=False, return_dict_in_generate=True)
    got, expected = assert_same_generate(ours, stock, model_inputs, **kwargs)
    assert got.past_key_values is ours.static_cache() and isinstance(expected.past_key_values, DynamicCache)
    length = got.sequences.shape[1] - 1
    assert int(got.past_key_values.get_seq_length()) == length
    expected = stock.generate(**model_inputs, **kwargs, **{CACHE_KWARG: DynamicCache()})
    ours._engine.decode.length = -1
    got = ours.generate(**model_inputs, **kwargs, **{CACHE_KWARG: DynamicCache()})
    assert got.sequences.tolist() == expected.sequences.tolist()
    assert isinstance(got.past_key_values, DynamicCache) and not used_static_loop(ours)
    for got_layer, expected_layer in zip(got.past_key_values.layers, expected.past_key_values.layers):
        assert torch.allclose(got_layer.keys, expected_layer.keys, atol=1e-5)


def test_assisted_decoding_on_an_image_prompt_matches_stock(tiny_pair):
    """The model as its own assistant: transformers' loop calls the assistant's `generate` with the main call's pixels
    and a cache that already holds their placeholders (they are dropped there, not checked against the prompt)."""
    ours, stock = tiny_pair
    model_inputs = build(ONE_IMAGE)
    expected = stock.generate(**model_inputs, assistant_model=stock, max_new_tokens=5, do_sample=False)
    assert ours.generate(**model_inputs, assistant_model=ours, max_new_tokens=5, do_sample=False).tolist() == (
        expected.tolist())


def test_inputs_embeds_run_the_stock_loop(tiny_pair):
    ours, stock = tiny_pair
    model_inputs = build((TEXT, {}))
    embeds = stock.get_input_embeddings()(model_inputs["input_ids"])
    kwargs = dict(inputs_embeds=embeds, attention_mask=model_inputs["attention_mask"], max_new_tokens=6, do_sample=False)
    assert ours.generate(**kwargs).tolist() == stock.generate(**kwargs).tolist()


@pytest.mark.parametrize("steps_per_sync", [1, 3])
def test_chunked_device_loop_stops_like_stock(tiny_pair, steps_per_sync):
    """Chunk boundaries anywhere relative to the EOS steps: the device loop still stops and pads like stock."""
    ours, stock = tiny_pair
    model_inputs = build(MIXED_BATCH)
    free_run = stock.generate(**model_inputs, max_new_tokens=20, do_sample=False)
    generated = free_run[:, model_inputs["input_ids"].shape[1]:]
    eos = [int(generated[0, 4]), int(generated[1, 9]), int(generated[2, 6])]
    ours.static_cache()
    runner = ours._engine.decode
    default = runner.steps_per_sync
    runner.steps_per_sync = steps_per_sync  # fewer columns of the same output buffers
    try:
        got, expected = assert_same_generate(ours, stock, model_inputs, max_new_tokens=20, do_sample=False, eos_token_id=eos)
    finally:
        runner.steps_per_sync = default
    assert expected.shape[1] < free_run.shape[1] and used_static_loop(ours)


def test_synced_gpus_runs_the_stock_loop_on_the_static_cache(tiny_pair, tmp_path):
    """`synced_gpus` (ZeRO-3 style lockstep) needs transformers' loop. After a static-loop call filled the cache, it
    runs on the same cache (marked empty first), equals stock, and the next call takes the static loop again. One
    process, a world of one."""
    import torch.distributed as dist

    ours, stock = tiny_pair
    model_inputs = build(ONE_IMAGE)
    assert_same_generate(ours, stock, model_inputs, max_new_tokens=12, do_sample=False)
    assert used_static_loop(ours)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        assert_same_generate(ours, stock, model_inputs, max_new_tokens=12, do_sample=False, synced_gpus=True)
        assert not used_static_loop(ours)
    finally:
        dist.destroy_process_group()
    assert_same_generate(ours, stock, model_inputs, max_new_tokens=12, do_sample=False)
    assert used_static_loop(ours)
