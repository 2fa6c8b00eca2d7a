"""Continuous batching (`generate_batch`, `init_continuous_batching`): each request's output equals `generate` on that
request alone (fp32, token for token), with more requests than cache rows, images among them, requests entering
together, and rows finishing at different steps; a bad request fails alone; the model stays usable for `generate`
afterwards."""

import pytest
import torch
from conftest import bucketed_pair, build, chat, image, new_pair
from transformers.generation.continuous_batching.requests import RequestStatus

CASES = [([[chat("image", "What is it?")]], {"images": [image(64, 64)]}), ([[chat("Hi")]], {}),
         ([[chat("image", "Describe it.")]], {"images": [image(96, 64)]}), ([[chat("Tell me more about it")]], {})]


def requests_and_expected(stock, count, eos_token_id=None, lengths=None, cases=CASES):
    """`count` requests over `cases` (max_new_tokens 2, 5, 8, ..., or `lengths`) and what stock `generate` gives each
    alone."""
    requests, expected = [], []
    for index in range(count):
        inputs = build(cases[index % len(cases)])
        new_tokens = lengths[index] if lengths else 2 + 3 * index
        out = stock.generate(**inputs, max_new_tokens=new_tokens, do_sample=False, eos_token_id=eos_token_id)
        expected.append(out[0, inputs["input_ids"].shape[1]:].tolist())
        requests.append({**inputs, "max_new_tokens": new_tokens})
    return requests, expected


@pytest.mark.parametrize("pair", [new_pair, bucketed_pair], ids=["exact", "bucketed"])
def test_each_request_generates_as_alone(pair):
    ours, stock = pair()  # 4 cache rows for 7 requests: rows are taken again as they free up
    requests, expected = requests_and_expected(stock, 7)
    calls, stepped = [], []  # rows of each `generate` call that admits requests; rows of each chunk of steps
    generate, runner = ours.generate, ours.graph_engine().decode
    ours.generate = lambda **inputs: calls.append(inputs["input_ids"].shape[0]) or generate(**inputs)
    issue = runner.issue
    runner.issue = lambda *args: stepped.append(runner.batch_size) or issue(*args)
    results = ours.generate_batch(requests, progress_bar=False)
    del ours.generate, runner.issue
    # The first 4 requests arrive together: the 2 image and the 2 text prompts (each pair of two lengths, padded on
    # the left) enter in one call per pair. The rows in use move to the front: the last request steps alone.
    assert calls[:2] == [2, 2] and sum(calls) == 7
    assert stepped[0] == 4 and stepped[-1] == 1
    assert list(results) == [f"req_{index}" for index in range(7)]
    for result, tokens, request in zip(results.values(), expected, requests):
        assert result.status == RequestStatus.FINISHED and result.error is None
        assert result.prompt_ids == request["input_ids"][0].tolist()
        assert result.generated_tokens == tokens
    # The cache is empty again: a plain call afterwards is stock's.
    inputs = build(CASES[0])
    assert ours.generate(**inputs, max_new_tokens=6, do_sample=False).tolist() == stock.generate(
        **inputs, max_new_tokens=6, do_sample=False).tolist()


def test_free_rows_gather_while_requests_wait():
    """With more requests waiting than rows free, rows enter an eighth of the rows at a time (here 2 of 16), not one
    by one as they free up (every step frees one here); each request still generates as alone."""
    ours, stock = new_pair(max_batch_size=16, steps_per_sync=1)
    texts = [case for case in CASES if not case[1]]  # one group: text prompts of two lengths
    requests, expected = requests_and_expected(stock, 24, lengths=[2 + index % 16 for index in range(24)], cases=texts)
    calls = []
    generate = ours.generate
    ours.generate = lambda **inputs: calls.append(inputs["input_ids"].shape[0]) or generate(**inputs)
    results = ours.generate_batch(requests, progress_bar=False)
    del ours.generate
    assert [result.generated_tokens for result in results.values()] == expected
    assert calls[0] == 16 and sum(calls) == 24 and min(calls[:-1]) >= 2


def test_rows_stop_at_their_own_eos():
    ours, stock = new_pair()
    # An EOS id that the greedy answers reach early: the stock output ends with it.
    probe = stock.generate(**build(CASES[1]), max_new_tokens=8, do_sample=False)[0]
    eos = int(probe[-5])
    requests, expected = requests_and_expected(stock, 5, eos_token_id=eos)
    results = ours.generate_batch(requests, progress_bar=False, eos_token_id=eos, do_sample=False)  # as the batch
    assert [result.generated_tokens for result in results.values()] == [
        tokens[: tokens.index(eos) + 1] if eos in tokens else tokens for tokens in expected]
    assert any(eos in tokens for tokens in expected)


def test_a_bad_request_fails_alone():
    ours, stock = new_pair()
    requests, expected = requests_and_expected(stock, 3)
    broken = dict(requests[0])
    broken["image_grid_thw"] = broken["image_grid_thw"] * 2  # features and placeholders no longer match
    too_long = {**requests[1], "max_new_tokens": 1000}
    results = ours.generate_batch([broken, requests[1], too_long, requests[2]], progress_bar=False)
    statuses = [result.status for result in results.values()]
    assert statuses == [RequestStatus.FAILED, RequestStatus.FINISHED, RequestStatus.FAILED, RequestStatus.FINISHED]
    assert "image_grid_thw" in results["req_0"].error and "static_cache_len" in results["req_2"].error
    assert [results["req_1"].generated_tokens, results["req_3"].generated_tokens] == expected[1:]


def test_manager_streams_results_as_requests_arrive():
    ours, stock = new_pair()
    requests, expected = requests_and_expected(stock, 3)
    manager = ours.init_continuous_batching()
    manager.start()
    try:
        first = manager.add_request(**requests[0], request_id="first")
        assert manager.get_result(first, timeout=60).generated_tokens == expected[0]
        ids = [manager.add_request(**request) for request in requests[1:]]
        results = {manager.get_result(timeout=60).request_id for _ in ids}
        assert results == set(ids)
        times = [manager.timings[request_id] for request_id in (first, *ids)]
        assert all(time["added"] <= time["first_token"] <= time["finished"] for time in times)
    finally:
        manager.stop()
    assert not manager.is_running()


def test_sampled_requests_take_their_own_settings():
    ours, _ = new_pair()
    ours.generation_config.do_sample = True
    inputs = build(CASES[1])
    torch.manual_seed(0)
    results = ours.generate_batch([{**inputs, "max_new_tokens": 6, "top_k": 1}, {**inputs, "max_new_tokens": 6},
                                   {**inputs, "max_new_tokens": 6, "do_sample": False}], progress_bar=False)
    top_1, sampled, greedy = results.values()
    assert top_1.generated_tokens == ours.generate(**inputs, max_new_tokens=6, do_sample=False)[0, -6:].tolist()
    assert sampled.status == RequestStatus.FINISHED and len(sampled.generated_tokens) == 6
    assert greedy.status == RequestStatus.FAILED and "do_sample" in greedy.error
