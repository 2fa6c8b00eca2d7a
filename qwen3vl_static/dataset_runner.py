"""The dataset runner behind `python -m qwen3vl_static run MODEL --input requests.jsonl --output answers.jsonl`.
Not uploaded to the Hub.

One chat request per input line, `{"id": ..., "messages": [...], "max_new_tokens": ..., ...}` (any of the
continuous-batching request settings besides the messages): the messages take transformers' chat format, images as
`{"type": "image", "image" | "url" | "path": <path | URL | base64 data>}` (a relative path is relative to the
input file), rendered by
the model's processor. Requests run by continuous batching (`init_continuous_batching`) while later lines are read
and rendered; each answer is written and flushed as soon as it finishes, `{"id", "answer", "generated_tokens",
"error": null}`, so a killed run loses nothing written, and a rerun skips the ids the output already answers. A line
that cannot run (bad JSON, no id or messages, an id an earlier line has, an image file that is missing or does not
load, a request the model refuses) becomes an `{"id", "error"}` record whose error names its line; the others go on.
Ctrl-C cancels the requests in flight and ends the batch (answers finished by then are written). When the run ends
the output is rewritten in input order.

Under `torchrun --nproc-per-node N` (one model per GPU) each rank takes a share of the requests by estimated cost
(`share_out`), writes its answers as they finish to a part file of its own (`part_path`), and rank 0 merges the parts
into the output in input order once every rank is done; a rerun skips what the output and any part file answer.
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
from .presets import pil_image_processor_class


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
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(model_path, **kwargs),
                   pil_image_processor_class().from_pretrained(model_path))

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


def read_records(path: Path) -> list:
    """The whole records of an output or part file, `(line, record)`, in file order (a line cut short by a killed run
    is not one)."""
    records = []
    for line in path.read_text().splitlines() if path.exists() else ():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and {"id", "error"} <= record.keys():
            records.append((line, record))
    return records


def answered_ids(output_path: Path) -> set:
    """Ids the output already answers (a rerun skips them). Error records are dropped from the file (their lines run
    again), and so is a last line cut short by a killed run, so the records appended next start on a line of their
    own."""
    if not output_path.exists():
        return set()
    kept = [(line, record) for line, record in read_records(output_path) if record["error"] is None]
    if len(kept) != len(output_path.read_text().splitlines()):
        output_path.write_text("".join(f"{line}\n" for line, _ in kept))
    return {record["id"] for _, record in kept}


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
    try:
        messages = [_with_local_paths(message, base) for message in record["messages"]]
        inputs = processor.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=True,
                                               return_tensors="pt")
    except Exception as error:  # noqa: BLE001 - a missing or unreadable image, a failing template: this line's error
        raise _Failed(request_id, f"{type(error).__name__}: {error}") from None
    settings = {key: record[key] for key in REQUEST_SETTINGS if key in record}
    return request_id, settings, dict(inputs)


class _Failed(ValueError):
    def __init__(self, request_id, message):
        super().__init__(message)
        self.request_id = request_id


def request_cost(line: str, default_new_tokens: int) -> int:
    """A request line's estimated cost, to share requests out across ranks: its text (about 4 characters a token),
    256 tokens an image, and its answer tokens."""
    try:
        record = json.loads(line)
        images = sum(part.get("type") == "image" for message in record["messages"] for part in _parts(message))
        return len(json.dumps(record["messages"])) // 4 + 256 * images + int(record.get("max_new_tokens") or
                                                                              default_new_tokens)
    except (ValueError, KeyError, TypeError, AttributeError):
        return 1  # it becomes an error record


def share_out(costs, world: int) -> list:
    """The rank of each request: the costliest first, each to the least loaded rank so far (ties: input order, the
    lowest rank). Every rank computes the same answer from the same input."""
    loads, ranks = [0] * world, [0] * len(costs)
    for index in sorted(range(len(costs)), key=lambda index: -costs[index]):
        rank = min(range(world), key=lambda rank: loads[rank])
        ranks[index], loads[rank] = rank, loads[rank] + costs[index]
    return ranks


def part_path(output_path: Path, rank: int) -> Path:
    """Where rank `rank` of a data-parallel run writes its answers as they finish (merged into the output at the end)."""
    return output_path.with_name(f"{output_path.name}.rank{rank}")


def parts_of(output_path: Path) -> list:
    return sorted(output_path.parent.glob(f"{output_path.name}.rank*"))


def run_dataset(model, processor, input_path, output_path, progress: bool = True, rank: int = 0, world: int = 1,
                max_batch_size: int | None = None, **settings) -> dict:
    """Answer every request of `input_path` not yet answered in `output_path` (or the part files of an earlier
    data-parallel run; see the module docstring); `settings` apply to every request (a line's own win). With `world`
    ranks, this rank answers its share (`share_out`) into its part file, for rank 0 to merge when all are done;
    alone, it leaves the output in input order (`merge_in_input_order`). `max_batch_size`: the requests decoded at
    once (default: as many as fit in the GPU's memory, `init_continuous_batching`). Returns counts: answered, failed,
    skipped, generated tokens, seconds."""
    input_path, output_path = Path(input_path), Path(output_path)
    target = output_path if world == 1 else part_path(output_path, rank)
    # Only the file this rank appends to is cleaned; the others (other ranks' parts, the output) are only read.
    done = answered_ids(target) | {record["id"] for path in {output_path, *parts_of(output_path)} - {target}
                                   for _, record in read_records(path) if record["error"] is None}
    lines = input_path.read_text().splitlines()
    default_new_tokens = settings.get("max_new_tokens") or model.generation_config.max_new_tokens or 128
    ranks = share_out([request_cost(line, default_new_tokens) for line in lines], world)
    counts = {"answered": 0, "failed": 0, "skipped": 0, "generated_tokens": 0}
    mine = sum(1 for number, line in enumerate(lines) if line.strip() and ranks[number] == rank)
    manager = model.init_continuous_batching(max_batch_size=max_batch_size, requests=max(mine, 1),
                                             tokenizer=getattr(processor, "tokenizer", None))
    # Lines render (their images decoded) while rows decode, two rows' worth ahead, not the whole file at once.
    manager.input_queue.maxsize = 2 * model.config.max_batch_size
    began = time.perf_counter()
    first = first_lines(lines)  # a later line with the same id fails, on every run and whichever rank it falls to
    pending = {}  # ids added and not yet written: their line numbers
    with target.open("a") as out, tqdm(desc=f"Answering (rank {rank})" if world > 1 else "Answering", unit="request",
                                       disable=not progress) as bar:
        def write(record):
            out.write(json.dumps(record) + "\n")
            out.flush()
            counts["failed" if record["error"] else "answered"] += 1
            bar.update(1)
            seconds = time.perf_counter() - began
            bar.set_postfix(requests_per_s=f"{bar.n / seconds:.2f}", tokens_per_s=f"{counts['generated_tokens'] / seconds:.0f}")

        def take(result):
            number = pending.pop(result.request_id)
            if result.status == RequestStatus.FINISHED:
                counts["generated_tokens"] += len(result.generated_tokens)
                write({"id": result.request_id, "answer": processor.decode(result.generated_tokens, skip_special_tokens=True),
                       "generated_tokens": len(result.generated_tokens), "error": None})
            else:
                write({"id": result.request_id, "error": f"line {number}: {result.error}"})

        manager.start()
        try:
            for number, line in enumerate(lines, 1):
                if not line.strip() or ranks[number - 1] != rank:
                    continue
                try:
                    request_id, own, inputs = render(processor, line, input_path.parent)
                    if first[request_id] != number:
                        raise ValueError(f"line {first[request_id]} of the input has the id {request_id!r} already")
                    if request_id in done:
                        counts["skipped"] += 1
                        continue
                    manager.add_request(**inputs, request_id=request_id, **{**settings, **own})
                    pending[request_id] = number
                except _Failed as error:
                    write({"id": error.request_id, "error": f"line {number}: {error}"})
                except ValueError as error:
                    write({"id": f"line {number}", "error": str(error)})
                while (result := manager.get_result(timeout=0)) is not None:
                    take(result)
            manager.stop(block=False)
            for result in manager:
                take(result)
        except KeyboardInterrupt:
            # Ctrl-C: the batch ends at its next chunk, not after every request added, and its thread is joined (a
            # thread still running at exit aborts the process); answers that finished meanwhile are written.
            for request_id in pending:
                manager.cancel_request(request_id)
            manager.stop()
            while (result := manager.get_result(timeout=0)) is not None:
                if result.status == RequestStatus.FINISHED:
                    take(result)
            raise
        finally:
            manager.stop(block=False)
        manager.join()
    if manager.error is not None:
        raise RuntimeError(f"the continuous batch stopped on an error: {type(manager.error).__name__}: "
                           f"{manager.error}") from manager.error
    if world == 1:  # else rank 0 merges once every rank is done
        merge_in_input_order(input_path, output_path)
    counts["seconds"] = time.perf_counter() - began
    return counts


def merge_in_input_order(input_path, output_path) -> None:
    """Rewrite the output with its records and the part files' in input order (an id's answer over its errors; a
    bad line's error record, named by its line, at that line), then remove the part files. Written beside and
    renamed into place: the output is never left half written."""
    input_path, output_path = Path(input_path), Path(output_path)
    parts = parts_of(output_path)
    records = {}
    for path in [output_path, *parts]:
        for _, record in read_records(path):
            held = records.get(record["id"])
            if held is None or held["error"] is not None:  # an answer is never replaced by an error
                records[record["id"]] = record
    lines = input_path.read_text().splitlines()
    order = first_lines(lines)
    for number in range(1, len(lines) + 1):
        order.setdefault(f"line {number}", number)
    ranked = sorted(records.values(), key=lambda record: order.get(record["id"], len(order) + 1))
    staging = output_path.with_name(f"{output_path.name}.merging")
    staging.write_text("".join(json.dumps(record) + "\n" for record in ranked))
    staging.replace(output_path)
    for part in parts:
        part.unlink()


def first_lines(lines) -> dict:
    """Each request id's first line number (from 1) in the input's `lines`."""
    first = {}
    for number, line in enumerate(lines, 1):
        try:
            first.setdefault(str(json.loads(line)["id"]), number)
        except (ValueError, KeyError, TypeError):
            pass
    return first


def _parts(message) -> list:
    content = message.get("content")
    return content if isinstance(content, list) else []


def _with_local_paths(message, base: Path) -> dict:
    """The message with each relative image path made relative to the input file's folder. Raises ValueError for a
    path that names no file (base64 data has no "."; without this, transformers reads it as bad base64)."""
    parts = []
    for part in _parts(message):
        for key in ("image", "path"):
            source = part.get(key) if isinstance(part, dict) else None
            if isinstance(source, str) and not source.startswith(("http://", "https://", "data:")):
                path = base / Path(source).expanduser()
                if path.is_file():
                    part = {**part, key: str(path)}
                elif "." in source:
                    raise ValueError(f"image file not found: {source!r} (looked for {path}; a relative path is "
                                     f"relative to the input file's folder)")
        parts.append(part)
    return {**message, "content": parts} if parts else message
