"""EAGLE-3 drafts: the published checkpoint format read and checked against the target, and the reference speculative
greedy loop, whose output equals stock greedy `generate` token for token whatever the draft proposes (CPU, fp32)."""

import hashlib
import json

import pytest
import torch
from safetensors.torch import save_file

from conftest import chat, image, new_pair
from qwen3vl_static.draft_qwen3vl_graph import DraftSpec, speculative_greedy
from qwen3vl_static.ops_qwen3vl_graph import TorchOps
from qwen3vl_static.presets import TINY_VOCAB, real_config, tiny_inputs
from qwen3vl_static.workloads import eagle3_matrix_shapes

# AngelSlim's training config of the Qwen3-VL-2B-Instruct draft, as published
# (Tencent/AngelSlim: angelslim/compressor/speculative/train/configs/qwen3-vl-2b-eagle3-mrope.json).
ANGELSLIM_2B = {
    "architectures": ["Eagle3LlamaForCausalLM"], "model_type": "llama", "target_model_type": "qwen3_vl",
    "dtype": "bfloat16", "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
    "intermediate_size": 6144, "max_position_embeddings": 262144, "num_attention_heads": 16, "num_hidden_layers": 1,
    "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
    "rope_scaling": {"type": "default", "rope_type": "default", "mrope_interleaved": True,
                     "mrope_section": [24, 20, 20]},
    "rope_theta": 5000000, "use_cache": True, "vocab_size": 151936, "tie_word_embeddings": True,
    "transformers_version": "4.57.1", "image_token_id": 151655, "video_token_id": 151656,
    "vision_end_token_id": 151653, "vision_start_token_id": 151652, "draft_vocab_size": 32000, "modal_type": "VLM",
}

# SpecForge's training config of a Qwen3-VL-8B-Instruct draft, as published (sgl-project/SpecForge:
# configs/qwen3-vl-8b-eagle3.json).
SPECFORGE_8B = {
    "architectures": ["LlamaForCausalLMEagle3"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096,
    "initializer_range": 0.02, "intermediate_size": 12288, "max_position_embeddings": 262144, "model_type": "llama",
    "target_model_type": "qwen3_vl", "num_attention_heads": 32, "num_hidden_layers": 1, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06, "pretraining_tp": 1,
    "rope_scaling": {"rope_type": "default", "mrope_section": [24, 20, 20], "mrope_interleaved": True},
    "rope_theta": 5000000, "tie_word_embeddings": False, "dtype": "bfloat16", "transformers_version": "4.57.1",
    "use_cache": True, "use_sliding_window": False, "vocab_size": 151936, "draft_vocab_size": 32000,
}

# The same format at the tiny target's sizes (presets.tiny_config_dict: hidden 64, head_dim 16, M-RoPE [4, 2, 2]).
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE, DRAFT_VOCAB = 64, 4, 2, 16, 96, 100


def tiny_draft_config(**changes):
    config = {
        **ANGELSLIM_2B, "head_dim": HEAD_DIM, "hidden_size": HIDDEN, "intermediate_size": INTERMEDIATE,
        "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "vocab_size": TINY_VOCAB,
        "draft_vocab_size": DRAFT_VOCAB, "rope_theta": 10000,
        "rope_scaling": {"type": "default", "rope_type": "default", "mrope_interleaved": True,
                         "mrope_section": [4, 2, 2]},
        # The tiny target has 3 layers: the default ids (1, L // 2 - 1, L - 4) need 4 or more.
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 2]},
    }
    return {**config, **changes}


def tiny_draft_tensors(seed=0, embed=True):
    """Random tensors under the published names and shapes, in bfloat16 as published; norms at 1."""
    generator = torch.Generator().manual_seed(seed)
    shapes = {**eagle3_matrix_shapes(tiny_draft_config()),
              **({"embed_tokens.weight": (TINY_VOCAB, HIDDEN)} if embed else {})}
    tensors = {name: (0.2 * torch.randn(shape, generator=generator)).bfloat16() for name, shape in shapes.items()}
    for name in ("midlayer.hidden_norm", "midlayer.input_layernorm", "midlayer.post_attention_layernorm", "norm"):
        tensors[f"{name}.weight"] = torch.ones(HIDDEN, dtype=torch.bfloat16)
    used = torch.randperm(TINY_VOCAB, generator=generator)[:DRAFT_VOCAB].sort().values
    tensors["d2t"] = used - torch.arange(DRAFT_VOCAB)  # draft id + d2t[draft id] = target id
    tensors["t2d"] = torch.zeros(TINY_VOCAB, dtype=torch.bool)
    tensors["t2d"][used] = True
    return tensors


def save_draft(folder, config=None, tensors=None):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config or tiny_draft_config()))
    save_file(tensors if tensors is not None else tiny_draft_tensors(), str(folder / "model.safetensors"))
    return folder


@pytest.fixture(scope="module")
def pair():
    return new_pair()


PROMPTS = {
    "text": ([[chat("Describe a cat in one line.")]], {}),
    "image": ([[chat("image", "What is in the picture?")]], {"images": [image(64, 96)]}),
    "video": ([[chat("video", "What happens?")]], {"video_grids": [(2, 4, 6)]}),
}


class Oracle:
    """A draft stub that proposes the target's own greedy continuation, wrong at index `miss` of each chain; it
    checks the shapes the loop hands a draft."""

    layer_ids = (0, 1, 2)

    def __init__(self, expected, miss=None):
        self.expected, self.miss = expected[0].tolist(), miss

    def prepare(self, ops, slots, rotary_emb, rotary_components=None):
        pass

    def propose(self, start, tokens, features, positions, count):
        n = tokens.shape[1]
        assert features.shape == (1, n, 3 * HIDDEN) and positions.shape == (3, 1, n)
        known = start + n + 1  # tokens the sequence holds: the slots up to `start + n`
        proposals = (self.expected[known:known + count] + [0] * count)[:count]  # past a stop: anything
        if self.miss is not None:
            proposals[self.miss] = (proposals[self.miss] + 1) % TINY_VOCAB
        return torch.tensor([proposals])


def test_published_configs_fit_their_targets_only():
    spec = DraftSpec.from_config(ANGELSLIM_2B, real_config("2b"))
    assert spec.layer_ids == (1, 13, 24)  # the 2B's 28 layers
    assert (spec.hidden_size, spec.target_hidden_size, spec.draft_vocab_size) == (2048, 2048, 32000)
    assert spec.mrope and spec.rope_theta == 5e6  # the target's interleaved M-RoPE
    with pytest.raises(ValueError, match="reads hidden states 2048 wide"):
        DraftSpec.from_config(ANGELSLIM_2B, real_config("4b"))
    assert DraftSpec.from_config(SPECFORGE_8B, real_config("8b")).layer_ids == (1, 17, 32)  # the 8B's 36 layers
    with pytest.raises(ValueError, match="reads hidden states 4096 wide"):
        DraftSpec.from_config(SPECFORGE_8B, real_config("2b"))


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    return save_draft(tmp_path_factory.mktemp("drafts") / "random")


@pytest.fixture(scope="module")
def shared_draft_dir(tmp_path_factory):
    """Without embed_tokens, as AngelSlim saves its drafts."""
    return save_draft(tmp_path_factory.mktemp("drafts") / "shared", tensors=tiny_draft_tensors(embed=False))


def test_load_draft_reads_the_published_format(pair, draft_dir):
    ours, stock = pair
    draft = ours.load_draft(draft_dir)
    assert ours._draft is draft and draft.layer_ids == (0, 1, 2)
    saved = tiny_draft_tensors()
    own = draft.state_dict()
    assert set(own) == set(saved)
    for name, tensor in saved.items():  # on the target's device, in its dtype (float32 here)
        assert own[name].dtype == (tensor.dtype if name in ("d2t", "t2d") else torch.float32)
        assert torch.equal(own[name], tensor.to(own[name].dtype)), name
    assert ours.state_dict().keys() == stock.state_dict().keys()  # not in the module tree: the stock layout


def test_load_draft_shares_the_targets_embedding_when_it_has_none(pair, shared_draft_dir):
    ours, _ = pair
    draft = ours.load_draft(shared_draft_dir)
    assert draft.embed_tokens is ours.get_input_embeddings()  # shared, not copied


def test_load_draft_by_hub_repo_id(pair, draft_dir, tmp_path):
    """A repo id resolves through transformers' hub utilities (here from an offline Hub cache, as downloaded)."""
    ours, _ = pair
    repo = tmp_path / "models--org--tiny-draft"
    commit = hashlib.sha1(b"org/tiny-draft").hexdigest()
    save_draft(repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    draft = ours.load_draft("org/tiny-draft", cache_dir=str(tmp_path), local_files_only=True)
    assert torch.equal(draft.d2t, tiny_draft_tensors()["d2t"])


def _without(name):
    tensors = tiny_draft_tensors()
    del tensors[name]
    return tensors


def _reshaped_head():
    tensors = tiny_draft_tensors()
    tensors["lm_head.weight"] = tensors["lm_head.weight"][:-1]
    return tensors


def _maps_disagree():
    tensors = tiny_draft_tensors()
    tensors["t2d"] = tensors["t2d"].roll(1)
    return tensors


@pytest.mark.parametrize("config, tensors, message", [
    ({"architectures": ["LlamaForCausalLM"]}, None, r"names architectures \['LlamaForCausalLM'\]"),
    ({"target_model_type": "qwen2_5_vl"}, None, "target_model_type is 'qwen2_5_vl'"),
    ({"target_hidden_size": 128}, None, "reads hidden states 128 wide"),
    ({"vocab_size": 151936}, None, "vocabulary has 151936 tokens"),
    ({"num_hidden_layers": 2}, None, "has 2 decoder layers"),
    ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 3]}}, None, r"layers \[0, 1, 3\]"),
    ({"rope_scaling": {"rope_type": "default", "mrope_section": [4, 2, 4]}}, None, "mrope_section"),
    ({"rope_theta": 500}, None, r"RoPE \(default, theta 500, head_dim 16\) is not the target's"),
    ({"hidden_act": "gelu"}, None, "runs SwiGLU"),
    ({}, _without("fc.weight"), r"missing \['fc.weight'\]"),
    ({}, _without("t2d"), r"missing \['t2d'\]"),
    ({}, _reshaped_head(), r"lm_head.weight \(99, 64\) \(expected \(100, 64\)\)"),
    ({}, _maps_disagree(), "d2t and t2d do not describe one draft vocabulary"),
], ids=["architecture", "target-type", "hidden", "vocabulary", "layers", "layer-ids", "rope", "theta", "act", "missing",
        "maps", "shape", "maps-disagree"])
def test_load_draft_refuses_what_does_not_fit(pair, draft_dir, tmp_path, config, tensors, message):
    ours, _ = pair
    before = ours.load_draft(draft_dir)
    folder = save_draft(tmp_path / "bad", tiny_draft_config(**config), tensors)
    with pytest.raises(ValueError, match=message):
        ours.load_draft(folder)
    assert ours._draft is before  # nothing attached


def test_draft_layer_is_the_published_llama_layer(pair, draft_dir):
    """The draft's layer on the op set equals EAGLE-3's Llama layer written out in plain torch (vLLM's and SpecForge's
    `LlamaDecoderLayer` with a 2 * hidden wide attention input): q/k/v of [norm(embedding), norm(hidden)], the target's
    M-RoPE (rotate_half), causal grouped-query attention, the residual from the hidden state, SwiGLU, the final norm."""
    ours, _ = pair
    draft = ours.load_draft(draft_dir).float()
    rotary_emb = ours.model.language_model.rotary_emb
    draft.prepare(TorchOps(), 16, rotary_emb)
    generator = torch.Generator().manual_seed(3)
    n = 7
    tokens = torch.randint(0, TINY_VOCAB, (n,), generator=generator)
    hidden = torch.randn(n, HIDDEN, generator=generator)
    positions = torch.tensor([[0, 1, 2, 3, 3, 3, 7], [0, 1, 2, 3, 3, 4, 7], [0, 1, 2, 3, 4, 4, 7]])[:, :, None]
    got, normed = draft.layer(tokens, hidden, draft.rotary_tables(positions, torch.arange(n)), torch.arange(n), n)

    layer, eps = draft.midlayer, draft.spec.rms_norm_eps

    def norm(x, weight):
        return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)

    def heads(x, count):
        return x.view(n, count, HEAD_DIM).transpose(0, 1)

    def rope(x, cos, sin):
        first, second = x.chunk(2, dim=-1)
        return x * cos + torch.cat([-second, first], dim=-1) * sin

    wide = torch.cat([norm(draft.embed_tokens.weight[tokens], layer.input_layernorm.weight),
                      norm(hidden, layer.hidden_norm.weight)], dim=-1)
    cos, sin = rotary_emb(hidden, positions.transpose(1, 2))  # (1, n, D)
    attention = layer.self_attn
    q = rope(heads(wide @ attention.q_proj.weight.T, HEADS), cos, sin)
    k = rope(heads(wide @ attention.k_proj.weight.T, KV_HEADS), cos, sin).repeat_interleave(HEADS // KV_HEADS, 0)
    v = heads(wide @ attention.v_proj.weight.T, KV_HEADS).repeat_interleave(HEADS // KV_HEADS, 0)
    weights = (q @ k.transpose(1, 2) / HEAD_DIM**0.5).masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), -torch.inf)
    out = (weights.softmax(-1) @ v).transpose(0, 1).reshape(n, -1) @ attention.o_proj.weight.T
    expected = hidden + out
    mlp, x = layer.mlp, norm(expected, layer.post_attention_layernorm.weight)
    expected = expected + (torch.nn.functional.silu(x @ mlp.gate_proj.weight.T) * (x @ mlp.up_proj.weight.T)) @ mlp.down_proj.weight.T
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(normed, norm(expected, draft.norm.weight), atol=1e-4, rtol=1e-4)


def test_draft_cache_extends_and_replaces_its_chain(pair, draft_dir):
    """Proposing from slot `start` replaces what the draft held from there (the previous chain): extending a prefix
    proposes what one pass over the whole sequence does."""
    ours, _ = pair
    draft = ours.load_draft(draft_dir)
    draft.prepare(TorchOps(), 16, ours.model.language_model.rotary_emb)
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, TINY_VOCAB, (1, 9), generator=generator)
    features = torch.randn(1, 9, 3 * HIDDEN, generator=generator)
    positions = torch.arange(9).expand(3, 1, 9)
    whole = draft.propose(0, tokens, features, positions, 4)
    draft.propose(0, tokens[:, :6], features[:, :6], positions[..., :6], 4)  # its chain fills slots 6..8
    extended = draft.propose(6, tokens[:, 6:], features[:, 6:], positions[..., 6:], 4)
    assert extended.tolist() == whole.tolist()
    assert set(whole[0].tolist()) <= set((draft.d2t + torch.arange(DRAFT_VOCAB)).tolist())  # target ids


@pytest.mark.parametrize("prompt", PROMPTS)
def test_speculative_greedy_equals_stock_generate(pair, shared_draft_dir, prompt):
    """Token for token stock greedy output, with a random draft of the published format (few proposals kept), a
    draft always right (every proposal kept: K + 1 tokens per verify step) and ones wrong at their second or first
    proposal (exactly one or none kept per step): what the draft proposes changes only how many tokens a step keeps."""
    ours, stock = pair
    conversations, media = PROMPTS[prompt]
    inputs = tiny_inputs(conversations, **media)
    k, new = 3, 17  # 16 tokens after the prefill's: whole verify steps of 4 and of 2
    ours.load_draft(shared_draft_dir)
    sequences, stats = ours._speculative_greedy(max_new_tokens=new, num_draft_tokens=k, **inputs)
    assert sequences.tolist() == stock.generate(**inputs, do_sample=False, max_new_tokens=new).tolist()
    assert stats["rounds"] == len(stats["accepted"]) and all(0 <= kept <= k for kept in stats["accepted"])
    assert sum(stats["accepted"]) + stats["rounds"] >= sequences.shape[1] - inputs["input_ids"].shape[1] - 1
    print(f"{prompt}: random draft, mean accepted length {stats['mean_accepted_length']:.2f} at K = {k}")
    # Without EOS every verify step is whole, so the kept counts are exact.
    expected = stock.generate(**inputs, do_sample=False, max_new_tokens=new + k, eos_token_id=None)
    for miss, kept in ((None, k), (1, 1), (0, 0)):
        sequences, stats = speculative_greedy(ours, Oracle(expected, miss), max_new_tokens=new, num_draft_tokens=k,
                                              **inputs)
        assert sequences.tolist() == expected[:, :inputs["input_ids"].shape[1] + new].tolist()
        assert stats["accepted"] == [kept] * ((new - 1) // (kept + 1))
        assert stats["mean_accepted_length"] == kept + 1


def test_speculative_greedy_stops_at_eos_and_refuses_batches(pair, draft_dir):
    ours, stock = pair
    inputs = tiny_inputs(*PROMPTS["text"][:1])
    expected = stock.generate(**inputs, do_sample=False, max_new_tokens=12)
    eos = expected[0, inputs["input_ids"].shape[1] + 4].item()  # a token the output holds stops it there
    first = expected[0, inputs["input_ids"].shape[1]:].tolist().index(eos)
    sequences, _ = speculative_greedy(ours, Oracle(expected), max_new_tokens=12, num_draft_tokens=3, eos_token_id=eos,
                                      **inputs)
    assert sequences.tolist() == expected[:, :inputs["input_ids"].shape[1] + first + 1].tolist()
    batch = tiny_inputs([[chat("Hi")], [chat("Hello there")]])
    with pytest.raises(ValueError, match="a batch of 2"):
        speculative_greedy(ours, Oracle(expected), max_new_tokens=4, **batch)
    with pytest.raises(ValueError, match="unpadded"):
        speculative_greedy(ours, Oracle(expected), max_new_tokens=4, **{key: value[:1] for key, value in batch.items()})
