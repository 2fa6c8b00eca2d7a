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
"""Qwen3VLGraphForConditionalGeneration: the stock Qwen3-VL model with a static-cache decode loop.

Same module tree and forward as `Qwen3VLForConditionalGeneration` (stock checkpoints load unchanged and what
this class saves loads into the stock class). `generate()` keeps all of transformers' input preparation
(M-RoPE positions, multimodal inputs, logits processors, stopping criteria); this class only
- hands generate its one persistent `ASStaticCache` (`_prepare_cache_for_generation`), and
- owns prefill and the decode loop (`_sample`): its `GraphEngine` (engine_qwen3vl_graph.py) encodes the images and
  videos, writes the prompt into that cache and gives the first token's logits, then steps (loops_qwen3vl_graph.py).
A later turn may pass the returned cache back (`past_key_values=` / `cache=`, as with stock): when the new prompt
extends the tokens the cache holds, only its new tokens are prefilled. Anything the loop does not cover (beam
search, assisted decoding, attention/hidden-state outputs, a cache of another kind, ...) runs transformers' own
code path, and so does a model whose linear layers are quantized in a format the kernels do not take (plain and
fine-grained FP8 weights run on the fast path: fp8_qwen3vl_graph.py).
"""

import copy
import threading
from contextlib import contextmanager, nullcontext
from operator import is_

import torch
from transformers import GenerationMixin, PretrainedConfig
from transformers.generation.configuration_utils import GenerationMode
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLForConditionalGeneration, Qwen3VLModel
from transformers.utils import logging

from .batching_qwen3vl_graph import (
    DEFAULT_GPU_MEMORY_UTILIZATION,
    DEFAULT_MAX_PREFILL_TOKENS,
    GraphBatchingManager,
    cache_len_for,
    device_memory,
    kv_bytes_per_slot,
    media_bytes_per_token,
    slots_from_memory,
)
from .cache_qwen3vl_graph import ASStaticCache
from .compat_qwen3vl_graph import CACHE_KWARG, first_decode_positions, generate_output, media_features, prompt_positions
from .configuration_qwen3vl_graph import Qwen3VLGraphConfig
from .draft_qwen3vl_graph import Eagle3Draft, load_draft, speculative_greedy
from .engine_qwen3vl_graph import GraphEngine
from .fp8_qwen3vl_graph import fp8_at_load_config, quantizes_fp8_at_load, unsupported_weights
from .loops_qwen3vl_graph import device_loop, device_plan, host_loop
from .prefill_ahead_qwen3vl_graph import prefill_ahead
from .vision_qwen3vl_graph import Qwen3VLGraphPatchEmbed, Qwen3VLGraphVisionModel

# transformers 4.57 copies into its module cache only the files that the modeling file imports itself (later releases
# follow imports recursively), so this file names every other file of the custom code.
from .capture_qwen3vl_graph import GraphCapturer  # noqa: F401
from .decode_qwen3vl_graph import DecodeRunner  # noqa: F401
from .decoder_qwen3vl_graph import TextWeights  # noqa: F401
from .ops_accept_qwen3vl_graph import accept  # noqa: F401
from .ops_argmax_qwen3vl_graph import argmax  # noqa: F401
from .ops_attention_qwen3vl_graph import decode_attention  # noqa: F401
from .ops_fp8_matmul_qwen3vl_graph import fp8_matmul  # noqa: F401
from .ops_matmul_qwen3vl_graph import skinny_matmul  # noqa: F401
from .ops_norm_qwen3vl_graph import rms_norm  # noqa: F401
from .ops_qwen3vl_graph import make_ops  # noqa: F401
from .ops_rotary_qwen3vl_graph import qk_norm_rope_write  # noqa: F401
from .ops_sample_qwen3vl_graph import sample_tokens  # noqa: F401
from .ops_step_end_qwen3vl_graph import finish_step  # noqa: F401
from .prefill_qwen3vl_graph import PrefillRunner  # noqa: F401
from .runner_qwen3vl_graph import GraphRunner  # noqa: F401
from .scheduler_qwen3vl_graph import Scheduler  # noqa: F401
from .speculative_qwen3vl_graph import SpeculativeRunner  # noqa: F401
from .triton_qwen3vl_graph import launch  # noqa: F401
from .tuner_qwen3vl_graph import KernelTuner  # noqa: F401

logger = logging.get_logger(__name__)

_LOOP_MODES = (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE)
_STEP_ATTENTION = ("sdpa", "eager")
# What `from_pretrained` passes on to find a checkpoint's config.json.
_HUB_KWARGS = ("cache_dir", "force_download", "local_files_only", "proxies", "revision", "subfolder", "token")


class Qwen3VLGraphModel(Qwen3VLModel):
    """The stock base model under this package's config type (what `AutoModel` returns)."""

    config: Qwen3VLGraphConfig

    # What the stock `get_rope_index` reads, by name in every supported release. 5.x `generate` passes every model
    # input along (the pixels too): the others stay where they are.
    _ROPE_INDEX_INPUTS = ("mm_token_type_ids", "image_grid_thw", "video_grid_thw", "attention_mask")
    _rope_index_kept = None  # within `rope_index_kept`: (inputs, result) of the last call, or ()

    def get_rope_index(self, input_ids=None, *args, **kwargs):
        """The stock M-RoPE positions and offsets, computed on host copies of the inputs and returned to their device.
        Stock loops over rows and images in small tensor ops with host reads, each a kernel launch or a sync on a GPU:
        it is host work on the way to the first token (for one image on an H200 host: 0.89 ms, on copies 0.52).
        Within `rope_index_kept`, a call on the very same tensors as the last one returns its result."""
        inputs = (input_ids, *args, *(kwargs.get(key) for key in self._ROPE_INDEX_INPUTS))
        kept = self._rope_index_kept
        if kept and len(kept[0]) == len(inputs) and all(map(is_, kept[0], inputs)):
            return kept[1]
        if not isinstance(input_ids, torch.Tensor) or input_ids.device.type == "cpu":
            result = super().get_rope_index(input_ids, *args, **kwargs)
        else:
            def on_host(value):
                return value.cpu() if isinstance(value, torch.Tensor) else value

            on_host_kwargs = {key: on_host(value) if key in self._ROPE_INDEX_INPUTS else value
                              for key, value in kwargs.items()}
            positions, offsets = super().get_rope_index(input_ids.cpu(), *map(on_host, args), **on_host_kwargs)
            result = positions.to(input_ids.device), offsets.to(input_ids.device)
        if kept is not None:
            self._rope_index_kept = (inputs, result)
        return result

    @contextmanager
    def rope_index_kept(self):
        """Within: `get_rope_index` answers a call on the very tensors of the last one with its result. A prompt
        prefilled ahead computed it before `generate` does: `generate`'s host copies would wait for that prefill."""
        self._rope_index_kept = ()
        try:
            yield
        finally:
            self._rope_index_kept = None


# `GenerationMixin` named directly, as transformers asks of custom code (it checks the direct bases).
class Qwen3VLGraphForConditionalGeneration(Qwen3VLForConditionalGeneration, GenerationMixin):
    config: Qwen3VLGraphConfig
    _draft = None  # `load_draft`'s EAGLE-3 draft
    _num_draft_tokens = 4

    def __init__(self, config: Qwen3VLGraphConfig):
        config.validate_graph_settings()
        super().__init__(config)
        # The base model's class is ours (`get_rope_index`), and the tower's (its forward hands calls to the engine's
        # vision runner); the patch embedding runs the same weights as one matrix product (`patch_embed_mode`).
        self.model = _ours_around(self.model, Qwen3VLGraphModel, config)
        self.model.visual = visual = _ours_around(self.model.visual, Qwen3VLGraphVisionModel, config.vision_config)
        patch_embed = Qwen3VLGraphPatchEmbed(config.vision_config, mode=config.patch_embed_mode)
        patch_embed.load_state_dict(visual.patch_embed.state_dict(), assign=True)  # the stock tensors, no copy
        visual.patch_embed = patch_embed
        self._engine = None
        # The last `warmup()`: seconds of its compile-ahead pass ("compile": compiling, plus each step's first eager
        # run), of settling near-tied kernel choices in the whole step ("settle") and of capturing ("capture"); graphs
        # captured.
        self.warmup_report = {}
        # One request at a time owns the cache and the runners' buffers.
        self._generate_lock = threading.RLock()
        # While continuous batching admits a request: `generate` prefills it into that `Admission`'s free row.
        self._admission = None
        self._prefilled = None  # the call's `PrefilledAhead`, until its loop takes it
        # The last speculative `generate`: draft tokens a cycle and the tokens each cycle kept.
        self.speculative_stats = {}

    def generate(self, *args, **kwargs):
        with self._generate_lock, self.backend_flags():
            engine = self._current_engine()  # None: weights the kernels do not take (warned)
            if engine is not None:
                # The tower starts on the side stream as the call begins (it reads only the pixels and the grids,
                # which it checks itself, into its own buffers), then the prompt's prefill after it
                # (prefill_ahead_qwen3vl_graph.py), while generate prepares its loop (host work, ~3 ms on an H200
                # host); the loop then takes the results. (Before generate's own steps: 5.2x runs the tower early.)
                if self._draft is not None:  # before the prefill: it keeps the layer outputs the draft reads
                    engine.use_draft(self._draft, self._num_draft_tokens)
                videos = kwargs.get("pixel_values_videos") is not None
                engine.vision.encode_ahead(kwargs.get("pixel_values"), kwargs.get("image_grid_thw"), videos=videos)
            try:
                # Before anything is written (a bad token id would fail inside a CUDA kernel). Its host read waits
                # for the default stream only, not for the tower.
                _check_generate_inputs(self, kwargs.get("input_ids", args[0] if args else None), kwargs)
                if engine is None:  # transformers' modules and loop
                    return super().generate(*args, **kwargs)
                with self.model.rope_index_kept():
                    self._prefilled = prefill_ahead(self, args, kwargs)
                    return super().generate(*args, **kwargs)
            finally:
                if engine is not None:
                    engine.vision.join_ahead()  # its buffers are free again
                if self._prefilled is not None:  # the loop never took it: what the prefill wrote is no conversation
                    self._prefilled.join()
                    self._prefilled = None
                    engine.cache.clear()

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        """transformers' `from_pretrained`. Quantizing an unquantized checkpoint at load
        (`quantization_config=FineGrainedFP8Config(...)`), the linears that do not divide into its blocks (the 8B's
        vision MLP) keep the checkpoint's dtype (`fp8_at_load_config`)."""
        quantization_config = kwargs.get("quantization_config")
        if quantizes_fp8_at_load(quantization_config):
            config = kwargs.get("config")
            if not isinstance(config, PretrainedConfig):  # the shapes, from the checkpoint's config
                hub = {key: kwargs[key] for key in _HUB_KWARGS if key in kwargs}
                config = cls.config_class.from_pretrained(config or pretrained_model_name_or_path, **hub)
            if getattr(config, "quantization_config", None) is None:  # else quantized already: its own choices hold
                with torch.device("meta"):
                    skeleton = cls(copy.deepcopy(config))
                kwargs["quantization_config"] = fp8_at_load_config(quantization_config, skeleton)
        return super().from_pretrained(pretrained_model_name_or_path, *model_args, **kwargs)

    @contextmanager
    def backend_flags(self):
        """torch's global TF32 / cuDNN-benchmark flags as the config opts in (`allow_tf32`, `cudnn_benchmark`), for
        the model's own work only (`generate`, `warmup`): the process's flags are restored on the way out."""
        flags = {}
        if self.config.allow_tf32:
            flags.update({(torch.backends.cuda.matmul, "allow_tf32"): True, (torch.backends.cudnn, "allow_tf32"): True})
        if self.config.cudnn_benchmark:
            flags[(torch.backends.cudnn, "benchmark")] = True
        saved = {key: getattr(*key) for key in flags}
        try:
            for (owner, name), value in flags.items():
                setattr(owner, name, value)
            yield
        finally:
            for (owner, name), value in saved.items():
                setattr(owner, name, value)

    def load_draft(self, path_or_repo_id, num_draft_tokens: int = 4, **hub_kwargs) -> Eagle3Draft:
        """Load an EAGLE-3 draft head for this model from a folder or Hub repo (`config.json` and `model.safetensors`
        as AngelSlim and SpecForge publish them; `hub_kwargs` as for `from_pretrained`: revision, token, cache_dir,
        ...), on the model's device in its dtype. A draft of another architecture or for another target is refused
        with a ValueError naming what differs, before anything is attached.

        From then on `generate` of one unpadded prompt proposes `num_draft_tokens` tokens a cycle with it and checks
        them in one target step (speculative decoding): every kept token is the model's own greedy choice (in 16-bit
        the K + 1-row step may settle a near-tie otherwise than the one-row step), or drawn from the same distribution
        (the standard rejection rule), in fewer steps when the draft is often right. Other calls
        run the plain loop (a one-line notice says why). `use_draft(None)` detaches it."""
        _check_draft_tokens(num_draft_tokens)  # before the download
        draft = load_draft(path_or_repo_id, self, **hub_kwargs)
        self.use_draft(draft, num_draft_tokens)
        return draft

    def use_draft(self, draft, num_draft_tokens: int = 4) -> None:
        """Propose with `draft` (what `load_draft` returns; None: no speculative decoding)."""
        _check_draft_tokens(num_draft_tokens)
        # Outside the module tree: the model's own checkpoint keeps the stock layout.
        object.__setattr__(self, "_draft", draft)
        self._num_draft_tokens = num_draft_tokens

    def _speculative_greedy(self, input_ids, max_new_tokens: int, num_draft_tokens: int = 4, **model_inputs):
        """Greedy generation of one prompt with the loaded draft (`speculative_greedy`, eager torch): the reference
        the in-graph speculative loop must equal. Returns the sequences and the acceptance stats."""
        if self._draft is None:
            raise ValueError(f"{type(self).__name__} has no draft: call load_draft(path_or_repo_id) first.")
        with self._generate_lock:
            return speculative_greedy(self, self._draft, input_ids, max_new_tokens, num_draft_tokens,
                                      self.generation_config.eos_token_id, **model_inputs)

    def __deepcopy__(self, memo):
        """A deep copy, as stock models allow (transformers 4.57 copies a model to find what a quantizer leaves out):
        the same weights, config and settings, a lock of its own, and no engine (its cache and graphs are built again
        at its first use; graphs cannot be copied)."""
        memo[id(self._generate_lock)] = threading.RLock()
        for derived in (self._engine, getattr(self.model.visual, "runner", None)):
            if derived is not None:
                memo[id(derived)] = None
        copied = type(self).__new__(type(self))
        memo[id(self)] = copied
        copied.__setstate__(copy.deepcopy(self.__dict__, memo))
        return copied

    def save_pretrained(self, save_directory, *args, **kwargs):
        # Name every Auto class in `auto_map`, not only the ones the classes were registered for.
        self.config.auto_map = {**(getattr(self.config, "auto_map", None) or {}), **auto_map()}
        with self._engine.text.separate_weights() if self._engine is not None else nullcontext():
            return super().save_pretrained(save_directory, *args, **kwargs)

    def _valid_auto_compile_criteria(self, model_kwargs, generation_config) -> bool:
        """Whether transformers' own loop (the paths it runs: `_static_loop_blocker`) compiles its decode step.
        Stock compiles it whenever the cache is static on CUDA; here only a call that asks (`compile_config`) gets
        that, and only on a cache of transformers' own: the persistent cache is written outside that step (prefill,
        graphs) at addresses that captured graphs hold."""
        if generation_config.compile_config is None:
            return False
        if self._engine is not None and model_kwargs.get(CACHE_KWARG) is self._engine.cache:
            logger.warning_once(
                f"{type(self).__name__}: compile_config is not used with this model's persistent cache (returned by "
                "generate and passed back): transformers' loop runs its forward eagerly on it."
            )
            return False
        return super()._valid_auto_compile_criteria(model_kwargs, generation_config)

    def graph_engine(self) -> GraphEngine:
        """The engine of the fast path (cache, kernels, graphs, runners), built on first use and again once the
        weights moved or were replaced. A ValueError names the format of linears quantized in a way the kernels do
        not take."""
        engine = self._current_engine()
        if engine is None:
            raise ValueError(f"{type(self).__name__} has no fast path for these weights: {unsupported_weights(self)}")
        return engine

    def _current_engine(self) -> GraphEngine | None:
        """`graph_engine()`, or None (with a warning naming the format) where the kernels do not take the weights."""
        engine = self._engine
        if engine is None or not engine.current(self):
            # The old cache and graphs are freed before new ones are allocated.
            self._engine = engine = self.model.visual.runner = None
            unsupported = unsupported_weights(self)
            if unsupported is not None:
                logger.warning_once(f"{type(self).__name__}: {unsupported}; transformers' own modules and generation "
                                    "loop run this model.")
                return None
            with torch.inference_mode(False):  # buffers that later calls update in place, inside inference mode or not
                self._engine = engine = GraphEngine(self)
        return engine

    def static_cache(self) -> ASStaticCache:
        """The persistent KV cache, allocated on first use for the model's current device and dtype."""
        return self.graph_engine().cache

    def set_cuda_graphs(self, enabled: bool) -> None:
        """Turn graph replay on or off at runtime (captured graphs are kept). Off, the same steps run eagerly on
        the same padded shapes, which is what the graphs are checked against."""
        self.config.use_cuda_graphs = enabled
        self.graph_engine().set_graphs(enabled)

    def init_continuous_batching(
        self, generation_config=None, max_queue_size: int = 0, *, max_batch_size: int | None = None,
        static_cache_len: int | None = None, gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION,
        max_prefill_tokens: int = DEFAULT_MAX_PREFILL_TOKENS, tokenizer=None, requests: int | None = None,
        pixel_transform=None,
    ) -> GraphBatchingManager:
        """A continuous-batching manager for this model (not started), as transformers' own: `start()`,
        `add_request(input_ids, request_id, max_new_tokens, streaming, **settings_and_model_inputs)`, `get_result()`,
        `request_id_iter()`, `register_result_handler()`, `cancel_request()`, `stop()` (batching_qwen3vl_graph.py).

        Requests take the static cache's rows: `max_batch_size` of them (default: as many rows of `static_cache_len`
        slots, default the config's, as fit in `gpu_memory_utilization` of the GPU's memory, at most 512 and at most
        `requests` when given; on the CPU the config's). A size other than the config's rebuilds the cache (and its
        graphs), which later `generate` calls use too; one log line says what was chosen and why. Waiting prompts
        enter `max_prefill_tokens` at a time, prefilled beside the chunks of decode steps. `tokenizer` decodes answers
        for requests with `stop_strings`. `pixel_transform`: a function applied on the model's device to the requests'
        `pixel_values` (joined; not videos') before the vision tower, e.g. normalizing raw uint8 patches there, as the
        server does; every request's image pixels are then what it takes."""
        self._size_cache(max_batch_size, static_cache_len, gpu_memory_utilization, max_prefill_tokens, requests)
        return GraphBatchingManager(self, generation_config, max_queue_size, max_prefill_tokens, tokenizer,
                                    pixel_transform)

    def generate_batch(self, inputs, generation_config=None, progress_bar: bool = True, *,
                       max_batch_size: int | None = None, static_cache_len: int | None = None,
                       gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION,
                       max_prefill_tokens: int = DEFAULT_MAX_PREFILL_TOKENS, tokenizer=None, **kwargs) -> dict:
        """Generate for every one of `inputs` (token ids, or a dict of one prompt's processor outputs) by continuous
        batching; `kwargs` apply to each (e.g. `max_new_tokens`). Returns {request id: GenerationOutput} in input
        order; a request that cannot run has status FAILED and an `error` naming why, and the others finish. On a
        GPU the cache is sized for these requests unless set (`init_continuous_batching`): rows of the slots the
        longest of them needs, as many as fit in memory."""
        inputs = list(inputs)
        config = generation_config if generation_config is not None else self.generation_config
        new_tokens = kwargs.get("max_new_tokens") or config.max_new_tokens
        if static_cache_len is None and device_memory(self.device) is not None:
            static_cache_len = cache_len_for(inputs, new_tokens, self.config.steps_per_sync)
        manager = self.init_continuous_batching(
            generation_config, max_batch_size=max_batch_size, static_cache_len=static_cache_len,
            gpu_memory_utilization=gpu_memory_utilization, max_prefill_tokens=max_prefill_tokens, tokenizer=tokenizer,
            requests=len(inputs),
        )
        return manager.generate_all(inputs, progress_bar, **kwargs)

    def _size_cache(self, rows, cache_len, gpu_memory_utilization, max_prefill_tokens, requests) -> None:
        """The cache continuous batching runs on: `rows` x `cache_len` slots, each None for the default (rows: what
        fits in memory on a GPU, else the config's; slots: the config's). Rebuilt when that differs from the config's."""
        config = self.config
        if not 0 < gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
        for name, value in (("max_batch_size", rows), ("static_cache_len", cache_len)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        cache_len = cache_len or config.static_cache_len
        with self._generate_lock:
            if rows is None:
                memory = device_memory(self.device)
                if memory is None:
                    rows = config.max_batch_size
                else:
                    engine = self._engine
                    held = 0 if engine is None else engine.cache.rows * engine.cache.capacity
                    slot_bytes = kv_bytes_per_slot(config, config.kv_dtype(self.dtype))
                    rows, why = slots_from_memory(*memory, held * slot_bytes, slot_bytes, cache_len,
                                                  gpu_memory_utilization, max_prefill_tokens, requests,
                                                  media_bytes_per_token(config, self.dtype))
                    if rows < 1:
                        raise ValueError(f"No cache row of {cache_len} slots fits: {why}. Lower static_cache_len or "
                                         "raise gpu_memory_utilization.")
                    logger.warning(f"Continuous batching on {rows} rows of {cache_len} slots: {why}.")
            if (rows, cache_len) != (config.max_batch_size, config.static_cache_len):
                config.max_batch_size, config.static_cache_len = rows, cache_len
                self._engine = self.model.visual.runner = None  # the old cache and graphs go before the new ones
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()

    def _check_inputs(self, input_ids, model_kwargs) -> None:
        """`generate`'s checks of a prompt's inputs (`_check_generate_inputs`), for continuous batching's requests."""
        _check_generate_inputs(self, input_ids, model_kwargs)

    def _static_loop_blocker(self, generation_config, model_kwargs, generation_mode) -> str | None:
        """Why this call must run transformers' own loop, or None when the static loop covers it."""
        if generation_mode not in _LOOP_MODES:
            return f"generation mode {generation_mode.value!r}"
        passed = model_kwargs.get(CACHE_KWARG)
        if passed is not None and passed is not self._engine.cache:
            return f"a cache passed by the caller ({type(passed).__name__}, not the one this model returns)"
        if generation_config.cache_implementation not in (None, "static"):
            return f"cache_implementation={generation_config.cache_implementation!r}"
        if generation_config.use_cache is False:
            return "use_cache=False"
        if generation_config.output_attentions or generation_config.output_hidden_states:
            return "output_attentions / output_hidden_states"
        if generation_config.prefill_chunk_size is not None:
            return "prefill_chunk_size"
        if generation_config.is_assistant:
            return "use as an assistant model"
        if model_kwargs.get("inputs_embeds") is not None:
            return "inputs_embeds"
        if self.config.get_text_config(decoder=True)._attn_implementation not in _STEP_ATTENTION:
            return f"attn_implementation={self.config._attn_implementation!r}"
        return None

    def _prepare_cache_for_generation(
        self, generation_config, model_kwargs, generation_mode, batch_size, max_cache_length
    ):
        if self._engine is None:  # no fast path for these weights (`generate`)
            return super()._prepare_cache_for_generation(
                generation_config, model_kwargs, generation_mode, batch_size, max_cache_length
            )
        blocker = self._static_loop_blocker(generation_config, model_kwargs, generation_mode)
        cache = self._engine.cache  # current: `generate` called `_current_engine()` under its lock
        if self._admission is not None:  # continuous batching: the other rows keep what they hold
            if blocker is not None:
                raise ValueError(f"Continuous batching does not take {blocker}.")
            cache.check_capacity(batch_size, max_cache_length)
            cache.hold_rows()
            model_kwargs[CACHE_KWARG] = cache
            return
        passed_back = model_kwargs.get(CACHE_KWARG) is cache
        # Passed back holding nothing (`warmup()` or continuous batching has run on its rows since): a new request.
        resumed = passed_back and cache.filled() > 0
        if blocker is not None:
            logger.warning_once(f"{type(self).__name__}: {blocker} runs transformers' stock generation loop.")
            if not passed_back:
                return super()._prepare_cache_for_generation(
                    generation_config, model_kwargs, generation_mode, batch_size, max_cache_length
                )
            cache.tokens = None  # the stock loop writes to it: what it then holds is not recorded
        rows = batch_size * max(generation_config.num_beams, generation_config.num_return_sequences)
        cache.check_capacity(rows, max_cache_length)
        if resumed:  # a later turn: the cache keeps what it holds, whichever loop runs
            cache.resume(rows, max_cache_length)
        else:
            cache.activate(rows, max_cache_length)
        model_kwargs[CACHE_KWARG] = cache

    def warmup(
        self, batch_sizes=None, cache_lengths=None, modes=("greedy", "sample", "sample_top_k"), prompt_lengths=None,
        image_patches=None,
    ) -> float:
        """Capture the CUDA graphs ahead of time, so no `generate` call waits for a capture.

        - decode: every (batch size, `cache_lengths` = prompt + new tokens, mode) combination;
        - prefill: every (batch size, `prompt_lengths`) combination within `prefill_graph_tokens` (batches of
          several rows both unpadded and padded);
        - vision: images of each `image_patches` count (per image; a 448x448 image has 784 patches), one per call
          and one per row of each batch size, in the chunks of at most `vision_graph_patches` that such calls run
          as. None by default (each (number of images, image size) is then captured on first use).
        Each other size is rounded up to its bucket, and each other list defaults to every configured bucket.
        Returns the time taken in seconds (0 where graphs are not used: CPU, or `use_cuda_graphs=False`);
        `warmup_report` splits it into compiling the kernels ahead and capturing. Capturing runs steps on the cache's
        rows, so a conversation the returned cache holds is dropped: passed back, it serves a new request.
        """
        with self._generate_lock, self.backend_flags(), torch.no_grad():
            self.warmup_report = self.graph_engine().warmup(batch_sizes, cache_lengths, modes, prompt_lengths,
                                                            image_patches)
        return sum(self.warmup_report.get(part, 0.0) for part in ("compile", "settle", "capture"))

    def _sample(
        self,
        input_ids,
        logits_processor,
        stopping_criteria,
        generation_config,
        synced_gpus: bool = False,
        streamer=None,
        **model_kwargs,
    ):
        if self._admission is not None:
            return self._admission.prefill(self, input_ids, logits_processor, stopping_criteria, generation_config,
                                           model_kwargs)
        engine = self._engine
        cache = engine.cache if engine is not None else None
        static = engine is not None and model_kwargs.get(CACHE_KWARG) is cache
        prefilled = None
        if static:  # whichever loop runs next writes this cache from slot 0 or from what it holds, and records it
            prefilled, self._prefilled = self._prefilled, None
        start = _cached_prefix(cache, input_ids, model_kwargs) if static else None
        if synced_gpus or start is None:
            if static:  # transformers' loop on the static cache: what it then holds is not recorded
                if not cache.resumed:  # empty for 4.57 too, which counts non-zero slots
                    cache.set_length(0)
                cache.tokens = None
            return super()._sample(
                input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus, streamer, **model_kwargs
            )
        if generation_config.compile_config is not None:
            logger.warning_once(
                f"{type(self).__name__}: compile_config is not used: this model's own decode step runs instead (CUDA "
                "graphs of fused kernels on a GPU, the same step eagerly on the CPU). It applies where transformers' "
                "own loop runs on its own cache (e.g. with output_hidden_states=True)."
            )
        if prefilled is not None and prefilled.serves(input_ids, model_kwargs, start):
            logits, positions = prefilled.join()
        else:
            logits, positions = self._prefill_prompt(input_ids, model_kwargs, start)
        engine.decode.start(first_decode_positions(self, model_kwargs, positions, input_ids.shape[1]),
                            model_kwargs.get("attention_mask"), input_ids.shape[1])
        plan = device_plan(logits_processor, stopping_criteria, generation_config)
        scores = raw_logits = None
        speculating = self._draft is not None and self._speculation_blocker(plan, input_ids, model_kwargs, start) is None
        self.speculative_stats = {}
        if speculating:
            runner = engine.speculative
            sequences, kept = runner.generate(
                input_ids, logits, engine.prefill.taps, positions,
                first_decode_positions(self, model_kwargs, positions, input_ids.shape[1]), plan, streamer, start)
            self.speculative_stats = {"num_draft_tokens": runner.k, "kept_per_cycle": kept}
        elif plan is None:
            sequences, scores, raw_logits = host_loop(engine.decode, input_ids, logits, logits_processor,
                                                      stopping_criteria, generation_config, streamer)
        else:
            sequences = device_loop(engine.decode, input_ids, logits, plan, generation_config, streamer)
        sequences = sequences.to(input_ids.device)
        cache.set_length(sequences.shape[1] - 1)  # the last token is never fed back
        cache.tokens = sequences[:, :-1].clone()
        if speculating:  # the draft's cache holds this conversation's slots: a later turn continues them
            self._draft.conversation = cache.tokens
        if streamer is not None:
            streamer.end()
        if generation_config.return_dict_in_generate:
            return generate_output(sequences, tuple(scores) if scores else None,
                                   tuple(raw_logits) if raw_logits else None, cache)
        return sequences

    def _speculation_blocker(self, plan, input_ids, model_kwargs, start: int) -> str | None:
        """Why this call runs the plain loop although a draft is loaded (said once), or None."""
        if plan is None:
            reason = "logits processors or stopping criteria the device loop does not cover"
        elif input_ids.shape[0] != 1:
            reason = f"a batch of {input_ids.shape[0]} prompts"
        elif start and getattr(self._draft, "conversation", None) is not self._engine.cache.tokens:
            reason = "a later turn whose earlier turns the draft did not run (its cache does not hold them)"
        elif model_kwargs.get("attention_mask") is not None and not bool(model_kwargs["attention_mask"].all()):
            reason = "a padded prompt"
        elif plan["max_length"] + self._num_draft_tokens > self._engine.cache.capacity:
            reason = (f"no room in the cache for the {self._num_draft_tokens} slots the last cycle checks past "
                      f"max_length {plan['max_length']} (static_cache_len {self._engine.cache.capacity})")
        else:
            return None
        logger.warning_once(f"{type(self).__name__}: {reason} runs the plain decode loop; speculative decoding covers "
                            "one unpadded prompt, greedy or sampled by the device loop.")
        return reason

    def _prefill_prompt(self, input_ids, model_kwargs, start: int, rows=None, stream=None, padded: bool | None = None,
                        media=None):
        """Vision tower and prefill of the prompt's tokens from slot `start` on (the cache holds the ones before) into
        the static cache's rows `rows` (a tensor; None: the first rows); returns the float32 logits of the last
        position and the new tokens' M-RoPE positions. `stream`: a CUDA stream to queue the tower and the prefill on,
        after the host reads and what the current stream has queued (None: the current stream). `padded`: whether the
        attention mask has zeros, when the caller knows (else read back from it). `media`: `media_features` of the
        new tokens' images and videos, when the caller has them (a long prompt prefilled in chunks encodes once)."""
        new = input_ids[:, start:]
        # The host reads first: after the tower is queued on their stream they would wait for it.
        attention_mask = model_kwargs.get("attention_mask")
        if padded is None:
            padded = attention_mask is not None and bool((attention_mask == 0).any())
        positions = prompt_positions(self, input_ids, model_kwargs, start)  # 4.57: on host copies
        queued_on = nullcontext()
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream())
            queued_on = torch.cuda.stream(stream)
        with queued_on:
            if media is None:  # placeholders and features agree (`_check_generate_inputs`)
                media = media_features(self, model_kwargs)
            # Placeholders of a kind with no features are embedded as text, as stock does.
            modality = torch.zeros_like(new)
            visual, deepstack = None, ()
            if media:
                for kind, token, _, _ in media:
                    modality += (new == token) * (1 if kind == "image" else 2)
                visual = torch.cat([features for _, _, features, _ in media])
                deepstack = [torch.cat(layer) for layer in zip(*(layers for _, _, _, layers in media))]
            logits = self._engine.prefill.run(new, attention_mask, positions, modality, visual, deepstack, padded,
                                              start, rows=rows)
        return logits, positions


def _check_draft_tokens(count) -> None:
    """A chain of 1 to 15 proposals: the verify step's K + 1 rows and the draft's query rows stay within 16."""
    if not 1 <= count <= 15:
        raise ValueError(f"num_draft_tokens must be within 1..15, got {count}")


def _ours_around(stock, cls, config):
    """A `cls` instance (built on the meta device) around the `stock` module's own submodules: our class, the same
    module tree and tensors."""
    with torch.device("meta"):
        ours = cls(config)
    for name, child in stock.named_children():
        setattr(ours, name, child)
    return ours


def _check_generate_inputs(model, input_ids, kwargs) -> None:
    """Raise a `ValueError` that names the problem for inputs that would fail deep inside `generate` or, worse, inside
    a kernel: tensors on the meta device (no data to read), token ids outside the vocabulary, an attention mask of
    another shape, pixels without their grid, image (video) placeholders in the prompt's uncached tokens that do not
    match the pixels' merged patches, and placeholders without pixels after the cache passed back lost what it held.
    `model`: whose config the inputs are for (its device, named in a message, is looked up only then: it walks the
    parameters, ~25 us, which continuous batching would pay per request). An assistant's call (assisted decoding) gets
    the main call's pixels with a cache that holds their placeholders; transformers drops them there, so they are not
    checked against the prompt."""
    config = model.config
    for name, value in {"input_ids": input_ids, **kwargs}.items():
        if isinstance(value, torch.Tensor) and value.device.type == "meta":
            raise ValueError(
                f"{name} is on the meta device: a shape without data, which generate cannot read. Pass real tensors, "
                f"on the model's device ({model.device}) or the CPU."
            )
    if not isinstance(input_ids, torch.Tensor) or not input_ids.numel():
        return  # inputs_embeds, or transformers' own error for what it cannot read
    attention_mask = kwargs.get("attention_mask")
    if attention_mask is not None and tuple(attention_mask.shape) != tuple(input_ids.shape):
        raise ValueError(
            f"attention_mask has shape {tuple(attention_mask.shape)} but input_ids has {tuple(input_ids.shape)}: they "
            f"must match (one flag per token)."
        )
    cache = kwargs.get(CACHE_KWARG)
    held = 0 if cache is None else cache.filled() if isinstance(cache, ASStaticCache) else int(cache.get_seq_length())
    uncached = input_ids[:, held:]
    assistant = getattr(kwargs.get("generation_config"), "is_assistant", False)
    media = [(kind, token, kwargs.get(pixels), kwargs.get(f"{kind}_grid_thw"))
             for kind, token, pixels in (("image", config.image_token_id, "pixel_values"),
                                         ("video", config.video_token_id, "pixel_values_videos"))
             if not assistant]
    for kind, _, pixels, grid in media:
        if pixels is not None and grid is None:
            raise ValueError(f"{kind} pixels were passed without `{kind}_grid_thw`: pass the processor's {kind}_grid_thw "
                             f"with them (the {kind}s' patch grids).")
    # One host read for every check below.
    stats = [input_ids.min(), input_ids.max(), *((uncached == token).sum() for _, token, _, _ in media)]
    stats += [grid.prod(-1).sum().to(input_ids.device) for _, _, pixels, grid in media if pixels is not None]
    low, high, *counts = torch.stack([value.to(input_ids.device) for value in stats]).tolist()
    vocab = config.get_text_config(decoder=True).vocab_size
    if low < 0 or high >= vocab:
        raise ValueError(f"input_ids holds token ids from {low} to {high}, outside the vocabulary [0, {vocab}).")
    tokens, patches = counts[:2], iter(counts[2:])
    for (kind, _, pixels, _), count in zip(media, tokens):
        if isinstance(cache, ASStaticCache) and not held and count and pixels is None:
            raise ValueError(
                f"The cache passed back holds nothing (warmup() or continuous batching ran on its rows since it was "
                f"returned), so the prompt's {count} {kind} tokens have no {kind}s: pass the conversation as a new "
                f"request, with its {kind}s."
            )
    unit = config.vision_config.spatial_merge_size**2
    for (kind, _, pixels, _), count in zip(media, tokens):
        if pixels is None:
            continue
        described = next(patches)
        if described != pixels.shape[0]:
            raise ValueError(
                f"The {kind} pixel values hold {pixels.shape[0]} patches but {kind}_grid_thw describes {described}."
            )
        if count != described // unit:
            raise ValueError(
                f"{kind.capitalize()} features and {kind} tokens do not match: the prompt has {count} {kind} tokens "
                f"to fill, {kind}_grid_thw gives {described // unit} features ({described} patches / "
                f"spatial_merge_size**2)."
            )


def _cached_prefix(cache: ASStaticCache, input_ids, model_kwargs) -> int | None:
    """Slots of the static cache that the prompt continues from: 0 for a new request; for a resumed one, the tokens it
    holds when every row of the prompt starts with them and goes on past them with text only, else None:
    transformers' own loop then continues from whatever the cache holds, as it would. (New images in a later turn
    take that loop too: releases differ in how they place them after a cache.)"""
    if not cache.resumed:
        return 0
    held = cache.tokens
    media = any(model_kwargs.get(key) is not None for key in ("pixel_values", "pixel_values_videos"))
    media = media or bool(model_kwargs.get("mm_encoder_outputs"))  # 5.2x: pre-encoded, an empty dict without media
    if media or held is None or held.shape[0] != input_ids.shape[0] or held.shape[1] >= input_ids.shape[1]:
        return None
    return held.shape[1] if torch.equal(input_ids[:, : held.shape[1]], held.to(input_ids.device)) else None


def auto_map() -> dict[str, str]:
    """`auto_map` of a saved or converted checkpoint: each Auto class -> its class in the module files beside it."""
    modeling = __name__.rsplit(".", 1)[-1]
    configuration = Qwen3VLGraphConfig.__module__.rsplit(".", 1)[-1]
    model = f"{modeling}.{Qwen3VLGraphForConditionalGeneration.__name__}"
    return {
        "AutoConfig": f"{configuration}.{Qwen3VLGraphConfig.__name__}",
        "AutoModel": f"{modeling}.{Qwen3VLGraphModel.__name__}",
        "AutoModelForImageTextToText": model,
        "AutoModelForVision2Seq": model,
    }


__all__ = ["Qwen3VLGraphModel", "Qwen3VLGraphForConditionalGeneration"]
