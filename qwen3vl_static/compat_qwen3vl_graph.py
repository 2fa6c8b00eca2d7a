"""The one place that knows how transformers releases differ for this package.

Everything else asks this module instead of testing versions: 5.24 renamed the cache keyword from
`past_key_values` to `cache` (forward arguments, generate's model kwargs and its output), and
`AutoModelForVision2Seq` exists only up to 4.57.
"""

import dataclasses
import inspect

import transformers
from transformers.generation.utils import GenerateDecoderOnlyOutput
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLForConditionalGeneration

# Keyword under which generate() hands the KV cache to forward() and keeps it in its model kwargs.
CACHE_KWARG = "cache" if "cache" in inspect.signature(Qwen3VLForConditionalGeneration.forward).parameters else "past_key_values"

# Field of GenerateDecoderOnlyOutput that returns the cache.
_OUTPUT_CACHE_FIELD = "cache" if "cache" in {f.name for f in dataclasses.fields(GenerateDecoderOnlyOutput)} else "past_key_values"

# Auto classes the package registers with / names in `auto_map` (Vision2Seq for transformers <= 4.57 users).
AUTO_MODEL_FOR_VISION2SEQ = getattr(transformers, "AutoModelForVision2Seq", None)


def generate_output(sequences, scores, logits, cache) -> GenerateDecoderOnlyOutput:
    """`GenerateDecoderOnlyOutput` as the installed transformers spells it."""
    return GenerateDecoderOnlyOutput(sequences=sequences, scores=scores, logits=logits, **{_OUTPUT_CACHE_FIELD: cache})
