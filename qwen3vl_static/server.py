"""The OpenAI-compatible HTTP server behind `python -m qwen3vl_static serve MODEL`. Not uploaded to the Hub; needs
the `serve` extra (FastAPI, uvicorn, httpx).

Endpoints (vLLM's shapes): `POST /v1/chat/completions` (text and `image_url` parts, streaming as server-sent events),
`POST /v1/completions` (a text prompt), `GET /v1/models`, `GET /health`, `GET /metrics` (the batch's counters in
Prometheus' text format). Every choice of a request is one streaming request of the model's continuous-batching
manager, so requests join the running batch as they arrive.

Processes (as vLLM's API servers and engine core): `serve` starts the engine process (`engine_process.py`: the model
and its batch, nothing else) and several HTTP processes that share the listening socket; each parses, fetches and
decodes images, runs the processor, computes the prompt's M-RoPE positions and streams its own clients' tokens, so
none of that takes the interpreter lock the batch's thread needs. What can be checked before a request enters the
batch is (the body, the model name, images, the prompt's and the answer's length against a cache row, the queue), and
answered with an OpenAI-style error, `{"error": {"message", "type", "param", "code"}}`, whose message says what to
change. A client that disconnects cancels its choices, freeing their rows; on SIGINT / SIGTERM the HTTP processes stop
accepting connections and let the requests in flight finish, then the batch stops.
"""

import asyncio
import itertools
import json
import logging
import multiprocessing
import os
import secrets
import signal
import socket
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from typing import Annotated, Literal

import httpx
import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationError, field_validator
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from transformers.generation.continuous_batching.requests import RequestStatus

from .batching_qwen3vl_graph import prompt_position_ids
from .engine_process import EngineClient, EngineProcess
from .gc_pauses import GcPauses, freeze_startup_heap
from .media import MediaError, MediaLimits, decode_image, fetch_image_data
from .pixels import PixelNormalizer, as_uint8

logger = logging.getLogger(__name__)

ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 405: "BadRequestError",
               413: "RequestTooLargeError", 503: "ServiceUnavailableError"}
RENDER_NICENESS = 10  # how far below the other threads the render threads run (`render_pool`)


# The batch's counters (`GraphBatchingManager.stats`) at GET /metrics: name, scale, help.
METRICS = {
    "prefill_ms": ("qwen3vl_static_gpu_prefill_seconds_total", 1e-3,
                   "GPU time in prefills (beside decode steps, sharing the GPU, while rows decode)"),
    "decode_ms": ("qwen3vl_static_gpu_decode_seconds_total", 1e-3, "GPU time in decode steps"),
    "activation_wait_ms": ("qwen3vl_static_gpu_activation_wait_seconds_total", 1e-3,
                           "GPU time decoding rows waited for a prefill beside them to finish as its rows began"),
    "activation_slack_ms": ("qwen3vl_static_gpu_activation_slack_seconds_total", 1e-3,
                            "GPU time from a prefill beside decoding rows finishing to its rows beginning"),
    "host_wait_ms": ("qwen3vl_static_host_wait_seconds_total", 1e-3, "time the batch's thread waited for the GPU"),
    "admit_host_ms": ("qwen3vl_static_admit_host_seconds_total", 1e-3,
                      "time the batch's thread spent admitting requests (their prefills issued)"),
    "take_in_ms": ("qwen3vl_static_take_in_seconds_total", 1e-3,
                   "time the batch's thread spent taking requests in (their checks and positions)"),
    "media_ahead_host_ms": ("qwen3vl_static_media_ahead_host_seconds_total", 1e-3,
                            "time the batch's thread spent issuing the vision tower ahead of admissions"),
    "chunks": ("qwen3vl_static_decode_chunks_total", 1, "chunks of decode steps (each read by the host at once)"),
    "steps": ("qwen3vl_static_decode_steps_total", 1, "decode steps"),
    "request_steps": ("qwen3vl_static_decode_request_steps_total", 1, "decode steps of rows that held a request"),
    "prefills": ("qwen3vl_static_prefills_total", 1, "prefill launches"),
    "eager_prefills": ("qwen3vl_static_eager_prefills_total", 1,
                       "prefill launches run eagerly although graphs are on (no graph bucket fits their rows)"),
    "prefills_beside": ("qwen3vl_static_prefills_beside_total", 1, "prefill launches while rows decoded (beside them)"),
    "admitted": ("qwen3vl_static_admitted_requests_total", 1, "requests that entered the batch"),
    "admission_wait_ms": ("qwen3vl_static_admission_wait_seconds_total", 1e-3,
                          "time the admitted requests waited from reaching the batch to their prefill's launch"),
    "queued_ms": ("qwen3vl_static_admission_queued_seconds_total", 1e-3,
                  "of the admission wait, the time the admitted requests waited to be taken in by the batch's thread"),
    "first_token_ms": ("qwen3vl_static_first_token_read_seconds_total", 1e-3,
                       "time the admitted requests waited from their prefill's launch to the batch reading their first "
                       "token"),
    "encoded_ahead": ("qwen3vl_static_requests_encoded_ahead_total", 1,
                      "requests whose images the vision tower encoded beside a decode chunk, before they entered"),
    "encoded_at_admission": ("qwen3vl_static_requests_encoded_at_admission_total", 1,
                             "requests whose images the vision tower encoded as they entered"),
    "stall_ms": ("qwen3vl_static_gpu_decode_stall_seconds_total", 1e-3,
                 "GPU time between two decode chunks while requests went on decoding: no step of theirs queued"),
    "long_stalls": ("qwen3vl_static_decode_long_stalls_total", 1,
                    "gaps between decode chunks of 10 ms or more while requests went on decoding"),
    "gathering_turns": ("qwen3vl_static_gathering_turns_total", 1,
                        "turns of the batch that held waiting requests back, to enter together beside many decoding "
                        "rows"),
    "engine_cpu_s": ("qwen3vl_static_engine_cpu_seconds_total", 1, "CPU time of the engine process"),
    "engine_gc_ms": ("qwen3vl_static_engine_gc_pause_seconds_total", 1e-3,
                     "time the engine process stood still in Python's garbage collector"),
    "engine_gc_full": ("qwen3vl_static_engine_gc_full_collections_total", 1,
                       "the garbage collector's passes over the oldest generation in the engine process"),
}


@dataclass(frozen=True)
class ServerLimits:
    max_waiting: int = 256  # requests (choices) waiting for a row, beyond the rows; past it: 503
    max_body_bytes: int = 50 * 2**20
    max_images: int = 8  # per request


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": ERROR_TYPES.get(self.status, "InternalServerError"),
                          "param": self.param, "code": self.status}}


# -- request bodies -----------------------------------------------------------------------------------------------


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a field this server does not implement is refused, not ignored


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ImageURL(_Body):
    url: str
    detail: str | None = None  # accepted; the processor sizes images itself


class ImagePart(_Body):
    type: Literal["image_url"]
    image_url: ImageURL


Part = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class Message(_Body):
    role: Literal["system", "user", "assistant"]
    # Tagged by the input's kind: a wrong part is reported alone, not beside "not a string".
    content: Annotated[Annotated[str, Tag("string")] | Annotated[list[Part], Tag("parts")],
                       Discriminator(lambda content: "string" if isinstance(content, str) else "parts")]
    name: str | None = None


class StreamOptions(_Body):
    include_usage: bool = False


class _Generation(_Body):
    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1)
    stop: str | list[str] | None = Field(None, validate_default=True)  # always a list once validated
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)  # -1 or 0: no top-k
    min_p: float | None = Field(None, ge=0, le=1)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0)  # vLLM's extra parameter: transformers' penalty
    ignore_eos: bool = False  # vLLM's extra parameters (its benchmark sends ignore_eos)
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    seed: int | None = None
    max_tokens: int | None = Field(None, ge=1)
    user: str | None = None

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, stop):
        stops = [stop] if isinstance(stop, str) else stop or []
        if not all(stops):
            raise ValueError("stop strings must not be empty")
        return stops

    def sampling(self) -> dict:
        """The manager's sampling settings and penalties the request sets (a request that sets a sampling setting
        samples; temperature 0: greedy)."""
        settings = {"temperature": self.temperature, "top_p": self.top_p, "min_p": self.min_p,
                    "top_k": None if self.top_k is None else max(self.top_k, 0),
                    "presence_penalty": self.presence_penalty, "frequency_penalty": self.frequency_penalty,
                    "repetition_penalty": self.repetition_penalty}
        return {key: value for key, value in settings.items() if value is not None}


class ChatRequest(_Generation):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    # Features this server does not have, which some clients send switched off: taken when off, refused when on.
    logprobs: bool | None = None
    top_logprobs: int | None = None
    logit_bias: dict | None = None
    tools: list | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict | None = None

    @field_validator("logprobs", "top_logprobs", "logit_bias", "tools", "tool_choice", "response_format")
    @classmethod
    def _off(cls, value, info):
        if value in (None, False, 0, [], {}, "none") or (info.field_name == "response_format"
                                                          and value == {"type": "text"}):
            return value
        raise ValueError("not supported by this server, only switched off (null, false, 0, [], {}, \"none\"; "
                         "response_format {\"type\": \"text\"})")


class CompletionRequest(_Generation):
    prompt: str = Field(min_length=1)


# -- answers --------------------------------------------------------------------------------------------------------


class Answer:
    """One choice's text as its tokens come: cut before the first stop string, and held back while its end could still
    begin one (or is half a character) until the choice ends."""

    def __init__(self, request_id: str, tokenizer, stops: list, eos_ids: frozenset):
        self.request_id, self.tokenizer, self.stops, self.eos_ids = request_id, tokenizer, stops, eos_ids
        self.tokens = []
        self.text = ""  # what was sent
        self.finish_reason = None
        self.error = None
        self.running = True  # until the manager's last output for it
        self._clean_tokens, self._clean_text = 0, ""  # the text up to the last token that ended a whole character

    @property
    def done(self) -> bool:
        return self.finish_reason is not None or self.error is not None

    def advance(self, output) -> str:
        """The text to send after `output` (every token so far); sets `finish_reason` or `error` when it ends."""
        if output.status == RequestStatus.FAILED:
            self.error = output.error
            return ""
        tokens = list(output.generated_tokens)
        text = self._text(tokens)
        cut = min((text.find(stop) for stop in self.stops if stop in text), default=None)
        if cut is not None:  # the fewest tokens that hold it; the text before it had none
            tokens = tokens[: next(count for count in range(len(self.tokens) + 1, len(tokens) + 1)
                                   if any(stop in self._decode(tokens[:count]) for stop in self.stops))]
            text, self.finish_reason = text[:cut], "stop"
        elif output.status == RequestStatus.FINISHED:
            self.finish_reason = "stop" if tokens and tokens[-1] in self.eos_ids else "length"
        else:
            text = text.rstrip("\ufffd")
            if self.stops:
                text = text[: max(len(self.text), len(text) - max(map(len, self.stops)) + 1)]
        self.tokens = tokens
        delta, self.text = text[len(self.text):], text
        return delta

    def _decode(self, tokens) -> str:
        # No clean-up of spaces: the text of more tokens then always extends the text of fewer.
        return self.tokenizer.decode(tokens, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def _text(self, tokens) -> str:
        """The text of `tokens`, decoding only those after the last clean cut (byte-level BPE: text splits where no
        character is half written)."""
        tail = self._decode(tokens[self._clean_tokens:])
        text = self._clean_text + tail
        if not tail.endswith("\ufffd"):
            self._clean_tokens, self._clean_text = len(tokens), text
        return text


class Job:
    """One HTTP request's choices, each a streaming request of the manager, and their outputs as they come."""

    def __init__(self, job_id: str, prompt_tokens: int, answers: list, cancel_request):
        self.id, self.prompt_tokens, self.answers = job_id, prompt_tokens, answers
        self.created = int(time.time())
        self.outputs = asyncio.Queue()  # (choice index, GenerationOutput), filled by the manager's result handlers
        self._cancel_request = cancel_request
        self._watcher = None
        self.handed_over = None  # when it went to the engine, until its first token came back (then logged, None)
        self.received = None  # when its body began to be read, until its first text goes out (then logged, None)

    async def updates(self):
        """(choice index, new text, finish reason or None) as the choices' tokens come, until every choice is done.
        Outputs that came while the last text was being sent are taken together: each holds all of its choice's
        tokens so far, so a choice's last one (and its end, if it ended) says the same in one piece."""
        while not all(answer.done for answer in self.answers):
            latest = {}  # choice index -> its outputs to read: the last snapshot, then the end
            for index, output in [await self.outputs.get(), *_drain(self.outputs)]:
                ended = output.status in (RequestStatus.FINISHED, RequestStatus.FAILED)
                latest[index] = [*latest.get(index, [])[:1], output] if ended else [output]
            for index, outputs in latest.items():
                answer = self.answers[index]
                for output in outputs:
                    if answer.done:  # an output after the one that ended the choice
                        break
                    delta = answer.advance(output)
                    if delta or answer.finish_reason:
                        yield index, delta, answer.finish_reason

    def error(self) -> str | None:
        return next((answer.error for answer in self.answers if answer.error is not None), None)

    def usage(self) -> dict:
        completion = sum(len(answer.tokens) for answer in self.answers)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
                "total_tokens": self.prompt_tokens + completion}

    def watch(self, request: Request) -> None:
        """Cancel the running choices when the client disconnects."""
        async def until_disconnect():
            while (await request.receive())["type"] != "http.disconnect":
                pass
            cancelled = self.cancel()
            if cancelled:
                logger.info("%s: the client disconnected; %d unfinished choice(s) cancelled", self.id, cancelled)

        self._watcher = asyncio.create_task(until_disconnect())

    def cancel(self) -> int:
        running = [answer for answer in self.answers if answer.running]
        for answer in running:
            self._cancel_request(answer.request_id)
        return len(running)

    def close(self) -> None:
        """The response is over (sent, failed or abandoned): stop watching, cancel what still runs."""
        if self._watcher is not None:
            self._watcher.cancel()
        self.cancel()


# -- the server -------------------------------------------------------------------------------------------------


class OpenAIServer:
    """The endpoints of one HTTP process over the engine process's batch (`app()`: the FastAPI application). Where the
    engine takes image patches as uint8, this process's processor leaves them unnormalized (`PixelNormalizer`)."""

    def __init__(self, engine: EngineClient, processor, model_name: str, api_key: str | None = None,
                 limits: ServerLimits = ServerLimits(), media: MediaLimits = MediaLimits(), render_threads: int = 1):
        self.engine, self.processor, self.model_name, self.api_key = engine, processor, model_name, api_key
        # Requests render (image decoded, processor run) in a pool of about the process's share of the cores: a burst
        # of them then finishes first come first served, where a thread each would share the interpreter lock and
        # finish all together, late (`bench/probes/render_burst_probe.py`).
        self.renderers = render_pool(render_threads)
        self.tokenizer = getattr(processor, "tokenizer", processor)
        self.limits, self.media = limits, media
        # A row holds the prompt, the answer and the steps a row may run past its end.
        self.row_slots, self.reserved = engine.info.row_slots, engine.info.reserved
        self.max_requests, self.eos_ids = engine.info.max_requests, engine.info.eos_ids
        if engine.info.uint8_pixels:
            PixelNormalizer.raw(processor.image_processor)
        self.positions_model = meta_model(engine.info.config)
        self.created = int(time.time())
        self.http = None  # the client that fetches image URLs, open while the app runs

    def app(self) -> FastAPI:
        @asynccontextmanager
        async def lifespan(_):
            async with httpx.AsyncClient() as client:
                self.http = client
                self.engine.start()
                yield
            self.renderers.shutdown(wait=False)

        app = FastAPI(title="qwen3vl_static", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
        app.add_exception_handler(APIError, lambda _, error: JSONResponse(error.body(), status_code=error.status))
        app.add_exception_handler(HTTPException, lambda _, error: JSONResponse(
            APIError(error.status_code, str(error.detail)).body(), status_code=error.status_code))
        app.add_exception_handler(Exception, lambda _, error: JSONResponse(
            APIError(500, f"{type(error).__name__}: {error}").body(), status_code=500))
        # A client gone mid-upload: no one to answer, nothing to log.
        app.add_exception_handler(ClientDisconnect, lambda *_: Response(status_code=499))
        app.add_api_route("/health", self.health, methods=["GET"])
        app.add_api_route("/metrics", self.metrics, methods=["GET"])
        app.add_api_route("/v1/models", self.models, methods=["GET"])
        app.add_api_route("/v1/chat/completions", self.chat_completions, methods=["POST"])
        app.add_api_route("/v1/completions", self.completions, methods=["POST"])
        return app

    async def health(self) -> Response:
        if not self.engine.alive:
            return JSONResponse(self._stopped().body(), status_code=503)
        return Response(status_code=200)

    async def metrics(self) -> Response:
        """Prometheus' text format: the requests in flight and the batch's counters (`METRICS`)."""
        stats = await self.engine.stats()
        if not stats:
            return JSONResponse(self._stopped().body(), status_code=503)
        lines = ["# TYPE qwen3vl_static_requests_in_flight gauge",
                 f"qwen3vl_static_requests_in_flight {stats['in_flight']}"]
        for stat, (name, scale, what) in METRICS.items():
            lines += [f"# HELP {name} {what}", f"# TYPE {name} counter", f"{name} {stats[stat] * scale}"]
        return Response("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    async def models(self, request: Request) -> dict:
        self._authorize(request)
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": self.created,
                                            "owned_by": "qwen3vl_static", "max_model_len": self.row_slots}]}

    async def chat_completions(self, request: Request) -> Response:
        received = time.perf_counter()
        body = await self._parse(request, ChatRequest)
        urls = [part.image_url.url for message in body.messages if isinstance(message.content, list)
                for part in message.content if part.type == "image_url"]
        if len(urls) > self.limits.max_images:
            raise APIError(400, f"{len(urls)} images in one request, more than this server takes "
                                f"({self.limits.max_images}, --max-images): send fewer", param="messages")
        images = iter(await asyncio.gather(*(self._image(number, url) for number, url in enumerate(urls, 1))))
        messages = [{"role": message.role, "content": message.content if isinstance(message.content, str) else [
            {"type": "text", "text": part.text} if part.type == "text" else {"type": "image", "image": next(images)}
            for part in message.content]} for message in body.messages]
        inputs = await self._render(messages)
        job = await self._submit(inputs, body, body.max_completion_tokens or body.max_tokens, "chatcmpl", received)
        return await self._respond(request, job, body, chat=True)

    async def completions(self, request: Request) -> Response:
        received = time.perf_counter()
        body = await self._parse(request, CompletionRequest)
        ids = self.tokenizer(body.prompt, return_tensors="pt")["input_ids"]
        job = await self._submit({"input_ids": ids}, body, body.max_tokens, "cmpl", received)
        return await self._respond(request, job, body, chat=False)

    # -- a request's way in ---------------------------------------------------------------------------------------

    def _authorize(self, request: Request) -> None:
        if self.api_key is not None and not secrets.compare_digest(
                request.headers.get("authorization", "").encode(), f"Bearer {self.api_key}".encode()):
            raise APIError(401, "Missing or wrong API key: send the header 'Authorization: Bearer <key>' with the "
                                "server's --api-key")

    async def _parse(self, request: Request, kind):
        """The request's body as `kind`, within the size limit, for this server's model."""
        self._authorize(request)
        limit = self.limits.max_body_bytes
        declared = request.headers.get("content-length", "")
        too_large = APIError(413, f"The body is larger than this server takes ({limit} bytes, --max-request-mb): "
                                  "send smaller or fewer images")
        if declared.isdigit() and int(declared) > limit:
            raise too_large
        raw = bytearray()
        async for piece in request.stream():
            raw += piece
            if len(raw) > limit:
                raise too_large
        try:
            data = json.loads(raw)
        except ValueError as error:
            raise APIError(400, f"The body is not JSON ({error}): send a JSON object") from None
        if not isinstance(data, dict):
            raise APIError(400, "The body must be a JSON object")
        try:
            body = kind.model_validate(data)
        except ValidationError as error:
            problems = [(_location(problem["loc"]),
                         "not supported by this server" if problem["type"] == "extra_forbidden" else problem["msg"])
                        for problem in error.errors()]
            raise APIError(400, "Invalid request: " + "; ".join(f"{where}: {what}" for where, what in problems[:4]),
                           param=problems[0][0]) from None
        if body.model is not None and body.model != self.model_name:
            raise APIError(400, f"Unknown model {body.model!r}: this server serves {self.model_name!r} (GET "
                                "/v1/models)", param="model")
        return body

    async def _image(self, number: int, url: str) -> bytes:
        try:
            return await fetch_image_data(url, self.media, self.http)
        except MediaError as error:
            raise APIError(400, f"Image {number}: {error}", param="messages") from None

    async def _render(self, messages) -> dict:
        """The model inputs of a chat whose images are still encoded (`render_chat`) with their M-RoPE positions
        (`_with_positions`), in a render thread."""
        try:
            return await asyncio.get_running_loop().run_in_executor(self.renderers, self._rendered, messages)
        except MediaError as error:
            raise APIError(400, str(error), param="messages") from None
        except Exception as error:  # noqa: BLE001 - what the model's chat template or processor refuses
            raise APIError(400, f"The model's chat template could not render these messages "
                                f"({type(error).__name__}: {error})", param="messages") from None

    def _rendered(self, messages) -> dict:
        return self._with_positions(render_chat(self.processor, self.media, messages))

    def _with_positions(self, inputs: dict) -> dict:
        """`inputs` with the prompt's M-RoPE `position_ids`, computed here rather than on the engine's batch thread
        (`prompt_position_ids` on the model's meta-device copy). Inputs they cannot be computed for go without: the
        batch's checks then fail the request with their own message."""
        if self.positions_model is None:
            return inputs
        rest = {key: value for key, value in inputs.items() if key not in ("input_ids", "attention_mask")}
        try:
            positions = prompt_position_ids(self.positions_model, inputs["input_ids"], rest)
        except Exception:  # noqa: BLE001 - what the batch refuses, with the reason, when it takes the request in
            return inputs
        return {**inputs, "position_ids": positions}

    def _stopped(self) -> APIError:
        return APIError(503, f"The model's batch has stopped on an error: {self.engine.error}; restart the server")

    async def _submit(self, inputs: dict, body: _Generation, max_tokens: int | None, prefix: str,
                      received: float) -> Job:
        """The request's choices into the batch, after the checks the batch would otherwise fail them on."""
        if not self.engine.alive:
            raise self._stopped()
        prompt_tokens = inputs["input_ids"].shape[-1]
        room = self.row_slots - self.reserved - prompt_tokens
        if room < 1:
            raise APIError(400, f"The prompt is {prompt_tokens} tokens, and a request's cache row holds "
                                f"{self.row_slots - self.reserved} of prompt and answer (--cache-len {self.row_slots}, "
                                f"less {self.reserved}): shorten the prompt, or restart the server with a larger "
                                "--cache-len", param="messages")
        if max_tokens is not None and max_tokens > room:
            raise APIError(400, f"max_tokens={max_tokens} does not fit: the prompt is {prompt_tokens} tokens and a "
                                f"cache row holds {self.row_slots - self.reserved} of prompt and answer, so at most "
                                f"{room}; ask for fewer (or restart the server with a larger --cache-len)",
                           param="max_tokens")
        if body.n > self.max_requests:
            raise APIError(400, f"n={body.n} is more than this server holds at once ({self.max_requests}): ask for "
                                "fewer choices", param="n")
        job_id = f"{prefix}-{uuid.uuid4().hex}"
        eos_ids = (frozenset() if body.ignore_eos else self.eos_ids) | frozenset(body.stop_token_ids or ())
        answers = [Answer(f"{job_id}-{index}", self.tokenizer, body.stop, eos_ids) for index in range(body.n)]
        job = Job(job_id, prompt_tokens, answers, self.engine.cancel)
        new_tokens = max_tokens or room
        ends = {"eos_token_id": sorted(eos_ids)} if eos_ids != self.eos_ids else {}
        # Each choice its own seed, so that seeded choices differ from each other and repeat across requests.
        settings = [{"max_new_tokens": new_tokens, "stop_strings": body.stop, **body.sampling(), **ends,
                     **({} if body.seed is None else {"seed": (body.seed + index) % 2**32})} for index in range(body.n)]
        if self.engine.info.uint8_pixels and "pixel_values" in inputs:
            patches = as_uint8(inputs["pixel_values"])
            if patches is None:  # the engine's start-up check found them whole: a processor that changed since
                raise RuntimeError("the processor's unnormalized image patches are not whole numbers")
            inputs = {**inputs, "pixel_values": patches}
        job.received = received
        job.handed_over = rendered = time.perf_counter()
        refusal = await self.engine.submit(job_id, [answer.request_id for answer in answers], inputs, settings,
                                           [partial(self._deliver, job, index) for index in range(body.n)])
        if refusal is not None:
            raise APIError(*refusal)
        logger.info("%s: %d choice(s), %d prompt tokens, up to %d new tokens each; read and rendered in %.1f ms, taken "
                    "by the engine in %.1f ms", job_id, body.n, prompt_tokens, new_tokens,
                    1000 * (rendered - received), 1000 * (time.perf_counter() - rendered))
        return job

    def _deliver(self, job: Job, index: int, output) -> None:
        """The manager's result handler for one choice (on the event loop)."""
        if job.handed_over is not None and output.generated_tokens:  # the engine's share of the time to first token
            logger.info("%s: first token back from the engine %.1f ms after the request went to it", job.id,
                        1000 * (time.perf_counter() - job.handed_over))
            job.handed_over = None
        if output.status in (RequestStatus.FINISHED, RequestStatus.FAILED):
            job.answers[index].running = False
        job.outputs.put_nowait((index, output))

    # -- a request's way out --------------------------------------------------------------------------------------

    async def _respond(self, request: Request, job: Job, body: _Generation, chat: bool) -> Response:
        job.watch(request)
        if body.stream:
            return StreamingResponse(self._events(job, body, chat), media_type="text/event-stream")
        try:
            async for _ in job.updates():
                pass
        finally:
            job.close()
        if job.error() is not None:
            raise self._failed(job)
        choices = [_choice(chat, index, answer.text, answer.finish_reason) for index, answer in enumerate(job.answers)]
        return JSONResponse({"id": job.id, "object": "chat.completion" if chat else "text_completion",
                             "created": job.created, "model": self.model_name, "choices": choices,
                             "usage": job.usage()})

    async def _events(self, job: Job, body: _Generation, chat: bool):
        """The server-sent events of a streamed response: each choice's role first (chat), its text as it comes, its
        finish reason, the usage when asked for, `[DONE]`."""
        usage = body.stream_options is not None and body.stream_options.include_usage

        def event(choices, **extra) -> str:
            chunk = {"id": job.id, "object": "chat.completion.chunk" if chat else "text_completion",
                     "created": job.created, "model": self.model_name, "choices": choices,
                     **({"usage": None} if usage else {}), **extra}
            return f"data: {json.dumps(chunk)}\n\n"

        try:
            if chat:
                for index in range(len(job.answers)):
                    yield event([{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                  "finish_reason": None}])
            async for index, delta, finish_reason in job.updates():
                if delta and job.received is not None:  # the server's whole share of the time to first token
                    logger.info("%s: first text sent %.1f ms after the request was read", job.id,
                                1000 * (time.perf_counter() - job.received))
                    job.received = None
                yield event([_choice(chat, index, delta, finish_reason, delta=True)])
            if job.error() is not None:
                yield f"data: {json.dumps(self._failed(job).body())}\n\n"
            elif usage:
                yield event([], usage=job.usage())
            yield "data: [DONE]\n\n"
        finally:
            job.close()

    def _failed(self, job: Job) -> APIError:
        """A choice the batch failed: the batch stopped (500), else a request the manager refused (400)."""
        if self.engine.error is not None:
            return APIError(500, f"The model's batch stopped on an error: {self.engine.error}; restart the server")
        return APIError(400, job.error())


def meta_model(config):
    """The model for `config` on the meta device: no weights and no memory, what an HTTP process computes prompts'
    M-RoPE positions with; None (the engine computes them) where there is no config or it cannot be built."""
    from .modeling_qwen3vl_graph import Qwen3VLGraphForConditionalGeneration

    if config is None:
        return None
    try:
        with torch.device("meta"):
            return Qwen3VLGraphForConditionalGeneration(config).eval()
    except Exception as error:  # noqa: BLE001 - the engine's batch computes the positions then, as it can
        logger.warning("the engine computes the prompts' M-RoPE positions: no copy of the model on the meta device "
                       "(%s: %s)", type(error).__name__, error)
        return None


def render_chat(processor, media: MediaLimits, messages: list) -> dict:
    """The processor's inputs for one chat whose image parts hold encoded images: each decoded within `media`'s limits
    (a `MediaError` names the image by its number), then the chat template."""
    numbers = itertools.count(1)

    def decoded(part):
        if part["type"] != "image":
            return part
        number = next(numbers)
        try:
            return {**part, "image": decode_image(part["image"], media)}
        except MediaError as error:
            raise MediaError(f"Image {number}: {error}") from None

    chat = [{**message, "content": message["content"] if isinstance(message["content"], str) else
             [decoded(part) for part in message["content"]]} for message in messages]
    return dict(processor.apply_chat_template(chat, tokenize=True, add_generation_prompt=True, return_dict=True,
                                              return_tensors="pt"))


def _drain(outputs: asyncio.Queue) -> list:
    """What `outputs` holds now, without waiting."""
    taken = []
    while not outputs.empty():
        taken.append(outputs.get_nowait())
    return taken


def _location(loc: tuple) -> str:
    """A field's place in the body as pydantic gives it, without the repeats its tagged unions add (a part of type
    "image_url" whose "image_url" is wrong: content.parts.0.image_url, not content.parts.0.image_url.image_url)."""
    return ".".join(str(part) for index, part in enumerate(loc) if index == 0 or part != loc[index - 1]) or "body"


def _choice(chat: bool, index: int, text: str, finish_reason: str | None, delta: bool = False) -> dict:
    if not chat:
        return {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}
    message = {"content": text} if delta else {"role": "assistant", "content": text}
    return {"index": index, "delta" if delta else "message": message, "logprobs": None, "finish_reason": finish_reason}


def default_api_servers() -> int:
    """HTTP processes: one per four cores, one to four (the engine process keeps a core and its GPU's host work)."""
    return max(1, min(4, (os.cpu_count() or 1) // 4))


def render_pool(threads: int) -> ThreadPoolExecutor:
    """The threads an HTTP process renders requests in, below the process's other threads in the OS's eyes
    (`RENDER_NICENESS`, Linux): where the cores run short in a burst of renders, the event loop that sends every
    stream's tokens and the engine's batch thread run first, and rendering, for which TTFT has room, waits
    (`bench/probes/loop_lag_probe.py`, 4 render threads on 2 cores: the loop's wake-ups late by ~5 ms p99 instead of
    ~8-9, rendering as fast)."""
    return ThreadPoolExecutor(threads, thread_name_prefix="qwen3vl-static-render", initializer=_lower_priority)


def _lower_priority() -> None:
    """This thread's niceness raised by RENDER_NICENESS (Linux sets it per thread; elsewhere nothing). A system that
    refuses leaves it as it was: a failing initializer would break the pool, and every render with it."""
    if sys.platform.startswith("linux"):
        thread = threading.get_native_id()
        try:
            os.setpriority(os.PRIO_PROCESS, thread, os.getpriority(os.PRIO_PROCESS, thread) + RENDER_NICENESS)
        except OSError as error:
            logger.warning("render threads run at the event loop's priority: %s", error)


def render_threads(api_servers: int) -> int:
    """Render threads per HTTP process: its share of the cores."""
    return max(1, (os.cpu_count() or 1) // api_servers)


def serve(build_model, build_processor, model_name: str, host: str = "127.0.0.1", port: int = 8000,
          api_servers: int | None = None, max_batch_size: int | None = None,
          max_prefill_tokens: int | None = None, warmup: bool = False, **settings) -> None:
    """Serve the model `build_model()` returns with the processor `build_processor()` returns (both picklable
    callables: they run in the processes started here; `max_batch_size`: the batch's rows, None: sized from memory;
    `max_prefill_tokens`: the prompt tokens admitted per turn of the batch, None: the batch's default; `warmup`:
    capture the batch's graphs before taking requests)
    from one engine process and `api_servers` HTTP processes (None: `default_api_servers()`) until SIGINT / SIGTERM,
    which drain them (`settings`: `OpenAIServer`'s)."""
    api_servers = api_servers or default_api_servers()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s:     %(message)s")
    context = multiprocessing.get_context("spawn")  # nothing of this process (threads, CUDA) goes along
    limits = settings.get("limits", ServerLimits())
    began = time.perf_counter()
    engine = EngineProcess(context, build_model, build_processor, max_batch_size, limits.max_waiting, api_servers,
                           max_prefill_tokens, warmup)
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    listener = socket.create_server((host, port), family=family, backlog=2048)
    port = listener.getsockname()[1]
    renderers = render_threads(api_servers)
    fronts = [context.Process(target=_http_main, name=f"qwen3vl-static-http-{index}",
                              args=(connection, listener, build_processor, engine.info, model_name, host, port,
                                    {"render_threads": renderers, **settings}))
              for index, connection in enumerate(engine.connections)]
    for front in fronts:
        front.start()
    for connection in engine.connections:
        connection.close()
    listener.close()
    logger.info("serving %s from %d HTTP process(es) of %d render threads each and the engine process (ready %.1f s "
                "after the start)", model_name, api_servers, renderers, time.perf_counter() - began)
    # uvicorn's own line (it prints none for a socket it is handed): the socket takes connections from now on
    logger.info("Uvicorn running on http://%s:%d (Press CTRL+C to quit)", host, port)

    def drain(*_):  # uvicorn's way: stop accepting, let the requests in flight finish
        for front in fronts:
            if front.is_alive():
                os.kill(front.pid, signal.SIGTERM)

    for handled in (signal.SIGINT, signal.SIGTERM):
        signal.signal(handled, drain)
    failed = None
    while any(front.is_alive() for front in fronts):
        for front in fronts:
            front.join(0.2)
            if front.exitcode not in (None, 0) and failed is None:
                failed = f"{front.name} exited with code {front.exitcode}"
        if failed is None and not engine.process.is_alive():
            failed = f"the engine process exited with code {engine.process.exitcode}"
        if failed is not None:
            logger.error("stopping: %s", failed)
            drain()
            for front in fronts:
                front.join(5)
                if front.is_alive():
                    front.kill()
    engine.stop()
    if failed is not None:
        raise SystemExit(1)


def _http_main(connection, listener, build_processor, info, model_name: str, host: str, port: int,
               settings: dict) -> None:
    """One HTTP process: uvicorn on the shared socket, over its pipe to the engine."""
    import uvicorn

    logging.basicConfig(level=logging.INFO, format="%(levelname)s:     %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per image fetched
    app = OpenAIServer(EngineClient(connection, info), build_processor(), model_name, **settings).app()
    process = f"HTTP process [{os.getpid()}]"
    freeze_startup_heap(process)
    GcPauses(process)  # its long pauses logged while uvicorn runs (`gc.callbacks` keeps it)
    # uvicorn drains on SIGINT / SIGTERM, then raises the signal again for the handlers it found; these make that a
    # clean exit.
    for handled in (signal.SIGINT, signal.SIGTERM):
        signal.signal(handled, lambda *_: None)
    uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="info")).run(sockets=[listener])
