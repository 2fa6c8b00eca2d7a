"""transformers' own Qwen3-VL model tests (`tests/models/qwen3_vl/test_modeling_qwen3_vl.py` with the common mixins
it imports) run on this package's config, base model and generation class.

The suite is not on PyPI (the source distribution lacks `tests/models` and `tests/generation`), so CI, which installs
from PyPI only, skips this file. Point `QWEN3VL_TRANSFORMERS_TESTS` at a transformers source tree of the installed
release (the folder holding `tests/` and `utils/`), e.g. a clone at the release's tag (about 30 s on two idle cores):

    QWEN3VL_TRANSFORMERS_TESTS=/path/to/transformers python -m pytest -q tests/test_transformers_suite.py

The swap happens here only: the upstream test classes are subclassed with this package's classes in their place.
Tests that fail for stock too on the same tree (a suite newer or older than the installed release) show as failures
here as well: compare against a run of the upstream file itself.
"""

import contextlib
import importlib
import importlib.util
import os
import sys
from pathlib import Path
from unittest import mock

import pytest

SOURCE = os.environ.get("QWEN3VL_TRANSFORMERS_TESTS")
SUITE = "tests/models/qwen3_vl/test_modeling_qwen3_vl.py"
if not SOURCE or not (Path(SOURCE) / SUITE).is_file():
    pytest.skip(f"set QWEN3VL_TRANSFORMERS_TESTS to a transformers source tree with {SUITE}", allow_module_level=True)

from qwen3vl_static import Qwen3VLGraphConfig, Qwen3VLGraphForConditionalGeneration, Qwen3VLGraphModel


def _upstream_module():
    """transformers' test module. Its files import each other as the package `tests`, which this repository's own
    test folder (no `__init__.py`: its modules import by their own names) would otherwise claim."""
    root = Path(SOURCE) / "tests"
    if SOURCE not in sys.path:  # some upstream files import the source tree's `utils` folder from its root
        sys.path.append(SOURCE)
    package = sys.modules.get("tests")
    if package is None or list(getattr(package, "__path__", ())) != [str(root)]:
        spec = importlib.util.spec_from_file_location("tests", root / "__init__.py",
                                                      submodule_search_locations=[str(root)])
        package = importlib.util.module_from_spec(spec)
        sys.modules["tests"] = package
        spec.loader.exec_module(package)
    return importlib.import_module("tests.models.qwen3_vl.test_modeling_qwen3_vl")


upstream = _upstream_module()
ConfigTester = importlib.import_module("tests.test_configuration_common").ConfigTester
_OURS = {"Qwen3VLConfig": Qwen3VLGraphConfig, "Qwen3VLModel": Qwen3VLGraphModel,
         "Qwen3VLForConditionalGeneration": Qwen3VLGraphForConditionalGeneration}


def _ours(cls):
    return _OURS.get(cls.__name__, cls)


def _ours_name(name):
    return _OURS[name].__name__ if name in _OURS else name


@pytest.fixture(autouse=True, scope="module")
def _our_names_in_the_auto_tables():
    """The mixins pick a class's role (base model, which labels a head takes) by its name in transformers' Auto
    tables: ours stand beside the stock names there while this file runs, as `AutoModel.register` would list them."""
    from transformers.models.auto import modeling_auto

    tables = [table for name, table in vars(modeling_auto).items()
              if name.startswith("MODEL") and name.endswith("_MAPPING_NAMES") and "qwen3_vl" in table]
    with contextlib.ExitStack() as stack:
        for table in tables:
            stack.enter_context(mock.patch.dict(table, {Qwen3VLGraphConfig.model_type: _ours_name(table["qwen3_vl"])}))
        yield


class GraphModelTester(upstream.Qwen3VLVisionText2TextModelTester):
    """The upstream tester with our classes: newer suites name them as class attributes, older ones build the stock
    config in `get_config`."""

    def get_config(self):
        config = super().get_config()
        return config if isinstance(config, Qwen3VLGraphConfig) else Qwen3VLGraphConfig(**config.to_dict())


for _attribute in ("config_class", "base_model_class", "conditional_generation_class"):
    if hasattr(GraphModelTester, _attribute):
        setattr(GraphModelTester, _attribute, _ours(getattr(GraphModelTester, _attribute)))


class TestQwen3VLGraphModel(upstream.Qwen3VLModelTest):
    model_tester_class = GraphModelTester  # newer suites build the tester and take the model classes from it
    pipeline_model_mapping = {}
    if upstream.Qwen3VLModelTest.all_model_classes:  # older suites list them here
        all_model_classes = tuple(map(_ours, upstream.Qwen3VLModelTest.all_model_classes))

    def setUp(self):
        super().setUp()
        # Older suites build the stock tester and config tester in `setUp`.
        self.model_tester = GraphModelTester(self)
        self.config_tester = ConfigTester(self, config_class=Qwen3VLGraphConfig, has_text_modality=False)
