"""Acquirers: replacement capacity asked for from another node group, never raising, never late.

Exec tests run real subprocesses (`sys.executable -c`); webhook tests a real aiohttp server on
port 0. Target choice and the avoidance window are pure and use a fake clock (plain numbers).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp import web

from spotdrain.coordinator.capacity.acquirer import (
    DEFAULT_AVOID_S,
    AcquisitionRequest,
    AvoidanceWindow,
    ExecAcquirer,
    WebhookAcquirer,
    acquirers_from_config,
    avoid_s_from_config,
    choose_target_group,
)

REQ = AcquisitionRequest(
    request_id="acq-n7-1",
    reclaimed_node="n7",
    reclaimed_group="gpu-a",
    target_group="gpu-b",
    gpus=8,
    models=("llama-70b", "whisper"),
    reason="notice",
    deadline=1_800_000_120.0,
)
REQ_DOC = {
    "request_id": "acq-n7-1",
    "reclaimed_node": "n7",
    "reclaimed_group": "gpu-a",
    "target_group": "gpu-b",
    "gpus": 8,
    "models": ["llama-70b", "whisper"],
    "reason": "notice",
    "deadline": 1_800_000_120.0,
}


def py(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def gone(pid: int) -> bool:
    """The process no longer runs (absent, or a zombie waiting for a reaper that is not us)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


# --- exec ---------------------------------------------------------------------------------------


async def test_exec_ok_gets_the_request_on_stdin_and_keeps_its_json_answer() -> None:
    """The buy-capacity script reads the request and answers with what it ordered."""
    script = (
        "import json, sys; req = json.load(sys.stdin); "
        "print(json.dumps({'echo': req, 'ordered': 1}))"
    )
    result = await ExecAcquirer(py(script), timeout_s=10).request(REQ)
    assert (result.request_id, result.ok, result.detail) == ("acq-n7-1", True, "exit 0")
    assert result.response == {"echo": REQ_DOC, "ordered": 1}
    assert 0 < result.duration_s < 10


async def test_exec_non_zero_exit_is_a_failure_with_its_stderr() -> None:
    script = "import sys; sys.stderr.write('quota exceeded in gpu-b\\n'); sys.exit(3)"
    result = await ExecAcquirer(py(script), timeout_s=10).request(REQ)
    assert (result.ok, result.detail, result.response) == (
        False,
        "exit 3: quota exceeded in gpu-b",
        None,
    )


async def test_exec_garbage_on_stdout_is_still_ok_when_it_exits_0() -> None:
    """Exit 0 is the contract; an unreadable answer is noted, not held against it."""
    result = await ExecAcquirer(py("print('ordered!! <html>')"), timeout_s=10).request(REQ)
    assert (result.ok, result.detail, result.response) == (
        True,
        "exit 0; answer is not JSON, ignored",
        None,
    )


async def test_exec_that_hangs_is_killed_with_its_children_at_the_timeout(tmp_path: Path) -> None:
    """A script that hangs, having spawned a helper: both are gone soon after the timeout."""
    pids = tmp_path / "pids"
    script = (
        "import os, subprocess, sys, time; "
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
        f"open({str(pids)!r}, 'w').write(f'{{os.getpid()}} {{child.pid}}'); "
        "time.sleep(60)"
    )
    timeout_s = 1.0
    started = time.monotonic()
    result = await ExecAcquirer(py(script), timeout_s=timeout_s).request(REQ)
    elapsed = time.monotonic() - started
    assert result.ok is False
    assert result.detail == "timed out after 1 s; process group killed"
    assert elapsed < timeout_s + 1.0
    assert result.duration_s == pytest.approx(elapsed, abs=0.1)
    parent, child = (int(p) for p in pids.read_text().split())
    for _ in range(50):  # SIGKILL is delivered at once, the kernel reaps a moment later
        if gone(parent) and gone(child):
            break
        await asyncio.sleep(0.02)
    assert gone(parent) and gone(child)


async def test_exec_cancelled_by_the_caller_leaves_nothing_running(tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    script = (
        f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(60)"
    )
    task = asyncio.create_task(ExecAcquirer(py(script), timeout_s=30).request(REQ))
    for _ in range(200):
        if pid_file.exists() and pid_file.read_text():
            break
        await asyncio.sleep(0.02)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    pid = int(pid_file.read_text())
    for _ in range(50):
        if gone(pid):
            break
        await asyncio.sleep(0.02)
    assert gone(pid)


async def test_exec_missing_program_is_a_failure_not_an_exception(tmp_path: Path) -> None:
    result = await ExecAcquirer([str(tmp_path / "no-such-buyer")], timeout_s=5).request(REQ)
    assert result.ok is False
    assert result.detail.startswith(f"cannot run {tmp_path / 'no-such-buyer'}:")


# --- webhook ------------------------------------------------------------------------------------


@pytest.fixture
async def capacity_api() -> AsyncIterator[tuple[str, list[tuple[dict, dict]]]]:
    """A capacity API on port 0: /ok answers 201 with JSON, /broken 500, /slow never in time."""
    seen: list[tuple[dict, dict]] = []

    async def ok(request: web.Request) -> web.Response:
        seen.append((await request.json(), dict(request.headers)))
        return web.json_response({"ordered": 2}, status=201)

    async def broken(request: web.Request) -> web.Response:
        return web.Response(status=500, text="capacity backend down")

    async def slow(request: web.Request) -> web.Response:
        await asyncio.sleep(30)
        return web.Response()

    app = web.Application()
    app.router.add_post("/ok", ok)
    app.router.add_post("/broken", broken)
    app.router.add_post("/slow", slow)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    yield f"http://{host}:{port}", seen
    await runner.cleanup()


async def test_webhook_ok_posts_the_request_json(capacity_api) -> None:
    base, seen = capacity_api
    hook = WebhookAcquirer(f"{base}/ok", timeout_s=5, headers={"Authorization": "Bearer t"})
    result = await hook.request(REQ)
    assert (result.ok, result.detail, result.response) == (True, "HTTP 201", {"ordered": 2})
    [(body, headers)] = seen
    assert body == REQ_DOC
    assert headers["Authorization"] == "Bearer t"
    assert headers["Idempotency-Key"] == "acq-n7-1"
    assert "Bearer" not in repr(hook)


async def test_webhook_500_is_a_failure_with_the_body(capacity_api) -> None:
    base, _ = capacity_api
    result = await WebhookAcquirer(f"{base}/broken", timeout_s=5).request(REQ)
    assert (result.ok, result.detail) == (False, "HTTP 500: capacity backend down")


async def test_webhook_that_does_not_answer_times_out_on_time(capacity_api) -> None:
    base, _ = capacity_api
    started = time.monotonic()
    result = await WebhookAcquirer(f"{base}/slow", timeout_s=0.5).request(REQ)
    assert (result.ok, result.detail) == (False, "timed out after 0.5 s")
    assert time.monotonic() - started < 1.5


async def test_webhook_refused_connection_is_a_failure() -> None:
    with socket_bound_port() as port:  # a port nobody listens on
        result = await WebhookAcquirer(f"http://127.0.0.1:{port}/", timeout_s=5).request(REQ)
    assert result.ok is False
    assert result.detail.startswith(f"POST http://127.0.0.1:{port}/: ClientConnectorError")


class socket_bound_port:
    """A port bound but not listening, so a connection to it is refused."""

    def __enter__(self) -> int:
        import socket

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        return self.sock.getsockname()[1]

    def __exit__(self, *exc: object) -> None:
        self.sock.close()


# --- config -------------------------------------------------------------------------------------


def test_config_builds_one_acquirer_per_group() -> None:
    acquirers = acquirers_from_config(
        {
            "groups": {
                "gpu-b": {"exec": ["/usr/local/bin/buy-capacity", "--group", "gpu-b"]},
                "gpu-c": {"webhook": "http://capacity/acquire", "timeout_s": 5},
            }
        }
    )
    b, c = acquirers["gpu-b"], acquirers["gpu-c"]
    assert isinstance(b, ExecAcquirer)
    assert (b.argv, b.timeout_s) == (["/usr/local/bin/buy-capacity", "--group", "gpu-b"], 10.0)
    assert isinstance(c, WebhookAcquirer)
    assert (c.url, c.timeout_s, c.headers) == ("http://capacity/acquire", 5.0, {})
    assert acquirers_from_config({}) == {}


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ({"group": {}}, "acquirers: unknown keys ['group']"),
        ({"groups": []}, "acquirers: groups must be a table"),
        ({"avoid_s": 0}, "acquirers: avoid_s must be positive"),
        ({"groups": {"b": "exec"}}, "group 'b': must be a table"),
        ({"groups": {"b": {"exec": ["x"], "retries": 3}}}, "group 'b': unknown keys ['retries']"),
        (
            {"groups": {"b": {"exec": ["x"], "webhook": "http://h/"}}},
            "group 'b': give exec or webhook, not both",
        ),
        ({"groups": {"b": {"timeout_s": 5}}}, "group 'b': give exec (a command) or webhook"),
        ({"groups": {"b": {"exec": []}}}, "group 'b': exec must be a non-empty list"),
        ({"groups": {"b": {"exec": "buy --now"}}}, "group 'b': exec must be a non-empty list"),
        ({"groups": {"b": {"exec": ["buy", 3]}}}, "group 'b': exec must be strings"),
        ({"groups": {"b": {"exec": [""]}}}, "group 'b': exec must be strings"),
        ({"groups": {"b": {"exec": ["x"], "timeout_s": 0}}}, "timeout_s must be positive"),
        ({"groups": {"b": {"exec": ["x"], "timeout_s": -1}}}, "timeout_s must be positive"),
        ({"groups": {"b": {"exec": ["x"], "timeout_s": float("inf")}}}, "must be positive and"),
        ({"groups": {"b": {"exec": ["x"], "timeout_s": True}}}, "timeout_s must be a number"),
        ({"groups": {"b": {"exec": ["x"], "timeout_s": "5"}}}, "timeout_s must be a number"),
        ({"groups": {"b": {"webhook": "capacity:80"}}}, "group 'b': webhook must be an http://"),
        (
            {"groups": {"b": {"exec": ["x"], "headers": {"A": "b"}}}},
            "group 'b': headers apply to a webhook",
        ),
        (
            {"groups": {"b": {"webhook": "http://h/", "headers": {"A": 1}}}},
            "group 'b': headers must be a table of strings",
        ),
    ],
)
def test_bad_config_is_refused_with_a_clear_message(doc: dict, message: str) -> None:
    with pytest.raises(ValueError) as raised:
        acquirers_from_config(doc)
    assert message in str(raised.value)


def test_avoid_s_from_config() -> None:
    assert avoid_s_from_config({}) == DEFAULT_AVOID_S == 300.0
    assert avoid_s_from_config({"avoid_s": 60}) == 60.0
    with pytest.raises(ValueError, match="avoid_s must be positive"):
        avoid_s_from_config({"avoid_s": -5})


# --- target group and avoidance window ----------------------------------------------------------

GROUPS = ["gpu-a", "gpu-b", "gpu-c"]


@pytest.mark.parametrize(
    ("reclaimed", "avoided", "now", "expected"),
    [
        ("gpu-a", {}, 0, "gpu-b"),  # the first other group, in configured order
        ("gpu-b", {}, 0, "gpu-a"),
        ("gpu-a", {"gpu-b": 100.0}, 50, "gpu-c"),  # gpu-b still avoided
        ("gpu-a", {"gpu-b": 100.0}, 100, "gpu-b"),  # its window has ended
        ("gpu-a", {"gpu-b": 200.0, "gpu-c": 200.0}, 150, None),  # nowhere to ask
        ("gpu-x", {}, 0, "gpu-a"),  # a reclaimed group without acquirer of its own
    ],
)
def test_choose_target_group(reclaimed, avoided, now, expected) -> None:
    assert choose_target_group(reclaimed, GROUPS, avoided, now) == expected


def test_choose_target_group_with_a_single_group_has_nowhere_to_go() -> None:
    assert choose_target_group("gpu-a", ["gpu-a"], {}, 0) is None


def test_avoidance_window_on_a_fake_clock() -> None:
    """gpu-a is reclaimed at t=1000: avoided for 300 s; a second reclaim at t=1200 extends it to
    1500 from the new reclaim; a late report of an older reclaim never shortens it."""
    window = AvoidanceWindow()
    assert window.avoid_s == 300.0
    assert window.is_avoided("gpu-a", 1000) is False
    assert window.avoid("gpu-a", 1000) == 1300
    assert window.is_avoided("gpu-a", 1000) and window.is_avoided("gpu-a", 1299.9)
    assert not window.is_avoided("gpu-a", 1300)
    assert not window.is_avoided("gpu-b", 1000)

    assert window.avoid("gpu-a", 1200) == 1500  # a second reclaim extends from its own time
    assert window.is_avoided("gpu-a", 1400)
    assert window.avoid("gpu-a", 1100) == 1500  # a late, older report never shortens it

    assert choose_target_group("gpu-b", GROUPS, window.active(1400), 1400) == "gpu-c"
    assert window.active(1500) == {}  # ended windows are forgotten
    assert choose_target_group("gpu-b", GROUPS, window.active(1500), 1500) == "gpu-a"


def test_avoidance_window_length_is_configurable() -> None:
    window = AvoidanceWindow(avoid_s=60)
    window.avoid("gpu-a", 0)
    assert window.is_avoided("gpu-a", 59) and not window.is_avoided("gpu-a", 60)
    with pytest.raises(ValueError, match="avoid_s must be positive"):
        AvoidanceWindow(avoid_s=0)


def test_request_json_is_stable() -> None:
    """What a buy-capacity script gets on stdin: every field, models as a list."""
    assert json.loads(REQ.to_json()) == REQ_DOC
    assert os.linesep not in REQ.to_json()
