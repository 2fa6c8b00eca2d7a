"""The dataset runner behind `python -m qwen3vl_static run MODEL --input requests.jsonl --output answers.jsonl`.
Not uploaded to the Hub.

One chat request per input line, `{"id": ..., "messages": [...], "max_new_tokens": ..., ...}` (any of the
continuous-batching request settings besides the messages): the messages take transformers' chat format, images as
`{"type": "image", "image" | "url" | "path": <path | URL | base64 data>}` (a relative path is relative to the
input file), rendered by
the model's processor. Requests run by continuous batching (`init_continuous_batching`) while later lines are read
and rendered; each answer is written and flushed as soon as it finishes, `{"id", "answer", "generated_tokens",
"error": null}`, so a killed run loses nothing written, and a rerun skips the ids the output already answers. A line
that cannot run (bad JSON, no id or messages, an image that does not load, a request the model refuses) becomes an
`{"id", "error"}` record; the others go on.
"""

import json
import time
from pathlib import Path

import torch
from transformers import BatchFeature
from transformers.generation.continuous_batching.requests import RequestStatus
from transformers.image_utils import load_image
from transformers.utils.logging import tqdm

from .batching_qwen3vl_graph import REQUEST_SETTINGS
from .compat_qwen3vl_graph import TAKES_MM_TOKEN_TYPE_IDS


# The keys of an image part in transformers' chat format, each a path, URL or base64 data.
IMAGE_KEYS = ("image", "url", "path", "base64")


class ImageChatProcessor:
    """The Qwen3-VL processor's chat rendering for text and images, from the tokenizer and the image processor alone:
    where the full processor cannot load (its video processor needs torchvision)."""

    def __init__(self, tokenizer, image_processor):
        self.tokenizer, self.image_processor = tokenizer, image_processor
        self.image_token = "<|image_pad|>"  # Qwen's placeholder, one per merged patch
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)

    @classmethod
    def from_pretrained(cls, model_path, **kwargs):
        from transformers import AutoTokenizer, Qwen2VLImageProcessor

        # Qwen2VLImageProcessor falls back to PIL without torchvision.
        return cls(AutoTokenizer.from_pretrained(model_path, **kwargs), Qwen2VLImageProcessor.from_pretrained(model_path))

    def apply_chat_template(self, messages, **_):
        """The processor's outputs for one chat (`tokenize=True, add_generation_prompt=True, return_dict=True`)."""
        parts = [part for message in messages for part in _parts(message)]
        if any(part.get("type") == "video" for part in parts):
            raise ValueError("videos need the model's full processor (its video processor needs torchvision)")
        images = [load_image(next(part[key] for key in IMAGE_KEYS if key in part)) for part in parts
                  if part.get("type") == "image"]
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        inputs = {}
        if images:
            encoded = self.image_processor(images=images, return_tensors="pt")
            inputs.update(pixel_values=encoded["pixel_values"], image_grid_thw=encoded["image_grid_thw"])
            counts = iter((encoded["image_grid_thw"].prod(-1) // self.image_processor.merge_size**2).tolist())
            pieces = text.split(self.image_token)
            text = pieces[0] + "".join(self.image_token * next(counts) + piece for piece in pieces[1:])
        input_ids = torch.tensor([self.tokenizer(text, add_special_tokens=False)["input_ids"]])
        inputs.update(input_ids=input_ids, attention_mask=torch.ones_like(input_ids))
        if TAKES_MM_TOKEN_TYPE_IDS:
            inputs["mm_token_type_ids"] = (input_ids == self.image_token_id).int()
        return BatchFeature(inputs)

    def decode(self, tokens, **kwargs):
        return self.tokenizer.decode(tokens, **kwargs)

    def batch_decode(self, sequences, **kwargs):
        return self.tokenizer.batch_decode(sequences, **kwargs)


def load_processor(model_path):
    """The model's processor, or `ImageChatProcessor` where it cannot load (no torchvision)."""
    from transformers import AutoProcessor

    try:
        return AutoProcessor.from_pretrained(model_path)
    except ImportError:
        return ImageChatProcessor.from_pretrained(model_path)


def answered_ids(output_path: Path) -> set:
    """Ids the output already answers (a rerun skips them). Error records are dropped from the file (their lines run
    again), and so is a last line cut short by a killed run, so the records appended next start on a line of their
    own."""
    if not output_path.exists():
        return set()
    lines = [line for line in output_path.read_text().split("\n") if line]
    kept = []
    for line in lines:
        try:
            record = json.loads(line)
            if record["error"] is None:
                kept.append((record["id"], line))
        except (ValueError, KeyError, TypeError):
            continue
    if len(kept) != len(lines):
        output_path.write_text("".join(f"{line}\n" for _, line in kept))
    return {request_id for request_id, _ in kept}


def render(processor, line: str, base: Path) -> tuple:
    """(id, settings, model inputs) of one input line; raises ValueError naming what is wrong with it."""
    try:
        record = json.loads(line)
    except ValueError as error:
        raise ValueError(f"not a JSON object: {error}") from None
    if not isinstance(record, dict) or "id" not in record or not isinstance(record.get("messages"), list):
        raise ValueError('a request is a JSON object with an "id" and a "messages" list')
    request_id = str(record["id"])
    unknown = set(record) - {"id", "messages", *REQUEST_SETTINGS}
    if unknown:
        raise _Failed(request_id, f"unknown fields {sorted(unknown)} (a request takes id, messages and "
                                  f"{', '.join(REQUEST_SETTINGS)})")
    messages = [_with_local_paths(message, base) for message in record["messages"]]
    try:
        inputs = processor.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=True,
                                               return_tensors="pt")
    except Exception as error:  # noqa: BLE001 - an image that does not load, a template that fails: this line's error
        raise _Failed(request_id, f"{type(error).__name__}: {error}") from None
    settings = {key: record[key] for key in REQUEST_SETTINGS if key in record}
    return request_id, settings, dict(inputs)


class _Failed(ValueError):
    def __init__(self, request_id, message):
        super().__init__(message)
        self.request_id = request_id


def run_dataset(model, processor, input_path, output_path, progress: bool = True, **settings) -> dict:
    """Answer every request of `input_path` not yet in `output_path` (see the module docstring); `settings` apply to
    every request (a line's own win). Returns counts: answered, failed, skipped, generated tokens, seconds."""
    input_path, output_path = Path(input_path), Path(output_path)
    done = answered_ids(output_path)
    counts = {"answered": 0, "failed": 0, "skipped": 0, "generated_tokens": 0}
    manager = model.init_continuous_batching(max_queue_size=2 * model.config.max_batch_size)
    began = time.perf_counter()
    seen = set()
    with output_path.open("a") as out, tqdm(desc="Answering", unit="request", disable=not progress) as bar:
        def write(record):
            out.write(json.dumps(record) + "\n")
            out.flush()
            counts["failed" if record["error"] else "answered"] += 1
            bar.update(1)
            seconds = time.perf_counter() - began
            bar.set_postfix(requests_per_s=f"{bar.n / seconds:.2f}", tokens_per_s=f"{counts['generated_tokens'] / seconds:.0f}")

        def take(result):
            if result.status == RequestStatus.FINISHED:
                counts["generated_tokens"] += len(result.generated_tokens)
                write({"id": result.request_id, "answer": processor.decode(result.generated_tokens, skip_special_tokens=True),
                       "generated_tokens": len(result.generated_tokens), "error": None})
            else:
                write({"id": result.request_id, "error": result.error})

        manager.start()
        try:
            with input_path.open() as lines:
                for number, line in enumerate(lines, 1):
                    if not line.strip():
                        continue
                    try:
                        request_id, own, inputs = render(processor, line, input_path.parent)
                        if request_id in done:
                            counts["skipped"] += 1
                            continue
                        if request_id in seen:
                            raise _Failed(request_id, "another line of the input has this id")
                        seen.add(request_id)
                        manager.add_request(**inputs, request_id=request_id, **{**settings, **own})
                    except _Failed as error:
                        write({"id": error.request_id, "error": str(error)})
                    except ValueError as error:
                        write({"id": f"line {number}", "error": str(error)})
                    while (result := manager.get_result(timeout=0)) is not None:
                        take(result)
        finally:
            manager.stop(block=False)
        for result in manager:
            take(result)
        manager.join()
    if manager.error is not None:
        raise RuntimeError("the continuous batch stopped on an error") from manager.error
    counts["seconds"] = time.perf_counter() - began
    return counts


def _parts(message) -> list:
    content = message.get("content")
    return content if isinstance(content, list) else []


def _with_local_paths(message, base: Path) -> dict:
    """The message with each relative image path made relative to the input file's folder."""
    parts = []
    for part in _parts(message):
        for key in ("image", "path"):
            source = part.get(key) if isinstance(part, dict) else None
            if isinstance(source, str) and not source.startswith(("http://", "https://", "data:")) and (base / source).is_file():
                part = {**part, key: str(base / source)}
        parts.append(part)
    return {**message, "content": parts} if parts else message
