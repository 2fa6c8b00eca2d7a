"""Checkpoints move between the stock class and ours unchanged, and `import qwen3vl_static` registers the Auto
classes (CPU, tiny model)."""

import contextlib
import inspect
import json
import logging
import re
from pathlib import Path

import pytest
import torch
import transformers
from safetensors import safe_open
from transformers import AutoConfig, GenerationMixin, LlamaConfig, Qwen3VLForConditionalGeneration, Qwen3VLModel
from transformers.dynamic_module_utils import get_relative_imports

from qwen3vl_static import Qwen3VLGraphConfig, Qwen3VLGraphForConditionalGeneration, Qwen3VLGraphModel
from qwen3vl_static.convert import hub_module_files
from conftest import AUTO_MAP, assert_clean, save_stock_checkpoint

MODEL_TYPE_WARNING = "You are using a model of type"


@contextlib.contextmanager
def transformers_messages():
    """What transformers logs meanwhile. Its library logger does not propagate to the root logger (nor to caplog)."""
    messages = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: messages.append(record.getMessage())
    library = logging.getLogger("transformers")
    library.addHandler(handler)
    try:
        yield messages
    finally:
        library.removeHandler(handler)


def tensor_names(folder):
    with safe_open(str(folder / "model.safetensors"), "pt") as weights:
        return set(weights.keys())


@pytest.fixture(scope="module")
def stock_folder(tmp_path_factory):
    return save_stock_checkpoint(tmp_path_factory.mktemp("stock"))


@pytest.fixture(scope="module")
def ours(stock_folder):
    model, info = Qwen3VLGraphForConditionalGeneration.from_pretrained(stock_folder, output_loading_info=True)
    assert_clean(info)
    return model


@pytest.fixture(scope="module")
def ours_folder(ours, tmp_path_factory):
    folder = tmp_path_factory.mktemp("ours")
    ours.save_pretrained(folder)
    return folder


def test_stock_checkpoint_loads_into_our_class(ours, stock_folder):
    # Tied weights: the stock checkpoint has no lm_head tensor, so the head must share the embedding's storage.
    assert ours.lm_head.weight.data_ptr() == ours.model.language_model.embed_tokens.weight.data_ptr()
    stock = Qwen3VLForConditionalGeneration.from_pretrained(stock_folder).state_dict()
    assert ours.state_dict().keys() == stock.keys()
    assert all(torch.equal(tensor, stock[name]) for name, tensor in ours.state_dict().items())


def test_stock_checkpoint_loads_without_a_model_type_warning(stock_folder, tmp_path):
    # A stock Qwen3-VL checkpoint is what this class loads; a genuinely different model type is refused before a
    # model is built (transformers only warns, then builds a default-size Qwen3-VL: GBs).
    with transformers_messages() as messages:
        Qwen3VLGraphForConditionalGeneration.from_pretrained(stock_folder)
    assert not [message for message in messages if MODEL_TYPE_WARNING in message], messages
    LlamaConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=4).save_pretrained(tmp_path)
    for loader in (Qwen3VLGraphConfig, Qwen3VLGraphForConditionalGeneration):
        with pytest.raises(ValueError, match="holds a 'llama' checkpoint, not a Qwen3-VL one"):
            loader.from_pretrained(tmp_path)


def test_our_checkpoint_loads_into_stock_class(ours, ours_folder, stock_folder):
    assert tensor_names(ours_folder) == tensor_names(stock_folder)  # same layout as a stock save
    stock, info = Qwen3VLForConditionalGeneration.from_pretrained(ours_folder, output_loading_info=True)
    assert_clean(info)
    expected = ours.state_dict()
    assert stock.state_dict().keys() == expected.keys()
    assert all(torch.equal(tensor, expected[name]) for name, tensor in stock.state_dict().items())


def test_saved_folder_is_a_custom_code_repo(ours_folder):
    config = json.loads((ours_folder / "config.json").read_text())
    assert config["model_type"] == "qwen3_vl_graph"
    assert config["auto_map"] == AUTO_MAP
    # The same module files as `convert`, unchanged.
    modules = {path.name: path for path in hub_module_files()}
    assert {path.name for path in ours_folder.glob("*.py")} == modules.keys()
    assert all((ours_folder / name).read_bytes() == path.read_bytes() for name, path in modules.items())


def test_generation_class_names_generation_mixin_directly():
    """transformers checks a custom-code class's direct bases for `GenerationMixin` (its own tests do too); a subclass
    of the stock class has it only further up."""
    assert GenerationMixin in Qwen3VLGraphForConditionalGeneration.__bases__


LICENSE_HEADER = re.compile(
    r"# Copyright (\d{4}) The qwen3vl-static Authors\. All rights reserved\.\n#\n"
    r"# Licensed under the Apache License, Version 2\.0 \(the \"License\"\);\n"
    r"# you may not use this file except in compliance with the License\.\n"
    r"# You may obtain a copy of the License at\n#\n#     http://www\.apache\.org/licenses/LICENSE-2\.0\n#\n"
    r"# Unless required by applicable law or agreed to in writing, software\n"
    r"# distributed under the License is distributed on an \"AS IS\" BASIS,\n"
    r"# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied\.\n"
    r"# See the License for the specific language governing permissions and\n"
    r"# limitations under the License\.\n"
)


def test_every_custom_code_file_starts_with_the_license_header():
    """The files that travel to the Hub say their license as transformers' own files do; transformers' model tests
    read a model's year from its configuration file's first `# Copyright YEAR` line (older than 2023: some skipped)."""
    for path in hub_module_files():
        header = LICENSE_HEADER.match(path.read_text(encoding="utf-8"))
        assert header is not None, f"{path.name} does not start with the license header"
        assert int(header.group(1)) >= 2025
    configuration = Path(inspect.getfile(Qwen3VLGraphConfig)).read_text(encoding="utf-8")
    assert re.search(r"^# Copyright (\d{4})", configuration, re.MULTILINE).group(1) == "2026"


def test_modeling_file_imports_every_custom_code_file_itself():
    """transformers 4.57 copies into its module cache only the files the modeling file imports directly (later
    releases follow imports recursively): a file reached only through another would be missing there."""
    modeling, *others = hub_module_files()
    assert set(get_relative_imports(modeling)) == {path.stem for path in others}


def test_from_pretrained_overrides_settings(ours_folder):
    model = Qwen3VLGraphForConditionalGeneration.from_pretrained(ours_folder, max_batch_size=2, static_cache_len=64)
    assert (model.config.max_batch_size, model.config.static_cache_len) == (2, 64)
    cache = model.static_cache()  # the overrides reach the one allocation
    assert (cache.rows, cache.capacity) == (2, 64)


@pytest.mark.parametrize(
    ("auto_class", "expected"),
    [
        ("AutoModel", Qwen3VLGraphModel),
        ("AutoModelForImageTextToText", Qwen3VLGraphForConditionalGeneration),
        ("AutoModelForVision2Seq", Qwen3VLGraphForConditionalGeneration),
    ],
)
def test_import_registers_auto_classes(ours_folder, auto_class, expected):
    if not hasattr(transformers, auto_class):
        pytest.skip(f"transformers {transformers.__version__} has no {auto_class}")
    # No trust_remote_code: the registered local classes, not the folder's copies of them.
    assert type(AutoConfig.from_pretrained(ours_folder)) is Qwen3VLGraphConfig
    model, info = getattr(transformers, auto_class).from_pretrained(ours_folder, output_loading_info=True)
    assert type(model) is expected
    # Loads as the stock class of the same role loads the same files (transformers 4.57's base Qwen3VLModel
    # cannot read a ...ForConditionalGeneration checkpoint; 5.x's can).
    stock_class = Qwen3VLModel if expected is Qwen3VLGraphModel else Qwen3VLForConditionalGeneration
    _, stock_info = stock_class.from_pretrained(ours_folder, output_loading_info=True)
    assert {key: sorted(value) for key, value in info.items() if key != "error_msgs"} == {
        key: sorted(value) for key, value in stock_info.items() if key != "error_msgs"
    }
    if transformers.__version__ >= "5":
        assert_clean(info)
