"""A stream cut at the grace deadline continues on another worker: real agents, reference model
containers behind their slot gates, the reference router, the official openai client.

The owner pauses the node of the worker serving a long answer (D = pause + 5 s, G = D - 3 s, so
the gate cuts about 2 s after the pause). The router continues the answer on the other worker;
the client's text is checked against the reference model's own generation for the request, which
is what one uninterrupted generation gives (tests/images/fake_model/server.py)."""

from __future__ import annotations

import queue
import re
import threading
import urllib.request
from dataclasses import dataclass, field
from typing import Any

import openai
import pytest
from test_pause import spotctl, start_worker, wait_state

from fakes.dockerenv import remove_test_containers
from fakes.harness import AgentOptions, start_agent, start_router
from fakes.waiting import wait_until
from images.fake_model import ensure_model_image
from images.fake_model.server import _token, continuation_of, render

pytestmark = pytest.mark.docker

OPTIONS = AgentOptions(grace_s=3.0, overrun_s=1.0, extra=["--pause-notice-s", "5"])
MESSAGES = [{"role": "user", "content": "tell me how spot capacity drains"}]
PROMPT = "A story of spot capacity:"
TOKENS, PACE = 400, 40.0  # ten seconds of answer: the cut, 2 s after the pause, is mid-answer
PORT_BASE = 23400


@pytest.fixture
def scene(request, tmp_path, docker_engine, coordinator, gpus, nvml_lib):
    """Two nodes, one reference-model worker each, and the reference router in front (its
    extra flags as the test's indirect parameter)."""
    flags = getattr(request, "param", [])
    image = ensure_model_image(docker_engine.client)
    agents = {
        n: start_agent(tmp_path, n, coordinator, docker_engine.host, gpus, nvml_lib, OPTIONS)
        for n in ("node-a", "node-b")
    }
    router = None
    try:
        workers = {
            n: start_worker(coordinator, n, image, port=PORT_BASE + i) for i, n in enumerate(agents)
        }
        for info in workers.values():
            wait_state(coordinator, info.worker_id, "ready")
        router = start_router(tmp_path / "router", coordinator, *flags)
        yield agents, workers, router, docker_engine.client
    finally:
        if router is not None:
            router.proc.stop()
        for agent in agents.values():
            agent.proc.stop()
        remove_test_containers(docker_engine.client, "spotdrain-w-")


@dataclass
class Answer:
    worker: str = ""  # the worker that began it (X-Worker-Id)
    text: str = ""
    ids: set[tuple[str, int, str]] = field(default_factory=set)
    usage: Any = None
    finish: str | None = None
    error: BaseException | None = None
    chunks: int = 0  # chunks received so far (the tests' barrier for "mid-answer")


def expected_chat(tokens: int) -> str:
    _, seed, _ = continuation_of(render(MESSAGES, False, True))
    return "".join(_token(seed, i) for i in range(tokens))


def expected_completion(tokens: int) -> str:
    _, seed, _ = continuation_of(PROMPT)
    return "".join(_token(seed, i) for i in range(tokens))


def client(router) -> openai.OpenAI:
    return openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def stream(
    router, began: queue.Queue, chat: bool = True, headers=None, answer: Answer | None = None
) -> Answer:
    """One streamed answer through the router; the worker that began it is put on `began`.
    `answer` fills as the chunks come (a test waits on its `chunks`)."""
    answer = answer if answer is not None else Answer()
    api = client(router).chat.completions if chat else client(router).completions
    common = dict(
        model="fake-model",
        stream=True,
        max_tokens=TOKENS,
        stream_options={"include_usage": True},
        extra_headers={"X-Fake-Tokens-Per-S": str(PACE), **(headers or {})},
    )
    try:
        if chat:
            raw = api.with_raw_response.create(messages=MESSAGES, **common)
        else:
            raw = api.with_raw_response.create(prompt=PROMPT, **common)
        answer.worker = raw.headers["x-worker-id"]
        began.put(answer.worker)
        for chunk in raw.parse():
            answer.chunks += 1
            answer.ids.add((chunk.id, chunk.created, chunk.model))
            if chunk.usage is not None:
                answer.usage = chunk.usage
            for choice in chunk.choices:
                answer.text += (choice.delta.content or "") if chat else choice.text
                answer.finish = choice.finish_reason or answer.finish
    except BaseException as e:  # noqa: BLE001 (the test asserts on it)
        answer.error = e
        began.put("")
    return answer


def node_of(workers, worker_id: str) -> str:
    return next(n for n, w in workers.items() if w.worker_id == worker_id)


def pause_mid_stream(agents, workers, router, chat: bool = True, headers=None) -> Answer:
    """Start a long stream, pause the node of the worker it landed on once about a second of
    it has reached the client, and return the client's answer once it ends."""
    began: queue.Queue = queue.Queue()
    out: list[Answer] = []
    answer = Answer()
    t = threading.Thread(
        target=lambda: out.append(stream(router, began, chat, headers, answer)), daemon=True
    )
    t.start()
    worker = began.get(timeout=30)
    assert worker, "the stream did not begin"
    wait_until(lambda: answer.chunks >= PACE or answer.error, 30, "a second of the answer")
    assert spotctl(agents[node_of(workers, worker)], "pause")["ok"] is True
    t.join(60)
    assert out, "the stream did not end"
    return out[0]


def metrics(router) -> str:
    return urllib.request.urlopen(router.url + "/metrics", timeout=10).read().decode()


def continued_lines(router) -> list[str]:
    return re.findall(r"continued on worker .*", router.proc.log())


def test_a_chat_stream_cut_at_g_continues_on_the_other_worker(scene, coordinator):
    """The owner pauses worker A's node while a long chat answer streams from it. The client's
    stream continues from B and ends normally: the whole text of one uninterrupted generation,
    one id throughout, usage as for one request, and the router says where it continued."""
    agents, workers, router, _ = scene
    answer = pause_mid_stream(agents, workers, router)
    assert answer.error is None, answer.error
    assert answer.text == expected_chat(TOKENS)
    assert answer.finish == "stop" and len(answer.ids) == 1
    prompt_tokens = len(MESSAGES[0]["content"].split())
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (prompt_tokens, TOKENS)
    assert answer.usage.total_tokens == prompt_tokens + TOKENS
    other = next(w.worker_id for w in workers.values() if w.worker_id != answer.worker)
    [line] = continued_lines(router)
    assert f"continued on worker {other}" in line and f"after worker {answer.worker}" in line
    # The reclaimed node's timeline tells it: cut there, continued on the other worker.
    node = node_of(workers, answer.worker)
    continued = coordinator.admin().wait_for("stream_continued", node=node, timeout=10)
    cut = coordinator.admin().wait_for("stream_interrupted", node=node, timeout=10)
    assert continued["reclaim_id"] and continued["reclaim_id"] == cut["reclaim_id"]
    assert (continued["worker_id"], continued["to_worker_id"]) == (answer.worker, other)
    assert continued["request_id"] == cut["request_id"]
    assert 0 < continued["tokens"] < TOKENS and continued["chars"] > continued["tokens"]
    timeline = coordinator.admin().timeline(continued["reclaim_id"])
    assert "stream_continued" in [e.event.kind for e in timeline.events]
    assert "spotdrain_router_streams_continued_total 1\n" in metrics(router)


def test_a_plain_completion_stream_continues_too(scene):
    """/v1/completions: the continuation is the prompt with the text so far appended."""
    agents, workers, router, _ = scene
    answer = pause_mid_stream(agents, workers, router, chat=False)
    assert answer.error is None, answer.error
    assert answer.text == expected_completion(TOKENS) and len(answer.ids) == 1
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (
        len(PROMPT.split()),
        TOKENS,
    )
    assert len(continued_lines(router)) == 1


def test_a_non_streamed_answer_cut_before_its_first_byte_is_sent_again(scene):
    """A non-streamed request is cut with nothing sent to the client: the router sends it to the
    other worker, and the client gets the whole answer once."""
    agents, workers, router, engine = scene
    out: list[Any] = []

    def ask() -> None:
        try:
            out.append(
                client(router).chat.completions.with_raw_response.create(
                    model="fake-model",
                    messages=MESSAGES,
                    max_tokens=TOKENS,
                    extra_headers={"X-Fake-Tokens-Per-S": str(PACE)},
                )
            )
        except BaseException as e:  # noqa: BLE001
            out.append(e)

    t = threading.Thread(target=ask, daemon=True)
    t.start()
    # The fake model logs each request on arrival: pause the node that has it.
    arrived = wait_until(
        lambda: next(
            (n for n, a in agents.items() if "arrived /v1/chat" in _worker_log(engine, workers[n])),
            None,
        ),
        20,
        "the request to reach a worker",
    )
    assert spotctl(agents[arrived], "pause")["ok"] is True
    t.join(60)
    assert out and not isinstance(out[0], BaseException), out
    done = out[0].parse()
    assert done.choices[0].message.content == expected_chat(TOKENS)
    assert out[0].headers["x-worker-id"] != workers[arrived].worker_id


def _worker_log(engine, info) -> str:
    for c in engine.containers.list(all=True):
        if c.labels.get("spotdrain.worker") == info.worker_id:
            return c.logs().decode(errors="replace")
    return ""


def assert_interrupted(answer: Answer) -> None:
    """Today's ending: the SDK raises the interrupted error; the text stops short."""
    assert isinstance(answer.error, openai.APIError), answer.error
    assert answer.error.body["type"] == "interrupted"  # type: ignore[index]
    assert 0 < len(answer.text) < len(expected_chat(TOKENS))
    assert expected_chat(TOKENS).startswith(answer.text)


def test_no_other_worker_ready_falls_back_to_interrupted(scene, coordinator):
    """Node-b is paused first: when node-a's stream is cut no worker can take it within the
    bound, and the client gets the interrupted error, no [DONE]."""
    agents, workers, router, _ = scene
    assert spotctl(agents["node-b"], "pause")["ok"] is True
    wait_state(coordinator, workers["node-b"].worker_id, "draining", 10)
    answer = pause_mid_stream(agents, workers, router)
    assert_interrupted(answer)
    assert "(no_worker)" in router.proc.log()
    assert 'spotdrain_router_continuation_failed_total{reason="no_worker"} 1' in metrics(router)


def test_a_worker_refusing_the_continuation_falls_back_to_interrupted(scene):
    """The other worker answers the continuation 400 (a server without continue_final_message):
    interrupted, as before."""
    agents, workers, router, _ = scene
    answer = pause_mid_stream(agents, workers, router, headers={"X-Fake-Continuation": "refuse"})
    assert_interrupted(answer)
    assert "(refused)" in router.proc.log()


@pytest.mark.parametrize("scene", [["--max-continuations", "1"]], indirect=True)
def test_a_continuation_cut_in_turn_falls_back_with_max_continuations_1(scene):
    """The continuation on node-b is itself cut (node-b paused too) and the one continuation
    allowed is spent: interrupted."""
    agents, workers, router, _ = scene
    began: queue.Queue = queue.Queue()
    out: list[Answer] = []
    answer = Answer()
    t = threading.Thread(
        target=lambda: out.append(stream(router, began, answer=answer)), daemon=True
    )
    t.start()
    first = began.get(timeout=30)
    wait_until(lambda: answer.chunks >= PACE / 2 or answer.error, 30, "half a second of it")
    assert spotctl(agents[node_of(workers, first)], "pause")["ok"] is True
    wait_until(lambda: continued_lines(router), 20, "the continuation")
    other = next(n for n, w in workers.items() if w.worker_id != first)
    assert spotctl(agents[other], "pause")["ok"] is True
    t.join(60)
    assert_interrupted(out[0])
    assert "(cut_again)" in router.proc.log()


@pytest.mark.parametrize("scene", [["--continue-cut-streams", "false"]], indirect=True)
def test_continuation_turned_off_reports_the_cut_interrupted(scene):
    """--continue-cut-streams false: the gate's cut reaches the client as today."""
    agents, workers, router, _ = scene
    answer = pause_mid_stream(agents, workers, router)
    assert_interrupted(answer)
    assert not continued_lines(router)


@pytest.fixture
def crowd(tmp_path, docker_engine, coordinator, gpus, nvml_lib):
    """Four nodes and the router; node-a's worker (64 slots) only, for the test to start the
    other three when its streams are open there."""
    image = ensure_model_image(docker_engine.client)
    agents = {
        n: start_agent(tmp_path, n, coordinator, docker_engine.host, gpus, nvml_lib, OPTIONS)
        for n in ("node-a", "node-b", "node-c", "node-d")
    }
    router = None
    try:
        first = start_worker(coordinator, "node-a", image, slots=64, port=PORT_BASE + 10)
        wait_state(coordinator, first.worker_id, "ready")
        router = start_router(tmp_path / "router", coordinator)
        yield agents, first, router, image, docker_engine.client
    finally:
        if router is not None:
            router.proc.stop()
        for agent in agents.values():
            agent.proc.stop()
        remove_test_containers(docker_engine.client, "spotdrain-w-")


def test_64_streams_on_a_paused_node_all_complete_on_the_3_other_workers(crowd, coordinator):
    """64 long answers stream from node-a when its owner pauses it; three other workers are
    ready by then. Every one completes with its own whole text (no continuation sent twice or
    to the wrong client), and none is continued on node-a's draining worker."""
    agents, first, router, image, engine = crowd
    tokens, pace = 1000, 20.0

    def messages(i: int) -> list[dict[str, str]]:
        return [{"role": "user", "content": f"client {i}: tell me how spot capacity drains"}]

    def expected(i: int) -> str:
        _, seed, _ = continuation_of(render(messages(i), False, True))
        return "".join(_token(seed, k) for k in range(tokens))

    results: dict[int, Answer] = {}

    def one(i: int) -> None:
        answer = Answer()
        try:
            chunks = client(router).chat.completions.create(
                model="fake-model",
                stream=True,
                max_tokens=tokens,
                messages=messages(i),
                extra_headers={"X-Fake-Tokens-Per-S": str(pace)},
            )
            for chunk in chunks:
                answer.ids.add((chunk.id, chunk.created, chunk.model))
                for choice in chunk.choices:
                    answer.text += choice.delta.content or ""
                    answer.finish = choice.finish_reason or answer.finish
        except BaseException as e:  # noqa: BLE001 (the test asserts on it)
            answer.error = e
        results[i] = answer

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(64)]
    for t in threads:
        t.start()
    wait_until(
        lambda: len(re.findall(r"arrived /v1/chat", _worker_log(engine, first))) >= 64,
        30,
        "64 streams on node-a",
    )
    others = [
        start_worker(coordinator, n, image, slots=32, port=PORT_BASE + 11 + k)
        for k, n in enumerate(("node-b", "node-c", "node-d"))
    ]
    for info in others:
        wait_state(coordinator, info.worker_id, "ready")
    assert spotctl(agents["node-a"], "pause")["ok"] is True
    for t in threads:
        t.join(120)
    failed = {i: a.error for i, a in results.items() if a.error is not None}
    assert len(results) == 64 and not failed, list(failed.items())[:3]
    wrong = [i for i, a in results.items() if a.text != expected(i) or len(a.ids) != 1]
    assert not wrong, wrong
    to = re.findall(r"continued on worker (\S+)", router.proc.log())
    assert len(to) == 64 and first.worker_id not in to
    assert set(to) <= {w.worker_id for w in others}
    events = [e for e in coordinator.admin().events() if e["kind"] == "stream_continued"]
    assert len({e["request_id"] for e in events}) == 64, "every seam in node-a's timeline"
