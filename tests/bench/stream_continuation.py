"""The seam a client sees when a stream cut at G is continued on another worker (issue 26).

Two reference model servers (tests/images/fake_model/server.py) run as local processes, each
behind a real slot gate (agent/workloads/slot_gate.py); the reference router's front
(coordinator/router/front.py) serves on loopback with its routing table fed here as the
coordinator's watch would feed it. Each run: a long stream starts on worker A; mid-answer A
leaves the table (as at its drain) and its gate is cut, as at G; the router continues the answer
on B. Timed at the client, which stamps every chunk as it arrives:

- gap: the last chunk from A to the first chunk of the continuation;
- ttft: in the same run, right after, a fresh streamed request to B through the router: from
  sending it to its first chunk with text.

Each run's whole text is checked against one uninterrupted generation. Target: gap p99 <= ttft
p99 + 20 ms.

    .venv/bin/python tests/bench/stream_continuation.py                # 50 runs
    .venv/bin/python tests/bench/stream_continuation.py --runs 10 --pace 100 --json /tmp/s.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

import aiohttp
from aiohttp import web

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from images.fake_model.server import _token, continuation_of, render  # noqa: E402
from spotdrain.agent.workloads.slot_gate import SlotGate  # noqa: E402
from spotdrain.coordinator.router.front import Router  # noqa: E402
from spotdrain.coordinator.router.model_routes import ModelRoutes, Route  # noqa: E402

MODEL = "fake-model"
SERVER = HERE.parent / "images" / "fake_model" / "server.py"
MESSAGES = [{"role": "user", "content": "a long answer, please"}]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def model_server(worker_id: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-u", str(SERVER)],
        env={**os.environ, "PORT": str(port), "WORKER_ID": worker_id, "MODEL": MODEL},
        stdout=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return proc, f"127.0.0.1:{port}"
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"model server {worker_id} did not listen")


class NoCoordinator:
    """The router's replicas, for a table fed by hand: the continuation's report is dropped."""

    async def on_leader(self, *args: object, **kwargs: object) -> None:
        return None

    async def close(self) -> None:
        return None


def watch_of(table: ModelRoutes) -> types.SimpleNamespace:
    async def synced(timeout: float) -> bool:
        return True

    done = asyncio.get_running_loop().create_future()
    done.set_result(None)
    return types.SimpleNamespace(table=table, task=done, problem="", wait_synced=synced)


async def read_stream(resp: aiohttp.ClientResponse) -> list[tuple[float, str]]:
    """(arrival, text) of each chunk with text, stamped as it arrives; raises on an error."""
    out: list[tuple[float, str]] = []
    buf = b""
    async for data in resp.content.iter_any():
        now = time.perf_counter()
        buf += data
        while b"\n\n" in buf:
            event, buf = buf.split(b"\n\n", 1)
            if event.startswith(b"event: error"):
                raise RuntimeError(f"the stream ended with an error: {event!r}")
            if not event.startswith(b"data: {"):
                continue
            for choice in json.loads(event[6:]).get("choices") or []:
                text = (choice.get("delta") or {}).get("content")
                if text:
                    out.append((now, text))
    return out


async def run(args: argparse.Namespace) -> dict:
    servers = {w: model_server(w) for w in ("w-a", "w-b")}
    gate_b = SlotGate("w-b", f"http://{servers['w-b'][1]}", capacity=8)
    await gate_b.start()
    router = Router(NoCoordinator(), attempts=3)  # type: ignore[arg-type]
    await router.start()
    table = ModelRoutes(MODEL)
    router.watches[MODEL] = watch_of(table)  # type: ignore[assignment]
    runner = web.AppRunner(router.app(), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}/v1/chat/completions"
    route_b = Route("w-b", "node-b", gate_b.address, 0, 8)
    _, seed, _ = continuation_of(render(MESSAGES, False, True))
    whole = "".join(_token(seed, i) for i in range(args.tokens))
    body = {"model": MODEL, "messages": MESSAGES, "stream": True, "max_tokens": args.tokens}
    headers = {"X-Fake-Tokens-Per-S": str(args.pace)}
    gaps: list[float] = []
    ttfts: list[float] = []
    version = 0
    started = time.monotonic()
    async with aiohttp.ClientSession() as http:
        # Warm: the router's pooled connection to B's gate, as a serving router's would be.
        table.apply_snapshot(1, [route_b])
        for _ in range(3):
            async with http.post(url, json={**body, "max_tokens": 2}, headers=headers) as resp:
                await read_stream(resp)
        version = 1
        for i in range(args.runs):
            gate_a = SlotGate(f"w-a{i}", f"http://{servers['w-a'][1]}", capacity=8)
            await gate_a.start()
            version += 1
            route_a = Route(f"w-a{i}", "node-a", gate_a.address, 0, 8)
            # A is the less loaded: the stream begins there.
            table.apply_snapshot(version, [route_a, Route("w-b", "node-b", gate_b.address, 8, 8)])
            async with http.post(url, json=body, headers=headers) as resp:
                assert resp.headers["X-Worker-Id"] == route_a.worker_id
                reading = asyncio.ensure_future(read_stream(resp))
                await asyncio.sleep(args.cut_after_s)
                version += 1
                table.apply_change(version, [route_b], [route_a.worker_id])  # A drains
                cut_at = time.perf_counter()
                await gate_a.cut()
                chunks = await reading
            text = "".join(t for _, t in chunks)
            if text != whole:
                raise AssertionError(f"run {i}: the text is not one generation's")
            before = [t for t, _ in chunks if t <= cut_at]
            after = [t for t, _ in chunks if t > cut_at]
            gaps.append((after[0] - before[-1]) * 1000)
            await gate_a.close()
            # The same run, worker B: a fresh request's time to its first token.
            sent = time.perf_counter()
            fresh = {**body, "max_tokens": 4}
            async with http.post(url, json=fresh, headers=headers) as resp:
                first = (await read_stream(resp))[0][0]
            ttfts.append((first - sent) * 1000)
    took = time.monotonic() - started
    await runner.cleanup()
    await router.close()
    await gate_b.close()
    for proc, _ in servers.values():
        proc.terminate()
        proc.wait(5)
    return {
        "runs": args.runs,
        "pace_tokens_per_s": args.pace,
        "gap_ms": summary(gaps),
        "gap_runs_over_50_ms": [i for i, g in enumerate(gaps) if g > 50],
        "ttft_ms": summary(ttfts),
        "target": "gap p99 <= ttft p99 + 20 ms",
        "met": percentile(gaps, 99) <= percentile(ttfts, 99) + 20,
        "router_stats": {
            "streams_continued": router.stats.streams_continued,
            "continuation_failed": router.stats.continuation_failed,
        },
        "wall_s": round(took, 1),
        "env": {"cpus": os.cpu_count(), "python": platform.python_version()},
    }


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    k = (len(ordered) - 1) * p / 100
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def summary(values: list[float]) -> dict[str, float]:
    return {
        "p50": round(percentile(values, 50), 2),
        "p99": round(percentile(values, 99), 2),
        "max": round(max(values), 2),
        "min": round(min(values), 2),
        "mean": round(statistics.fmean(values), 2),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=50)
    ap.add_argument("--tokens", type=int, default=40, help="tokens per long answer")
    ap.add_argument("--pace", type=float, default=100.0, help="the model's tokens per second")
    ap.add_argument("--cut-after-s", type=float, default=0.15, help="the cut, after the start")
    ap.add_argument("--json", help="also write the result here")
    args = ap.parse_args()
    result = asyncio.run(run(args))
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0 if result["met"] else 1


if __name__ == "__main__":
    sys.exit(main())
