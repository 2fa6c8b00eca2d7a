"""`python -m qwen3vl_static convert`: a stock checkpoint becomes a custom-code repo that loads and generates like
the stock model where this package is not installed, from a folder or by repo id from the Hub cache (CPU, tiny)."""

import ast
import hashlib
import inspect
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from transformers import Qwen3VLForConditionalGeneration

import qwen3vl_static
from conftest import AUTO_MAP, assert_clean, chat, image, save_stock_checkpoint
from qwen3vl_static import Qwen3VLGraphConfig, Qwen3VLGraphForConditionalGeneration
from qwen3vl_static.cli import main
from qwen3vl_static.compat_qwen3vl_graph import portable_config_dict
from qwen3vl_static.convert import PROCESSOR_NAMES, convert, hub_module_files
from qwen3vl_static.presets import tiny_inputs

# Package files that stay home; every other module is needed by the custom code on the Hub.
HOME_ONLY = {"__init__.py", "__main__.py", "auto_classes.py", "checkpoints.py", "cli.py", "convert.py", "dataset_runner.py",
             "engine_process.py", "fp8_quantize.py", "gc_pauses.py", "media.py", "pixels.py", "presets.py", "server.py",
             "workloads.py"}
PACKAGE = Path(qwen3vl_static.__file__).parent
HUB_MODULES = {
    path.name for path in PACKAGE.glob("*.py") if path.name not in HOME_ONLY and not path.name.startswith("bench")
}

# Run first in the children that play a machine without this package: its import must fail.
HIDE_PACKAGE = """
import sys

class HidePackage:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] == "qwen3vl_static":
            raise ImportError(f"{name} is hidden in this test")

sys.meta_path.insert(0, HidePackage())
"""

LOAD_AND_GENERATE = HIDE_PACKAGE + """
import torch
import transformers
from transformers import AutoConfig

where, prompt, result, auto_class = sys.argv[1:]
config = AutoConfig.from_pretrained(where, trust_remote_code=True)
model = getattr(transformers, auto_class).from_pretrained(where, trust_remote_code=True)
tokens = model.generate(**torch.load(prompt), do_sample=False, max_new_tokens=12)
torch.save({
    "model_type": config.model_type,
    "class": type(model).__name__,
    "module": type(model).__module__,
    "tokens": tokens,
    "package_imported": any(name.partition(".")[0] == "qwen3vl_static" for name in sys.modules),
}, result)
"""

LOAD_WITHOUT_TRUST = HIDE_PACKAGE + """
from transformers import AutoModelForImageTextToText

AutoModelForImageTextToText.from_pretrained(sys.argv[1])
"""


def hf_env(tmp_path, **extra):
    """An environment with private, offline Hugging Face caches, so no test reads or writes the user's."""
    env = {key: value for key, value in os.environ.items() if not key.startswith(("HF_", "HUGGINGFACE_"))}
    home = tmp_path / "hf_home"
    env.update(HF_HOME=str(home), HF_MODULES_CACHE=str(home / "modules"), HF_HUB_OFFLINE="1", **extra)
    env.pop("PYTHONPATH", None)
    return env


def run(args, tmp_path, **env):
    return subprocess.run(
        [sys.executable, *map(str, args)], cwd=tmp_path, env=hf_env(tmp_path, **env),
        stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300,
    )


def run_child(script, args, tmp_path, **env):
    """Run `script` from a folder outside the repo, with `qwen3vl_static` unimportable."""
    path = tmp_path / "child.py"
    path.write_text(script)
    return run([path, *args], tmp_path, **env)


def error_line(result):
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 1 and len(lines) == 1, result.stderr
    return lines[0]


def add_to_hub_cache(cache, repo_id, folder):
    """Lay out `folder` as `snapshot_download(repo_id)` leaves it in the Hub cache: snapshot + refs/main."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    commit = hashlib.sha1(repo_id.encode()).hexdigest()
    shutil.copytree(folder, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return save_stock_checkpoint(tmp_path_factory.mktemp("stock") / "src")


@pytest.fixture(scope="module")
def dst(src, tmp_path_factory):
    work = tmp_path_factory.mktemp("convert")
    result = run(["-m", "qwen3vl_static", "convert", src, work / "dst"], work)
    assert result.returncode == 0, result.stderr
    return work / "dst"


@pytest.fixture(scope="module")
def prompt(tmp_path_factory):
    """A left-padded batch with an image, saved for the children."""
    path = tmp_path_factory.mktemp("prompt") / "prompt.pt"
    torch.save(tiny_inputs([[chat("image", "What is in the picture?")], [chat("Hello")]], images=[image(64, 96)]), path)
    return path


@pytest.fixture(scope="module")
def expected_tokens(src, prompt):
    stock = Qwen3VLForConditionalGeneration.from_pretrained(src)
    return stock.generate(**torch.load(prompt), do_sample=False, max_new_tokens=12)


def assert_loads_and_generates_like_stock(where, prompt, expected_tokens, tmp_path, auto_class="AutoModelForImageTextToText", **env):
    result = run_child(LOAD_AND_GENERATE, [where, prompt, tmp_path / "result.pt", auto_class], tmp_path, **env)
    assert result.returncode == 0, result.stderr
    got = torch.load(tmp_path / "result.pt")
    assert not got["package_imported"]
    assert got["model_type"] == "qwen3_vl_graph"
    assert got["class"] == "Qwen3VLGraphForConditionalGeneration"
    assert got["module"].startswith("transformers_modules")  # the folder's copy of the code
    assert got["tokens"].tolist() == expected_tokens.tolist()


def test_convert_writes_a_custom_code_repo(src, dst):
    copied = {path.name for path in src.iterdir()} - {"config.json", "README.md"}
    assert {path.name for path in dst.iterdir()} == copied | HUB_MODULES | {"config.json", "README.md"}
    unchanged = copied - {"preprocessor_config.json"}
    assert all((dst / name).read_bytes() == (src / name).read_bytes() for name in unchanged)  # weights included
    # The image processor's config gains what AutoProcessor needs to build the processor, as the Hub's repos have it.
    processor = json.loads((src / "preprocessor_config.json").read_text())
    assert "processor_class" not in processor
    assert json.loads((dst / "preprocessor_config.json").read_text()) == {**PROCESSOR_NAMES, **processor}
    assert {path.name for path in hub_module_files()} == HUB_MODULES
    assert all((dst / name).read_bytes() == (PACKAGE / name).read_bytes() for name in HUB_MODULES)
    assert not list(dst.parent.glob(".*partial"))

    config = json.loads((dst / "config.json").read_text())
    assert config["model_type"] == "qwen3_vl_graph"
    assert config["architectures"] == ["Qwen3VLGraphForConditionalGeneration"]
    assert config["auto_map"] == AUTO_MAP
    stock = portable_config_dict(json.loads((src / "config.json").read_text()))
    for key in stock.keys() - {"model_type", "architectures", "transformers_version"}:
        assert config[key] == stock[key], key

    readme = (dst / "README.md").read_text()
    front_matter = readme.split("---\n")[1]
    assert "library_name: transformers" in front_matter and "pipeline_tag: image-text-to-text" in front_matter
    assert "base_model" not in front_matter  # SRC was a folder
    for usage in ("AutoModelForImageTextToText", "trust_remote_code=True", "AutoProcessor", ".generate(", ".warmup("):
        assert usage in readme
    assert all(f"`{field}`" in readme for field in inspect.get_annotations(Qwen3VLGraphConfig))
    assert "bench/README.md" in readme


def test_custom_code_imports_only_torch_transformers_and_the_standard_library():
    """What travels to the Hub imports torch, transformers, the standard library, optionally Triton, and its siblings
    (one-level relative imports): nothing else is sure to be installed where it loads."""
    for path in hub_module_files():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        roots = {alias.name.partition(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                 for alias in node.names}
        roots |= {node.module.partition(".")[0] for node in ast.walk(tree)
                  if isinstance(node, ast.ImportFrom) and node.level == 0}
        assert roots - set(sys.stdlib_module_names) <= {"torch", "transformers", "triton"}, path.name
        assert all(node.level <= 1 for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)), path.name


# AutoModelForVision2Seq exists on transformers <= 4.57 only; converted repos name it for those users.
@pytest.mark.slow  # a subprocess that imports torch and transformers
@pytest.mark.parametrize("auto_class", ["AutoModelForImageTextToText", "AutoModelForVision2Seq"])
def test_folder_loads_without_the_package(dst, prompt, expected_tokens, tmp_path, auto_class):
    if not hasattr(transformers, auto_class):
        pytest.skip(f"transformers {transformers.__version__} has no {auto_class}")
    assert_loads_and_generates_like_stock(dst, prompt, expected_tokens, tmp_path, auto_class)


@pytest.mark.slow  # a subprocess that imports torch and transformers
def test_repo_id_loads_from_offline_hub_cache(dst, prompt, expected_tokens, tmp_path):
    add_to_hub_cache(tmp_path / "hub", "someone/tiny-qwen3-vl-graph", dst)
    assert_loads_and_generates_like_stock(
        "someone/tiny-qwen3-vl-graph", prompt, expected_tokens, tmp_path, HF_HUB_CACHE=str(tmp_path / "hub")
    )


@pytest.mark.slow  # a subprocess that imports torch and transformers
def test_forgetting_trust_remote_code_fails(dst, tmp_path):
    # The model type is unknown to transformers, so this cannot fall back to the stock model silently.
    result = run_child(LOAD_WITHOUT_TRUST, [dst], tmp_path)
    assert result.returncode != 0
    assert "trust_remote_code=True" in result.stderr


@pytest.mark.slow  # a subprocess that imports torch and transformers
def test_failed_push_leaves_a_complete_folder(src, dst, tmp_path):
    # Converting by repo id from the offline Hub cache works; the push cannot.
    add_to_hub_cache(tmp_path / "hub", "stock-org/tiny-qwen3-vl", src)
    out = tmp_path / "out"
    result = run(
        ["-m", "qwen3vl_static", "convert", "stock-org/tiny-qwen3-vl", out, "--push-to-hub", "someone/repo"],
        tmp_path, HF_HUB_CACHE=str(tmp_path / "hub"), HF_ENDPOINT="http://127.0.0.1:9",
    )
    line = error_line(result)
    assert "could not push" in line and "someone/repo" in line and "is complete" in line
    assert sorted(path.name for path in out.iterdir()) == sorted(path.name for path in dst.iterdir())
    assert "base_model: stock-org/tiny-qwen3-vl" in (out / "README.md").read_text()
    _, info = Qwen3VLGraphForConditionalGeneration.from_pretrained(out, output_loading_info=True)
    assert_clean(info)


@pytest.mark.parametrize(
    ("config", "message"), [(None, "has no config.json"), ({"model_type": "llava"}, "model_type 'llava'")]
)
def test_bad_source_is_refused_before_writing(tmp_path, capsys, config, message):
    bad = tmp_path / "bad"
    bad.mkdir()
    if config:
        (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        convert(str(bad), str(tmp_path / "out"))
    assert main(["convert", str(bad), str(tmp_path / "out")]) == 1
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_destination_must_be_new_empty_or_a_previous_conversion(src, tmp_path):
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="not a previous conversion"):
        convert(src, taken)
    assert [path.name for path in taken.iterdir()] == ["notes.txt"]

    out = tmp_path / "out"
    out.mkdir()
    convert(src, out)  # empty: fine
    (out / "stale.bin").write_text("left over")
    convert(src, out)  # a previous conversion: replaced as a whole
    assert not (out / "stale.bin").exists() and (out / "model.safetensors").exists()
