"""Cache, patch embedding and config pieces on their own."""

import pytest
import torch
from transformers import Qwen3VLConfig
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionPatchEmbed

from conftest import build, chat, image
from qwen3vl_static import ASStaticCache, Qwen3VLGraphConfig
from qwen3vl_static import compat_qwen3vl_graph as compat
from qwen3vl_static.presets import real_config, tiny_config
from qwen3vl_static.runner_qwen3vl_graph import bucket_of
from qwen3vl_static.vision_qwen3vl_graph import Qwen3VLGraphPatchEmbed


@pytest.mark.parametrize("mode", ["gemm", "conv3d", "channels_last_3d"])
def test_patch_embed_modes_equal_stock_conv3d(mode):
    config = tiny_config().vision_config
    torch.manual_seed(0)
    stock = Qwen3VLVisionPatchEmbed(config)
    ours = Qwen3VLGraphPatchEmbed(config, mode=mode)
    ours.load_state_dict(stock.state_dict())  # strict: same parameter names and shapes
    pixels = torch.randn(24, 3 * 2 * 16 * 16)
    torch.testing.assert_close(ours(pixels), stock(pixels), rtol=1e-5, atol=1e-5)


def test_model_uses_configured_patch_embed():
    from qwen3vl_static import Qwen3VLGraphForConditionalGeneration

    model = Qwen3VLGraphForConditionalGeneration(tiny_config(patch_embed_mode="channels_last_3d"))
    assert isinstance(model.model.visual.patch_embed, Qwen3VLGraphPatchEmbed)
    assert model.model.visual.patch_embed.mode == "channels_last_3d"
    with pytest.raises(ValueError, match="patch_embed_mode"):  # from the config (5.x) or the model (4.57)
        Qwen3VLGraphForConditionalGeneration(tiny_config(patch_embed_mode="winograd"))


def test_cache_is_allocated_once_and_keeps_addresses(tiny_pair):
    ours, stock = tiny_pair
    cache = ours.static_cache()
    pointers = [keys.data_ptr() for keys in cache.full_keys]
    for rows in ([[chat("one")]], [[chat("image", "two")], [chat("rows")]]):
        media = {"images": [image(64, 64)]} if len(rows) == 2 else {}
        ours.generate(**build((rows, media)), max_new_tokens=3, do_sample=False)
        assert ours.static_cache() is cache
        assert [keys.data_ptr() for keys in cache.full_keys] == pointers
        model_inputs = build((rows, media))
        needed = model_inputs["input_ids"].shape[1] + 3 - 1
        assert cache.layers[0].keys.shape[:3] == (len(rows), 2, needed)  # the request's rows and slots, as views
        assert cache.layers[0].keys.data_ptr() == pointers[0]
    assert isinstance(cache, ASStaticCache) and cache.full_keys[0].shape[:3] == (4, 2, 160)


def test_cache_length_after_generate_matches_written_slots(tiny_pair):
    ours, _ = tiny_pair
    model_inputs = build(([[chat("count me")]], {}))
    out = ours.generate(**model_inputs, max_new_tokens=6, do_sample=False)
    assert int(ours.static_cache().get_seq_length()) == out.shape[1] - 1


def test_buckets_derive_from_limits():
    config = Qwen3VLGraphConfig(max_batch_size=6, static_cache_len=1000)
    assert config.batch_buckets() == [1, 2, 4, 6]
    assert config.cache_buckets() == [256, 512, 1000]
    config.static_cache_len = 300  # as from_pretrained(..., static_cache_len=300) sets it
    assert config.cache_buckets() == [256, 300]
    with pytest.raises(ValueError, match="graph_batch_sizes"):
        Qwen3VLGraphConfig(max_batch_size=2, graph_batch_sizes=[1, 4]).batch_buckets()


def test_prompt_buckets_pad_long_prompts_by_at_most_a_quarter():
    buckets = Qwen3VLGraphConfig(prefill_graph_tokens=2048).prompt_buckets()
    assert buckets[:6] == [16, 32, 64, 128, 256, 320] and buckets[-1] == 2048
    for length in range(257, 2049):
        assert bucket_of(buckets, length) <= 1.25 * length
    assert Qwen3VLGraphConfig(prefill_graph_tokens=300).prompt_buckets() == [16, 32, 64, 128, 256, 300]
    assert Qwen3VLGraphConfig(prefill_graph_tokens=0).prompt_buckets() == []


def test_real_2b_architecture_ships_with_the_package():
    config = real_config("2b")
    assert config.model_type == "qwen3_vl_graph"
    assert (config.text_config.num_hidden_layers, config.text_config.hidden_size) == (28, 2048)
    assert config.vision_config.deepstack_visual_indexes == [5, 11, 17]


def test_fused_projections_keep_one_copy_and_the_stock_checkpoint(tiny_pair, tmp_path):
    from transformers import Qwen3VLForConditionalGeneration

    ours, stock = tiny_pair
    ours.static_cache()
    attn, mlp = ours.model.language_model.layers[0].self_attn, ours.model.language_model.layers[0].mlp
    storage = attn.q_proj.weight.untyped_storage().data_ptr()
    assert storage == attn.k_proj.weight.untyped_storage().data_ptr() == attn.v_proj.weight.untyped_storage().data_ptr()
    assert mlp.gate_proj.weight.untyped_storage().data_ptr() == mlp.up_proj.weight.untyped_storage().data_ptr()
    for name, tensor in stock.state_dict().items():
        assert torch.equal(ours.state_dict()[name], tensor), name
    ours.save_pretrained(tmp_path)
    assert attn.q_proj.weight.untyped_storage().data_ptr() == storage  # fused again after saving
    reloaded, info = Qwen3VLForConditionalGeneration.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert torch.equal(reloaded.model.language_model.layers[0].self_attn.k_proj.weight, attn.k_proj.weight)


def test_replaced_weights_rebuild_the_engine(tiny_pair):
    ours, _ = tiny_pair
    engine = ours.graph_engine()
    layer = ours.model.language_model.layers[1]
    original = layer.mlp.up_proj.weight.data
    layer.mlp.up_proj.weight.data = original.clone()  # what .to() or a re-assignment does
    try:
        ours.static_cache()
        assert ours.graph_engine() is not engine and ours.graph_engine().current(ours)
    finally:
        ours.static_cache()


def test_warmup_rejects_bad_sizes_and_modes(tiny_pair):
    ours, _ = tiny_pair
    assert ours.warmup() == 0.0  # no graphs on the CPU
    with pytest.raises(ValueError, match="static_cache_len=160"):
        ours.warmup(cache_lengths=[161])
    with pytest.raises(ValueError, match="max_batch_size=4"):
        ours.warmup(batch_sizes=[5])
    with pytest.raises(ValueError, match="modes"):
        ours.warmup(modes=("beam",))
    assert ours.warmup(prompt_lengths=[50], image_patches=[784]) == 0.0


def test_set_cuda_graphs_never_turns_graphs_on_where_they_cannot_run(tiny_pair):
    ours, _ = tiny_pair
    ours.set_cuda_graphs(True)
    assert not any(runner.use_graphs for runner in ours._engine.runners)  # the CPU: no CUDA graphs, and no padded buckets
    assert not ours._engine.prefill.bucketed and ours._engine.vision.limit is None  # no chunks: one call per size


def vision_features(model, pixels, grid):
    """Merged and DeepStack features of the vision tower (a ModelOutput on 5.x, a tuple on 4.57)."""
    merged, deepstack = compat.vision_features(model.model.visual(pixels, grid_thw=grid))
    return [merged, *deepstack]


def test_vision_tower_matches_stock_with_one_attention_call_per_block_and_size(tiny_pair, monkeypatch):
    """Images of two sizes: one batched SDPA call per block for each size; a video's frames: one per block."""
    ours, stock = tiny_pair
    model_inputs = build(([[chat("image", "image", "image", "video", "four")]],
                          {"images": [image(64, 64), image(96, 64), image(64, 64)], "video_grids": [(2, 4, 4)]}))
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", lambda *a, **k: calls.append(1) or sdpa(*a, **k))
    with torch.no_grad():
        for pixels, grid, sizes in (("pixel_values", "image_grid_thw", 2), ("pixel_values_videos", "video_grid_thw", 1)):
            calls.clear()
            got = vision_features(ours, model_inputs[pixels], model_inputs[grid])
            assert len(calls) == sizes * len(ours.model.visual.blocks)
            expected = vision_features(stock, model_inputs[pixels], model_inputs[grid])
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not hasattr(Qwen3VLConfig, "_get_generation_parameters"), reason="transformers 4.57 checks otherwise")
def test_generation_settings_in_the_model_config_are_still_found():
    """Our faster `_get_generation_parameters` finds what stock's finds: nothing by default, a stray setting when set."""
    config = tiny_config()
    assert config._get_generation_parameters() == {}
    config.temperature = 0.3
    assert config._get_generation_parameters() == {"temperature": 0.3}
