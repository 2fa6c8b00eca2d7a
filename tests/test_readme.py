"""The README's Usage code runs as written against a tiny converted checkpoint (CPU), the model card shows the same
code, and the README's settings table is the one the config's docstring gives."""

import ast
import re
from pathlib import Path

import pytest
import torch
import transformers
from transformers.utils import is_torchvision_available

from conftest import image, save_stock_checkpoint
from qwen3vl_static.convert import convert
from qwen3vl_static.dataset_runner import ImageChatProcessor
from test_convert import HIDE_PACKAGE, run_child

README = Path(__file__).parents[1] / "README.md"
CONFIG_SOURCE = Path(__file__).parents[1] / "qwen3vl_static" / "configuration_qwen3vl_graph.py"
CONFIG_CLASS = "Qwen3VLGraphConfig"
SETTINGS_HEADER = ("| name | default | meaning |", "|---|---|---|")
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


def test_usage_runs(usage, monkeypatch, capsys):
    if not is_torchvision_available():
        monkeypatch.setattr(transformers, "AutoProcessor", ImageChatProcessor)  # the runner's, for the same reason
    namespace = {}
    exec(compile(usage, "README.md, Usage", "exec"), namespace)
    model, inputs, output = namespace["model"], namespace["inputs"], namespace["output"]
    assert type(model).__name__ == "Qwen3VLGraphForConditionalGeneration" and model.dtype == torch.bfloat16
    assert inputs["image_grid_thw"].shape[0] == 1  # the image reached the model
    assert output.shape[1] > inputs["input_ids"].shape[1]
    assert capsys.readouterr().out.endswith("\n")


@pytest.mark.slow  # a subprocess that imports torch and transformers
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


# -- The settings table: generated from the `Args:` section of `Qwen3VLGraphConfig`'s docstring ------------------------
# Read from the source (ast, no import), so the table is checked whatever else the package's import needs. To update the
# README after a field or its docs change: run `python -m pytest tests/test_readme.py`; the failure prints the table.


def _config_class(source: str) -> ast.ClassDef:
    return next(node for node in ast.walk(ast.parse(source)) if isinstance(node, ast.ClassDef) and node.name == CONFIG_CLASS)


def config_field_docs(source: str) -> list[tuple[str, str, str]]:
    """(name, default, meaning) of each entry of the class docstring's `Args:` section, in order. An entry reads
    `name (`type`, defaults to VALUE):` or `name (`type`, *optional*):` (default `None`), then its indented text."""
    lines = ast.get_docstring(_config_class(source)).splitlines()
    body = lines[lines.index("Args:") + 1 :]
    entries, indent = [], None
    for line in body:
        if not line.strip():
            continue
        depth = len(line) - len(line.lstrip())
        if indent is None:
            indent = depth
        if depth < indent:  # the next section
            break
        if depth == indent:
            match = re.fullmatch(r"(\w+) \((.*)\):", line.strip())
            assert match, f"not an `Args:` entry of {CONFIG_CLASS}: {line.strip()!r}"
            kind = match.group(2)
            default = kind.split("defaults to ", 1)[1].strip("`") if "defaults to " in kind else None
            assert default is not None or "*optional*" in kind, f"{match.group(1)}: no default in {kind!r}"
            entries.append([match.group(1), "None" if default is None else default, []])
        else:
            entries[-1][2].append(line.strip())
    return [(name, default, " ".join(text)) for name, default, text in entries]


def config_field_defaults(source: str) -> dict[str, str]:
    """The class body's declared fields (`name: type = value`) -> their default as source text."""
    return {node.target.id: ast.unparse(node.value).replace("'", '"')
            for node in _config_class(source).body
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None}


def settings_table(source: str) -> list[str]:
    """The README's settings table (Markdown lines) for the config source's `Args:` section."""
    def cell(text):
        return text.replace("|", "\\|")

    rows = [f"| `{name}` | `{default}` | {cell(meaning)} |" for name, default, meaning in config_field_docs(source)]
    return [*SETTINGS_HEADER, *rows]


def readme_settings_table(markdown: str) -> list[str]:
    """The table of the README's "## Settings" section: its first run of lines that start with `|`."""
    section = markdown.split("\n## Settings\n", 1)[1].split("\n## ", 1)[0]
    lines = section.splitlines()
    start = next(index for index, line in enumerate(lines) if line.startswith("|"))
    end = next((index for index in range(start, len(lines)) if not lines[index].startswith("|")), len(lines))
    return lines[start:end]


def test_readme_settings_table_is_the_config_docstring():
    expected = settings_table(CONFIG_SOURCE.read_text(encoding="utf-8"))
    found = readme_settings_table(README.read_text(encoding="utf-8"))
    assert found == expected, (
        "README.md's settings table differs from the `Args:` section of Qwen3VLGraphConfig's docstring "
        "(qwen3vl_static/configuration_qwen3vl_graph.py). Replace the table under \"## Settings\" with:\n\n"
        + "\n".join(expected) + "\n"
    )


def test_config_docstring_documents_every_field_with_its_default():
    source = CONFIG_SOURCE.read_text(encoding="utf-8")
    documented = {name: default for name, default, _ in config_field_docs(source)}
    assert documented == config_field_defaults(source)


def test_settings_table_parser():
    """The generator on a docstring of each entry form, and the README reader on a section between two others."""
    source = '''
class Qwen3VLGraphConfig:
    r"""
    Intro.

    Args:
        flag (`bool`, defaults to `True`):
            Turns a thing on | off
            when set.
        size (`int`, defaults to 8):
            Rows.
        names (`list[int]`, *optional*):
            Defaults to powers of two.
        mode (`str`, defaults to `"gemm"`):
            How.

    Returns:
        nothing
    """

    flag: bool = True
    size: int = 8
    names: list[int] | None = None
    mode: str = "gemm"
'''
    table = settings_table(source)
    assert table[2:] == [
        "| `flag` | `True` | Turns a thing on \\| off when set. |",
        "| `size` | `8` | Rows. |",
        "| `names` | `None` | Defaults to powers of two. |",
        "| `mode` | `\"gemm\"` | How. |",
    ]
    assert config_field_defaults(source) == {name: default for name, default, _ in config_field_docs(source)}
    markdown = "# x\n\n## Settings\n\nText.\n\n" + "\n".join(table) + "\n\nAfter.\n\n## Next\n\n| other |\n"
    assert readme_settings_table(markdown) == table
