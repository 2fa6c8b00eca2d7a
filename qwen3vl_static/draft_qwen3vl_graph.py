# Copyright 2026 The qwen3vl-static Authors. All rights reserved.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
"""EAGLE-3 draft heads for a Qwen3-VL target: the published checkpoint format, its checks against the target, and
the reference speculative greedy loop (batch 1, eager torch) that the in-graph loop must equal.

The format (docs/design.md, "Speculative decoding: the EAGLE-3 draft format"), as AngelSlim and SpecForge train it
and vLLM / SGLang load it: `config.json` of a one-layer Llama (architecture `Eagle3LlamaForCausalLM` or
`LlamaForCausalLMEagle3`) with `draft_vocab_size`, optional `target_hidden_size`, `target_model_type` and
`eagle_config.eagle_aux_hidden_state_layer_ids`, M-RoPE in `rope_scaling` where it has an `mrope_section`; and
`model.safetensors` with `fc.weight` (3 target hidden states -> hidden), `midlayer.*` (one decoder layer whose q/k/v
read the normed embedding and the normed hidden state side by side, 2 * hidden wide), `norm.weight`, `lm_head.weight`
(over the draft vocabulary), `d2t` (draft id -> target id offset) and `t2d` (which target ids the draft has), and
`embed_tokens.weight` unless the target's embedding is shared.
"""

import json
from dataclasses import dataclass

import torch
from torch import nn
from transformers.cache_utils import DynamicCache
from transformers.modeling_utils import load_state_dict
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.utils import cached_file

from .compat_qwen3vl_graph import CACHE_KWARG, generate_position_ids, prompt_positions
from .decoder_qwen3vl_graph import fuse_weights
from .ops_qwen3vl_graph import TorchOps

# AngelSlim and vLLM name the draft class the first way, SpecForge and SGLang the second.
ARCHITECTURES = ("Eagle3LlamaForCausalLM", "LlamaForCausalLMEagle3")
TARGET_MODEL_TYPES = ("qwen3_vl",)  # `target_model_type`, where the draft's config names one
_REQUIRED = ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size", "rms_norm_eps")


def default_layer_ids(num_layers: int) -> tuple[int, int, int]:
    """The target layers whose outputs the draft reads when its config names none (AngelSlim's and SpecForge's
    training default; vLLM's `(2, L // 2, L - 3)` counts the same states as inputs of the next layer)."""
    return 1, num_layers // 2 - 1, num_layers - 4


def table_rows(rotary, rows):
    """Rows `rows` (a slice) of rotary tables `rotary` (a tuple of `(n, D)` tables): views."""
    return tuple(table[rows] for table in rotary)


@dataclass(frozen=True)
class DraftSpec:
    """The sizes and settings of a draft, from its `config.json`, checked against the target's text config."""

    hidden_size: int
    target_hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    draft_vocab_size: int
    layer_ids: tuple[int, ...]
    rms_norm_eps: float
    rope_theta: float
    mrope: bool  # the target's M-RoPE over its T/H/W positions; else 1-D RoPE over cache slots

    @classmethod
    def from_config(cls, config: dict, target_config) -> "DraftSpec":
        """Raise a ValueError naming what differs when `config` is not an EAGLE-3 draft for this target."""
        architectures = config.get("architectures") or []
        if not set(architectures) & set(ARCHITECTURES):
            raise ValueError(f"The draft's config.json names architectures {architectures}; an EAGLE-3 draft names "
                             f"one of {list(ARCHITECTURES)}.")
        missing = [key for key in _REQUIRED if key not in config]
        if missing:
            raise ValueError(f"The draft's config.json has no {', '.join(missing)}.")
        text = target_config.get_text_config(decoder=True)
        target = (f"the target's text model (hidden size {text.hidden_size}, vocabulary {text.vocab_size}, "
                  f"{text.num_hidden_layers} layers)")

        def refuse(what):
            raise ValueError(f"This EAGLE-3 draft is not for {target}: {what}.")

        if config.get("num_hidden_layers", 1) != 1:
            refuse(f"it has {config['num_hidden_layers']} decoder layers; the format has one")
        if config.get("target_model_type", TARGET_MODEL_TYPES[0]) not in TARGET_MODEL_TYPES:
            refuse(f"its target_model_type is {config['target_model_type']!r}")
        target_hidden = config.get("target_hidden_size", config["hidden_size"])
        if target_hidden != text.hidden_size:
            refuse(f"it reads hidden states {target_hidden} wide")
        if config["vocab_size"] != text.vocab_size:
            refuse(f"its vocabulary has {config['vocab_size']} tokens")
        draft_vocab = config.get("draft_vocab_size") or config["vocab_size"]
        if not 0 < draft_vocab <= config["vocab_size"]:
            refuse(f"its draft_vocab_size {draft_vocab} is not within its vocabulary of {config['vocab_size']}")
        layer_ids = tuple((config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
                          or default_layer_ids(text.num_hidden_layers))
        if len(layer_ids) != 3 or not all(0 <= index < text.num_hidden_layers for index in layer_ids):
            refuse(f"it reads the hidden states of layers {list(layer_ids)}: three of 0..{text.num_hidden_layers - 1}")
        if config.get("hidden_act", "silu") != "silu":
            refuse(f"its hidden_act is {config['hidden_act']!r}; the draft layer runs SwiGLU (silu)")
        if config.get("attention_bias"):
            refuse("its attention projections have biases; the published drafts' have none")
        heads = config["num_attention_heads"]
        head_dim = config.get("head_dim") or config["hidden_size"] // heads
        rope = config.get("rope_scaling") or config.get("rope_parameters") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        theta = float(config.get("rope_theta", rope.get("rope_theta", 10000.0)))
        # The draft's rotary tables are the target's own (its module and kernel): the same frequencies, and the same
        # M-RoPE layout where the draft has M-RoPE.
        target_rope = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}
        target_theta = float(target_rope.get("rope_theta", getattr(text, "rope_theta", 10000.0)))
        section = rope.get("mrope_section")
        if rope_type not in ("default", "mrope") or theta != target_theta or head_dim != text.head_dim:
            refuse(f"its RoPE ({rope_type}, theta {theta:g}, head_dim {head_dim}) is not the target's (theta "
                   f"{target_theta:g}, head_dim {text.head_dim})")
        if section and (list(section) != list(target_rope.get("mrope_section") or [])
                        or bool(rope.get("mrope_interleaved")) != bool(target_rope.get("mrope_interleaved"))):
            refuse(f"its mrope_section {section} (interleaved: {bool(rope.get('mrope_interleaved'))}) is not the "
                   f"target's {target_rope.get('mrope_section')}")
        return cls(
            hidden_size=config["hidden_size"], target_hidden_size=target_hidden,
            intermediate_size=config["intermediate_size"], num_heads=heads,
            num_kv_heads=config.get("num_key_value_heads") or heads, head_dim=head_dim,
            vocab_size=config["vocab_size"], draft_vocab_size=draft_vocab, layer_ids=layer_ids,
            rms_norm_eps=config["rms_norm_eps"], rope_theta=theta, mrope=bool(section),
        )


class Eagle3Attention(nn.Module):
    """The draft layer's attention projections (read the 2 * hidden wide input), under their published names."""

    def __init__(self, spec: DraftSpec):
        super().__init__()
        wide = 2 * spec.hidden_size
        self.q_proj = nn.Linear(wide, spec.num_heads * spec.head_dim, bias=False)
        self.k_proj = nn.Linear(wide, spec.num_kv_heads * spec.head_dim, bias=False)
        self.v_proj = nn.Linear(wide, spec.num_kv_heads * spec.head_dim, bias=False)
        self.o_proj = nn.Linear(spec.num_heads * spec.head_dim, spec.hidden_size, bias=False)


class Eagle3MLP(nn.Module):
    def __init__(self, spec: DraftSpec):
        super().__init__()
        self.gate_proj = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=False)
        self.up_proj = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=False)
        self.down_proj = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=False)


class Eagle3Layer(nn.Module):
    """The draft's one decoder layer (`midlayer`): attention over [norm(embedding), norm(hidden)], the residual being
    the hidden state before its norm; then the usual MLP block."""

    def __init__(self, spec: DraftSpec):
        super().__init__()
        self.self_attn = Eagle3Attention(spec)
        self.mlp = Eagle3MLP(spec)
        self.hidden_norm = LlamaRMSNorm(spec.hidden_size, eps=spec.rms_norm_eps)
        self.input_layernorm = LlamaRMSNorm(spec.hidden_size, eps=spec.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(spec.hidden_size, eps=spec.rms_norm_eps)


class Eagle3Draft(nn.Module):
    """An EAGLE-3 draft head with the published tensor names. `embed_tokens`: the target's embedding when the
    checkpoint has none of its own (shared, not copied).

    Its steps run on an op set (`prepare`: the engine's fused kernels on a GPU, the torch references elsewhere), on one
    sequence's cache slots given as tensors, with no host read, so the speculative loop runs them inside its CUDA
    graph: `extend` takes the target's features of new slots, `chain` proposes from the last. The layer is the
    target's decode step in miniature: its attention is the decode attention over the draft's own K/V cache, its
    rotary tables the target's (the draft's RoPE must be the target's)."""

    def __init__(self, spec: DraftSpec, embed_tokens: nn.Module | None = None):
        super().__init__()
        self.spec = spec
        self.layer_ids = spec.layer_ids
        self.fc = nn.Linear(3 * spec.target_hidden_size, spec.hidden_size, bias=False)
        self.midlayer = Eagle3Layer(spec)
        self.norm = LlamaRMSNorm(spec.hidden_size, eps=spec.rms_norm_eps)
        self.lm_head = nn.Linear(spec.hidden_size, spec.draft_vocab_size, bias=False)
        self.shares_embedding = embed_tokens is not None
        self.embed_tokens = embed_tokens if self.shares_embedding else nn.Embedding(spec.vocab_size, spec.hidden_size)
        # A draft whose vocabulary is the target's may leave the maps out (SpecForge does): the identity.
        self.register_buffer("d2t", torch.zeros(spec.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(spec.vocab_size, dtype=torch.bool))
        self.ops = self.rotary_emb = self.rotary_components = None  # `prepare`'s
        self.qkv = self.gate_up = self.keys = self.values = None
        # The target cache's record of the tokens whose slots this draft's K/V holds (set by the speculative loop after
        # a turn; a later turn passing that cache back continues from them), or None.
        self.conversation = None

    def prepare(self, ops, slots: int, rotary_emb, rotary_components=None) -> None:
        """Run the steps with `ops` (an op set of ops_qwen3vl_graph.py) over a K/V cache of at least `slots` slots
        (what it holds is kept), with the target's text rotary embedding `rotary_emb` (`rotary_components`: what the
        op set's `decode_rotary` reads off it). The q/k/v and gate/up projections are fused once, as the target's are
        (the parameters become views of the fused matrices)."""
        attention, mlp = self.midlayer.self_attn, self.midlayer.mlp
        if self.qkv is None:
            self.qkv = fuse_weights([attention.q_proj, attention.k_proj, attention.v_proj])
            self.gate_up = fuse_weights([mlp.gate_proj, mlp.up_proj])
        self.ops, self.rotary_emb, self.rotary_components = ops, rotary_emb, rotary_components
        spec, weight = self.spec, self.fc.weight
        if self.keys is None or self.keys.shape[2] < slots:
            grown = [torch.zeros(1, spec.num_kv_heads, slots, spec.head_dim, dtype=weight.dtype, device=weight.device)
                     for _ in range(2)]
            if self.keys is not None:
                for new, old in zip(grown, (self.keys, self.values)):
                    new[:, :, : old.shape[2]] = old
            self.keys, self.values = grown
            # Per query row: every slot attendable up to its own (the attention bounds each row by its slot), all
            # on the cache's one row. Rows for a cycle's queries; a prompt's take more (`layer`).
            self.attendable = torch.ones(16, slots, dtype=torch.bool, device=weight.device)
            self.cache_rows = torch.zeros(16, dtype=torch.long, device=weight.device)

    def rotary_tables(self, positions, slots):
        """The rotary tables of the draft's slots `slots` `(n,)` at M-RoPE `positions` `(3, n, 1)`, as the op set's
        `decode_rotary` returns them (one row per slot: a cycle computes all its slots' in one launch, each step takes
        its rows)."""
        n = slots.shape[0]
        if not self.spec.mrope:  # 1-D RoPE: by cache slot
            positions = slots.view(1, n, 1).expand(3, n, 1)
        like = self.fc.weight.new_empty(n, 0)  # the tables' rows, dtype and device
        return self.ops.decode_rotary(self.rotary_emb, like, positions, self.rotary_components)

    def layer(self, tokens, hidden, rotary, slots, kv_len: int):
        """The decoder layer at cache slots `slots` `(n,)` with their `rotary_tables` `rotary`: `hidden` `(n, hidden)`
        with `tokens` `(n,)`, the token at each next slot. Returns the new hidden states and their final norm."""
        ops, spec, layer = self.ops, self.spec, self.midlayer
        n, eps = tokens.shape[0], spec.rms_norm_eps
        # [norm(embedding), norm(hidden)], each norm written into its half
        wide = hidden.new_empty(n, 2 * spec.hidden_size)
        ops.embed_rms_norm(tokens, self.embed_tokens.weight, layer.input_layernorm.weight, eps,
                           out=wide[:, : spec.hidden_size])
        ops.rms_norm(hidden, layer.hidden_norm.weight, eps, out=wide[:, spec.hidden_size:])
        if n > self.attendable.shape[0]:  # a prompt's slots (eager, outside the graphs)
            self.attendable = torch.ones(n, self.keys.shape[2], dtype=torch.bool, device=hidden.device)
            self.cache_rows = torch.zeros(n, dtype=torch.long, device=hidden.device)
        context = ops.attention_context(self.attendable[:n], self.cache_rows[:n], slots, kv_len, hidden.dtype)
        out = ops.decode_attention(wide, self.qkv, spec.num_heads, (None, None, eps), rotary, self.keys, self.values,
                                   slots, context, kv_len, spec.head_dim**-0.5)
        hidden, x = ops.linear_add_rms_norm(out, layer.self_attn.o_proj.weight, None, hidden,
                                            layer.post_attention_layernorm.weight, eps)
        return ops.linear_add_rms_norm(ops.linear_swiglu(x, self.gate_up), layer.mlp.down_proj.weight, None, hidden,
                                       self.norm.weight, eps)

    def extend(self, tokens, features, rotary, slots, kv_len: int):
        """The layer over the target's `features` `(n, 3 * target hidden)` (its layers' outputs at `slots`,
        concatenated): the hidden states `(n, hidden)` to propose from and their final norm."""
        return self.layer(tokens, self.ops.linear(features.to(self.fc.weight.dtype), self.fc.weight), rotary, slots,
                          kv_len)

    def next_token(self, normed, out):
        """The target ids the draft's head picks after final-normed hidden states `normed` `(n, hidden)`, written to
        `out` `(n,)`."""
        return self.ops.argmax(self.ops.linear(normed, self.lm_head.weight), self.d2t, out)

    def chain(self, hidden, normed, rotary, slots, kv_len: int, out):
        """Target ids proposed one after another from `hidden` `(1, hidden)` (`normed`: its final norm), written to
        `out` `(count,)`; the chain's own slots are `slots` `(count - 1,)` (`rotary`: their tables), each attending
        to the first `kv_len`."""
        for step in range(out.shape[0]):
            token = self.next_token(normed, out[step:step + 1])
            if step + 1 < out.shape[0]:
                rows = slice(step, step + 1)
                hidden, normed = self.layer(token, hidden, table_rows(rotary, rows), slots[rows], kv_len)
        return out

    def extend_and_chain(self, tokens, features, positions, slots, chain_position, count: int, kv_len: int):
        """Eagerly: the layer over the target's `features` `(n, 3 * hidden)` at `slots` `(n,)` (M-RoPE `positions`
        `(3, n, 1)`) with `tokens` `(n,)`, then a chain of `count` proposals `(count,)` from the last, its slots one
        apart after it from M-RoPE `chain_position` `(3, 1, 1)` on, all attending to the first `kv_len` slots."""
        n, steps = slots.shape[0], torch.arange(1, count, device=slots.device)
        all_slots = torch.cat([slots, slots[-1] + steps])
        rotary = self.rotary_tables(torch.cat([positions, chain_position + steps.view(1, -1, 1) - 1], dim=1), all_slots)
        hidden, normed = self.extend(tokens, features, table_rows(rotary, slice(0, n)), slots, kv_len)
        out = torch.empty(count, dtype=torch.long, device=slots.device)
        return self.chain(hidden[-1:], normed[-1:], table_rows(rotary, slice(n, None)), all_slots[n:], kv_len, out)

    @torch.no_grad()
    def propose(self, start: int, tokens, features, positions, count: int) -> torch.Tensor:
        """`count` target token ids `(1, count)` proposed as a chain (after `prepare`).

        The draft's slots `start`.. get the target's `features` `(1, n, 3 * hidden)` (its layers' outputs at those
        slots, concatenated) with `tokens` `(1, n)`, the token at each next slot; `positions` `(3, 1, n)` are the
        slots' M-RoPE positions, the chain's follow one apart. What the draft held from `start` on (the previous chain)
        is replaced."""
        n = tokens.shape[1]
        self.conversation = None  # its slots now hold this call's
        slots = torch.arange(start, start + n, device=tokens.device)
        positions = positions.transpose(1, 2)
        return self.extend_and_chain(tokens[0], features[0], positions, slots, positions[:, -1:] + 1, count,
                                     start + n + count - 1)[None]

    def load_checkpoint(self, state: dict) -> None:
        """Take the checkpoint's tensors (converted to this module's dtype and device); a ValueError names missing,
        unexpected or misshapen tensors and inconsistent vocabulary maps."""
        expected = {name: tensor for name, tensor in self.state_dict().items()
                    if not (self.shares_embedding and name.startswith("embed_tokens."))}
        maps = {"d2t", "t2d"}
        optional = maps if self.spec.draft_vocab_size == self.spec.vocab_size and not maps & state.keys() else set()
        missing = sorted(expected.keys() - state.keys() - optional)
        unexpected = sorted(state.keys() - expected.keys())
        misshapen = sorted(f"{name} {tuple(state[name].shape)} (expected {tuple(expected[name].shape)})"
                           for name in expected.keys() & state.keys() if state[name].shape != expected[name].shape)
        if missing or unexpected or misshapen:
            raise ValueError(f"The draft checkpoint's tensors do not match its config: missing {missing}, unexpected "
                             f"{unexpected}, misshapen {misshapen}.")
        if "d2t" in state:
            targets = state["d2t"].long() + torch.arange(self.spec.draft_vocab_size)
            t2d = state["t2d"].bool()
            inside = bool(((targets >= 0) & (targets < self.spec.vocab_size)).all())
            if not inside or not bool(t2d[targets].all()) or int(t2d.sum()) != self.spec.draft_vocab_size:
                raise ValueError("The draft's d2t and t2d do not describe one draft vocabulary within the target's.")
        with torch.no_grad():
            for name, tensor in expected.items():
                if name in state:
                    tensor.copy_(state[name])


def load_draft(path_or_repo_id, target, **hub_kwargs) -> Eagle3Draft:
    """The EAGLE-3 draft in folder or Hub repo `path_or_repo_id` (`config.json` and `model.safetensors`, fetched with
    transformers' hub utilities and `hub_kwargs`), checked against `target` (a Qwen3-VL model) and built on its device
    in its dtype. A ValueError names what differs."""
    with open(cached_file(path_or_repo_id, "config.json", **hub_kwargs), encoding="utf-8") as file:
        config = json.load(file)
    spec = DraftSpec.from_config(config, target.config)
    state = load_state_dict(cached_file(path_or_repo_id, "model.safetensors", **hub_kwargs))
    shared = None
    if "embed_tokens.weight" not in state:  # AngelSlim saves without it; its inference and vLLM use the target's
        shared = target.get_input_embeddings()
        if shared.weight.shape[1] != spec.hidden_size:
            raise ValueError(f"The draft has no embed_tokens of its own and its hidden size {spec.hidden_size} is not "
                             f"the target's embedding width {shared.weight.shape[1]}.")
    with torch.device(target.device):
        draft = Eagle3Draft(spec, shared).to(target.dtype)
    draft.load_checkpoint(state)
    return draft.eval()


@torch.no_grad()
def speculative_greedy(model, draft, input_ids, max_new_tokens: int, num_draft_tokens: int = 4, eos_token_id=None,
                       **model_inputs):
    """Greedy generation of one unpadded prompt with `draft` proposing `num_draft_tokens` tokens as a chain and the
    target checking them all in one forward: the longest prefix it agrees with is kept, plus its own next token, and
    its cache drops the rest. Plain torch on transformers' `DynamicCache`: the reference the in-graph loop must equal.

    `draft`: what `load_draft` returns, or anything with its `layer_ids`, `prepare` and `propose`. `model_inputs`: the
    processor's other outputs (pixels, grids, ...). Returns the sequences `(1, prompt + new)` and stats:
    `accepted` (proposals kept per verify step), `rounds` and `mean_accepted_length` (tokens per verify step)."""
    if input_ids.shape[0] != 1:
        raise ValueError(f"Speculative decoding takes one prompt; got a batch of {input_ids.shape[0]}.")
    attention_mask = model_inputs.pop("attention_mask", None)
    if attention_mask is not None and not bool(attention_mask.all()):
        raise ValueError("Speculative decoding takes an unpadded prompt; the attention mask has zeros.")
    eos = {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id or ())
    prompt_len, k = input_ids.shape[1], num_draft_tokens
    # M-RoPE positions of every slot the loop can write: the prompt's as generate computes them, then one apart.
    inputs = dict(model_inputs)
    position_ids = generate_position_ids(model, input_ids, inputs)
    if position_ids is not None:
        inputs["position_ids"] = position_ids
    positions = prompt_positions(model, input_ids, inputs)
    steps = torch.arange(1, max_new_tokens + k + 1, device=positions.device)
    positions = torch.cat([positions, positions[:, :, -1:] + steps], dim=2)
    layers = model.model.language_model.layers
    draft.prepare(TorchOps(), prompt_len + max_new_tokens + k, model.model.language_model.rotary_emb)
    cache = DynamicCache()

    def target(tokens, start, **media):
        """The target's greedy tokens after each of `tokens` (written to the cache from slot `start`) and the
        outputs of the draft's layers there, concatenated."""
        recorded = {}
        hooks = [layers[index].register_forward_hook(
            lambda module, args, output, index=index: recorded.__setitem__(
                index, output[0] if isinstance(output, tuple) else output))
            for index in set(draft.layer_ids)]
        n = tokens.shape[1]
        slots = torch.arange(start, start + n, device=positions.device).view(1, 1, n)
        try:
            out = model(input_ids=tokens, position_ids=torch.cat([slots, positions[:, :, start:start + n]]),
                        use_cache=True, **{CACHE_KWARG: cache}, **media)
        finally:
            for hook in hooks:
                hook.remove()
        return out.logits[0].argmax(dim=-1), torch.cat([recorded[index] for index in draft.layer_ids], dim=-1)

    predicted, features = target(input_ids, 0, **model_inputs)
    new, accepted_counts = [int(predicted[-1])], []
    start, tokens = 0, torch.cat([input_ids[0, 1:], predicted[-1:]])
    while new[-1] not in eos and len(new) < max_new_tokens:
        filled = prompt_len + len(new) - 1  # slots the target's cache holds: all but the newest token
        proposals = draft.propose(start, tokens[None], features, positions[:, :, start:filled], k)[0]
        predicted, features = target(torch.cat([tokens[-1:], proposals])[None], filled)
        accepted = int((proposals == predicted[:k]).long().cumprod(dim=0).sum())
        accepted_counts.append(accepted)
        if accepted < k:
            cache.crop(accepted - k)
        start, tokens, features = filled, torch.cat([proposals[:accepted], predicted[accepted:accepted + 1]]), \
            features[:, :accepted + 1]
        for token in tokens.tolist():
            new.append(token)
            if token in eos or len(new) == max_new_tokens:
                break
    rounds = len(accepted_counts)
    stats = {"accepted": accepted_counts, "rounds": rounds,
             "mean_accepted_length": (sum(accepted_counts) + rounds) / rounds if rounds else None}
    return torch.cat([input_ids, torch.tensor([new], device=input_ids.device)], dim=1), stats
