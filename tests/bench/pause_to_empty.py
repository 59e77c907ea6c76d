"""Benchmark: the owner pauses a node serving short streamed requests -> node verified empty.

Run on demand (pytest does not collect this file; it has no test functions):

    .venv/bin/python tests/bench/pause_to_empty.py [--runs 10] [--clients 3] [--tokens 10]
        [--tokens-per-s 10] [--json PATH] [--keep]

docs/design.md "Performance targets": pause with short requests (<= 1 s) to node verified empty,
<= 3 s (anchor: "finishes in seconds"). Needs root and a Docker engine, or `dockerd` to start
a private one (tests/setup.sh installs it), and the fake model image (built on first use from
the cached Debian root, tests/images/fake_model). Everything it starts it removes again.

What runs: a real Docker engine, a real `spotdrain-coordinator` (mutual TLS, tests/fakes/pki.py), a
real `spotdrain-agent` on fake NVML (one GPU) with `--pause-notice-s 120` (D = pause + 120 s,
G = D - 10 s), and the fake model server as the node's one inference worker, placed with
Admin.StartWorker (4 slots) and reached at its slot gate. `--clients` threads send streamed
chat completions back to back at the gate, each `--tokens` tokens at `--tokens-per-s` (default
10 at 10/s: about 1 s each), so requests are in flight at a random phase when the owner pauses.

One run: traffic flows for a random 1-2 s, then `spotctl --socket S pause --json` (a
subprocess, as the owner runs it). Timed from just before spotctl is started to the wall time
of the agent's `verified_empty` event (also shown: to `drained`, and from the agent's own T0,
which leaves spotctl's start-up out). Clients that get 503 (the gate draining) stop until the
next run. Breakdown, from the event log (agent and coordinator stamps, this host's clock), the
agent's DEBUG log (stop issued; log stamps have 1 ms resolution) and the clients:

  pause -> T0            spotctl start-up and the unix socket round trip (notice_received)
  T0 -> tainted          the remote Taint call (the coordinator drains and unroutes the worker)
  tainted -> gate draining   the agent's worker_draining event
  pause -> last stream done  the last request in flight at the pause got its [DONE]
  last stream -> stop issued the gate's last slot released -> "stopping worker ... (SIGTERM)"
  stop issued -> container exited  the fake server's SIGTERM handling and Docker's exit
  container exited -> verified_empty  the observation (Docker lists nothing, NVML no process)

Between runs (not timed): `spotctl resume`; the coordinator places the paused worker again
(placement path "resume"); the run waits for it to be ready, removes the old container, and
starts the traffic again against the new gate.
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import docker  # noqa: E402
import docker.errors  # noqa: E402
from benchutil import base_environment, print_environment, say, summary, table, verdict  # noqa: E402

from fakes.dockerenv import ensure_engine  # noqa: E402
from fakes.fakenvml import FakeGpus, build  # noqa: E402
from fakes.harness import BIN, AgentOptions, start_agent, start_coordinator  # noqa: E402
from fakes.pki import Pki  # noqa: E402
from fakes.waiting import wait_until  # noqa: E402
from images.fake_model import ensure_model_image  # noqa: E402
from spotdrain.v1 import spotdrain_pb2 as pb  # noqa: E402
from spotdrain.v1 import spotdrain_pb2_grpc as pb_grpc  # noqa: E402

TARGET_S = 3.0
MODEL = "fake-model"
DRAINED_WAIT_S = 60.0
_LOG_STOP = re.compile(
    r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) \S+ \w+ node \S+: stopping worker (\S+) \((\w+)\)"
)
_LOG_IDLE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) \S+ \w+ gate (\S+): idle while")


def log_time(stamp: str) -> float:
    """An agent log stamp (logging's asctime: local time, milliseconds) as epoch seconds."""
    return datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()


# --- traffic ------------------------------------------------------------------------------------


@dataclass
class Request:
    client: int
    run: int
    started: float
    ended: float = 0.0
    status: int = 0
    done: bool = False  # saw data: [DONE]
    interrupted: bool = False  # saw the gate's interrupted error event
    error: str = ""


@dataclass
class Traffic:
    """`clients` threads streaming chat completions back to back at the current gate."""

    clients: int
    tokens: int
    tokens_per_s: float
    address: str = ""
    run: int = -1
    requests: list[Request] = field(default_factory=list)
    _on: threading.Event = field(default_factory=threading.Event)
    _stop: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _threads: list[threading.Thread] = field(default_factory=list)

    def start_threads(self) -> None:
        for i in range(self.clients):
            t = threading.Thread(target=self._client, args=(i,), name=f"client-{i}", daemon=True)
            t.start()
            self._threads.append(t)

    def go(self, address: str, run: int) -> None:
        self.address, self.run = address, run
        self._on.set()

    def hold(self) -> None:
        self._on.clear()

    def close(self) -> None:
        self._stop.set()
        self._on.set()
        for t in self._threads:
            t.join(30)

    def of_run(self, run: int) -> list[Request]:
        with self._lock:
            return [r for r in self.requests if r.run == run]

    def _client(self, index: int) -> None:
        body = json.dumps(
            {
                "model": MODEL,
                "stream": True,
                "max_tokens": self.tokens,
                "messages": [{"role": "user", "content": "hi"}],
            }
        ).encode()
        while not self._stop.is_set():
            self._on.wait()
            if self._stop.is_set():
                return
            run, address = self.run, self.address
            req = Request(index, run, time.time())
            with self._lock:
                self.requests.append(req)
            host, port = address.rsplit(":", 1)
            conn = http.client.HTTPConnection(host, int(port), timeout=30)
            try:
                conn.request(
                    "POST",
                    "/v1/chat/completions",
                    body=body,
                    headers={
                        "Content-Type": "application/json",
                        "X-Fake-Tokens-Per-S": str(self.tokens_per_s),
                        "X-Request-Id": f"bench-{run}-{index}-{uuid.uuid4().hex[:6]}",
                    },
                )
                resp = conn.getresponse()
                req.status = resp.status
                if resp.status != 200:
                    resp.read()
                else:
                    for raw in resp:
                        line = raw.strip()
                        if line == b"data: [DONE]":
                            req.done = True
                        elif line.startswith(b"event: error"):
                            req.interrupted = True
            except (OSError, http.client.HTTPException) as e:
                req.error = f"{type(e).__name__}: {e}"
            finally:
                req.ended = time.time()
                conn.close()
            if req.status != 200:
                # Refused (503 while draining) or broken: wait for the next run's traffic.
                if self.run == run:
                    self._on.clear()
                while not self._stop.is_set() and self.run == run:
                    time.sleep(0.01)


# --- the node -----------------------------------------------------------------------------------


class Node:
    def __init__(self, work: Path, engine: Any, args: argparse.Namespace) -> None:
        self.engine = engine
        self.node_id = f"bench-pause-{uuid.uuid4().hex[:6]}"
        self.pki = Pki(work / "pki")
        self.coord = start_coordinator(work / "coordinator", tls=self.pki)
        self.agent = None
        lib = build(work / "nvml")
        gpus = FakeGpus(work / "gpus.state")
        gpus.set(gpus=1)
        options = AgentOptions(
            grace_s=10.0,
            overrun_s=2.0,
            observe_every_s=0.2,
            extra=["--pause-notice-s", str(args.pause_notice_s)],
        )
        self.agent = start_agent(work, self.node_id, self.coord, engine.host, gpus, lib, options)
        self.admin = self.coord.admin()
        self.stub = pb_grpc.AdminStub(self.coord.channel())
        wait_until(
            lambda: any(n.node_id == self.node_id and n.connected for n in self.admin.nodes()),
            20,
            f"{self.node_id} to register",
        )

    def spotctl(self, command: str) -> dict[str, Any]:
        run = subprocess.run(
            [str(BIN / "spotctl"), "--socket", str(self.agent.socket), command, "--json"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        if run.returncode != 0 or not run.stdout:
            raise RuntimeError(f"spotctl {command} failed ({run.returncode}): {run.stderr}")
        return json.loads(run.stdout)

    def worker(self, worker_id: str) -> pb.WorkerInfo | None:
        workers = self.stub.ListWorkers(pb.ListWorkersRequest(node_id=self.node_id), timeout=10)
        return next((w for w in workers.workers if w.worker_id == worker_id), None)

    def wait_ready(self, worker_id: str, timeout: float = 120) -> pb.WorkerInfo:
        def ready() -> pb.WorkerInfo | None:
            w = self.worker(worker_id)
            if w is not None and w.state == "stopped":
                raise RuntimeError(f"worker {worker_id} stopped before it was ready")
            return w if w is not None and w.state == "ready" else None

        return wait_until(ready, timeout, f"worker {worker_id} ready", every=0.1)

    def remove_exited(self) -> None:
        client = self.engine.client
        for c in client.containers.list(
            all=True, filters={"label": f"spotdrain.node={self.node_id}", "status": "exited"}
        ):
            try:
                client.api.remove_container(c.id, force=True)
            except docker.errors.NotFound:
                pass

    def stop_issued(self, worker_id: str) -> tuple[float | None, float | None]:
        """(gate idle, stop issued) for the worker, from the agent's log."""
        idle = stop = None
        for line in self.agent.log_path.read_text(errors="replace").splitlines():
            m = _LOG_STOP.match(line)
            if m and m.group(2) == worker_id and stop is None:
                stop = log_time(m.group(1))
            m = _LOG_IDLE.match(line)
            if m and m.group(2) == worker_id and idle is None:
                idle = log_time(m.group(1))
        return idle, stop

    def close(self) -> None:
        if self.agent is not None:
            self.agent.proc.stop()
        self.coord.proc.stop()
        client = self.engine.client
        for c in client.containers.list(
            all=True, filters={"label": f"spotdrain.node={self.node_id}"}
        ):
            try:
                client.api.remove_container(c.id, force=True)
            except docker.errors.NotFound:
                pass


# --- one run ------------------------------------------------------------------------------------


@dataclass
class RunResult:
    run: int
    worker_id: str
    reclaim_id: str
    pause_to_verified_s: float
    pause_to_drained_s: float
    t0_to_verified_s: float
    steps_s: dict[str, float | None]  # offsets from the pause
    in_flight: int  # requests open at the pause
    completed: int  # of those, ended with [DONE]
    interrupted: int
    refused: int  # 503 after the pause
    errors: list[str]


def first(events: list[dict], kind: str, **match: Any) -> dict | None:
    for ev in events:
        if ev["kind"] == kind and all(ev.get(k) == v for k, v in match.items()):
            return ev
    return None


def one_run(node: Node, traffic: Traffic, run: int, worker_id: str) -> RunResult:
    time.sleep(random.uniform(1.0, 2.0))  # traffic flows; requests at a random phase
    t_pause = time.time()
    answer = node.spotctl("pause")
    t_answered = time.time()
    rid = answer.get("reclaim_id")
    if not answer.get("ok") or not rid:
        raise RuntimeError(f"spotctl pause: {answer}")
    node.admin.wait_for("drained", node=node.node_id, timeout=DRAINED_WAIT_S, reclaim_id=rid)
    wait_until(
        lambda: (w := node.worker(worker_id)) is not None and w.state == "stopped",
        30,
        f"worker {worker_id} stopped at the coordinator",
    )
    events = node.admin.events(node=node.node_id)
    ours = [e for e in events if e["reclaim_id"] == rid]
    t0 = first(ours, "notice_received")
    verified = first(ours, "verified_empty")
    drained = first(ours, "drained")
    assert t0 and verified and drained, [e["kind"] for e in ours]
    tainted = first(ours, "tainted")
    draining = first(ours, "worker_draining")
    exited = first(ours, "container_exited")
    coord_draining = first(events, "worker_draining", worker_id=worker_id)
    coord_stopped = first(events, "worker_stopped", worker_id=worker_id)
    idle, stop = node.stop_issued(worker_id)

    reqs = traffic.of_run(run)
    open_at_pause = [r for r in reqs if r.started < t_pause and (r.ended == 0 or r.ended > t_pause)]
    served = [r for r in open_at_pause if r.status == 200]
    last_done = max((r.ended for r in served), default=None)
    refused = [r for r in reqs if r.started >= t_pause and r.status == 503]
    errors = [f"client {r.client}: {r.error or r.status}" for r in reqs if r.error]
    errors += [
        f"client {r.client}: status {r.status}"
        for r in reqs
        if r.status not in (200, 503) and not r.error
    ]

    def off(t: float | None) -> float | None:
        return None if t is None else t - t_pause

    steps = {
        "spotctl returned": off(t_answered),
        "T0 (notice_received)": off(t0["wall_time"]),
        "tainted": off(tainted["wall_time"]) if tainted else None,
        "coordinator: worker_draining": off(coord_draining["wall_time"])
        if coord_draining
        else None,
        "agent: worker_draining": off(draining["wall_time"]) if draining else None,
        "last stream done (client)": off(last_done),
        "gate idle (log)": off(idle),
        "stop issued (log)": off(stop),
        "container_exited": off(exited["wall_time"]) if exited else None,
        "verified_empty": off(verified["wall_time"]),
        "drained": off(drained["wall_time"]),
        "coordinator: worker_stopped": off(coord_stopped["wall_time"]) if coord_stopped else None,
    }
    return RunResult(
        run=run,
        worker_id=worker_id,
        reclaim_id=rid,
        pause_to_verified_s=verified["wall_time"] - t_pause,
        pause_to_drained_s=drained["wall_time"] - t_pause,
        t0_to_verified_s=verified["wall_time"] - t0["wall_time"],
        steps_s=steps,
        in_flight=len(open_at_pause),
        completed=sum(1 for r in served if r.done and not r.interrupted),
        interrupted=sum(1 for r in reqs if r.interrupted),
        refused=len(refused),
        errors=errors,
    )


def resume_and_replace(node: Node, old_worker: str, after_id: int) -> str:
    """spotctl resume; the coordinator places the paused worker again. Its id, once ready."""
    answer = node.spotctl("resume")
    if not answer.get("ok") or answer.get("paused"):
        raise RuntimeError(f"spotctl resume: {answer}")

    def placed() -> str | None:
        for ev in node.admin.events(node=node.node_id):
            if (
                ev["id"] > after_id
                and ev["kind"] == "worker_starting"
                and ev.get("path") == "resume"
                and ev.get("worker_id") != old_worker
            ):
                return ev["worker_id"]
        return None

    new = wait_until(placed, 30, "the paused worker placed again", every=0.1)
    node.wait_ready(new)
    return new


# --- report -------------------------------------------------------------------------------------


def report(args: argparse.Namespace, results: list[RunResult], env: dict, wall: float) -> dict:
    ms = {
        "pause -> verified_empty": [r.pause_to_verified_s * 1000 for r in results],
        "pause -> drained": [r.pause_to_drained_s * 1000 for r in results],
        "agent T0 -> verified_empty": [r.t0_to_verified_s * 1000 for r in results],
    }
    stats = {k: summary(v) for k, v in ms.items()}
    ok = stats["pause -> verified_empty"]["p99_ms"] <= TARGET_S * 1000
    worst_ok = stats["pause -> verified_empty"]["max_ms"] <= TARGET_S * 1000
    print()
    print_environment(env)
    print(
        f"target: pause with short requests (<= 1 s) -> node verified empty, <= {TARGET_S:.0f} s; "
        f"{args.clients} clients, {args.tokens} tokens at {args.tokens_per_s:g}/s per request"
    )
    print()
    table(
        [
            (
                "pause -> verified_empty",
                stats["pause -> verified_empty"],
                f"p99 <= {TARGET_S * 1000:.0f} ms: {verdict(ok)}; every run: {verdict(worst_ok)}",
            ),
            ("pause -> drained", stats["pause -> drained"], ""),
            ("agent T0 -> verified_empty", stats["agent T0 -> verified_empty"], "(no spotctl)"),
        ],
        width=32,
    )
    print()
    print("every run, seconds from the pause (spotctl started):")
    names = list(results[0].steps_s) if results else []
    short = {
        "spotctl returned": "ctl",
        "T0 (notice_received)": "T0",
        "tainted": "taint",
        "coordinator: worker_draining": "c.drn",
        "agent: worker_draining": "a.drn",
        "last stream done (client)": "last",
        "gate idle (log)": "idle",
        "stop issued (log)": "stop",
        "container_exited": "exit",
        "verified_empty": "empty",
        "drained": "drnd",
        "coordinator: worker_stopped": "c.stp",
    }
    print(f"{'run':>4}" + "".join(f"{short[n]:>7}" for n in names) + "   open done cut 503")
    for r in results:
        cells = "".join(f"{v:>7.3f}" if v is not None else f"{'-':>7}" for v in r.steps_s.values())
        print(
            f"{r.run:>4}{cells}   {r.in_flight:>4} {r.completed:>4} {r.interrupted:>3} "
            f"{r.refused:>3}"
        )
    print("  " + "; ".join(f"{v} = {k}" for k, v in short.items()))
    phases = {}
    pairs = [
        ("pause -> T0 (spotctl)", None, "T0 (notice_received)"),
        ("T0 -> tainted", "T0 (notice_received)", "tainted"),
        ("tainted -> agent worker_draining", "tainted", "agent: worker_draining"),
        ("pause -> last stream done", None, "last stream done (client)"),
        ("last stream done -> stop issued", "last stream done (client)", "stop issued (log)"),
        ("stop issued -> container_exited", "stop issued (log)", "container_exited"),
        ("container_exited -> verified_empty", "container_exited", "verified_empty"),
    ]
    for label, a, b in pairs:
        values = []
        for r in results:
            va = 0.0 if a is None else r.steps_s.get(a)
            vb = r.steps_s.get(b)
            if va is not None and vb is not None:
                values.append((vb - va) * 1000)
        phases[label] = summary(values)
    print()
    table([(k, v, "") for k, v in phases.items()], width=38)
    problems = [e for r in results for e in r.errors]
    cut = sum(r.interrupted for r in results)
    lost = sum(r.in_flight - r.completed for r in results)
    print()
    print(
        f"requests in flight at the pause: {sum(r.in_flight for r in results)}, completed with "
        f"[DONE]: {sum(r.completed for r in results)}, interrupted: {cut}, not completed: {lost}; "
        f"client errors: {len(problems)}" + (f" ({problems[:3]})" if problems else "")
    )
    print(f"wall time {wall:.1f} s")
    return {
        "benchmark": "pause_to_empty",
        "environment": env,
        "params": {
            "runs": args.runs,
            "clients": args.clients,
            "tokens": args.tokens,
            "tokens_per_s": args.tokens_per_s,
            "pause_notice_s": args.pause_notice_s,
        },
        "target": {"pause_to_verified_empty_s": TARGET_S, "met_p99": ok, "met_every_run": worst_ok},
        "stats": stats,
        "phases": phases,
        "runs": [r.__dict__ for r in results],
        "wall_s": wall,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=10, help="pauses (default 10)")
    ap.add_argument("--clients", type=int, default=3, help="concurrent clients (default 3)")
    ap.add_argument("--tokens", type=int, default=10, help="tokens per request (default 10)")
    ap.add_argument("--tokens-per-s", type=float, default=10.0, help="(default 10)")
    ap.add_argument("--pause-notice-s", type=float, default=120.0, help="agent flag (default 120)")
    ap.add_argument("--json", type=Path, metavar="PATH", help="also write the numbers here")
    ap.add_argument("--keep", action="store_true", help="keep the work dir (logs) afterwards")
    args = ap.parse_args(argv)
    if args.runs < 1 or args.clients < 1 or args.clients > 4:
        ap.error("--runs must be >= 1 and --clients 1..4 (the worker has 4 slots)")
    started = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="sdbench-pause-", dir="/tmp"))
    engine = node = traffic = None
    results: list[RunResult] = []
    try:
        say(f"work dir {work}")
        engine = ensure_engine(work / "docker")
        image = ensure_model_image(engine.client)
        version, info = engine.client.version(), engine.client.info()
        env = {
            **base_environment(),
            "docker_engine": version.get("Version"),
            "storage_driver": info.get("Driver"),
            "engine": "private dockerd (started by this run)" if engine.owned else engine.host,
            "transport": "mutual TLS (tests/fakes/pki.py)",
        }
        node = Node(work, engine, args)
        say(f"node {node.node_id}, agent log {node.agent.log_path}")
        info0 = node.stub.StartWorker(
            pb.StartWorkerRequest(node_id=node.node_id, model=MODEL, image=image, slots=4),
            timeout=30,
        )
        worker = node.wait_ready(info0.worker_id)
        traffic = Traffic(args.clients, args.tokens, args.tokens_per_s)
        traffic.start_threads()
        for run in range(args.runs):
            traffic.go(worker.gate_address, run)
            result = one_run(node, traffic, run, worker.worker_id)
            results.append(result)
            say(
                f"  run {run + 1}/{args.runs}: pause -> verified_empty "
                f"{result.pause_to_verified_s * 1000:.0f} ms (T0 -> "
                f"{result.t0_to_verified_s * 1000:.0f} ms), {result.in_flight} in flight"
            )
            traffic.hold()
            last_id = max(e["id"] for e in node.admin.events(node=node.node_id))
            if run + 1 < args.runs:
                new_id = resume_and_replace(node, worker.worker_id, last_id)
                node.remove_exited()
                worker = node.wait_ready(new_id)
        wall = time.monotonic() - started
        doc = report(args, results, env, wall)
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(doc, indent=2) + "\n")
            say(f"wrote {args.json}")
        return 0
    finally:
        if traffic is not None:
            traffic.close()
        if node is not None:
            node.close()
        if engine is not None:
            engine.stop(remove_work_dir=True)
        if args.keep:
            say(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
