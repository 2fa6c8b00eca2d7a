"""The package's classes, registered with transformers' Auto classes on import (`import qwen3vl_static` imports this
module). Not uploaded to the Hub."""

from transformers import AutoConfig, AutoModel, AutoModelForImageTextToText

from .cache_qwen3vl_graph import ASStaticCache
from .compat_qwen3vl_graph import AUTO_MODEL_FOR_VISION2SEQ
from .configuration_qwen3vl_graph import Qwen3VLGraphConfig
from .modeling_qwen3vl_graph import Qwen3VLGraphForConditionalGeneration, Qwen3VLGraphModel

AutoConfig.register(Qwen3VLGraphConfig.model_type, Qwen3VLGraphConfig, exist_ok=True)
AutoModel.register(Qwen3VLGraphConfig, Qwen3VLGraphModel, exist_ok=True)
AutoModelForImageTextToText.register(Qwen3VLGraphConfig, Qwen3VLGraphForConditionalGeneration, exist_ok=True)
if AUTO_MODEL_FOR_VISION2SEQ is not None:
    AUTO_MODEL_FOR_VISION2SEQ.register(Qwen3VLGraphConfig, Qwen3VLGraphForConditionalGeneration, exist_ok=True)

# save_pretrained copies the modeling files and writes `auto_map` only for classes registered this way.
Qwen3VLGraphConfig.register_for_auto_class("AutoConfig")
Qwen3VLGraphModel.register_for_auto_class("AutoModel")
Qwen3VLGraphForConditionalGeneration.register_for_auto_class("AutoModelForImageTextToText")
