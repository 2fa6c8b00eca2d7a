"""GPU checks on the real Qwen3-VL-2B shapes with random bf16 weights (skipped without CUDA)."""

import copy
import threading

import pytest
import torch

from qwen3vl_static import Qwen3VLGraphForConditionalGeneration, modeling_qwen3vl_graph, ops_attention_qwen3vl_graph
from qwen3vl_static.capture_qwen3vl_graph import GraphCapturer
from qwen3vl_static.compat_qwen3vl_graph import CACHE_KWARG, returned_cache, vision_features
from qwen3vl_static.ops_qwen3vl_graph import TorchOps, TritonOps
from qwen3vl_static.presets import tiny_config
from qwen3vl_static.workloads import (
    build_models,
    build_ours,
    generate_exactly_as_asked,
    image_prompt,
    save_random_draft,
    second_turn,
    text_prompt,
)
from test_kv_cache_fp8 import Float8RoundingCache
from test_speculative import ScriptedDraft

pytestmark = pytest.mark.cuda


@pytest.fixture(scope="module")
def models():
    ours, stock = build_models(torch.device("cuda"), torch.bfloat16, static_cache_len=1024, max_batch_size=8)
    return ours, stock


def generate(model, prompt, new_tokens, graphs=True, **kwargs):
    model.set_cuda_graphs(graphs)
    try:
        return model.generate(**prompt, max_new_tokens=new_tokens, do_sample=False, **kwargs)
    finally:
        model.set_cuda_graphs(True)


def left_padded(prompt, pads):
    ids, mask = prompt["input_ids"].clone(), prompt["attention_mask"].clone()
    for row, pad in enumerate(pads):
        ids[row, :pad] = 0
        mask[row, :pad] = 0
    return {"input_ids": ids, "attention_mask": mask}


def test_graph_equals_eager_static_path(models):
    ours, _ = models
    ours.static_cache()
    # Some graphs captured ahead (their kernels compiled at once, in parallel), the others on first use.
    sizes = dict(batch_sizes=[1, 4], cache_lengths=[456], modes=("greedy",), prompt_lengths=[200], image_patches=[784])
    ours.warmup(**sizes)
    captured = ours.warmup_report
    assert captured["graphs"] > 0 and captured["compile"] > 0 and captured["capture"] > 0
    ours.warmup(**sizes)  # nothing left to compile or capture
    assert ours.warmup_report["graphs"] == 0 and ours.warmup_report["compile"] < captured["compile"]
    generator = torch.Generator().manual_seed(1)
    cases = [
        text_prompt(ours.config, 1, 200, "cuda", generator),
        left_padded(text_prompt(ours.config, 4, 180, "cuda", generator), [0, 7, 30, 101]),
        image_prompt(ours.config, "cuda", generator),
        image_prompt(ours.config, "cuda", generator, sides=(448, 224)),  # two segments plus padding patches
    ]
    for prompt in cases:
        graph = generate(ours, prompt, 256)
        eager = generate(ours, prompt, 256, graphs=False)
        assert graph.tolist() == eager.tolist()
    # the graph paths really ran: decode, prefill and vision
    assert ours._engine.decode.graphs and ours._engine.prefill.graphs and ours._engine.vision.graphs


def test_near_tied_choices_are_settled_by_the_whole_step(models, monkeypatch):
    """With every candidate counted as a near tie, warmup times the whole step with each candidate of each measured
    choice and keeps the fastest there; the graphs it captures still reproduce the eager path. (This warmup follows
    longer prompts: its prefill steps must not read at a previous prompt's last token, past their bucket.)"""
    ours, _ = models
    engine = ours.graph_engine()
    if not isinstance(engine.ops, TritonOps):
        pytest.skip("the torch decode ops make no measured choices")
    tuner = engine.tuner
    monkeypatch.setattr(tuner, "near_tie", float("inf"))
    ours.warmup(batch_sizes=[2], cache_lengths=[300], modes=("greedy",), prompt_lengths=[100], image_patches=[])
    assert ours.warmup_report["settle"] > 0
    settled = {key: per_step for key, per_step in tuner.step_timings.items() if key[1].startswith("2x")}
    assert settled and all(len(tuner.timings[key]) > 1 for key in settled)
    for key, per_step in settled.items():
        assert None not in per_step and len(per_step) == len(tuner.timings[key])
        assert per_step[tuner.choices[key]] == min(per_step)
    prompt = text_prompt(ours.config, 2, 100, "cuda", torch.Generator().manual_seed(3))
    assert generate(ours, prompt, 40).tolist() == generate(ours, prompt, 40, graphs=False).tolist()


def test_torch_ops_graph_equals_eager_and_stays_close_to_the_kernels(models):
    """The torch reference ops (no Triton) on the GPU: graphs reproduce their eager path too, and fed the kernels'
    tokens (teacher forcing), their logits stay within bf16 noise of the kernels' logits."""
    from transformers import LogitsProcessor, LogitsProcessorList

    class FollowTokens(LogitsProcessor):
        """Every step emits the next token of `tokens`, whatever the logits: the run sees the same contexts."""

        def __init__(self, tokens):
            self.tokens = tokens

        def __call__(self, input_ids, scores):
            forced = self.tokens[:, input_ids.shape[1], None]
            return torch.full_like(scores, -float("inf")).scatter_(1, forced, 0.0)

    ours, _ = models
    ours.static_cache()
    runner = ours._engine.decode
    prompt = left_padded(text_prompt(ours.config, 4, 150, "cuda", torch.Generator().manual_seed(8)), [0, 3, 40, 77])
    with_logits = dict(return_dict_in_generate=True, output_logits=True)
    kernels = generate(ours, prompt, 64, **with_logits)
    kernel_ops, kernel_graphs, kernel_capturer = runner.ops, runner.graphs, runner.capturer
    runner.ops, runner.graphs, runner.capturer = TorchOps(), {}, GraphCapturer()
    try:
        graph = generate(ours, prompt, 64)
        assert graph.tolist() == generate(ours, prompt, 64, graphs=False).tolist()
        follow = LogitsProcessorList([FollowTokens(kernels.sequences)])
        forced = generate(ours, prompt, 64, logits_processor=follow, **with_logits)
    finally:
        runner.ops, runner.graphs, runner.capturer = kernel_ops, kernel_graphs, kernel_capturer
    assert forced.sequences.tolist() == kernels.sequences.tolist()
    torch_logits, kernel_logits = (torch.stack(out.logits, dim=1).float().log_softmax(-1) for out in (forced, kernels))
    delta = (torch_logits - kernel_logits).abs().max().item()
    same = (torch_logits.argmax(-1) == kernel_logits.argmax(-1)).float().mean().item()
    report = (f"decode ops {type(kernel_ops).__name__} vs TorchOps on the same tokens: max |delta log-prob| {delta:.4f}, "
              f"top-1 agreement {same:.3f}")
    print(report)
    # The kernels stay within about 0.14 of the stock full-sequence forward (the teacher-forced test below) and stock's
    # own cached decode within about 0.12, so two correct op sets differ by at most about 0.3 (0.5 leaves room for
    # this test's 256 positions); a wrong kernel is off by whole units.
    assert delta < 0.5, report


# The largest |log-prob| deviation of our decode from the stock full-sequence forward that bf16 rounding explains (ours
# measured 0.14, stock's own cached decode 0.11-0.13).
MAX_LOG_PROB_DELTA = 0.25


def stock_log_probs(stock, prompt, sequence, cache=None):
    """The stock full-sequence forward's float32 next-token log-probs after the prompt's last token and after each
    token of `sequence` (the prompt followed by generated tokens), with `cache` (an empty one) if given."""
    prompt_len = prompt["input_ids"].shape[1]
    pixels = {k: v for k, v in prompt.items() if k in ("pixel_values", "image_grid_thw")}
    if "mm_token_type_ids" in prompt:  # transformers 5.x
        mm = torch.cat([prompt["mm_token_type_ids"], torch.zeros_like(sequence[:, prompt_len:], dtype=torch.int)], 1)
        pixels.update(mm_token_type_ids=mm)
    if cache is not None:
        pixels.update(use_cache=True, **{CACHE_KWARG: cache})
    with torch.no_grad():
        return stock(input_ids=sequence, **pixels).logits[:, prompt_len - 1 :].float().log_softmax(-1)


def teacher_forced_agreement(ours, stock, prompt) -> dict:
    """Our graph-replayed steps (greedy, 128 tokens) against the stock full-sequence forward on the same tokens:
    top-1 agreement overall and where the stock margin exceeds twice our largest log-prob deviation ("decisive"), that
    deviation, and the stock model's own cached decode measured the same way as a baseline."""
    prompt_len = prompt["input_ids"].shape[1]
    kwargs = dict(max_new_tokens=128, do_sample=False, return_dict_in_generate=True, output_logits=True)
    out = ours.generate(**prompt, **kwargs)
    sequence = out.sequences[:, :-1]
    reference = stock_log_probs(stock, prompt, sequence)
    # Baseline: the stock model decoding the same tokens one at a time with its own cache.
    pixels = {k: v for k, v in prompt.items() if k in ("pixel_values", "image_grid_thw", "mm_token_type_ids")}
    with torch.no_grad():
        step = stock(input_ids=sequence[:, :prompt_len], **pixels, use_cache=True)
        stock_steps = [step.logits[:, -1].float()]
        for position in range(prompt_len, sequence.shape[1]):
            step = stock(input_ids=sequence[:, position : position + 1], use_cache=True, **{CACHE_KWARG: getattr(step, CACHE_KWARG)})
            stock_steps.append(step.logits[:, -1].float())

    def agreement(logits, where=None):
        same = logits.argmax(-1) == reference.argmax(-1)
        return same[where].float().mean().item() if where is not None else same.float().mean().item()

    ours_logits = torch.stack(out.logits, dim=1).log_softmax(-1)
    delta = (ours_logits - reference).abs().max().item()
    top2 = reference.topk(2, dim=-1).values
    decisive = (top2[..., 0] - top2[..., 1]) > 2 * delta
    stock_logits = torch.stack(stock_steps, dim=1).log_softmax(-1)
    stock_delta = (stock_logits - reference).abs().max().item()
    result = {"overall": agreement(ours_logits), "decisive": agreement(ours_logits, decisive), "delta": delta,
              "stock_overall": agreement(stock_logits), "stock_delta": stock_delta}
    result["report"] = (
        f"ours: top-1 agreement {result['overall']:.4f} (decisive positions {result['decisive']:.4f}, "
        f"{int(decisive.sum())}/{decisive.numel()}), max |delta log-prob| {delta:.4f}; stock cached decode: "
        f"agreement {result['stock_overall']:.4f}, max |delta log-prob| {stock_delta:.4f}"
    )
    return result


def test_teacher_forced_logits_agree_with_stock_forward(models):
    """Our graph-replayed step vs the stock full-sequence forward on the same tokens (bf16).

    Random weights give near-uniform logits, so bf16 noise flips some near-ties; the stock model's own
    cached decode is measured the same way as a baseline, and full agreement is required on the positions
    whose stock top-1 margin exceeds that noise.
    """
    ours, stock = models
    agreement = teacher_forced_agreement(ours, stock, image_prompt(ours.config, "cuda", torch.Generator().manual_seed(2)))
    print(agreement["report"])
    assert agreement["decisive"] >= 0.99, agreement["report"]
    # Overall agreement on near-ties moves by several points between sequences for the stock model itself (seen:
    # 92.2% and 96.1%), so it is held against that baseline rather than a fixed number.
    assert agreement["overall"] >= agreement["stock_overall"] - 0.05, agreement["report"]
    assert agreement["delta"] < MAX_LOG_PROB_DELTA, agreement["report"]


def test_multi_tile_attention_splits_agree_with_stock(models, monkeypatch):
    """Flash-decoding programs of 4 tiles (what long caches and large batches take; the fixture's sizes take one):
    the decode graphs captured anew with them give the eager static path's tokens and agree with the stock forward
    as the one-tile step does."""
    ours, stock = models
    monkeypatch.setattr(ops_attention_qwen3vl_graph, "split_tiles", lambda rows, kv_heads, kv_len: 4)
    monkeypatch.setattr(ours._engine.decode, "graphs", {})  # the fixture's graphs come back afterwards
    prompt = image_prompt(ours.config, "cuda", torch.Generator().manual_seed(2))
    assert generate(ours, prompt, 64).tolist() == generate(ours, prompt, 64, graphs=False).tolist()
    agreement = teacher_forced_agreement(ours, stock, prompt)
    print(agreement["report"])
    assert agreement["decisive"] >= 0.99, agreement["report"]
    assert agreement["overall"] >= agreement["stock_overall"] - 0.05, agreement["report"]
    assert agreement["delta"] < MAX_LOG_PROB_DELTA, agreement["report"]


def batch_requests(config, count, generator) -> list:
    """Continuous batching's requests: every third a 448x448-image prompt, the others text of growing lengths, answers
    of uneven lengths."""
    return [{**(image_prompt(config, "cuda", generator) if index % 3 == 0
                else text_prompt(config, 1, 40 + 23 * index, "cuda", generator)),
             "max_new_tokens": 6 + 13 * index} for index in range(count)]


def batch_tokens(model, requests, **settings) -> dict:
    """{graphs on: each request's tokens} from `generate_batch` with graphs and without, on 8 rows of 1024 slots (not
    sized for these requests from memory: the tests share the cache); every request must succeed."""
    tokens = {}
    for graphs in (True, False):
        model.set_cuda_graphs(graphs)
        try:
            results = model.generate_batch(requests, progress_bar=False, max_batch_size=8, static_cache_len=1024,
                                           **settings)
        finally:
            model.set_cuda_graphs(True)
        assert [result.error for result in results.values()] == [None] * len(requests)
        tokens[graphs] = [result.generated_tokens for result in results.values()]
    return tokens


@pytest.mark.parametrize("max_prefill_tokens", [8192, 200])
def test_continuous_batching_graph_equals_eager_and_agrees_with_stock(models, max_prefill_tokens):
    """Continuous batching in bf16: 12 requests (text and 448x448-image prompts, uneven answer lengths) over the 8
    cache rows; with a budget of 200 tokens the longer prompts enter in chunks. The graphs give the tokens of the same
    schedule run eagerly, and each request's tokens, also streamed (chunks as short as keep the GPU busy: another
    schedule), are the stock full-sequence forward's top-1 wherever its margin exceeds twice the log-prob deviation
    the test above allows."""
    ours, stock = models
    requests = batch_requests(ours.config, 12, torch.Generator().manual_seed(9))
    tokens = batch_tokens(ours, requests, max_prefill_tokens=max_prefill_tokens)
    assert tokens[True] == tokens[False]
    manager = ours.init_continuous_batching(max_batch_size=8, static_cache_len=1024,
                                            max_prefill_tokens=max_prefill_tokens)
    manager.start()
    try:
        ids = [manager.add_request(**request, streaming=True) for request in requests]
        streamed = [list(manager.request_id_iter(request_id))[-1] for request_id in ids]
    finally:
        manager.stop()
    assert [result.error for result in streamed] == [None] * len(requests)
    # Rows that join decoding rows after a prefill beside them wait for it on the GPU or begin after its end: GPU time
    # from the one to the other is counted (`activation_wait_ms`, `activation_slack_ms`), never below zero.
    stats = manager.stats
    assert stats["prefills_beside"] > 0 and min(stats["activation_wait_ms"], stats["activation_slack_ms"]) >= 0
    assert stats["activation_wait_ms"] + stats["activation_slack_ms"] > 0
    decisive = 0
    for request, generated in zip(requests * 2, tokens[True] + [result.generated_tokens for result in streamed]):
        assert len(generated) == request["max_new_tokens"]  # no EOS (generate_exactly_as_asked)
        prompt = {key: value for key, value in request.items() if key != "max_new_tokens"}
        sequence = torch.cat([prompt["input_ids"], torch.tensor([generated[:-1]], device="cuda")], dim=1)
        top2 = stock_log_probs(stock, prompt, sequence)[0].topk(2, dim=-1)
        sure = (top2.values[:, 0] - top2.values[:, 1]) > 2 * MAX_LOG_PROB_DELTA
        assert torch.tensor(generated, device="cuda")[sure].tolist() == top2.indices[sure, 0].tolist()
        decisive += int(sure.sum())
    assert decisive > 0


def test_penalized_batches_graph_equals_eager_and_leave_other_rows_alone(models):
    """Requests with repetition, presence and frequency penalties beside requests without (bf16): the graphs of the
    penalized modes give the eager schedule's tokens, and the requests without penalties get the tokens they get in a
    batch that has none."""
    ours, _ = models
    generator = torch.Generator().manual_seed(5)
    plain = [{**text_prompt(ours.config, 1, 30 + 17 * index, "cuda", generator), "max_new_tokens": 24}
             for index in range(4)]
    settings = [{"repetition_penalty": 1.3}, {}, {"presence_penalty": 1.0, "frequency_penalty": 0.5}, {}]
    penalized = [{**request, **own} for request, own in zip(plain, settings)]
    tokens = {}
    for name, requests, graphs in (("plain", plain, True), ("graphs", penalized, True), ("eager", penalized, False)):
        ours.set_cuda_graphs(graphs)
        try:
            results = ours.generate_batch(requests, progress_bar=False, max_batch_size=8, static_cache_len=1024)
        finally:
            ours.set_cuda_graphs(True)
        assert [result.error for result in results.values()] == [None] * len(requests)
        tokens[name] = [result.generated_tokens for result in results.values()]
    assert tokens["graphs"] == tokens["eager"]
    assert tokens["graphs"][1::2] == tokens["plain"][1::2]


@pytest.mark.parametrize("case", ["plain", "penalized", "chunked"])
def test_a_warm_continuous_batch_waits_for_the_device_only_to_read_tokens(models, case):
    """A host-device sync in the batch's thread (a scalar written through an index, a tensor built from a list on the
    device) waits for every chunk and prefill queued: the host stops queueing ahead. Once warm (graphs captured, image
    tables built), a batch of text and image requests from the host (as a server gives them), with rows freed and
    moved to the front, runs under CUDA's sync debug mode set to raise: only reading tokens (an event) may wait.
    `penalized`: some requests set penalties; `chunked`: a budget of 200 tokens, the longer prompts in chunks."""
    ours, _ = models
    generator = torch.Generator().manual_seed(11)
    requests = [{**(image_prompt(ours.config, "cpu", generator) if index % 3 == 0
                    else text_prompt(ours.config, 1, 40 + 23 * index, "cpu", generator)),
                 "max_new_tokens": 6 + 13 * index} for index in range(12)]
    if case == "penalized":
        requests[1]["repetition_penalty"], requests[4]["presence_penalty"] = 1.3, 0.5
    settings = {"max_prefill_tokens": 200} if case == "chunked" else {}
    for debug_mode in ("default", "error"):
        torch.cuda.set_sync_debug_mode(debug_mode)
        try:
            results = ours.generate_batch(requests, progress_bar=False, max_batch_size=8, static_cache_len=1024,
                                          **settings)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert [result.error for result in results.values()] == [None] * len(requests)


def relative_error(got, expected):
    return ((got.float() - expected.float()).norm() / expected.float().norm()).item()


def test_float8_kv_cache_graph_equals_eager_and_agrees_with_stock_on_rounded_kv(models):
    """kv_cache_dtype="fp8" on the 2B shapes (the same weights): the cache holds float8, half the bytes; graphs give
    the eager static path's tokens, in `generate` and in continuous batching; and the answers are the top-1 of stock's
    full-sequence forward attending to K/V rounded as ours stores them, wherever its margin exceeds twice the log-prob
    deviation bf16 explains. (Ours and stock's K differ in bf16 rounding, which now and then lands a float8 unit
    apart: 95 % of those positions, not all.)"""
    reference, stock = models
    ours = build_ours("cuda", torch.bfloat16, static_cache_len=1024, max_batch_size=8, kv_cache_dtype="fp8")
    generate_exactly_as_asked(ours)
    try:
        generator = torch.Generator().manual_seed(5)
        cases = [text_prompt(ours.config, 1, 200, "cuda", generator),
                 left_padded(text_prompt(ours.config, 4, 180, "cuda", generator), [0, 7, 30, 101]),
                 image_prompt(ours.config, "cuda", generator)]
        decisive = agreeing = 0
        for prompt in cases:
            graph = generate(ours, prompt, 128)
            assert graph.tolist() == generate(ours, prompt, 128, graphs=False).tolist()
            if prompt["input_ids"].shape[0] > 1:
                continue
            top2 = stock_log_probs(stock, prompt, graph[:, :-1], Float8RoundingCache())[0].topk(2, dim=-1)
            sure = (top2.values[:, 0] - top2.values[:, 1]) > 2 * MAX_LOG_PROB_DELTA
            answer = graph[0, prompt["input_ids"].shape[1]:]
            agreeing += int((answer[sure] == top2.indices[sure, 0]).sum())
            decisive += int(sure.sum())
        print(f"float8 KV cache: top-1 of stock on rounded K/V at {agreeing} of {decisive} decisive positions")
        assert decisive > 0 and agreeing >= 0.95 * decisive
        keys, reference_keys = ours._engine.cache.full_keys[0], reference._engine.cache.full_keys[0]
        assert keys.dtype == torch.float8_e4m3fn and 2 * keys.nbytes == reference_keys.nbytes
        tokens = batch_tokens(ours, batch_requests(ours.config, 8, generator))
        assert tokens[True] == tokens[False]
    finally:
        del ours
        torch.cuda.empty_cache()


def test_rope_index_on_host_copies_equals_stock_on_the_gpu(models):
    ours, stock = models
    prompt = image_prompt(ours.config, "cuda", torch.Generator().manual_seed(3), sides=(448, 224), batch=3)
    inputs = {key: value for key, value in prompt.items() if key != "pixel_values"}
    for key in ("input_ids", "attention_mask", "mm_token_type_ids"):  # 40 text tokens before each row ...
        if key in inputs:
            inputs[key] = torch.cat([torch.full_like(inputs[key][:, :40], key == "attention_mask"), inputs[key]], 1)
    inputs["attention_mask"][1, :40] = 0  # ... that are left padding in row 1
    input_ids = inputs.pop("input_ids")
    ours_positions, ours_offsets = ours.model.get_rope_index(input_ids, **inputs)
    stock_positions, stock_offsets = stock.model.get_rope_index(input_ids, **inputs)
    assert ours_positions.device == stock_positions.device and ours_offsets.device == stock_offsets.device
    assert torch.equal(ours_positions, stock_positions) and torch.equal(ours_offsets, stock_offsets)


@pytest.mark.parametrize("sides", [(448,), (448, 224, 448), (448,) * 4], ids=["448", "448+224+448", "4x448"])
def test_vision_features_and_prefill_logits_match_stock(models, sides):
    """The graphed vision tower (one image; three of two sizes: a chunk per size, gathered back in order; four of one
    size: one chunk, batched attention) and graphed prefill, in bf16, are as close to a float32 reference as stock
    bf16 is: "within bf16 tolerance", measured rather than guessed."""
    ours, stock = models
    prompt = image_prompt(ours.config, "cuda", torch.Generator().manual_seed(9), sides=sides)
    pixels, grid = prompt["pixel_values"], prompt["image_grid_thw"]
    assert None not in ours._engine.vision.keys([tuple(row) for row in grid.tolist()])  # the graph path
    reference = copy.deepcopy(stock).float()
    kwargs = dict(max_new_tokens=1, do_sample=False, return_dict_in_generate=True, output_logits=True)
    with torch.no_grad():
        vision = [vision_features(model.model.visual(pixels.to(model.dtype), grid_thw=grid)) for model in (ours, stock, reference)]
    logits = [model.generate(**prompt, **kwargs).logits[0] for model in (ours, stock, reference)]
    del reference
    errors = {}
    for name, (got, expected, exact) in {"merged": [v[0] for v in vision], "logits": logits,
                                         **{f"deepstack{i}": [v[1][i] for v in vision] for i in range(len(vision[0][1]))}}.items():
        errors[name] = (relative_error(got, exact), relative_error(expected, exact))
    print("relative error vs float32 (ours, stock bf16):", {k: tuple(round(e, 4) for e in v) for k, v in errors.items()})
    for name, (ours_error, stock_error) in errors.items():
        assert ours_error <= 2 * stock_error + 1e-3, (name, ours_error, stock_error)
    assert ours._engine.prefill.graphs and ours._engine.vision.graphs


def test_vision_runs_ahead_on_the_side_stream(models, monkeypatch):
    """generate starts a captured vision graph on the side stream before it prepares its inputs, and the encode that
    follows takes that result instead of running the tower again; tokens equal the eager static path's. An encode of
    other images after a run ahead waits for it and encodes its own."""
    ours, _ = models
    runner = ours._engine.vision
    prompt = image_prompt(ours.config, "cuda", torch.Generator().manual_seed(10))
    generate(ours, prompt, 8)  # captures this image size's graph
    streams = []
    load = runner.load
    monkeypatch.setattr(runner, "load", lambda *args: (streams.append(torch.cuda.current_stream()), load(*args))[1])
    graph = generate(ours, prompt, 64)
    monkeypatch.undo()
    assert streams == [runner.capturer.side_stream()] and runner.ahead is None  # loaded once, on the side stream
    assert graph.tolist() == generate(ours, prompt, 64, graphs=False).tolist()
    other = image_prompt(ours.config, "cuda", torch.Generator().manual_seed(11), sides=(224,))
    with torch.no_grad():
        expected = runner.encode(other["pixel_values"], other["image_grid_thw"])
        runner.encode_ahead(prompt["pixel_values"], prompt["image_grid_thw"])
        got = runner.encode(other["pixel_values"], other["image_grid_thw"])
    assert runner.ahead is None
    assert all(torch.equal(a, b) for a, b in zip([got[0], got[1], *got[2]], [expected[0], expected[1], *expected[2]]))


def test_the_prompt_is_prefilled_ahead_on_the_side_stream(models, monkeypatch):
    """A fresh prompt's prefill is queued on the side stream before transformers prepares the loop, once; tokens equal
    the eager static path's and those of the loop's own prefill (prefill ahead off)."""
    ours, _ = models
    runner = ours._engine.prefill
    generator = torch.Generator().manual_seed(12)
    for prompt in (image_prompt(ours.config, "cuda", generator),
                   left_padded(text_prompt(ours.config, 4, 180, "cuda", generator), [0, 7, 30, 101])):
        generate(ours, prompt, 8)  # captures this size's graphs
        streams = []
        run = runner.run
        monkeypatch.setattr(runner, "run", lambda *args, **kwargs: (streams.append(torch.cuda.current_stream()),
                                                                   run(*args, **kwargs))[1])
        graph = generate(ours, prompt, 64)
        assert streams == [runner.capturer.side_stream()]
        assert graph.tolist() == generate(ours, prompt, 64, graphs=False).tolist()
        monkeypatch.setattr(modeling_qwen3vl_graph, "prefill_ahead", lambda *args: None)
        assert graph.tolist() == generate(ours, prompt, 64).tolist()
        monkeypatch.undo()


def test_bucket_switch_mid_generation(models):
    ours, _ = models
    prompt = text_prompt(ours.config, 2, 200, "cuda", torch.Generator().manual_seed(3))
    assert 256 in ours._engine.decode.cache_buckets
    graph = generate(ours, prompt, 150)  # crosses the 256-slot bucket into 512
    assert graph.tolist() == generate(ours, prompt, 150, graphs=False).tolist()
    assert any(key[1] == 512 for key in ours._engine.decode.graphs) and any(key[1] == 256 for key in ours._engine.decode.graphs)


def test_consecutive_calls_with_different_shapes(models):
    ours, _ = models
    generator = torch.Generator().manual_seed(4)
    for batch, length, new in [(1, 40, 20), (3, 300, 33), (1, 90, 7), (8, 64, 12), (2, 500, 40)]:
        prompt = text_prompt(ours.config, batch, length, "cuda", generator)
        assert generate(ours, prompt, new).tolist() == generate(ours, prompt, new, graphs=False).tolist()


def test_many_mixed_calls_do_not_grow_memory(models):
    ours, _ = models
    generator = torch.Generator().manual_seed(5)
    shapes = [(batch, length) for batch in (1, 2, 3, 5, 8) for length in (20, 300, 700)]
    prompts = [text_prompt(ours.config, b, n, "cuda", generator) for b, n in shapes]
    for prompt in prompts:  # every graph these calls need gets captured here
        generate(ours, prompt, 4)
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated()
    for call in range(1000):
        generate(ours, prompts[call % len(prompts)], 4)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() <= baseline + (1 << 20)


def test_a_capture_after_every_graph_is_gone():
    # Graphs are dropped (a draft's recorded layers, vision tables evicted): once none is left, PyTorch has released
    # their pool, and a capture into it would fail an internal assertion.
    capturer, values = GraphCapturer(), torch.zeros(4, device="cuda")

    def step():
        values.add_(1)

    first = capturer.capture(step)
    del first
    torch.cuda.synchronize()
    second = capturer.capture(step)
    values.zero_()
    second.replay()
    assert values.tolist() == [1.0] * 4


def test_two_threads_get_correct_outputs(models):
    ours, _ = models
    generator = torch.Generator().manual_seed(6)
    prompts = [text_prompt(ours.config, batch, 120, "cuda", generator) for batch in (1, 4)]
    expected = [generate(ours, prompt, 48).tolist() for prompt in prompts]
    results = {}

    def worker(index):
        for _ in range(5):
            out = ours.generate(**prompts[index], max_new_tokens=48, do_sample=False).tolist()
            results.setdefault(index, []).append(out == expected[index])

    threads = [threading.Thread(target=worker, args=(index,)) for index in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(results[0]) and all(results[1]) and len(results[0]) == len(results[1]) == 5


def test_seeded_in_graph_sampling_is_reproducible(models):
    """Both sampler forms (a top-k within the candidates; top-p alone, over the sorted vocabulary), their kernels
    compiled ahead by `warmup` (launches skipped, outputs unwritten: the sampler's torch glue must stay in bounds),
    reproduce with a seed and draw other tokens with another."""
    ours, _ = models
    prompt = text_prompt(ours.config, 4, 100, "cuda", torch.Generator().manual_seed(7))
    ours.warmup(batch_sizes=[4], cache_lengths=[140], modes=("sample", "sample_top_k"), prompt_lengths=[100],
                image_patches=[])
    for settings in (dict(top_k=50, top_p=0.9), dict(top_k=0, top_p=0.9)):
        runs = []
        for seed in (11, 11, 12):
            torch.manual_seed(seed)
            runs.append(ours.generate(**prompt, max_new_tokens=40, do_sample=True, temperature=1.0, **settings).tolist())
        assert runs[0] == runs[1] and runs[0] != runs[2]


def video_and_image_prompt(config, generator, side=448):
    """`image_prompt` with a one-frame video (after temporal merging) of the image's grid before the image: the two
    have the same grid and pixel shape."""
    prompt = image_prompt(config, "cuda", generator, sides=(side,))
    vision = config.vision_config
    grid = side // vision.patch_size
    tokens = grid * grid // vision.spatial_merge_size**2
    video = [config.vision_start_token_id] + [config.video_token_id] * tokens + [config.vision_end_token_id]
    ids = torch.cat([torch.tensor(video, device="cuda"), prompt["input_ids"][0]])[None]
    prompt.update(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        pixel_values_videos=torch.randn(prompt["pixel_values"].shape, generator=generator).to("cuda"),
        video_grid_thw=prompt["image_grid_thw"].clone(),
    )
    if "mm_token_type_ids" in prompt:  # transformers 5.x
        prompt["mm_token_type_ids"] = ((ids == config.image_token_id).int() + 2 * (ids == config.video_token_id).int())
    return prompt


def test_a_video_never_takes_the_features_of_images_run_ahead(models):
    """A call with an image and a video of the same grid and pixel shape, graphs on (the size's graph captured, so a
    run ahead could start), gives the tokens of the eager static path. And in the order that would mix them up, a
    video encoded while the call's images could be running ahead gets its own features."""
    ours, _ = models
    runner = ours._engine.vision
    prompt = video_and_image_prompt(ours.config, torch.Generator().manual_seed(12))
    generate(ours, prompt, 8)  # captures this size's graph
    assert generate(ours, prompt, 64).tolist() == generate(ours, prompt, 64, graphs=False).tolist()
    video, grid = prompt["pixel_values_videos"], prompt["video_grid_thw"]
    with torch.no_grad():
        expected = runner.encode(video, grid)
        runner.encode_ahead(prompt["pixel_values"], prompt["image_grid_thw"], videos=True)  # what generate passes
        assert runner.ahead is None
        got = runner.encode(video, grid)
    assert all(torch.equal(a, b) for a, b in zip([got[0], got[1], *got[2]], [expected[0], expected[1], *expected[2]]))


def test_tables_evicted_during_a_run_ahead(models, monkeypatch):
    """With no table slot (`vision_table_cache_size=0`) every table a run-ahead looks up is evicted at once, while the
    side stream still has to read it (and its graph is dropped as it runs): a call of three images of one size (one
    chunk), run ahead, gives the tokens of the eager path."""
    ours, _ = models
    runner = ours._engine.vision
    prompt = image_prompt(ours.config, "cuda", torch.Generator().manual_seed(13), sides=(320, 320, 320))
    generate(ours, prompt, 8)  # captures the graph of these images
    monkeypatch.setattr(runner, "table_cache_size", 0)
    runner.tables.clear()  # an insertion evicts one entry: the new one, from an empty cache
    streams = []
    load = runner.load
    monkeypatch.setattr(runner, "load", lambda *args: (streams.append(torch.cuda.current_stream()), load(*args))[1])
    graph = generate(ours, prompt, 64)
    assert streams == [runner.capturer.side_stream()] and not runner.tables  # ran ahead, taken; nothing kept
    assert graph.tolist() == generate(ours, prompt, 64, graphs=False).tolist()


def test_second_turn_with_the_returned_cache_graph_equals_eager(models):
    """A chat's second turn passed with the returned cache prefills only its new tokens, through a prefill graph
    that attends to the cached slots, and decodes as the same steps run eagerly do."""
    ours, _ = models
    image = image_prompt(ours.config, "cuda", torch.Generator().manual_seed(5))
    tokens = {}
    for graphs in (True, False):
        first, resumed, _ = second_turn(ours, image, torch.Generator().manual_seed(6), answer=64)
        tokens[graphs] = generate(ours, resumed, 64, graphs=graphs, **{CACHE_KWARG: returned_cache(first)})
    assert tokens[True].tolist() == tokens[False].tolist()
    assert any(kv_slots != size for _, size, kv_slots, _ in ours._engine.prefill.graphs)


def test_warmup_between_turns_leaves_no_stale_conversation(models):
    """`warmup()` runs its steps on the cache's rows (a 2 x 1024-token prefill graph writes slots 0-1023 of rows 0 and
    1): a turn passing back the cache returned before it is then a new request, never a read of overwritten slots."""
    ours, _ = models
    generator = torch.Generator().manual_seed(7)
    first = generate(ours, text_prompt(ours.config, 1, 100, "cuda", generator), 32, return_dict_in_generate=True)
    ids = torch.cat([first.sequences, torch.randint(0, 150000, (1, 20), generator=generator).to("cuda")], dim=1)
    turn = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    ours.warmup(batch_sizes=[2], cache_lengths=[300], modes=("greedy",), prompt_lengths=[700], image_patches=[])
    assert ours.warmup_report["graphs"] > 0  # steps ran
    got = generate(ours, turn, 32, **{CACHE_KWARG: returned_cache(first)})
    assert got.tolist() == generate(ours, turn, 32).tolist()


def test_each_model_measures_its_own_kernel_choices():
    """Measured kernel choices belong to a model's engine: a second model with the same shapes starts with none and
    measures its own; changing one model's choice leaves the other's alone."""
    def tiny_model():
        torch.manual_seed(0)
        config = tiny_config(max_batch_size=2, static_cache_len=256)
        return Qwen3VLGraphForConditionalGeneration(config).to("cuda", torch.bfloat16).eval()

    first, second = tiny_model(), tiny_model()
    ids = torch.randint(0, first.config.text_config.vocab_size, (1, 20), device="cuda")
    first.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)
    measured = first.graph_engine().tuner
    if not isinstance(first.graph_engine().ops, TritonOps):
        pytest.skip("the torch decode ops make no measured choices")
    assert measured.choices and not second.graph_engine().tuner.choices
    second.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)
    other = second.graph_engine().tuner
    assert other is not measured and set(other.choices) == set(measured.choices)
    key = next(iter(measured.choices))
    before = other.choices[key]
    measured.choices[key] = len(measured.timings[key]) - 1 - measured.choices[key]
    assert other.choices[key] == before


def test_a_new_engine_takes_the_choices_stored_by_an_earlier_one(tmp_path, monkeypatch):
    """With a store (`QWEN3VL_STATIC_CACHE_DIR`), a model built later (as in a later process) takes the choices the
    first one measured, without timing anything, and generates the same tokens."""
    monkeypatch.setenv("QWEN3VL_STATIC_CACHE_DIR", str(tmp_path))

    def tiny_model():
        torch.manual_seed(0)
        config = tiny_config(max_batch_size=2, static_cache_len=256)
        return Qwen3VLGraphForConditionalGeneration(config).to("cuda", torch.bfloat16).eval()

    ids = torch.randint(0, 100, (1, 20), device="cuda")
    first, later = tiny_model(), tiny_model()
    if not isinstance(first.graph_engine().ops, TritonOps):
        pytest.skip("the torch decode ops make no measured choices")
    expected = first.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)
    measured = first.graph_engine().tuner
    assert measured.choices and list((tmp_path / "tuner").glob("*.json"))

    def unexpected(candidates):
        raise AssertionError("a stored choice is not measured again")

    monkeypatch.setattr(later.graph_engine().tuner, "time_calls", unexpected)
    got = later.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)
    assert later.graph_engine().tuner.choices == {key: measured.choices[key] for key in later.graph_engine().tuner.choices}
    assert got.tolist() == expected.tolist()


def test_speculative_decoding_graph_equals_eager_and_agrees_with_stock(models, tmp_path):
    """bf16 on the 2B shapes, a 448x448 image prompt, 4 draft tokens a cycle: with a random draft of the published
    format (few proposals kept) and with one proposing the plain loop's own tokens (nearly all kept), the cycle graphs
    give the tokens of the same loop run eagerly, and every token is the stock full-sequence forward's top-1 wherever
    its margin exceeds twice the log-prob deviation the tests above allow (the verify step's 5-row kernels may break
    near-ties otherwise than the plain 1-row step)."""
    ours, stock = models
    prompt = image_prompt(ours.config, "cuda", torch.Generator().manual_seed(4))
    plain = generate(ours, prompt, 96)
    draft = ours.load_draft(save_random_draft(ours.config, tmp_path, torch.Generator().manual_seed(1)))
    try:
        for proposer in (draft, ScriptedDraft(plain)):
            ours.use_draft(proposer, 4)
            got = generate(ours, prompt, 96)
            kept = ours.speculative_stats["kept_per_cycle"]
            assert got.tolist() == generate(ours, prompt, 96, graphs=False).tolist()
            assert sum(kept) == 95 and all(1 <= count <= 5 for count in kept)
            sequence = got[:, :-1]
            top2 = stock_log_probs(stock, prompt, sequence)[0].topk(2, dim=-1)
            sure = (top2.values[:, 0] - top2.values[:, 1]) > 2 * MAX_LOG_PROB_DELTA
            generated = got[0, prompt["input_ids"].shape[1]:]
            assert generated[sure].tolist() == top2.indices[sure, 0].tolist() and int(sure.sum()) > 0
            print(f"{type(proposer).__name__}: {len(kept)} cycles for 95 tokens, {int(sure.sum())} decisive")
        assert len(kept) < 95 / 3  # the plain loop's own tokens: most cycles keep all 5
    finally:
        ours.use_draft(None)
