"""Common transformers paths beyond the main ones, each equal to stock (CPU, fp32): right padding, inference mode,
the order of the sampling warpers, the model's effect on torch's global flags, deep copies."""

import copy

import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper
from transformers.generation.stopping_criteria import MaxLengthCriteria, StoppingCriteriaList

from conftest import build, chat, image, new_pair, right_padded
from qwen3vl_static import Qwen3VLGraphForConditionalGeneration
from qwen3vl_static.compat_qwen3vl_graph import CACHE_KWARG, returned_cache
from qwen3vl_static.loops_qwen3vl_graph import device_plan
from qwen3vl_static.presets import tiny_config

MIXED_BATCH = (
    [[chat("image", "What is it?")], [chat("Hi")], [chat("video", "Summarise the clip, please.")]],
    {"images": [image(96, 64)], "video_grids": [(3, 4, 4)]},
)
GREEDY = dict(max_new_tokens=12, do_sample=False)


def test_right_padded_batch_matches_stock(tiny_pair):
    """Stock masks a right-padded row's padding queries like any padding: they see the real tokens before them, and
    the row's last position (a padding token) gives its first new token."""
    ours, stock = tiny_pair
    model_inputs = right_padded(build(MIXED_BATCH))
    assert (model_inputs["attention_mask"][:, -1] == 0).any()
    expected = stock.generate(**model_inputs, **GREEDY, return_dict_in_generate=True, output_logits=True)
    assert ours.generate(**model_inputs, **GREEDY).tolist() == expected.sequences.tolist()
    # Random weights rarely flip a token on the padding query's view: its logits must agree too (host loop).
    got = ours.generate(**model_inputs, **GREEDY, return_dict_in_generate=True, output_logits=True)
    assert got.sequences.tolist() == expected.sequences.tolist()
    for ours_step, stock_step in zip(got.logits, expected.logits):
        torch.testing.assert_close(ours_step, stock_step, rtol=1e-4, atol=1e-4)


def test_warpers_out_of_the_samplers_order_take_the_host_loop(tiny_pair):
    """Top-p, then temperature (custom warpers): the device sampler (temperature, then top-k, then top-p) cannot follow
    that order, so the host loop does, drawing as stock does."""
    ours, stock = tiny_pair
    model_inputs = build(MIXED_BATCH)
    warpers = LogitsProcessorList([TopPLogitsWarper(0.7), TemperatureLogitsWarper(0.4)])
    kwargs = dict(max_new_tokens=10, do_sample=True, top_k=0, logits_processor=warpers)
    torch.manual_seed(11)
    expected = stock.generate(**model_inputs, **kwargs)
    torch.manual_seed(11)
    assert ours.generate(**model_inputs, **kwargs).tolist() == expected.tolist()


def test_device_plan_follows_the_warpers_order():
    config, criteria = GenerationConfig(do_sample=True), StoppingCriteriaList([MaxLengthCriteria(20)])
    warpers = [TemperatureLogitsWarper(0.7), TopKLogitsWarper(20), TopPLogitsWarper(0.8)]
    plan = device_plan(LogitsProcessorList(warpers), criteria, config)
    assert (plan["temperature"], plan["top_k"], plan["top_p"]) == (0.7, 20, 0.8)
    for order in ([1, 0], [2, 0], [2, 1], [0, 0]):
        assert device_plan(LogitsProcessorList([warpers[i] for i in order]), criteria, config) is None, order


def test_generate_inside_and_outside_inference_mode_in_any_order(tiny_pair):
    """The persistent cache and buffers are built as normal tensors whichever mode the first call runs in, so every
    later call, in either mode, can update them in place; the parameters stay normal tensors (training still works)."""
    ours, stock = tiny_pair
    model_inputs = build(MIXED_BATCH)
    expected = stock.generate(**model_inputs, **GREEDY)
    ours._static_cache = None  # the next call builds the static path anew
    for inference in (True, False, True, False):
        with torch.inference_mode(inference):
            assert ours.generate(**model_inputs, **GREEDY).tolist() == expected.tolist()
    assert not any(parameter.is_inference() for parameter in ours.parameters())
    # A turn in inference mode, the next one outside it, on the returned cache.
    model_inputs = build(([[chat("Hi")], [chat("Describe a cat.")]], {}))
    with torch.inference_mode():
        first = ours.generate(**model_inputs, **GREEDY, return_dict_in_generate=True)
    sequences = torch.cat([first.sequences, first.sequences[:, -3:]], dim=1)
    mask = torch.cat([model_inputs["attention_mask"], torch.ones_like(sequences[:, model_inputs["input_ids"].shape[1]:])], 1)
    resumed = ours.generate(input_ids=sequences, attention_mask=mask, **GREEDY, **{CACHE_KWARG: returned_cache(first)})
    assert resumed.tolist() == stock.generate(input_ids=sequences, attention_mask=mask, **GREEDY).tolist()


class RecordFlags(LogitsProcessor):
    """Records torch's global TF32 / cuDNN-benchmark flags while generate runs (and forces the host loop)."""

    def __init__(self):
        self.seen = []

    def __call__(self, input_ids, scores):
        self.seen.append(global_flags())
        return scores


def global_flags():
    return (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark)


def test_tf32_and_cudnn_benchmark_apply_to_the_models_own_work_only(tiny_pair):
    ours, stock = tiny_pair
    before = global_flags()
    assert before == (False, torch.backends.cudnn.allow_tf32, False)  # torch's defaults for the two opt-ins
    model = Qwen3VLGraphForConditionalGeneration(tiny_config(allow_tf32=True, cudnn_benchmark=True)).eval()
    model.load_state_dict(ours.state_dict())
    assert global_flags() == before  # building the model changes nothing
    record = RecordFlags()
    model_inputs = build(MIXED_BATCH)
    got = model.generate(**model_inputs, **GREEDY, logits_processor=LogitsProcessorList([record]))
    assert got.tolist() == stock.generate(**model_inputs, **GREEDY).tolist()
    assert set(record.seen) == {(True, True, True)}
    assert global_flags() == before  # restored after the call
    model.warmup()
    assert global_flags() == before


def test_a_deep_copy_generates_as_the_model_and_owns_its_weights():
    """`copy.deepcopy` works as on stock models, before and after the engine exists: the copy generates stock's
    tokens, has a lock of its own and builds its own engine; changing its weights leaves the model's alone."""
    ours, stock = new_pair()
    inputs = build(MIXED_BATCH)
    expected = stock.generate(**inputs, **GREEDY)
    fresh = copy.deepcopy(ours)
    assert fresh.generate(**inputs, **GREEDY).tolist() == expected.tolist()
    assert ours._engine is None  # the copy's engine is its own
    assert ours.generate(**inputs, **GREEDY).tolist() == expected.tolist()
    copied = copy.deepcopy(ours)  # with the engine built
    assert copied._engine is None and copied._generate_lock is not ours._generate_lock
    assert copied.generate(**inputs, **GREEDY).tolist() == expected.tolist()
    assert copied._engine is not ours._engine
    with torch.no_grad():
        for parameter in copied.parameters():
            parameter.zero_()
    assert ours.generate(**inputs, **GREEDY).tolist() == expected.tolist()
