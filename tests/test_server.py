"""`python -m qwen3vl_static serve`: one server (a subprocess on 127.0.0.1, a tiny converted checkpoint on the CPU) for
the module, driven by the `openai` client and raw HTTP. Greedy answers equal `generate`; streamed text equals the
whole answer; concurrent requests equal the same requests one by one; a disconnect cancels; every bad input gets its
OpenAI-style error and the server goes on; SIGTERM lets the request in flight finish, then exits cleanly (last)."""

import base64
import importlib.util
import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.client import HTTPConnection
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
import torch
from conftest import image, save_stock_checkpoint
from openai import BadRequestError, OpenAI

from qwen3vl_static.batching_qwen3vl_graph import prompt_position_ids
from qwen3vl_static.bench import report
from qwen3vl_static.bench_server import (SPREAD, batch_counters, chat_body, metrics, pass_spread, run_clients,
                                         served_processes, server_split, start_split, summarize)
from qwen3vl_static.convert import convert
from qwen3vl_static.dataset_runner import load_processor
from qwen3vl_static.media import MediaError, MediaLimits, fetch_image
from qwen3vl_static.modeling_qwen3vl_graph import Qwen3VLGraphForConditionalGeneration
from qwen3vl_static.server import RENDER_NICENESS, OpenAIServer, meta_model, render_chat, render_pool, render_threads

KEY = "test-key"
NAME = "tiny"
CACHE_LEN = 1024
ROOM = CACHE_LEN - 2 * 8  # a row less the steps it may run past its end (steps_per_sync 8)
MAX_IMAGE_BYTES = 50_000
SERVER_FLAGS = ["--device", "cpu", "--port", "0", "--served-model-name", NAME, "--api-key", KEY, "--slots", "4",
                "--cache-len", str(CACHE_LEN), "--max-prefill-tokens", "4096", "--warmup", "--max-waiting", "4",
                "--max-images", "2",
                "--max-image-pixels", str(128 * 128), "--max-image-mb", str(MAX_IMAGE_BYTES / 2**20),
                "--max-request-mb", "1", "--media-timeout", "1", "--api-server-count", "2"]
HEADERS = {"Authorization": f"Bearer {KEY}"}


class Server:
    def __init__(self, process, url, log, repo):
        self.process, self.url, self.log, self.repo = process, url, log, repo

    def log_text(self) -> str:
        return self.log.read_text()

    def wait_for_log(self, pattern: str, after: int = 0, timeout: float = 30) -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = re.search(pattern, self.log_text()[after:])
            if found:
                return found
            assert self.process.poll() is None, self.log_text()
            time.sleep(0.05)
        raise AssertionError(f"no {pattern!r} in the server's log:\n{self.log_text()}")


class Images(BaseHTTPRequestHandler):
    """Images over HTTP on 127.0.0.1: /red.png, /big.png (over the size cap), /slow.png (past the timeout)."""

    def do_GET(self):
        if self.path == "/slow.png":
            time.sleep(2)
        body = {"/red.png": png(image(64, 64)), "/big.png": os.urandom(2 * MAX_IMAGE_BYTES)}.get(self.path, b"")
        self.send_response(200 if body else 404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("server")
    convert(str(save_stock_checkpoint(folder / "stock")), str(folder / "graph"))
    (folder / "allowed").mkdir()
    image(64, 64).save(folder / "allowed" / "red.png")
    return folder


@pytest.fixture(scope="module")
def server(workdir):
    log = workdir / "server.log"
    command = [sys.executable, "-m", "qwen3vl_static", "serve", str(workdir / "graph"), *SERVER_FLAGS,
               "--allowed-local-media-path", str(workdir / "allowed")]
    with log.open("w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    served = Server(process, None, log, workdir / "graph")
    try:
        port = served.wait_for_log(r"Uvicorn running on http://127\.0\.0\.1:(\d+)", timeout=120).group(1)
        served.url = f"http://127.0.0.1:{port}"
        yield served
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


@pytest.fixture(scope="module")
def image_host():
    host = ThreadingHTTPServer(("127.0.0.1", 0), Images)
    host.daemon_threads = True
    threading.Thread(target=host.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{host.server_address[1]}"
    host.shutdown()
    host.server_close()


@pytest.fixture(scope="module")
def reference(workdir):
    """(model, processor) of the same checkpoint in this process: `generate`'s answers."""
    return Qwen3VLGraphForConditionalGeneration.from_pretrained(workdir / "graph", dtype=torch.float32).eval(), \
        load_processor(workdir / "graph")


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=60)


def png(picture) -> bytes:
    buffer = io.BytesIO()
    picture.save(buffer, "PNG")
    return buffer.getvalue()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def user(text, *urls) -> list:
    return [{"role": "user", "content": [*({"type": "image_url", "image_url": {"url": url}} for url in urls),
                                         {"type": "text", "text": text}]}]


def expected(reference, text, max_tokens, pictures=(), **generation) -> tuple:
    """(text, prompt tokens, new tokens) of greedy `generate` on the chat (with `generation`'s settings)."""
    model, processor = reference
    chat = [{"role": "user", "content": [*({"type": "image", "image": picture} for picture in pictures),
                                         {"type": "text", "text": text}]}]
    inputs = processor.apply_chat_template(chat, tokenize=True, add_generation_prompt=True, return_dict=True,
                                           return_tensors="pt")
    new = model.generate(**inputs, max_new_tokens=max_tokens, do_sample=False, **generation)[
        0, inputs["input_ids"].shape[1]:]
    answer = processor.decode(new, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    return answer, inputs["input_ids"].shape[1], new.tolist()


def sse(response) -> list:
    """The JSON events of a streamed response, checking that it ends in [DONE]."""
    lines = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def post(server, body, path="/v1/chat/completions", **kwargs):
    return httpx.post(server.url + path, json=body, headers=HEADERS, timeout=60, **kwargs)


def test_greedy_answers_equal_generate(server, client, reference, image_host):
    text, prompt_tokens, new = expected(reference, "Hello there", 12)
    answer = client.chat.completions.create(model=NAME, messages=user("Hello there"), max_tokens=12, temperature=0)
    assert answer.id.startswith("chatcmpl-") and answer.object == "chat.completion" and answer.model == NAME
    assert answer.choices[0].message.content == text and answer.choices[0].message.role == "assistant"
    assert answer.choices[0].finish_reason == "length"
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (prompt_tokens, len(new))
    # Features switched off, as some clients send them, are taken.
    assert client.chat.completions.create(
        model=NAME, messages=user("Hello there"), max_tokens=12, temperature=0, logprobs=False, tools=[],
        tool_choice="none", response_format={"type": "text"}, logit_bias={}).choices[0].message.content == text
    # Penalties: OpenAI's at 0 (as many clients send them) change nothing; vLLM's repetition_penalty is transformers'.
    assert client.chat.completions.create(model=NAME, messages=user("Hello there"), max_tokens=12, temperature=0,
                                          presence_penalty=0, frequency_penalty=0).choices[0].message.content == text
    penalized = expected(reference, "Hello there", 12, repetition_penalty=1.5)[0]
    assert penalized != text and client.chat.completions.create(
        model=NAME, messages=user("Hello there"), max_tokens=12, temperature=0,
        extra_body={"repetition_penalty": 1.5}).choices[0].message.content == penalized
    # vLLM's stop_token_ids end the answer at the first of them ("stop"); ignore_eos leaves the checkpoint's EOS out.
    stop_at = next(index for index in range(1, len(new)) if new[index] not in new[:index])
    for extra in ({"stop_token_ids": [new[stop_at]]}, {"stop_token_ids": [new[stop_at]], "ignore_eos": True}):
        stopped = client.chat.completions.create(model=NAME, messages=user("Hello there"), max_tokens=12,
                                                 temperature=0, extra_body=extra)
        assert (stopped.usage.completion_tokens, stopped.choices[0].finish_reason) == (stop_at + 1, "stop")
        assert text.startswith(stopped.choices[0].message.content)
    unended = client.chat.completions.create(model=NAME, messages=user("Hello there"), max_tokens=12, temperature=0,
                                             extra_body={"ignore_eos": True})
    assert (unended.choices[0].message.content, unended.choices[0].finish_reason) == (text, "length")
    # An image, as a data URL, over HTTP and from the allowed folder: the same answer as `generate` on it.
    red = image(64, 64)
    text = expected(reference, "What is it?", 10, [red])[0]
    for url in (data_url(png(red)), f"{image_host}/red.png", f"file://{server.repo.parent / 'allowed' / 'red.png'}"):
        answer = client.chat.completions.create(model=NAME, messages=user("What is it?", url), max_tokens=10,
                                                temperature=0)
        assert answer.choices[0].message.content == text
    # /v1/completions: the prompt as written, no chat template.
    model, processor = reference
    ids = processor.tokenizer("Once upon", return_tensors="pt")["input_ids"]
    new = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=9, do_sample=False)[0, ids.shape[1]:]
    completion = client.completions.create(model=NAME, prompt="Once upon", max_tokens=9, temperature=0)
    assert completion.object == "text_completion" and completion.id.startswith("cmpl-")
    assert completion.choices[0].text == processor.decode(new, skip_special_tokens=True,
                                                          clean_up_tokenization_spaces=False)
    assert completion.usage.completion_tokens == 9


def test_streaming_sends_each_choice_as_it_is_drawn(server, client, reference):
    text, prompt_tokens, new = expected(reference, "Hello there", 40)
    with httpx.stream("POST", server.url + "/v1/chat/completions", headers=HEADERS, timeout=60, json={
            "model": NAME, "messages": user("Hello there"), "max_tokens": 40, "temperature": 0, "n": 2,
            "stream": True, "stream_options": {"include_usage": True}}) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        events = sse(response)
    assert all(event["object"] == "chat.completion.chunk" and event["id"] == events[0]["id"] for event in events)
    for index in range(2):
        deltas = [event["choices"][0] for event in events if event["choices"] and event["choices"][0]["index"] == index]
        assert deltas[0]["delta"] == {"role": "assistant", "content": ""}  # the role first
        assert "".join(delta["delta"].get("content", "") for delta in deltas) == text
        assert [delta["finish_reason"] for delta in deltas][-1] == "length"
        assert len(deltas) >= 1 + 40 // 8  # the text came chunk by chunk (8 steps each), not at the end
    assert events[-1]["choices"] == [] and events[-1]["usage"] == {
        "prompt_tokens": prompt_tokens, "completion_tokens": 2 * len(new),
        "total_tokens": prompt_tokens + 2 * len(new)}
    # The openai client reads the same stream.
    chunks = list(client.chat.completions.create(model=NAME, messages=user("Hello there"), max_tokens=40,
                                                 temperature=0, stream=True))
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks) == text


def test_stop_strings_end_the_answer_before_them(server, client, reference):
    text, _, tokens = expected(reference, "Hello there", 30)
    start = next(index for index in range(5, len(text) - 2) if "\ufffd" not in text[index:index + 2])
    stop = text[start:start + 2]
    _, processor = reference
    for stream in (False, True):
        answer = client.chat.completions.create(model=NAME, messages=user("Hello there"), max_tokens=30,
                                                temperature=0, stop=[stop, "never said"], stream=stream,
                                                **({"stream_options": {"include_usage": True}} if stream else {}))
        if stream:
            chunks = list(answer)
            content = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
            finish, usage = [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices][-1], chunks[-1].usage
        else:
            content, finish, usage = answer.choices[0].message.content, answer.choices[0].finish_reason, answer.usage
        assert content == text[: text.index(stop)] and finish == "stop"
        # Its tokens: the fewest of the greedy answer that hold the stop string.
        assert stop in processor.decode(tokens[: usage.completion_tokens])
        assert stop not in processor.decode(tokens[: usage.completion_tokens - 1])


def test_concurrent_requests_equal_the_same_requests_one_by_one(server, client):
    red = data_url(png(image(64, 64)))
    blue = data_url(png(image(96, 64, "blue")))
    requests = [dict(messages=user("Hello there"), max_tokens=20, temperature=0),
                dict(messages=user("What is it?", red), max_tokens=12, temperature=0),
                dict(messages=user("Describe both.", red, blue), max_tokens=16, temperature=0),
                dict(messages=user("Tell me a story"), max_tokens=24, temperature=0.8, top_p=0.9, seed=5),
                dict(messages=user("Tell me a story"), max_tokens=24, temperature=0.8, seed=6, n=2,
                     extra_body={"top_k": 20, "min_p": 0.05})]  # vLLM's fields beyond OpenAI's

    def answer(request):
        return [choice.message.content for choice in client.chat.completions.create(model=NAME, **request).choices]

    one_by_one = [answer(request) for request in requests]
    with ThreadPoolExecutor(len(requests)) as pool:
        together = list(pool.map(answer, requests))
    assert together == one_by_one
    assert one_by_one[3][0] != one_by_one[4][0] != one_by_one[4][1]  # seeds: each choice its own


def test_bad_input_gets_an_openai_error_and_the_server_goes_on(server, client, image_host):
    red = data_url(png(image(64, 64)))
    # A long request runs through all of it, unaffected.
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(client.chat.completions.create, model=NAME, messages=user("Hello there"),
                              max_tokens=300, temperature=0)
        bad = [
            (400, "not JSON", {"content": b"{"}),
            (400, "JSON object", {"json": ["a list"]}),
            (400, "messages: Field required", {"json": {"model": NAME}}),
            (400, "tools: Value error, not supported by this server, only switched off",
             {"json": {"messages": user("Hi"), "tools": [{"type": "function", "function": {"name": "f"}}]}}),
            (400, "logprobs: Value error, not supported", {"json": {"messages": user("Hi"), "logprobs": True}}),
            (400, "response_format: Value error", {"json": {"messages": user("Hi"),
                                                            "response_format": {"type": "json_object"}}}),
            (400, "functions: not supported", {"json": {"messages": user("Hi"), "functions": []}}),
            (400, "content.parts.0: Input tag 'video'", {"json": {"messages": [
                {"role": "user", "content": [{"type": "video", "video": "x"}]}]}}),
            (400, "content.parts.0.image_url.url: Field required", {"json": {"messages": [
                {"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}}),
            (400, "temperature: Input should be greater than or equal to 0",
             {"json": {"messages": user("Hi"), "temperature": -1}}),
            (400, "top_p", {"json": {"messages": user("Hi"), "top_p": 2}}),
            (400, "presence_penalty: Input should be less than or equal to 2",
             {"json": {"messages": user("Hi"), "presence_penalty": 3}}),
            (400, "stop_token_ids.0: Input should be greater than or equal to 0",
             {"json": {"messages": user("Hi"), "stop_token_ids": [-1]}}),
            (400, "Unknown model 'gpt-4'", {"json": {"model": "gpt-4", "messages": user("Hi")}}),
            (400, "The prompt is 1", {"json": {"messages": user("x" * CACHE_LEN)}}),
            (400, "max_tokens=5000 does not fit", {"json": {"messages": user("Hi"), "max_tokens": 5000}}),
            (400, "n=100 is more than", {"json": {"messages": user("Hi"), "n": 100}}),
            (400, "Image 1: could not be read as an image",
             {"json": {"messages": user("Hi", data_url(b"not an image"))}}),
            (400, "Image 2: 200x200 is 40000 pixels", {"json": {"messages": user("Hi", red, data_url(
                png(image(200, 200))))}}),
            (400, "Image 1: 75000 bytes is more than", {"json": {"messages": user("Hi", data_url(bytes(75000)))}}),
            (400, "3 images in one request", {"json": {"messages": user("Hi", red, red, red)}}),
            (400, "--max-image-mb", {"json": {"messages": user("Hi", f"{image_host}/big.png")}}),
            (400, "HTTP 404", {"json": {"messages": user("Hi", f"{image_host}/gone.png")}}),
            (400, "--media-timeout", {"json": {"messages": user("Hi", f"{image_host}/slow.png")}}),
            (400, "is outside the folder", {"json": {"messages": user("Hi", "file:///etc/hostname")}}),
            (400, "is not an image URL", {"json": {"messages": user("Hi", "/etc/hostname")}}),
            (404, "Not Found", {"json": {}, "path": "/v1/embeddings"}),
        ]
        for status, message, request in bad:
            path = request.pop("path", "/v1/chat/completions")
            response = httpx.post(server.url + path, headers=HEADERS, timeout=60, **request)
            assert response.status_code == status, (message, response.text)
            error = response.json()["error"]
            assert message in error["message"] and error["code"] == status, (message, error)
            assert set(error) == {"message", "type", "param", "code"}
        # A body declared larger than the limit is refused before it is read.
        connection = HTTPConnection("127.0.0.1", int(server.url.rsplit(":", 1)[1]), timeout=60)
        connection.putrequest("POST", "/v1/chat/completions")
        for name, value in {**HEADERS, "Content-Length": str(2 * 2**20)}.items():
            connection.putheader(name, value)
        connection.endheaders(b"{")
        response = connection.getresponse()
        assert response.status == 413 and "--max-request-mb" in json.loads(response.read())["error"]["message"]
        connection.close()
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            response = httpx.post(server.url + "/v1/chat/completions", headers=headers, json={"messages": user("Hi")})
            assert response.status_code == 401 and "--api-key" in response.json()["error"]["message"]
        with pytest.raises(BadRequestError, match="Unknown model"):
            client.chat.completions.create(model="gpt-4", messages=user("Hi"))
        assert running.result().choices[0].message.content == client.chat.completions.create(
            model=NAME, messages=user("Hello there"), max_tokens=300, temperature=0).choices[0].message.content


def test_models_and_health(server, client):
    assert [model.id for model in client.models.list().data] == [NAME]
    assert httpx.get(server.url + "/v1/models", timeout=10).status_code == 401
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200  # no key needed
    assert "image patches cross as uint8, normalized on the device" in server.log_text()
    assert "4 rows of 1024 slots, up to 4096 prompt tokens admitted per turn" in server.log_text()
    assert "graphs of the batch captured ahead in 0.0 s" in server.log_text()  # none on the CPU
    # --api-server-count 2, each rendering in its share of the cores (what bench --server reports)
    server.wait_for_log(r"(?s)Application startup complete.*Application startup complete")
    assert served_processes(server.log_text()) == (2, render_threads(2))
    # Where the start went: the engine's build in parts, then the engine ready (the HTTP processes start after it).
    start = start_split(server.log_text())
    assert start.keys() == {"engine_built_s", "processor_s", "model_s", "batch_s", "engine_ready_s"}
    assert 0 <= start["processor_s"] + start["model_s"] + start["batch_s"] <= start["engine_built_s"] + 0.2  # rounding
    assert start["engine_built_s"] <= start["engine_ready_s"]
    # Every process's start-up heap is left out of the garbage collector's passes before it serves.
    frozen = re.findall(r"(engine process|HTTP process \[\d+\]): (\d+) objects of its start-up heap frozen",
                        server.log_text())
    assert sorted(process.split(" [")[0] for process, _ in frozen) == ["HTTP process", "HTTP process", "engine process"]
    assert all(int(count) > 10_000 for _, count in frozen)
    # Each HTTP process built its meta-device copy of the model: the prompts' M-RoPE positions come from there.
    assert "the engine computes the prompts' M-RoPE positions" not in server.log_text()


def test_http_processes_send_the_positions_the_batch_would_compute(reference, caplog):
    """An HTTP process sends each chat's M-RoPE positions along (`position_ids`), computed on its meta-device copy of
    the model, so that the engine's batch thread need not: the positions the batch computes from the same inputs."""
    model, processor = reference
    front = object.__new__(OpenAIServer)  # what `_with_positions` reads
    front.positions_model = meta_model(model.config)
    assert next(front.positions_model.parameters()).device.type == "meta"
    chat = [{"role": "user", "content": [{"type": "image", "image": png(image(64, 32))},
                                         {"type": "text", "text": "What is it?"}]}]
    inputs = render_chat(processor, MediaLimits(), chat)
    sent = front._with_positions(inputs)
    rest = {key: value for key, value in inputs.items() if key not in ("input_ids", "attention_mask")}
    assert torch.equal(sent["position_ids"], prompt_position_ids(model, inputs["input_ids"], rest))
    assert sent["position_ids"].shape == (3, inputs["input_ids"].shape[1])
    # Without a copy of the model (no config, or one it cannot be built from), requests go without them: the engine
    # computes them.
    with caplog.at_level("WARNING", logger="qwen3vl_static.server"):
        assert meta_model(None) is None and meta_model(object()) is None
    assert "the engine computes the prompts' M-RoPE positions" in caplog.text
    front.positions_model = None
    assert "position_ids" not in front._with_positions(inputs)


def test_local_files_need_an_allowed_folder(tmp_path):
    import asyncio

    with pytest.raises(MediaError, match="--allowed-local-media-path"):
        asyncio.run(fetch_image(f"file://{tmp_path}/red.png", MediaLimits(), None))


def test_a_disconnect_cancels_and_a_full_queue_answers_503(server):
    # Eight long choices fill the 4 rows and the 4 places of the queue.
    body = {"model": NAME, "messages": user("Hello there"), "max_tokens": ROOM - 40, "temperature": 0, "n": 8,
            "stream": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", headers=HEADERS, timeout=60, json=body) as response:
        lines = response.iter_lines()
        first = json.loads(next(line for line in lines if line.startswith("data: "))[len("data: "):])
        next(line for line in lines if '"content": "' in line and '"content": ""' not in line)  # the first text
        full = post(server, {"messages": user("Hi"), "max_tokens": 4})
        assert full.status_code == 503 and "The server is full" in full.json()["error"]["message"]
    server.wait_for_log(rf"{first['id']}: the client disconnected; 8 unfinished choice\(s\) cancelled")
    # Their rows free up: the next request is answered.
    deadline = time.monotonic() + 30
    while (response := post(server, {"messages": user("Hi"), "max_tokens": 4})).status_code == 503:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 4
    # A client that gives up on a whole answer (not streamed) cancels it too.
    seen = len(server.log_text())
    request = json.dumps({"model": NAME, "messages": user("Hello there"), "max_tokens": ROOM - 40, "temperature": 0})
    with socket.create_connection(("127.0.0.1", int(server.url.rsplit(":", 1)[1]))) as connection:
        connection.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                           f"Content-Length: {len(request)}\r\n\r\n{request}".encode())
        job = server.wait_for_log(r"(chatcmpl-\w+): 1 choice\(s\)", after=seen).group(1)
    server.wait_for_log(rf"{job}: the client disconnected; 1 unfinished choice\(s\) cancelled", after=seen)


def test_the_benchmark_clients_stream_what_generate_answers(server, reference):
    """`bench --server`'s clients (two at a time, each in a process of its own, four requests): each streamed answer,
    back in the bodies' order, equals `generate`'s, and the figures count every chunk and token."""
    import asyncio

    model, processor = reference
    urls = [data_url(png(image(64, 32 + 16 * index))) for index in range(4)]
    bodies = [chat_body(index, url, model=NAME, new_tokens=12) for index, url in enumerate(urls)]
    before, seen = metrics(server.url), len(server.log_text())
    began = time.perf_counter()
    answers, seconds, client_cpu, started = run_clients(server.url, bodies, 2, headers=HEADERS, processes=2,
                                                        on_start=time.perf_counter)
    assert len(client_cpu) == 2 and all(cpu > 0 for cpu in client_cpu)
    assert 0 < seconds < time.perf_counter() - started  # from the clients' start, not the processes'
    assert began < started <= min(answer["sent"] for answer in answers)  # once every process was ready
    counters = batch_counters(before, metrics(server.url), seconds)  # GET /metrics: what the batch did meanwhile
    assert counters["prefills"] >= 2 and counters["requests_per_prefill"] * counters["prefills"] == 4
    assert counters["decode_steps"] >= 11 and counters["gpu_prefill_busy"] == counters["gpu_decode_busy"] == 0  # CPU
    assert 0 <= counters["prefill_beside_share"] <= 1  # and no GPU time on the CPU:
    assert counters["activation_wait_ms_per_prefill"] == counters["activation_slack_ms_per_prefill"] == 0
    assert counters["admit_host_ms_mean"] > 0 and counters["prefill_gpu_ms_mean"] == counters["eager_prefill_share"] == 0
    assert 1 <= counters["steps_per_chunk"] <= 8
    assert 0 <= counters["encoded_ahead_share"] <= 1
    shares = [counters[name] for name in ("host_wait_share", "admit_host_share", "take_in_share",
                                          "media_ahead_host_share")]  # parts of the batch thread's time
    assert all(share >= 0 for share in shares) and 0 < sum(shares) < 1
    assert 0 <= counters["engine_gc_share"] < 1 and counters["engine_gc_full_collections"] >= 0
    # Each request's log lines split its time to first token (the benchmark's): each part within the whole, and the
    # server's share within what the client saw.
    log = server.log_text()[seen:]
    assert len(re.findall(r"first token back from the engine [0-9.]+ ms after", log)) == 4
    assert len(re.findall(r"first text sent [0-9.]+ ms after", log)) == 4
    for answer, body in zip(answers, bodies):
        image_part, text_part = body["messages"][0]["content"]
        picture = asyncio.run(fetch_image(image_part["image_url"]["url"], MediaLimits(), client=None))
        chat = [{"role": "user", "content": [{"type": "image", "image": picture}, text_part]}]
        inputs = processor.apply_chat_template(chat, tokenize=True, add_generation_prompt=True, return_dict=True,
                                               return_tensors="pt")
        new = model.generate(**inputs, max_new_tokens=12, do_sample=False)[0, inputs["input_ids"].shape[1]:]
        assert answer["text"] == processor.decode(new, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        assert answer["sent"] < answer["arrivals"][0] and len(answer["arrivals"]) > 1
    row = summarize(answers, seconds, new_tokens=12)
    split = server_split(log, row["ttft_ms_p50"])
    assert 0 < split["engine_first_token_ms_p50"] <= split["server_first_text_ms_p50"] <= row["ttft_ms_p50"]
    assert split["server_read_and_render_ms_p50"] > 0 and split["engine_intake_ms_p50"] >= 0
    assert split["ttft_outside_server_ms"] == pytest.approx(row["ttft_ms_p50"] - split["server_first_text_ms_p50"])
    assert row["requests"] == 4 and row["answers_as_asked"] == 4
    assert row["output_tokens_per_s"] == pytest.approx(4 * 12 / seconds)
    assert 1 <= row["tokens_per_chunk"] < 12 and row["ttft_ms_p50"] > 0 and row["itl_ms_p99"] >= row["itl_ms_p50"]
    # A request's wait in the batch for its prefill is part of its time to first token.
    ttft = [1000 * (answer["arrivals"][0] - answer["sent"]) for answer in answers]
    assert 0 < counters["admission_wait_ms_mean"] < max(ttft) and 0 < counters["first_token_read_ms_mean"] < max(ttft)


def test_the_benchmark_clients_raise_what_failed_in_a_client_process():
    """A client process whose requests fail (nothing listens on the port): `run_clients` raises its error."""
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
    bodies = [chat_body(index, "data:,", model=NAME) for index in range(2)]
    with pytest.raises(RuntimeError, match="a client process failed: ConnectError"):
        run_clients(f"http://127.0.0.1:{port}", bodies, 2, processes=2)


def test_the_benchmark_gives_each_concurrency_its_median_and_range_over_the_measured_passes(tmp_path, capsys):
    """`bench --server --server-passes 3`: per concurrency, each figure's median, least and greatest over the three
    measured passes, the first pass (graph captures on the way) left out; printed, written and drawn."""
    def row(run, number, level, tokens_per_s):
        return {"run": run, "pass": number, "concurrency": level,
                **{key: tokens_per_s if key == "output_tokens_per_s" else tokens_per_s / 1000 for key in SPREAD}}

    rows = [row("first", 1, 1, 90.0), row("first", 1, 64, 900.0)]
    for number, (one, many) in enumerate([(500.0, 13000.0), (520.0, 12000.0), (510.0, 14000.0)], start=2):
        rows += [row("second", number, 1, one), row("second", number, 64, many)]
    spread = pass_spread(rows)
    assert [(level["concurrency"], level["passes"]) for level in spread] == [(1, 3), (64, 3)]
    assert (spread[0]["output_tokens_per_s_median"], spread[0]["output_tokens_per_s_min"],
            spread[0]["output_tokens_per_s_max"]) == (510.0, 500.0, 520.0)
    assert [spread[1][f"itl_ms_p99_{end}"] for end in ("median", "min", "max")] == [13.0, 12.0, 14.0]
    summary = {"device": "NVIDIA H200", "date": "2026-12-06", "model": "2b",
               "server": {"rows": rows, "spread": spread, "measured_passes": 3}}
    path = report(summary, tmp_path)
    assert path.name == "nvidia-h200-server-20261206.json" and json.loads(path.read_text()) == summary
    printed = capsys.readouterr().out
    assert "over its 3 measured passes" in printed and "64 | 13000.000 (12000.000-14000.000) |" in printed
    assert path.with_suffix(".png").exists() == (importlib.util.find_spec("matplotlib") is not None)  # drawn with it


def test_a_sigterm_to_the_benchmark_stops_its_server_and_clients_first():
    """Within `terminated_as_exit`, SIGTERM raises SystemExit where the main thread is (so the benchmark's `finally`
    stops the server it started); `run_clients` kills its client processes at once when interrupted; the handler
    before is back afterwards."""
    import multiprocessing

    from qwen3vl_static import bench_server

    before = signal.getsignal(signal.SIGTERM)
    stopped = []
    with pytest.raises(SystemExit) as exit_info, bench_server.terminated_as_exit():
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
        finally:
            stopped.append(True)
    assert exit_info.value.code == 128 + signal.SIGTERM and stopped
    assert signal.getsignal(signal.SIGTERM) is before
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
    began = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        run_clients(f"http://127.0.0.1:{port}", [chat_body(0, "data:,", model=NAME)] * 2, 2, processes=2,
                    on_start=lambda: (_ for _ in ()).throw(KeyboardInterrupt))
    assert time.monotonic() - began < 60 and not multiprocessing.active_children()


def test_sigterm_lets_the_request_in_flight_finish_then_exits(server, reference):
    """Last: this stops the module's server."""
    text = expected(reference, "Hello there", 200)[0]
    with httpx.stream("POST", server.url + "/v1/chat/completions", headers=HEADERS, timeout=60, json={
            "model": NAME, "messages": user("Hello there"), "max_tokens": 200, "temperature": 0,
            "stream": True}) as response:
        lines = response.iter_lines()
        received = [next(line for line in lines if '"content": "' in line and '"content": ""' not in line)]
        server.process.send_signal(signal.SIGTERM)
        received += list(lines)
    events = [json.loads(line[len("data: "):]) for line in received if line.startswith("data: {")]
    assert [line for line in received if line][-1] == "data: [DONE]"
    assert "".join(event["choices"][0]["delta"].get("content", "") for event in events) == text
    assert server.process.wait(timeout=30) == 0
    log = server.log_text()
    assert "Finished server process" in log and "Traceback" not in log


def test_an_engine_that_dies_fails_the_requests_in_flight_and_the_server_exits(workdir):
    """A second server: its engine process is killed mid-answer."""
    log = workdir / "dying.log"
    with log.open("w") as out:
        process = subprocess.Popen([sys.executable, "-m", "qwen3vl_static", "serve", str(workdir / "graph"),
                                    *SERVER_FLAGS], stdout=out, stderr=subprocess.STDOUT)
    served = Server(process, None, log, workdir / "graph")
    try:
        served.url = "http://127.0.0.1:" + served.wait_for_log(r"Uvicorn running on http://127\.0\.0\.1:(\d+)",
                                                             timeout=120).group(1)
        engine = int(served.wait_for_log(r"engine process \[(\d+)\]").group(1))
        with httpx.stream("POST", served.url + "/v1/chat/completions", headers=HEADERS, timeout=60, json={
                "model": NAME, "messages": user("Hello there"), "max_tokens": ROOM - 40, "temperature": 0,
                "stream": True}) as response:
            lines = response.iter_lines()
            next(line for line in lines if '"content": "' in line and '"content": ""' not in line)
            os.kill(engine, signal.SIGKILL)
            rest = [line for line in lines if line.startswith("data: ")]
        error = json.loads(rest[-2][len("data: "):])["error"]
        assert rest[-1] == "data: [DONE]" and error["code"] == 500 and "the engine process exited" in error["message"]
        assert process.wait(timeout=60) == 1
        assert "stopping: the engine process exited" in served.log_text()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread niceness is Linux's")
def test_requests_render_below_the_threads_that_send_tokens():
    """The render threads run at a lower priority than the event loop's thread: in a burst of renders the loop, which
    sends every stream's tokens, gets the cores first."""
    def niceness(_=None):
        time.sleep(0.05)  # every thread of the pool takes one
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    mine = niceness()
    with render_pool(2) as pool:
        theirs = set(pool.map(niceness, range(4)))
    assert theirs == {min(19, mine + RENDER_NICENESS)}
    assert niceness() == mine


def test_a_system_that_refuses_niceness_still_renders(monkeypatch, caplog):
    """Where the OS refuses to lower a thread's priority, the pool renders at the loop's priority instead of failing
    every request (a failing initializer breaks a ThreadPoolExecutor)."""
    def refuse(*_):
        raise PermissionError("not here")

    monkeypatch.setattr(os, "setpriority", refuse)
    with render_pool(1) as pool:
        assert pool.submit(lambda: 42).result() == 42
    if sys.platform.startswith("linux"):
        assert "render threads run at the event loop's priority" in caplog.text
