"""Turn a stock Qwen3-VL checkpoint into a ready custom-code repo for this package.

The weights, generation config and tokenizer/processor files are copied unchanged (the module tree is the
stock one), except that the image processor's config gets the processor class where it lacks it; what is new is
`config.json` (model type `qwen3_vl_graph` plus an `auto_map`), the module files that `trust_remote_code=True`
runs, and a model card. Not uploaded to the Hub.
"""

import inspect
import json
import re
import shutil
import sys
from pathlib import Path

import transformers
from huggingface_hub import HfApi, ModelCardData, snapshot_download
from huggingface_hub.repocard import metadata_load
from huggingface_hub.utils import tqdm
from transformers.dynamic_module_utils import get_relative_import_files

from .checkpoints import model_type, qwen3vl_config_file
from .configuration_qwen3vl_graph import Qwen3VLGraphConfig
from .modeling_qwen3vl_graph import Qwen3VLGraphForConditionalGeneration, auto_map

# Files of SRC that the conversion writes anew.
REPLACED = ("config.json", "README.md")
# What AutoProcessor reads from `preprocessor_config.json` to build the processor, as the Hub's Qwen3-VL repos name it.
# An image processor saved on its own names no processor class: AutoProcessor would then load the tokenizer alone.
PROCESSOR_NAMES = {"processor_class": "Qwen3VLProcessor", "image_processor_type": "Qwen2VLImageProcessor"}


def hub_module_files() -> list[Path]:
    """The package files that travel with a checkpoint: the modeling file and what it imports relatively.

    The same rule as `save_pretrained` (transformers' `custom_object_save`), so both write the same files.
    """
    modeling = Path(inspect.getfile(Qwen3VLGraphForConditionalGeneration))
    return [modeling, *map(Path, get_relative_import_files(modeling))]


def convert(src: str, dst: str, push_to_hub: str | None = None, private: bool = False) -> Path:
    """Write the custom-code version of checkpoint `src` (a folder or a Hub repo id) to folder `dst`.

    Everything is checked before anything is written. `dst` must be new, empty, or a previous conversion (a
    `config.json` of model type `qwen3_vl_graph`), which is replaced as a whole. The result is built in the
    hidden sibling folder `.<name>.partial` and then renamed, so `dst` is never left half written. With
    `push_to_hub`, the finished folder is uploaded to that repo id (created if needed, `private` if new).
    Returns the absolute path of `dst`.
    """
    folder = Path(dst).resolve()
    _check_destination(folder)
    src_dir, hub_id = _source_folder(src)
    config = _graph_config(src_dir / "config.json")
    files = [
        path
        for path in sorted(src_dir.rglob("*"))
        if path.is_file()
        # Hidden folders hold download or git metadata; top-level .py files are SRC's own custom code.
        and not any(part.startswith(".") for part in path.relative_to(src_dir).parts[:-1])
        and not (path.parent == src_dir and (path.name in REPLACED or path.suffix == ".py"))
    ]

    build = folder.with_name(f".{folder.name}.partial")  # a sibling: the final rename stays on one filesystem
    shutil.rmtree(build, ignore_errors=True)  # left over from an interrupted run
    build.mkdir(parents=True)
    try:
        _copy(files, src_dir, build)
        _name_processor(build / "preprocessor_config.json")
        config.save_pretrained(build)
        for module in hub_module_files():
            shutil.copyfile(module, build / module.name)
        card = _model_card(config, hub_id, src_dir, push_to_hub or dst)
        (build / "README.md").write_text(card, encoding="utf-8")
        if folder.exists():
            shutil.rmtree(folder)
        build.rename(folder)
    except BaseException:
        shutil.rmtree(build, ignore_errors=True)
        raise

    if push_to_hub:
        try:
            api = HfApi()
            api.create_repo(push_to_hub, private=private, exist_ok=True)
            api.upload_folder(
                repo_id=push_to_hub, folder_path=folder, commit_message=f"Convert {src} for qwen3vl-static"
            )
        except Exception as error:
            private_flag = " --private" if private else ""
            raise RuntimeError(
                f"could not push {folder} to the Hub as {push_to_hub}: {error}; the converted folder {folder} is "
                f"complete and can be pushed later with `hf upload{private_flag} {push_to_hub} {folder} .`"
            ) from error
    return folder


def _check_destination(dst: Path) -> None:
    if dst.exists() and not dst.is_dir():
        raise ValueError(f"DST {dst} exists and is not a folder")
    if dst.is_dir() and any(dst.iterdir()) and model_type(dst / "config.json") != Qwen3VLGraphConfig.model_type:
        raise ValueError(
            f"DST {dst} is not empty and is not a previous conversion (no config.json of model type "
            f"{Qwen3VLGraphConfig.model_type!r}); choose a new or empty folder"
        )


def _source_folder(src: str) -> tuple[Path, str | None]:
    """SRC's checked local folder and, when SRC is a Hub repo id, that id (config.json is checked before the rest
    is downloaded)."""
    config_file, hub_id = qwen3vl_config_file(src, "SRC")
    return (config_file.parent if hub_id is None else Path(snapshot_download(src))), hub_id


def _graph_config(config_file: Path) -> Qwen3VLGraphConfig:
    """SRC's config as this package's config: all its values, our model type, architecture and auto_map."""
    values = json.loads(config_file.read_text(encoding="utf-8"))
    for key in ("model_type", "auto_map", "architectures"):
        values.pop(key, None)
    config = Qwen3VLGraphConfig.from_dict(values)
    config.architectures = [Qwen3VLGraphForConditionalGeneration.__name__]
    config.auto_map = auto_map()
    return config


def _copy(files: list[Path], src_dir: Path, build: Path) -> None:
    with tqdm(total=sum(path.stat().st_size for path in files), unit="B", unit_scale=True, desc="Copying") as bar:
        for path in files:
            target = build / path.relative_to(src_dir)
            target.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "rb") as reader, open(target, "wb") as writer:
                while chunk := reader.read(1 << 24):
                    writer.write(chunk)
                    bar.update(len(chunk))


def _name_processor(preprocessor_config: Path) -> None:
    """Add the `PROCESSOR_NAMES` that the image processor's config lacks (a config that has them stays unchanged)."""
    if not preprocessor_config.is_file():
        return
    values = json.loads(preprocessor_config.read_text(encoding="utf-8"))
    if PROCESSOR_NAMES.keys() <= values.keys():
        return
    values = {**PROCESSOR_NAMES, **values}
    preprocessor_config.write_text(json.dumps(values, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _field_docs() -> dict[str, str]:
    """Each setting's description from `Qwen3VLGraphConfig`'s docstring, the one place they are documented."""
    docs, name = {}, None
    for line in inspect.getdoc(Qwen3VLGraphConfig).splitlines():
        if match := re.match(r" {4}(\w+) \(", line):
            name = match.group(1)
            docs[name] = ""
        elif name and line.startswith(" " * 8):
            docs[name] = f"{docs[name]} {line.strip()}".strip()
        else:
            name = None
    return docs


def _model_card(config: Qwen3VLGraphConfig, hub_id: str | None, src_dir: Path, repo: str) -> str:
    source_card = (metadata_load(src_dir / "README.md") if (src_dir / "README.md").is_file() else None) or {}
    data = ModelCardData(
        library_name="transformers",
        pipeline_tag="image-text-to-text",
        base_model=hub_id,
        tags=["qwen3_vl", "custom_code", "cuda-graphs", "static-cache"],
        # The weights keep their license.
        **{key: source_card[key] for key in ("license", "license_name", "license_link") if key in source_card},
    )
    source = f"[{hub_id}](https://huggingface.co/{hub_id})" if hub_id else "a Qwen3-VL checkpoint"
    fields = "\n".join(
        f"| `{name}` | `{json.dumps(getattr(config, name))}` | {doc} |" for name, doc in _field_docs().items()
    )
    return CARD.format(
        front_matter=data.to_yaml(),
        source=source,
        repo=repo,
        fields=fields,
        version=sys.modules[__package__].__version__,  # the package's own version (its __init__)
        transformers=transformers.__version__,
    )


CARD = """---
{front_matter}
---

# Qwen3-VL with a static-cache, CUDA-graph decode loop

This is {source} converted with qwen3vl-static {version} (transformers {transformers}): the same weights, tokenizer,
processor and generation config, with custom code whose `generate()` decodes on one persistent static KV cache and
replays each decode step as a captured CUDA graph. Only `config.json` (model type `qwen3_vl_graph`) and the `*.py`
files are new (and `preprocessor_config.json` names its processor class where the source's did not).

## Usage

Besides transformers, this needs accelerate (for `device_map`) and torchvision built for your torch (Qwen3-VL's
processor always builds its video processor, which needs it): `pip install accelerate torch torchvision` installs a
matching pair.

```python
import torch
from transformers import AutoModelForImageTextToText, AutoProcessor

repo = "{repo}"
model = AutoModelForImageTextToText.from_pretrained(
    repo, trust_remote_code=True, dtype=torch.bfloat16, device_map="auto"
)
processor = AutoProcessor.from_pretrained(repo, trust_remote_code=True)

messages = [{{"role": "user", "content": [
    {{"type": "image", "url": "https://qianwen-res.oss-cn-beijing.aliyuncs.com/Qwen-VL/assets/demo.jpeg"}},
    {{"type": "text", "text": "Describe this image."}},
]}}]
inputs = processor.apply_chat_template(
    messages, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt"
).to(model.device)
output = model.generate(**inputs, max_new_tokens=128)
print(processor.batch_decode(output[:, inputs["input_ids"].shape[1]:], skip_special_tokens=True)[0])
```

`trust_remote_code=True` is required: the model type `qwen3_vl_graph` is unknown to transformers itself, so
loading without it fails instead of silently falling back to the stock model. The processor is transformers' own
`Qwen3VLProcessor`; `AutoProcessor` takes the flag too because on transformers 5.x its tokenizer step reads
`config.json`, whose model type only this repo's configuration code knows.

Capture the CUDA graphs ahead of time, e.g. before a server takes requests, so that no request pays for a
capture:

```python
model.warmup()  # every batch-size x cache-length bucket of the settings below
```

The settings below can be changed when loading, e.g.
`from_pretrained(repo, trust_remote_code=True, max_batch_size=4, static_cache_len=8192)`.

## Settings (`config.json`)

| field | value here | meaning |
|---|---|---|
{fields}

## Speed-ups

- The decode loop runs on one KV cache allocated once, at fixed addresses, so every decode step can be a CUDA
  graph replay: no per-token Python, dispatch or kernel-launch overhead, which dominates decoding at small batch
  sizes.
- Graphs exist per batch-size bucket and per KV-length bucket; a step attends only to the cache slots of its
  length bucket, not to the whole `static_cache_len`.
- On CUDA the decode step runs fused Triton kernels (QKV projection + QK-norm + RoPE + KV write, flash-decoding
  attention, projection + residual add + RMSNorm, gate/up + SwiGLU, the rotary tables, and the step's end: argmax
  or the drawn token, EOS, padding), each in the form that measured fastest on the device at first use.
- The host queues the next chunk of decode steps before it reads one, so the GPU does not wait for it.
- The vision tower keeps each image size's position tables and, on CUDA, replays CUDA graphs: a single image at
  its exact size, several images padded to a patch-count bucket (padding patches are masked out); its patch
  embedding runs as one matrix product, its residual adds are fused with the LayerNorms, and its GELU runs as the
  epilogue of the MLP's first matmul.
- Prefill runs the language model on fixed-shape tensors (no host syncs) and, on CUDA, replays CUDA graphs per
  prompt-length bucket; a prompt without padding needs only causal attention, and a padded batch's padding is
  neutralised by the attention mask.
- `generate()`'s input preparation, logits processors and stopping criteria are transformers' own.

Measured speed-ups depend on the GPU, batch size and lengths; the numbers, and how they are measured, live in the
qwen3vl-static project's `bench/README.md`.

## Limitations

- The fast loop covers greedy decoding and sampling. Beam search, assisted decoding, `output_attentions` /
  `output_hidden_states`, `prefill_chunk_size`, a cache of another kind passed by the caller and attention
  implementations other than `sdpa` / `eager` run transformers' stock loop (with a warning): correct, without the
  speed-up.
- One `generate()` call takes at most `max_batch_size` sequences, and prompt + `max_new_tokens` - 1 must fit in
  `static_cache_len`; otherwise it raises a `ValueError` that names the setting to raise.
- The KV cache is allocated at full size (`max_batch_size` x `static_cache_len`) on first use and kept; a cache
  returned by `generate()` is that persistent cache. Passed back with a chat's next turn (the first turn's sequences
  plus new text), it is continued and only the new tokens are prefilled; a call that does not pass it back starts
  it afresh.
- Calls to `generate()` on one model run one at a time.
- CUDA graphs need a CUDA device; on the CPU, or with `use_cuda_graphs` off, the same loop runs eagerly.
"""
