"""Checks on a checkpoint named on the command line, made before torch and transformers are imported: a folder that
is not a Qwen3-VL checkpoint is refused at once, before a model of the wrong kind is built. Not uploaded to the Hub."""

import json
from pathlib import Path

# Stock Qwen3-VL, and this package's conversion of it (Qwen3VLGraphConfig.model_type).
QWEN3VL_MODEL_TYPES = ("qwen3_vl", "qwen3_vl_graph")


def model_type(config_file: Path) -> str | None:
    try:
        return json.loads(Path(config_file).read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None


def qwen3vl_config_file(name: str, role: str) -> tuple[Path, str | None]:
    """The checked `config.json` of Qwen3-VL checkpoint `name` (a folder, or a Hub repo id whose config.json alone is
    downloaded) and, for a Hub repo id, that id. `role` names the argument in errors (SRC, MODEL)."""
    if Path(name).is_dir():
        config_file, hub_id = Path(name) / "config.json", None
    elif Path(name).exists():
        raise ValueError(f"{role} {name} is a file, not a checkpoint folder or a Hub repo id")
    else:
        from huggingface_hub import hf_hub_download
        from huggingface_hub.utils import HFValidationError, validate_repo_id

        try:
            validate_repo_id(name)
        except HFValidationError:
            raise ValueError(f"{role} {name}: no such folder (nor a Hub repo id: NAME or OWNER/NAME)") from None
        try:
            config_file, hub_id = Path(hf_hub_download(name, "config.json")), name
        except Exception as error:  # noqa: BLE001 - not found, offline, gated: said in one line
            raise ValueError(f"{role} {name} is neither a checkpoint folder nor a downloadable Hub repo id: "
                             f"{type(error).__name__}: {error}") from None
    if not config_file.is_file():
        raise ValueError(f"{role} {name} has no config.json: not a transformers checkpoint")
    found = model_type(config_file)
    if found not in QWEN3VL_MODEL_TYPES:
        raise ValueError(f"{role} {name} has model_type {found!r} in its config.json; only Qwen3-VL checkpoints "
                         f"(model_type {' or '.join(map(repr, QWEN3VL_MODEL_TYPES))}) are supported")
    return config_file, hub_id
