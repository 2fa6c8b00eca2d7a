"""Qwen3VLGraphForConditionalGeneration: the stock Qwen3-VL model with a static-cache decode loop.

Same module tree and forward as `Qwen3VLForConditionalGeneration` (stock checkpoints load unchanged and what
this class saves loads into the stock class). `generate()` keeps all of transformers' input preparation
(M-RoPE positions, multimodal inputs, logits processors, stopping criteria); this class only
- hands generate its one persistent `ASStaticCache` (`_prepare_cache_for_generation`), and
- owns the decode loop (`_sample`): stock prefill into that cache, then `DecodeRunner` steps.
Anything the loop does not cover (beam search, assisted decoding, attention/hidden-state outputs, a cache
passed by the caller, ...) runs transformers' own code path.
"""

import threading

import torch
from torch import nn
from transformers.generation.configuration_utils import GenerationMode
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLForConditionalGeneration, Qwen3VLModel
from transformers.utils import logging

from .cache_qwen3vl_graph import ASStaticCache
from .compat_qwen3vl_graph import CACHE_KWARG, generate_output
from .configuration_qwen3vl_graph import Qwen3VLGraphConfig
from .graphs_qwen3vl_graph import DecodeRunner
from .vision_qwen3vl_graph import Qwen3VLGraphPatchEmbed

logger = logging.get_logger(__name__)

_LOOP_MODES = (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE)
_STEP_ATTENTION = ("sdpa", "eager")


class Qwen3VLGraphModel(Qwen3VLModel):
    """The stock base model under this package's config type (what `AutoModel` returns)."""

    config: Qwen3VLGraphConfig


class Qwen3VLGraphForConditionalGeneration(Qwen3VLForConditionalGeneration):
    config: Qwen3VLGraphConfig

    def __init__(self, config: Qwen3VLGraphConfig):
        super().__init__(config)
        visual = self.model.visual
        patch_embed = Qwen3VLGraphPatchEmbed(config.vision_config, mode=config.patch_embed_mode)
        patch_embed.load_state_dict(visual.patch_embed.state_dict(), assign=True)
        visual.patch_embed = patch_embed
        if config.allow_tf32:
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
        if config.cudnn_benchmark:
            torch.backends.cudnn.benchmark = True
        self._static_cache = None
        self._runner = None
        # One request at a time owns the cache and the runner's buffers.
        self._generate_lock = threading.RLock()

    def generate(self, *args, **kwargs):
        with self._generate_lock:
            return super().generate(*args, **kwargs)

    def save_pretrained(self, save_directory, *args, **kwargs):
        # Name every Auto class in `auto_map`, not only the ones the classes were registered for.
        self.config.auto_map = {**(getattr(self.config, "auto_map", None) or {}), **auto_map()}
        return super().save_pretrained(save_directory, *args, **kwargs)

    # transformers would wrap each decode step in torch.compile(mode="reduce-overhead") as soon as it sees a
    # static cache on CUDA: our loop never calls that step, and the fallback paths should not compile either.
    def _valid_auto_compile_criteria(self, model_kwargs, generation_config) -> bool:
        return False

    def static_cache(self) -> ASStaticCache:
        """The persistent KV cache, allocated on first use for the model's current device and dtype."""
        weight = self.model.language_model.embed_tokens.weight
        cache = self._static_cache
        if cache is None or cache.full_keys[0].device != weight.device or cache.full_keys[0].dtype != weight.dtype:
            self._static_cache = self._runner = None  # free the old cache before allocating the new one
            cache = ASStaticCache(
                self.config, self.config.max_batch_size, self.config.static_cache_len, weight.device, weight.dtype
            )
            self._static_cache = cache
            self._runner = DecodeRunner(self, cache, self.config.batch_buckets(), self.config.cache_buckets())
        return cache

    def _static_loop_blocker(self, generation_config, model_kwargs, generation_mode) -> str | None:
        """Why this call must run transformers' own loop, or None when the static loop covers it."""
        if generation_mode not in _LOOP_MODES:
            return f"generation mode {generation_mode.value!r}"
        if model_kwargs.get(CACHE_KWARG) is not None:
            return "a cache passed by the caller"
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
        if self.config.get_text_config(decoder=True)._attn_implementation not in _STEP_ATTENTION:
            return f"attn_implementation={self.config._attn_implementation!r}"
        return None

    def _prepare_cache_for_generation(
        self, generation_config, model_kwargs, generation_mode, batch_size, max_cache_length
    ):
        blocker = self._static_loop_blocker(generation_config, model_kwargs, generation_mode)
        if blocker is not None:
            logger.warning_once(f"{type(self).__name__}: {blocker} runs transformers' stock generation loop.")
            return super()._prepare_cache_for_generation(
                generation_config, model_kwargs, generation_mode, batch_size, max_cache_length
            )
        rows = batch_size * max(generation_config.num_beams, generation_config.num_return_sequences)
        cache = self.static_cache()
        cache.check_capacity(rows, max_cache_length)
        cache.activate(rows)
        model_kwargs[CACHE_KWARG] = cache

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
        if synced_gpus or model_kwargs.get(CACHE_KWARG) is not self._static_cache:
            return super()._sample(
                input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus, streamer, **model_kwargs
            )
        cache = self._static_cache
        runner = self._runner
        pad_token_id = generation_config._pad_token_tensor
        has_eos_stopping_criteria = any(hasattr(criteria, "eos_token_id") for criteria in stopping_criteria)
        keep_scores = generation_config.return_dict_in_generate and generation_config.output_scores
        keep_logits = generation_config.return_dict_in_generate and generation_config.output_logits
        scores, raw_logits = [], []
        unfinished = torch.ones(input_ids.shape[0], dtype=torch.long, device=input_ids.device)

        position_ids = model_kwargs["position_ids"]  # (4, B, S) from stock input preparation
        attention_mask = model_kwargs.get("attention_mask")
        outputs = self._prefill(input_ids, generation_config, model_kwargs)
        next_logits = outputs.logits[:, -1].to(copy=True, dtype=torch.float32, device=input_ids.device)
        del outputs
        runner.start(position_ids, attention_mask, input_ids.shape[1])
        while True:
            next_scores = logits_processor(input_ids, next_logits)
            if keep_scores:
                scores.append(next_scores)
            if keep_logits:
                raw_logits.append(next_logits)
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
            next_logits = runner.step(next_tokens).float()
        cache.set_length(runner.length)
        if streamer is not None:
            streamer.end()
        if generation_config.return_dict_in_generate:
            return generate_output(
                input_ids, tuple(scores) if keep_scores else None, tuple(raw_logits) if keep_logits else None, cache
            )
        return input_ids


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
