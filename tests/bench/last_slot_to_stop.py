"""Benchmark: a draining worker's last slot released -> the stop of its container issued.

Run on demand (pytest does not collect this file; it has no test functions):

    .venv/bin/python tests/bench/last_slot_to_stop.py [--runs 200] [--poll-runs 30]
        [--streams 1] [--json PATH]

docs/design.md "Performance targets": last slot released to stop issued, p99 <= 50 ms, event-driven,
not polled (anchor: Ray Serve polls its replicas every 2 s).

What runs, all on this host:

  upstream   a tiny aiohttp "worker" in its own process (as the model server is its own
             container): /health, and POST /v1/chat/completions streaming OpenAI-style SSE.
             Its last write is one event carrying its time.monotonic_ns() taken just before
             the write, then `data: [DONE]`, in the same write; then the end of the response.
  agent side the real spotdrain.agent.workloads.inference.WorkerManager in this process, with the
  real
             SlotGate it puts in front of each worker, over a stub Docker adapter: starting a
             container returns at once; `kill()` stamps time.monotonic() as its first act and
             makes the container "exit". CLOCK_MONOTONIC is one clock for every process.
  client     aiohttp in this process, through the gate.

One run: a fresh worker is started (WorkerManager.start: health check, gate, report); `--streams`
streamed requests are opened through its gate; once each has its first chunk, the worker is
drained (WorkerManager.drain, as a DrainWorker command or the pause does it) with a grace
deadline a minute away; the streams run out on their own. Timed from the upstream's stamp on
the last stream's final write (`data: [DONE]`) to the stub's kill() being called:

  spotdrain  the real path: the gate releases the last slot and calls on_idle, WorkerManager
             issues the stop from it (no polling anywhere).
  poll-2s    the baseline, the Ray Serve style: the same WorkerManager with its on_idle
             ignored, and a poller task that looks at the worker every 2 s (random phase,
             absolute schedule) and stops it when it is draining with no request in flight.

Breakdown of the spotdrain path: [DONE] written -> the gate released the slot (on_slots with
0 in use) -> WorkerManager stamped stop_issued_at -> the adapter's kill() ran (a task).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: the fakes package

from benchutil import base_environment, print_environment, say, summary, table, verdict  # noqa: E402

from spotdrain.agent.core.reclamation_events import ContainerExited, ContainerSignalled  # noqa: E402
from spotdrain.agent.workloads.inference import WorkerManager  # noqa: E402
from spotdrain.agent.workloads.slot_gate import Interrupted  # noqa: E402

TARGET_P99_MS = 50.0
POLL_S = 2.0
WAIT_S = 10.0
_T_DONE = re.compile(rb'"t_done":(\d+)')


# --- the upstream worker (its own process) -----------------------------------------------------


async def _health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def _chat(request: web.Request) -> web.StreamResponse:
    doc = await request.json()
    tokens = int(doc.get("max_tokens", 5))
    pace = float(doc.get("x_pace_ms", 20)) / 1000
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    for i in range(tokens):
        await response.write(
            b'data: {"object":"chat.completion.chunk","choices":[{"index":0,"delta":'
            b'{"content":"tok%d "}}]}\n\n' % i
        )
        await asyncio.sleep(pace)
    await response.write(b'data: {"t_done":%d}\n\ndata: [DONE]\n\n' % time.monotonic_ns())
    await response.write_eof()
    return response


async def serve_upstream() -> None:
    app = web.Application()
    app.router.add_get("/health", _health)
    app.router.add_post("/v1/chat/completions", _chat)
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    print(runner.addresses[0][1], flush=True)
    await asyncio.Event().wait()


def spawn_upstream() -> tuple[subprocess.Popen[str], int]:
    proc = subprocess.Popen(
        [sys.executable, __file__, "--role", "upstream"], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError("the upstream did not start")
    return proc, int(line)


# --- the agent side: the real WorkerManager over a stub Docker adapter -------------------------


class StubDocker:
    """Stands in for agent/docker_engine.DockerEngine: no engine, kill() is stamped."""

    def __init__(self) -> None:
        self.killed_at: dict[str, float] = {}
        self._exited: dict[str, asyncio.Event] = {}
        self.kills: list[tuple[str, str]] = []

    async def run_container(
        self, image: str, name: str, labels: dict[str, str], env: dict[str, str]
    ) -> tuple[str, str]:
        container_id = uuid.uuid4().hex
        self._exited[container_id] = asyncio.Event()
        return container_id, name

    async def kill(self, container_id: str, name: str, signal: str) -> ContainerSignalled:
        now = time.monotonic()
        self.killed_at.setdefault(container_id, now)
        self.kills.append((container_id, signal))
        self._exited[container_id].set()
        return ContainerSignalled(time.time(), container_id, name, signal, "api")

    async def wait_exit(self, container_id: str, name: str) -> ContainerExited:
        await self._exited[container_id].wait()
        return ContainerExited(time.time(), container_id, name, 0)


class PolledWorkerManager(WorkerManager):
    """The baseline: the gate's on_idle is ignored; a poller decides when to stop."""

    def _idle(self, worker_id: str) -> None:
        return None


async def poller(manager: WorkerManager, worker_id: str) -> None:
    """Ray Serve style: look every POLL_S seconds (random phase, absolute schedule)."""
    loop = asyncio.get_running_loop()
    tick = loop.time() + random.uniform(0, POLL_S)
    while True:
        await asyncio.sleep(max(0.0, tick - loop.time()))
        tick += POLL_S
        worker = manager.workers.get(worker_id)
        if worker is None or worker.stop_issued_at is not None:
            return
        if worker.draining and worker.gate.in_flight == 0:
            manager._stop(worker, "SIGTERM")
            return


@dataclass
class Harness:
    manager: WorkerManager
    docker: StubDocker
    upstream_port: int
    reports: dict[str, dict[str, Any]] = field(default_factory=dict)
    released_at: dict[str, float] = field(default_factory=dict)
    interrupted: list[Interrupted] = field(default_factory=list)
    stopped: dict[str, asyncio.Event] = field(default_factory=dict)


def make_harness(polled: bool, docker: StubDocker, upstream_port: int) -> Harness:
    cls = PolledWorkerManager if polled else WorkerManager
    h: Harness

    def report(worker_id: str, doc: dict[str, Any]) -> None:
        h.reports[worker_id] = doc
        if doc.get("state") == "stopped":
            h.stopped.setdefault(worker_id, asyncio.Event()).set()

    def on_slots(worker_id: str, in_use: int, capacity: int, state: str) -> None:
        if in_use == 0 and state == "draining":
            h.released_at.setdefault(worker_id, time.monotonic())

    manager = cls(
        "bench-node",
        docker,  # type: ignore[arg-type]
        gate_host="127.0.0.1",
        advertise_host="127.0.0.1",
        refuse_start=lambda: None,
        report=report,
        on_slots=on_slots,
        on_interrupted=lambda what, rid: h.interrupted.append(what),
        clock=time.monotonic,
    )
    h = Harness(manager, docker, upstream_port)
    return h


# --- one run ------------------------------------------------------------------------------------


@dataclass
class Sample:
    total_ms: float
    done_to_release_ms: float | None
    release_to_issued_ms: float | None
    issued_to_kill_ms: float | None


async def one_run(h: Harness, session: aiohttp.ClientSession, streams: int, polled: bool) -> Sample:
    worker_id = f"w-bench-{uuid.uuid4().hex[:8]}"
    await h.manager.start(worker_id, "bench-model", "stub", h.upstream_port, 4, 0)
    started = h.reports.get(worker_id, {})
    assert started.get("state") == "started", started
    gate = f"http://{started['gate_address']}"
    worker = h.manager.workers[worker_id]
    poll_task = asyncio.create_task(poller(h.manager, worker_id)) if polled else None

    first_chunk = [asyncio.Event() for _ in range(streams)]

    async def stream(j: int) -> bytes:
        body = {
            "model": "bench-model",
            "stream": True,
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": random.randint(4, 8) + j,
            "x_pace_ms": 20,
        }
        got = b""
        async with session.post(f"{gate}/v1/chat/completions", json=body) as resp:
            assert resp.status == 200, resp.status
            while True:
                piece = await resp.content.readany()
                if not piece:
                    break
                got += piece
                first_chunk[j].set()
        return got

    tasks = [asyncio.create_task(stream(j)) for j in range(streams)]
    async with asyncio.timeout(WAIT_S):
        for ev in first_chunk:
            await ev.wait()
    h.manager.drain(worker_id, grace_deadline=time.monotonic() + 60, reclaim_id="rcl-bench")
    bodies = await asyncio.gather(*tasks)
    t_done = 0.0
    for b in bodies:
        m = _T_DONE.search(b)
        if m is None or not b.rstrip().endswith(b"data: [DONE]"):
            raise RuntimeError(f"a stream did not complete: {b[-200:]!r}")
        t_done = max(t_done, int(m.group(1)) / 1e9)
    async with asyncio.timeout(WAIT_S + (POLL_S if polled else 0)):
        await h.stopped.setdefault(worker_id, asyncio.Event()).wait()
    if poll_task is not None:
        await poll_task
    if h.interrupted:
        raise RuntimeError(f"streams were interrupted: {h.interrupted}")
    killed = h.docker.killed_at[worker.container_id]
    released = h.released_at.get(worker_id)
    issued = worker.stop_issued_at
    return Sample(
        total_ms=(killed - t_done) * 1000,
        done_to_release_ms=None if released is None else (released - t_done) * 1000,
        release_to_issued_ms=(
            None if released is None or issued is None else (issued - released) * 1000
        ),
        issued_to_kill_ms=None if issued is None else (killed - issued) * 1000,
    )


async def scenario(
    name: str, runs: int, streams: int, upstream_port: int
) -> tuple[list[Sample], int]:
    polled = name == "poll-2s"
    docker = StubDocker()
    h = make_harness(polled, docker, upstream_port)
    samples: list[Sample] = []
    connector = aiohttp.TCPConnector(limit=0)
    try:
        async with aiohttp.ClientSession(connector=connector) as session:
            for i in range(runs):
                samples.append(await one_run(h, session, streams, polled))
                if (i + 1) % (10 if polled else 50) == 0 or i + 1 == runs:
                    say(f"  {name}: {i + 1}/{runs} (last {samples[-1].total_ms:.2f} ms)")
                await asyncio.sleep(random.uniform(0.005, 0.020))
    finally:
        await h.manager.close()
    return samples, len(docker.kills)


async def bench(args: argparse.Namespace, upstream_port: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, runs in (("spotdrain", args.runs), ("poll-2s", args.poll_runs)):
        if runs <= 0:
            continue
        say(f"scenario {name}: {runs} runs, {args.streams} stream(s) each")
        samples, kills = await scenario(name, runs, args.streams, upstream_port)
        if kills != runs:
            raise RuntimeError(f"{name}: {kills} stops issued for {runs} workers")
        out[name] = samples
    return out


def report(args: argparse.Namespace, results: dict[str, list[Sample]], env: dict, wall: float):
    stats: dict[str, Any] = {}
    rows = []
    ok = None
    for name in ("spotdrain", "poll-2s"):
        samples = results.get(name)
        if not samples:
            continue
        s = summary([x.total_ms for x in samples])
        stats[name] = s
        if name == "spotdrain":
            ok = s["p99_ms"] <= TARGET_P99_MS
            note = f"p99 <= {TARGET_P99_MS:.0f} ms: {verdict(ok)}"
        else:
            note = f"(baseline: poll every {POLL_S:.0f} s, random phase)"
        rows.append((f"{name}: [DONE] written -> stop issued", s, note))
    phases: dict[str, Any] = {}
    if results.get("spotdrain"):
        sd = results["spotdrain"]
        for label, attr in (
            ("  [DONE] written -> gate released slot", "done_to_release_ms"),
            ("  slot released -> stop_issued_at", "release_to_issued_ms"),
            ("  stop_issued_at -> adapter kill() ran", "issued_to_kill_ms"),
        ):
            values = [getattr(x, attr) for x in sd if getattr(x, attr) is not None]
            phases[attr] = summary(values)
            rows.append((label, phases[attr], "(spotdrain breakdown)"))
    print()
    print_environment(env)
    print(
        f"target: last slot released -> stop issued, p99 <= {TARGET_P99_MS:.0f} ms, event-driven; "
        f"{args.streams} stream(s) open at the drain"
    )
    print()
    table(rows, width=46)
    ratio = None
    if "spotdrain" in stats and "poll-2s" in stats:
        ratio = stats["poll-2s"]["p50_ms"] / max(stats["spotdrain"]["p50_ms"], 1e-9)
        print()
        print(
            f"poll-2s p50 / spotdrain p50 = {ratio:.0f}x; "
            f"poll-2s p99 {stats['poll-2s']['p99_ms']:.0f} ms vs "
            f"spotdrain p99 {stats['spotdrain']['p99_ms']:.2f} ms"
        )
    print(f"wall time {wall:.1f} s")
    return {
        "benchmark": "last_slot_to_stop",
        "environment": env,
        "params": {"runs": args.runs, "poll_runs": args.poll_runs, "streams": args.streams},
        "target": {"p99_ms": TARGET_P99_MS, "met": ok},
        "stats": stats,
        "phases": phases,
        "poll_over_spotdrain_p50": ratio,
        "samples_ms": {k: [x.total_ms for x in v] for k, v in results.items()},
        "wall_s": wall,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=200, help="spotdrain runs (default 200)")
    ap.add_argument(
        "--poll-runs", type=int, default=30, help="poll-2s baseline runs (default 30; ~1 s each)"
    )
    ap.add_argument("--streams", type=int, default=1, help="streams open at the drain")
    ap.add_argument("--json", type=Path, metavar="PATH", help="also write the numbers here")
    ap.add_argument("--role", choices=("upstream",), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.role == "upstream":
        asyncio.run(serve_upstream())
        return 0
    if args.runs < 1 or args.poll_runs < 0 or args.streams < 1:
        ap.error("--runs and --streams must be >= 1, --poll-runs >= 0")
    started = time.monotonic()
    upstream, port = spawn_upstream()
    try:
        env = {
            **base_environment(),
            "aiohttp": aiohttp.__version__,
            "upstream": f"aiohttp process pid {upstream.pid} on 127.0.0.1:{port}",
        }
        results = asyncio.run(bench(args, port))
        doc = report(args, results, env, time.monotonic() - started)
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(doc, indent=2) + "\n")
            say(f"wrote {args.json}")
    finally:
        upstream.terminate()
        upstream.wait(10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
