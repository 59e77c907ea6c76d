"""Real processes for integration tests and the demo: a coordinator, agents over fake GPUs,
and an admin client that reads what the coordinator stored.

Everything here is a real thing a user runs: `spotdrain-coordinator` and `spotdrain-agent` as
subprocesses (so they can be SIGSTOPped and SIGKILLed), gRPC on a free loopback port, SQLite
files or PostgreSQL databases (tests/fakes/pgserver.py), and the real pynvml loading the fake
libnvidia-ml.so.1 through LD_LIBRARY_PATH.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from fakes.fakenvml import FakeGpus
from fakes.pki import CertFiles, Pki
from fakes.waiting import wait_until
from spotdrain.protocol.events import stored_event_to_dict
from spotdrain.v1 import spotdrain_pb2 as pb
from spotdrain.v1 import spotdrain_pb2_grpc as pb_grpc

BIN = Path(sys.executable).parent


class Proc:
    def __init__(self, name: str, argv: list[str], log_path: Path, env: dict[str, str]):
        self.name = name
        self.argv = argv
        self.log_path = log_path
        self._log = open(log_path, "ab")  # noqa: SIM115 (kept open for the process's life)
        self.popen = subprocess.Popen(
            argv, stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, **env}
        )

    @property
    def pid(self) -> int:
        return self.popen.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def signal(self, sig: int) -> None:
        if self.popen.poll() is None:
            os.kill(self.popen.pid, sig)

    def kill(self) -> None:
        """SIGKILL: the process gets no chance to clean up (restart-safety tests)."""
        self.signal(signal.SIGKILL)
        self.popen.wait(10)

    def stop(self, timeout: float = 10.0) -> int | None:
        if self.popen.poll() is None:
            self.signal(signal.SIGCONT)  # a SIGSTOPped process cannot act on SIGTERM
            self.signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        self._log.close()
        return self.popen.returncode


@dataclass
class Coordinator:
    proc: Proc
    address: str
    db: Path | str  # --db as given: a SQLite path, or a sqlite:/// or postgresql:// URL
    tls: Pki | None
    operator: CertFiles | None = None

    def channel(self, identity: CertFiles | None = None) -> grpc.Channel:
        if self.tls is None:
            return grpc.insecure_channel(self.address)
        who = identity or self.operator
        assert who is not None
        creds = grpc.ssl_channel_credentials(
            Path(who.ca).read_bytes(), Path(who.key).read_bytes(), Path(who.cert).read_bytes()
        )
        return grpc.secure_channel(self.address, creds)

    def admin(self) -> Admin:
        return Admin(pb_grpc.AdminStub(self.channel()))

    def cli_args(self) -> list[str]:
        if self.tls is None:
            return ["--coordinator", self.address, "--insecure"]
        assert self.operator is not None
        return [
            "--coordinator",
            self.address,
            "--tls-cert",
            self.operator.cert,
            "--tls-key",
            self.operator.key,
            "--ca",
            self.operator.ca,
        ]


def start_coordinator(
    work: Path,
    tls: Pki | None = None,
    db: Path | str | None = None,
    port: int = 0,
    extra: tuple[str, ...] = (),
) -> Coordinator:
    """db: a SQLite file (default <work>/coordinator.sqlite) or a URL (`sqlite:///PATH`,
    `postgresql://...`), passed to --db unchanged."""
    work.mkdir(parents=True, exist_ok=True)
    db = db or work / "coordinator.sqlite"
    argv = [
        str(BIN / "spotdrain-coordinator"),
        "--listen",
        f"127.0.0.1:{port}",
        "--db",
        str(db),
        *extra,
    ]
    operator = None
    if tls is None:
        argv.append("--insecure")
    else:
        server = tls.issue("coordinator", server=True)
        operator = tls.issue("operator:tests")
        argv += ["--tls-cert", server.cert, "--tls-key", server.key, "--client-ca", server.ca]
    log_path = work / f"coordinator-{int(time.time() * 1000)}.log"
    proc = Proc("coordinator", argv, log_path, {"PYTHONUNBUFFERED": "1"})
    match = wait_until(
        lambda: re.search(r"listening on (\S+)", proc.log()) or _died(proc),
        20,
        "the coordinator to listen",
    )
    return Coordinator(proc, match.group(1), db, tls, operator)


def _died(proc: Proc) -> None:
    if proc.popen.poll() is not None:
        raise RuntimeError(f"{proc.name} exited {proc.popen.returncode}:\n{proc.log()}")


@dataclass
class Agent:
    proc: Proc
    node_id: str
    state_dir: Path
    notice_file: Path
    deadline_file: Path
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    status_root: Path = Path()  # <status_root>/<container name>: a container's status dir

    def outbox_left(self) -> int:
        """Events the agent made that the coordinator has not acknowledged."""
        conn = sqlite3.connect(self.state_dir / "outbox.sqlite")
        try:
            return conn.execute("SELECT count(*) FROM outbox").fetchone()[0]
        finally:
            conn.close()

    def status_dir(self, container_name: str) -> Path:
        """Made as the agent makes it for the containers it starts (a test starting its own
        container bind-mounts this at SPOTDRAIN_STATUS_DIR)."""
        from spotdrain.agent.workloads.status_dirs import make_status_dir  # noqa: PLC0415

        return make_status_dir(self.status_root, container_name)

    def write_notice(self, doc: dict[str, Any] | bytes) -> None:
        """Atomically, by rename, as a relay does."""
        data = doc if isinstance(doc, bytes) else json.dumps(doc).encode()
        tmp = self.notice_file.with_name(".notice.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, self.notice_file)

    @property
    def socket(self) -> Path:
        return Path(self.argv[self.argv.index("--socket") + 1])

    def restart(self) -> None:
        self.proc = Proc(self.node_id, self.argv, self.log_path, self.env)


@dataclass
class AgentOptions:
    grace_s: float = 3.0
    overrun_s: float = 1.0
    default_notice_s: float = 8.0
    taint_answer_s: float = 0.8
    observe_every_s: float = 0.2
    docker_call_timeout_s: float = 2.0
    nvml_timeout_s: float = 2.0
    socket: Path | None = None  # default: <work>/<node>/agent.sock
    extra: list[str] = field(default_factory=list)


def start_agent(
    work: Path,
    node_id: str,
    coordinator: Coordinator,
    docker_host: str,
    gpus: FakeGpus,
    nvml_lib: Path,
    options: AgentOptions | None = None,
    identity: CertFiles | None = None,
) -> Agent:
    opts = options or AgentOptions()
    base = work / node_id
    state_dir, notice_dir = base / "state", base / "run"
    notice_dir.mkdir(parents=True, exist_ok=True)
    notice_file = notice_dir / "notice.json"
    deadline_file = base / "workload" / "deadline.json"
    status_root = base / "status"
    argv = [
        str(BIN / "spotdrain-agent"),
        "--coordinator",
        coordinator.address,
        "--node-id",
        node_id,
        "--notice-file",
        str(notice_file),
        # The file alone: a test machine's DMI or system bus must not turn other sources on.
        "--sources",
        "file",
        "--state-dir",
        str(state_dir),
        "--docker-host",
        docker_host,
        "--deadline-file",
        str(deadline_file),
        "--status-dir",
        str(status_root),
        "--grace-s",
        str(opts.grace_s),
        "--overrun-s",
        str(opts.overrun_s),
        "--default-notice-s",
        str(opts.default_notice_s),
        "--taint-answer-s",
        str(opts.taint_answer_s),
        "--observe-every-s",
        str(opts.observe_every_s),
        "--docker-call-timeout-s",
        str(opts.docker_call_timeout_s),
        "--nvml-timeout-s",
        str(opts.nvml_timeout_s),
        "--log-level",
        "DEBUG",
        "--socket",
        str(opts.socket or base / "agent.sock"),
        "--gate-host",
        "127.0.0.1",
        "--advertise-host",
        "127.0.0.1",
        *opts.extra,
    ]
    if coordinator.tls is None:
        argv.append("--insecure")
    else:
        ident = identity or coordinator.tls.issue(f"node:{node_id}")
        argv += ["--tls-cert", ident.cert, "--tls-key", ident.key, "--ca", ident.ca]
    env = {**gpus.env(nvml_lib), "PYTHONUNBUFFERED": "1"}
    log_path = base / "agent.log"
    base.mkdir(parents=True, exist_ok=True)
    agent = Agent(
        Proc(node_id, argv, log_path, env),
        node_id,
        state_dir,
        notice_file,
        deadline_file,
        argv,
        env,
        log_path,
        status_root,
    )
    wait_until(
        lambda: "agent up" in agent.proc.log() or _died(agent.proc), 20, f"agent {node_id} to start"
    )
    return agent


class Admin:
    """What the coordinator stored, through its admin API."""

    def __init__(self, stub: pb_grpc.AdminStub) -> None:
        self.stub = stub

    def events(self, node: str | None = None, reclaim_id: str | None = None) -> list[dict]:
        out = []
        for stored in self.stub.WatchEvents(pb.WatchEventsRequest(from_id=0), timeout=10):
            ev = stored_event_to_dict(stored)
            if node is not None and ev["node"] != node:
                continue
            if reclaim_id is not None and ev["reclaim_id"] != reclaim_id:
                continue
            out.append(ev)
        return out

    def kinds(self, node: str | None = None) -> list[str]:
        return [e["kind"] for e in self.events(node)]

    def wait_for(
        self, kind: str, node: str | None = None, timeout: float = 20.0, **match: Any
    ) -> dict:
        def find() -> dict | None:
            for ev in self.events(node):
                if ev["kind"] == kind and all(ev.get(k) == v for k, v in match.items()):
                    return ev
            return None

        return wait_until(find, timeout, f"event {kind} {match} on {node or 'any node'}", 0.1)

    def timeline(self, reclaim_id: str = "") -> pb.Timeline:
        return self.stub.GetTimeline(pb.GetTimelineRequest(reclaim_id=reclaim_id), timeout=10)

    def nodes(self) -> list[pb.Node]:
        return list(self.stub.ListNodes(pb.ListNodesRequest(), timeout=10).nodes)


@dataclass
class Router:
    proc: Proc
    url: str  # http://HOST:PORT


def start_router(work: Path, coordinator: Coordinator, *flags: str) -> Router:
    """The reference router as a process, with a `router:` identity and any extra flags."""
    work.mkdir(parents=True, exist_ok=True)
    argv = [
        str(BIN / "spotdrain-router"),
        "--listen",
        "127.0.0.1:0",
        "--coordinator",
        coordinator.address,
        *flags,
    ]
    if coordinator.tls is None:
        argv.append("--insecure")
    else:
        who = coordinator.tls.issue("router:tests")
        argv += ["--tls-cert", who.cert, "--tls-key", who.key, "--ca", who.ca]
    proc = Proc("router", argv, work / "router.log", {"PYTHONUNBUFFERED": "1"})
    match = wait_until(
        lambda: re.search(r"spotdrain-router: listening on (\S+)", proc.log()) or _died(proc),
        20,
        "the router to listen",
    )
    return Router(proc, f"http://{match.group(1)}")
