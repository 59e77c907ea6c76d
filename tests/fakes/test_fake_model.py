"""The fake OpenAI-compatible model server, as a real container (tests/images/fake_model)."""

from __future__ import annotations

import asyncio
import json
import socket
import statistics
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

import aiohttp
import openai
import pytest
from docker.models.containers import Container

from fakes.dockerenv import DockerEngine, remove_test_containers
from fakes.waiting import eventually
from images.fake_model import MODEL_IMAGE, RECIPE_LABEL, ensure_model_image, run_model

pytestmark = pytest.mark.docker

NODE = "node-fm"


@pytest.fixture(scope="module")
def model_image(docker_engine: DockerEngine) -> str:
    try:
        return ensure_model_image(docker_engine.client)
    except Exception as e:  # never a skip (docs/design.md)
        pytest.fail(f"could not build the fake model image: {e}", pytrace=False)


@pytest.fixture
def prefix(docker_engine: DockerEngine, request: pytest.FixtureRequest):
    prefix = f"sdt-fm-{request.node.name[:24]}-{int(time.time() * 1000) % 100000}-"
    yield prefix
    remove_test_containers(docker_engine.client, prefix)


@dataclass
class Worker:
    container: Container
    port: int
    worker_id: str

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@pytest.fixture
def start_worker(docker_engine: DockerEngine, model_image: str, prefix: str):
    def start(worker_id: str = "w1", **kwargs) -> Worker:
        port = free_port()
        container = run_model(
            docker_engine.client,
            name=prefix + worker_id,
            node_id=NODE,
            worker_id=worker_id,
            port=port,
            image=model_image,
            **kwargs,
        )
        return Worker(container, port, worker_id)

    return start


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def chat(max_tokens: int, stream: bool, **extra) -> dict:
    return {
        "model": "fake-model",
        "messages": [{"role": "user", "content": "say something"}],
        "stream": stream,
        "max_tokens": max_tokens,
        **extra,
    }


async def read_stream(response: aiohttp.ClientResponse, on_line=None) -> list[tuple[float, str]]:
    """The `data:` payloads of an event stream, each with the monotonic time it arrived."""
    lines = []
    async for raw in response.content:
        line = raw.decode().rstrip("\r\n")
        if not line:
            continue
        assert line.startswith("data: "), line
        lines.append((time.monotonic(), line.removeprefix("data: ")))
        if on_line is not None:
            on_line(lines)
    return lines


def connect_refused(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except ConnectionRefusedError:
        return True
    return False


# ---------------------------------------------------------------------------------------------


def test_image_is_built_once_and_labelled(docker_engine: DockerEngine, model_image: str):
    client = docker_engine.client
    image = client.images.get(model_image)
    assert model_image == MODEL_IMAGE
    assert image.labels.get(RECIPE_LABEL)
    assert image.attrs["Config"]["Cmd"] == ["python3", "-u", "/srv/server.py"]

    started = time.monotonic()
    assert ensure_model_image(client) == model_image
    assert time.monotonic() - started < 5, "a current image must not be rebuilt"
    assert client.images.get(model_image).id == image.id


async def test_stream_arrives_token_by_token(start_worker):
    worker = start_worker(tokens_per_s=1000)
    tokens, pace = 10, 20  # the header overrides the worker's pace: 0.5 s in all
    async with aiohttp.ClientSession() as session:
        async with session.post(
            f"{worker.url}/v1/chat/completions",
            json=chat(tokens, stream=True),
            headers={"X-Fake-Tokens-Per-S": str(pace), "X-Request-Id": "rid-stream"},
        ) as response:
            assert response.status == 200
            assert response.headers["Content-Type"].startswith("text/event-stream")
            assert response.headers["X-Worker-Id"] == "w1"
            assert response.headers["X-Request-Id"] == "rid-stream"
            lines = await read_stream(response)

    assert lines[-1][1] == "[DONE]"
    chunks = [json.loads(text) for _, text in lines[:-1]]
    assert len(chunks) == tokens + 2  # the role, one per token, the stop
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert len({c["id"] for c in chunks}) == 1 and chunks[0]["id"].startswith("chatcmpl-")
    assert {c["model"] for c in chunks} == {"fake-model"}
    assert all(isinstance(c["created"], int) for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    content = chunks[1:-1]
    assert all(c["choices"][0]["delta"]["content"] for c in content)
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"][0] == {
        "index": 0,
        "delta": {},
        "logprobs": None,
        "finish_reason": "stop",
    }

    # Token by token: the chunks come spread over the stream's time, not in one burst at the end.
    times = [t for t, _ in lines[1 : tokens + 1]]
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    assert times[-1] - times[0] >= 0.5 * (tokens - 1) / pace, gaps
    assert statistics.median(gaps) >= 0.6 / pace, gaps
    assert lines[-1][0] - lines[0][0] >= 0.9 * tokens / pace


async def test_non_streamed_completion_is_one_json(start_worker):
    worker = start_worker(tokens_per_s=40)
    started = time.monotonic()
    async with aiohttp.ClientSession() as session:
        async with session.post(
            f"{worker.url}/v1/chat/completions", json=chat(8, stream=False)
        ) as response:
            assert response.status == 200
            assert response.headers["Content-Type"] == "application/json"
            assert response.headers["X-Worker-Id"] == "w1"
            body = await response.json()
    assert time.monotonic() - started >= 0.9 * 8 / 40  # the tokens are generated at the pace
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"]["role"] == "assistant"
    assert len(body["choices"][0]["message"]["content"].split()) == 8
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] == 8
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + 8

    async with aiohttp.ClientSession() as session:
        async with session.post(f"{worker.url}/v1/chat/completions", data=b"not json") as response:
            assert response.status == 400
            assert response.headers["X-Worker-Id"] == "w1"
            assert (await response.json())["error"]["type"] == "invalid_request_error"


def test_openai_client_streams_all_tokens(start_worker):
    worker = start_worker(tokens_per_s=100)
    client = openai.OpenAI(base_url=f"{worker.url}/v1", api_key="unused", max_retries=0, timeout=10)
    try:
        stream = client.chat.completions.create(
            model="fake-model",
            messages=[{"role": "user", "content": "hello"}],
            stream=True,
            max_tokens=12,
        )
        chunks = list(stream)
        contents = [c.choices[0].delta.content for c in chunks if c.choices[0].delta.content]
        assert len(contents) == 12
        assert chunks[-1].choices[0].finish_reason == "stop"
        assert chunks[0].choices[0].delta.role == "assistant"

        completion = client.chat.completions.create(
            model="fake-model", messages=[{"role": "user", "content": "hello"}], max_tokens=4
        )
        assert completion.choices[0].finish_reason == "stop"
        assert completion.usage.completion_tokens == 4
        assert [m.id for m in client.models.list()] == ["fake-model"]
    finally:
        client.close()


def test_models_health_labels_and_request_log(docker_engine: DockerEngine, start_worker):
    worker = start_worker("w7", model="tiny-llama", extra_labels={"team": "infra"})
    labels = worker.container.labels
    assert labels["spotdrain.node"] == NODE
    assert labels["spotdrain.kind"] == "inference"
    assert labels["spotdrain.worker"] == "w7"
    assert labels["spotdrain.model"] == "tiny-llama"
    assert labels["team"] == "infra"

    def get(path: str):
        request = urllib.request.Request(worker.url + path, headers={"X-Request-Id": "rid-42"})
        try:
            with urllib.request.urlopen(request, timeout=5) as r:
                return r.status, r.headers, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, e.headers, json.loads(e.read())

    status, headers, body = get("/health")
    assert (status, body, headers["X-Worker-Id"]) == (200, {"status": "ok"}, "w7")
    status, headers, body = get("/v1/models")
    assert status == 200 and headers["X-Worker-Id"] == "w7"
    assert body["object"] == "list"
    assert [m["id"] for m in body["data"]] == ["tiny-llama"]
    status, headers, _ = get("/no/such/route")
    assert status == 404 and headers["X-Worker-Id"] == "w7"

    logs = worker.container.logs().decode()
    assert f"fake-model: ready on :{worker.port}" in logs
    assert "GET /v1/models request_id=rid-42 status=200" in logs
    assert "GET /no/such/route request_id=rid-42 status=404" in logs


async def test_sigterm_refuses_new_connections_and_finishes_the_stream(start_worker):
    tokens, pace = 20, 10  # a 2 s stream
    worker = start_worker(tokens_per_s=pace)
    streaming = asyncio.Event()

    def on_line(lines):
        if len(lines) >= 4:  # the role and three tokens: the stream is well under way
            streaming.set()

    async def stream() -> list[tuple[float, str]]:
        async with aiohttp.ClientSession() as session:
            async with session.post(
                f"{worker.url}/v1/chat/completions",
                json=chat(tokens, stream=True),
                headers={"X-Request-Id": "rid-drain"},
            ) as response:
                assert response.status == 200
                return await read_stream(response, on_line)

    task = asyncio.create_task(stream())
    await asyncio.wait_for(streaming.wait(), 5)
    await asyncio.to_thread(worker.container.kill, signal="SIGTERM")
    signalled = time.monotonic()

    # New connections are refused at once, while the stream goes on.
    while not connect_refused(worker.port):
        assert time.monotonic() - signalled < 0.5, "still accepting 0.5 s after SIGTERM"
        await asyncio.sleep(0.01)
    refused_after = time.monotonic() - signalled
    assert not task.done()
    with pytest.raises(aiohttp.ClientConnectionError):
        async with aiohttp.ClientSession() as session:
            await session.get(f"{worker.url}/health")

    lines = await asyncio.wait_for(task, 10)
    assert lines[-1][1] == "[DONE]"
    chunks = [json.loads(text) for _, text in lines[:-1]]
    assert sum(1 for c in chunks if c["choices"][0]["delta"].get("content")) == tokens
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    after = [
        t
        for t, text in lines[:-1]
        if t > signalled and json.loads(text)["choices"][0]["delta"].get("content")
    ]
    assert len(after) >= 5, "the in-flight stream must run to its end after SIGTERM"

    result = await asyncio.to_thread(worker.container.wait, timeout=10)
    assert result["StatusCode"] == 0, worker.container.logs().decode()
    logs = worker.container.logs().decode()
    assert "SIGTERM: not accepting; draining 1 request(s)" in logs
    assert "POST /v1/chat/completions request_id=rid-drain status=200" in logs
    assert "outcome=ok" in logs
    assert refused_after < 0.5


async def test_second_sigterm_exits_at_once(start_worker):
    worker = start_worker(tokens_per_s=5)
    streaming = asyncio.Event()

    async def stream():
        async with aiohttp.ClientSession() as session:
            async with session.post(
                f"{worker.url}/v1/chat/completions", json=chat(100, stream=True)
            ) as response:
                return await read_stream(response, lambda lines: streaming.set())

    task = asyncio.create_task(stream())
    await asyncio.wait_for(streaming.wait(), 5)
    await asyncio.to_thread(worker.container.kill, signal="SIGTERM")
    # The first SIGTERM is handled:
    await eventually(
        lambda: b"SIGTERM: not accepting" in worker.container.logs(), "the SIGTERM handled", 5
    )
    assert not task.done()
    await asyncio.to_thread(worker.container.kill, signal="SIGTERM")
    result = await asyncio.to_thread(worker.container.wait, timeout=5)
    assert result["StatusCode"] == 128 + 15
    with pytest.raises(aiohttp.ClientPayloadError):  # the open stream is cut, not finished
        await asyncio.wait_for(task, 5)


def test_run_model_reports_a_worker_that_cannot_start(
    docker_engine: DockerEngine, prefix, model_image
):
    with socket.socket() as taken:  # the port is held, so the server cannot bind it
        taken.bind(("", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(RuntimeError, match="Address already in use|before it was healthy"):
            run_model(
                docker_engine.client,
                name=prefix + "clash",
                node_id=NODE,
                worker_id="w-clash",
                port=port,
                image=model_image,
                ready_timeout=10,
            )
