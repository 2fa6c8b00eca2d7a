"""Continuous batching (`generate_batch`, `init_continuous_batching`): each greedy request's output equals `generate` on
that request alone (fp32, token for token), with more requests than cache rows, images and text admitted together
under a prefill token budget while running rows keep decoding, and rows finishing at different steps; every setting
per request (a seeded sampled request draws the same tokens alone or among others); streaming, cancelling, stop
strings; a bad request fails alone; cache rows sized from (fake) GPU memory; the model stays usable afterwards."""

import math
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image
from conftest import bucketed_pair, build, chat, image, new_pair
from transformers import LogitsProcessor, LogitsProcessorList
from transformers.generation.continuous_batching.requests import RequestStatus

import qwen3vl_static.batching_qwen3vl_graph as batching
import qwen3vl_static.modeling_qwen3vl_graph as modeling
from qwen3vl_static.batching_qwen3vl_graph import (
    StreamingSteps,
    kv_bytes_per_slot,
    media_bytes_per_token,
    prompt_position_ids,
    slots_from_memory,
)
from qwen3vl_static.pixels import PixelNormalizer
from qwen3vl_static.presets import real_config, tiny_image_processor, tiny_tokenizer

CASES = [([[chat("image", "What is it?")]], {"images": [image(64, 64)]}), ([[chat("Hi")]], {}),
         ([[chat("image", "Describe it.")]], {"images": [image(96, 64)]}), ([[chat("Tell me more about it")]], {})]
TEXT = CASES[1]


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


def record_work(model):
    """Wrap the model's prefill and its decode runner's chunks: a list of ("prefill", rows) / ("decode", rows)."""
    events, runner = [], model.graph_engine().decode
    prefill, issue = model._prefill_prompt, runner.issue
    model._prefill_prompt = lambda input_ids, *args, **kwargs: (
        events.append(("prefill", input_ids.shape[0])) or prefill(input_ids, *args, **kwargs))
    runner.issue = lambda *args: events.append(("decode", runner.batch_size)) or issue(*args)
    return events


@pytest.mark.parametrize("pair", [new_pair, bucketed_pair], ids=["exact", "bucketed"])
def test_each_request_generates_as_alone(pair):
    ours, stock = pair()  # 4 cache rows for 7 requests: rows are taken again as they free up
    requests, expected = requests_and_expected(stock, 7)
    events = record_work(ours)
    results = ours.generate_batch(requests, progress_bar=False)
    # The first 4 requests enter together: the 2 text and the 2 image prompts (each pair of two lengths, padded on
    # the left) in one prefill per kind. The rows in use move to the front: the last request steps alone.
    assert events[:3] == [("prefill", 2), ("prefill", 2), ("decode", 4)]
    assert sum(rows for kind, rows in events if kind == "prefill") == 7 and events[-1] == ("decode", 1)
    assert list(results) == [f"req_{index}" for index in range(7)]
    for result, tokens, request in zip(results.values(), expected, requests):
        assert result.status == RequestStatus.FINISHED and result.error is None
        assert result.prompt_ids == request["input_ids"][0].tolist()
        assert result.generated_tokens == tokens
    # The cache is empty again: a plain call afterwards is stock's.
    inputs = build(CASES[0])
    assert ours.generate(**inputs, max_new_tokens=6, do_sample=False).tolist() == stock.generate(
        **inputs, max_new_tokens=6, do_sample=False).tolist()


def test_admissions_keep_to_the_token_budget_between_decode_chunks():
    """With a prefill budget of two prompts, 12 waiting text requests enter two per turn, and every turn after the
    first also steps the rows already running: admissions never hold decoding up for more than one budget."""
    ours, stock = new_pair(max_batch_size=16, steps_per_sync=2)
    requests, expected = requests_and_expected(stock, 12, lengths=[6 + index % 5 for index in range(12)], cases=[TEXT])
    length = requests[0]["input_ids"].shape[1]
    events = record_work(ours)
    manager = ours.init_continuous_batching(max_prefill_tokens=2 * length)
    results = manager.generate_all(requests, progress_bar=False, record_timestamps=True)
    assert [result.generated_tokens for result in results.values()] == expected
    prefills = [rows for kind, rows in events if kind == "prefill"]
    assert prefills == [2] * 6
    turns = [index for index, event in enumerate(events) if event[0] == "prefill"]
    assert all(events[index + 1][0] == "decode" for index in turns)  # each admission is followed by a chunk
    decoded = [rows for kind, rows in events[: turns[-1] + 2] if kind == "decode"]
    # Running rows step on while the others enter; each chunk also steps, inert, the rows parked for the prefill queued
    # after it in the same turn.
    assert len(decoded) == 6 and decoded[:4] == [4, 6, 8, 10]
    # Every admission after the first was launched while rows decoded: beside them (on a GPU, on the side stream).
    stats = manager.stats
    assert stats["prefills_beside"] == 5
    assert stats["prefill_ms"] == stats["activation_wait_ms"] == stats["activation_slack_ms"] == 0
    assert stats["chunks"] == len([event for event in events if event[0] == "decode"])
    assert stats["steps"] == 2 * stats["chunks"]
    # The batch's thread spent host time issuing each admission; none ran eagerly for want of a graph (CPU: no graphs).
    assert stats["admit_host_ms"] > 0 and stats["eager_prefills"] == 0
    # From add_request to its prefill's launch, a request waits less than until its first token was read; the last
    # pair entered after the first pair's first tokens were read (turn 6 against turn 2), so waited longer than those.
    first = sorted(1000 * (result.timestamps[0] - result.created_time) for result in results.values())
    assert stats["admitted"] == 12 and 2 * first[0] - 1 <= stats["admission_wait_ms"] <= sum(first)
    # Of that wait, the part in the input queue (until the batch's thread took them in): all were added before the
    # start and are taken in a little each turn, so some waited there, and never longer than their whole wait.
    assert 0 < stats["queued_ms"] < stats["admission_wait_ms"]
    # The rest of each request's time to its first token: from its prefill's launch to the host reading that token.
    # What is left is the host recording the token after reading it (each request's timestamp comes after the read):
    # a fraction of a millisecond, a few on a machine whose cores other processes share.
    assert stats["first_token_ms"] > 0
    assert 0 <= sum(first) - (stats["admission_wait_ms"] + stats["first_token_ms"]) <= 12 * 5


def test_a_long_queue_is_taken_in_a_little_each_turn_and_a_queued_request_can_be_cancelled():
    """Twelve text requests queued before the batch starts, a prefill budget of two prompts: the batch checks and
    takes in two budgets of them (four) before its first prefill, not all twelve, and tops that up each turn after
    queuing its chunk. One cancelled while still in the queue never starts; the others give `generate`'s tokens."""
    ours, stock = new_pair(max_batch_size=16, steps_per_sync=2)
    requests, expected = requests_and_expected(stock, 12, lengths=[6 + index % 5 for index in range(12)], cases=[TEXT])
    manager = ours.init_continuous_batching(max_prefill_tokens=2 * requests[0]["input_ids"].shape[1])
    work, prepare, enter = [], manager._prepare, manager._enter
    manager._prepare = lambda *args, **kwargs: work.append("check") or prepare(*args, **kwargs)
    manager._enter = lambda parts, *args: work.append(sum(map(len, parts))) or enter(parts, *args)
    ids = manager.add_requests(requests)
    manager.cancel_request(ids[9])
    manager.start()
    manager.stop(block=False)
    results = {result.request_id: result for result in manager}
    assert work[:5] == ["check"] * 4 + [2]  # two budgets checked, one admitted
    assert work.count("check") == 11 and work.count(2) == 5 and work.count(1) == 1  # request 9 was never checked
    assert results[ids[9]].status == RequestStatus.FAILED and results[ids[9]].error == "cancelled"
    assert not results[ids[9]].generated_tokens
    assert [results[request_id].generated_tokens for request_id in ids if request_id != ids[9]] == (
        expected[:9] + expected[10:])


def test_a_turn_past_its_host_time_takes_in_one_request_and_encodes_one_group_ahead(monkeypatch):
    """Past the turn's `until` (requests stream beside decoding rows), `_take_in` checks one more queued request and
    `_media_ahead` encodes one more group of `MEDIA_AHEAD_GROUP` requests' media, leaving the rest for the next turns:
    a wave of arrivals is spread over several turns. Without `until`, as many as the budgets hold, in one call."""
    import qwen3vl_static.batching_qwen3vl_graph as batching
    from qwen3vl_static.scheduler_qwen3vl_graph import Scheduler

    ours, stock = new_pair(max_batch_size=16)
    requests, _ = requests_and_expected(stock, 6, lengths=[4] * 6, cases=[CASES[0]])
    manager = ours.init_continuous_batching(max_prefill_tokens=16 * requests[0]["input_ids"].shape[1])
    calls, encode = [], batching.media_features
    monkeypatch.setattr(batching, "media_features",
                        lambda model, inputs: calls.append(inputs["image_grid_thw"].shape[0]) or encode(model, inputs))
    monkeypatch.setattr(batching, "MEDIA_AHEAD_GROUP", 2)
    manager.add_requests(requests)
    engine = ours.graph_engine()
    scheduler = Scheduler(engine.cache.rows, manager.max_prefill_tokens)
    manager._take_in(scheduler, engine, wait=False, until=0.0)
    manager._take_in(scheduler, engine, wait=False, until=0.0)
    assert len(scheduler.waiting) == 2
    manager._media_ahead(scheduler, engine, until=0.0)
    assert calls == [2]
    manager._take_in(scheduler, engine, wait=False)
    assert len(scheduler.waiting) == 6
    manager._media_ahead(scheduler, engine, until=0.0)
    assert calls == [2, 2]
    manager._media_ahead(scheduler, engine)
    assert calls == [2, 2, 2]
    assert not any(batching._unencoded(sequence) for sequence in scheduler.waiting)


def test_an_admission_runs_as_pieces_that_replay_prefill_graphs():
    """Seven text prompts of two lengths entering together, where prefill graphs exist for 1, 2, 4 and 8 rows, prompts
    up to 128 tokens and 512 tokens in all: a batch of 7 would run eagerly (a graph of 8 rows would write its padding
    row into a row another request holds), so they enter as pieces of 4, 2 and 1 (shortest prompts first), each at
    its bucket's shapes as its graph runs on CUDA (here without graphs); each request generates as alone. Prompts no
    graph takes enter as one eager batch; unbucketed prompts (the CPU's default) enter whole."""
    ours, stock = bucketed_pair(max_batch_size=8)
    requests, expected = requests_and_expected(stock, 7, cases=[CASES[1], CASES[3]])
    prefill = ours.graph_engine().prefill
    assert prefill.graph_pieces([20] * 7) == [4, 2, 1]
    assert prefill.graph_pieces([100] * 8) == [4, 4]  # 8 rows of 128 tokens exceed 512
    assert prefill.graph_pieces([20, 150]) is None  # longer than the largest graph's prompt
    assert new_pair()[0].graph_engine().prefill.graph_pieces([20] * 3) is None
    events = record_work(ours)
    results = ours.generate_batch(requests, progress_bar=False)
    assert [rows for kind, rows in events if kind == "prefill"] == [4, 2, 1]
    assert [result.generated_tokens for result in results.values()] == expected


def test_rows_stop_at_their_own_eos():
    ours, stock = new_pair()
    # An EOS id that the greedy answers reach early: the stock output ends with it.
    probe = stock.generate(**build(TEXT), max_new_tokens=8, do_sample=False)[0]
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
    bad = [broken, {**requests[1], "max_new_tokens": 1000}, {**requests[1], "max_new_tokens": "ten"},
           {**requests[1], "max_new_tokens": -3}, {**requests[1], "top_p": 2.0}, {**requests[1], "unknown": 1},
           {**requests[1], "repetition_penalty": 0.0}, {"input_ids": [[1.5, 2.0]]},
           {"input_ids": torch.tensor([[10**9]])}]
    results = ours.generate_batch([*bad, requests[1], requests[2]], progress_bar=False)
    outputs = list(results.values())
    assert [result.status for result in outputs] == [RequestStatus.FAILED] * len(bad) + [RequestStatus.FINISHED] * 2
    errors = [result.error for result in outputs[: len(bad)]]
    for error, named in zip(errors, ["image_grid_thw", "static_cache_len", "max_new_tokens='ten'", "max_new_tokens=-3",
                                     "top_p=2.0", "unknown", "repetition_penalty", "input_ids", "vocabulary"]):
        assert named in error
    assert "1000" in errors[1] and "a row holds 160" in errors[1]  # the request's length and the limit
    assert "at least 1 token" in errors[3] and "row" not in errors[3]  # not a cache message: -3 fits any row
    assert [outputs[-2].generated_tokens, outputs[-1].generated_tokens] == expected[1:]


def test_positions_brought_by_a_request_are_used_as_the_batch_would_compute_them():
    """A request may bring its prompt's M-RoPE positions (`prompt_position_ids`, computed off the batch's thread, as
    `serve`'s HTTP processes do on a meta-device copy of the model): the same positions, so the same tokens, as the
    batch computes; positions of the wrong shape or kind fail that request alone, naming what they must be."""
    ours, stock = new_pair()
    requests, expected = requests_and_expected(stock, 3)
    with torch.device("meta"):
        skeleton = type(ours)(ours.config).eval()
    ahead = []
    for request in requests:
        inputs = {key: value for key, value in request.items() if key not in ("input_ids", "attention_mask",
                                                                             "max_new_tokens")}
        positions = prompt_position_ids(skeleton, request["input_ids"], inputs)
        assert torch.equal(positions, prompt_position_ids(ours, request["input_ids"], inputs))
        assert positions.shape == (3, request["input_ids"].shape[1])
        ahead.append({**request, "position_ids": positions})
    assert not torch.equal(ahead[0]["position_ids"][0], ahead[0]["position_ids"][1])  # an image's rows and columns
    length = requests[1]["input_ids"].shape[1]
    bad = [{**requests[1], "position_ids": torch.zeros(3, length - 1, dtype=torch.long)},
           {**requests[1], "position_ids": torch.zeros(3, length)}]
    outputs = list(ours.generate_batch([*bad, *ahead], progress_bar=False).values())
    assert [output.status for output in outputs] == [RequestStatus.FAILED] * 2 + [RequestStatus.FINISHED] * 3
    assert f"integers of shape (3, {length})" in outputs[0].error and "torch.float32" in outputs[1].error
    assert [output.generated_tokens for output in outputs[2:]] == expected


def test_every_setting_per_request():
    """Greedy and sampled requests in one batch: the greedy ones as `generate` alone; a seeded sampled one draws the
    same tokens alone or among others and other tokens with another seed; top-k 1 and min-p 1 keep only the argmax;
    sampling settings without `do_sample` sample (on a greedy config), temperature 0 does not."""
    ours, stock = new_pair()
    inputs = build(TEXT)
    greedy = stock.generate(**inputs, max_new_tokens=8, do_sample=False)[0, -8:].tolist()
    sampled = {**inputs, "max_new_tokens": 8, "temperature": 1.5, "seed": 11}
    batch = [sampled, {**inputs, "max_new_tokens": 8}, {**inputs, "max_new_tokens": 8, "top_k": 1, "seed": 3},
             {**inputs, "max_new_tokens": 8, "min_p": 1.0}, {**inputs, "max_new_tokens": 8, "temperature": 0},
             {**build(CASES[0]), "max_new_tokens": 8, "top_p": 0.9, "top_k": 5, "seed": 5},
             {**inputs, "max_new_tokens": 8, "temperature": 1.5, "seed": 12}]
    results = [result.generated_tokens for result in ours.generate_batch(batch, progress_bar=False).values()]
    alone = ours.generate_batch([sampled], progress_bar=False)["req_0"].generated_tokens
    assert results[0] == alone and results[0] != greedy and results[6] != results[0]
    assert results[1] == results[2] == results[3] == results[4] == greedy
    assert len(results[5]) == 8


class OpenAIPenalties(LogitsProcessor):
    """OpenAI's presence and frequency penalties over the answer so far (what the batch applies after transformers'
    repetition penalty)."""

    def __init__(self, prompt_len: int, presence: float, frequency: float):
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids, scores):
        answer = input_ids[:, self.prompt_len:]
        counts = torch.zeros_like(scores).scatter_add_(1, answer, torch.ones_like(answer, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0)


def test_penalties_per_request_equal_generate_alone():
    """Repetition (transformers': prompt and answer), presence and frequency penalties (OpenAI's: the answer), each
    request its own, beside requests without any: each greedy answer is `generate`'s with the same penalties alone,
    and they change the answers, also when long prompts enter in chunks; a sampled request with a penalty draws the
    same alone or among others; the generation config's repetition penalty is every request's default."""
    ours, stock = new_pair()
    penalties = [{"repetition_penalty": 1.5}, {"presence_penalty": 1.5, "frequency_penalty": 0.5}, {},
                 {"repetition_penalty": 0.7, "frequency_penalty": 2.0}]
    requests, expected, plain = [], [], []
    for index, settings in enumerate(penalties * 2):
        inputs = build(CASES[index % len(CASES)])
        prompt_len = inputs["input_ids"].shape[1]
        processors = [OpenAIPenalties(prompt_len, settings.get("presence_penalty", 0.0),
                                      settings.get("frequency_penalty", 0.0))]
        out = stock.generate(**inputs, max_new_tokens=12, do_sample=False,
                             repetition_penalty=settings.get("repetition_penalty", 1.0),
                             logits_processor=LogitsProcessorList(processors))
        expected.append(out[0, prompt_len:].tolist())
        plain.append(stock.generate(**inputs, max_new_tokens=12, do_sample=False)[0, prompt_len:].tolist())
        requests.append({**inputs, "max_new_tokens": 12, **settings})
    results = [result.generated_tokens for result in ours.generate_batch(requests, progress_bar=False).values()]
    assert results == expected
    # (an answer that repeats nothing, as the tiny model's first image answer, keeps its tokens)
    assert sum(got != without for got, without, settings in zip(results, plain, penalties * 2) if settings) >= 4
    assert results[2] == plain[2] and results[6] == plain[6]

    sampled = {**build(TEXT), "max_new_tokens": 8, "temperature": 1.2, "seed": 4, "frequency_penalty": 1.0}
    alone = ours.generate_batch([sampled], progress_bar=False)["req_0"].generated_tokens
    among = ours.generate_batch([requests[2], sampled, requests[0]], progress_bar=False)["req_1"].generated_tokens
    assert among == alone
    # Prompts longer than the prefill budget enter a chunk per turn, their rows parked beside penalized rows.
    chunked = ours.init_continuous_batching(max_prefill_tokens=12).generate_all(requests[:4], progress_bar=False)
    assert [result.generated_tokens for result in chunked.values()] == expected[:4]

    ours.generation_config.repetition_penalty = 1.5
    inputs = build(TEXT)
    result = ours.generate_batch([{**inputs, "max_new_tokens": 12}], progress_bar=False)["req_0"].generated_tokens
    assert result == stock.generate(**inputs, max_new_tokens=12, do_sample=False, repetition_penalty=1.5)[
        0, inputs["input_ids"].shape[1]:].tolist()


def test_stop_strings_end_a_request_where_its_text_ends_in_one():
    ours, stock = new_pair()
    tokenizer = tiny_tokenizer()
    inputs = build(TEXT)
    greedy = stock.generate(**inputs, max_new_tokens=10, do_sample=False)[0, -10:].tolist()
    stop = tokenizer.decode(greedy[:4])[-3:]  # the text's end after the 4th token
    cut = next(count for count in range(1, 11) if tokenizer.decode(greedy[:count]).endswith(stop))
    manager = ours.init_continuous_batching(tokenizer=tokenizer)
    results = manager.generate_all([{**inputs, "max_new_tokens": 10, "stop_strings": [stop]},
                                    {**inputs, "max_new_tokens": 10}], progress_bar=False)
    stopped, full = results.values()
    assert stopped.generated_tokens == greedy[:cut] and full.generated_tokens == greedy
    # A stop string inside one token's text (a token may hold it and more) stops the request at that token: here
    # tokens decode as "[id]", and the stop string is the 4th token's text less its bracket.
    class Bracketed:
        @staticmethod
        def decode(tokens, **kwargs):
            return "".join(f"[{token}]" for token in tokens)

    inner = f"[{greedy[3]}"
    cut = next(count for count in range(1, 11) if inner in Bracketed.decode(greedy[:count]))
    bracketed = ours.init_continuous_batching(tokenizer=Bracketed())
    inside = bracketed.generate_all([{**inputs, "max_new_tokens": 10, "stop_strings": inner}], progress_bar=False)
    assert cut <= 4 and next(iter(inside.values())).generated_tokens == greedy[:cut]
    refused = ours.generate_batch([{**inputs, "stop_strings": "x"}], progress_bar=False)["req_0"]
    assert refused.status == RequestStatus.FAILED and "tokenizer" in refused.error


def test_streaming_chunks_are_as_short_as_the_host_and_clients_keep_up_with():
    steps = StreamingSteps(most=8)
    assert [steps.next(behind=None)] == [1]  # no measure: one step
    assert [steps.next(behind=True) for _ in range(5)] == [2, 4, 8, 8, 8]  # fell behind: longer chunks
    assert [steps.next(behind=False) for _ in range(9)] == [7, 6, 5, 4, 3, 2, 1, 1, 1]
    assert [steps.next(behind=None), steps.next(behind=True), steps.next(behind=None)] == [1, 2, 2]


def test_handlers_on_an_event_loop_get_every_output_in_order():
    """Streaming requests whose result handlers run on an asyncio loop (as the server's): each chunk's outputs reach
    the loop together, in order, ending with the request's result; the tokens are `generate`'s."""
    import asyncio

    ours, stock = new_pair(max_batch_size=4, steps_per_sync=2)
    requests, expected = requests_and_expected(stock, 6)
    manager = ours.init_continuous_batching()

    async def main():
        outputs, done = {}, asyncio.Event()

        def handler(output):
            outputs.setdefault(output.request_id, []).append(output)
            if sum(seen[-1].status == RequestStatus.FINISHED for seen in outputs.values()) == len(requests):
                done.set()

        for index in range(len(requests)):
            manager.register_result_handler(f"r{index}", handler)
        manager.start()
        for index, request in enumerate(requests):
            manager.add_request(**request, request_id=f"r{index}", streaming=True)
        await asyncio.wait_for(done.wait(), timeout=120)
        return outputs

    try:
        outputs = asyncio.run(main())
    finally:
        manager.stop()
    for index, tokens in enumerate(expected):
        seen = outputs[f"r{index}"]
        assert [output.status for output in seen[:-1]] == [RequestStatus.DECODING] * (len(seen) - 1)
        assert seen[-1].generated_tokens == tokens
        counts = [len(output.generated_tokens) for output in seen]
        assert counts == sorted(counts) and (len(seen) > 1 or len(tokens) <= 2)  # streamed, unless done at once


def test_streaming_delivers_tokens_as_they_are_drawn_and_cancel_frees_the_row():
    ours, stock = new_pair(max_batch_size=2, steps_per_sync=2)
    inputs = build(TEXT)
    expected = stock.generate(**inputs, max_new_tokens=9, do_sample=False)[0, -9:].tolist()
    manager = ours.init_continuous_batching()
    handled = []
    manager.start()
    try:
        streamed = manager.add_request(**inputs, max_new_tokens=9, streaming=True)
        outputs = list(manager.request_id_iter(streamed))
        # The first token with the first step's, then one token per output: a streaming batch's chunks start at one
        # step (and stay there without CUDA events to tell whether the host keeps up: `StreamingSteps`).
        assert [len(output.generated_tokens) for output in outputs] == list(range(2, 10))
        for before, after in zip(outputs, outputs[1:]):
            assert after.generated_tokens[: len(before.generated_tokens)] == before.generated_tokens
        assert outputs[-1].status == RequestStatus.FINISHED and outputs[-1].generated_tokens == expected
        assert all(output.status == RequestStatus.DECODING for output in outputs[:-1])
        # A long request cancelled after its first tokens: it ends as cancelled and its row serves the next ones.
        long = manager.add_request(**inputs, max_new_tokens=100, streaming=True)
        first = next(iter(manager.request_id_iter(long)))
        manager.cancel_request(long)
        last = list(manager.request_id_iter(long))[-1]
        assert last.status == RequestStatus.FAILED and last.error == "cancelled"
        assert len(first.generated_tokens) <= len(last.generated_tokens) < 100
        handler_id = "handled"
        manager.register_result_handler(handler_id, handled.append)
        manager.add_request(**inputs, max_new_tokens=9, request_id=handler_id)
        after = [manager.add_request(**inputs, max_new_tokens=9) for _ in range(3)]
        assert [manager.get_result(request_id, timeout=60).generated_tokens for request_id in after] == [expected] * 3
    finally:
        manager.stop()
    assert [output.generated_tokens for output in handled] == [expected]


def test_a_delta_handler_gets_each_chunks_new_tokens():
    """A handler registered with `delta=True` gets only the tokens new since its last output (a streamed answer's
    copy would otherwise grow with it at every chunk): together they are the whole answer, `generate`'s, the last one
    ending it; a handler without it gets every token so far, and a request that does not stream one result."""
    ours, stock = new_pair(max_batch_size=3, steps_per_sync=2)
    inputs = build(TEXT)
    expected = stock.generate(**inputs, max_new_tokens=9, do_sample=False)[0, -9:].tolist()
    manager = ours.init_continuous_batching()
    deltas, whole, single = [], [], []
    manager.register_result_handler("delta", deltas.append, delta=True)
    manager.register_result_handler("whole", whole.append)
    manager.register_result_handler("single", single.append, delta=True)
    manager.start()
    try:
        for request_id, streaming in (("delta", True), ("whole", True), ("single", False)):
            manager.add_request(**inputs, max_new_tokens=9, request_id=request_id, streaming=streaming)
        deadline = time.monotonic() + 60
        while len(single) < 1 or not deltas or deltas[-1].status != RequestStatus.FINISHED:
            assert time.monotonic() < deadline
            time.sleep(0.01)
    finally:
        manager.stop()
    assert [token for output in deltas for token in output.generated_tokens] == expected
    assert all(output.generated_tokens for output in deltas[:-1]) and len(deltas) > 2
    assert [output.status for output in deltas[:-1]] == [RequestStatus.DECODING] * (len(deltas) - 1)
    assert whole[-1].generated_tokens == expected and len(whole[0].generated_tokens) == 2
    assert [output.generated_tokens for output in single] == [expected]


def test_a_fatal_error_reaches_every_waiting_caller():
    ours, _ = new_pair()
    runner = ours.graph_engine().decode

    def broken(*args):
        raise RuntimeError("device lost")

    runner.issue = broken
    manager = ours.init_continuous_batching()
    manager.start()
    streamed = manager.add_request(**build(TEXT), max_new_tokens=4, streaming=True)
    other = manager.add_request(**build(TEXT), max_new_tokens=4)
    outputs = list(manager.request_id_iter(streamed))
    assert outputs[-1].status == RequestStatus.FAILED and "device lost" in outputs[-1].error
    with pytest.raises(RuntimeError, match="stopped on an error"):
        manager.get_result(other, timeout=5)
    manager.stop()
    del runner.issue
    assert ours.generate_batch([{**build(TEXT), "max_new_tokens": 3}], progress_bar=False)["req_0"].error is None


def test_cache_rows_sized_from_memory(monkeypatch, caplog):
    """On a (fake) GPU memory figure the batch takes as many rows as fit in `gpu_memory_utilization` of it, less what
    is in use and the prefill reserve, at most the requests; the cache is rebuilt at that size; a request too long
    for its rows fails alone, naming its length and the limit."""
    ours, stock = new_pair()
    slot = kv_bytes_per_slot(ours.config, torch.float32)
    gib = 2**30
    rows, why = slots_from_memory(free=30 * gib, total=40 * gib, held=0, slot_bytes=slot, cache_len=1000,
                                  gpu_memory_utilization=0.5, max_prefill_tokens=1024, media_bytes=16384)
    reserve = 1024 * (64 * 1024 + 2 * 16384) + gib  # a prefill's activations, two budgets of image features, graphs
    assert rows == min(512, (20 * gib - 10 * gib - reserve) // (slot * 1000)) and "gpu_memory_utilization=0.5" in why
    assert slots_from_memory(30 * gib, 40 * gib, 0, slot, 1000, 0.5, 1024, requests=3)[0] == 3
    # The 2B's features: a merged one and three DeepStack ones of 2,048 bf16 values (16 KiB); the tiny model's 3 x 64.
    assert media_bytes_per_token(real_config("2b"), torch.bfloat16) == 16384
    media = media_bytes_per_token(ours.config, torch.float32)
    assert media == 3 * 64 * 4
    budget = 6 * slot * 96 + 8192 * (64 * 1024 + 2 * media) + gib  # six rows of 96 slots, the default budget's reserve
    monkeypatch.setattr(modeling, "device_memory", lambda device: (budget, budget))
    with caplog.at_level("WARNING"):
        manager = ours.init_continuous_batching(static_cache_len=96, gpu_memory_utilization=1.0)
    assert (ours.config.max_batch_size, ours.config.static_cache_len) == (6, 96)
    assert ours.graph_engine().cache.rows == 6 and "6 rows of 96 slots" in caplog.text
    requests, expected = requests_and_expected(stock, 3, cases=[TEXT])
    results = manager.generate_all([*requests, {**requests[0], "max_new_tokens": 90}], progress_bar=False)
    outputs = list(results.values())
    assert [output.generated_tokens for output in outputs[:3]] == expected
    assert outputs[3].status == RequestStatus.FAILED and "a row holds 96" in outputs[3].error
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        ours.init_continuous_batching(gpu_memory_utilization=0)


def test_max_new_tokens_defaults_to_the_room_the_row_leaves():
    """Qwen's own generation config sets no length: a request without max_new_tokens runs until its row is full
    (as a server does), not into a TypeError."""
    ours, stock = new_pair()
    ours.generation_config.max_new_tokens = ours.generation_config.max_length = None
    result = ours.generate_batch([build(TEXT)], progress_bar=False, eos_token_id=None)["req_0"]
    length = len(result.prompt_ids)
    assert result.status == RequestStatus.FINISHED
    assert len(result.generated_tokens) == 160 - length - 2 * ours.config.steps_per_sync


@pytest.mark.parametrize("pair", [new_pair, bucketed_pair], ids=["exact", "bucketed"])
def test_a_prompt_longer_than_the_budget_enters_in_chunks(pair):
    """With a prefill budget of the short prompt's tokens, a text and an image prompt (its image tokens across chunk boundaries) enter a
    chunk per turn, their rows parked meanwhile, while a short request already running keeps decoding; each generates
    as alone."""
    ours, stock = pair(steps_per_sync=2)
    short = build(([[chat("Hi")]], {}))
    budget = short["input_ids"].shape[1]
    requests, expected = requests_and_expected(stock, 3, lengths=[12, 7, 9], cases=[TEXT, CASES[3], CASES[0]])
    requests[0] = {**short, "max_new_tokens": 12}
    assert min(request["input_ids"].shape[1] for request in requests[1:]) > budget
    events = record_work(ours)
    manager = ours.init_continuous_batching(max_prefill_tokens=budget)
    results = manager.generate_all(requests, progress_bar=False)
    assert [result.generated_tokens for result in results.values()] == expected
    prefills = [rows for kind, rows in events if kind == "prefill"]
    assert len(prefills) > 4 and set(prefills) == {1}  # the long prompts a chunk at a time
    chunks = [index for index, event in enumerate(events) if event[0] == "prefill"]
    assert all(events[index + 1][0] == "decode" for index in chunks[:-1])  # the others decode between chunks


def test_a_prompt_prefilled_beside_decoding_rows_joins_them_after_the_steps_its_prefill_takes(monkeypatch):
    """Requests that enter while rows decode have their prompts prefilled beside the decode chunks (on a GPU, on the
    side stream) and begin decoding once the steps their prefill takes are queued (on the CPU's one stream a prefill
    is done once queued: none). Here a prefill takes 60 steps: meanwhile its row is parked (it steps inert, never past
    its cache row's end, however many chunks it waits) and moved to the front as another request finishes; every
    answer still equals `generate`'s."""
    ours, stock = new_pair(max_batch_size=4, steps_per_sync=2, static_cache_len=96)
    capacity = ours.graph_engine().cache.capacity
    requests, expected = requests_and_expected(stock, 5, lengths=[70, 20, 2, 2, 8],
                                               cases=[TEXT, CASES[0], CASES[1], CASES[1], CASES[3]])
    monkeypatch.setattr(batching, "prefill_tokens_per_step", lambda rows, side: 2 / 3)  # 40 tokens: 60 steps
    ours.generation_config.eos_token_id = None  # the long answer runs its length, as `generate`'s reference did
    runner = ours.graph_engine().decode
    issue, reorder, moved_parked, deepest, stepped = runner.issue, runner.reorder, [], [], []

    def checked_issue(steps, mode):
        deepest.append(int(runner.cache_lens.max()) + steps)  # the last slot a row's steps write, plus one
        stepped.append((steps, int((runner.park_lens > 0).sum())))
        return issue(steps, mode)

    def recorded_reorder(order):
        moved_parked.append(bool((runner.park_lens > 0).any()))
        reorder(order)

    runner.issue, runner.reorder = checked_issue, recorded_reorder
    manager = ours.init_continuous_batching()
    results = manager.generate_all(requests, progress_bar=False)
    assert [result.generated_tokens for result in results.values()] == expected
    assert manager.stats["prefills_beside"] == 1
    # The last request's row stayed parked for 60 steps (from its 40-slot prompt: past the 96 slots without going back
    # to the prompt's end every chunk), and a reorder moved it meanwhile.
    assert sum(steps for steps, parked in stepped if parked) == 60
    assert max(deepest) <= capacity and any(moved_parked)


@pytest.mark.parametrize("budget", [None, 12], ids=["whole", "chunked"])
def test_every_setting_gives_the_same_tokens_whenever_rows_join(monkeypatch, budget):
    """Greedy, seeded sampled and penalized requests over 4 rows, with long prompts entering in chunks (`chunked`):
    each gets the same tokens whether the rows that enter while others decode begin decoding in the turn they enter
    (the CPU's) or 5 steps later, parked meanwhile (a prefill beside the decode steps); a request cancelled while its
    row waits to begin ends cancelled, and the others are unaffected. (Later, the side stream's work also holds the
    waiting requests back while it is more than a chunk.)"""
    ours, _ = new_pair(steps_per_sync=2)
    settings = [{}, {"temperature": 1.3, "seed": 7}, {"repetition_penalty": 1.4}, {"top_k": 5, "seed": 2},
                {"presence_penalty": 1.0, "frequency_penalty": 0.5}, {}, {"temperature": 0.8, "top_p": 0.9, "seed": 9}]
    requests = [{**build(CASES[index % len(CASES)]), "max_new_tokens": 3 + 2 * index, **own}
                for index, own in enumerate(settings)]
    budget = {} if budget is None else {"max_prefill_tokens": budget}

    def answers(tokens_per_step, cancel=None):
        monkeypatch.setattr(batching, "prefill_tokens_per_step", lambda rows, side: tokens_per_step)
        manager = ours.init_continuous_batching(**budget)
        if cancel is not None:  # cancelled as its prefill is launched: its row then waits to begin decoding
            launch = manager._launch

            def launch_and_cancel(part, *args):
                prefilled = launch(part, *args)
                if prefilled is not None and any(sequence.request_id == cancel for sequence in part):
                    manager.cancel_request(cancel)
                return prefilled

            manager._launch = launch_and_cancel
        results = manager.generate_all(requests, progress_bar=False)
        return {key: (result.status, result.generated_tokens) for key, result in results.items()}, manager.stats

    at_once, stats = answers(math.inf)
    assert stats["prefills_beside"] > 0
    later, _ = answers(8)  # 3-5 steps for these prompts
    assert later == at_once
    cancelled, _ = answers(8, cancel="req_5")
    assert cancelled["req_5"][0] == RequestStatus.FAILED
    assert {key: value for key, value in cancelled.items() if key != "req_5"} == {
        key: value for key, value in at_once.items() if key != "req_5"}


def test_a_prompt_that_fills_its_row_enters_beside_decoding_rows(monkeypatch):
    """A prompt that leaves its row room for one new token (and the steps past its end) waits parked beside a decoding
    row: the steps' cache-length bucket covers it without passing the cache's end, and both answers are `generate`'s."""
    ours, stock = new_pair(max_batch_size=2, steps_per_sync=2, static_cache_len=96)
    ours.generation_config.eos_token_id = None
    fills = torch.randint(0, 200, (1, 96 - 2 * 2 - 1), generator=torch.Generator().manual_seed(1))
    requests = [{**build(TEXT), "max_new_tokens": 60}, {**build(TEXT), "max_new_tokens": 2},
                {"input_ids": fills, "attention_mask": torch.ones_like(fills), "max_new_tokens": 1}]
    expected = [stock.generate(**{key: value for key, value in request.items() if key != "max_new_tokens"},
                               max_new_tokens=request["max_new_tokens"], do_sample=False)[0, -request["max_new_tokens"]:]
                .tolist() for request in requests]
    monkeypatch.setattr(batching, "prefill_tokens_per_step", lambda rows, side: 23)  # 91 tokens: 4 steps
    manager = ours.init_continuous_batching()
    results = manager.generate_all(requests, progress_bar=False)
    assert [result.generated_tokens for result in results.values()] == expected
    assert manager.stats["prefills_beside"] == 1


def test_prefills_beside_decoding_rows_count_from_the_side_streams_work_before_them(monkeypatch):
    """The side stream runs its work in order: a prefill queued behind another is through only after it, so its rows
    begin decoding once the steps queued beside them cover both (`SideWork`: its mark counts every token queued
    before it). Here the side stream gets through 4 prompt tokens a step, chunks are 2 steps, and a 21-token prompt
    enters per turn: each request's rows wait for the count, and every answer still equals `generate`'s."""
    ours, stock = new_pair(max_batch_size=4, steps_per_sync=2)
    requests, expected = requests_and_expected(stock, 4, lengths=[40, 4, 4, 4], cases=[TEXT])
    monkeypatch.setattr(batching, "prefill_tokens_per_step", lambda rows, side: 4)
    manager = ours.init_continuous_batching(max_prefill_tokens=21)  # a 21-token prompt per admission
    runner = ours.graph_engine().decode
    launches, began, steps, launch, activate, issue = {}, {}, [0], manager._launch, manager._activate, runner.issue

    def recorded_launch(part, *args):
        work = manager._side_work
        queued, covered = work.queued, work.covered
        prefilled = launch(part, *args)
        launches[part[0].request_id] = (queued, covered, prefilled.mark, part[0].prompt_len, steps[0])
        return prefilled

    def recorded_activate(ready, *args):
        for prefilled in ready:
            began[prefilled.part[0].request_id] = steps[0]
        return activate(ready, *args)

    def counted_issue(count, mode):
        steps[0] += count
        return issue(count, mode)

    manager._launch, manager._activate, runner.issue = recorded_launch, recorded_activate, counted_issue
    results = manager.generate_all(requests, progress_bar=False)
    assert [result.generated_tokens for result in results.values()] == expected
    assert manager.stats["prefills_beside"] == 3
    beside = [key for key in launches if launches[key][4] > 0]  # launched after a chunk: beside decoding rows
    assert len(beside) == 3
    for key in beside:
        queued, covered, mark, tokens, launched_at = launches[key]
        assert mark == queued + tokens  # it counts from every token queued before it ...
        chunks = math.ceil((mark - covered) / (2 * 4))  # ... and begins once the chunks from its turn's on cover it
        assert began[key] - launched_at == 2 * (chunks - 1)
    assert any(launches[key][0] > launches[key][1] for key in beside)  # one entered behind another's work


def test_rows_beside_a_prefill_join_by_the_step_count_or_while_requests_stream_when_the_device_is_done():
    """`joins_now`: an offline batch's rows begin once the steps queued beside their prefill cover the side stream's
    work up to it, whatever the device has done (the same schedule every run); while requests stream (chunks that
    already follow the GPU's timing) once the host finds the prefill's event done, whatever the count says."""
    from qwen3vl_static.batching_qwen3vl_graph import SideWork, _Prefilled, joins_now

    class Event:
        def __init__(self, done):
            self.done = done

        def query(self):
            return self.done

    work = SideWork(side="a stream")
    work.add(1000)
    work.stepped(2, rows=64)  # 2 x (200 + 3 x 64) = 784 tokens covered of 1,000
    early, late = (_Prefilled([], None, None, None, done=Event(done), mark=mark)
                   for done, mark in ((True, 1000), (False, 500)))
    assert not joins_now(early, work, follows_timing=False) and joins_now(late, work, follows_timing=False)
    assert joins_now(early, work, follows_timing=True) and not joins_now(late, work, follows_timing=True)
    untimed = _Prefilled([], None, None, None, done=None, mark=1000)  # no event to ask: the count
    assert not joins_now(untimed, work, follows_timing=True)
    work.waited(1000)
    assert joins_now(untimed, work, follows_timing=True)


def test_a_chunks_decode_time_is_read_once_its_end_event_is_done():
    """The end event follows the tokens' copy, so the host can hold the tokens a moment before the device has passed
    it: CUDA refuses the elapsed time of an event not yet done, which used to stop the whole batch. A turn counts only
    the spans done by then; going idle or stopping, the batch waits for the rest."""
    class Event:  # as a CUDA timing event: elapsed_time only once both are done
        def __init__(self, done):
            self.done = done

        def query(self):
            return self.done

        def synchronize(self):
            self.done = True

        def elapsed_time(self, end):
            if not (self.done and end.done):
                raise RuntimeError("Both events must be completed before calculating elapsed time.")
            return 2.5

    manager = new_pair()[0].init_continuous_batching()
    manager._spans.append(("decode_ms", Event(True), Event(False)))
    manager._count_spans(wait=False)
    assert manager.stats["decode_ms"] == 0 and len(manager._spans) == 1
    manager._count_spans(wait=True)
    assert manager.stats["decode_ms"] == 2.5 and not manager._spans


def test_streaming_requests_gather_to_enter_together_only_beside_many_decoding_rows():
    """`gathers`: waiting streaming requests hold back while many rows decode, until they fill a share of a prefill
    budget or the oldest has waited GATHER_S; a request that does not stream, too few decoding rows or an empty queue
    hold nothing back."""
    from qwen3vl_static.batching_qwen3vl_graph import (
        GATHER_BUDGET_SHARE,
        GATHER_MIN_DECODING_ROWS,
        GATHER_S,
        gathers,
    )

    budget, now = 8192, 100.0
    small = int(GATHER_BUDGET_SHARE * budget) // 4

    def waiting(*ages, streaming=True, tokens=small):
        return [SimpleNamespace(streaming=streaming, prompt_len=tokens, taken_in=now - age) for age in ages]

    many = GATHER_MIN_DECODING_ROWS
    assert gathers(waiting(0.010, 0.001), many, budget, now)
    assert not gathers(waiting(GATHER_S, 0.001), many, budget, now)  # the oldest waited long enough
    assert not gathers(waiting(0.010, 0.001, 0.001, 0.0), many, budget, now)  # a quarter of the budget is here
    assert not gathers(waiting(0.010), many - 1, budget, now)  # few decoding rows: the wait would be all TTFT
    assert not gathers(waiting(0.010, streaming=False), many, budget, now)
    assert not gathers([], many, budget, now)


def test_gaps_between_decode_chunks_count_as_stalls_only_while_their_requests_go_on_decoding():
    """The GPU time from one chunk's end to the next one's start counts as a stall when a request of the first decodes
    in the second too (its stream's next token waited); a chunk of new requests only, after the others ended, starts
    no stall. Gaps of LONG_STALL_MS or more are counted apart, and /metrics names that length."""
    from qwen3vl_static.batching_qwen3vl_graph import LONG_STALL_MS, _Chunk
    from qwen3vl_static.server import METRICS

    class Event:  # a CUDA timing event recorded at `at` ms, done
        def __init__(self, at):
            self.at = at

        def query(self):
            return True

        def elapsed_time(self, end):
            return end.at - self.at

    class Request:  # a request's sequence as the batch holds it: compared and hashed by identity
        def __init__(self, request_id):
            self.output = SimpleNamespace(request_id=request_id)

    manager = new_pair()[0].init_continuous_batching()
    a, b, c = Request("a"), Request("b"), Request("c")
    chunks = [((0, 3), {0: a, 1: b}), ((5, 8), {0: a}), ((20, 23), {0: a, 1: c}), ((40, 43), {0: c})]
    other = _Chunk(None, {}, 0, [], events=(Event(60), Event(63)))
    other.owners = {0: Request("d")}
    for (start, end), owners in chunks:
        chunk = _Chunk(None, owners, 1, [], events=(Event(start), Event(end)))
        manager._time_stall(chunk)
    manager._time_stall(other)  # "d" alone: the gap before it is no stall
    manager._read_tokens(_Chunk(None, {}, 0, []), scheduler=None, runner=None)
    assert manager.stats["stall_ms"] == 2 + 12 + 17
    assert manager.stats["long_stalls"] == 2
    assert f"{LONG_STALL_MS} ms" in METRICS["long_stalls"][2]


def test_an_image_prefill_beside_decoding_rows_counts_its_towers_work_before_it(monkeypatch):
    """The side stream runs an image request's tower (encoded ahead, beside a chunk) before its prefill, so its rows
    begin decoding after the steps of both: its features count `TOWER_TOKENS_PER_FEATURE` prompt tokens each."""
    ours, stock = new_pair(steps_per_sync=2)
    requests, expected = requests_and_expected(stock, 2, lengths=[40, 5], cases=[TEXT, CASES[0]])
    monkeypatch.setattr(batching, "prefill_tokens_per_step", lambda rows, side: 4)
    manager = ours.init_continuous_batching(max_prefill_tokens=36)  # the text prompt enters first, alone
    launches, launch = [], manager._launch

    def recorded_launch(part, *args):
        queued = manager._side_work.queued
        prefilled = launch(part, *args)
        launches.append((queued, prefilled.mark))
        return prefilled

    manager._launch = recorded_launch
    results = manager.generate_all(requests, progress_bar=False)
    assert [result.generated_tokens for result in results.values()] == expected
    features = int((requests[1]["input_ids"] == ours.config.image_token_id).sum())
    assert manager.stats["encoded_ahead"] == 1 and manager.stats["prefills_beside"] == 1
    text, tower = requests[0]["input_ids"].shape[1], batching.TOWER_TOKENS_PER_FEATURE * features
    assert launches[1] == (text + tower, text + tower + requests[1]["input_ids"].shape[1])


def test_a_stop_string_of_several_bytes_per_character_is_found_in_byte_tokens():
    """A byte-level tokenizer spends a token per UTF-8 byte: the tail decoded for a stop string of one 3-byte
    character spans its bytes, not its one character."""
    from qwen3vl_static.batching_qwen3vl_graph import GraphBatchingManager
    from qwen3vl_static.scheduler_qwen3vl_graph import Sequence
    from transformers.generation.continuous_batching.requests import GenerationOutput

    class ByteTokens:
        @staticmethod
        def decode(tokens, **kwargs):
            return bytes(tokens).decode("utf-8", errors="replace")

    manager = GraphBatchingManager(new_pair()[0], tokenizer=ByteTokens())
    output = GenerationOutput(request_id="bytes", generated_tokens=list("ab好".encode()))
    assert manager._stopped(Sequence(output, {}, None, 10, stop_strings=("好",)))
    assert not manager._stopped(Sequence(output, {}, None, 10, stop_strings=("好x",)))


def test_the_requests_next_in_line_are_those_of_two_budgets():
    """`Scheduler.upcoming`: the waiting requests in arrival order whose prompts fit the tokens given (the first one
    always), whose images the manager encodes while the GPU runs the chunk it just queued. `schedule(ready)` admits in
    arrival order up to the first that is not ready."""
    from qwen3vl_static.scheduler_qwen3vl_graph import Scheduler, Sequence

    scheduler = Scheduler(rows=2, max_prefill_tokens=10)
    for length in (12, 5, 4, 3):
        scheduler.add(Sequence(None, {"input_ids": torch.zeros(1, length)}, None, 0))
    assert [sequence.prompt_len for sequence in scheduler.upcoming(20)] == [12, 5]
    assert [sequence.prompt_len for sequence in scheduler.upcoming(5)] == [12]
    assert [sequence.prompt_len for sequence in scheduler.upcoming(100)] == [12, 5, 4, 3]
    assert scheduler.schedule(ready=lambda sequence: sequence.prompt_len != 12) == []
    assert [sequence.prompt_len for sequence in scheduler.schedule(ready=lambda sequence: True)] == [12]
    assert scheduler.schedule(ready=lambda sequence: sequence.prompt_len != 5) == []
    assert [sequence.prompt_len for sequence in scheduler.schedule()] == [5]  # the last free row


def test_images_are_encoded_ahead_of_their_prefill_while_rows_decode(monkeypatch):
    """Two rows, six requests: the images of the requests next in line go through the tower right after a decode
    chunk is queued (on a GPU: on the side stream, beside it), several in one call; each prefill then takes their
    features, its prompts holding no pixels; every request generates as alone."""
    import qwen3vl_static.batching_qwen3vl_graph as batching

    ours, stock = new_pair(max_batch_size=2)
    requests, expected = requests_and_expected(stock, 6, cases=[CASES[0], CASES[2], TEXT])
    events = record_work(ours)
    encode, joined = batching.media_features, batching._joined

    def media_features(model, inputs):
        events.append(("encode", inputs["image_grid_thw"].shape[0]))
        return encode(model, inputs)

    def joined_prompts(prompts, pad_id):
        assert not any(key in prompt for prompt in prompts for key in batching.PIXELS)
        return joined(prompts, pad_id)

    monkeypatch.setattr(batching, "media_features", media_features)
    monkeypatch.setattr(batching, "_joined", joined_prompts)
    results = list(ours.generate_batch(requests, progress_bar=False).values())
    assert [result.generated_tokens for result in results] == expected
    encodes = [index for index, event in enumerate(events) if event[0] == "encode"]
    assert sum(events[index][1] for index in encodes) == 4  # each image once
    assert any(events[index][1] == 2 for index in encodes)  # two requests' images in one call
    assert any(events[index - 1][0] == "decode" for index in encodes)  # right after a chunk, ahead of the prefill


def test_a_pixel_transform_takes_raw_patches_to_the_tower():
    """Requests whose images come as raw uint8 patches (the processor's rescaling and normalizing off, as the server
    hands them over) generate as the processor's float patches do, once the manager's `pixel_transform` normalizes
    them on the device: encoded ahead of their prefill beside a decoding row and at their admission alike. A request
    whose pixels the transform does not take fails alone."""
    ours, stock = new_pair(max_batch_size=2)
    generator = np.random.default_rng(3)
    pictures = [Image.fromarray(generator.integers(0, 256, (48 + 16 * index, 64, 3), dtype=np.uint8))
                for index in range(3)]
    cases = [([[chat("image", "What is it?")]], {"images": [picture]}) for picture in pictures]
    requests, expected = requests_and_expected(stock, 4, cases=[*cases, TEXT])
    normalizer = PixelNormalizer.for_processor(SimpleNamespace(image_processor=tiny_image_processor()))
    raw = [{**request, "pixel_values": PixelNormalizer.raw_patches(tiny_image_processor(), [picture])}
           for request, picture in zip(requests, pictures)] + requests[3:]
    assert all(request["pixel_values"].dtype == torch.uint8 for request in raw[:3])
    manager = ours.init_continuous_batching(pixel_transform=normalizer)
    results = manager.generate_all(raw, progress_bar=False)
    assert [result.generated_tokens for result in results.values()] == expected
    assert manager.stats["encoded_ahead"] and manager.stats["encoded_at_admission"]  # both ways to the tower
    untransformed = ours.init_continuous_batching().generate_all(raw[:1], progress_bar=False)
    assert untransformed["req_0"].generated_tokens != expected[0]  # the transform is what makes them equal
    # Float patches are not what this transform takes: that request fails, alone.
    mixed = ours.init_continuous_batching(pixel_transform=normalizer).generate_all([requests[0], raw[1]],
                                                                                   progress_bar=False)
    failed, finished = mixed.values()
    assert failed.status == RequestStatus.FAILED and "must be uint8" in failed.error
    assert finished.generated_tokens == expected[1]


def test_media_that_cannot_be_encoded_fail_their_request_alone(monkeypatch):
    """A request whose images fail in the tower fails with that error, whether it was encoded with others ahead of
    its prefill or at it; the others generate as alone."""
    import qwen3vl_static.batching_qwen3vl_graph as batching

    ours, stock = new_pair()
    requests, expected = requests_and_expected(stock, 6, cases=[CASES[0], CASES[2], TEXT])
    bad = requests[4]["pixel_values"] = requests[4]["pixel_values"].clone()
    bad[0, 0] = float("nan")
    encode = batching.media_features

    def media_features(model, inputs):
        if inputs["pixel_values"].isnan().any():
            raise RuntimeError("the tower failed")
        return encode(model, inputs)

    monkeypatch.setattr(batching, "media_features", media_features)
    for rows in (2, 4):  # encoded ahead with the next request's; at the prefill with its part's
        results = list(ours.generate_batch(requests, progress_bar=False, max_batch_size=rows).values())
        assert results[4].status == RequestStatus.FAILED and "the tower failed" in results[4].error
        for index in (0, 1, 2, 3, 5):
            assert results[index].status == RequestStatus.FINISHED
            assert results[index].generated_tokens == expected[index]


def test_while_rows_decode_an_image_request_enters_once_encoded_beside_a_chunk(monkeypatch):
    """An image request that arrives while a row decodes is not prefilled at once, with its tower inside the
    prefill's window: its images are encoded right after the next chunk is queued (on a GPU: beside it), and it enters
    the turn after. Both answers are as alone."""
    import qwen3vl_static.batching_qwen3vl_graph as batching

    ours, stock = new_pair(steps_per_sync=2)
    (text, picture), expected = requests_and_expected(stock, 2, lengths=[40, 5], cases=[TEXT, CASES[0]])
    events = record_work(ours)
    encode = batching.media_features
    monkeypatch.setattr(batching, "media_features",
                        lambda model, inputs: events.append(("encode", 1)) or encode(model, inputs))
    manager = ours.init_continuous_batching()
    enter = manager._enter
    manager._enter = lambda parts, *args: events.append(("enter", sum(map(len, parts)))) or enter(parts, *args)
    manager.start()
    try:
        first = manager.add_request(**text, streaming=True)
        streamed = iter(manager.request_id_iter(first))
        next(streamed)  # it decodes
        second = manager.add_request(**picture)
        assert manager.get_result(second, timeout=60).generated_tokens == expected[1]
        assert list(streamed)[-1].generated_tokens == expected[0]
    finally:
        manager.stop()
    at = events.index(("encode", 1))  # the turn after, its row steps inert in the chunk queued before its prefill
    assert events[at - 1][0] == "decode" and events[at + 1 : at + 4] == [("decode", 2), ("enter", 1), ("prefill", 1)]
    assert (manager.stats["encoded_ahead"], manager.stats["encoded_at_admission"]) == (1, 0)


def test_warmup_captures_every_mode_a_batch_without_penalties_takes(monkeypatch):
    """`manager.warmup()` asks the model for the decode modes `batch_mode` gives rows of greedy, top-k and plain
    sampled requests, in every mix."""
    import itertools

    from qwen3vl_static.batching_qwen3vl_graph import BATCH_MODES, batch_mode
    from qwen3vl_static.scheduler_qwen3vl_graph import Sequence

    def sequence(do_sample, top_k):
        return Sequence(None, {}, None, 0, do_sample=do_sample, sampling={"top_k": top_k, "candidates": 64})

    kinds = [sequence(False, 0), sequence(True, 20), sequence(True, 151936)]  # greedy, top-k 20, every token
    taken = {batch_mode(mix) for count in (1, 2, 3) for mix in itertools.combinations(kinds, count)}
    ours, _ = new_pair()
    asked = []
    monkeypatch.setattr(ours, "warmup", lambda **settings: asked.append(settings) or 0.0)
    assert ours.init_continuous_batching().warmup() == 0.0
    assert taken == set(BATCH_MODES) == set(asked[0]["modes"])
