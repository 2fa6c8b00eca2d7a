"""The README's Usage code runs as written against a tiny converted checkpoint (CPU), and the model card shows the same
code."""

import re
from pathlib import Path

import pytest
import torch
import transformers
from PIL import Image
from transformers import AutoTokenizer, BatchFeature, Qwen2VLImageProcessor
from transformers.utils import is_torchvision_available

from conftest import image, save_stock_checkpoint
from qwen3vl_static.convert import convert
from qwen3vl_static.presets import tiny_inputs
from test_convert import HIDE_PACKAGE, run_child

README = Path(__file__).parents[1] / "README.md"
# The only text of the Usage that a test replaces: where the checkpoint is and where the image is.
USAGE_REPO = '"./qwen3-vl-2b-graph"'
USAGE_IMAGE = '"https://qianwen-res.oss-cn-beijing.aliyuncs.com/Qwen-VL/assets/demo.jpeg"'


def usage_block(markdown: str) -> str:
    """The first python block of the "## Usage" section."""
    section = markdown.split("\n## Usage\n", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    work = tmp_path_factory.mktemp("readme")
    return convert(str(save_stock_checkpoint(work / "stock")), str(work / "graph"))


@pytest.fixture(scope="module")
def usage(repo, tmp_path_factory):
    """The README's Usage code with the tiny checkpoint and a local image in place of the real ones."""
    picture = tmp_path_factory.mktemp("image") / "demo.png"
    image(64, 96).save(picture)
    code = usage_block(README.read_text(encoding="utf-8"))
    for text, local in ((USAGE_REPO, repo), (USAGE_IMAGE, picture)):
        assert code.count(text) == 1, text
        code = code.replace(text, repr(str(local)))
    return code


class ProcessorWithoutVideo:
    """Stands in for `AutoProcessor` where torchvision is missing (Qwen3VLProcessor needs it for the video processor it
    always builds): the processor's inputs for an image chat (`tiny_inputs`), from the repo's tokenizer and image
    processor."""

    def __init__(self, repo, **kwargs):
        self.tokenizer = AutoTokenizer.from_pretrained(repo, **kwargs)
        self.image_processor = Qwen2VLImageProcessor.from_pretrained(repo)

    @classmethod
    def from_pretrained(cls, repo, **kwargs):
        return cls(repo, **kwargs)

    def apply_chat_template(self, messages, **kwargs):
        images = [Image.open(part["url"]) for message in messages for part in message["content"] if part["type"] == "image"]
        return BatchFeature(tiny_inputs([messages], images, tokenizer=self.tokenizer, image_processor=self.image_processor))

    def batch_decode(self, *args, **kwargs):
        return self.tokenizer.batch_decode(*args, **kwargs)


def test_usage_runs(usage, monkeypatch, capsys):
    if not is_torchvision_available():
        monkeypatch.setattr(transformers, "AutoProcessor", ProcessorWithoutVideo)
    namespace = {}
    exec(compile(usage, "README.md, Usage", "exec"), namespace)
    model, inputs, output = namespace["model"], namespace["inputs"], namespace["output"]
    assert type(model).__name__ == "Qwen3VLGraphForConditionalGeneration" and model.dtype == torch.bfloat16
    assert inputs["image_grid_thw"].shape[0] == 1  # the image reached the model
    assert output.shape[1] > inputs["input_ids"].shape[1]
    assert capsys.readouterr().out.endswith("\n")


def test_usage_runs_where_the_package_is_not_installed(usage, tmp_path):
    """As a user without this package runs it: the repo's own code, and no prompt to trust custom code for the
    processor (standard input is closed: a prompt would print, then count as a refusal). Without torchvision (as on
    the CPU test machines) the processor line fails for that reason alone, after the model loaded."""
    result = run_child(HIDE_PACKAGE + usage, [], tmp_path)
    assert "Do you wish to run the custom code?" not in result.stdout + result.stderr
    if is_torchvision_available():
        assert result.returncode == 0, result.stderr
    else:
        assert result.returncode != 0, result.stdout
        # The traceback starts at the processor line (the model loaded) and ends at torchvision's absence.
        assert "AutoProcessor.from_pretrained(" in result.stderr, result.stderr
        assert "VideoProcessor requires the Torchvision library" in result.stderr, result.stderr


def test_model_card_shows_the_same_usage(repo):
    def without_repo_line(code):
        return re.sub(r"^repo = .*$", "repo = ...", code, count=1, flags=re.M)

    card = usage_block((repo / "README.md").read_text(encoding="utf-8"))
    assert f'repo = "{repo}"\n' in card
    assert without_repo_line(card) == without_repo_line(usage_block(README.read_text(encoding="utf-8")))
