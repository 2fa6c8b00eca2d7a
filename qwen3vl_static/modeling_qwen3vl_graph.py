"""Qwen3VLGraphForConditionalGeneration: the stock Qwen3-VL model with a static-cache decode loop.

Same module tree and forward as `Qwen3VLForConditionalGeneration` (stock checkpoints load unchanged and what
this class saves loads into the stock class). `generate()` keeps all of transformers' input preparation
(M-RoPE positions, multimodal inputs, logits processors, stopping criteria); this class only
- hands generate its one persistent `ASStaticCache` (`_prepare_cache_for_generation`), and
- owns prefill and the decode loop (`_sample`): `VisionRunner` encodes the images and videos, `PrefillRunner`
  writes the prompt into that cache and gives the first token's logits, then `DecodeRunner` steps.
A later turn may pass the returned cache back (`past_key_values=` / `cache=`, as with stock): when the new prompt
extends the tokens the cache holds, only its new tokens are prefilled. Anything the loop does not cover (beam
search, assisted decoding, attention/hidden-state outputs, a cache of another kind, ...) runs transformers' own
code path.
"""

import threading
import time
from collections import deque
from contextlib import contextmanager, nullcontext

import torch
from torch import nn
from transformers.generation.configuration_utils import GenerationMode
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLForConditionalGeneration, Qwen3VLModel
from transformers.utils import logging
from transformers.utils.logging import tqdm

from .cache_qwen3vl_graph import ASStaticCache
from .capture_qwen3vl_graph import GraphCapturer
from .compat_qwen3vl_graph import CACHE_KWARG, first_decode_positions, generate_output, media_features, prompt_positions
from .configuration_qwen3vl_graph import Qwen3VLGraphConfig
from .graphs_qwen3vl_graph import MAX_EOS_IDS, DecodeRunner, sample_tokens
from .kernels_qwen3vl_graph import decode_ops
from .prefill_qwen3vl_graph import PrefillRunner
from .vision_qwen3vl_graph import (
    BlockDiagonalMask,
    Qwen3VLGraphPatchEmbed,
    Qwen3VLGraphVisionAttention,
    Qwen3VLGraphVisionModel,
    VisionRunner,
)

logger = logging.get_logger(__name__)

_LOOP_MODES = (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE)
_STEP_ATTENTION = ("sdpa", "eager")


class Qwen3VLGraphModel(Qwen3VLModel):
    """The stock base model under this package's config type (what `AutoModel` returns)."""

    config: Qwen3VLGraphConfig


class Qwen3VLGraphForConditionalGeneration(Qwen3VLForConditionalGeneration):
    config: Qwen3VLGraphConfig

    def __init__(self, config: Qwen3VLGraphConfig):
        config.validate_graph_settings()
        super().__init__(config)
        # Vision modules with the stock parameters but faster forwards (vision_qwen3vl_graph.py). The tower class
        # is ours (its forward can use the runner) around the stock instance's own submodules.
        with torch.device("meta"):
            visual = Qwen3VLGraphVisionModel(config.vision_config)
        for name, child in self.model.visual.named_children():
            setattr(visual, name, child)
        self.model.visual = visual
        visual.patch_embed = _same_weights(
            Qwen3VLGraphPatchEmbed(config.vision_config, mode=config.patch_embed_mode), visual.patch_embed
        )
        self._vision_mask = BlockDiagonalMask()
        for block in visual.blocks:
            block.attn = _same_weights(
                Qwen3VLGraphVisionAttention(config.vision_config, self._vision_mask, config.use_triton_kernels), block.attn
            )
        self._static_cache = None
        self._runner = self._prefill_runner = None
        # The last `warmup()`: seconds of its compile-ahead pass ("compile": compiling, plus each step's first eager
        # run), of settling near-tied kernel choices in the whole step ("settle") and of capturing ("capture"); graphs
        # captured.
        self.warmup_report = {}
        # One request at a time owns the cache and the runner's buffers.
        self._generate_lock = threading.RLock()

    def generate(self, *args, **kwargs):
        with self._generate_lock, self.backend_flags():
            # Before anything is queued or written (a bad token id would fail inside a CUDA kernel).
            _check_generate_inputs(self.config, kwargs.get("input_ids", args[0] if args else None), kwargs)
            self.static_cache()  # before generate's own steps: transformers 5.2x runs the vision tower early
            # The tower runs on the side stream while generate prepares its inputs (host work, ~3 ms on an H200
            # host); whichever path encodes the images then takes the result.
            vision = self.model.visual.runner
            videos = kwargs.get("pixel_values_videos") is not None
            vision.encode_ahead(kwargs.get("pixel_values"), kwargs.get("image_grid_thw"), videos=videos)
            try:
                return super().generate(*args, **kwargs)
            finally:
                vision.join_ahead()  # not taken (an error, or a path that never encoded): its buffers are free again

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

    def save_pretrained(self, save_directory, *args, **kwargs):
        # Name every Auto class in `auto_map`, not only the ones the classes were registered for.
        self.config.auto_map = {**(getattr(self.config, "auto_map", None) or {}), **auto_map()}
        with self._runner.separate_weights() if self._runner is not None else nullcontext():
            return super().save_pretrained(save_directory, *args, **kwargs)

    # transformers would wrap each decode step in torch.compile(mode="reduce-overhead") as soon as it sees a
    # static cache on CUDA: our loop never calls that step, and the fallback paths should not compile either.
    def _valid_auto_compile_criteria(self, model_kwargs, generation_config) -> bool:
        return False

    def static_cache(self) -> ASStaticCache:
        """The persistent KV cache, allocated on first use for the model's current device and dtype."""
        weight = self.model.language_model.embed_tokens.weight
        cache = self._static_cache
        stale = (
            cache is None
            or (cache.full_keys[0].device, cache.full_keys[0].dtype) != (weight.device, weight.dtype)
            or not self._runner.weights_current()
            or not self.model.visual.runner.current()
        )
        if stale:
            with torch.inference_mode(False):  # buffers that later calls update in place, inside inference mode or not
                self._build_static_path(weight)
        return self._static_cache

    def _build_static_path(self, weight) -> None:
        """The persistent cache, runners and graph capturer for the weights' device and dtype."""
        # Free the old cache and graphs before allocating new ones.
        self._static_cache = self._runner = self._prefill_runner = self.model.visual.runner = None
        config = self.config
        cache = ASStaticCache(config, config.max_batch_size, config.static_cache_len, weight.device, weight.dtype)
        self._static_cache = cache
        ops = decode_ops(weight.device, weight.dtype, config.use_triton_kernels)
        capturer = GraphCapturer()  # one memory pool for every graph of the model
        graphs = config.use_cuda_graphs
        # On CUDA, prompts and images are padded to buckets with or without graphs: the eager path then
        # computes on the graphs' shapes, so the two give the same numbers.
        bucketed = weight.device.type == "cuda"
        self._runner = DecodeRunner(
            self, cache, ops, config.batch_buckets(), config.cache_buckets(), config.steps_per_sync, capturer, graphs
        )
        self._prefill_runner = PrefillRunner(
            self, cache, ops, (self._runner.qkv_weights, self._runner.gate_up_weights), config.batch_buckets(),
            config.prompt_buckets(), config.cache_buckets(), config.prefill_graph_tokens, capturer, graphs, bucketed,
        )
        self.model.visual.runner = VisionRunner(
            self.model.visual, self._vision_mask, config.patch_buckets(), config.vision_table_cache_size, capturer,
            graphs, bucketed, config.use_triton_kernels,
        )

    def set_cuda_graphs(self, enabled: bool) -> None:
        """Turn graph replay on or off at runtime (captured graphs are kept). Off, the same steps run eagerly on
        the same padded shapes, which is what the graphs are checked against."""
        self.config.use_cuda_graphs = enabled
        self.static_cache()
        for runner in (self._runner, self._prefill_runner, self.model.visual.runner):
            runner.use_graphs = enabled and runner.can_use_graphs

    def _static_loop_blocker(self, generation_config, model_kwargs, generation_mode) -> str | None:
        """Why this call must run transformers' own loop, or None when the static loop covers it."""
        if generation_mode not in _LOOP_MODES:
            return f"generation mode {generation_mode.value!r}"
        passed = model_kwargs.get(CACHE_KWARG)
        if passed is not None and passed is not self._static_cache:
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
        blocker = self._static_loop_blocker(generation_config, model_kwargs, generation_mode)
        cache = self._static_cache  # checked and current: `generate` called `static_cache()` under its lock
        resumed = model_kwargs.get(CACHE_KWARG) is cache
        if blocker is not None:
            logger.warning_once(f"{type(self).__name__}: {blocker} runs transformers' stock generation loop.")
            if not resumed:
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
        self, batch_sizes=None, cache_lengths=None, modes=("greedy", "sample"), prompt_lengths=None, image_patches=None
    ) -> float:
        """Capture the CUDA graphs ahead of time, so no `generate` call waits for a capture.

        - decode: every (batch size, `cache_lengths` = prompt + new tokens, mode) combination;
        - prefill: every (batch size, `prompt_lengths`) combination within `prefill_graph_tokens` (batches of
          several rows both unpadded and padded);
        - vision: every `image_patches` count (all images of one call; a 448x448 image has 784 patches) within
          `vision_graph_patches`: a single image's graph at exactly that count, and the padded bucket graph for
          several images. By default every bucket (a single image's own graph is then captured on first use).
        Each other size is rounded up to its bucket, and each list defaults to every configured bucket. Returns the
        time taken in seconds (0 where graphs are not used: CPU, or `use_cuda_graphs=False`); `warmup_report` splits
        it into compiling the kernels ahead and capturing.
        """
        self.static_cache()
        runner, prefill, vision = self._runner, self._prefill_runner, self.model.visual.runner
        with self._generate_lock, self.backend_flags(), torch.no_grad():
            batch_sizes = batch_sizes or runner.batch_buckets
            pending = [(runner, key) for key in runner.warmup_keys(batch_sizes, cache_lengths or runner.cache_buckets, modes)]
            pending += [(prefill, key) for key in prefill.warmup_keys(batch_sizes, prompt_lengths or prefill.token_buckets)]
            pending += [(vision, key) for key in vision.warmup_keys(image_patches)]
            pending = [(owner, key) for owner, key in pending if owner.use_graphs and key not in owner.graphs]
            if not runner.use_graphs:
                return 0.0
            runner.idle()
            prefill.idle()
            began = time.perf_counter()
            # Every kernel these graphs launch, compiled at once on a thread pool rather than one by one as captures
            # first meet them.
            runner.capturer.precompile(runner.ops, [owner.graph_step(*key) for owner, key in pending])
            compiled = time.perf_counter()
            # Near-tied measured choices are settled in the whole step, before a batch size's graphs bake them in. One
            # choice serves every KV length, so each batch size settles at the middle of its KV buckets (at 256 slots
            # an H200 picked a QKV form 0.066 ms/step slower at 1024).
            decode_keys = sorted(key for owner, key in pending if owner is runner)
            for rows in dict.fromkeys(key[0] for key in decode_keys):
                keys = [key for key in decode_keys if key[0] == rows]
                runner.settle_near_ties(*keys[len(keys) // 2])
            settled = time.perf_counter()
            for owner, key in tqdm(pending, desc="Capturing CUDA graphs"):
                owner.capture(*key)
            torch.cuda.synchronize()
            done = time.perf_counter()
            self.warmup_report = {"compile": compiled - began, "settle": settled - compiled, "capture": done - settled,
                                  "graphs": len(pending)}
            logger.info(f"Compiled ahead the kernels of {len(pending)} CUDA graphs in {compiled - began:.2f} s (one "
                        f"eager run of each step included; Triton caches the kernels on disk for later processes), "
                        f"settled near-tied kernel choices in the whole step in {settled - compiled:.2f} s and "
                        f"captured the graphs in {done - settled:.2f} s")
            return done - began

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
        cache = self._static_cache
        static = model_kwargs.get(CACHE_KWARG) is cache
        start = _cached_prefix(cache, input_ids, model_kwargs) if static else None
        if synced_gpus or start is None:
            if static:  # transformers' loop on the static cache: what it then holds is not recorded
                if not cache.resumed:  # empty for 4.57 too, which counts non-zero slots
                    cache.set_length(0)
                cache.tokens = None
            return super()._sample(
                input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus, streamer, **model_kwargs
            )
        runner = self._runner
        logits, positions = self._prefill_prompt(input_ids, model_kwargs, start)
        runner.start(first_decode_positions(self, model_kwargs, positions, input_ids.shape[1]),
                     model_kwargs.get("attention_mask"), input_ids.shape[1])
        plan = _device_plan(logits_processor, stopping_criteria, generation_config)
        if plan is None:
            return self._host_loop(input_ids, logits, logits_processor, stopping_criteria, generation_config, streamer)
        return self._device_loop(input_ids, logits, plan, generation_config, streamer)

    def _prefill_prompt(self, input_ids, model_kwargs, start: int):
        """Vision tower and prefill of the prompt's tokens from slot `start` on (the cache holds the ones before) into
        the static cache; returns the float32 logits of the last position and the new tokens' M-RoPE positions."""
        new = input_ids[:, start:]
        # Whether the prompt has padding: a host read before the tower is queued (a read after it would wait for it).
        attention_mask = model_kwargs.get("attention_mask")
        padded = attention_mask is not None and bool((attention_mask == 0).any())
        media = media_features(self, model_kwargs)  # placeholders and features agree (`_check_generate_inputs`)
        # Placeholders of a kind with no features are embedded as text, as stock does.
        modality = torch.zeros_like(new)
        visual, deepstack = None, ()
        if media:
            for kind, token, _, _ in media:
                modality += (new == token) * (1 if kind == "image" else 2)
            visual = torch.cat([features for _, _, features, _ in media])
            deepstack = [torch.cat(layer) for layer in zip(*(layers for _, _, _, layers in media))]
        positions = prompt_positions(self, input_ids, model_kwargs, start)
        logits = self._prefill_runner.run(new, attention_mask, positions, modality, visual, deepstack, padded, start)
        return logits, positions

    def _device_loop(self, input_ids, logits, plan, generation_config, streamer):
        """Sampling and EOS checks on the device, `steps_per_sync` steps per host read, one chunk queued ahead."""
        runner = self._runner
        pad_id = generation_config._pad_token_tensor
        runner.set_sampling(plan["temperature"], plan["top_k"], plan["top_p"], plan["eos_ids"], pad_id)
        batch = input_ids.shape[0]
        if plan["mode"] == "greedy":
            tokens = logits.argmax(dim=-1)
        else:  # the first token comes from the prefill logits, drawn with the same sampler eagerly
            tokens = sample_tokens(logits, runner.temperature[:batch], runner.top_k[:batch], runner.top_p[:batch])
        unfinished = ~(tokens[:, None] == runner.eos_ids).any(dim=-1)  # the in-graph rule, on the first token
        runner.unfinished[:batch] = unfinished
        sequences = [input_ids.cpu(), tokens[:, None].cpu()]
        if streamer is not None:
            streamer.put(sequences[-1][:, 0])
        remaining = plan["max_length"] - input_ids.shape[1] - 1
        if remaining > 0 and bool(unfinished.any()):
            runner.input_ids[:batch, 0] = tokens
            # One chunk ahead: the next chunk is queued before this one's tokens are read, so the GPU never waits for
            # the host. When every row finishes, the chunk already queued is computed and dropped.
            chunks, queued = deque(), 0
            while queued < remaining or chunks:
                while queued < remaining and len(chunks) < 2:
                    steps = min(runner.steps_per_sync, remaining - queued)
                    chunks.append((steps, runner.issue(steps, plan["mode"])))
                    queued += steps
                steps, handle = chunks.popleft()
                chunk, alive = runner.collect(handle)
                all_done = (~alive.any(dim=0)).nonzero()
                keep = int(all_done[0]) + 1 if len(all_done) else steps  # stock stops at the step all rows finish
                sequences.append(chunk[:, :keep])
                if streamer is not None:
                    for column in chunk[:, :keep].T:
                        streamer.put(column)
                if len(all_done):
                    break
        return self._finish(torch.cat(sequences, dim=1).to(input_ids.device), None, None, generation_config, streamer)

    def _host_loop(self, input_ids, logits, logits_processor, stopping_criteria, generation_config, streamer):
        """Transformers' `_sample` loop body with the runner's (graph-replayed) step as the forward."""
        keep_scores = generation_config.return_dict_in_generate and generation_config.output_scores
        keep_logits = generation_config.return_dict_in_generate and generation_config.output_logits
        pad_token_id = generation_config._pad_token_tensor
        has_eos_stopping_criteria = any(hasattr(criteria, "eos_token_id") for criteria in stopping_criteria)
        scores, raw_logits = [], []
        unfinished = torch.ones(input_ids.shape[0], dtype=torch.long, device=input_ids.device)
        while True:
            next_scores = logits_processor(input_ids, logits)
            if keep_scores:
                scores.append(next_scores)
            if keep_logits:
                raw_logits.append(logits)
            if generation_config.do_sample:
                next_tokens = torch.multinomial(nn.functional.softmax(next_scores, dim=-1), num_samples=1).squeeze(1)
            else:
                next_tokens = torch.argmax(next_scores, dim=-1)
            if has_eos_stopping_criteria:
                next_tokens = next_tokens * unfinished + pad_token_id * (1 - unfinished)
            input_ids = torch.cat([input_ids, next_tokens[:, None]], dim=-1)
            if streamer is not None:
                streamer.put(next_tokens.cpu())
            unfinished = unfinished & ~stopping_criteria(input_ids, tuple(scores) if keep_scores else None)
            if unfinished.max() == 0:
                break
            logits = self._runner.logits_step(next_tokens).clone()
        return self._finish(input_ids, scores if keep_scores else None, raw_logits if keep_logits else None,
                            generation_config, streamer)

    def _finish(self, sequences, scores, raw_logits, generation_config, streamer):
        cache = self._static_cache
        cache.set_length(sequences.shape[1] - 1)  # the last token is never fed back
        cache.tokens = sequences[:, :-1].clone()
        if streamer is not None:
            streamer.end()
        if generation_config.return_dict_in_generate:
            return generate_output(
                sequences, tuple(scores) if scores else None, tuple(raw_logits) if raw_logits else None,
                self._static_cache,
            )
        return sequences


def _same_weights(module: nn.Module, stock: nn.Module) -> nn.Module:
    """`module` holding the stock module's parameter tensors (no copy)."""
    module.load_state_dict(stock.state_dict(), assign=True)
    return module


def _check_generate_inputs(config, input_ids, kwargs) -> None:
    """Raise a `ValueError` that names the problem for inputs that would fail deep inside `generate` or, worse, inside
    a kernel: token ids outside the vocabulary, an attention mask of another shape, pixels without their grid, and
    image (video) placeholders in the prompt's uncached tokens that do not match the pixels' merged patches."""
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
    media = [(kind, token, kwargs.get(pixels), kwargs.get(f"{kind}_grid_thw"))
             for kind, token, pixels in (("image", config.image_token_id, "pixel_values"),
                                         ("video", config.video_token_id, "pixel_values_videos"))]
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


def _device_plan(logits_processor, stopping_criteria, generation_config) -> dict | None:
    """What the device loop needs to reproduce these processors and criteria, or None when it cannot.

    Covered: greedy, or sampling with temperature, top-k and top-p, each at most once and in that order (the
    sampler's, which is transformers' own when it builds them from the generation config), stopping on max length
    and up to MAX_EOS_IDS EOS ids. Anything else (other processors or orders, stop strings, custom criteria,
    returned scores) runs the host loop.
    """
    if generation_config.return_dict_in_generate and (generation_config.output_scores or generation_config.output_logits):
        return None
    plan = {"mode": "sample" if generation_config.do_sample else "greedy",
            "temperature": 1.0, "top_k": None, "top_p": None, "eos_ids": [], "max_length": None}
    applied = -1  # the sampler's step of the last warper seen
    for processor in logits_processor:
        kind = type(processor)
        if kind is TemperatureLogitsWarper:
            step, name, value = 0, "temperature", float(processor.temperature)
        elif kind is TopKLogitsWarper and processor.filter_value == -float("inf"):
            step, name, value = 1, "top_k", int(processor.top_k)
        elif kind is TopPLogitsWarper and processor.filter_value == -float("inf") and processor.min_tokens_to_keep == 1:
            step, name, value = 2, "top_p", float(processor.top_p)
        else:
            return None
        if step <= applied:
            return None
        applied, plan[name] = step, value
    if plan["mode"] == "greedy" and len(logits_processor):
        return None
    for criteria in stopping_criteria:
        if type(criteria) is MaxLengthCriteria:
            plan["max_length"] = criteria.max_length
        elif type(criteria) is EosTokenCriteria:
            plan["eos_ids"] = criteria.eos_token_id.tolist()
        else:
            return None
    if plan["max_length"] is None or len(plan["eos_ids"]) > MAX_EOS_IDS:
        return None
    return plan


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
