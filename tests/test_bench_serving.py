"""The --serving and --batching benchmarks' workloads on the CPU: the batched image prompt, the decoding modes (tiny
models), the answer lengths."""

import pytest
import torch
from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

import qwen3vl_static.modeling_qwen3vl_graph as modeling
from conftest import build, chat
from qwen3vl_static import Qwen3VLGraphForConditionalGeneration
from qwen3vl_static.bench import sampling_modes
from qwen3vl_static.bench_batching import answer_lengths
from qwen3vl_static.presets import real_config_dict, tiny_config, tiny_config_dict
from qwen3vl_static.workloads import image_prompt


def with_real_token_ids(config_dict):
    """The tiny model with the real vocabulary size and vision token ids, which `image_prompt` writes."""
    real = real_config_dict()
    config_dict["text_config"]["vocab_size"] = real["text_config"]["vocab_size"]
    for key in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"):
        config_dict[key] = real[key]
    return config_dict


def test_batched_image_prompt_generates_as_stock():
    """Rows of two images each: stock accepts the layout (placeholders, pixels and grids agree) and ours generates the
    same tokens from it."""
    torch.manual_seed(0)
    ours = Qwen3VLGraphForConditionalGeneration(tiny_config(**with_real_token_ids(tiny_config_dict()))).eval()
    stock = Qwen3VLForConditionalGeneration(Qwen3VLConfig(**with_real_token_ids(tiny_config_dict()))).eval()
    stock.load_state_dict(ours.state_dict())
    prompt = image_prompt(ours.config, "cpu", torch.Generator().manual_seed(0), sides=(64, 96), batch=3)
    assert prompt["image_grid_thw"].tolist() == [[1, 4, 4], [1, 6, 6]] * 3
    assert prompt["pixel_values"].shape[0] == 3 * (16 + 36)
    assert ((prompt["input_ids"] == ours.config.image_token_id).sum(1) == 4 + 9).all()
    kwargs = dict(max_new_tokens=6, do_sample=False)
    assert ours.generate(**prompt, **kwargs).tolist() == stock.generate(**prompt, **kwargs).tolist()
    assert ours._engine.decode.batch_size == 3  # the static loop ran the batch (not the stock fallback)


def test_single_row_image_prompt_is_one_row_of_the_batch_layout():
    config = tiny_config(**with_real_token_ids(tiny_config_dict()))
    single = image_prompt(config, "cpu", torch.Generator().manual_seed(1), sides=(64,))
    batch = image_prompt(config, "cpu", torch.Generator().manual_seed(1), sides=(64,), batch=2)
    for key, value in single.items():
        assert torch.equal(batch[key][: value.shape[0]], value), key


@pytest.mark.parametrize("mode", list(sampling_modes("2b")))
def test_serving_decoding_modes_run_on_the_device_loop(tiny_pair, monkeypatch, mode):
    """Each decoding mode of the benchmark takes the device loop with the sampler settings it names (top_k=0: no
    top-k) on the installed transformers, so its ms/step measures the in-graph sampler."""
    ours, _ = tiny_pair
    plans = []

    def recording_device_loop(runner, input_ids, logits, plan, *args):
        plans.append(plan)
        return device_loop(runner, input_ids, logits, plan, *args)

    def no_host_loop(*args):
        raise AssertionError("the host loop ran")

    device_loop = modeling.device_loop
    monkeypatch.setattr(modeling, "device_loop", recording_device_loop)
    monkeypatch.setattr(modeling, "host_loop", no_host_loop)
    kwargs = sampling_modes("2b")[mode]
    ours.generate(**build(([[chat("Hi there")]], {})), max_new_tokens=8, **kwargs)
    [plan] = plans
    if kwargs["do_sample"]:
        top_k = kwargs["top_k"] or None  # 0: no top-k warper
        mode = "sample" if top_k is None else "sample_top_k"  # Qwen's top-k, 20, is within the candidates
        assert (plan["mode"], plan["temperature"], plan["top_k"], plan["top_p"]) == (
            mode, kwargs["temperature"], top_k, kwargs["top_p"])
    else:
        assert plan["mode"] == "greedy"


def test_answer_lengths_are_seeded_geometric_and_clipped():
    lengths = answer_lengths(20000, torch.Generator().manual_seed(0))
    assert lengths == answer_lengths(20000, torch.Generator().manual_seed(0))
    assert min(lengths) == 1 and max(lengths) == 512
    # Geometric of mean 128, clipped at 512: the clipped mean is 128 * (1 - (1 - 1/128) ** 512) = 125.7.
    assert 123 < sum(lengths) / len(lengths) < 128.5
    assert abs(sum(length == 1 for length in lengths) / len(lengths) - 1 / 128) < 0.003
